"""The switch's rules as one table: state + packet gives counter, flags and reply.

Each row sets up a slot's state with a few contributions, then sends one probe packet and
states what must happen: which counter moves (the counters are one per verdict or drop reason,
so this is the verdict too), who gets a reply, with which flags and words. Rows marked
``tree`` install the job as a tree's child job (uplink.p4) whose parent is host 3: its partial
sums go there, and host 3 sends the parent's answers. The same table runs on three targets:
- ``model``: homagg.switch_model.SwitchModel, in memory;
- ``soft``: the software aggregator's server on a UDP socket (loopback addresses as hosts);
- ``bmv2``: simple_switch_grpc running p4/homagg.p4 on veth pairs (skips without bmv2/root).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from bmv2_tests.conftest import bmv2_skip_reason
from bmv2_tests.targets import Bmv2Target, ModelTarget, SoftUdpTarget, soft_engine
from homagg import wire
from homagg.netconfig import Uplink as UplinkSpec
from homagg.targets.testbed import host_mac

K = wire.WORDS_PER_PACKET
WORKERS = 3          # hosts 0..2 are the job's workers; host 3 is registered nowhere
PARENT = 3           # (or, for a tree's child job, its parent switch)
PJ, LW = 5, 1        # the parent's job id, and this switch's worker id in it
PKEY = 0x5EED0F0D    # the parent job's key
SLOTS = 4


def key_of(job: int) -> int:
    """The case job's key (the auth word its packets carry): its top bit set, so the byte
    order shows."""
    return 0xA5000000 | job * 0x10101
_job_ids = itertools.count()


@dataclass(frozen=True)
class Pkt:
    host: int
    seq: int = 1
    value: int = 1             # every word carries this value
    op: int = wire.OP_ADD
    slot: int = 0
    phase: int = 0
    flags: int = 0
    worker: int | None = None  # header worker id (default: the host's own)
    version: int = wire.HOMAGG_VERSION
    size: int | None = None    # payload bytes (truncate or pad); None: the packet's own
    gen: int = 0               # the run's generation (join.p4)
    job: int | None = None     # header job id (default: the case's job)
    status: tuple[int, int] | None = None  # words of a status reply (a parent's)
    run: int = 0               # a join's run (word JOIN_RUN_WORD)
    auth: int | None = None    # its key (default: the case job's; the parent job's from it)
    flip: int = 0              # bits of the key flipped (a near guess)

    def payload(self, job: int) -> bytes:
        flags = self.flags | (wire.FLAG_PHASE if self.phase else 0)
        n = wire.JOIN_WORDS if self.op == wire.OP_JOIN else K  # a join's words, whatever K
        words = (np.full(n, self.value, np.int64).astype(np.uint32) if self.status is None
                 else wire.status_words(*self.status, n))
        if self.run:
            words[wire.JOIN_RUN_WORD] = self.run
        auth = self.flip ^ (self.auth if self.auth is not None else (
            PKEY if self.host == PARENT else key_of(job)))
        job = job if self.job is None else self.job
        p = wire.pack(self.op, job, self.host if self.worker is None else self.worker,
                      self.slot, self.seq, words, flags=flags, version=self.version,
                      gen=self.gen, auth=auth)
        if self.size is None:
            return p
        return p[:self.size] if self.size <= len(p) else p + bytes(self.size - len(p))


@dataclass(frozen=True)
class Reply:
    host: int
    flags: int
    value: int | None = None          # every word equals this (results)
    status: tuple[int, int] | None = None  # (contributors bitmap, count) (status replies)
    refused: str | None = None        # the DROP_* reason a FLAG_REFUSED reply carries
    job: int | None = None            # its job id (default: the case's job)
    seq: int | None = None            # its seq (default: the probe's; ANY: not checked)
    slot: int | None = None           # its slot (default: the probe's, K for a join's)
    gen: int | None = None            # its gen, where checked
    run: int | None = None            # word JOIN_RUN_WORD, if not ``value`` (a join going up)


@dataclass(frozen=True)
class Case:
    name: str
    setup: tuple[Pkt, ...]
    probe: Pkt
    counter: str                    # the one STATS counter the probe moves (besides STAT_RX)
    replies: tuple[Reply, ...] = ()
    also: tuple[str, ...] = field(default=())  # further counters the probe moves
    tree: bool = False              # the job is a tree's child job, host 3 its parent

R, S, T, OVF = wire.FLAG_RESULT, wire.FLAG_STATUS, wire.FLAG_RETRANS, wire.FLAG_OVERFLOW
P, F = wire.FLAG_PHASE, wire.FLAG_REFUSED
ALL = tuple(range(WORKERS))


def J(host: int, nonce: int, run: int = 0) -> Pkt:
    """A join (OP_JOIN): a run's first packet, its seq the agent's nonce, its first word the
    run (the attempt every worker of one run of the job shares)."""
    return Pkt(host, seq=nonce, value=0, op=wire.OP_JOIN, run=run)


# The order of a job restarted during its join: run 1's join stays at 2 of 3 workers (worker
# 2 never started), then in run 2 worker 2 joins first, then 0 and 1 again.
STRANDED = (J(0, 11, run=1), J(1, 12, run=1))
RESTARTED = STRANDED + (J(2, 23, run=2), J(0, 21, run=2))


JOINED = (J(0, 11), J(1, 12), J(2, 13))  # one run's complete join
U, ANY = wire.FLAG_UPSTREAM, -1
ROUND = (Pkt(0, value=1), Pkt(1, value=2), Pkt(2, value=3))  # a round complete here (sum 6)


def FROM_PARENT(value: int = 42, flags: int = R, **kw) -> Pkt:
    """The parent's answer to this switch's partial (its result, by default)."""
    return Pkt(PARENT, value=value, flags=flags, worker=LW, **{"job": PJ, **kw})


def UP(value: int | None, **kw) -> Reply:
    """This switch's partial (or join) to its parent: the parent job's identity, no flags."""
    return Reply(PARENT, 0, value, job=PJ, **kw)


TREE_CASES = [
    Case("tree: a round complete here goes up as one partial sum, not to the workers",
         (Pkt(0, value=5), Pkt(1, value=-7)), Pkt(2, value=100), "STAT_ACCEPTED",
         (UP(98),), ("STAT_PARTIAL_UP",)),
    Case("tree: the round's designated worker's retransmission (seq & (workers - 1) = 0) "
         "before the parent's answer sends the partial up again",
         ROUND, Pkt(0), "STAT_PARTIAL_RESENT", (UP(6),)),
    Case("tree: another worker's retransmission before the parent's answer gets a status "
         "(every worker here has sent), not another partial up",
         ROUND, Pkt(1), "STAT_DUP_PENDING", (Reply(1, R | S, status=(0b111, 3)),)),
    Case("tree: the designated worker rotates with the round tag (seq 2: worker 2)",
         tuple(Pkt(h, seq=2, value=h + 1) for h in ALL), Pkt(2, seq=2), "STAT_PARTIAL_RESENT",
         (UP(6, seq=2),)),
    Case("tree: the parent's result is multicast to the workers",
         ROUND, FROM_PARENT(42), "STAT_FROM_PARENT", tuple(Reply(h, R, 42) for h in ALL),
         ("STAT_COMPLETED",)),
    Case("tree: a result from the parent's address without the parent job's key is forged",
         ROUND, FROM_PARENT(42, flip=1 << 7), "DROP_FORGED_RESULT"),
    Case("tree: after the parent's result, a retransmission gets it by unicast",
         ROUND + (FROM_PARENT(42),), Pkt(0), "STAT_RETRANS_REPLY", (Reply(0, R | T, 42),)),
    Case("tree: the parent's result twice is dropped", ROUND + (FROM_PARENT(42),),
         FROM_PARENT(42), "DROP_PARENT_DUP"),
    Case("tree: a parent's result for a round not complete here is dropped",
         ROUND[:2], FROM_PARENT(42), "DROP_PARENT_DUP"),
    Case("tree: the parent's result for another round is dropped",
         ROUND, FROM_PARENT(42, seq=2), "DROP_PARENT_DUP"),
    Case("tree: the parent's status is relayed to every worker, marked upstream",
         ROUND, FROM_PARENT(0, R | S, status=(0b10, 1)), "STAT_FROM_PARENT",
         tuple(Reply(h, R | S | U, status=(0b10, 1)) for h in ALL)),
    Case("tree: the parent's refusal is relayed to every worker, marked upstream",
         ROUND, FROM_PARENT(0, R | F, status=(0, wire.STAT_INDEX["DROP_BAD_SLOT"])),
         "STAT_FROM_PARENT", tuple(Reply(h, R | F | U, refused="DROP_BAD_SLOT") for h in ALL)),
    Case("tree: the parent's overflow flag reaches the workers",
         ROUND, FROM_PARENT(7, R | OVF), "STAT_FROM_PARENT",
         tuple(Reply(h, R | OVF, 7) for h in ALL), ("STAT_COMPLETED", "STAT_OVERFLOW")),
    Case("tree: a round that overflowed here goes up flagged",
         (Pkt(0, value=2**31 - 1), Pkt(1, value=1)), Pkt(2, value=0), "STAT_ACCEPTED",
         (Reply(PARENT, OVF, -(2**31), job=PJ),), ("STAT_PARTIAL_UP",)),
    Case("tree: the parent's answer from another job id is forged", ROUND,
         FROM_PARENT(42, job=PJ + 1), "DROP_FORGED_RESULT"),
    Case("tree: a join complete here goes up as this switch's join",
         JOINED[:2], JOINED[2], "STAT_ACCEPTED", (UP(0, seq=ANY, slot=0, gen=0),),
         ("STAT_PARTIAL_UP",)),
    Case("tree: a retransmitted join before the root's answer goes up again",
         JOINED, J(1, 12), "STAT_PARTIAL_RESENT", (UP(0, seq=ANY, slot=0, gen=0),)),
    Case("tree: the root's join answer hands its generation to every worker",
         JOINED, FROM_PARENT(0, op=wire.OP_JOIN, seq=77, gen=9), "STAT_FROM_PARENT",
         tuple(Reply(h, R, 0, gen=9) for h in ALL), ("STAT_COMPLETED",)),
    Case("tree: after the root's answer, a retransmitted join gets the root's generation",
         JOINED + (FROM_PARENT(0, op=wire.OP_JOIN, seq=77, gen=9),), J(1, 12),
         "STAT_RETRANS_REPLY", (Reply(1, R | T, 0, gen=9),)),
    Case("tree: the root's join answer while the join here is pending is held, not relayed",
         JOINED + (J(0, 21),), FROM_PARENT(0, op=wire.OP_JOIN, seq=77, gen=9),
         "STAT_FROM_PARENT"),
    Case("tree: a held join answer is handed out when the join here completes (not sent up)",
         JOINED + (J(0, 21), FROM_PARENT(0, op=wire.OP_JOIN, seq=77, gen=9), J(1, 22)),
         J(2, 23), "STAT_ACCEPTED", tuple(Reply(h, R, 0, gen=9) for h in ALL),
         ("STAT_COMPLETED",)),
    Case("tree: after a held answer is handed out, a retransmitted join gets it again",
         JOINED + (J(0, 21), FROM_PARENT(0, op=wire.OP_JOIN, seq=77, gen=9), J(1, 22),
                   J(2, 23)), J(1, 22), "STAT_RETRANS_REPLY", (Reply(1, R | T, 0, gen=9),)),
    Case("tree: a second join answer while one is held is dropped",
         JOINED + (J(0, 21), FROM_PARENT(0, op=wire.OP_JOIN, seq=77, gen=9)),
         FROM_PARENT(0, op=wire.OP_JOIN, seq=78, gen=10), "DROP_PARENT_DUP"),
    Case("tree: a join goes up with its run",
         (J(0, 11, run=3), J(1, 12, run=3)), J(2, 13, run=3), "STAT_ACCEPTED",
         (UP(0, seq=ANY, slot=0, gen=0, run=3),), ("STAT_PARTIAL_UP",)),
    Case("tree: after a join that never completed here, a restarted run's completes and goes "
         "up with its run", RESTARTED, J(1, 22, run=2), "STAT_ACCEPTED",
         (UP(0, seq=ANY, slot=0, gen=0, run=2),), ("STAT_PARTIAL_UP",)),
    Case("tree: a join of another run drops a held answer (the other run's) and goes up",
         JOINED + (J(0, 21), FROM_PARENT(0, op=wire.OP_JOIN, seq=77, gen=9),
                   J(1, 32, run=4), J(0, 31, run=4)), J(2, 33, run=4), "STAT_ACCEPTED",
         (UP(0, seq=ANY, slot=0, gen=0, run=4),), ("STAT_PARTIAL_UP",)),
    Case("tree: a root's join answer of an older generation is dropped",
         JOINED + (FROM_PARENT(0, op=wire.OP_JOIN, seq=77, gen=9), J(0, 21), J(1, 22),
                   J(2, 23)), FROM_PARENT(0, op=wire.OP_JOIN, seq=78, gen=9),
         "DROP_PARENT_DUP"),
]
TREE_CASES = [replace(c, tree=True) for c in TREE_CASES]

CASES = [
    Case("first contribution is absorbed", (), Pkt(0), "STAT_ACCEPTED"),
    Case("second contribution is absorbed", (Pkt(0),), Pkt(1), "STAT_ACCEPTED"),
    Case("last contribution completes: sum multicast to every worker",
         (Pkt(0, value=5), Pkt(1, value=-7)), Pkt(2, value=100), "STAT_ACCEPTED",
         tuple(Reply(h, R, 98) for h in ALL), ("STAT_COMPLETED",)),
    Case("OR combines bit sets",
         (Pkt(0, op=wire.OP_OR, value=0b001), Pkt(1, op=wire.OP_OR, value=0b010)),
         Pkt(2, op=wire.OP_OR, value=0b110), "STAT_ACCEPTED",
         tuple(Reply(h, R, 0b111) for h in ALL), ("STAT_COMPLETED",)),
    Case("shadow copy (phase 1) aggregates like phase 0",
         (Pkt(0, phase=1, value=1), Pkt(1, phase=1, value=2)), Pkt(2, phase=1, value=3),
         "STAT_ACCEPTED", tuple(Reply(h, R | P, 6) for h in ALL), ("STAT_COMPLETED",)),
    Case("positive int32 overflow is flagged in the result",
         (Pkt(0, value=2**31 - 1), Pkt(1, value=1)), Pkt(2, value=0), "STAT_ACCEPTED",
         tuple(Reply(h, R | OVF, -(2**31)) for h in ALL), ("STAT_COMPLETED", "STAT_OVERFLOW")),
    Case("a sum reaching INT32_MIN exactly is not an overflow",
         (Pkt(0, value=-(2**30)), Pkt(1, value=-(2**30))), Pkt(2, value=0), "STAT_ACCEPTED",
         tuple(Reply(h, R, -(2**31)) for h in ALL), ("STAT_COMPLETED",)),
    Case("duplicate of an unfinished round: not added, status names the contributors",
         (Pkt(0), Pkt(2)), Pkt(0), "STAT_DUP_PENDING", (Reply(0, R | S, status=(0b101, 2)),)),
    Case("duplicate of a finished round: the result again, by unicast",
         (Pkt(0, value=1), Pkt(1, value=2), Pkt(2, value=3)), Pkt(1), "STAT_RETRANS_REPLY",
         (Reply(1, R | T, 6),)),
    Case("overflow flag survives into a retransmitted result",
         (Pkt(0, value=2**31 - 1), Pkt(1, value=1), Pkt(2, value=0)), Pkt(0),
         "STAT_RETRANS_REPLY", (Reply(0, R | T | OVF, -(2**31)),)),
    Case("another op in the same round is a mismatch", (Pkt(0),), Pkt(1, op=wire.OP_OR),
         "DROP_SEQ_MISMATCH"),
    Case("a delayed packet of an older round is stale", (Pkt(0, seq=5),), Pkt(1, seq=4),
         "DROP_STALE"),
    Case("an old round cannot restart an idle copy",
         (Pkt(0, seq=5), Pkt(1, seq=5), Pkt(2, seq=5), Pkt(0, seq=6, phase=1),
          Pkt(1, seq=6, phase=1), Pkt(2, seq=6, phase=1)), Pkt(0, seq=3), "DROP_STALE"),
    Case("a finished round is stale for a worker that moved on",
         (Pkt(0), Pkt(1), Pkt(2), Pkt(0, seq=2, phase=1)), Pkt(0, seq=1), "DROP_STALE"),
    Case("a join is absorbed until the last worker's, then multicast",
         JOINED[:2], JOINED[2], "STAT_ACCEPTED", tuple(Reply(h, R, 0) for h in ALL),
         ("STAT_COMPLETED",)),
    Case("a retransmitted join of a complete join: the reply again, by unicast",
         JOINED, J(1, 12), "STAT_RETRANS_REPLY", (Reply(1, R | T, 0),)),
    Case("a retransmitted pending join: status names who joined",
         (J(0, 11), J(2, 13)), J(0, 11), "STAT_DUP_PENDING", (Reply(0, R | S, status=(0b101, 2)),)),
    Case("a new run's join after a complete one starts the next join",
         JOINED, J(0, 21), "STAT_ACCEPTED"),
    Case("a join that a newer run's join replaced is stale",
         JOINED + (J(1, 22),), J(0, 11), "DROP_STALE"),
    Case("a worker restarting during a pending join is counted once",
         (J(0, 11), J(1, 12), J(0, 31)), J(2, 13), "STAT_ACCEPTED",
         tuple(Reply(h, R, 0) for h in ALL), ("STAT_COMPLETED",)),
    Case("a join of another run finds a join that never completed, and starts afresh",
         STRANDED, J(2, 23, run=2), "STAT_ACCEPTED", (), ("STAT_JOIN_AFRESH",)),
    Case("after a join that never completed, a restarted run's joins complete in any order",
         RESTARTED, J(1, 22, run=2), "STAT_ACCEPTED", tuple(Reply(h, R, 0) for h in ALL),
         ("STAT_COMPLETED",)),
    Case("a retransmission of the join that never completed is stale once another run's "
         "started afresh", STRANDED + (J(2, 23, run=2),), J(0, 11, run=1), "DROP_STALE"),
    Case("joins of one run count toward one join (replies carry no run)",
         (J(0, 11, run=7), J(1, 12, run=7)), J(2, 13, run=7), "STAT_ACCEPTED",
         tuple(Reply(h, R, 0) for h in ALL), ("STAT_COMPLETED",)),
    Case("a new run's join after a complete one of another run starts the next join",
         (J(0, 11, run=7), J(1, 12, run=7), J(2, 13, run=7)), J(0, 21, run=8),
         "STAT_ACCEPTED"),
    Case("a newer run's round on a finished copy starts afresh (no old result)",
         (Pkt(0), Pkt(1), Pkt(2)), Pkt(1, gen=1, value=9), "STAT_ACCEPTED"),
    Case("a newer run's round replaces an unfinished one of an earlier run",
         (Pkt(0, value=5), Pkt(1, value=5)), Pkt(2, gen=1, value=3), "STAT_ACCEPTED"),
    Case("a newer run's rounds add up from scratch",
         (Pkt(0, value=5), Pkt(1, value=5), Pkt(0, gen=1, value=1), Pkt(1, gen=1, value=2)),
         Pkt(2, gen=1, value=3), "STAT_ACCEPTED", tuple(Reply(h, R, 6) for h in ALL),
         ("STAT_COMPLETED",)),
    Case("a packet of an earlier run is stale", (Pkt(0, gen=2),), Pkt(1, gen=1), "DROP_STALE"),
    Case("generations compare in serial arithmetic (255 < 0)", (Pkt(0, gen=255),),
         Pkt(1, gen=0), "STAT_ACCEPTED"),
    Case("a host outside the job", (), Pkt(3, worker=0), "DROP_UNKNOWN_SENDER"),
    Case("a header worker id that is not the sender's", (), Pkt(0, worker=1),
         "DROP_WRONG_IDENTITY"),
    Case("a slot outside the job's region", (), Pkt(0, slot=SLOTS), "DROP_BAD_SLOT"),
    Case("a result flag from a host", (), Pkt(0, flags=R), "DROP_FORGED_RESULT"),
    Case("another protocol version", (), Pkt(0, version=wire.HOMAGG_VERSION - 1),
         "DROP_BAD_VERSION"),
    Case("a registered sender's packet without its job's key is spoofed: no reply",
         (Pkt(1),), Pkt(0, auth=0), "DROP_SPOOFED"),
    Case("a key one bit off is spoofed too, and adds nothing: the round still waits",
         (Pkt(1), Pkt(2)), Pkt(0, flip=1 << 31), "DROP_SPOOFED"),
    Case("... and the worker's own packet then completes it", (Pkt(1), Pkt(2),
                                                              Pkt(0, flip=1, value=99)),
         Pkt(0), "STAT_ACCEPTED", tuple(Reply(h, R, 3) for h in ALL), ("STAT_COMPLETED",)),
    Case("a join without the job's key is spoofed", (J(1, 12),),
         replace(J(0, 11), auth=0), "DROP_SPOOFED"),
    Case("a header worker id that is not the sender's, without the key: spoofed, unanswered",
         (), Pkt(0, worker=1, auth=0), "DROP_SPOOFED"),
    Case("an unknown op", (), Pkt(0, op=7), "DROP_BAD_OP"),
    Case("a contribution flagged as overflowed (a child switch's partial) flags its round",
         (Pkt(0), Pkt(1)), Pkt(2, flags=OVF), "STAT_ACCEPTED",
         tuple(Reply(h, R | OVF, 3) for h in ALL), ("STAT_COMPLETED", "STAT_OVERFLOW")),
    Case("a truncated packet", (), Pkt(0, size=wire.PACKET_BYTES - 4), "DROP_MALFORMED"),
    Case("an overlong packet", (), Pkt(0, size=wire.PACKET_BYTES + 4), "DROP_BAD_LENGTH"),
    Case("a join carries JOIN_WORDS words whatever K: one of K words is a wrong length", (),
         Pkt(0, seq=11, value=0, op=wire.OP_JOIN, size=wire.PACKET_BYTES), "DROP_BAD_LENGTH"),
    Case("a join of the header alone is truncated", (),
         Pkt(0, seq=11, value=0, op=wire.OP_JOIN, size=wire.HOMAGG_HDR_BYTES), "DROP_MALFORMED"),
    Case("a packet of another K (64 words) is truncated for this switch", (),
         Pkt(0, size=wire.packet_bytes(64)), "DROP_MALFORMED"),
]
# A registered sender's packet dropped for one of these is answered (FLAG_REFUSED, the reason
# in the last word) so that its agent can say why; every other drop is silent.
REFUSED = {"DROP_STALE", "DROP_SEQ_MISMATCH", "DROP_WRONG_IDENTITY", "DROP_BAD_SLOT"}
CASES = [replace(c, replies=(Reply(c.probe.host, R | F | (P if c.probe.phase else 0),
                                   refused=c.counter),))
         if c.counter in REFUSED else c for c in CASES] + TREE_CASES


# -- targets ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["model", "soft-native", "soft-python", "bmv2"])
def target(request):
    """``soft-*``: the software aggregator behind its UDP server (the server's rules too), with
    each of its engines."""
    if request.param == "model":
        t = ModelTarget()
    elif request.param.startswith("soft"):
        t = SoftUdpTarget(WORKERS + 1, engine=soft_engine(request.param))
    else:
        reason = bmv2_skip_reason()
        if reason:
            pytest.skip(reason)
        t = Bmv2Target(request.getfixturevalue("testbed"))
    t.installed = []  # the case's job: removed before the next case's
    yield t
    for j in t.installed:
        t.remove_job(j)
    t.close()


def install_case_job(target, job: int, tree: bool) -> None:
    """The case's job over hosts ALL, alone on the switch; with ``tree``, a child job whose
    parent is host PARENT (through switch port PARENT + 1, where the target knows ports)."""
    for j in getattr(target, "installed", []):
        target.remove_job(j)
    uplink = None
    if tree:
        ip, port = target.addr(PARENT)
        uplink = UplinkSpec(PJ, LW, ip, port, host_mac(PARENT), wire.HOMAGG_UDP_PORT_MIN,
                            PARENT + 1, PKEY)
    target.add_job(job, list(ALL), SLOTS, uplink=uplink, key=key_of(job))
    target.installed, target.uplink = [job], uplink
    target.drain()


def send_in_order(target, host: int, payload: bytes) -> None:
    """One packet, taken by the switch before the next is sent: a case's packets are in
    order (say, a join before the parent's answer to it), and neither bmv2 nor a server's
    sockets keep the order of packets from different hosts."""
    if target.synchronous:
        target.send(host, payload)
        return
    rx = target.stats()["switch"]["STAT_RX"]
    target.send(host, payload)
    # bounded, and not an error here: the case's counter check says what went wrong
    deadline = time.monotonic() + 2.0
    while target.stats()["switch"]["STAT_RX"] == rx and time.monotonic() < deadline:
        time.sleep(0.005)


def settled_stats(target, before: dict[str, int], moved: set[str], timeout: float = 2.0):
    """bmv2 counts asynchronously: wait (bounded) until the counters we expect have moved."""
    deadline = time.monotonic() + timeout
    while True:
        now = target.stats()["switch"]
        if all(now[n] > before[n] for n in moved) or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


def salted(p: Pkt, n: int) -> Pkt:
    """A worker's join with its nonce made unique to the case's turn ``n``: join.p4 keeps each
    worker's last join nonce across job incarnations, and a case's fixed nonces would look
    like retransmissions of an earlier case's on the same job id (agents' nonces are random)."""
    return replace(p, seq=p.seq + (n << 8)) if p.op == wire.OP_JOIN and p.host != PARENT else p


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule(target, case):
    n = next(_job_ids)
    job = 1 + n % (wire.MAX_JOBS - 1)  # the previous case's job is removed
    install_case_job(target, job, case.tree)
    for p in case.setup:
        p = salted(p, n)
        send_in_order(target, p.host, p.payload(job))
    hosts = range(WORKERS + 1)
    target.recv_all(0 if target.synchronous else 0.3, hosts, expect=0)  # the setup's replies
    before = target.stats()["switch"]
    probe = salted(case.probe, n)
    send_in_order(target, probe.host, probe.payload(job))
    got = target.recv_all(0 if target.synchronous else 0.5, hosts, expect=len(case.replies))
    moved = {"STAT_RX", case.counter, *case.also}
    after = settled_stats(target, before, moved)

    delta = {n: after[n] - before[n] for n in after if after[n] != before[n]}
    assert delta == {n: 1 for n in moved}, f"counters moved: {delta}"

    expect = {r.host: r for r in case.replies}
    for host in range(WORKERS + 1):
        pkts = got.get(host, [])
        if host not in expect:
            assert not pkts, f"host {host} got {len(pkts)} unexpected packet(s)"
            continue
        r = expect[host]
        assert len(pkts) == 1, f"host {host}: {len(pkts)} replies"
        pkt = pkts[0]
        assert pkt.flags == r.flags, f"host {host}: flags {pkt.flags:#x}, expected {r.flags:#x}"
        # a join's replies say K, the switch's words per packet, in the slot field
        slot = K if case.probe.op == wire.OP_JOIN else case.probe.slot
        slot = slot if r.slot is None else r.slot
        seq = probe.seq if r.seq is None else r.seq
        assert (pkt.job, pkt.slot) == (job if r.job is None else r.job, slot)
        # up to the parent with its job's key; down here, and answers, with this job's
        assert pkt.auth == (PKEY if r.job == PJ else key_of(job)), f"host {host}: key"
        assert seq == ANY or pkt.seq == seq
        if r.job == PJ:  # up to the parent: this switch's worker id there
            assert pkt.worker == LW
        if r.gen is not None:
            assert pkt.gen == r.gen
        if r.value is not None:
            n = wire.JOIN_WORDS if case.probe.op == wire.OP_JOIN else K
            expected_words = np.full(n, r.value, np.int64).astype(np.uint32).view(np.int32)
            if r.run is not None:
                expected_words[wire.JOIN_RUN_WORD] = r.run
            np.testing.assert_array_equal(pkt.words, expected_words)
        if r.refused is not None:
            assert pkt.words[-1] == wire.STAT_INDEX[r.refused] and not pkt.words[:-1].any()
        if r.status is not None:
            assert pkt.status == r.status
            assert not pkt.words[:-3].any()  # (STATUS_WORD at K words)
