"""The whole all-reduce in memory, on floats: W agents, no sockets, the switch's arithmetic.

    from homagg.host_agent import simulate_allreduce
    sim = simulate_allreduce([x0, x1, x2, x3], mode="auto", index="hier", block=256)
    sim.out[0], sim.wire_bytes[0]          # worker 0's float sum, and the bytes it sent

Each worker is a real ``Agent`` (negotiation, non-finite flag, block scales, index, mode
choice, value rounds, rescale) whose transport is a ``MemoryTransport``: the W agents run in
threads, and each ``stream`` call meets its peers' at a barrier, where the words are combined
as the switch does (``homagg.switch_model.lane_add`` / ``lane_or``, in worker order, an
overflow in any lane flagged to every worker). Outputs are bit-identical to agents over
sockets through the software aggregator, and wire bytes are counted as the UDP transport
counts them (whole packets, no retransmissions).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from homagg import wire
from homagg.host_agent.allreduce import Agent, Counters, Result
from homagg.host_agent.config import AgentConfig, AgentError, AggregationTimeout
from homagg.host_agent.transport import SwitchOverflow
from homagg.switch_model import lane_add, lane_or


class MemorySwitch:
    """The rendezvous of W in-memory transports: one combined round at a time."""

    def __init__(self, workers: int, deadline: float = 10.0):
        self.workers = workers
        self.barrier = threading.Barrier(workers, timeout=deadline)
        self.inbox: list[tuple[int, np.ndarray] | None] = [None] * workers
        self.result = np.zeros(0, np.int32)
        self.overflow = False
        self.error: str | None = None

    def _combine(self) -> None:
        got = [c for c in self.inbox if c is not None]
        ops = {op for op, _ in got}
        sizes = {w.size for _, w in got}
        self.error = None
        if len(got) != self.workers or len(ops) != 1 or len(sizes) != 1:
            self.error = (f"workers disagree on the round: ops {sorted(ops)}, sizes "
                          f"{sorted(sizes)}")
            return
        op = ops.pop()
        acc = np.zeros(sizes.pop(), np.int32)
        over = np.zeros(acc.size, bool)
        for _, words in got:
            if op == wire.OP_OR:
                acc = lane_or(acc, words)
            else:
                acc, lanes = lane_add(acc, words)
                over |= lanes
        self.result, self.overflow = acc, bool(over.any())

    def round(self, worker: int, op: int, words: np.ndarray) -> tuple[np.ndarray, bool,
                                                                     str | None]:
        self.inbox[worker] = (op, words)
        if self.barrier.wait() == 0:
            self._combine()
        self.barrier.wait()  # every worker reads the result before the next round's combine
        return self.result.copy(), self.overflow, self.error


class MemoryTransport:
    """``Transport``'s interface (``stream``, ``close``, ``broken``) over a ``MemorySwitch``."""

    def __init__(self, switch: MemorySwitch, cfg: AgentConfig, counters: Counters):
        self.switch_model = switch
        self.cfg = cfg
        self.counters = counters
        self.who = cfg.who
        self.broken: str | None = None

    def close(self) -> None:
        pass

    def stream(self, op: int, words: np.ndarray) -> np.ndarray:
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
            out, overflow, error = self.switch_model.round(self.cfg.worker, op, words)
        except threading.BrokenBarrierError:
            self.broken = "timeout"
            raise AggregationTimeout(f"{self.who}: a peer failed or did not take part in "
                                     "the round") from None
        if error:
            self.broken = error
            raise AgentError(f"{self.who}: {error}")
        self.counters.results += chunks
        self.counters.rounds += 1
        if overflow:
            raise SwitchOverflow()
        return out


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
    """W agents on a ``MemorySwitch``, kept across calls (so ``key`` memory works)."""

    def __init__(self, workers: int, **options):
        job = options.pop("job", 1)
        cfgs = [AgentConfig(job, w, workers, **options) for w in range(workers)]
        self.switch = MemorySwitch(workers, cfgs[0].deadline)
        self.agents = [Agent(c, transport=lambda c, counters: MemoryTransport(self.switch, c,
                                                                              counters))
                       for c in cfgs]

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

        threads = [threading.Thread(target=work, args=(w,)) for w in range(len(arrays))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [e for e in errors if e is not None]
        if failed:
            raise next((e for e in failed if not isinstance(e, AggregationTimeout)), failed[0])
        return AllreduceSim(results)


def simulate_allreduce(arrays, key=None, **options) -> AllreduceSim:
    """All-reduce ``arrays`` (one float tensor per worker) in memory; ``options`` are
    ``AgentConfig``'s (mode, index, headroom, block, shift_bias, max_rescales, seed, job...)."""
    return MemoryJob(len(arrays), **options).allreduce(arrays, key)
