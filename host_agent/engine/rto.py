"""The retransmission timeout, estimated from measured round trips (RFC 6298).

A fixed timeout resends half of everything on a queueing bmv2, so the agent measures: the
smoothed round trip ``srtt``, its variation ``rttvar``, and ``rto = srtt + 4 rttvar`` held
between a floor and a cap. Which round trips count is the caller's business (Karn: only those of
chunks sent once, see ``transport``).

It also keeps the least round trip of recent samples (``min_rtt``: the least of this epoch of
MIN_EPOCH samples and the last one, so it follows a path that got slower), which the tail-loss
probe times itself by after a loss (``loss.LossRecovery.pto``): a round trip in a faulty run
includes the peers' recovery, and so ``srtt`` grows with the losses it is meant to find.
"""

from __future__ import annotations

import math

#: Samples per epoch of ``min_rtt``'s window (about a window of chunks' worth of runs).
MIN_EPOCH = 64


class RtoEstimator:
    """RFC 6298's estimator: ``sample`` each round trip, read ``rto``."""

    def __init__(self, initial: float, min_rto: float, max_rto: float):
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.samples = 0  # how many round trips the estimate has taken
        self.rto = initial  # until the first sample
        self.min_rto = min_rto
        self.max_rto = max_rto
        # the round (``Counters.rounds``) in which RACK last found a loss: the tail-loss probe
        # times out sooner for a while after one (``loss.LossRecovery.pto``)
        self.loss_round = -(1 << 30)
        # the least round trip of this epoch and of the last (``min_rtt``), and this epoch's
        # samples so far
        self.min_cur = self.min_prev = math.inf
        self.min_n = 0

    @property
    def min_rtt(self) -> float:
        """The least round trip of the last MIN_EPOCH to 2 MIN_EPOCH samples (inf: none)."""
        return min(self.min_cur, self.min_prev)

    def sample(self, rtt: float) -> float:
        """Take one measured round trip (s); returns the new timeout."""
        self.samples += 1
        self.min_cur = min(self.min_cur, rtt)
        self.min_n += 1
        if self.min_n >= MIN_EPOCH:
            self.min_prev, self.min_cur, self.min_n = self.min_cur, math.inf, 0
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.rto = min(max(self.srtt + 4 * self.rttvar, self.min_rto), self.max_rto)
        return self.rto
