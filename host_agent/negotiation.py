"""Round 1 of an all-reduce and the index rounds that ride with it: what each worker sends to
negotiate the tensor's scale, and what the ORed words settle (``Negotiation``).

The words of round 1: the exponent one-hot (a worker's max exponent as one bit; the OR gives
the job's max) with the non-finite flag in bit 0, the round-cost word (``round_cost``: what a
round trip costs each worker, which the index choice weighs), the block words and split flags
(``codec.blocks``), and the index of the non-zeros, flat or the hierarchical index's top level,
whose mid round carries the block words of the scale blocks the union touches
(``codec.index``). ``Agent`` (``allreduce.py``) decides what to send (the mode, the index, what
it remembers per tensor) and goes on from what this settled; the format lives here, apart from
the value rounds, so either can be read alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from homagg import wire
from homagg.host_agent import codec
from homagg.host_agent.codec.index import BLOCK as INDEX_BLOCK
from homagg.host_agent.engine.round_cost import HOLD, agreed_words
from homagg.host_agent.local import Round1

#: Bit 0 of the exponent words (e = -EXP_BIAS, below any float32 exponent): "I have a NaN or
#: an Inf". The OR tells every worker in round 1.
NONFINITE_BIT = 0
#: Round 1's head: the exponent words, then the round-cost word (``round_cost``).
HEAD_WORDS = wire.EXP_WORDS + 1


def exponent_words(e: int | None, nonfinite: bool = False,
                   cost: int = 0, hold: bool = True) -> np.ndarray:
    """Round 1's head (HEAD_WORDS): a worker's max exponent e as one bit (e + EXP_BIAS) of
    EXP_WORDS words, whose OR over the workers gives the job's max (``max_exponent``), then
    its round-cost word ``cost`` (``RoundCost.word``). Bit 0 is the non-finite flag (an e that
    low is raised to -EXP_BIAS + 1: a coarser scale, never a finer one). ``hold``: this
    worker has no next tensor ready to ride with this one's next round (``HOLD`` in the
    round-cost word; ``Negotiation.pipelined``)."""
    onehot = np.zeros(HEAD_WORDS, np.uint32)
    onehot[wire.EXP_WORDS] = cost | (HOLD if hold else 0)
    bits = [NONFINITE_BIT] if nonfinite else []
    if e is not None:
        bits.append(max(e + wire.EXP_BIAS, NONFINITE_BIT + 1))
    for b in bits:
        onehot[b // 32] |= np.uint32(1 << (31 - b % 32))
    return onehot


def max_exponent(words: np.ndarray) -> int | None:
    bits = np.unpackbits(words.astype(">u4").view(np.uint8))
    hits = np.flatnonzero(bits[NONFINITE_BIT + 1:])
    return None if hits.size == 0 else int(hits[-1]) + NONFINITE_BIT + 1 - wire.EXP_BIAS


def _nonfinite(words: np.ndarray) -> bool:
    return bool(np.unpackbits(words.astype(">u4").view(np.uint8))[NONFINITE_BIT])


def _blocks_touched(top_blocks: np.ndarray, n: int, block: int) -> np.ndarray:
    """Scale blocks (sorted int64) overlapping the hierarchy's union blocks (128 elements)."""
    nb = codec.block_count(n, block)
    span = INDEX_BLOCK
    lo = top_blocks * span // block
    hi = (np.minimum(top_blocks * span + span, n) - 1) // block
    mark = np.zeros(nb + 1, np.int64)
    np.add.at(mark, lo, 1)
    np.add.at(mark, hi + 1, -1)
    return np.flatnonzero(np.cumsum(mark[:nb]) > 0)


@dataclass
class Proposal:
    """What a worker's round 1 sends, built before it goes: the mode asked (dense: no index),
    the index (None: dense), the tensor's ``Round1``, the head (``exponent_words``), the
    hierarchy (hier) and the round's words (``first_words``)."""

    mode: str
    index: str | None
    mine: Round1
    onehot: np.ndarray
    levels: Any  # codec.Levels, or the device codec's (hier); None otherwise
    words: np.ndarray


