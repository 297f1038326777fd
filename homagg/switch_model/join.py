"""join.p4 in the model: a new run's barrier, in a tree its trip to the parent and back."""

from __future__ import annotations

import numpy as np

from homagg import wire
from homagg.switch_model.core import SwitchCore
from homagg.switch_model.state import (
    ACCEPT,
    DUP_PENDING,
    RESEND_UP,
    RETRANS_REPLY,
    STALE,
    Address,
    JobEntry,
    Outcome,
    newer_gen,
    reply,
)
from homagg.wire import (  # the protocol's constants, generated from the P4 program
    DROP_PARENT_DUP,
    DROP_STALE,
    FLAG_PHASE,
    FLAG_REFUSED,
    FLAG_RESULT,
    FLAG_RETRANS,
    FLAG_STATUS,
    FLAG_UPSTREAM,
    JOB_STAT_ACCEPTED,
    JOB_STAT_COMPLETED,
    JOB_STAT_RETRANS,
    STAT_ACCEPTED,
    STAT_COMPLETED,
    STAT_DUP_PENDING,
    STAT_FROM_PARENT,
    STAT_JOIN_AFRESH,
    STAT_PARTIAL_RESENT,
    STAT_PARTIAL_UP,
    STAT_RETRANS_REPLY,
)


class JoinRules(SwitchCore):
    """The join's rules (join.p4, and uplink.p4 for a tree's join)."""

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
                               [(self._joinreply(data, rflags, None, handed), src)])
            else:
                stats[STAT_DUP_PENDING] += 1
                jstats[kinds + JOB_STAT_RETRANS] += 1
                rflags = FLAG_RESULT | FLAG_STATUS | (flags & FLAG_PHASE)
                return Outcome("STAT_DUP_PENDING", DUP_PENDING,
                               [(self._joinreply(data, rflags, wire.status_words(
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
            pkt = self._joinreply(data, FLAG_RESULT | (flags & FLAG_PHASE), None, hand)
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
        hdr = bytearray(reply(data, 0, words, 0, job=up.job, worker=up.worker, auth=up.auth))
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
            pkt = self._joinreply(data, (flags & ~FLAG_RETRANS) | FLAG_UPSTREAM, words,
                                   None, job)
        else:
            st[4:7] = [1, h.gen, 0]
            self.stats[STAT_COMPLETED] += 1
            self.job_stats[wire.JOB_STATS_PER_JOB * job.id + JOB_STAT_COMPLETED] += 1
            pkt = self._joinreply(data, FLAG_RESULT | (flags & FLAG_PHASE), None, h.gen,
                                   job)
        out.replies = [(pkt, a) for a in job.result_addresses]
        return out


def _join_run(data: bytes) -> int:
    """A join's run (word JOIN_RUN_WORD): the attempt its worker's run belongs to (join.p4)."""
    at = wire.OFFSETS["words"] + 4 * wire.JOIN_RUN_WORD
    return int.from_bytes(data[at:at + 4], "big")


def _join_nonce(epoch: int, gen: int) -> int:
    """A tree job's join of its parent's job, for its local run ``gen``: unique per run and
    job incarnation (uplink.p4)."""
    return (epoch << 8 | gen) & 0xFFFFFFFF
