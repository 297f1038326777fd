"""The switch's rules, once, in Python: state and a packet in; verdict, counters and replies out.

This is p4/homagg.p4's aggregation pipeline as a pure model (no sockets, no clock): admission
(include/control/admission.p4), the join (join.p4), the slot state machine (slot_state.p4),
the words and the round's overflow bit (words.p4, with lanes.p4's int32 lane arithmetic) and
the replies (reply.p4). The software aggregator (``homagg.targets.soft``) is this model on a
UDP socket; the in-memory simulator (``homagg.host_agent.simulate``) adds words with
``lane_add``/``lane_or``; and one table-driven conformance suite (bmv2_tests/
test_conformance.py) holds the model, the software target and bmv2 to the same verdicts,
counters, flags and replies.

Names of verdicts and counters are the P4 program's (generated constants): a new drop reason
there is a new counter here without an edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from homagg import wire
from homagg.wire import (  # the protocol's constants, generated from the P4 program
    DROP_BAD_LENGTH,
    DROP_BAD_OP,
    DROP_BAD_SLOT,
    DROP_BAD_VERSION,
    DROP_FORGED_RESULT,
    DROP_MALFORMED,
    DROP_PARENT_DUP,
    DROP_SEQ_MISMATCH,
    DROP_SPOOFED,
    DROP_STALE,
    DROP_UNKNOWN_SENDER,
    DROP_WRONG_IDENTITY,
    FLAG_OVERFLOW,
    FLAG_PHASE,
    FLAG_REFUSED,
    FLAG_RESULT,
    FLAG_RETRANS,
    FLAG_STATUS,
    FLAG_UPSTREAM,
    HOMAGG_HDR_BYTES,
    HOMAGG_VERSION,
    JOB_STAT_ACCEPTED,
    JOB_STAT_COMPLETED,
    JOB_STAT_DROPPED,
    JOB_STAT_RETRANS,
    JOIN_BYTES,
    OP_ADD,
    OP_JOIN,
    OP_OR,
    STAT_ACCEPTED,
    STAT_COMPLETED,
    STAT_DUP_PENDING,
    STAT_FROM_PARENT,
    STAT_JOIN_AFRESH,
    STAT_OVERFLOW,
    STAT_PARTIAL_RESENT,
    STAT_PARTIAL_UP,
    STAT_RETRANS_REPLY,
    STAT_RX,
    Verdict,  # the P4 program's enum Verdict (types.p4), generated
)

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# The verdicts by name, at a global's cost: the per-packet path compares them, and looking an
# enum member up on its class costs five times as much (Python 3.11)
ACCEPT, RETRANS_REPLY, DUP_PENDING = Verdict.ACCEPT, Verdict.RETRANS_REPLY, Verdict.DUP_PENDING
SEQ_MISMATCH, STALE, RESEND_UP = Verdict.SEQ_MISMATCH, Verdict.STALE, Verdict.RESEND_UP


def lane_add(acc: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int32 lane-wise add as the switch does it: the wrapped sum and, per lane, whether it
    overflowed (operands of one sign, sum of the other: lanes.p4)."""
    a = np.asarray(acc, np.int32)
    b = np.asarray(words, np.int32)
    wide = a.astype(np.int64) + b
    return wide.astype(np.int32), (wide > INT32_MAX) | (wide < INT32_MIN)


def lane_or(acc: np.ndarray, words: np.ndarray) -> np.ndarray:
    return np.asarray(acc, np.int32) | np.asarray(words, np.int32)


def newer(seq: int, tag: int) -> bool:
    """seq is after tag in serial arithmetic: (int<32>)(seq - tag) > 0."""
    d = (seq - tag) & 0xFFFFFFFF
    return 0 < d < 0x80000000


def newer_gen(gen: int, than: int) -> bool:
    """A run generation after another, in 8-bit serial arithmetic: (int<8>)(gen - than) > 0."""
    d = (gen - than) & 0xFF
    return 0 < d < 0x80


Address = tuple[str, int]


@dataclass(frozen=True)
class Uplink:
    """A tree job's parent (uplink.p4): this switch is worker ``worker`` of job ``job`` at the
    parent switch, whose homagg address is ``parent``. A round complete here goes up as one
    contribution (the partial sum); the parent's result (the final) comes down from
    ``parent`` and is multicast to this switch's workers."""

    job: int
    worker: int
    parent: Address
    port: int | None = None  # the switch port to the parent (None: the target cannot tell)


