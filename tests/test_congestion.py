"""The per-agent congestion control (host_agent.congestion): the window's AIMD arithmetic and
pacing, and rounds that stay exact with it on, under injected loss and a window of one slot."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from homagg.faults import FaultSpec
from homagg.host_agent.engine.congestion import BETA, GAIN, MIN_BURST, Congestion
from homagg.host_agent.engine.round import Round
from homagg.host_agent.engine.rto import RtoEstimator
from tests.test_agent import Job, assert_exact, closing_factory, sparse_tensors


@pytest.fixture
def make_job():
    yield from closing_factory(Job)


def controller(cap=64, srtt=None):
    rtt = RtoEstimator(0.05, 0.02, 0.1)
    if srtt is not None:
        rtt.sample(srtt)
    return Congestion(cap, rtt)


def test_window_starts_at_the_cap_and_halves_on_a_timeout():
    cc = controller(64, srtt=0.01)
    assert cc.window == 64
    cc.timeout(1.0)
    assert cc.window == 64 * BETA == 32 and cc.cuts == 1


def test_one_cut_per_timeout_period():
    cc = controller(64, srtt=0.01)
    cc.timeout(1.0)
    cc.timeout(1.0 + cc.rtt.rto / 2)  # the same window's timeouts: one event
    assert cc.window == 32 and cc.cuts == 1
    cc.timeout(1.0 + cc.rtt.rto)       # still timing out a timeout later: cut again
    assert cc.window == 16 and cc.cuts == 2


def test_floor_is_one_slot():
    cc = controller(8, srtt=0.01)
    for i in range(10):
        cc.timeout(float(i))
    assert cc.cwnd == 1.0 and cc.window == 1


def test_additive_increase_one_slot_per_window_and_capped():
    cc = controller(64, srtt=0.01)
    cc.timeout(0.0)
    assert cc.window == 32
    cc.on_time(32, 0.001)  # inside the cut's hold: no growth
    assert cc.window == 32
    t = cc.hold
    cc.on_time(32, t)      # a window of results on time: one slot
    assert cc.window == 33
    for _ in range(1000):
        cc.on_time(64, t)
    assert cc.cwnd == 64.0 and cc.window == 64


def test_cap_must_be_a_slot():
    with pytest.raises(ValueError, match="at least one slot"):
        controller(0)


def test_pacing_is_gain_times_window_over_srtt():
    cc = controller(64)
    assert math.isinf(cc.rate())
    assert cc.allowance(0.0) == 64  # no round trip yet: not paced
    cc.rtt.sample(0.01)
    assert cc.rate() == pytest.approx(GAIN * 64 / cc.rtt.srtt)
    cc = controller(64, srtt=0.01)
    assert cc.allowance(0.0) == 32  # a full bucket: half the window
    cc.spend(32)
    assert cc.allowance(0.0) == 0
    assert cc.ready_at(0.0) == pytest.approx(1 / cc.rate())
    assert cc.allowance(0.001) == int(0.001 * cc.rate())
    assert cc.allowance(10.0) == 32  # the bucket holds no more than its burst
    cc.cwnd = 1.0
    assert cc.burst() == MIN_BURST


class Stall:
    """The job's soft switch, silent once for ``seconds`` after ``arm()``: once the runs it
    took since have sent ``after`` results to every worker (past a round's first chunks, and
    past round 1's single chunk), the next run waits that long before it is taken. A switch
    that pauses (a reprogrammed pipeline, an overrun queue) is what a timeout means: chunks
    out and no result for a timeout's length, which every worker of the job sees. It wraps
    the Python engine's ``handle_run``, which the native loop does not call: the job's switch
    must run the Python engine."""

    def __init__(self, job, seconds, after=64):
        assert job.server.engine == "python", "Stall instruments the Python engine only"
        self.seconds, self.after, self.workers = seconds, after, len(job.agents)
        self.armed = self.due = False
        self.results = self.stalls = 0
        sw = job.server.switch
        self.handle_run = sw.handle_run
        sw.handle_run = self.handle

    def arm(self):
        self.armed, self.results = True, 0

    def handle(self, data, seg, src):
        if self.due:
            self.due = False
            self.stalls += 1
            time.sleep(self.seconds)
        replies = self.handle_run(data, seg, src)
        if self.armed and len(replies) == self.workers:  # results, multicast to all
            self.results += min(len(out) for out in replies.values())
            if self.results >= self.after:
                self.armed, self.due = False, True
        return replies


def test_rounds_stay_exact_with_congestion_control_under_loss(make_job):
    """Loss at every socket, and the switch silent once mid-round for longer than any
    timeout: the silence cuts the windows, every sum is exact, and the windows stay within
    1 .. slots. (Random loss alone need not cut: RACK and the probe resend before a round
    goes silent, as a window's worth of results keeps coming.)"""
    job = make_job(4, slots=32, deadline=10, congestion=True, engine="python",
                   per_worker=lambda w: {"faults": FaultSpec(0.08, 0.02, 0.05, seed=40 + w)})
    assert all(a.transport.cc is not None for a in job.agents)
    stall = Stall(job, 0.5)  # past max_timeout (0.1 s): every worker times out
    rng = np.random.default_rng(41)
    for i in range(3):
        if i == 1:  # a dense tensor: ~800 chunks in its value round, the stall mid-way
            stall.arm()
            xs = sparse_tensors(rng, 4, 200_000, 1.0)
        else:
            xs = sparse_tensors(rng, 4, 100_000, 0.01)
        res, err = job.run(lambda a, w, xs=xs: a.allreduce_detailed(xs[w]))
        assert not any(err), err
        assert_exact(res, xs)
    assert stall.stalls == 1
    ccs = [a.transport.cc for a in job.agents]
    assert sum(cc.cuts for cc in ccs) > 0
    assert all(1 <= cc.window <= 32 for cc in ccs)


def test_a_silent_switch_cuts_every_window(make_job):
    """No loss, one silence mid-round: every worker sees it, so every worker's window is cut
    (a job's windows are cut together: none holds back chunks its peers have sent), and the
    sum is exact. A window then grows on its own results' timing, so they need not stay
    equal to the slot."""
    job = make_job(4, slots=32, deadline=10, congestion=True, engine="python")
    stall = Stall(job, 0.5)
    rng = np.random.default_rng(43)
    xs = sparse_tensors(rng, 4, 200_000, 1.0)
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))  # joins, measures round trips
    assert not any(err), err
    assert all(a.transport.cc.cuts == 0 for a in job.agents)
    stall.arm()
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err), err
    assert_exact(res, xs)
    assert stall.stalls == 1
    cuts = [a.transport.cc.cuts for a in job.agents]
    assert all(c >= 1 for c in cuts), cuts


