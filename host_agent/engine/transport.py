"""The streaming engine: word arrays aggregated through the job's slot pool, reliably.

Every round streams K-word chunks through the job's S slots: chunk g (numbered across the
agent's life, identically on every worker) goes to slot g % S, copy (g // S) % 2, with round tag
g + 1; chunk g is sent once chunk g - S (same slot) has come back, and at most ``rate_pps``
packets a second if set. Lost packets are resent after a timeout (measured, ``rto``) with
backoff; the switch answers a duplicate with the finished result or a status that names the
contributors, so a dead peer is named in the error, after ``deadline`` seconds of no progress.
An overflow flagged by the switch is reported once the round is complete (``SwitchOverflow``):
every worker sees the same flag, so all of them can redo the round at a smaller scale.

A run starts with a join (the switch's join.p4): one OP_JOIN packet (JOIN_WORDS words, whatever
K) carrying a random nonce and the run (``AgentConfig.run``: the attempt every worker of this run
shares, so a join that another run left pending is not counted in), answered once every worker
of the job has joined with the run's generation, which every later packet carries. The reply's
slot field is the switch's K, the words per packet it was built with: the agent learns K there
(a K configured here that differs is an error at once). The switch treats slot state of an
earlier generation as empty, so chunk numbers (and round tags) start at 0 in every run and runs
that follow each other on one job need no reset; a worker still retransmitting from an earlier
run is dropped as stale.

One call is one ``Round`` (``homagg.host_agent.engine.round``): its chunks in flight, loss detection
and retransmission, and the results matched to their chunks.

The header is ``homagg.wire``'s (its struct, field list and status words): nothing of the
protocol is spelt out here.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from homagg import udpio, wire
from homagg.faults import ImpairedSocket
from homagg.host_agent.config import AgentConfig, AgentError
from homagg.host_agent.engine import native, results
from homagg.host_agent.engine.congestion import Congestion
from homagg.host_agent.engine.round import Round, SwitchOverflow
from homagg.host_agent.engine.round_cost import RoundCost
from homagg.host_agent.engine.rto import RtoEstimator
from homagg.host_agent.engine.scratch import Scratch

if TYPE_CHECKING:
    from homagg.host_agent.engine import Counters

__all__ = ["SwitchOverflow", "Transport"]

#: Receives' worth of datagrams gathered before matching (1 MiB with 64 KiB receives).
RECV_BATCH = 16

#: Called before every agent's join with its config and its engine ("native" or "python"):
#: compiles (or loads) the kernels its rounds call, so that none is compiled inside a round.
#: ``homagg.host_agent`` sets it to ``warm.before_join`` when it is imported (as it is before
#: this module, its parent): warm runs agents through the simulator, a layer above this one,
#: which this module therefore does not import.


def _nothing(cfg: AgentConfig, engine: str) -> None:
    return None


before_join: Callable[[AgentConfig, str], object] = _nothing


class Transport:
    """The agent's socket to the switch and its place in the job's chunk sequence."""

    def __init__(self, cfg: AgentConfig, counters: Counters):
        self.cfg = cfg
        self.counters = counters
        self.who = cfg.who
        # joined through the service: the socket was bound then, on the port the switch knows
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM) if cfg.membership is None \
            else cfg.membership.take_socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        if cfg.membership is None:
            try:
                sock.bind(cfg.bind)
            except OSError as e:
                sock.close()
                raise AgentError(f"{self.who}: cannot bind {cfg.bind[0]}:{cfg.bind[1]}: {e}"
                                 ) from None
        sock.setblocking(False)
        self.sock: udpio.BatchSocket | ImpairedSocket = udpio.BatchSocket(sock)
        if cfg.faults is not None and cfg.faults.active:
            self.sock = ImpairedSocket(self.sock, cfg.faults)
        self.switch = (socket.gethostbyname(cfg.switch[0]), cfg.switch[1])
        self.chunk = 0        # next global chunk number (identical on every worker)
        self.k: int = 0       # words per packet: the switch's, from the join's reply
        self.packet_bytes = 0
        self.gen: int | None = None  # the run's generation, from the join (first stream)
        self.broken: str | None = None
        # the results a wake-up finds, gathered end to end (Round.receive): runs (GRO) and
        # single datagrams, up to RECV_BATCH receives' worth before they are matched
        self.rbuf = bytearray(RECV_BATCH * udpio.RECV_BYTES)
        self.rview = memoryview(self.rbuf)
        # the rounds' packets, results and words, kept from round to round (engine.scratch)
        self.scratch = Scratch()
        # Retransmission timeout from measured round trips (RFC 6298, Karn: samples only from
        # chunks sent once). A fixed timeout resends half of everything on a queueing bmv2.
        self.rtt = RtoEstimator(cfg.timeout, cfg.min_timeout, cfg.max_timeout)
        # what a round trip costs in words, for the index choice (agreed in round 1)
        self.round_cost = RoundCost()
        # The window in slots and the pacing, across this agent's rounds (None: off)
        self.cc = Congestion(cfg.slots, self.rtt) if cfg.congestion else None
        self._headers: dict[tuple[int, int, int], tuple[bytes, np.uint64]] = {}
        # the rounds' engine: the C loop where it can run (``engine.native``), else this one's
        self.engine = native.choose(cfg, self.sock)
        self.native = native.NativeLink(self) if self.engine == "native" else None

    def headers(self, op: int, gen: int, flags: int = 0) -> tuple[bytes, np.uint64]:
        """A round's packet header (its slot, tag and copy flag zero; ``flags``: FLAG_OVERFLOW
        where the words are a partial sum that overflowed) and what a plain result of it has
        in its first 8 bytes (``results.head8``), per op, run and flags: made once."""
        got = self._headers.get((op, gen, flags))
        if got is None:
            cfg = self.cfg
            got = self._headers[op, gen, flags] = (
                wire.header(op=op, job=cfg.job, worker=cfg.worker, slot=0, seq=0, gen=gen,
                            auth=cfg.key, flags=flags),
                results.head8(version_op=op, flags=wire.FLAG_RESULT, job=cfg.job, gen=gen))
        return got

    def close(self) -> None:
        if self.native is not None:
            self.native.close()
        self.scratch.clear()
        self.sock.close()

    def stream(self, op: int, words: np.ndarray, flagged: bool = False) -> np.ndarray:
        """Aggregate ``words`` (int32, or uint32 bit sets for OR) with every worker's; returns
        int32. Raises SwitchOverflow if the switch flagged an int32 overflow (after completing).
        ``flagged``: the words are a partial sum that overflowed already (a host's,
        ``hostreduce``): the packets say so, and the switch flags the round."""
        self._start()
        r = Round(self, op, words, flagged=flagged)
        out = r.run()
        self.round_cost.sample(r.nchunks, r.k, time.monotonic() - r.t_start)
        return out

    def stream_fused(self, op: int, words: np.ndarray, op2: int, words2: np.ndarray,
                     flagged: bool = False) -> tuple[np.ndarray, np.ndarray, bool]:
        """Two rounds in one window and one round trip: ``words`` (``op``), then ``words2``
        (``op2``) from the next chunk boundary on, each chunk with its part's op (a pipelined
        tensor's round 1 riding with the one before's values: ``Agent``). Every worker must
        fuse the same two. Returns both results and whether the switch flagged an overflow
        (in an ADD part: the caller redoes that part; the other's result stands). ``flagged``:
        as ``stream``'s, for the whole window."""
        self._start()
        r = Round(self, op, words, second=(op2, words2), flagged=flagged)
        try:
            out, overflow = r.run(), False
        except SwitchOverflow:
            out, overflow = r.out[:r.n], True
        self.round_cost.sample(r.nchunks, r.k, time.monotonic() - r.t_start)
        return out, r.second_out(), overflow

    def _start(self) -> None:
        """Before a round: refuse after a failure; join the job first (its first round)."""
        if self.broken:
            raise AgentError(f"{self.who}: agent unusable after an earlier failure "
                             f"({self.broken}); reset the job and start a new agent")
        if self.gen is None:
            self.gen = self.join()

    def join(self) -> int:
        """The job's barrier at the start of this agent's run: the generation the switch hands
        out once every worker has joined (retransmitted like any round, with the deadline).
        The kernels are compiled (or loaded) first: never inside a round (``before_join``)."""
        before_join(self.cfg, self.engine)
        nonce = secrets.randbits(32) or 1  # 0: a register never written
        words = np.zeros(wire.JOIN_WORDS, np.int32)
        words[wire.JOIN_RUN_WORD] = np.uint32(self.cfg.run).view(np.int32)  # the attempt
        r = Round(self, wire.OP_JOIN, words, join_nonce=nonce)
        r.run()
        assert r.gen is not None and self.k
        return r.gen

    def learn_words(self, k: int) -> None:
        """K from the join's reply. An agent told K (``AgentConfig.words``) that differs from
        the switch's stops here, in its first round, with both numbers."""
        if self.cfg.words is not None and self.cfg.words != k:
            self.broken = "words per packet"
            raise AgentError(f"{self.who}: the switch {self.switch[0]}:{self.switch[1]} was "
                             f"built for {k} words per packet and this agent for "
                             f"{self.cfg.words}: leave the agent's words unset (it learns K "
                             "from the switch) or rebuild the switch with homagg-ctl build "
                             f"--words {self.cfg.words}")
        if not wire.MIN_WORDS_PER_PACKET <= k <= wire.MAX_WORDS_PER_PACKET:
            self.broken = "words per packet"
            raise AgentError(f"{self.who}: the switch {self.switch[0]}:{self.switch[1]} "
                             f"answered the join with {k} words per packet, which no homagg "
                             "switch has: is it an older homagg?")
        try:  # a K for jumbo frames on a 1500-byte link would be fragmented (bmv2 drops those)
            wire.check_words(k, udpio.path_mtu(self.switch))
        except wire.WireError as e:
            self.broken = "words per packet"
            raise AgentError(f"{self.who}: the switch {self.switch[0]}:{self.switch[1]} was "
                             f"built for {k} words per packet, too many for this host's "
                             f"link: {e}") from None
        self.k, self.packet_bytes = k, wire.packet_bytes(k)
