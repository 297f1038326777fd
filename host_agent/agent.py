"""The host agent: a reliable, packetized all-reduce through the switch's slot pool.

    agent = Agent(AgentConfig(job=1, worker=0, workers=4, switch=("10.0.0.254", 48864),
                              bind=("10.0.0.1", 50000), slots=64))
    total = agent.allreduce(grad)          # fp32 in, fp32 out: the exact sum of quantized values

Per tensor (DESIGN.md section 1): one OR round carrying the job's scale negotiation (a one-hot
exponent per worker: the OR gives the max) and the non-zero bitmap; then the values, as the
byte count decides (``codec.choose_mode``): dense, on the union, or sketch + residual. Every
round streams K-word chunks through the job's S slots: chunk g (numbered across the agent's
life, identically on every worker) goes to slot g % S, copy (g // S) % 2, with round tag g + 1;
chunk g is sent once chunk g - S (same slot) has come back. Lost packets are resent after a
timeout with backoff; the switch answers a duplicate with the finished result or a status that
names the contributors, so a dead peer is named in the error, after ``deadline`` seconds of no
progress. An overflow flagged by the switch makes every worker (they all see the same flag)
redo the value rounds with a smaller scale: never a wrapped sum.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from homagg import wire
from homagg.errors import HomaggError
from homagg.faults import FaultSpec, ImpairedSocket
from homagg.host_agent import codec

log = logging.getLogger("homagg.agent")

K = wire.WORDS_PER_PACKET
#: Scale negotiation: worker's max exponent e (frexp) as bit e + EXP_BIAS of EXP_WORDS words.
EXP_BIAS = 160
EXP_WORDS = 10  # 320 bits: fp32 exponents run from -148 to 128
_HDR = struct.Struct("!BBHBBHI")


class AgentError(HomaggError):
    """The all-reduce cannot complete; the message says who and what."""


class AggregationTimeout(AgentError):
    pass


class _Overflow(Exception):
    pass


@dataclass(frozen=True)
class AgentConfig:
    job: int
    worker: int
    workers: int
    switch: tuple[str, int] = ("10.0.0.254", wire.HOMAGG_UDP_PORT_MIN)
    bind: tuple[str, int] = ("0.0.0.0", 50000)
    slots: int = 64              # the job's slot region (controller: job 'slots')
    seed: int | None = None      # sketch hash seed; default: the job id
    timeout: float = 0.05        # initial retransmission timeout (s); then measured RTTs
    min_timeout: float = 0.02    # floor of the measured timeout: a window's last chunks queue
                                 # behind its first, so one RTT sample understates the rest
    max_timeout: float = 0.1     # backoff cap: losses here are random, not congestion, and a
                                 # round waits for its slowest chunk (10% loss: 37 s -> 9 s)
    backoff: float = 2.0
    deadline: float = 10.0       # no progress for this long: AggregationTimeout
    rate_pps: float | None = None  # pacing (bmv2 drops bursts); None: window-limited only
    mode: str = "auto"           # auto | dense | union | sketch
    headroom: int = codec.DEFAULT_HEADROOM
    max_rescales: int = 6
    # Fault injection, for tests and demos: loss/duplication/reordering at this agent's socket
    # (where the kernel has no netem), and a scale finer than negotiated by this many bits
    # (forces the switch's overflow flag; every worker of the job must use the same value).
    faults: FaultSpec | None = None
    shift_bias: int = 0

    def __post_init__(self):
        if not 0 <= self.worker < self.workers <= wire.MAX_WORKERS:
            raise AgentError(f"worker {self.worker} of {self.workers}: need 0 <= worker < "
                             f"workers <= {wire.MAX_WORKERS}")
        if not 1 <= self.slots <= wire.SLOTS:
            raise AgentError(f"slots {self.slots}: 1 to {wire.SLOTS}")
        if self.mode not in ("auto",) + codec.MODES:
            raise AgentError(f"mode {self.mode!r}: auto, dense, union or sketch")


@dataclass
class Counters:
    packets_sent: int = 0
    bytes_sent: int = 0
    retransmissions: int = 0
    results: int = 0
    ignored: int = 0          # late duplicates, foreign or malformed datagrams
    rounds: int = 0
    rescales: int = 0
    seconds: float = 0.0


@dataclass
class Result:
    """One all-reduce: the float sum, and the exact integers behind it."""

    out: np.ndarray
    shift: int
    mode: str
    n: int
    union_words: np.ndarray | None  # ORed non-zero bitmap the values are on (None: dense)
    values: np.ndarray         # exact integer sums, per union rank (union: the switch's int32
                               # words; sketch: int64), or dense int64
    wire_bytes: int            # homagg payload bytes this worker sent (retransmissions too)
    rounds: dict = field(default_factory=dict)
    _union: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def union(self) -> np.ndarray | None:
        """Positions the values are on (None: dense), listed on first use only."""
        if self.union_words is None:
            return None
        if self._union is None:
            self._union = codec.union_indices(self.union_words, self.n)
        return self._union

    def ints(self) -> np.ndarray:
        """The exact integer sum as a dense int64 array."""
        if self.union_words is None:
            return self.values.astype(np.int64)
        full = np.zeros(self.n, np.int64)
        full[self.union] = self.values
        return full


class Agent:
    def __init__(self, config: AgentConfig):
        self.cfg = config
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        try:
            self.sock.bind(config.bind)
        except OSError as e:
            self.sock.close()
            raise AgentError(f"job {config.job} worker {config.worker}: cannot bind "
                             f"{config.bind[0]}:{config.bind[1]}: {e}") from None
        self.sock.setblocking(False)
        if config.faults is not None and config.faults.active:
            self.sock = ImpairedSocket(self.sock, config.faults)
        self.switch = (socket.gethostbyname(config.switch[0]), config.switch[1])
        self.seed = config.job if config.seed is None else config.seed
        self.counters = Counters()
        self._chunk = 0        # next global chunk number (identical on every worker)
        self._broken: str | None = None
        self._rbuf = bytearray(2048)
        self._last_mode: dict = {}
        # Retransmission timeout from measured round trips (RFC 6298, Karn: samples only from
        # chunks sent once). A fixed timeout resends half of everything on a queueing bmv2.
        self._srtt: float | None = None
        self._rttvar = 0.0
        self._rto = config.timeout

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the streaming engine ----------------------------------------------------------------
    def _who(self) -> str:
        return f"job {self.cfg.job} worker {self.cfg.worker}"

    def stream(self, op: int, words: np.ndarray) -> np.ndarray:
        """Aggregate ``words`` (int32, or uint32 bit sets for OR) with every worker's; returns
        int32. Raises _Overflow if the switch flagged an int32 overflow (after completing)."""
        if self._broken:
            raise AgentError(f"{self._who()}: agent unusable after an earlier failure "
                             f"({self._broken}); reset the job and start a new agent")
        cfg = self.cfg
        n = words.size
        nchunks = max(1, -(-n // K))
        g0 = self._chunk
        S = cfg.slots
        g = g0 + np.arange(nchunks, dtype=np.int64)
        batch = np.zeros(nchunks, wire.PACKET_DTYPE)
        batch["version_op"] = (wire.HOMAGG_VERSION << 4) | op
        batch["flags"] = np.where((g // S) % 2 == 1, wire.FLAG_PHASE, 0)
        batch["job"] = cfg.job
        batch["worker"] = cfg.worker
        batch["slot"] = g % S
        batch["seq"] = (g + 1) & 0xFFFFFFFF
        padded = np.zeros(nchunks * K, np.int32)  # zero is neutral for ADD and OR
        padded[:n] = words.view(np.int32) if words.dtype == np.uint32 else words
        batch["words"] = padded.reshape(nchunks, K)  # (a reshape of the field would copy)
        buf = memoryview(batch.tobytes())
        P = wire.PACKET_BYTES

        out = np.zeros(nchunks * K, np.int32)
        done = np.zeros(nchunks, bool)
        sent_at = np.full(nchunks, np.inf)
        rto = np.full(nchunks, self._rto)
        resent = np.zeros(nchunks, bool)
        overflow = False
        ndone = 0
        next_c = 0
        sock, dst, rbuf = self.sock, self.switch, self._rbuf
        interval = 1.0 / cfg.rate_pps if cfg.rate_pps else 0.0
        next_send = time.monotonic()
        last_progress = time.monotonic()
        status: dict[int, tuple[int, int]] = {}
        c_ = self.counters
        t_start = time.monotonic()
        seq0 = (g0 + 1) & 0xFFFFFFFF

        def send(c: int) -> None:
            nonlocal next_send
            try:
                sock.sendto(buf[c * P:(c + 1) * P], dst)
            except BlockingIOError:
                return  # socket buffer full: the timeout resends it
            except OSError as e:
                self._broken = str(e)
                raise AgentError(f"{self._who()}: cannot send to the switch {dst[0]}:{dst[1]}: "
                                 f"{e}") from None
            c_.packets_sent += 1
            c_.bytes_sent += P
            if interval:
                next_send = max(next_send + interval, time.monotonic() - 4 * interval)

        while ndone < nchunks:
            now = time.monotonic()
            # 1. new chunks, as the window (slot reuse) and pacing allow
            while next_c < nchunks and (next_c < S or done[next_c - S]) and now >= next_send:
                send(next_c)
                sent_at[next_c] = now
                next_c += 1
                if interval:
                    break
            # 2. results
            lo = max(0, next_c - S) if next_c else 0
            pending = np.flatnonzero(~done[lo:next_c]) + lo
            wake = min(float((sent_at[pending] + rto[pending]).min()) if pending.size else now + 0.05,
                       next_send if (interval and next_c < nchunks) else now + 0.05)
            r, _, _ = select.select([sock], [], [], max(0.0, wake - time.monotonic()))
            while r:
                try:
                    nb, src = sock.recvfrom_into(rbuf)
                except BlockingIOError:
                    break
                if (nb != P or src[0] != dst[0]
                        or not wire.HOMAGG_UDP_PORT_MIN <= src[1] <= wire.HOMAGG_UDP_PORT_MAX):
                    c_.ignored += 1
                    continue
                vo, flags, job, _w, _r, slot, seq = _HDR.unpack_from(rbuf)
                c = (seq - seq0) & 0xFFFFFFFF
                if job != self.cfg.job or not flags & wire.FLAG_RESULT or c >= nchunks:
                    c_.ignored += 1
                    continue
                if flags & wire.FLAG_STATUS:
                    w = np.frombuffer(rbuf, ">u4", 3, wire.HOMAGG_HDR_BYTES + 4 * wire.STATUS_WORD)
                    # The switch holds our contribution; the round waits for peers, so only
                    # a lost result could need us again: resend after the longest timeout.
                    # Not progress: the deadline still runs.
                    status[int(c)] = ((int(w[0]) << 32) | int(w[1]), int(w[2]))
                    sent_at[c] = time.monotonic()
                    rto[c] = cfg.max_timeout
                    continue
                if done[c]:
                    c_.ignored += 1
                    continue
                out[c * K:(c + 1) * K] = np.frombuffer(rbuf, ">i4", K, wire.HOMAGG_HDR_BYTES)
                done[c] = True
                ndone += 1
                if not resent[c]:
                    self._rtt_sample(time.monotonic() - sent_at[c])
                    rto[next_c:] = self._rto
                c_.results += 1
                overflow |= bool(flags & wire.FLAG_OVERFLOW)
                last_progress = time.monotonic()
                status.pop(int(c), None)
            # 3. retransmissions of overdue chunks, with backoff
            now = time.monotonic()
            if pending.size:
                pending = pending[~done[pending]]
                due = pending[sent_at[pending] + rto[pending] <= now]
                for c in due:
                    send(int(c))
                    sent_at[c] = now
                    rto[c] = min(rto[c] * cfg.backoff, cfg.max_timeout)
                    resent[c] = True
                    c_.retransmissions += 1
            if now - last_progress > cfg.deadline:
                self._chunk = g0 + nchunks
                self._broken = "timeout"
                raise self._timeout(pending, g0, status)
        self._chunk = g0 + nchunks
        c_.rounds += 1
        c_.seconds += time.monotonic() - t_start
        if overflow:
            raise _Overflow()
        return out[:n]

    def _rtt_sample(self, rtt: float) -> None:
        if self._srtt is None:
            self._srtt, self._rttvar = rtt, rtt / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - rtt)
            self._srtt = 0.875 * self._srtt + 0.125 * rtt
        self._rto = min(max(self._srtt + 4 * self._rttvar, self.cfg.min_timeout),
                        self.cfg.max_timeout)

    def _timeout(self, pending, g0, status) -> AggregationTimeout:
        S, W = self.cfg.slots, self.cfg.workers
        c = int(pending[0]) if len(pending) else 0
        slot = (g0 + c) % S
        msg = (f"{self._who()}: no result for slot {slot} (round tag {(g0 + c + 1) & 0xFFFFFFFF}"
               f", {len(pending)} chunk(s) outstanding) in {self.cfg.deadline:.1f} s; ")
        st = status.get(c) or (next(iter(status.values())) if status else None)
        if st is None:
            msg += (f"the switch {self.switch[0]}:{self.switch[1]} did not answer at all: is it "
                    f"up, and is this worker's address installed in job {self.cfg.job}?")
        else:
            seen, count = st
            missing = [w for w in range(W) if not seen >> w & 1]
            msg += (f"the switch holds {count} of {W} contributions; waiting for worker(s) "
                    f"{', '.join(map(str, missing))} (dead, or stuck in another round)")
        return AggregationTimeout(msg)

    # -- all-reduce ----------------------------------------------------------------------------
    def allreduce_int(self, q: np.ndarray) -> np.ndarray:
        """Dense int32 sum, bit for bit; AgentError if the switch flags an overflow."""
        q = np.ascontiguousarray(q, np.int32).reshape(-1)
        try:
            return self.stream(wire.OP_ADD, q)
        except _Overflow:
            raise AgentError(f"{self._who()}: int32 overflow in the sum") from None

    def allreduce(self, x: np.ndarray, key=None) -> np.ndarray:
        """The sum over workers of ``x`` (float), exact on the quantized values."""
        return self.allreduce_detailed(x, key).out.reshape(np.shape(x))

    def allreduce_detailed(self, x: np.ndarray, key=None) -> Result:
        cfg = self.cfg
        x = np.asarray(x)
        if not np.issubdtype(x.dtype, np.floating):
            raise AgentError(f"{self._who()}: allreduce wants floats, got {x.dtype} "
                             "(use allreduce_int for integers)")
        out_dtype = x.dtype
        flat = x.reshape(-1)
        n = flat.size
        before = self.counters.bytes_sent
        try:
            scan = codec.Scan.of(flat)
            e = scan.max_exponent()
        except codec.CodecError as err:
            # Every worker must still take part in the round, or its peers hang: say so loudly.
            raise AgentError(f"{self._who()}: {err}; this worker stops, and its peers will "
                             "time out on this tensor") from None
        onehot = np.zeros(EXP_WORDS, np.uint32)
        if e is not None:
            b = e + EXP_BIAS
            onehot[b // 32] = np.uint32(1 << (31 - b % 32))

        mode = cfg.mode
        if mode == "auto" and key is not None and self._last_mode.get(key) == "dense":
            mode = "dense"  # last time this tensor was dense: skip the bitmap (all agree)
        if mode == "dense":
            agg = self.stream(wire.OP_OR, onehot).view(np.uint32)
            union_words = None
        else:
            agg = self.stream(wire.OP_OR, np.concatenate([onehot, scan.words]))
            agg = agg.view(np.uint32)
            union_words = agg[EXP_WORDS:]
            if mode == "auto":
                mode = codec.choose_mode(n, codec.union_size(union_words, n))
            if mode == "dense":
                union_words = None
        # Only the sketch needs U's positions; union mode works from the bitmap itself.
        union = codec.union_indices(union_words, n) if mode == "sketch" else None
        if key is not None:
            self._last_mode[key] = mode
        e_all = _max_exponent(agg[:EXP_WORDS])
        shift = codec.shift_for(e_all, cfg.workers, cfg.headroom) + cfg.shift_bias
        rounds = {}
        for attempt in range(cfg.max_rescales + 1):
            try:
                values, rounds = self._value_rounds(flat, scan, shift, mode, union_words,
                                                    union)
                break
            except _Overflow:
                self.counters.rescales += 1
                log.info("%s: overflow at shift %d, rescaling", self._who(), shift)
                shift -= 4
            except codec.CodecError as err:  # e.g. a local value out of int32 at this scale
                self._broken = str(err)
                raise AgentError(f"{self._who()}: {err}; peers will time out on this "
                                 "tensor") from None
        else:
            raise AgentError(f"{self._who()}: int32 overflow persists after "
                             f"{cfg.max_rescales} rescales")
        if union_words is None:
            out = np.ldexp(values.astype(np.float64), -shift).astype(out_dtype)
        elif mode == "union":
            out = codec.decode_union(union_words, n, values, shift, out_dtype)
        else:
            out = codec.assemble(n, union, values, shift, out_dtype)
        return Result(out, shift, mode, n, union_words, values,
                      self.counters.bytes_sent - before, rounds, union)

    def _value_rounds(self, flat, scan, shift, mode, union_words, union):
        """Round 2 (and the residual): exact sums, on the union (int32 words from the switch
        in mode union, int64 for the sketch) or dense (int64)."""
        if mode == "dense" or union_words is None:
            q = codec.quantize(flat, shift)
            return self.stream(wire.OP_ADD, q).astype(np.int64), {"dense": q.size}
        s = scan.quantize(shift)
        if mode == "union":  # straight from the bitmap: U is never listed
            words = codec.encode_union(s, union_words)
            return self.stream(wire.OP_ADD, words), {mode: words.size}
        words = codec.encode_values(s, union, mode, self.seed)
        agg = self.stream(wire.OP_ADD, words)
        peeled = codec.decode_values(agg, union, mode, self.seed)
        values, left = peeled.values, peeled.unresolved
        rounds = {mode: words.size}
        if left.size:
            resid = self.stream(wire.OP_ADD, codec.residual_values(s, union[left]))
            values = values.copy()
            values[left] = resid
            rounds["residual"] = left.size
        codec.check_int32(values, mode)
        return values, rounds


def _max_exponent(words: np.ndarray) -> int | None:
    bits = np.unpackbits(words.astype(">u4").view(np.uint8))
    hits = np.flatnonzero(bits)
    return None if hits.size == 0 else int(hits[-1]) - EXP_BIAS
