"""The switch model's core: its state (job table, slot memory, join registers, counters), the
control plane's writes, and the replies every rule shares (a drop, a refusal, a join's reply)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from homagg import wire
from homagg.switch_model.state import Address, JobEntry, Outcome, SlotMemory, reply
from homagg.wire import (  # the protocol's constants, generated from the P4 program
    FLAG_PHASE,
    FLAG_REFUSED,
    FLAG_RESULT,
    JOB_STAT_DROPPED,
)


class SwitchCore:
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
        # admission.p4's parents table: (parent address, parent's job id, parent job's key)
        # -> the job here
        self.children_of: dict[tuple[Address, int, int], JobEntry] = {}
        # join.p4's registers: per job id [seen, count, gen, epoch, final, handed, held, run]
        # (final: the join is complete at the root, not only here; handed: the generation it
        # handed out, the root's in a tree; held: the parent's answer came while the join
        # here was pending, and handed is its generation; run: the attempt the current join
        # belongs to); per (job, worker) nonce
        self.join_state: dict[int, list[int]] = {}
        self.join_nonce: dict[tuple[int, int], int] = {}
        #: called with this model after every change to its jobs (the native data path's copy
        #: of the job table, ``homagg.targets.soft.native``)
        self.jobs_changed: Callable[[SwitchCore], None] | None = None

    # -- the control plane's writes ------------------------------------------------------------
    def install(self, job: JobEntry) -> None:
        self.jobs[job.id] = job
        for w, addr in enumerate(job.workers):
            self.senders[addr] = (job, w)
        if job.uplink is not None:
            self.children_of[(job.uplink.parent, job.uplink.job, job.uplink.auth)] = job
        if self.jobs_changed is not None:
            self.jobs_changed(self)

    def uninstall(self, job_id: int) -> JobEntry:
        job = self.jobs.pop(job_id)
        for addr in job.workers:
            self.senders.pop(addr, None)
        if job.uplink is not None:
            self.children_of.pop((job.uplink.parent, job.uplink.job, job.uplink.auth), None)
        if self.jobs_changed is not None:
            self.jobs_changed(self)
        return job

    def clear_job_stats(self, job_id: int) -> None:
        k = wire.JOB_STATS_PER_JOB
        self.job_stats[job_id * k:(job_id + 1) * k] = 0

    # -- the data plane ------------------------------------------------------------------------
    def _count(self, name: str) -> None:
        self.stats[wire.STAT_INDEX[name]] += 1

    def _job_count(self, job: JobEntry, kind: int) -> None:
        self.job_stats[job.id * wire.JOB_STATS_PER_JOB + kind] += 1

    # -- replies every rule shares -------------------------------------------------------------
    def _refuse(self, index: int, job: JobEntry, data: bytes, src: Address, flags: int,
                gen: int | None = None, join: bool = False) -> Outcome:
        """A registered sender's packet dropped (reply.p4): counted, and answered with
        FLAG_REFUSED and the reason in the last word, so the agent can say why (``join``: the
        packet is a join, answered as joins are)."""
        out = self._drop(index, job)
        words = np.zeros(wire.JOIN_WORDS if join else self.k, np.int32)
        words[-1] = index
        rflags = FLAG_RESULT | FLAG_REFUSED | (flags & FLAG_PHASE)
        out.replies = [(self._joinreply(data, rflags, words, gen) if join
                        else reply(data, rflags, words, gen), src)]
        return out

    def _joinreply(self, data: bytes, flags: int, words: np.ndarray | None,
                    gen: int | None, job: JobEntry | None = None) -> bytes:
        """A reply to a join: its JOIN_WORDS words (``words``, else zeros) and K in the slot
        field, which is how the agent learns K (reply.p4); ``job``: a tree's child job, whose
        id and key a parent's answer takes on the way down."""
        pkt = bytearray(reply(data, flags, np.zeros(wire.JOIN_WORDS, np.int32)
                               if words is None else words, gen,
                               None if job is None else job.id,
                               auth=None if job is None else job.auth))
        wire.put_field(pkt, "slot", self.k)
        return bytes(pkt)

    def _drop(self, index: int, job: JobEntry | None = None) -> Outcome:
        self.stats[index] += 1
        if job is not None:
            self.job_stats[job.id * wire.JOB_STATS_PER_JOB + JOB_STAT_DROPPED] += 1
        return Outcome(wire.STATS[index])