@dataclass
class JobEntry:
    """What the controller installs for a job (the job table and its multicast group)."""

    id: int
    workers: list[Address]          # worker id -> (ip, udp port)
    epoch: int
    base: int
    size: int
    ports: list[int] | None = None  # worker id -> switch port (None: the target cannot tell)
    #: where a completed round's result goes, one datagram per entry (the multicast group's
    #: replicas as egress addresses them); None: to every worker's own address
    results: list[Address] | None = None
    #: a tree's leaf (or any switch below the root): where its partial sums go
    uplink: Uplink | None = None

    @property
    def result_addresses(self) -> list[Address]:
        """Where a completed round's (or join's) result goes."""
        return self.workers if self.results is None else self.results

    @property
    def group(self) -> int:
        return self.id + 1


@dataclass
class Outcome:
    """What one packet did: the counter it moved (a STATS name), the verdict of the slot state
    machine (None if admission dropped it), and the datagrams that go out."""

    counter: str
    verdict: Verdict | None = None
    replies: list[tuple[bytes, Address]] = field(default_factory=list)


class SlotMemory:
    """The slot registers, 2 copies per slot (index 2 * slot + phase). The bookkeeping is in
    Python lists, not arrays: the per-packet path reads and writes single cells, which a list
    does several times faster than numpy's scalar indexing."""

    def __init__(self, slots: int, k: int = wire.WORDS_PER_PACKET):
        n = 2 * slots
        self.seen = [0] * n
        self.count = [0] * n
        self.tag = [0] * n
        self.op = [0] * n
        self.epoch = [0] * n
        self.gen = [0] * n
        self.overflow = [False] * n
        self.final = [False] * n  # a tree job's copy holds the parent's result, not a partial
        self.words = np.zeros((n, k), np.int32)


