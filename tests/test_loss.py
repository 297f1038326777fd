"""``host_agent.loss`` alone: when the tail-loss probe fires, with and without a loss RACK
found lately, and what the recovery's wait counters take. A round's state is set by hand (no
socket): the end-to-end cases are in ``tests/test_agent.py``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from homagg.host_agent.config import AgentConfig
from homagg.host_agent.engine import Counters
from homagg.host_agent.engine.loss import (
    HELD_PROBES,
    LOSS_ROUNDS,
    PROBE_SAMPLES,
    PROBES,
    LossRecovery,
)
from homagg.host_agent.engine.rto import RtoEstimator


class FakeRound(LossRecovery):
    """The state ``LossRecovery`` reads, chunks 0 .. n - 1 sent at time 0; sends recorded."""

    def __init__(self, n=4, srtt=0.004, rttvar=0.004, min_rtt=0.001):
        self.cfg = AgentConfig(1, 0, 2, ("127.0.0.1", 48864), ("127.0.0.1", 0), 16)
        self.counters = Counters()
        rtt = RtoEstimator(0.05, self.cfg.min_timeout, self.cfg.max_timeout)
        rtt.srtt, rtt.rttvar, rtt.samples = srtt, rttvar, PROBE_SAMPLES
        rtt.rto = max(srtt + 4 * rttvar, rtt.min_rto)
        rtt.min_cur = min_rtt
        self.t = SimpleNamespace(rtt=rtt)
        self.join = False
        self.nchunks = self.next_c = n
        self.done = np.zeros(n, bool)
        self.sent_at = np.zeros(n)
        self.rto = np.full(n, rtt.rto)
        self.resent = np.zeros(n, bool)
        self.held = np.zeros(n, bool)
        self.rack_ts, self.rack_c, self.rack_rtt = -np.inf, -1, 0.0
        self.nprobes, self.probe_c, self.held_probes = 0, -1, 0
        self.last_status = -np.inf
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
    # two of the least round trips (the smoothed one grows with the peers' recovery)
    assert r.pto() == pytest.approx(max(2 * 0.001, r.cfg.min_timeout / 16))
    r.t.rtt.min_cur = 0.0001
    assert r.pto() == pytest.approx(r.cfg.min_timeout / 16)  # its floor
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


def test_a_resent_chunks_result_is_no_evidence_against_the_chunks_numbered_above_it():
    """RACK's evidence is a result of a chunk numbered after and sent after (``rack_due``):
    chunks 0-3 sent at 0, chunk 1 resent at 10 ms and its result back at 10.5 ms. Its peers'
    copies were in, so chunk 0's result is overdue (every peer sent it before chunk 1), but
    chunks 2 and 3 may wait for a slow peer's copies: they keep their timeouts."""
    r = FakeRound(n=4)
    r.sent_at[1], r.resent[1] = 0.010, True
    r.delivered(1, 0.0105)
    r.done[1] = True
    assert (r.rack_ts, r.rack_c) == (0.010, 1)
    pending = r.retransmit(r.in_flight(), now=0.012)  # past 0.5 ms + srtt / 4, before 20 ms
    assert r.sends == [0] and pending.tolist() == [0, 2, 3]
    assert r.counters.early_resends == 1 and r.counters.waited_timeout == 0.0
    assert np.isinf(r.rack_due(np.array([2, 3]))).all()


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
    # spent: HELD_PROBES more of the oldest chunk out, 4, 8 and 16 probe timeouts after its
    # last send, while the round is lossy (a result lost after its peer's recovery)
    r.rto[:] = 1.0  # (their timeouts later than these)
    for k in range(HELD_PROBES):
        oldest, want = float(r.sent_at.min()), int(np.argmin(r.sent_at))
        at = r.probe_at(pending)
        assert at == pytest.approx(oldest + r.pto() * 4 * 2 ** k)
        r.retransmit(pending, at)
        assert r.sends[-1] == want
    assert len(r.sends) == PROBES + HELD_PROBES
    assert r.probe_at(pending) == np.inf  # then the timeout, until a result
    r.counters.rounds += LOSS_ROUNDS + 1
    r.held_probes = 0
    assert r.probe_at(pending) == np.inf  # not lossy: none


def test_a_timeout_resends_only_what_the_switch_cannot_hold():
    """A window of 6 overdue chunks. Chunk 5's status came after the window went out: the
    switch waits for a peer, so of the window only the oldest goes again (chunk 0); the
    others' timers start over. Without a status the whole window goes, as before."""
    r = FakeRound(n=6)
    r.sent_at[:] = 0.001
    r.held[5] = True
    r.sent_at[5] = r.last_status = 0.002
    now = 0.001 + r.rto.max() + 0.001
    pending = r.retransmit(r.in_flight(), now)
    assert r.sends == [0]
    assert r.counters.held_back == 5 and r.counters.retransmissions == 1
    assert np.all(r.sent_at == now)  # every timer starts over, with its backoff
    assert pending.tolist() == [0, 1, 2, 3, 4, 5]
    # a result of chunk 0 moves the round: RACK resends the chunks before it that are lost
    plain = FakeRound(n=6)
    plain.sent_at[:] = 0.001
    plain.retransmit(plain.in_flight(), now)
    assert plain.sends == [0, 1, 2, 3, 4, 5] and plain.counters.held_back == 0


def test_a_timeout_asks_once_for_the_chunks_the_switch_holds():
    r = FakeRound(n=3)
    r.held[:] = True
    r.sent_at[:] = [0.003, 0.001, 0.002]  # their statuses
    now = 0.003 + r.rto.max() + 0.001
    r.retransmit(r.in_flight(), now)
    assert r.sends == [1] and r.counters.held_back == 2  # the oldest status
