"""What one more round trip costs, in words: the job-wide figure ``codec.choose_index`` weighs
the hierarchical index's two extra rounds against the flat bitmap's extra words with.

A round's time is about ``fixed + (packets - 1) x per_packet``: ``fixed`` is what a round
costs however small (the round trip, the round's setup), measured on rounds of fewer than
``MIN_PACKETS`` packets; ``per_packet`` is what each further packet adds, measured on longer
rounds. ``words`` = fixed / per_packet x K: the words a round trip is worth. A tensor's first
round is no sample: it also waits for the slowest worker to reach the tensor (a DDP bucket
waits for every worker's backward pass), which one more round would not.
On a fast link with a CPU-bound agent that is tens of thousands of words (round trips are
dear: fewer rounds win); on a 100 Mbit/s link, a few thousand (bytes are dear).

Every worker measures its own; they agree through round 1 (``negotiation``): each sets one
bit, log2 of its figure, in the round-cost word, and the OR gives every worker the same set,
of which the job takes the largest (a step waits for its slowest worker). Every worker then
makes the same index choice without a message.
"""

from __future__ import annotations

import math

import numpy as np

#: Rounds with at least this many packets give the per-packet time.
MIN_PACKETS = 8
#: Weight of a new sample (an EWMA, as RFC 6298 smooths round trips).
ALPHA = 0.125
#: Bits of the round-cost word: log2 of the words a round trip is worth, 1 .. 31.
BITS = 32
#: The word's top bit (log2 = 0: a round trip worth one word, which no link comes near) is no
#: cost: a worker sets it to hold its job's next tensor back from this tensor's next round
#: (``negotiation``: pipelined tensors).
HOLD = 1 << 31


class RoundCost:
    """One worker's estimate: ``sample`` each completed round, read ``words``."""

    def __init__(self) -> None:
        self.fixed: float | None = None       # seconds a one-packet round takes
        self.per_packet: float | None = None  # seconds each further packet adds
        self.k = 0                            # words per packet (the rounds' K)
        self._first = False                   # the next round is a tensor's first

    def tensor_starts(self) -> None:
        """The next round is a new tensor's first (no sample: see the module docstring)."""
        self._first = True

    def sample(self, packets: int, k: int, seconds: float) -> None:
        """A completed round of ``packets`` packets of ``k`` words that took ``seconds``."""
        self.k = k
        if self._first:
            self._first = False
        elif packets < MIN_PACKETS:
            extra = (packets - 1) * (self.per_packet or 0.0)
            self.fixed = _ewma(self.fixed, max(seconds - extra, 0.0))
        elif self.fixed is not None:
            self.per_packet = _ewma(self.per_packet,
                                    max(seconds - self.fixed, 0.0) / (packets - 1))

    @property
    def words(self) -> float | None:
        """Words a round trip is worth to this worker; None until both parts are measured."""
        if self.fixed is None or self.per_packet is None or not self.k:
            return None
        if self.per_packet <= 0.0:
            return float(2 ** (BITS - 1))
        return self.fixed / self.per_packet * self.k

    def word(self) -> int:
        """This worker's round-cost word for round 1: bit log2(words) (MSB first, as the
        exponent words; at least 1: bit 0 is ``HOLD``), or 0 (no estimate yet: says
        nothing)."""
        w = self.words
        if w is None:
            return 0
        b = min(max(round(math.log2(max(w, 1.0))), 1), BITS - 1)  # (bit 0 is HOLD)
        return 1 << (31 - b)


def agreed_words(ored: int | np.integer) -> int | None:
    """The job's round cost from the ORed round-cost word: 2 ** the largest bit any worker set
    (the slowest worker's rounds); None when no worker had an estimate."""
    w = int(ored) & ~HOLD
    if not w:
        return None
    low = w & -w  # bit b is 1 << (31 - b): the largest b is the lowest bit set
    return 2 ** (31 - (low.bit_length() - 1))


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new
