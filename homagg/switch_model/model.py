"""The model's data plane: admission, the slot state machine, the words, the replies (one
packet, or a run of packets), and a tree's partial sums going up and results coming down."""

from __future__ import annotations

import numpy as np

from homagg import wire
from homagg.switch_model.join import JoinRules
from homagg.switch_model.state import (
    ACCEPT,
    DUP_PENDING,
    RESEND_UP,
    RETRANS_REPLY,
    SEQ_MISMATCH,
    STALE,
    Address,
    JobEntry,
    Outcome,
    ParentLink,
    newer,
    newer_gen,
    reply,
)
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
    JOB_STAT_RETRANS,
    JOIN_BYTES,
    OP_ADD,
    OP_JOIN,
    OP_OR,
    STAT_ACCEPTED,
    STAT_COMPLETED,
    STAT_DUP_PENDING,
    STAT_FROM_PARENT,
    STAT_OVERFLOW,
    STAT_PARTIAL_RESENT,
    STAT_PARTIAL_UP,
    STAT_RETRANS_REPLY,
    STAT_RX,
    Verdict,
)


class SwitchModel(JoinRules):
    """One switch's aggregation state and rules: ``process`` one datagram, or ``process_run``
    a run of them. ``words``: K, the words per packet (the P4 program's build-time
    WORDS_PER_PACKET)."""

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
            # only a tree job's parent sends results to a switch, with its job's key (uplink.p4)
            child = self.children_of.get((src, h.job, h.auth)) if self.children_of else None
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
        if h.auth != job.auth:  # (headers.p4: what the key keeps out)
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
                pkt = reply(data, rflags, result)
                out.replies = [(pkt, a) for a in job.result_addresses]
            return out
        if verdict is RETRANS_REPLY:
            stats[STAT_RETRANS_REPLY] += 1
            jstats[kinds + JOB_STAT_RETRANS] += 1
            rflags = FLAG_RESULT | FLAG_RETRANS | (flags & FLAG_PHASE)
            if m.overflow[idx]:
                rflags |= FLAG_OVERFLOW
            return Outcome("STAT_RETRANS_REPLY", verdict, [(reply(data, rflags, m.words[idx]),
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
            return Outcome("STAT_DUP_PENDING", verdict, [(reply(data, rflags, status), src)])
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
    def _up(self, data: bytes, up: ParentLink, flags: int, idx: int) -> tuple[bytes, Address]:
        """The partial sum of slot copy ``idx`` as this switch's contribution to its parent's
        job: the worker's header (slot, round tag, gen, phase) with the parent job's identity,
        and the round's overflow as a flag the parent merges into its own."""
        rflags = (flags & FLAG_PHASE) | (FLAG_OVERFLOW if self.mem.overflow[idx] else 0)
        return (reply(data, rflags, self.mem.words[idx], job=up.job, worker=up.worker,
                      auth=up.auth), up.parent)

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
            pkt = reply(data, (flags & ~FLAG_RETRANS) | FLAG_UPSTREAM,
                         np.frombuffer(data, ">i4", self.k, HOMAGG_HDR_BYTES), job=job.id,
                         auth=job.auth)
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
        pkt = reply(data, rflags, m.words[idx], job=job.id, auth=job.auth)
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
                    and (rec["auth"] == job.auth).all()
                    and int(slots.max()) < job.size and np.unique(slots).size == n):
                rec = None
        if rec is None:
            out = []
            # (an empty datagram is one packet too: DROP_MALFORMED, counted)
            for at in range(0, max(len(view), 1), size or 1):
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
                replies["job"], replies["worker"], replies["auth"] = up.job, up.worker, up.auth
                stats[STAT_PARTIAL_UP] += len(done)
                dests = [up.parent]
            blob = replies.tobytes()
            pkts = [blob[i * size:(i + 1) * size] for i in range(len(done))]
            for a in dests:
                out += [(p, a) for p in pkts]
        return out
