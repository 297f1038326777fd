"""Local reduction: the ranks of one host combine their words first, and one of them (the
host's leader) takes the host's sum through the switch, as SwitchML runs one worker per host and
NCCL reduces inside a node before it crosses the network.

    host = ThreadHost(size=8)                        # in-process ranks (tests, benches)
    link = host.link(r, Transport if r == 0 else None)  # local rank r's transport factory
    agent = Agent(AgentConfig(job, worker=h, workers=ranks, local_workers=hosts, ...),
                  transport=link)

Every round of the protocol (the negotiation's ORs, the values' adds, a fused window) is
combined at this level, whatever it carries: the leader gathers its host's words, combines
them as the switch would (``homagg.switch_model``'s int32 lane add, or OR), streams the host's
words through its own link, and hands the result back to every local rank. The integers are
those every rank would have sent the switch itself, and int32 addition modulo 2**32 is
associative and commutative, so the sum every rank decodes is bit for bit the one it decodes
without local reduction.

The job's numbering, as a tree's (``AgentConfig``): ``workers`` is every rank of the job (the
sum's contributors: the codec's headroom and the mean count them), ``local_workers`` the
switch's workers (the hosts, or a leaf's hosts in a tree) and ``worker`` the host's id at its
switch. Every rank of a host runs its own ``Agent`` (the codec's work is per rank); only the
leader's has a socket.

An overflow: the switch flags a round whose int32 partial sums overflowed (in any order), and
every worker then redoes it at a smaller scale. A host's own sum is such a partial sum: where
one overflowed, the leader's packets carry FLAG_OVERFLOW, which the switch merges into the
round's flag (as it does a child switch's partial, ``uplink.p4``), so every host sees it. A
leader whose round fails passes the failure to its host's ranks, which raise too: no rank waits
for a result that will not come.

How the ranks of a host meet is an ``Exchange``: threads of one process (``ThreadHost``), or
torch.distributed's ranks of one node through a gloo group of their own
(``homagg.host_agent.distributed.hosts``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from homagg import wire
from homagg.host_agent.config import AgentConfig, AgentError, AggregationTimeout
from homagg.host_agent.engine import Counters, SwitchLink, SwitchOverflow
from homagg.switch_model import lane_add, lane_or

#: What a round's outcome says to the host's other ranks (the first word of what is shared).
OK, OVERFLOW, FAILED = 0, 1, 2


def switch_combine(op: int, contribs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """One round at the switch: the contributions (int32 words, or uint32 taken as their bit
    patterns) added (``op`` OP_ADD) or ORed in arrival order, as ``homagg.switch_model``'s
    lanes do; and, per word, whether an add overflowed on the way (the switch checks each
    partial sum, so an intermediate overflow is flagged even when the final sum would fit).
    ``simulate`` combines its workers' rounds with it, and a host its ranks' (``combine``)."""
    acc = np.zeros(contribs[0].size, np.int32)
    over = np.zeros(acc.size, bool)
    for words in contribs:
        if op == wire.OP_OR:
            acc = lane_or(acc, words)
        else:
            acc, lanes = lane_add(acc, words)  # wraps, as the switch's bit<32> add does
            over |= lanes
    return acc, over


def combine(op: int, parts: list[np.ndarray]) -> tuple[np.ndarray, bool]:
    """One round's words of a host's ranks, combined as the switch combines workers' words
    (``switch_combine``), with whether a partial sum overflowed."""
    sizes = {p.size for p in parts}
    if len(sizes) != 1:
        raise AgentError(f"the ranks of a host disagree on a round's size ({sorted(sizes)} "
                         "words): their tensors part ways here")
    acc, over = switch_combine(op, parts)
    return acc, bool(over.any())


def as_int32(words: np.ndarray) -> np.ndarray:
    """A round's words as contiguous int32 (a bit set's uint32 by its bit patterns)."""
    words = np.ascontiguousarray(words)
    return words.view(np.int32) if words.dtype == np.uint32 else words.astype(np.int32,
                                                                              copy=False)


@dataclass
class Shared:
    """What the leader hands its host's ranks after a round: the outcome (OK, OVERFLOW,
    FAILED), the result(s) and, where it failed, why."""
    status: int
    outs: tuple[np.ndarray, ...] = ()
    why: str = ""


class Exchange(Protocol):
    """How one rank meets the other ranks of its host (local rank 0 is the leader)."""

    local_rank: int
    size: int

    def gather(self, parts: tuple[np.ndarray, ...]) -> list[tuple[np.ndarray, ...]] | None:
        """Every local rank's ``parts`` (one round's words, two for a fused window), in local
        rank order, at the leader; None elsewhere."""
        ...

    def share(self, shared: Shared | None, sizes: tuple[int, ...]) -> Shared:
        """The leader's ``shared`` at every local rank (``sizes``: the result(s) words)."""
        ...


