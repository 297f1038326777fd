"""The union's index: which positions are non-zero anywhere, aggregated by OR in the switch.

Two lossless indexes; both end with every worker holding the same flat union bitmap (the ORed
non-zero bitmap, ``scan.bitmap``'s layout, bit for bit), from which the value rounds
(``union``, ``sketch`` + ``residual``) proceed unchanged.

``flat`` (1 round): each worker's non-zero bitmap, n/32 words whatever the sparsity.

``hier`` (3 rounds): a bitmap over fixed blocks, 128 -> 8 -> 1 elements, each level sent only
where the union's level above is set:

- ``index-top`` (round 1, with the exponent words): ceil(n/128) bits, bit b set iff block b
  (elements 128b .. 128b+127) has a non-zero;
- ``index-mid`` (OR): for each set bit of the ORed top level, in increasing order, 16 bits:
  which of that block's 8-element sub-blocks are non-empty (c1 * 16 bits, c1 = popcount of
  the ORed top level);
- ``index-leaf`` (OR): for each set bit of the ORed mid level, 8 bits: which elements of that
  sub-block are non-zero (c2 * 8 bits).

Every level is packed like the flat bitmap (bit i at bit 7-(i%8) of byte i//8, as uint32
words). Every worker knows the ORed level above, so it knows where its own bits go (the rank
of its block among the union's); a worker's bits for a block it does not touch are zero, so
the OR of the workers' levels is the level of the union. No extra messages: c1, c2 and the
positions come from what the switch returned, identical on every worker. With c1 = 0 (an
all-zero union) every worker skips the mid and leaf rounds together.

Which index (``choose_index``), per tensor, from integers every worker shares:
``flat`` or ``hier`` when asked; ``auto``, once the job's round cost is known (R words: what a
round trip costs, measured by every worker and agreed in round 1, ``host_agent.round_cost``)
and the same tensor (the agent's ``key``) has been seen: ``flat`` unless the hierarchy saved
more than 2R index words on its previous union (``hier_saving``), since ``hier`` costs two
more round trips; without the round cost, the previous union size u: ``flat`` if 5u > n, else
``hier``; without history, ``hier`` from n = 4096 elements on, else ``flat``. Round trips are
dear where the agents are CPU-bound on fast links (R of tens of thousands of words) and cheap
behind a slow link (a few thousand). Why the byte rule, in the simulator's bytes (8 workers,
N = 10M, independent random supports; wire bytes per worker / dense fp32):

    density per worker   union     flat      hier
    1%                    7.7%    10.9%     9.6%
    0.1%                  0.80%    3.9%     1.27%
    0.01%                 0.08%    3.2%     0.16%
    rows of 64, 0.1%      0.80%    3.9%     0.85%

For a random union of density p the hierarchy costs 1/4096 + (1 - (1-p)**128)/256 +
(1 - (1-p)**8)/32 words per element against the flat bitmap's 1/32: it saves 3.5% of the
index (0.1% of dense) at p = 20% and nothing from p ~ 22% on (at p = 1, 13% more); past 20%
the two extra round trips (latency, more on a lossy network) buy next to nothing, hence flat.
(Clustered supports, whole rows for instance, favour the hierarchy more: rows of 64 above.)
Below 4096 elements the flat bitmap is at most 128 words, two packets' worth: not worth two
more round trips either. Without history the agent bets on sparsity; a tensor that turns out
dense is then remembered as dense (no index at all), and one whose union is over 20% goes flat
from its second call on.

Speed: building the levels, gathering a worker's mid and leaf bits and scattering the ORed
leaf into the union bitmap are numpy passes over n/8 bytes or fewer; listing the union's
sub-blocks from the mid level is a kernel (``kernels``: ``subblocks``, numba and numpy twins).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from homagg.host_agent.codec import kernels
from homagg.host_agent.codec.errors import CodecError
from homagg.host_agent.codec.modes import AUTO
from homagg.host_agent.codec.scan import Sparse, bitmap, bitmap_words, checked_words, set_bits

#: Elements per top-level block and per sub-block; sub-blocks per block (16 bits, 2 bytes).
BLOCK = 128
SUB = 8
SUBS = BLOCK // SUB

FLAT = "flat"
HIER = "hier"
#: The ``index`` option's values.
INDEXES = (AUTO, FLAT, HIER)
#: Without history, ``auto`` uses the hierarchy from this many elements on.
HIER_MIN_N = 4096

#: Round names (``Result.rounds``, ``simulate.SimResult.bytes_per_worker``).
ROUND_FLAT = "bitmap"
ROUND_TOP = "index-top"
ROUND_MID = "index-mid"
ROUND_LEAF = "index-leaf"


def as_index(index: str) -> str:
    """``index`` if it is one of ``INDEXES``, else CodecError."""
    if index not in INDEXES:
        raise CodecError(f"unknown index {index!r}; expected one of {INDEXES}")
    return index


def choose_index(index: str, n: int, last_u: int | None = None, saves: int | None = None,
                 round_words: int | None = None) -> str:
    """``flat`` or ``hier`` for an n-element tensor (module docstring): ``index`` itself unless
    it is ``auto``; then, when the job's round cost (``round_words``) and the words the
    hierarchy saved on the tensor's previous union (``saves``, ``hier_saving``) are known,
    flat unless the hierarchy saves more than its two extra round trips cost; else from the
    previous union size ``last_u`` if known; else from n."""
    if as_index(index) != AUTO:
        return index
    if saves is not None and round_words is not None:
        return FLAT if saves <= 2 * round_words else HIER
    if last_u is not None:
        return FLAT if 5 * last_u > n else HIER
    return HIER if n >= HIER_MIN_N else FLAT


def hier_saving(union_words: np.ndarray, n: int) -> int:
    """Index words the hierarchy sends fewer than the flat bitmap for this union (negative:
    more): the flat bitmap against the top, mid and leaf levels of the union's blocks (c1)
    and sub-blocks (c2), which every worker's levels have (``level_words``)."""
    c1, c2 = kernels.active.level_counts(checked_words(union_words, n), n)
    return bitmap_words(n) - sum(level_words(n, c1, c2))