@dataclass
class Negotiation:
    """What round 1 (and the index rounds) settled, for ``Agent.allreduce_detailed``'s later
    steps: what this worker's round 1 carried of its tensor and its max exponent, the mode
    asked (``auto`` still undecided), the ORed round-1 words (exponents first), the union
    bitmap (None: dense), the index and its words per round, the ORed block words and the
    split blocks."""

    mine: Round1
    exponent: int | None
    mode: str
    ored: np.ndarray
    union_words: np.ndarray | None
    index: str | None
    index_rounds: dict[str, int]
    block_words: np.ndarray | None  # None: round 1 flagged a non-finite value, and ended it
    split: np.ndarray

    @property
    def nonfinite(self) -> bool:
        """Some worker had a NaN or an Inf (round 1's flag)."""
        return _nonfinite(self.ored[:wire.EXP_WORDS])

    @property
    def pipelined(self) -> bool:
        """No worker held the job's next tensor back: its round 1 rides with this tensor's
        next round, on every worker (``Agent``)."""
        return not int(self.ored[wire.EXP_WORDS]) & HOLD

    @property
    def round_words(self) -> int | None:
        """The job's round cost in words (``round_cost.agreed_words``), None: no estimate."""
        return agreed_words(self.ored[wire.EXP_WORDS])


def first_words(onehot, blocks, flags, index, mine: Round1, levels=None) -> np.ndarray:
    """Round 1's words: the head, then the block words and split flags and the flat bitmap
    (``index`` flat), the block words and split flags alone (None: dense, no index), or the
    hierarchy's top level (hier: its mid round carries the block words)."""
    if index == codec.HIER:
        assert levels is not None
        return np.concatenate([onehot, levels.top])
    if index is None:
        return np.concatenate([onehot, blocks, flags])
    assert mine.words is not None
    return np.concatenate([onehot, blocks, flags, mine.words])


def index_rounds(stream: Callable[[int, np.ndarray], np.ndarray], block: int, mine: Round1,
                 onehot, blocks, flags, index, levels=None, first=None):
    """Round 1 (its head, and the flat bitmap after the block words and split flags,
    or the top level) and, for ``hier``, the mid round (with the block words and split
    flags of the scale blocks the union's blocks touch) and the leaf round: (round 1's
    ORed words, the flat union bitmap, words per index round, the ORed block words, the
    split blocks). Round 1 flagging a non-finite value anywhere ends it there (union
    bitmap None). ``levels``: this worker's hierarchy (``top``, ``mid(blocks)``,
    ``leaf(subs)``, as ``codec.Levels``), where it is not built from ``mine.words`` (the
    device codec builds it where the tensor lives). ``first``: round 1's ORed words where
    they came already (its words rode with the tensor before's, ``first_words``)."""
    E = HEAD_WORDS
    n, B = mine.n, block
    if levels is None and index == codec.HIER:
        assert mine.words is not None
        levels = codec.Levels.of(mine.words, n)
    if first is None:
        first = stream(wire.OP_OR, first_words(onehot, blocks, flags, index, mine, levels))
    if index == codec.FLAT:
        agg = first.view(np.uint32)
        union_words = agg[E + blocks.size + flags.size:]
        return (agg, union_words, {codec.ROUND_FLAT: union_words.size},
                agg[E:E + blocks.size],
                codec.split_blocks(agg[E + blocks.size:E + blocks.size + flags.size], n, B))
    assert levels is not None
    agg = first.view(np.uint32)
    split = np.zeros(0, np.int64)
    if _nonfinite(agg[:E]):
        return agg, None, {codec.ROUND_TOP: levels.top.size}, None, split
    block_agg = np.zeros(blocks.size, np.uint32)
    first = [True]

    def or_round(words):
        nonlocal split
        if not first[0]:
            return stream(wire.OP_OR, words[0]).view(np.uint32)
        first[0] = False  # the mid round: the touched scale blocks' words ride along
        touched = _blocks_touched(codec.union_blocks(agg[E:], n), n, B)
        mine = np.zeros(blocks.size, bool)
        mine[codec.split_blocks(flags, n, B)] = True
        got = stream(wire.OP_OR, np.concatenate([words[0], blocks[touched],
                                                 codec.kernels.active.pack(mine[touched])])
                     ).view(np.uint32)
        w = words[0].size
        block_agg[touched] = got[w:w + touched.size]
        split = touched[codec.set_bits(got[w + touched.size:], touched.size)]
        return got[:w]

    union_words, sent = codec.hier_rounds([levels], agg[E:], or_round)
    return agg, union_words, sent, block_agg, split
