"""The agent's native engine: a round's packets sent, received and matched by
``homagg/native/agent_loop.c`` with the GIL released, under the Python engine's rules.

``Round.run`` hands a round to ``NativeLink.drive`` where the transport chose the native engine
(``choose``). The C loop runs the round's common path: new chunks as the slots free up, in runs
(sendmmsg, UDP GSO), results in batches (recvmmsg, UDP GRO) matched and written in place, the
timeout's estimate and RACK's state, and the wake-up time of every timer. It returns to Python
for what the protocol decides: a datagram off the common path (``Round.take``: statuses,
refusals, strays), a timer that is due (``LossRecovery.retransmit``: timeouts, RACK, probes)
and the deadline. So loss recovery, the status and refusal rules and every error message are
the Python engine's own, written once; the C loop is ``Round``'s send_new, receive, take_run,
``rto`` and ``wake_at``, and tests hold both engines to the same sums and counters.

The Python engine runs instead, and says why, where the native one cannot: the library is not
built (or ``HOMAGG_PURE_PYTHON`` is set), faults are injected at the agent's socket (only the
Python socket injects them), or the congestion control or a fixed rate paces the sends (their
window and pacing are Python's). A join is always Python's: one packet.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import TYPE_CHECKING

import numpy as np

from homagg import native as native_lib
from homagg import udpio, wire
from homagg.faults import ImpairedSocket
from homagg.host_agent.config import AgentConfig, AgentError
from homagg.host_agent.engine import results
from homagg.host_agent.engine.loss import HELD_PROBES, PROBE_SAMPLES, PROBES
from homagg.host_agent.engine.rto import MIN_EPOCH
from homagg.netconfig import ip_int

if TYPE_CHECKING:
    from homagg.host_agent.engine.round import Round
    from homagg.host_agent.engine.transport import Transport

log = logging.getLogger("homagg.agent")

#: what ``AgentConfig.engine`` may ask for: "auto" is native where it can run
ENGINES = ("auto", "native", "python")
DONE, DUE, ODD, ERROR, WAIT_ERROR = 0, 1, 2, 3, 4  # ha_round_run's answers (agent_loop.c)

_i64, _u64, _dbl, _ptr = ctypes.c_int64, ctypes.c_uint64, ctypes.c_double, ctypes.c_void_p


class _Round(ctypes.Structure):
    """agent_loop.c's ha_round, field for field (the library's ha_round_bytes checks the
    size at load)."""

    _fields_ = (
        [(n, _i64) for n in ("fd", "switch_ip", "switch_port", "psize", "k", "nchunks",
                              "slots", "seq0", "auth")]
        + [(n, _u64) for n in ("mask", "expect", "ovf_mask", "expect2")]
        + [("split", _i64)]
        + [(n, _ptr) for n in ("buf", "out", "done", "resent", "held", "sent_at", "rto",
                                "rbuf")]
        + [("has_srtt", _i64), ("samples", _i64)]
        + [(n, _dbl) for n in ("srtt", "rttvar", "cur_rto", "min_rto", "max_rto", "min_cur",
                                "min_prev", "rack_ts", "rack_rtt", "last_progress",
                                "last_new")]
        + [(n, _i64) for n in ("rack_c", "nprobes", "probe_c", "lossy", "probes",
                                "probe_samples", "held_probes", "held_max", "min_n",
                                "min_epoch", "next_c", "ndone", "overflow",
                                "packets_sent", "bytes_sent", "results", "ignored",
                                "tail_copies", "send_calls", "sent", "recv_calls",
                                "received", "gso", "odd_at", "odd_len", "err")])


#: the counters the C loop adds to (Counters' names), and the socket's (udpio's names)
_COUNTERS = ("packets_sent", "bytes_sent", "results", "ignored", "tail_copies")
_IO = ("send_calls", "sent", "recv_calls", "received")


def unavailable(cfg: AgentConfig, sock) -> str | None:
    """Why the native engine cannot run this agent's rounds, or None where it can."""
    if isinstance(sock, ImpairedSocket):
        return "faults are injected at this agent's socket (only the Python engine injects them)"
    if cfg.congestion:
        return "the congestion control is on (its window and pacing are the Python engine's)"
    if cfg.rate_pps:
        return "a fixed rate (rate_pps) paces the sends (the Python engine's pacing)"
    lib = native_lib.load()
    if lib is None:
        return f"the native data path is off: {native_lib.why()}"
    if lib.ha_round_bytes() != ctypes.sizeof(_Round):
        return (f"the native library's round ({lib.ha_round_bytes()} bytes) is not this "
                f"homagg's ({ctypes.sizeof(_Round)}): rebuild it (./run.sh setup)")
    return None