class SwitchModel:
    """One switch's aggregation state: the job table, the slot pool and the counters.
    ``words``: K, the words per packet (the P4 program's build-time WORDS_PER_PACKET)."""

    def __init__(self, slots: int = wire.SLOTS, words: int = wire.WORDS_PER_PACKET):
        self.slots = slots
        self.k = wire.check_words(words)
        self.packet_bytes = wire.packet_bytes(words)
        self.mem = SlotMemory(slots, words)
        self.stats = np.zeros(wire.STATS_SIZE, np.int64)
        self.job_stats = np.zeros(wire.JOB_STATS_SIZE, np.int64)
        self.senders: dict[Address, tuple[JobEntry, int]] = {}
        self.jobs: dict[int, JobEntry] = {}
        # uplink.p4's parent table: (parent address, parent's job id) -> the job here
        self.children_of: dict[tuple[Address, int], JobEntry] = {}
        # join.p4's registers: per job id [seen, count, gen, epoch, final, handed, held, run]
        # (final: the join is complete at the root, not only here; handed: the generation it
        # handed out, the root's in a tree; held: the parent's answer came while the join
        # here was pending, and handed is its generation; run: the attempt the current join
        # belongs to); per (job, worker) nonce
        self.join_state: dict[int, list[int]] = {}
        self.join_nonce: dict[tuple[int, int], int] = {}

    # -- the control plane's writes ------------------------------------------------------------
    def install(self, job: JobEntry) -> None:
        self.jobs[job.id] = job
        for w, addr in enumerate(job.workers):
            self.senders[addr] = (job, w)
        if job.uplink is not None:
            self.children_of[(job.uplink.parent, job.uplink.job)] = job

    def uninstall(self, job_id: int) -> JobEntry:
        job = self.jobs.pop(job_id)
        for addr in job.workers:
            self.senders.pop(addr, None)
        if job.uplink is not None:
            self.children_of.pop((job.uplink.parent, job.uplink.job), None)
        return job

    def clear_job_stats(self, job_id: int) -> None:
        k = wire.JOB_STATS_PER_JOB
        self.job_stats[job_id * k:(job_id + 1) * k] = 0

    # -- the data plane ------------------------------------------------------------------------
    def _count(self, name: str) -> None:
        self.stats[wire.STAT_INDEX[name]] += 1

    def _job_count(self, job: JobEntry, kind: int) -> None:
        self.job_stats[job.id * wire.JOB_STATS_PER_JOB + kind] += 1

    def process(self, data: bytes, src: Address, port: int | None = None) -> Outcome:
        """One datagram from ``src`` (arriving on switch ``port``, where the target knows it).

        Written for speed (the software aggregator runs it per packet): header fields by
        position, counters by index."""
        stats = self.stats
        stats[STAT_RX] += 1
        # admission.p4
        n = len(data)
        if n < HOMAGG_HDR_BYTES:
            return self._drop(DROP_MALFORMED)
        # (from here on, a reply to a join says K in its slot field: _reply)
        h = wire.decode_header(data)
        if h.op == OP_JOIN:  # JOIN_WORDS words, whatever K (parser.p4)
            if n != JOIN_BYTES:
                return self._drop(DROP_MALFORMED if n < JOIN_BYTES else DROP_BAD_LENGTH)
        elif n != self.packet_bytes:  # short: the words do not parse; long: a wrong length
            return self._drop(DROP_MALFORMED if n < self.packet_bytes else DROP_BAD_LENGTH)
        if h.version != HOMAGG_VERSION:
            return self._drop(DROP_BAD_VERSION)
        op = h.op
        if op != OP_ADD and op != OP_OR and op != OP_JOIN:
            return self._drop(DROP_BAD_OP)
        flags = h.flags
        if flags & FLAG_RESULT:
            # only a tree job's parent sends results to a switch (uplink.p4)
            child = self.children_of.get((src, h.job)) if self.children_of else None
            if child is None:
                return self._drop(DROP_FORGED_RESULT)
            up = child.uplink
            if port is not None and up is not None and up.port is not None and port != up.port:
                return self._drop(DROP_SPOOFED, child)
            return self._from_parent(data, h, child)
        hit = self.senders.get(src)
        if hit is None:
            return self._drop(DROP_UNKNOWN_SENDER)
        job, worker = hit
        if port is not None and job.ports is not None and port != job.ports[worker]:
            return self._drop(DROP_SPOOFED, job)
        join = op == OP_JOIN
        if h.job != job.id or h.worker != worker:
            return self._refuse(DROP_WRONG_IDENTITY, job, data, src, flags, join=join)
        slot = h.slot
        if slot >= job.size:
            return self._refuse(DROP_BAD_SLOT, job, data, src, flags, join=join)

        if join:
            return self._join(data, src, h, job, worker)
        m = self.mem
        seq = h.seq
        gen = h.gen
        idx = 2 * (job.base + slot) + (1 if flags & FLAG_PHASE else 0)
        me = 1 << worker
        workers = len(job.workers)
        verdict, count = self._slot_state(idx, job.epoch, workers, me, seq, gen, op)

        kinds = wire.JOB_STATS_PER_JOB * job.id
        jstats = self.job_stats
        if verdict is ACCEPT:
            result = self._merge_words(
                idx, np.frombuffer(data, ">i4", self.k, HOMAGG_HDR_BYTES).astype(np.int32),
                count == 1, op, flags & FLAG_OVERFLOW != 0)
            stats[STAT_ACCEPTED] += 1
            jstats[kinds + JOB_STAT_ACCEPTED] += 1
            out = Outcome("STAT_ACCEPTED", verdict)
            if count == workers and job.uplink is not None:  # uplink.p4: the partial goes up
                stats[STAT_PARTIAL_UP] += 1
                out.replies = [self._up(data, job.uplink, flags, idx)]
            elif count == workers:  # reply.p4: complete, multicast to the job's workers
                m.final[idx] = True
                stats[STAT_COMPLETED] += 1
                jstats[kinds + JOB_STAT_COMPLETED] += 1
                rflags = FLAG_RESULT | (flags & FLAG_PHASE)
                if m.overflow[idx]:
                    rflags |= FLAG_OVERFLOW
                    stats[STAT_OVERFLOW] += 1
                pkt = _reply(data, rflags, result)
                out.replies = [(pkt, a) for a in job.result_addresses]
            return out
        if verdict is RETRANS_REPLY:
            stats[STAT_RETRANS_REPLY] += 1
            jstats[kinds + JOB_STAT_RETRANS] += 1
            rflags = FLAG_RESULT | FLAG_RETRANS | (flags & FLAG_PHASE)
            if m.overflow[idx]:
                rflags |= FLAG_OVERFLOW
            return Outcome("STAT_RETRANS_REPLY", verdict, [(_reply(data, rflags, m.words[idx]),
                                                            src)])
        if verdict is RESEND_UP:
            stats[STAT_PARTIAL_RESENT] += 1
            jstats[kinds + JOB_STAT_RETRANS] += 1
            return Outcome("STAT_PARTIAL_RESENT", verdict,
                           [self._up(data, job.uplink, flags, idx)])  # type: ignore[arg-type]
        if verdict is DUP_PENDING:
            stats[STAT_DUP_PENDING] += 1
            jstats[kinds + JOB_STAT_RETRANS] += 1
            rflags = FLAG_RESULT | FLAG_STATUS | (flags & FLAG_PHASE)
            status = wire.status_words(m.seen[idx], m.count[idx], self.k)
            return Outcome("STAT_DUP_PENDING", verdict, [(_reply(data, rflags, status), src)])
        out = self._refuse(DROP_SEQ_MISMATCH if verdict is SEQ_MISMATCH else DROP_STALE,
                           job, data, src, flags)
        out.verdict = verdict
        return out

    def _slot_state(self, idx: int, epoch: int, workers: int, me: int, seq: int, gen: int,
                    op: int) -> tuple[Verdict, int]:
        """slot_state.p4, for a packet of worker bit ``me`` (round ``seq`` of run ``gen``, job
        incarnation ``epoch``) on slot copy ``idx``: its verdict and, on ACCEPT, the copy's
        new state, the accept step both packet paths share. The worker joins the round, a new
        one if it is the first (the copy's last round done, another run's or incarnation's),
        and leaves the slot's other copy (its next round there is a new one); the copy holds
        a partial sum until the round completes. Returns the verdict and the round's count
        after the packet (1: it started the round; 0: not accepted, nothing written)."""
        m = self.mem
        seen, count, tag = m.seen[idx], m.count[idx], m.tag[idx]
        if m.epoch[idx] != epoch:
            seen = 0
        elif m.gen[idx] != gen:  # another run's state: an earlier one's is empty to us
            if not newer_gen(gen, m.gen[idx]):
                return STALE, 0
            seen = 0
        elif seen & me:
            if count == workers and tag == seq:
                if m.final[idx]:
                    return RETRANS_REPLY, 0  # the final result again
                # a tree's round still at the parent: its designated worker sends the partial
                # up again, the others get a status (one resend per timeout, not one each)
                return (RESEND_UP if me == 1 << (seq & (workers - 1)) else DUP_PENDING), 0
            return (DUP_PENDING if tag == seq else STALE), 0
        elif seen == 0:
            if not newer(seq, tag):
                return STALE, 0
        elif count >= workers or newer(tag, seq):
            return STALE, 0  # finished and this worker moved on, or an older round
        elif tag != seq or m.op[idx] != op:
            return SEQ_MISMATCH, 0
        # ACCEPT: a round's first packet where seen is 0 (cleared above for a new run or
        # incarnation), else one more in the round
        seen, count = (me, 1) if seen == 0 else (seen | me, count + 1)
        m.seen[idx], m.count[idx], m.tag[idx] = seen, count, seq
        m.op[idx], m.epoch[idx], m.gen[idx] = op, epoch, gen
        m.seen[idx ^ 1] &= ~me
        m.final[idx] = False
        return ACCEPT, count

    def _merge_words(self, at: int | list[int], words: np.ndarray, first: bool, op: int,
                     flagged) -> np.ndarray:
        """words.p4 for accepted packets, all of them the first of their rounds or none: into
        slot copy ``at`` its ``words`` (K int32), or into each of a list of copies a row of
        ``words``. A round's first packet replaces the copy's words and clears its overflow
        bit; a later one adds (int32 arrays wrap, as the switch's lanes do; a lane where both
        operands' signs differ from the sum's overflowed, lanes.p4, and sets the bit) or ORs.
        ``flagged`` (a bool, or one per row): the packet says FLAG_OVERFLOW, a child switch's
        partial sum overflowed (trees), which sets the bit too. Returns the new words."""
        m = self.mem
        over = flagged
        if first:
            total = words
        elif op == OP_ADD:
            acc = m.words[at]
            total = acc + words
            lanes = ((acc ^ total) & (words ^ total)).min(axis=-1) < 0
            # one packet: Python bools (a numpy scalar's | costs as much as the add)
            over = (flagged or bool(lanes)) if isinstance(at, int) else lanes | flagged
        else:
            total = m.words[at] | words
        m.words[at] = total
        kept = not first  # a later packet keeps the round's bit; the first starts it afresh
        if isinstance(at, int):
            m.overflow[at] = over or (kept and m.overflow[at])
        elif over is not False:  # a bit per row
            for i, o in zip(at, over.tolist()):
                if o or not kept:
                    m.overflow[i] = o
        elif not kept:
            for i in at:
                m.overflow[i] = False
        return total

    # -- trees (uplink.p4) ----------------------------------------------------------------------
    def _up(self, data: bytes, up: Uplink, flags: int, idx: int) -> tuple[bytes, Address]:
        """The partial sum of slot copy ``idx`` as this switch's contribution to its parent's
        job: the worker's header (slot, round tag, gen, phase) with the parent job's identity,
        and the round's overflow as a flag the parent merges into its own."""
        rflags = (flags & FLAG_PHASE) | (FLAG_OVERFLOW if self.mem.overflow[idx] else 0)
        return _reply(data, rflags, self.mem.words[idx], job=up.job, worker=up.worker), up.parent

    def _from_parent(self, data: bytes, h: wire.Header, job: JobEntry) -> Outcome:
        """A tree job's parent answers this switch: its result (the final sum) is kept in the
        slot copy, so that retransmissions get it, and multicast to the workers here; its
        status replies and refusals are relayed to them marked FLAG_UPSTREAM."""
        if h.op == OP_JOIN:
            return self._join_from_parent(data, h, job)
        stats, flags = self.stats, h.flags
        kinds = wire.JOB_STATS_PER_JOB * job.id
        slot = h.slot
        if slot >= job.size:
            return self._drop(DROP_BAD_SLOT, job)
        m = self.mem
        idx = 2 * (job.base + slot) + (1 if flags & FLAG_PHASE else 0)
        # the round must be the one this switch sent up and still waits for
        if not (m.epoch[idx] == job.epoch and m.gen[idx] == h.gen and m.tag[idx] == h.seq
                and m.count[idx] == len(job.workers) and not m.final[idx]):
            return self._drop(DROP_PARENT_DUP, job)
        stats[STAT_FROM_PARENT] += 1
        out = Outcome("STAT_FROM_PARENT")
        if flags & (FLAG_STATUS | FLAG_REFUSED):
            pkt = _reply(data, (flags & ~FLAG_RETRANS) | FLAG_UPSTREAM,
                         np.frombuffer(data, ">i4", self.k, HOMAGG_HDR_BYTES), job=job.id)
            out.replies = [(pkt, a) for a in job.result_addresses]
            return out
        m.words[idx] = np.frombuffer(data, ">i4", self.k, HOMAGG_HDR_BYTES)
        m.overflow[idx] = m.overflow[idx] or bool(flags & FLAG_OVERFLOW)
        m.final[idx] = True
        stats[STAT_COMPLETED] += 1
        self.job_stats[kinds + JOB_STAT_COMPLETED] += 1
        rflags = FLAG_RESULT | (flags & FLAG_PHASE)
        if m.overflow[idx]:
            rflags |= FLAG_OVERFLOW
            stats[STAT_OVERFLOW] += 1
        pkt = _reply(data, rflags, m.words[idx], job=job.id)
        out.replies = [(pkt, a) for a in job.result_addresses]
        return out

    def process_run(self, run, size: int, src: Address) -> list[tuple[bytes, Address]]:
        """Datagrams of ``size`` bytes end to end (the last may be shorter), all from ``src``
        (a coalesced receive, ``homagg.udpio``); the datagrams to send out, as ``process``
        one by one would give them (same state, counters and replies; replies grouped by
        kind, not interleaved by arrival).

        The common case, a worker's burst of a round's packets to distinct slots, is taken
        with array operations: the words of every accepted packet added at once, and the
        replies of every completed round built at once. Anything else (another size, a
        join, an unknown sender, a refusal, two packets for one slot) goes through
        ``process`` packet by packet, and so does every packet whose verdict is not ACCEPT:
        distinct slots never touch each other's state, so the order does not matter."""
        view = memoryview(run).cast("B")
        n = len(view) // size if size else 0
        hit = self.senders.get(src)
        rec = (np.frombuffer(view, wire.packet_dtype(self.k), n)
               if size == self.packet_bytes and n * size == len(view) and n > 1
               and hit is not None else None)  # (no switch port here: nothing is SPOOFED)
        if rec is not None:
            job, worker = hit  # type: ignore[misc]
            vo, flags, slots = rec["version_op"], rec["flags"], rec["slot"]
            if not ((vo >> 4 == HOMAGG_VERSION).all()
                    and ((vo & 0xF) == (vo[0] & 0xF)).all()
                    and vo[0] & 0xF in (OP_ADD, OP_OR)
                    and not (flags & FLAG_RESULT).any()
                    and (rec["job"] == job.id).all() and (rec["worker"] == worker).all()
                    and int(slots.max()) < job.size and np.unique(slots).size == n):
                rec = None
        if rec is None:
            out = []
            for at in range(0, len(view), size or 1):
                out += self.process(bytes(view[at:at + size]), src).replies
            return out
        return self._accept_run(view, rec, job, worker, src)

    def _accept_run(self, view: memoryview, rec: np.ndarray, job: JobEntry, worker: int,
                    src: Address) -> list[tuple[bytes, Address]]:
        """``process_run``'s array path: admission passed for every packet of ``rec``."""
        m, size, op = self.mem, self.packet_bytes, int(rec["version_op"][0] & 0xF)
        workers, me, epoch = len(job.workers), 1 << worker, job.epoch
        phase = (rec["flags"] & FLAG_PHASE) != 0
        idxs = (2 * (job.base + rec["slot"].astype(np.int64)) + phase).tolist()
        seqs, gens = rec["seq"].tolist(), rec["gen"].tolist()
        out: list[tuple[bytes, Address]] = []
        # rows accepted: first of their round, added to it; rows that completed it
        fresh: list[int] = []
        added: list[int] = []
        done: list[int] = []
        for r, (idx, seq, gen) in enumerate(zip(idxs, seqs, gens)):
            verdict, count = self._slot_state(idx, epoch, workers, me, seq, gen, op)
            if verdict is not ACCEPT:
                out += self.process(bytes(view[r * size:(r + 1) * size]), src).replies
                continue
            (fresh if count == 1 else added).append(r)
            if count == workers:
                done.append(r)
        accepted = len(fresh) + len(added)
        if not accepted:
            return out
        words = rec["words"]
        flagged = (rec["flags"] & FLAG_OVERFLOW) != 0
        for rows, first in ((fresh, True), (added, False)):
            if rows:
                self._merge_words([idxs[r] for r in rows], words[rows], first, op,
                                  flagged[rows] if flagged.any() else False)
        stats, jstats = self.stats, self.job_stats
        kinds = wire.JOB_STATS_PER_JOB * job.id
        stats[STAT_RX] += accepted
        stats[STAT_ACCEPTED] += accepted
        jstats[kinds + JOB_STAT_ACCEPTED] += accepted
        if done:  # reply.p4: complete, multicast to the job's workers (uplink.p4: or go up)
            at = [idxs[r] for r in done]
            ovf = np.array([m.overflow[i] for i in at])
            replies = rec[done].copy()
            replies["flags"] = ((replies["flags"] & FLAG_PHASE)
                                | np.where(ovf, FLAG_OVERFLOW, 0))
            replies["words"] = m.words[at]
            up = job.uplink
            if up is None:
                replies["flags"] |= FLAG_RESULT
                for i in at:
                    m.final[i] = True
                stats[STAT_COMPLETED] += len(done)
                jstats[kinds + JOB_STAT_COMPLETED] += len(done)
                stats[STAT_OVERFLOW] += int(ovf.sum())
                dests = job.result_addresses
            else:
                replies["job"], replies["worker"] = up.job, up.worker
                stats[STAT_PARTIAL_UP] += len(done)
                dests = [up.parent]
            blob = replies.tobytes()
            pkts = [blob[i * size:(i + 1) * size] for i in range(len(done))]
            for a in dests:
                out += [(p, a) for p in pkts]
        return out

    def _join(self, data: bytes, src: Address, h: wire.Header, job: JobEntry, worker: int
              ) -> Outcome:
        """join.p4: a new run's barrier; the reply carries the run's generation. In a tree, a
        join complete here goes up as this switch's join of the parent's job, and the run's
        generation is the one the root hands out (``_join_from_parent``)."""
        st = self.join_state.setdefault(job.id, [0, 0, 0, 0, 0, 0, 0, 0])
        seen, count, gen, epoch, final, handed, held, run = st
        same_epoch = epoch == job.epoch
        if not same_epoch:
            seen, count, held = 0, 0, 0
        me = 1 << worker
        nonce = h.seq
        workers = len(job.workers)
        kinds = wire.JOB_STATS_PER_JOB * job.id
        jstats, stats = self.job_stats, self.stats
        flags = h.flags
        if same_epoch and self.join_nonce.get((job.id, worker), 0) == nonce:
            if not seen & me:
                verdict = STALE
            elif count == workers and not final:  # a tree's join, still at the parent
                stats[STAT_PARTIAL_RESENT] += 1
                jstats[kinds + JOB_STAT_RETRANS] += 1
                return Outcome("STAT_PARTIAL_RESENT", RESEND_UP,
                               [self._join_up(data, job, gen, run)])
            elif count == workers:
                stats[STAT_RETRANS_REPLY] += 1
                jstats[kinds + JOB_STAT_RETRANS] += 1
                rflags = FLAG_RESULT | FLAG_RETRANS | (flags & FLAG_PHASE)
                return Outcome("STAT_RETRANS_REPLY", RETRANS_REPLY,
                               [(self._join_reply(data, rflags, None, handed), src)])
            else:
                stats[STAT_DUP_PENDING] += 1
                jstats[kinds + JOB_STAT_RETRANS] += 1
                rflags = FLAG_RESULT | FLAG_STATUS | (flags & FLAG_PHASE)
                return Outcome("STAT_DUP_PENDING", DUP_PENDING,
                               [(self._join_reply(data, rflags, wire.status_words(
                                   seen, count, wire.JOIN_WORDS), gen), src)])
            out = self._refuse(DROP_STALE, job, data, src, flags, gen, join=True)
            out.verdict = verdict
            return out
        self.join_nonce[(job.id, worker)] = nonce
        # a pending join of another run never completed: its members are not this run's
        afresh = 0 < count < workers and _join_run(data) != run
        if count == workers or count == 0 or afresh:  # the first of a new run: the next gen
            seen, count, gen, run = me, 1, (gen + 1) & 0xFF, _join_run(data)
            if afresh:
                held = 0  # the parent's answer to the other run
                stats[STAT_JOIN_AFRESH] += 1
        elif not seen & me:
            seen, count = seen | me, count + 1
        # else: this worker's process restarted during a join it is counted in
        st[:] = [seen, count, gen, job.epoch, 0, handed, held, run]
        stats[STAT_ACCEPTED] += 1
        jstats[kinds + JOB_STAT_ACCEPTED] += 1
        out = Outcome("STAT_ACCEPTED", ACCEPT)
        if count == workers and job.uplink is not None and not held:  # uplink.p4: goes up
            stats[STAT_PARTIAL_UP] += 1
            out.replies = [self._join_up(data, job, gen, run)]
        elif count == workers:
            # the root hands out its generation; a child job the parent's held answer's
            hand = handed if job.uplink is not None else gen
            st[4:7] = [1, hand, 0]
            stats[STAT_COMPLETED] += 1
            jstats[kinds + JOB_STAT_COMPLETED] += 1
            pkt = self._join_reply(data, FLAG_RESULT | (flags & FLAG_PHASE), None, hand)
            out.replies = [(pkt, a) for a in job.result_addresses]
        return out

    def _join_up(self, data: bytes, job: JobEntry, gen: int, run: int
                 ) -> tuple[bytes, Address]:
        """This switch's join of its parent's job, for the local run ``gen`` of attempt
        ``run``: its nonce is the job's epoch and that generation, so each local run is a new
        run at the parent, and a resend is the same join; the attempt goes up with it."""
        up = job.uplink
        assert up is not None
        words = np.zeros(wire.JOIN_WORDS, np.int32)
        words[wire.JOIN_RUN_WORD] = np.uint32(run).view(np.int32)
        hdr = bytearray(_reply(data, 0, words, 0, job=up.job, worker=up.worker))
        wire.put_field(hdr, "seq", _join_nonce(job.epoch, gen))
        wire.put_field(hdr, "slot", 0)
        return bytes(hdr), up.parent

    def _join_from_parent(self, data: bytes, h: wire.Header, job: JobEntry) -> Outcome:
        """The parent's answer to this switch's join: its result hands out the run's
        generation, kept here for retransmissions and multicast to the workers; a status or
        refusal is relayed to them marked FLAG_UPSTREAM. A result that comes while the join
        here is pending is held (join.p4): the parent completed its join with this switch's
        previous one, and nothing newer went up, so the local join hands it out."""
        st = self.join_state.get(job.id)
        flags = h.flags
        answer = flags & (FLAG_STATUS | FLAG_REFUSED)
        if st is None or st[3] != job.epoch:
            return self._drop(DROP_PARENT_DUP, job)
        workers = len(job.workers)
        waiting = st[1] == workers and not st[4]
        # a status or refusal answers our own join (its nonce); a result is the parent's
        # multicast, which echoes whichever child completed the join, so any newer
        # generation than the last one handed out is ours
        newer = newer_gen(h.gen, st[5])
        if answer and not (waiting and h.seq == _join_nonce(job.epoch, st[2])):
            return self._drop(DROP_PARENT_DUP, job)
        if not answer and not (waiting and newer):
            if 0 < st[1] < workers and not st[6] and newer:
                st[5:7] = [h.gen, 1]
                self.stats[STAT_FROM_PARENT] += 1
                return Outcome("STAT_FROM_PARENT")
            return self._drop(DROP_PARENT_DUP, job)
        self.stats[STAT_FROM_PARENT] += 1
        out = Outcome("STAT_FROM_PARENT")
        words = np.frombuffer(data, ">i4", wire.JOIN_WORDS, wire.OFFSETS["words"])
        if answer:
            pkt = self._join_reply(data, (flags & ~FLAG_RETRANS) | FLAG_UPSTREAM, words,
                                   None, job.id)
        else:
            st[4:7] = [1, h.gen, 0]
            self.stats[STAT_COMPLETED] += 1
            self.job_stats[wire.JOB_STATS_PER_JOB * job.id + JOB_STAT_COMPLETED] += 1
            pkt = self._join_reply(data, FLAG_RESULT | (flags & FLAG_PHASE), None, h.gen,
                                   job.id)
        out.replies = [(pkt, a) for a in job.result_addresses]
        return out

    def _refuse(self, index: int, job: JobEntry, data: bytes, src: Address, flags: int,
                gen: int | None = None, join: bool = False) -> Outcome:
        """A registered sender's packet dropped (reply.p4): counted, and answered with
        FLAG_REFUSED and the reason in the last word, so the agent can say why (``join``: the
        packet is a join, answered as joins are)."""
        out = self._drop(index, job)
        words = np.zeros(wire.JOIN_WORDS if join else self.k, np.int32)
        words[-1] = index
        rflags = FLAG_RESULT | FLAG_REFUSED | (flags & FLAG_PHASE)
        out.replies = [(self._join_reply(data, rflags, words, gen) if join
                        else _reply(data, rflags, words, gen), src)]
        return out

    def _join_reply(self, data: bytes, flags: int, words: np.ndarray | None,
                    gen: int | None, job: int | None = None) -> bytes:
        """A reply to a join: its JOIN_WORDS words (``words``, else zeros) and K in the slot
        field, which is how the agent learns K (reply.p4); ``job``: as ``_reply``."""
        pkt = bytearray(_reply(data, flags, np.zeros(wire.JOIN_WORDS, np.int32)
                               if words is None else words, gen, job))
        wire.put_field(pkt, "slot", self.k)
        return bytes(pkt)

    def _drop(self, index: int, job: JobEntry | None = None) -> Outcome:
        self.stats[index] += 1
        if job is not None:
            self.job_stats[job.id * wire.JOB_STATS_PER_JOB + JOB_STAT_DROPPED] += 1
        return Outcome(wire.STATS[index])


