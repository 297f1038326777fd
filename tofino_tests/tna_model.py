"""The TNA program (p4/tofino/homagg_tna.p4), register by register, in Python.

Nothing here runs a Tofino program (no chip, no tofino-model). This is the TNA program's
design written out as the pipeline executes it: the same registers and RegisterActions
(``_claim``, ``_start``, ``_take``, the pairs' ``write_hi``/``add_hi``/``or_hi``/``read_lo``,
the join's ``member`` and ``generation``), the same table decisions and the same passes
(recirculation included), so that the conformance table the switch model defines
(bmv2_tests/test_conformance.py) can hold the design to the reference rules. It is kept next
to the P4 source by hand: a change to one is a change to the other (tofino_tests/
test_tna_model.py says where the two programs are meant to differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from homagg import wire

K = 64                 # p4/tofino/include/size.p4: WORDS_PER_PACKET
HALF = K // 2          # register pairs
MASK32 = 0xFFFFFFFF
NO_DROP = 0xFF


@dataclass
class Job:
    """One job_workers entry's parameters (set_worker)."""

    id: int
    workers: int
    epoch: int
    region_base: int
    region_size: int
    mcast_group: int
    auth: int


class TnaModel:
    """The TNA program's state: registers, counters, and the tables the controller writes
    (the job table, the multicast groups with result_dst folded in)."""

    def __init__(self, slots: int = wire.SLOTS):
        n = 2 * slots                                  # SLOT_STATE_SIZE
        self.owner = np.zeros(n, np.uint64)            # slot_owner: {owner, newest tag}
        self.owner_tag = np.zeros(n, np.uint64)
        self.round_seen = np.zeros(n, np.uint64)       # slot_round.seen
        self.round_tag = np.zeros(n, np.uint64)        # slot_round.tag
        self.lo = np.zeros((n, HALF), np.uint32)       # pair i: lanes (word i, word HALF + i)
        self.hi = np.zeros((n, HALF), np.uint32)
        self.members = np.zeros((wire.MAX_JOBS, 2), np.uint64)     # join_members (seen, run)
        self.generation = np.zeros((wire.MAX_JOBS, 2), np.uint64)  # join_generation (gen, run)
        self.stats = np.zeros(wire.STATS_SIZE, np.int64)
        self.job_stats = np.zeros(wire.JOB_STATS_SIZE, np.int64)
        self.senders: dict[tuple[str, int], tuple[Job, int]] = {}
        self.results: dict[int, list[tuple[str, int]]] = {}  # job -> result_dst by worker

    def install(self, job: Job, workers: list[tuple[str, int]]) -> None:
        for w, addr in enumerate(workers):
            self.senders[addr] = (job, w)
        self.results[job.id] = list(workers)

    def uninstall(self, job_id: int) -> None:
        self.senders = {a: v for a, v in self.senders.items() if v[0].id != job_id}
        self.results.pop(job_id, None)

    # -- ingress, pass 1 --------------------------------------------------------------------
    def process(self, data: bytes, src: tuple[str, int]) -> list[tuple[bytes, tuple[str, int]]]:
        """One datagram from ``src`` (its UDP payload): the datagrams the switch sends."""
        hb = wire.HOMAGG_HDR_BYTES
        if len(data) < hb:
            return self._drop(wire.DROP_MALFORMED)
        h = wire.fields(data)
        join = h["op"] == wire.OP_JOIN
        need = hb + 4 * (wire.JOIN_WORDS if join else K)
        if len(data) < need:                            # the parser runs out: parser_err
            return self._drop(wire.DROP_MALFORMED)
        if len(data) != need:                           # the IPv4 and UDP lengths
            return self._drop(wire.DROP_BAD_LENGTH)
        if h["version"] != wire.HOMAGG_VERSION:
            return self._drop(wire.DROP_BAD_VERSION)
        if h["op"] not in (wire.OP_ADD, wire.OP_OR, wire.OP_JOIN):
            return self._drop(wire.DROP_BAD_OP)
        if h["flags"] & wire.FLAG_RESULT:
            return self._drop(wire.DROP_FORGED_RESULT)
        hit = self.senders.get(src)
        if hit is None:
            return self._drop(wire.DROP_UNKNOWN_SENDER)
        job, worker = hit
        me = (1 << worker) if worker < 32 else 0        # worker_bit
        mask = (1 << job.workers) - 1 if job.workers <= 32 else 0  # job_mask
        words = np.frombuffer(data, ">u4", offset=hb).astype(np.uint32)
        if h["auth"] != job.auth:
            return self._drop(wire.DROP_SPOOFED, job)
        if h["job"] != job.id or h["worker"] != worker:
            return self._refuse(wire.DROP_WRONG_IDENTITY, job, h, data, src)
        if not join and h["slot"] >= job.region_size:
            return self._refuse(wire.DROP_BAD_SLOT, job, h, data, src)
        phase = 1 if h["flags"] & wire.FLAG_PHASE else 0
        if join:
            return self._join(job, h, words, me, mask, src)
        idx = 2 * (job.region_base + h["slot"]) + phase
        owner = (job.epoch << 8) | h["gen"]
        seq = h["seq"]
        # slot_owner: claim ({owner, newest tag}): a new round, or this one (or an older one)
        if int(self.owner[idx]) != owner:
            self.owner[idx], self.owner_tag[idx] = owner, seq
            newround = True
        elif (seq - int(self.owner_tag[idx])) & MASK32 and \
                (seq - int(self.owner_tag[idx])) & MASK32 < 0x80000000:
            self.owner_tag[idx] = seq
            newround = True
        else:
            newround = False
        # slot_round: start, or take (an older round's packet learns nobody: 0)
        if newround:
            rv = 0
            self.round_seen[idx], self.round_tag[idx] = me, seq
        elif int(self.round_tag[idx]) == seq:
            rv = int(self.round_seen[idx])
            self.round_seen[idx] = rv | me
        else:
            rv = 0
        stale = not newround and rv == 0
        lo, hi = words[:HALF].copy(), words[HALF:].copy()
        # the pairs' table
        if newround:
            self.lo[idx], self.hi[idx] = lo, hi         # write_hi
            hi = self.hi[idx].copy()
        elif stale:
            lo[:], hi[:] = 0, 0                         # refused: the reason in the last word
            hi[HALF - 1] = wire.DROP_STALE
        elif rv & me:
            lo[:], hi[:] = 0, 0                         # status
            hi[HALF - 2] = rv                           # status_word of pair 30
        elif h["op"] == wire.OP_ADD:
            self.lo[idx] += lo                          # add_hi (uint32: wraps)
            self.hi[idx] += hi
            hi = self.hi[idx].copy()
        else:
            self.lo[idx] |= lo                          # or_hi
            self.hi[idx] |= hi
            hi = self.hi[idx].copy()
        left_before, left_after = rv ^ mask, rv ^ mask ^ me
        pflag = wire.FLAG_PHASE if phase else 0
        if stale:
            self._count(wire.DROP_STALE, job, wire.JOB_STAT_DROPPED)
            return [(self._reply(data, wire.FLAG_RESULT | wire.FLAG_REFUSED | pflag, lo, hi),
                     src)]
        if not newround and rv & me:
            if left_before == 0:                        # RETRANS: two more passes
                self._count(wire.STAT_RETRANS_REPLY, job, wire.JOB_STAT_RETRANS)
                lo[:], hi[:] = 0, 0                     # pass 2: zero_words, add_hi
                self.lo[idx] += lo
                self.hi[idx] += hi
                hi = self.hi[idx].copy()
                lo = self.lo[idx].copy()                # pass 3: read_lo
                return [(self._reply(data, wire.FLAG_RESULT | wire.FLAG_RETRANS | pflag, lo,
                                     hi), src)]
            self._count(wire.STAT_DUP_PENDING, job, wire.JOB_STAT_RETRANS)
            return [(self._reply(data, wire.FLAG_RESULT | wire.FLAG_STATUS | pflag, lo, hi),
                     src)]
        self._count(wire.STAT_ACCEPTED, job, wire.JOB_STAT_ACCEPTED)
        if left_after != 0:
            return []
        lo = self.lo[idx].copy()                        # pass 2: read_lo, then multicast
        self._count(wire.STAT_COMPLETED, job, wire.JOB_STAT_COMPLETED)
        out = self._reply(data, wire.FLAG_RESULT | pflag, lo, hi)
        return [(out, dst) for dst in self.results[job.id]]

    def _join(self, job: Job, h: dict, words: np.ndarray, me: int, mask: int,
              src: tuple[str, int]) -> list[tuple[bytes, tuple[str, int]]]:
        run = int(words[wire.JOIN_RUN_WORD]) ^ job.epoch << 16   # md.join_run
        j = job.id % wire.MAX_JOBS
        seen_run = self.members[j]
        if int(seen_run[1]) != run:                     # member
            rv = 0
            self.members[j] = (me, run)
        else:
            rv = int(seen_run[0])
            self.members[j, 0] = rv | me
        g = self.generation[j]                          # generation
        if int(g[1]) != run:
            self.generation[j] = ((int(g[0]) + 1) & MASK32, run)
        gen = int(self.generation[j, 0]) & 0xFF
        left_before, left_after = rv ^ mask, rv ^ mask ^ me
        pflag = h["flags"] & wire.FLAG_PHASE              # (SET_FLAGS keeps it)
        out = words.copy()
        out[wire.JOIN_RUN_WORD] = 0
        if left_before == 0 or (not rv & me and left_after == 0):
            if left_before == 0:
                self._count(wire.STAT_RETRANS_REPLY, job, wire.JOB_STAT_RETRANS)
                flags = wire.FLAG_RESULT | wire.FLAG_RETRANS | pflag
                return [(self._joinreply(h, flags, out, gen), src)]
            self._count(wire.STAT_COMPLETED, job, wire.JOB_STAT_COMPLETED)
            r = self._joinreply(h, wire.FLAG_RESULT | pflag, out, gen)
            return [(r, dst) for dst in self.results[job.id]]
        if rv & me:                                     # again, still waiting
            out[wire.JOIN_WORDS - 2] = rv
            self._count(wire.STAT_DUP_PENDING, job, wire.JOB_STAT_RETRANS)
            flags = wire.FLAG_RESULT | wire.FLAG_STATUS | pflag
            return [(self._joinreply(h, flags, out, h["gen"]), src)]
        self._count(wire.STAT_ACCEPTED, job, wire.JOB_STAT_ACCEPTED)
        return []

    # -- what every rule shares ---------------------------------------------------------------
    def _count(self, stat: int, job: Job | None = None, kind: int | None = None) -> None:
        self.stats[stat] += 1
        if job is not None and kind is not None:
            self.job_stats[(job.id % wire.MAX_JOBS) * wire.JOB_STATS_PER_JOB + kind] += 1

    def _drop(self, reason: int, job: Job | None = None) -> list:
        self._count(reason, job, wire.JOB_STAT_DROPPED if job is not None else None)
        return []

    def _refuse(self, reason: int, job: Job, h: dict, data: bytes, src) -> list:
        self._count(reason, job, wire.JOB_STAT_DROPPED)
        flags = wire.FLAG_RESULT | wire.FLAG_REFUSED | (h["flags"] & wire.FLAG_PHASE)
        if h["op"] == wire.OP_JOIN:
            words = np.frombuffer(data, ">u4", offset=wire.HOMAGG_HDR_BYTES).astype(np.uint32)
            words = words.copy()
            words[wire.JOIN_RUN_WORD] = 0
            words[-1] = reason
            return [(self._joinreply(h, flags, words, h["gen"]), src)]
        lo, hi = np.zeros(HALF, np.uint32), np.zeros(HALF, np.uint32)
        hi[HALF - 1] = reason
        return [(self._reply(data, flags, lo, hi), src)]

    @staticmethod
    def _reply(data: bytes, flags: int, lo: np.ndarray, hi: np.ndarray) -> bytes:
        h = wire.fields(data)
        head = wire.header(version=h["version"], op=h["op"], flags=flags, job=h["job"],
                           worker=h["worker"], slot=h["slot"], seq=h["seq"], gen=h["gen"],
                           auth=h["auth"])
        return head + np.concatenate([lo, hi]).astype(">u4").tobytes()

    @staticmethod
    def _joinreply(h: dict, flags: int, words: np.ndarray, gen: int) -> bytes:
        head = wire.header(version=h["version"], op=h["op"], flags=flags, job=h["job"],
                           worker=h["worker"], slot=K, seq=h["seq"],
                           gen=gen, auth=h["auth"])
        return head + words.astype(">u4").tobytes()
