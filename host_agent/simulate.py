"""The whole all-reduce in memory: W agents, no sockets, the switch's arithmetic. The one simulator.

    from homagg.host_agent import simulate_allreduce
    sim = simulate_allreduce([x0, x1, x2, x3], mode="auto", index="hier", block=256)
    sim.out[0], sim.wire_bytes[0]          # worker 0's float sum, and the bytes it sent
    res = simulate_ints([q0, q1, q2, q3], seed=1, mode="sketch")
    res.total, res.bytes_per_worker        # the int32 sum, bit for bit, and each round's bytes

Each worker is a real ``Agent`` (negotiation, non-finite flag, block scales, index, mode
choice, value rounds, rescale) whose transport is a ``MemoryTransport``: the W agents run in
threads, and each ``stream`` call meets its peers' at a barrier, where the words are combined
as the switch does (``homagg.switch_model.lane_add`` / ``lane_or``, in worker order, an
overflow in any lane flagged to every worker). Outputs are bit-identical to agents over
sockets through the software aggregator, and wire bytes are counted as the UDP transport
counts them (whole packets, no retransmissions).

``simulate_ints`` is the same job on int32 tensors, for the codec's exactness tests: the
agents all-reduce the integers as floats at scale 1 (one block, no split, no rescale), so the
result is their integer sum or ``AggregationOverflow``, never a wrapped one. ``switch_add``
and ``switch_or`` are the switch's combine of one round's contributions, for tests that run
one round by hand.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from homagg import wire
from homagg.host_agent import codec
from homagg.host_agent.allreduce import Agent, Counters, Result, SwitchLink
from homagg.host_agent.codec import AUTO, AggregationOverflow, CodecError, Mode
from homagg.host_agent.config import AgentConfig, AgentError, AggregationTimeout
from homagg.host_agent.engine.transport import SwitchOverflow
from homagg.host_agent.hostreduce import ThreadHost, switch_combine


def switch_add(contribs: list[np.ndarray], round_name: str) -> np.ndarray:
    """int32 words summed as the switch does; AggregationOverflow names the round."""
    acc, over = switch_combine(wire.OP_ADD, contribs)
    if over.any():
        raise AggregationOverflow(round_name, np.flatnonzero(over))
    return acc


def switch_or(contribs: list[np.ndarray]) -> np.ndarray:
    """uint32 words (bitmaps) ORed as the switch does."""
    return switch_combine(wire.OP_OR, contribs)[0].view(np.uint32)


class MemorySwitch:
    """The rendezvous of W in-memory transports: one combined round at a time."""

    def __init__(self, workers: int, deadline: float = 10.0):
        self.workers = workers
        self.barrier = threading.Barrier(workers, timeout=deadline)
        self.inbox: list[tuple[int, np.ndarray, bool] | None] = [None] * workers
        self.result = np.zeros(0, np.int32)
        self.overflow = False
        self.overflow_words = np.zeros(0, np.int64)  # the last flagged round's, for errors
        self.adds = 0  # OP_ADD rounds so far (a job's value rounds come in order)
        self.error: str | None = None

    def _combine(self) -> None:
        got = [c for c in self.inbox if c is not None]
        ops = {op for op, _, _ in got}
        sizes = {w.size for _, w, _ in got}
        self.error = None
        if len(got) != self.workers or len(ops) != 1 or len(sizes) != 1:
            self.error = (f"workers disagree on the round: ops {sorted(ops)}, sizes "
                          f"{sorted(sizes)}")
            return
        op = ops.pop()
        self.adds += op == wire.OP_ADD
        self.result, over = switch_combine(op, [words for _, words, _ in got])
        # (a flagged contribution: a partial sum that overflowed on its way, ``hostreduce``)
        self.overflow = bool(over.any()) or any(flagged for _, _, flagged in got)
        if self.overflow:
            self.overflow_words = np.flatnonzero(over)

    def round(self, worker: int, op: int, words: np.ndarray, flagged: bool = False
              ) -> tuple[np.ndarray, bool, str | None]:
        self.inbox[worker] = (op, words, flagged)
        if self.barrier.wait() == 0:
            self._combine()
        self.barrier.wait()  # every worker reads the result before the next round's combine
        return self.result.copy(), self.overflow, self.error


class MemoryTransport:
    """A ``SwitchLink`` (``allreduce.SwitchLink``) over a ``MemorySwitch``."""

    def __init__(self, switch: MemorySwitch, cfg: AgentConfig, counters: Counters):
        self.memory_switch = switch  # (``switch`` is an address, as the UDP link's)
        self.switch = ("memory", 0)
        self.sock = None
        self.cfg = cfg
        self.counters = counters
        self.who = cfg.who
        self.broken: str | None = None

    def close(self) -> None:
        pass

    def stream(self, op: int, words: np.ndarray, flagged: bool = False) -> np.ndarray:
        out, overflow = self._round(op, words, flagged)
        self.counters.rounds += 1
        if overflow:
            raise SwitchOverflow()
        return out

    def stream_fused(self, op: int, words: np.ndarray, op2: int, words2: np.ndarray,
                     flagged: bool = False) -> tuple[np.ndarray, np.ndarray, bool]:
        """``Transport.stream_fused`` in memory: the two parts combined one after the other,
        counted as one round (one round trip on a network)."""
        out, overflow = self._round(op, words, flagged)
        out2, overflow2 = self._round(op2, words2, flagged)
        self.counters.rounds += 1
        return out, out2, overflow or overflow2

    def _round(self, op: int, words: np.ndarray, flagged: bool = False
               ) -> tuple[np.ndarray, bool]:
        if self.broken:
            raise AgentError(f"{self.who}: agent unusable after an earlier failure "
                             f"({self.broken}); reset the job and start a new agent")
        words = np.ascontiguousarray(words)
        words = words.view(np.int32) if words.dtype == np.uint32 else words.astype(np.int32)
        k = self.cfg.words or wire.WORDS_PER_PACKET
        chunks = max(1, -(-words.size // k))
        self.counters.packets_sent += chunks
        self.counters.bytes_sent += chunks * wire.packet_bytes(k)
        try:
            out, overflow, error = self.memory_switch.round(self.cfg.worker, op, words,
                                                            flagged)
        except threading.BrokenBarrierError:
            self.broken = "timeout"
            raise AggregationTimeout(f"{self.who}: a peer failed or did not take part in "
                                     "the round") from None
        if error:
            self.broken = error
            raise AgentError(f"{self.who}: {error}")
        self.counters.results += chunks
        return out, overflow


@dataclass
class AllreduceSim:
    """``simulate_allreduce``'s outcome: every worker's ``Result``."""

    results: list[Result]

    @property
    def out(self) -> list[np.ndarray]:
        return [r.out for r in self.results]

    @property
    def wire_bytes(self) -> list[int]:
        return [r.wire_bytes for r in self.results]


class MemoryJob:
    """W agents on a ``MemorySwitch``, kept across calls (so ``key`` memory works).

    ``hosts``: the ranks' hosts, as their sizes in rank order (``[8, 8]``: ranks 0-7 on host 0,
    8-15 on host 1): each host reduces locally (``hostreduce.ThreadHost``) and its leader is
    the switch's worker, so the switch has one worker per host. None: a worker per rank."""

    def __init__(self, workers: int, hosts: list[int] | None = None, **options):
        job = options.pop("job", 1)
        sizes = [1] * workers if hosts is None else list(hosts)
        if sum(sizes) != workers or min(sizes, default=0) < 1:
            raise AgentError(f"hosts {sizes}: sizes of at least 1 that add up to the "
                             f"{workers} ranks")
        self.switch = MemorySwitch(len(sizes), options.get("deadline", 10.0))
        self.hosts = [ThreadHost(m) for m in sizes] if hosts is not None else []

        def memory(c: AgentConfig, counters: Counters) -> SwitchLink:
            return MemoryTransport(self.switch, c, counters)

        self.agents = []
        link: Callable[[AgentConfig, Counters], SwitchLink]
        for h, m in enumerate(sizes):
            for r in range(m):
                if hosts is None:
                    cfg, link = AgentConfig(job, h, workers, **options), memory
                else:
                    cfg = AgentConfig(job, h, workers, local_workers=len(sizes), **options)
                    link = self.hosts[h].link(r, memory if r == 0 else None)
                self.agents.append(Agent(cfg, transport=link))

    def allreduce(self, arrays, key=None) -> AllreduceSim:
        if len(arrays) != len(self.agents):
            raise AgentError(f"{len(arrays)} tensors for {len(self.agents)} workers")
        results: list = [None] * len(arrays)
        errors: list = [None] * len(arrays)

        def work(w: int) -> None:
            try:
                results[w] = self.agents[w].allreduce_detailed(arrays[w], key)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[w] = e
                self.switch.barrier.abort()  # its peers stop now, not at the deadline
                for host in self.hosts:
                    host.barrier.abort()

        threads = [threading.Thread(target=work, args=(w,)) for w in range(len(arrays))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [e for e in errors if e is not None]
        if failed:
            raise next((e for e in failed if not isinstance(e, AggregationTimeout)), failed[0])
        return AllreduceSim(results)


def simulate_allreduce(arrays, key=None, hosts: list[int] | None = None,
                       **options) -> AllreduceSim:
    """All-reduce ``arrays`` (one float tensor per worker) in memory; ``options`` are
    ``AgentConfig``'s (mode, index, headroom, block, shift_bias, max_rescales, seed, job...);
    ``hosts``: ``MemoryJob``'s (local reduction per host)."""
    return MemoryJob(len(arrays), hosts, **options).allreduce(arrays, key)


@dataclass
class SimResult:
    """``simulate_ints``'s outcome: the exact int sum and what it cost per worker on the wire."""

    total: np.ndarray  # int32 (the switch's word width); equal to the integer sum
    mode: Mode
    n: int
    u: int             # the union's size (n when dense was asked: no index round)
    m: int = 0         # sketch counters
    unresolved: int = 0  # union elements peeling left to the residual round
    bytes_per_worker: dict[str, int] = field(default_factory=dict)
    index: str | None = None  # "flat" or "hier"; None: dense, no index round

    @property
    def wire_bytes(self) -> int:
        return sum(self.bytes_per_worker.values())

    @property
    def dense_bytes(self) -> int:
        return 4 * self.n

    @property
    def ratio(self) -> float:
        """Wire bytes per worker relative to dense fp32."""
        return self.wire_bytes / self.dense_bytes if self.n else 0.0


def simulate_ints(int_arrays, seed: int, *, mode: str = AUTO,
                  ratio: float = codec.DEFAULT_RATIO, index: str = AUTO,
                  last_u: int | None = None) -> SimResult:
    """All-reduce int32 tensors (one per worker, same size) with the agents' rounds in memory.

    ``mode``: a Mode (or its name), or "auto"; ``index``: "flat", "hier" or "auto", with
    ``last_u`` as the agents' previous union size of this tensor, if any; ``seed`` and
    ``ratio``: the sketch's. The agents take the integers as floats (exact) at scale 1: one
    scale block, no split, the shift bias that cancels the negotiated shift, and no rescale,
    so an overflow the switch flags is ``AggregationOverflow``. Returns the decoded sum
    (bit-identical to the integer sum) and the bytes each round cost a worker: "bitmap"
    (flat) or "index-top", "index-mid", "index-leaf" (a level with nothing to carry is not
    sent), then the value rounds; round 1's exponent and block words are not counted.
    """
    arrays = [np.asarray(a).reshape(-1) for a in int_arrays]
    if not arrays:
        raise CodecError("simulate needs at least one worker")
    n = arrays[0].size
    for w, a in enumerate(arrays):
        if a.size != n:
            raise CodecError(f"worker {w} has {a.size} elements, worker 0 has {n}")
        if a.dtype != np.int32:
            raise CodecError(f"worker {w}: expected int32, got {a.dtype}")
    asked = codec.as_mode(mode, auto=True)
    codec.as_index(index)
    xs = [a.astype(np.float64) for a in arrays]  # every int32 is a float64
    exps = [e for e in map(codec.max_exponent, xs) if e is not None]
    # the negotiated shift is shift_for(the job's max exponent); the bias brings it to 0
    bias = -codec.shift_for(max(exps), len(xs)) if exps else 0
    job = MemoryJob(len(xs), mode=str(asked), index=index, seed=seed, ratio=ratio,
                    block=max(n, 1), split=False, shift_bias=bias, max_rescales=0,
                    deadline=600.0)  # a hang guard: nothing here is lost or late
    key = "ints"
    if last_u is not None:  # the history auto's index choice reads (Agent._last_union)
        for agent in job.agents:
            agent._last_union[key] = last_u
    try:
        sim = job.allreduce(xs, key)
    except AgentError:
        if not job.switch.overflow:
            raise
        # no rescale: the switch's flag ends the job, in its first value round or the residual
        chosen = job.agents[0]._last_mode.get(key, asked)
        name = str(chosen) if job.switch.adds == 1 else "residual"
        raise AggregationOverflow(name, job.switch.overflow_words) from None
    r = sim.results[0]
    assert not r.block_shifts.any(), "the integers went through at a scale other than 1"
    total = r.ints()
    codec.check_int32(total, f"{r.mode}-decode")  # never hand back a wrong sum
    if r.union_words is not None:
        u = codec.union_size(r.union_words, n)
    elif asked == Mode.DENSE:
        u = n
    else:  # auto chose dense after the index round: the union the workers saw
        u = int(np.count_nonzero(np.logical_or.reduce([a != 0 for a in arrays])))
    return SimResult(total.astype(np.int32), r.mode, n, u, r.rounds.get(str(Mode.SKETCH), 0),
                     r.rounds.get("residual", 0), {k: 4 * v for k, v in r.rounds.items()},
                     r.index)