# --------------------------------------------------------------------------------------------
# Level sizes
# --------------------------------------------------------------------------------------------


def top_bits(n: int) -> int:
    """Blocks of an n-element tensor: bits of the top level."""
    return -(-n // BLOCK)


def level_words(n: int, c1: int, c2: int) -> tuple[int, int, int]:
    """uint32 words of the top, mid and leaf levels, given c1 union blocks and c2 union
    sub-blocks (a level with nothing to carry is not sent: 0 words)."""
    return bitmap_words(top_bits(n)), -(-c1 * SUBS // 32), -(-c2 * SUB // 32)


def _words(b: np.ndarray) -> np.ndarray:
    """Bytes (uint8 or uint16 in memory order) as uint32 words, zero-padded."""
    b = np.ascontiguousarray(b).view(np.uint8)
    pad = (-b.size) % 4
    if pad:
        b = np.concatenate([b, np.zeros(pad, np.uint8)])
    return b.view(np.uint32)


# --------------------------------------------------------------------------------------------
# One worker's levels
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Levels:
    """One worker's hierarchy, from its flat non-zero bitmap.

    ``top`` is round 1's words; ``mid`` and ``leaf`` give rounds 2 and 3 once the union's
    blocks and sub-blocks are known (``union_blocks``, ``union_subblocks``).
    """

    n: int
    top: np.ndarray    # uint32 words: ceil(n/128) bits
    flat: np.ndarray   # uint8: the flat bitmap's bytes (one per sub-block), whole blocks
    sub: np.ndarray    # uint16 per block: its 16 sub-block bits, as 2 packed bytes

    @classmethod
    def of(cls, words: np.ndarray, n: int) -> Levels:
        """The levels of a flat bitmap (``Scan.words``, ``bitmap``); bits past n are ignored."""
        raw = checked_words(words, n).view(np.uint8)
        nb = top_bits(n)
        flat = np.zeros(SUBS * nb, np.uint8)
        used = -(-n // SUB)
        flat[:used] = raw[:used]
        if n % SUB:
            flat[used - 1] &= np.uint8((0xFF << (SUB - n % SUB)) & 0xFF)
        sub = np.packbits(flat != 0).view(np.uint16)  # SUBS bits per block: 2 bytes
        return cls(n, kernels.active.pack(sub != 0), flat, sub)

    @classmethod
    def from_sparse(cls, s: Sparse) -> Levels:
        return cls.of(bitmap(s), s.n)

    def mid(self, blocks: np.ndarray) -> np.ndarray:
        """Round 2's words: this worker's 16 sub-block bits of each union block, in order."""
        return _words(self.sub[blocks])

    def leaf(self, subs: np.ndarray) -> np.ndarray:
        """Round 3's words: this worker's 8 element bits of each union sub-block, in order."""
        return _words(self.flat[subs])


# --------------------------------------------------------------------------------------------
# The union, from the ORed levels (identical on every worker)
# --------------------------------------------------------------------------------------------


def union_blocks(top_union: np.ndarray, n: int) -> np.ndarray:
    """The union's non-empty blocks (sorted int64) from the ORed top level; c1 = their count."""
    return set_bits(top_union, top_bits(n))


def union_subblocks(blocks: np.ndarray, mid_union: np.ndarray) -> np.ndarray:
    """The union's non-empty sub-blocks (sorted int64 sub-block numbers, element // 8) from the
    union's blocks and the ORed mid level; c2 = their count."""
    mid = checked_words(mid_union, SUBS * blocks.size)
    return kernels.active.subblocks(mid, np.ascontiguousarray(blocks, np.int64))


def union_bitmap(n: int, subs: np.ndarray, leaf_union: np.ndarray) -> np.ndarray:
    """The flat union bitmap (``bitmap_words(n)`` uint32 words, the ORed flat bitmap bit for
    bit) from the union's sub-blocks and the ORed leaf level."""
    leaf = np.ascontiguousarray(leaf_union).view(np.uint8)
    if leaf.size < subs.size:
        raise CodecError(f"leaf level of {leaf.size} bytes is too short for {subs.size} "
                         "sub-blocks")
    out = np.zeros(SUBS * top_bits(n), np.uint8)  # whole blocks: at least the bitmap's bytes
    out[subs] = leaf[:subs.size]
    return out[:4 * bitmap_words(n)].view(np.uint32)


def hier_rounds(levels: Sequence[Levels], top_union: np.ndarray,
                or_round: Callable[[list[np.ndarray]], np.ndarray]
                ) -> tuple[np.ndarray, dict[str, int]]:
    """Rounds 2 and 3 of the hierarchy, after round 1's ORed top level: the flat union bitmap,
    and the words each worker sent per index round (top level included).

    ``levels``: the workers taking part here (the agent: its own; a test's hand-run rounds:
    all of them); ``or_round(words per worker)`` returns their OR as uint32 (the switch, or
    ``homagg.host_agent.simulate.switch_or``).
    A level with nothing to carry is not sent, on any worker (they all see the same counts).
    """
    n = levels[0].n
    blocks = union_blocks(top_union, n)
    sent = {ROUND_TOP: bitmap_words(top_bits(n))}
    subs = np.zeros(0, np.int64)
    leaf = np.zeros(0, np.uint32)
    if blocks.size:
        mid = or_round([lv.mid(blocks) for lv in levels])
        sent[ROUND_MID] = mid.size
        subs = union_subblocks(blocks, mid)
        if subs.size:
            leaf = or_round([lv.leaf(subs) for lv in levels])
            sent[ROUND_LEAF] = leaf.size
    return union_bitmap(n, subs, leaf), sent
