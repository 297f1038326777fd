"""Congestion control per agent (``AgentConfig.congestion``, off by default): how many of the
job's slots the agent keeps in flight (its window), and how fast it opens them (pacing), so that
jobs sharing a link share it, and none collapses when another starts. (Off by default because
bench/fairness.py measured two jobs sharing a 100 Mbit/s link as fair without it, and with more
resends with it: docs/performance.md, "Aggregation throughput".)

AIMD on a window counted in slots (chunks sent and not yet done), as TCP's congestion avoidance
(RFC 5681) but for slots: the window starts at the job's slots (its cap: a job alone on its
links runs as it did without the control), grows by one slot per window of chunks that come back
outside a cut's hold, and halves on a timeout, down to one slot. A timeout here is TCP's: chunks
out and no result at all for a timeout's length (``Round.congestion``), after the round's first
(before it, the round waits for its peers to start it). While results still come, a chunk out
past its timeout was lost (RACK's and the probe's business) or waits for a peer that sent it
later. Silence is what every worker of a job sees alike, so their windows are cut together and
stay alike: a worker whose window were cut alone would hold back chunks its peers have sent and
wait on, whose timeouts would resend them (bench/fairness.py, with cuts per worker on its own
chunks: 2.6-15x the resends of no control). After a cut, the chunks already in flight were sent
under the old window: their timeouts are the same congestion event, so neither a second cut nor
growth comes before a retransmission timeout has passed (``hold``). A window is no fairer than
its signal: a queue deep enough to hold every job's window never drops, so the windows stay at
their caps and the jobs share the link by their windows' ratio (equal slots: equally).

What counts as congestion: a timeout, not a resend on RACK's evidence alone. RACK resends a
chunk when a chunk sent after it has come back: the path delivers, and the evidence is as much
reordering (netem's jitter, the fault injector, a tree's two paths) as loss, and the losses it
finds first in this deployment are random (a lossy link, the injector), which a smaller window
does not cure but would pay for in every later round. A bottleneck that is really overrun keeps
dropping, the resends too, and its queue delays a window past the timeout: that is what a timeout
says, and what the window answers. (A tail-loss probe is not a timeout either: it is the resend
that saves one.)

Pacing: new chunks go out at ``gain x window / srtt`` packets a second (the smoothed round trip
of ``homagg.host_agent.engine.rto``), from a bucket of at most ``burst`` packets, so a window that
opens at once (a run of results, a new round) reaches the bottleneck spread over its round trip
rather than as one burst into its queue. The gain of 2 lets the window, not the pacing, bound a
job's rate in steady state (Linux paces TCP at 2x in slow start and 1.2x after), and the bucket
keeps whole runs of datagrams per system call (``homagg.udpio``'s batching) on the common path.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from homagg.host_agent.engine.rto import RtoEstimator

#: Multiplicative decrease on a timeout, pacing gain over window / srtt, and the pacing
#: bucket (packets) as a fraction of the window (at least MIN_BURST).
BETA = 0.5
GAIN = 2.0
BURST = 0.5
MIN_BURST = 4


class Congestion:
    """One agent's window (in slots) and pacing; one per ``Transport``, across its rounds."""

    def __init__(self, cap: int, rtt: RtoEstimator):
        if cap < 1:
            raise ValueError(f"congestion window cap {cap}: at least one slot")
        self.cap = cap
        self.rtt = rtt
        self.cwnd = float(cap)
        self.hold = -math.inf   # no cut and no growth before this (after a cut: one RTO)
        self.cuts = 0           # timeouts that cut the window
        self.tokens = float(max(MIN_BURST, BURST * cap))
        self.stamp: float | None = None  # when the bucket was last filled

    @property
    def window(self) -> int:
        """Slots the agent may have in flight now: 1 .. cap."""
        return max(1, min(self.cap, int(self.cwnd)))

    def on_time(self, n: int, now: float) -> None:
        """``n`` chunks came back on time: additive increase, one slot per window of them."""
        if n > 0 and now >= self.hold:
            self.cwnd = min(float(self.cap), self.cwnd + n / self.cwnd)

    def timeout(self, now: float) -> None:
        """A chunk's timeout ran out: multiplicative decrease, once per timeout period."""
        if now < self.hold:
            return
        self.cwnd = max(1.0, self.cwnd * BETA)
        self.hold = now + self.rtt.rto
        self.cuts += 1

    # -- pacing ----------------------------------------------------------------------------
    def rate(self) -> float:
        """Packets a second (inf until a round trip has been measured)."""
        srtt = self.rtt.srtt
        return GAIN * self.cwnd / srtt if srtt else math.inf

    def burst(self) -> float:
        return max(MIN_BURST, BURST * self.cwnd)

    def allowance(self, now: float) -> int:
        """New chunks pacing allows now."""
        rate = self.rate()
        if math.isinf(rate):  # no round trip measured yet: nothing to pace by
            self.tokens, self.stamp = self.burst(), now
            return self.cap
        if self.stamp is None:
            self.tokens = self.burst()
        else:
            self.tokens = min(self.burst(), self.tokens + (now - self.stamp) * rate)
        self.stamp = now
        return int(self.tokens)

    def spend(self, n: int) -> None:
        self.tokens -= n

    def ready_at(self, now: float) -> float:
        """When pacing allows the next chunk (``now`` if it does already)."""
        missing = 1.0 - self.tokens
        return now if missing <= 0 else now + missing / self.rate()