def test_a_window_of_one_slot_completes_exactly(make_job, monkeypatch):
    """The window at its floor: one chunk in flight at a time, still exact."""
    runs = []
    send_run = Round.send_run

    def checked(self, c0, end):
        runs.append((end - c0, self.next_c - self.ndone))  # chunks sent, chunks out before
        send_run(self, c0, end)

    monkeypatch.setattr(Round, "send_run", checked)
    job = make_job(3, mode="dense", congestion=True)
    for a in job.agents:
        a.transport.cc.cwnd = 1.0
        a.transport.cc.hold = math.inf  # no growth: stays at one slot
    xs = sparse_tensors(np.random.default_rng(42), 3, 20_000, 0.05)
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err), err
    assert_exact(res, xs)
    assert all(a.transport.cc.window == 1 for a in job.agents)
    assert runs and all(r == (1, 0) for r in runs)


def test_off_by_default_leaves_no_controller(make_job):
    job = make_job(2)
    assert all(a.transport.cc is None for a in job.agents)
    x = np.arange(3000, dtype=np.float32)
    res, err = job.run(lambda a, w: a.allreduce_detailed(x))
    assert not any(err), err
    assert_exact(res, [x, x])


def test_fairness_bench_arithmetic():
    """bench.fairness: goodput prorates the iterations at a window's edges; Jain's index."""
    from bench.fairness import goodput, jain

    log = [(0.0, 1.0), (1.0, 2.0), (2.0, 4.0)]
    assert goodput(log, 100, 0.0, 2.0) == pytest.approx(2 * 400 / 2)
    assert goodput(log, 100, 0.5, 3.0) == pytest.approx((0.5 + 1 + 0.5) * 400 / 2.5)
    assert goodput(log, 100, 3.0, 3.0) == 0.0
    assert jain([1.0, 1.0]) == 1.0
    assert jain([1.0, 0.0]) == 0.5
    assert jain([3.0, 1.0]) == pytest.approx(16 / 20)


def test_a_cut_needs_silence_for_a_timeout():
    """Round.congestion cuts only when chunks are out and no result has come back for a
    timeout's length since the round's last (overdue chunks while results flow: no cut), and
    not before the round's first result (its peers may not have started it)."""
    from types import SimpleNamespace

    cc = controller(64, srtt=0.01)
    rto = cc.rtt.rto
    r = SimpleNamespace(cc=cc, ndone=0, cc_done=0, t=SimpleNamespace(rtt=cc.rtt),
                        last_progress=0.0)
    pending = np.arange(4)
    now = 2 * rto
    Round.congestion(r, pending, now)  # silent, but no result yet in this round
    assert cc.cuts == 0
    r.ndone = 1
    r.last_progress = now - rto / 2  # a result came back lately
    Round.congestion(r, pending, now)
    assert cc.cuts == 0
    Round.congestion(r, pending[:0], now + rto)  # nothing out
    assert cc.cuts == 0
    Round.congestion(r, pending, now + rto)
    assert cc.cuts == 1 and cc.window == 32