def choose(cfg: AgentConfig, sock) -> str:
    """The engine an agent runs: "native" or "python" (``AgentConfig.engine``). Asked for by
    name, the native engine is an error where it cannot run."""
    if cfg.engine == "python":
        return "python"
    why = unavailable(cfg, sock)
    if why is None:
        return "native"
    if cfg.engine == "native":
        raise AgentError(f"{cfg.who}: the native engine was asked for, but {why}")
    log.debug("%s: the Python engine runs: %s", cfg.who, why)
    return "python"


class NativeLink:
    """One transport's native engine: the C loop's context (its receive batch) and the round
    state it shares with Python."""

    def __init__(self, t: Transport):
        lib = native_lib.load()
        assert lib is not None
        self.lib, self.t = lib, t
        self.ctx = lib.ha_new()
        if not self.ctx:
            raise MemoryError("the native engine's context")
        self.results = 0  # results the C loop took itself (the rest were Python's)
        self._switch: tuple[str, int] | None = None  # (the switch's address, as an int)
        self._switch_ip = 0
        self.st = _Round()
        self.ref = ctypes.byref(self.st)
        # the transport's receive buffer: its batches land there, and Round.take reads the odd
        # datagram from there (t.rview)
        assert len(t.rbuf) >= 16 * udpio.RECV_BYTES  # agent_loop.c's HA_BATCH runs of 64 KiB
        self._rbuf: ctypes.Array | None = (ctypes.c_char * len(t.rbuf)).from_buffer(t.rbuf)
        self.st.rbuf = ctypes.addressof(self._rbuf)

    def close(self) -> None:
        if self.ctx:
            self.lib.ha_free(self.ctx)
            self.ctx = None
        self.st.rbuf = None
        self._rbuf = None  # (releases the bytearray's export)

    @staticmethod
    def serves(sock) -> bool:
        """Whether the C loop may run a round on ``sock``: the transport's own socket, not one
        a caller wrapped since (a test's instrumented socket sees only Python's sends)."""
        return type(sock) is udpio.BatchSocket

    def pack(self, flat: np.ndarray, k: int, nchunks: int, g0: int, slots: int,
             head: bytes, out: np.ndarray | None = None) -> np.ndarray:
        """``packets.pack``'s packets (not a join's), built in one pass (``ha_pack``), in
        ``out`` where given (``nchunks`` packets of ``wire.packet_dtype(k)``, contiguous)."""
        batch = np.empty(nchunks, wire.packet_dtype(k)) if out is None else out
        assert batch.size == nchunks and batch.flags.c_contiguous
        flat = np.ascontiguousarray(flat, np.int32)
        self.lib.ha_pack(batch.ctypes.data, flat.ctypes.data, flat.size, k, nchunks, g0, slots,
                         head)
        return batch

    def drive(self, r: Round) -> None:
        """Run round ``r`` until every chunk's result is in; raises as ``Round.run`` does."""
        t, st, lib, ctx = self.t, self.st, self.lib, self.ctx
        st.fd = t.sock.fileno()
        if self._switch != t.switch:
            self._switch, self._switch_ip = t.switch, ip_int(t.switch[0])
        st.switch_ip = self._switch_ip
        st.switch_port = t.switch[1]
        st.psize, st.k, st.nchunks, st.slots = r.psize, r.k, r.nchunks, r.cfg.slots
        st.seq0, st.auth = r.seq0, r.cfg.key
        st.mask, st.expect, st.ovf_mask = int(results.MASK), int(r.h8_plain), \
            int(results.OVERFLOW)
        st.split, st.expect2 = r.split, int(r.h8_second)
        st.buf, st.out = r.batch.ctypes.data, r.out.ctypes.data
        st.done, st.resent, st.held = r.done.ctypes.data, r.resent.ctypes.data, \
            r.held.ctypes.data
        st.sent_at, st.rto = r.sent_at.ctypes.data, r.rto.ctypes.data
        st.probes, st.probe_samples, st.held_max = PROBES, PROBE_SAMPLES, HELD_PROBES
        st.min_epoch = MIN_EPOCH
        lib.ha_reset(ctx, self.ref)
        while True:
            self.push(r)
            code = lib.ha_round_run(ctx, self.ref)
            self.pull(r)
            if code == DONE:
                return
            if code == ODD:
                r.take(t.rview[st.odd_at:st.odd_at + st.odd_len])
                continue
            if code == ERROR:
                t.broken = os.strerror(st.err)
                raise AgentError(f"{t.who}: cannot send to the switch {t.switch[0]}:"
                                 f"{t.switch[1]}: {os.strerror(st.err)}")
            if code == WAIT_ERROR:
                t.broken = os.strerror(st.err)
                raise AgentError(f"{t.who}: cannot wait for the switch's results: "
                                 f"{os.strerror(st.err)}")
            now = time.monotonic()
            pending = r.retransmit(r.in_flight(), now)
            r.give_up_if_silent(pending, now)

    def push(self, r: Round) -> None:
        """The round's scalars (and the estimate's) into the C loop's state."""
        st, rtt = self.st, self.t.rtt
        st.has_srtt = rtt.srtt is not None
        st.srtt = rtt.srtt or 0.0
        st.rttvar, st.samples, st.cur_rto = rtt.rttvar, rtt.samples, rtt.rto
        st.min_rto, st.max_rto = rtt.min_rto, rtt.max_rto
        st.min_cur, st.min_prev, st.min_n = rtt.min_cur, rtt.min_prev, rtt.min_n
        st.rack_ts, st.rack_rtt, st.rack_c = r.rack_ts, r.rack_rtt, r.rack_c
        st.last_progress, st.last_new = r.last_progress, r.last_new
        st.nprobes, st.probe_c, st.lossy = r.nprobes, r.probe_c, r.lossy()
        st.held_probes = r.held_probes
        st.next_c, st.ndone, st.overflow = r.next_c, r.ndone, r.overflow
        st.gso = getattr(self.t.sock, "gso", True)

    def pull(self, r: Round) -> None:
        """The C loop's state back into the round, its counters added to the agent's and the
        socket's."""
        st, t = self.st, self.t
        rtt = t.rtt
        rtt.srtt = st.srtt if st.has_srtt else None
        rtt.rttvar, rtt.samples, rtt.rto = st.rttvar, st.samples, st.cur_rto
        rtt.min_cur, rtt.min_prev, rtt.min_n = st.min_cur, st.min_prev, st.min_n
        r.rack_ts, r.rack_rtt, r.rack_c = st.rack_ts, st.rack_rtt, st.rack_c
        r.last_progress, r.last_new = st.last_progress, st.last_new
        r.nprobes, r.probe_c, r.held_probes = st.nprobes, st.probe_c, st.held_probes
        r.next_c, r.ndone, r.overflow = st.next_c, st.ndone, bool(st.overflow)
        c = t.counters
        self.results += st.results
        for name in _COUNTERS:
            setattr(c, name, getattr(c, name) + getattr(st, name))
            setattr(st, name, 0)
        sock = t.sock
        if isinstance(sock, udpio.BatchSocket):
            sock.gso = bool(st.gso)
            for name in _IO:
                setattr(sock, name, getattr(sock, name) + getattr(st, name))
        for name in _IO:
            setattr(st, name, 0)
        if r.status:  # (a status of a chunk whose result the loop took)
            for chunk in [ch for ch in r.status if r.done[ch]]:
                del r.status[chunk]
