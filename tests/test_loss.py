"""``host_agent.loss`` alone: when the tail-loss probe fires, with and without a loss RACK
found lately, and what the recovery's wait counters take. A round's state is set by hand (no
socket): the end-to-end cases are in ``tests/test_agent.py``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from homagg.host_agent.config import AgentConfig
from homagg.host_agent.engine import Counters
from homagg.host_agent.engine.loss import LOSS_ROUNDS, PROBE_SAMPLES, PROBES, LossRecovery
from homagg.host_agent.engine.rto import RtoEstimator


class FakeRound(LossRecovery):
    """The state ``LossRecovery`` reads, chunks 0 .. n - 1 sent at time 0; sends recorded."""

    def __init__(self, n=4, srtt=0.004, rttvar=0.004):
        self.cfg = AgentConfig(1, 0, 2, ("127.0.0.1", 48864), ("127.0.0.1", 0), 16)
        self.counters = Counters()
        rtt = RtoEstimator(0.05, self.cfg.min_timeout, self.cfg.max_timeout)
        rtt.srtt, rtt.rttvar, rtt.samples = srtt, rttvar, PROBE_SAMPLES
        rtt.rto = max(srtt + 4 * rttvar, rtt.min_rto)
        self.t = SimpleNamespace(rtt=rtt)
        self.join = False
        self.nchunks = self.next_c = n
        self.done = np.zeros(n, bool)
        self.sent_at = np.zeros(n)
        self.rto = np.full(n, rtt.rto)
        self.resent = np.zeros(n, bool)
        self.held = np.zeros(n, bool)
        self.rack_ts, self.rack_c, self.rack_rtt = -np.inf, -1, 0.0
        self.nprobes, self.probe_c = 0, -1
        self.last_new = 0.0
        self.last_progress = 0.0
        self.next_send, self.interval = 0.0, 0.0
        self.sends: list[int] = []

    def send(self, c):
        self.sends.append(c)


def test_the_probe_waits_the_timeouts_estimate_until_rack_finds_a_loss():
    r = FakeRound(srtt=0.004, rttvar=0.004)
    assert not r.lossy()
    assert r.pto() == pytest.approx(0.004 + 4 * 0.004)  # srtt + 4 rttvar
    r.t.rtt.loss_round = r.counters.rounds
    assert r.lossy()
    assert r.pto() == pytest.approx(max(2 * 0.004, r.cfg.min_timeout / 4))  # RFC 8985's
    r.counters.rounds += LOSS_ROUNDS + 1
    assert not r.lossy()


def test_a_rack_resend_marks_the_round_lossy_and_counts_its_wait():
    r = FakeRound(n=4)
    r.delivered(3, 0.005)  # the last chunk's result: chunks 0-2 sent before it
    r.done[3] = True
    pending = r.retransmit(r.in_flight(), now=0.010)  # past 5 ms + srtt / 4
    assert sorted(r.sends) == [0, 1, 2] and pending.tolist() == [0, 1, 2]
    assert r.counters.early_resends == 3 and r.counters.retransmissions == 3
    assert r.counters.waited_rack == pytest.approx(3 * 0.010)
    assert r.counters.waited_timeout == 0.0
    assert r.lossy()


def test_held_chunks_are_probed_only_after_a_loss():
    r = FakeRound(n=2)
    r.held[:] = True
    r.sent_at[:] = [0.001, 0.002]  # their statuses
    pending = r.in_flight()
    assert r.probe_at(pending) == np.inf  # no loss seen: they wait for a peer, then the timeout
    r.t.rtt.loss_round = 0
    due = r.probe_at(pending)
    assert due == pytest.approx(0.001 + r.pto())
    r.retransmit(pending, due)
    assert r.sends == [0] and r.counters.probes == 1  # the oldest status first
    assert r.counters.waited_probe == pytest.approx(due - 0.001)
    # unanswered: probed again a probe timeout later; then no more until a result
    again = r.probe_at(pending)
    assert again == pytest.approx(due + r.pto())
    r.retransmit(pending, again)
    assert r.sends == [0, 0] and r.counters.probes == PROBES == 2
    assert r.probe_at(pending) == np.inf
