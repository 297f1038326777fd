"""The switch's rules, once, in Python: state and a packet in; verdict, counters and replies out.

This is p4/homagg.p4's aggregation pipeline as a pure model (no sockets, no clock): admission
(include/control/admission.p4), the slot state machine (slot_state.p4), the words and the
round's overflow bit (words.p4, with lanes.p4's int32 lane arithmetic) and the replies
(reply.p4). The software aggregator (``homagg.targets.soft``) is this model on a UDP socket;
the codec's in-memory simulator adds words with ``lane_add``/``lane_or``; and one table-driven
conformance suite (bmv2_tests/test_conformance.py) holds the model, the software target and
bmv2 to the same verdicts, counters, flags and replies.

Names of verdicts and counters are the P4 program's (generated constants): a new drop reason
there is a new counter here without an edit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from homagg import wire

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
K = wire.WORDS_PER_PACKET

#: The P4 program's ``enum Verdict`` (types.p4), by its generated values.
Verdict = enum.IntEnum("Verdict", wire.VERDICTS)  # type: ignore[misc]


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


Address = tuple[str, int]


@dataclass
class JobEntry:
    """What the controller installs for a job (the job table and its multicast group)."""

    id: int
    workers: list[Address]          # worker id -> (ip, udp port)
    epoch: int
    base: int
    size: int
    ports: list[int] | None = None  # worker id -> switch port (None: the target cannot tell)

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
    """The slot registers, 2 copies per slot (index 2 * slot + phase)."""

    def __init__(self, slots: int):
        n = 2 * slots
        self.seen = np.zeros(n, np.uint64)
        self.count = np.zeros(n, np.int64)
        self.tag = np.zeros(n, np.uint32)
        self.op = np.zeros(n, np.uint8)
        self.epoch = np.zeros(n, np.uint32)
        self.overflow = np.zeros(n, bool)
        self.words = np.zeros((n, K), np.int32)


class SwitchModel:
    """One switch's aggregation state: the job table, the slot pool and the counters."""

    def __init__(self, slots: int = wire.SLOTS):
        self.slots = slots
        self.mem = SlotMemory(slots)
        self.stats = np.zeros(wire.STATS_SIZE, np.int64)
        self.job_stats = np.zeros(wire.JOB_STATS_SIZE, np.int64)
        self.senders: dict[Address, tuple[JobEntry, int]] = {}
        self.jobs: dict[int, JobEntry] = {}

    # -- the control plane's writes ------------------------------------------------------------
    def install(self, job: JobEntry) -> None:
        self.jobs[job.id] = job
        for w, addr in enumerate(job.workers):
            self.senders[addr] = (job, w)

    def uninstall(self, job_id: int) -> JobEntry:
        job = self.jobs.pop(job_id)
        for addr in job.workers:
            self.senders.pop(addr, None)
        return job

    def clear_job_stats(self, job_id: int) -> None:
        k = wire.JOB_STATS_PER_JOB
        self.job_stats[job_id * k:(job_id + 1) * k] = 0

    # -- the data plane ------------------------------------------------------------------------
    def _count(self, name: str) -> None:
        self.stats[wire.STAT_INDEX[name]] += 1

    def _job_count(self, job: JobEntry, kind: int) -> None:
        self.job_stats[job.id * wire.JOB_STATS_PER_JOB + kind] += 1

    def _admit(self, data: bytes, src: Address, port: int | None):
        """(drop reason or None, job entry or None, worker id, header fields)."""
        if len(data) < wire.PACKET_BYTES:
            return "DROP_MALFORMED", None, 0, {}
        if len(data) > wire.PACKET_BYTES:
            return "DROP_BAD_LENGTH", None, 0, {}
        f = wire.fields(data)
        if f["version"] != wire.HOMAGG_VERSION:
            return "DROP_BAD_VERSION", None, 0, f
        if f["op"] not in wire.OPS:
            return "DROP_BAD_OP", None, 0, f
        if f["flags"] & wire.FLAG_RESULT:
            return "DROP_FORGED_RESULT", None, 0, f
        hit = self.senders.get(src)
        if hit is None:
            return "DROP_UNKNOWN_SENDER", None, 0, f
        job, worker = hit
        if port is not None and job.ports is not None and port != job.ports[worker]:
            return "DROP_SPOOFED", job, worker, f
        if f["job"] != job.id or f["worker"] != worker:
            return "DROP_WRONG_IDENTITY", job, worker, f
        if f["slot"] >= job.size:
            return "DROP_BAD_SLOT", job, worker, f
        return None, job, worker, f

    def process(self, data: bytes, src: Address, port: int | None = None) -> Outcome:
        """One datagram from ``src`` (arriving on switch ``port``, where the target knows it)."""
        self._count("STAT_RX")
        reason, job, worker, f = self._admit(data, src, port)
        if reason is not None:
            self._count(reason)
            if job is not None:
                self._job_count(job, wire.JOB_STAT_DROPPED)
            return Outcome(reason)
        assert job is not None
        m = self.mem
        seq, op, flags = f["seq"], f["op"], f["flags"]
        phase = 1 if flags & wire.FLAG_PHASE else 0
        idx = 2 * (job.base + f["slot"]) + phase
        me = 1 << worker
        seen, count, tag = int(m.seen[idx]), int(m.count[idx]), int(m.tag[idx])
        workers = len(job.workers)

        # slot_state.p4
        first = False
        verdict = Verdict.ACCEPT
        if m.epoch[idx] != job.epoch:
            first = True
        elif seen & me:
            if count == workers and tag == seq:
                verdict = Verdict.RETRANS_REPLY
            elif tag == seq:
                verdict = Verdict.DUP_PENDING
            else:
                verdict = Verdict.STALE
        elif seen == 0:
            if newer(seq, tag):
                first = True
            else:
                verdict = Verdict.STALE
        elif count >= workers:
            verdict = Verdict.STALE
        elif newer(tag, seq):
            verdict = Verdict.STALE
        elif tag != seq or m.op[idx] != op:
            verdict = Verdict.SEQ_MISMATCH

        words = np.frombuffer(data, ">i4", K, wire.HOMAGG_HDR_BYTES).astype(np.int32)
        result = words
        complete = False
        if verdict == Verdict.ACCEPT:
            seen, count = (me, 1) if first else (seen | me, count + 1)
            m.seen[idx], m.count[idx], m.tag[idx] = seen, count, seq
            m.op[idx], m.epoch[idx] = op, job.epoch
            m.seen[idx ^ 1] &= np.uint64(~me & 0xFFFFFFFFFFFFFFFF)
            complete = count == workers
            # words.p4
            if first:
                m.words[idx] = words
                m.overflow[idx] = False
            else:
                if op == wire.OP_ADD:
                    result, lanes = lane_add(m.words[idx], words)
                    m.overflow[idx] |= bool(lanes.any())
                else:
                    result = lane_or(m.words[idx], words)
                m.words[idx] = result
        elif verdict == Verdict.RETRANS_REPLY:
            result = m.words[idx]

        # reply.p4 and the counters (aggregation.p4)
        out = Outcome(self._verdict_counter(verdict), verdict)
        ovf = wire.FLAG_OVERFLOW if m.overflow[idx] else 0
        keep = flags & wire.FLAG_PHASE
        if verdict == Verdict.ACCEPT:
            self._count("STAT_ACCEPTED")
            self._job_count(job, wire.JOB_STAT_ACCEPTED)
            if complete:
                self._count("STAT_COMPLETED")
                self._job_count(job, wire.JOB_STAT_COMPLETED)
                if ovf:
                    self._count("STAT_OVERFLOW")
                pkt = self._packet(f, wire.FLAG_RESULT | keep | ovf, result)
                out.replies = [(pkt, a) for a in job.workers]
        elif verdict == Verdict.RETRANS_REPLY:
            self._count("STAT_RETRANS_REPLY")
            self._job_count(job, wire.JOB_STAT_RETRANS)
            out.replies = [(self._packet(f, wire.FLAG_RESULT | wire.FLAG_RETRANS | keep | ovf,
                                         result), src)]
        elif verdict == Verdict.DUP_PENDING:
            self._count("STAT_DUP_PENDING")
            self._job_count(job, wire.JOB_STAT_RETRANS)
            out.replies = [(self._packet(f, wire.FLAG_RESULT | wire.FLAG_STATUS | keep,
                                         wire.status_words(seen, count)), src)]
        else:
            self._count(out.counter)
            self._job_count(job, wire.JOB_STAT_DROPPED)
        return out

    @staticmethod
    def _verdict_counter(v: Verdict) -> str:
        return {Verdict.ACCEPT: "STAT_ACCEPTED", Verdict.RETRANS_REPLY: "STAT_RETRANS_REPLY",
                Verdict.DUP_PENDING: "STAT_DUP_PENDING", Verdict.SEQ_MISMATCH: "DROP_SEQ_MISMATCH",
                Verdict.STALE: "DROP_STALE"}[v]

    @staticmethod
    def _packet(f: dict, flags: int, words: np.ndarray) -> bytes:
        # The switch echoes the packet's header (worker and reserved included) with new flags.
        return wire.header(version=f["version"], op=f["op"], flags=flags, job=f["job"],
                           worker=f["worker"], slot=f["slot"], seq=f["seq"],
                           reserved=f["reserved"]) + np.asarray(words, ">i4").tobytes()