def _reply(data: bytes, flags: int, words: np.ndarray, gen: int | None = None,
           job: int | None = None, worker: int | None = None) -> bytes:
    """The switch echoes the packet's header (worker included) with new flags, and the gen
    the join hands out, followed by ``words``; in a tree, with the job (and worker) of the
    switch it goes to."""
    hdr = bytearray(data[:wire.OFFSETS["words"]])
    hdr[wire.OFFSETS["flags"]] = flags
    if gen is not None:
        hdr[wire.OFFSETS["gen"]] = gen
    if job is not None:
        wire.put_field(hdr, "job", job)
    if worker is not None:
        hdr[wire.OFFSETS["worker"]] = worker
    return bytes(hdr) + np.asarray(words, ">i4").tobytes()


def _join_run(data: bytes) -> int:
    """A join's run (word JOIN_RUN_WORD): the attempt its worker's run belongs to (join.p4)."""
    at = wire.OFFSETS["words"] + 4 * wire.JOIN_RUN_WORD
    return int.from_bytes(data[at:at + 4], "big")


def _join_nonce(epoch: int, gen: int) -> int:
    """A tree job's join of its parent's job, for its local run ``gen``: unique per run and
    job incarnation (uplink.p4)."""
    return (epoch << 8 | gen) & 0xFFFFFFFF
