"""Which of a round's chunks are lost, and when to resend them: the timeout, RACK and the
tail-loss probe. ``LossRecovery`` is the part of ``round.Round`` that decides; the round keeps
the per-chunk state it reads (declared below) and does the sending.

Each chunk has a timeout (measured, ``rto``, with backoff). Loss is also detected without
waiting it out, as TCP's RACK does (RFC 8985): once the result of a chunk numbered after chunk
c and sent after it has come back, c is deemed lost when it has been out for that result's
round trip plus a reordering window (a quarter of the smoothed round trip), and is resent then.
Numbered after it, not only sent after it: the switch completes a chunk once every peer's copy
is in, and each peer sends its chunks in order, so a result says every peer has sent the chunks
numbered below it, and nothing of those above. A resent chunk's result (its peers' copies long
in) comes back while the chunks sent before the resend and numbered above it still wait for a
slow peer's; taken as evidence against them, it would resend a window that is only queued.
A chunk the switch said it holds (a status reply) is exempt: a peer's packet is what it waits
for. Each such resend waits for a later chunk's result again, so none repeats
without new evidence. A loss with nothing sent after it (a round's tail) is found by a tail-loss
probe (RFC 8985's TLP): after a probe timeout of silence the latest-sent chunk not held is resent
once, and again only after another result; the timeout (with backoff) covers a lost probe.
The probe times out sooner, and probes held chunks too, while RACK has found losses lately.

A timeout resends only what the switch cannot already hold (``retransmit``): of the overdue
chunks it has said it holds, or that went out before its latest status (which says it waits for
a peer, not for us), just the oldest, as a question; the others' timers start over, and RACK and
the probe, which the next result re-arms, find any of them that was lost after all. A window's
timeout in a round that waits for a late peer is then one datagram, not the window.

``Counters`` keeps, per cause (timeout, RACK, probe), the time resent copies had been out:
where a faulty run's time goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from homagg.host_agent.config import AgentConfig

if TYPE_CHECKING:
    from homagg.host_agent.engine import Counters
    from homagg.host_agent.engine.transport import Transport

#: Round-trip samples the probe timeout needs before tail-loss probes start, and the probes
#: at most between two results (see ``LossRecovery.probe_at``).
PROBE_SAMPLES = 8
PROBES = 2
#: Further probes after those, while RACK has found losses lately: of the oldest chunk out,
#: 4, 8 and 16 probe timeouts after its last send or status (``LossRecovery.probe_at``).
HELD_PROBES = 3
#: Rounds after a loss RACK found during which the probe timeout is RFC 8985's own, two
#: smoothed round trips (see ``LossRecovery.pto``).
LOSS_ROUNDS = 16


class LossRecovery:
    """Loss detection over a round's per-chunk arrays (chunk c of the round: index c)."""

    # the round's state this reads and writes (set in ``Round.__init__``)
    cfg: AgentConfig
    counters: Counters
    t: Transport
    join: bool
    nchunks: int
    next_c: int
    done: np.ndarray
    sent_at: np.ndarray
    rto: np.ndarray
    resent: np.ndarray
    held: np.ndarray
    rack_ts: float
    rack_c: int
    rack_rtt: float
    nprobes: int
    held_probes: int
    probe_c: int
    last_status: float
    last_new: float
    last_progress: float
    next_send: float
    interval: float

    def send(self, c: int) -> None:  # the round's
        raise NotImplementedError

    def retransmit(self, pending: np.ndarray, now: float) -> np.ndarray:
        """Resend overdue chunks, with backoff, and chunks RACK deems lost (without); returns
        the chunks still pending."""
        if pending.size:
            pending = pending[~self.done[pending]]
            overdue = self.sent_at[pending] + self.rto[pending] <= now
            for c in pending[overdue]:
                self.rto[c] = min(self.rto[c] * self.cfg.backoff, self.cfg.max_timeout)
            overdue = self.held_back(pending, overdue, now)
            early = ~overdue & (self.rack_due(pending) <= now)
            if not self.join:
                out = now - self.sent_at[pending]
                self.counters.waited_timeout += float(out[overdue].sum())
                self.counters.waited_rack += float(out[early].sum())
            for c in pending[overdue | early]:
                self.send(int(c))
                self.sent_at[c] = now
                self.resent[c] = True
                self.counters.retransmissions += not self.join
            if early.any() and not self.join:
                self.counters.early_resends += int(early.sum())
                self.t.rtt.loss_round = self.counters.rounds
            if overdue.any():
                self.nprobes = PROBES  # the timeout's resends stand for the probes
            elif early.any():
                self.nprobes = 0  # RACK's resends, on evidence: the silence starts over
                self.last_new = now
            elif self.probe_at(pending) <= now:
                self.probe(pending, now)
        return pending

    def held_back(self, pending: np.ndarray, overdue: np.ndarray, now: float) -> np.ndarray:
        """The overdue chunks a timeout resends: not those the switch can already hold. Of the
        overdue chunks it said it holds, and of those that went out before its latest status
        (the switch answered after they left, and its answer was that it waits for a peer),
        only the oldest (the lowest-numbered of the oldest) is resent: its answer, a result or
        a status, asks for them all. The others' timers start over (their backoff stands);
        when the round moves on, RACK resends any of them that was lost after all, and the
        probe, which a result re-arms, the ones at its tail. Counted in
        ``Counters.held_back``."""
        waiting = overdue & (self.held[pending] | (self.sent_at[pending] < self.last_status))
        if np.count_nonzero(waiting) < 2:
            return overdue
        w = pending[waiting]
        ask = w[np.lexsort((w, self.sent_at[w]))[0]]
        quiet = waiting & (pending != ask)
        self.sent_at[pending[quiet]] = now
        if not self.join:
            self.counters.held_back += int(np.count_nonzero(quiet))
        return overdue & ~quiet

    def probe_at(self, pending: np.ndarray) -> float:
        """When to send a tail-loss probe (RFC 8985's TLP); inf if none is due. The first:
        after a probe timeout of silence (no result, no new chunk, no resend on RACK's
        evidence) with chunks out that the switch has not said it holds. The second: a probe
        timeout after the first, if that got no answer at all (the switch answers a probe of a
        chunk it holds with a status, and of a finished round with the result). Then the
        timeout, until another result or RACK's next resend re-arms them.

        The probe timeout is the timeout's estimate, ``srtt + 4 rttvar``, with a quarter of the
        timeout's floor as its floor instead of the whole, and at least two round trips (RFC
        8985). The timeout's floor is for a window's queue; the silence is measured from the
        last result, which that queue delays. The quarter: after a run of quick rounds the
        estimate is a few ms, less than a peer's occasional lag (on a 2-core host running 4
        agents, 1 to 2% of fault-free rounds wait 6 to 10 ms), and each probe of such a round
        is a datagram for nothing. No cap below the estimate: capped at half the floor, the
        probes found the soft target's losses sooner (a loss elsewhere in the job lengthens
        every agent's round trips, and so its estimate) but bmv2's queues, whose round trips
        vary that much with no loss, drew 5.7% more datagrams fault-free. It needs
        PROBE_SAMPLES round trips first: a first sample's variation is a guess (R / 2), and a
        round's silence includes the peers' skew, which a few samples do not show. A join has
        none: it waits for its peers to start.

        After a loss RACK found (in the last LOSS_ROUNDS rounds, ``lossy``), the probe timeout
        is two of the least recent round trips (``rto.RtoEstimator.min_rtt``; a sixteenth of
        the timeout's floor at least), and a round whose chunks out are all held is probed
        too, a probe timeout after the oldest status: a held chunk then mostly waits for a
        result that was lost on its way back (or for a peer's own recovery, which the probe's
        status answer shows). In a faulty run every round trip includes some peer's recovery,
        so ``4 rttvar``, and then ``2 srtt``, kept the probe near the timeout. And once the
        probes are spent (answered held, or a timeout resent), HELD_PROBES more ask for the
        oldest chunk out, 4, 8 and 16 probe timeouts after its last send or status: a chunk
        held while a peer recovered, whose result was then lost on its way to us, waited the
        timeout (20 ms and more) out before. RACK finds no loss in a fault-free run on the
        software target; on bmv2 it finds the ones the loaded switch makes, and those rounds
        probe sooner."""
        pto = self.pto()
        if pto is None or not pending.size:
            return np.inf
        if self.nprobes >= PROBES:
            if self.lossy() and self.held_probes < HELD_PROBES:
                return float(self.sent_at[pending].min()) + pto * 4 * 2 ** self.held_probes
            return np.inf
        if self.nprobes:  # the first probe's chunk, unanswered (a status ends the probing)
            c = self.probe_c
            return np.inf if self.done[c] else self.sent_at[c] + pto
        if self.probe_candidates(pending).size:
            return max(self.last_progress, self.last_new) + pto
        if self.lossy():  # every chunk out is held: the first probe, a probe timeout after
            return float(self.sent_at[pending].min()) + pto  # its status (``probe``)
        return np.inf

    def probe_candidates(self, pending: np.ndarray) -> np.ndarray:
        """The chunks a probe may resend: those the switch has not said it holds, and those
        it said it holds before a later result came back (the round moved on without their
        result: lost on its way, or a peer's chunk was, which that peer resends)."""
        return pending[~self.held[pending] | (self.sent_at[pending] < self.last_progress)]

    def pto(self) -> float | None:
        """The probe timeout (see ``probe_at``), or None while there is none."""
        rtt = self.t.rtt
        if self.join or rtt.srtt is None or rtt.samples < PROBE_SAMPLES:
            return None
        if self.lossy():
            return max(2 * rtt.min_rtt, rtt.min_rto / 16)
        return max(rtt.srtt + 4 * rtt.rttvar, rtt.min_rto / 4, 2 * rtt.srtt)

    def lossy(self) -> bool:
        """Whether RACK found a loss in the last LOSS_ROUNDS rounds."""
        return self.counters.rounds - self.t.rtt.loss_round <= LOSS_ROUNDS

    def probe(self, pending: np.ndarray, now: float) -> None:
        """Resend the latest-sent chunk not held (the highest-numbered of those sent with
        it), or the first probe's chunk again, without backoff. Its result makes RACK resend
        the chunks before it; a status says it was there and the round waits for a peer
        (``Counters.probes_held``), which ends the probing until another result. Past the
        probes (``probe_at``), the oldest chunk out (the lowest-numbered of those)."""
        spent = self.nprobes >= PROBES
        if spent:
            c = int(pending[np.lexsort((pending, self.sent_at[pending]))[0]])
            self.held_probes += 1
        elif self.nprobes:
            c = self.probe_c
        else:
            cand = self.probe_candidates(pending)
            if cand.size:
                c = int(cand[np.lexsort((cand, self.sent_at[cand]))[-1]])
            else:  # (lossy: every chunk out is held) the one whose status is oldest
                c = int(pending[np.argmin(self.sent_at[pending])])
            self.probe_c = c
        self.counters.waited_probe += now - float(self.sent_at[c])
        self.send(c)
        self.sent_at[c] = now
        self.resent[c] = True
        self.nprobes += not spent  # (past the probes: held_probes counts)
        self.counters.retransmissions += 1
        self.counters.probes += 1

    def rack_due(self, pending: np.ndarray) -> np.ndarray:
        """Per pending chunk, when RACK deems it lost: numbered before the latest-sent chunk
        whose result came back and sent no later than it, and out for that result's round
        trip plus the reordering window; inf for the others (the module's doc says why the
        number counts)."""
        sent = self.sent_at[pending]
        before = (pending < self.rack_c) & (sent <= self.rack_ts)
        srtt = self.t.rtt.srtt or 0.0
        return np.where(before & ~self.held[pending], sent + self.rack_rtt + srtt / 4, np.inf)

    def delivered(self, c: int, now: float) -> None:
        """RACK's state after chunk ``c``'s result came back (of a run: its latest-sent,
        highest-numbered chunk)."""
        sent = float(self.sent_at[c])
        if (sent, c) > (self.rack_ts, self.rack_c):
            self.rack_ts, self.rack_c, self.rack_rtt = sent, c, now - sent

    def in_flight(self) -> np.ndarray:
        """Chunks sent (within the window) and not done."""
        lo = max(0, self.next_c - self.cfg.slots) if self.next_c else 0
        return np.flatnonzero(~self.done[lo:self.next_c]) + lo

    def wake_at(self, pending: np.ndarray, now: float) -> float:
        """When to stop waiting for results: the first timeout or RACK deadline, or the next
        paced send."""
        first_due = (min(float(np.minimum(self.sent_at[pending] + self.rto[pending],
                                          self.rack_due(pending)).min()),
                         self.probe_at(pending)) if pending.size else now + 0.05)
        paced = self.next_send if (self.interval and self.next_c < self.nchunks) else now + 0.05
        return min(first_due, paced)

    # -- receiving -----------------------------------------------------------------------------