class HostLink:
    """A ``SwitchLink`` for one rank of a host: through the leader's link (``inner``, on the
    leader only), the host's words combined first."""

    def __init__(self, exchange: Exchange, inner: SwitchLink | None, cfg: AgentConfig,
                 counters: Counters | None = None):
        if (exchange.local_rank == 0) != (inner is not None):
            raise AgentError("a host's leader (local rank 0), and it alone, has a link to "
                             "the switch")
        self.ex = exchange
        self.inner = inner
        self.counters = counters  # (another rank's: the rounds it took part in; the leader's
        # link counts its own, packets too)
        self.who = f"{cfg.who} local rank {exchange.local_rank}"
        self.broken: str | None = None
        self.switch = inner.switch if inner is not None else ("host leader", 0)
        self.sock = inner.sock if inner is not None else None
        if inner is not None and hasattr(inner, "round_cost"):
            self.round_cost = inner.round_cost  # (the leader's: the negotiation ORs it)
        if inner is not None and hasattr(inner, "stream_fused"):
            self.stream_fused = self._stream_fused  # the host pipelines where its link does

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def stream(self, op: int, words: np.ndarray, flagged: bool = False) -> np.ndarray:
        outs, overflow = self._round((op,), (words,), flagged)
        if overflow:
            raise SwitchOverflow()
        return outs[0]

    def _stream_fused(self, op: int, words: np.ndarray, op2: int, words2: np.ndarray,
                      flagged: bool = False) -> tuple[np.ndarray, np.ndarray, bool]:
        outs, overflow = self._round((op, op2), (words, words2), flagged)
        return outs[0], outs[1], overflow

    def _round(self, ops: tuple[int, ...], words: tuple[np.ndarray, ...], flagged: bool
               ) -> tuple[tuple[np.ndarray, ...], bool]:
        """One round (two: a fused window) of the host. ``flagged``: this rank's words are a
        partial sum that overflowed already (the leader flags the host's if any rank's is)."""
        if self.broken:
            raise AgentError(f"{self.who}: agent unusable after an earlier failure "
                             f"({self.broken}); reset the job and start a new agent")
        sizes = tuple(w.size for w in words)
        flag = np.array([int(flagged)], np.int32)  # (gathered with the words)
        try:
            parts = self.ex.gather((flag, *words))
        except Exception as e:
            self.broken = "host"
            raise AgentError(f"{self.who}: the ranks of this host could not meet: {e}"
                             ) from e
        if parts is None:  # another rank of the host: the leader's outcome
            got = self._outcome(self._share(None, sizes))
            if self.counters is not None:
                self.counters.rounds += 1
            return got
        try:
            combined = [combine(op, [p[i + 1] for p in parts]) for i, op in enumerate(ops)]
            flagged = any(bool(p[0][0]) for p in parts) or any(
                over for (_, over), op in zip(combined, ops) if op == wire.OP_ADD)
            shared = self._through_switch(ops, [c for c, _ in combined], flagged)
        except Exception as e:  # noqa: BLE001 - the host's ranks hear of it, then it is raised
            self._share(Shared(FAILED, why=f"{type(e).__name__}: {e}"), sizes)
            self.broken = getattr(self.inner, "broken", None) or "leader"
            raise
        return self._outcome(self._share(shared, sizes))

    def _through_switch(self, ops: tuple[int, ...], words: list[np.ndarray],
                        flagged: bool) -> Shared:
        inner = self.inner
        assert inner is not None
        if len(ops) == 2:
            out, out2, overflow = inner.stream_fused(  # type: ignore[attr-defined]
                ops[0], words[0], ops[1], words[1], flagged=flagged)
            return Shared(OVERFLOW if overflow else OK, (out, out2))
        try:
            return Shared(OK, (inner.stream(ops[0], words[0], flagged=flagged),))
        except SwitchOverflow:
            return Shared(OVERFLOW, (np.zeros(words[0].size, np.int32),))

    def _share(self, shared: Shared | None, sizes: tuple[int, ...]) -> Shared:
        try:
            return self.ex.share(shared, sizes)
        except Exception as e:
            self.broken = "host"
            raise AgentError(f"{self.who}: the ranks of this host could not meet: {e}"
                             ) from e

    def _outcome(self, shared: Shared) -> tuple[tuple[np.ndarray, ...], bool]:
        if shared.status == FAILED:  # (the leader raised its own error already)
            self.broken = "leader"
            if shared.why.startswith("AggregationTimeout"):
                raise AggregationTimeout(f"{self.who}: the host's leader failed the round: "
                                         f"{shared.why}")
            raise AgentError(f"{self.who}: the host's leader failed the round: {shared.why}")
        return shared.outs, shared.status == OVERFLOW


