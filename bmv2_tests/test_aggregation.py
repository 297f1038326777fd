"""The aggregation semantics, packet by packet, on both targets: bmv2 running p4/homagg.p4 and
the software aggregator. Every output is checked; every drop must move its counter.

The bmv2 half needs p4c-bm2-ss, simple_switch_grpc and root, and skips with the reason otherwise;
the software half runs everywhere.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from bmv2_tests.conftest import bmv2_skip_reason
from bmv2_tests.targets import Bmv2Target, SoftTarget
from homagg import wire
from homagg.targets.testbed import host_ip

_job_ids = itertools.count(1)


@pytest.fixture(scope="module", params=["soft", "bmv2"])
def target(request):
    if request.param == "soft":
        return SoftTarget()
    reason = bmv2_skip_reason()
    if reason:
        pytest.skip(reason)
    return Bmv2Target(request.getfixturevalue("testbed"))


class Job:
    def __init__(self, target, installed, workers):
        self.t = target
        self.id = installed.id
        self.epoch = installed.epoch
        self.region = range(installed.base, installed.base + installed.size)
        self.hosts = list(workers)
        self.refusals: dict[int, list[wire.Packet]] = {}  # FLAG_REFUSED notices, per worker

    def send(self, worker, slot, seq, words, op=wire.OP_ADD, phase=0, host=None, **kw):
        flags = kw.pop("flags", 0) | (wire.FLAG_PHASE if phase else 0)
        payload = wire.pack(op, kw.pop("job", self.id), kw.pop("as_worker", worker), slot, seq,
                            words, flags=flags, version=kw.pop("version", wire.HOMAGG_VERSION))
        self.t.send(self.hosts[worker] if host is None else host, payload, **kw)

    def results(self, workers=None, timeout=1.0, count=1):
        """Up to ``count`` results (or status replies) per worker; a refusal notice
        (FLAG_REFUSED: the switch dropped one of the worker's packets) is kept apart."""
        workers = range(len(self.hosts)) if workers is None else workers
        out = {}
        for w in workers:
            got: list[wire.Packet] = []
            deadline = time.monotonic() + timeout
            while len(got) < count and time.monotonic() < deadline:
                for p in self.t.recv(self.hosts[w], max(0.0, deadline - time.monotonic()),
                                     count - len(got)):
                    (self.refusals.setdefault(w, []) if p.flags & wire.FLAG_REFUSED
                     else got).append(p)
            out[w] = got
        return out

    def refused(self, w, timeout=0.5) -> list[str]:
        """The DROP_* reasons of the refusal notices worker ``w`` got (waiting ``timeout``)."""
        self.results([w], timeout, count=1_000_000)
        return [wire.STATS[int(p.words[-1])] for p in self.refusals.pop(w, [])]


@pytest.fixture
def job(target):
    made = []

    def make(workers=(0, 1, 2, 3), slots=8, udp_port=wire.DEFAULT_AGENT_PORT):
        installed = target.add_job(next(_job_ids), list(workers), slots, udp_port)
        j = Job(target, installed, workers)
        made.append(j)
        target.drain()
        return j

    yield make
    for j in made:
        target.remove_job(j.id)


def counter(target, name):
    return target.stats()["switch"][name]


def expect_counter(target, name, value, timeout=2.0):
    """bmv2 handles packets asynchronously: wait (bounded) for the counter to get there."""
    deadline = time.monotonic() + timeout
    while True:
        got = counter(target, name)
        if got == value or time.monotonic() > deadline:
            assert got == value, f"{name}: {got}, expected {value}"
            return
        time.sleep(0.02)


def full(v):
    return np.full(wire.WORDS_PER_PACKET, v, np.int32)


# --- sums, ORs, completion -----------------------------------------------------------------


def test_sum_is_multicast_to_every_worker_when_the_last_arrives(target, job):
    j = job()
    rng = np.random.default_rng(1)
    words = rng.integers(-(2**28), 2**28, (4, wire.WORDS_PER_PACKET)).astype(np.int32)
    for w in range(3):
        j.send(w, 0, 1, words[w])
    assert not any(j.results(timeout=0.3).values()), "result before completion"
    j.send(3, 0, 1, words[3])
    expect = words.astype(np.int64).sum(0)
    for _w, rs in j.results().items():
        assert len(rs) == 1, f"worker {w} got {len(rs)} results"
        r = rs[0]
        assert r.is_result and not r.overflow and (r.slot, r.seq, r.job) == (0, 1, j.id)
        np.testing.assert_array_equal(r.words.astype(np.int64), expect)


def test_non_members_get_nothing(target, job):
    j = job(workers=(0, 1))
    j.send(0, 0, 1, full(1))
    j.send(1, 0, 1, full(2))
    j.results()
    assert not target.recv(4, 0.3), "a host outside the job got a result"


def test_or_combines_bitmaps(target, job):
    j = job()
    words = np.zeros((4, wire.WORDS_PER_PACKET), np.uint32)
    for w in range(4):
        words[w, w] = 1 << (w * 7 + 3)
        words[w, -1] = 0xF0F0F0F0 if w % 2 else 0x0F0F0F0F
        words[w, 10 + w] = 0xFFFFFFFF
        j.send(w, 0, 1, words[w], op=wire.OP_OR)
    expect = np.bitwise_or.reduce(words).view(np.int32)
    for _w, rs in j.results().items():
        np.testing.assert_array_equal(rs[0].words, expect)


def test_overflow_is_flagged_and_the_next_round_starts_clean(target, job):
    j = job(workers=(0, 1))
    j.send(0, 0, 1, full(2**30 + 1))
    j.send(1, 0, 1, full(2**30 + 1))
    for _w, rs in j.results().items():
        assert rs[0].overflow, "overflowing add not flagged"
    before = counter(target, "STAT_OVERFLOW")
    j.send(0, 0, 2, full(5), phase=1)   # the slot's next round uses its other copy
    j.send(1, 0, 2, full(-7), phase=1)
    for _w, rs in j.results().items():
        assert not rs[0].overflow and (rs[0].words == -2).all()
    expect_counter(target, "STAT_OVERFLOW", before)


def test_sums_reaching_int32_min_exactly_are_not_flagged(target, job):
    j = job(workers=(0, 1))
    j.send(0, 0, 1, full(-(2**30)))
    j.send(1, 0, 1, full(-(2**30)))
    for _w, rs in j.results().items():
        assert not rs[0].overflow and (rs[0].words == -(2**31)).all()


def test_negative_overflow_is_flagged(target, job):
    j = job(workers=(0, 1))
    j.send(0, 0, 1, full(-(2**31)))
    j.send(1, 0, 1, full(-1))
    for _w, rs in j.results().items():
        assert rs[0].overflow


# --- duplicates, retransmissions, shadow copies -------------------------------------------


def test_duplicate_before_completion_is_not_added_twice_and_gets_a_status(target, job):
    j = job(workers=(0, 1, 2))
    before = counter(target, "STAT_DUP_PENDING")
    j.send(0, 0, 1, full(10))
    j.send(0, 0, 1, full(10))  # retransmission
    status = j.results([0], timeout=0.5)[0]
    assert len(status) == 1 and status[0].flags & wire.FLAG_STATUS
    i = wire.STATUS_WORD
    words = status[0].words
    seen = (int(words[i]) << 32) | (int(words[i + 1]) & 0xFFFFFFFF)
    assert seen == 0b001 and words[i + 2] == 1 and not words[:i].any()
    j.send(1, 0, 1, full(1))
    j.send(2, 0, 1, full(2))
    for _w, rs in j.results().items():
        assert len(rs) == 1 and not rs[0].flags & wire.FLAG_STATUS and (rs[0].words == 13).all()
    expect_counter(target, "STAT_DUP_PENDING", before + 1)


def test_retransmission_after_completion_gets_the_result_by_unicast(target, job):
    j = job(workers=(0, 1, 2))
    for w in range(3):
        j.send(w, 0, 1, full(w + 1))
    j.results()
    j.send(1, 0, 1, full(99))  # worker 1 lost its result and resends
    got = j.results(timeout=0.5)
    assert not got[0] and not got[2], "a retransmission must not multicast"
    assert len(got[1]) == 1
    assert got[1][0].flags & wire.FLAG_RETRANS and (got[1][0].words == 6).all()


def test_shadow_copy_keeps_the_result_while_the_other_copy_is_used(target, job):
    j = job(workers=(0, 1))
    j.send(0, 0, 1, full(3), phase=0)
    j.send(1, 0, 1, full(4), phase=0)
    j.results()
    j.send(0, 0, 2, full(100), phase=1)      # worker 0 moves to the other copy
    j.send(1, 0, 1, full(0), phase=0)        # worker 1 lost round 1's result
    got = j.results(timeout=0.5)
    assert not got[0]
    assert len(got[1]) == 1 and (got[1][0].words == 7).all() and got[1][0].seq == 1
    j.send(1, 0, 2, full(1), phase=1)
    for _w, rs in j.results().items():
        assert (rs[0].words == 101).all() and rs[0].phase == 1


def test_four_workers_one_hundred_rounds_on_reused_slots_are_exact(target, job):
    j = job(workers=(0, 1, 2, 3), slots=4)
    rng = np.random.default_rng(7)
    for rnd in range(100):
        slot, phase = rnd % 4, (rnd // 4) % 2
        words = rng.integers(-(2**29), 2**29, (4, wire.WORDS_PER_PACKET)).astype(np.int32)
        for w in rng.permutation(4):
            j.send(int(w), slot, rnd + 1, words[w], phase=phase)
        expect = words.astype(np.int64).sum(0)
        for _w, rs in j.results().items():
            assert len(rs) == 1, f"round {rnd}: worker {w} got {len(rs)} results"
            assert rs[0].seq == rnd + 1 and rs[0].slot == slot
            np.testing.assert_array_equal(rs[0].words.astype(np.int64), expect)
    assert target.stats()["jobs"][j.id]["JOB_STAT_COMPLETED"]["packets"] == 100


# --- drops, each with its reason ----------------------------------------------------------


def _still_exact(j):
    j.send(0, 0, 1, full(2))
    j.send(1, 0, 1, full(3))
    for _w, rs in j.results().items():
        assert len(rs) == 1 and (rs[0].words == 5).all()


BAD = {
    "unknown source port": ("DROP_UNKNOWN_SENDER", dict(sport=50001)),
    "forged source address": ("DROP_UNKNOWN_SENDER", dict(src_ip="10.0.0.77")),
    "a registered worker's address, from another port": ("DROP_SPOOFED",
                                                         dict(host=1, src_ip=host_ip(0))),
    "wrong version": ("DROP_BAD_VERSION", dict(version=wire.HOMAGG_VERSION + 1)),
    "the version before the key": ("DROP_BAD_VERSION", dict(version=1)),
    "unknown op": ("DROP_BAD_OP", dict(op=7)),
    "result flag from a host": ("DROP_FORGED_RESULT", dict(flags=wire.FLAG_RESULT)),
    "another worker's id": ("DROP_WRONG_IDENTITY", dict(as_worker=1)),
    "another job's id": ("DROP_WRONG_IDENTITY", dict(job=60)),
    "slot outside the region": ("DROP_BAD_SLOT", dict(slot=8)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_packet_is_dropped_counted_and_harmless(target, job, case):
    reason, kw = BAD[case][0], dict(BAD[case][1])
    if reason == "DROP_SPOOFED" and target.name == "soft":
        pytest.skip("the software aggregator sees addresses, not switch ports: it cannot tell "
                    "a forged registered address (documented limit; bmv2 binds senders to ports)")
    j = job(workers=(0, 1))
    before = counter(target, reason)
    slot = kw.pop("slot", 0)
    j.send(0, slot, 1, full(1000), **kw)
    expect_counter(target, reason, before + 1)
    # a registered sender is told why (its agent names the reason); any other is not answered
    refusable = reason in ("DROP_WRONG_IDENTITY", "DROP_BAD_SLOT")
    assert j.refused(0) == ([reason] if refusable else [])
    _still_exact(j)


@pytest.mark.parametrize("cut,reason", [(100, "DROP_MALFORMED"), (3, "DROP_MALFORMED"),
                                        (-8, "DROP_BAD_LENGTH")])
def test_wrong_size_is_dropped(target, job, cut, reason):
    j = job(workers=(0, 1))
    payload = wire.pack(wire.OP_ADD, j.id, 0, 0, 1, full(1000))
    payload = payload[:cut] if cut > 0 else payload + bytes(-cut)
    before = counter(target, reason)
    target.send(j.hosts[0], payload)
    expect_counter(target, reason, before + 1)
    _still_exact(j)


def test_round_tag_mismatch_is_dropped(target, job):
    j = job(workers=(0, 1))
    j.send(0, 0, 5, full(1))
    before = counter(target, "DROP_SEQ_MISMATCH")
    j.send(1, 0, 6, full(1))
    expect_counter(target, "DROP_SEQ_MISMATCH", before + 1)
    assert j.refused(1) == ["DROP_SEQ_MISMATCH"]
    j.send(1, 0, 5, full(2))
    for _w, rs in j.results().items():
        assert (rs[0].words == 3).all()


def test_delayed_packet_of_a_finished_round_is_stale(target, job):
    j = job(workers=(0, 1))
    for seq in (1, 2):
        j.send(0, 0, seq, full(1), phase=seq - 1)
        j.send(1, 0, seq, full(1), phase=seq - 1)
        j.results()
    j.send(0, 0, 3, full(1), phase=0)
    before = counter(target, "DROP_STALE")
    j.send(1, 0, 1, full(50), phase=0)  # round 1, delayed in the network
    expect_counter(target, "DROP_STALE", before + 1)
    assert j.refused(1) == ["DROP_STALE"]
    j.send(1, 0, 3, full(1), phase=0)
    for _w, rs in j.results().items():
        assert (rs[0].words == 2).all() and rs[0].seq == 3


def test_old_round_cannot_restart_an_idle_copy(target, job):
    j = job(workers=(0, 1))
    for seq in (1, 2):
        j.send(0, 0, seq, full(1), phase=seq - 1)
        j.send(1, 0, seq, full(1), phase=seq - 1)
        j.results()
    before = counter(target, "DROP_STALE")
    j.send(0, 0, 1, full(9), phase=0)  # copy 0 is empty now, but round 1 is history
    expect_counter(target, "DROP_STALE", before + 1)
    assert j.refused(0) == ["DROP_STALE"]


def test_reset_job_starts_afresh_with_seq_from_one(target, job):
    j = job(workers=(0, 1))
    for w in range(2):
        j.send(w, 0, 41, full(1))
    j.results()
    assert target.reset_job(j.id) != j.epoch
    assert target.stats()["jobs"][j.id]["JOB_STAT_ACCEPTED"]["packets"] == 0
    for w in range(2):
        j.send(w, 0, 1, full(4))
    for _w, rs in j.results().items():
        assert len(rs) == 1 and (rs[0].words == 8).all()


def test_two_jobs_do_not_touch_each_others_slots(target, job):
    a = job(workers=(0, 1))
    b = job(workers=(2, 3))
    assert set(a.region).isdisjoint(b.region)
    a.send(0, 0, 1, full(1))
    a.send(1, 0, 1, full(1000), host=2)   # a worker of b posing as a's worker 1
    a.send(1, 0, 1, full(2))
    b.send(0, 0, 1, full(10))
    b.send(1, 0, 1, full(20))
    ga, gb = a.results(), b.results()
    assert all((rs[0].words == 3).all() for rs in ga.values())
    assert all((rs[0].words == 30).all() for rs in gb.values())
    assert b.refused(0) == ["DROP_WRONG_IDENTITY"]  # host 2 is b's worker 0: it is told