class ThreadHost:
    """The ranks of one simulated host as threads of one process, each with its own agent:
    they meet at a barrier per round (``deadline`` seconds at most)."""

    def __init__(self, size: int, deadline: float = 30.0):
        if size < 1:
            raise AgentError(f"a host of {size} ranks: at least one")
        self.size = size
        self.barrier = threading.Barrier(size, timeout=deadline)
        self.inbox: list[tuple[np.ndarray, ...] | None] = [None] * size
        self.shared: Shared | None = None

    def link(self, local_rank: int, inner: Callable[[AgentConfig, Counters], SwitchLink] | None
             ) -> Callable[[AgentConfig, Counters], HostLink]:
        """Local rank ``local_rank``'s transport factory for ``Agent``; ``inner``: the
        leader's own (local rank 0 only)."""
        def make(cfg: AgentConfig, counters: Counters) -> HostLink:
            return HostLink(_ThreadMember(self, local_rank),
                            None if inner is None else inner(cfg, counters), cfg, counters)
        return make


class _ThreadMember:
    def __init__(self, host: ThreadHost, local_rank: int):
        if not 0 <= local_rank < host.size:
            raise AgentError(f"local rank {local_rank} of a host of {host.size}")
        self.host, self.local_rank, self.size = host, local_rank, host.size

    def _wait(self) -> None:
        try:
            self.host.barrier.wait()
        except threading.BrokenBarrierError:
            raise AggregationTimeout("a rank of this host failed or did not take part in "
                                     "the round") from None

    def gather(self, parts):
        h = self.host
        h.inbox[self.local_rank] = tuple(np.array(p, copy=True) for p in parts)
        self._wait()
        if self.local_rank:
            return None
        got = [p for p in h.inbox if p is not None]
        h.inbox = [None] * h.size
        return got

    def share(self, shared, sizes):
        h = self.host
        if self.local_rank == 0:
            h.shared = shared
        self._wait()
        got = h.shared
        self._wait()  # every rank has read it before the next round's
        assert got is not None
        return Shared(got.status, tuple(np.array(o, copy=True) for o in got.outs), got.why)
