"""One worker's tensor as the codec sees it, and round 1's bitmaps.

``Scan.of`` reads a float tensor once for its non-zero bitmap, positions and values; ``Sparse``
is the quantized result. ``Summary.of`` is what round 1 reads of it (the bitmap, the blocks'
peaks and split flags, the non-finite check) without listing a dense tensor's positions.
The bitmap helpers read the ORed bitmap the switch returns: the union support U
(``union_indices``), its size (``union_size``) and a worker's ranks in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from homagg.host_agent.codec import kernels
from homagg.host_agent.codec.blocks import (
    DEFAULT_BLOCK,
    SPLIT_BINADES,
    SPLIT_RUN,
    block_count,
    block_offsets,
    block_words,
    element_words,
    peak_words,
    split_flags,
    split_offsets,
    split_positions,
)
from homagg.host_agent.codec.errors import CodecError
from homagg.host_agent.codec.quantization import DEFAULT_HEADROOM, max_exponent, quantize, shift_for

# --------------------------------------------------------------------------------------------
# Sparse view of one worker's tensor
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sparse:
    """A worker's int32 tensor as sorted non-zero positions and values.

    ``words``, when set, is the packed round-1 bitmap, already computed from the same scan.
    """

    n: int
    idx: np.ndarray  # int64, sorted, unique
    val: np.ndarray  # int32 (a tiny float may round to 0: it stays, harmlessly)
    words: np.ndarray | None = None

    @classmethod
    def from_dense(cls, q: np.ndarray) -> Sparse:
        q = np.asarray(q).reshape(-1)
        if q.dtype != np.int32:
            raise CodecError(f"expected int32 values, got {q.dtype}")
        words = kernels.active.pack(q != 0)
        idx = set_bits(words, q.size)
        return cls(q.size, idx, q[idx], words)

    @classmethod
    def from_float(cls, x: np.ndarray, shift: int) -> Sparse:
        return Scan.of(x).quantize(shift)

    def to_dense(self) -> np.ndarray:
        out = np.zeros(self.n, np.int32)
        out[self.idx] = self.val
        return out


@dataclass(frozen=True)
class Scan:
    """One pass over a float tensor: its non-zero positions, their values and the bitmap.

    Everything after the scan is O(nnz): the max exponent for the job's scale, quantization.
    """

    n: int
    idx: np.ndarray
    raw: np.ndarray
    words: np.ndarray

    @classmethod
    def of(cls, x: np.ndarray) -> Scan:
        x = np.asarray(x).reshape(-1)
        if not np.issubdtype(x.dtype, np.floating):
            raise CodecError(f"expected a floating-point tensor, got {x.dtype}")
        # NaN != 0, so NaNs land in raw and max_exponent() names them
        words, idx, raw = kernels.active.scan(x)
        return cls(x.size, idx, raw, words)

    def max_exponent(self) -> int | None:
        try:
            return max_exponent(self.raw)
        except CodecError:
            bad = int(self.idx[np.flatnonzero(~np.isfinite(self.raw))[0]])
            raise CodecError(f"tensor has a non-finite value at index {bad}",
                             index=bad) from None

    def finite(self) -> bool:
        """No NaN or Inf among the values (O(nnz))."""
        return bool(np.isfinite(self.raw).all())

    def quantize(self, shift) -> Sparse:
        """The non-zeros at ``shift``: an int, or one shift per non-zero (as ``raw``). A value
        out of range raises CodecError whose ``index`` is its position in the tensor."""
        try:
            return Sparse(self.n, self.idx, quantize(self.raw, shift), self.words)
        except CodecError as err:
            if err.index is None:
                raise
            at = int(self.idx[err.index])
            raise CodecError(str(err).replace(f"index {err.index}", f"index {at}", 1),
                             index=at) from None


@dataclass(frozen=True)
class Summary:
    """Round 1's reading of a float tensor, in two passes over it and nothing per element
    kept but the bitmap: its non-zero bitmap, each block's peak (the largest magnitude,
    float64) and split mask (``blocks.split_flags``'s), the first non-finite position (-1:
    none), and its ``Scan`` when it has at most a quarter non-zeros (None: a dense tensor,
    scanned again only if a sparse mode needs its positions). The same words as ``Scan``'s
    ``block_words`` and ``split_flags``, bit for bit (tested)."""

    n: int
    words: np.ndarray
    peaks: np.ndarray
    mask: np.ndarray
    bad: int
    scan: Scan | None

    @classmethod
    def of(cls, x: np.ndarray, block: int, split: bool) -> Summary:
        x = np.asarray(x).reshape(-1)
        if not np.issubdtype(x.dtype, np.floating):
            raise CodecError(f"expected a floating-point tensor, got {x.dtype}")
        block_count(x.size, block)  # (a bad block size: CodecError)
        words, peaks, mask, bad, nz = kernels.active.summary(
            x, block, SPLIT_BINADES, SPLIT_RUN, split, x.size // 4 + 64)
        scan = Scan(x.size, nz[0], nz[1], words) if nz is not None else None
        return cls(x.size, words, peaks, mask, bad, scan)

    def finite(self) -> bool:
        return self.bad < 0

    def max_exponent(self) -> int | None:
        """As ``Scan.max_exponent``: None for an all-zero tensor; CodecError naming the first
        non-finite value's index."""
        if self.bad >= 0:
            raise CodecError(f"tensor has a non-finite value at index {self.bad}",
                             index=self.bad)
        peak = float(self.peaks.max(initial=0.0))
        return math.frexp(peak)[1] if peak > 0 else None

    def block_words(self, e_max: int | None) -> np.ndarray:
        """``blocks.block_words`` of the tensor (uint32, one per block)."""
        return peak_words(self.peaks, e_max)

    def split_flags(self) -> np.ndarray:
        """``blocks.split_flags`` of the tensor (all clear unless asked and finite)."""
        return kernels.active.pack(self.mask)


# --------------------------------------------------------------------------------------------
# Round 1: bitmaps
# --------------------------------------------------------------------------------------------


def bitmap_words(n: int) -> int:
    """Number of 32-bit words in the bitmap of an n-element tensor."""
    return (n + 31) // 32


def bitmap(s: Sparse) -> np.ndarray:
    """Packed non-zero bitmap as uint32 words (bit i of the tensor is bit 7-(i%8) of byte i//8)."""
    if s.words is not None:
        return s.words
    mask = np.zeros(s.n, dtype=bool)
    mask[s.idx] = True
    return kernels.active.pack(mask)


def checked_words(words: np.ndarray, n: int) -> np.ndarray:
    """``words`` as contiguous uint32, long enough for n elements (else CodecError)."""
    words = np.ascontiguousarray(words, dtype=np.uint32)
    if n > 32 * words.size:
        raise CodecError(f"bitmap of {words.size} words is too short for {n} elements")
    return words


def set_bits(words: np.ndarray, n: int) -> np.ndarray:
    """Sorted int64 positions < n whose bit is set in a packed bitmap (``bitmap``'s layout)."""
    return kernels.active.set_bits(checked_words(words, n), n)


def union_indices(words: np.ndarray, n: int) -> np.ndarray:
    """Positions set in an ORed bitmap (sorted), i.e. the union support U."""
    return set_bits(words, n)


def ranks_in(union: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Rank of each of a worker's positions within U (they are a subset of U)."""
    r = kernels.active.ranks(union, idx)
    if r is None:
        raise CodecError("worker's support is not contained in the union bitmap")
    return r


def union_size(words: np.ndarray, n: int) -> int:
    """u: the number of positions < n set in an ORed bitmap (without listing them)."""
    return int(kernels.active.union_size(checked_words(words, n), n))


def split_blocks(flag_words: np.ndarray, n: int, block: int) -> np.ndarray:
    """The blocks (sorted int64) set in ORed split flags."""
    return set_bits(flag_words, block_count(n, block))


def agreed_shifts(arrays, headroom: int | None = None, block: int = DEFAULT_BLOCK,
                  shift_bias: int = 0, split: bool = False,
                  enabled: bool = True) -> np.ndarray:
    """The per-block shifts (int64) a job of ``len(arrays)`` workers agrees on for these
    tensors (finite floats, same size), before any rescale: what the agents' negotiation
    round gives, computed here from all the tensors at once (for checks and tests). With
    ``split``, the per-element shifts (n) after the split round (the agents' ``Result.shift``;
    ``enabled``: ``AgentConfig.split``)."""
    scans = [Scan.of(np.asarray(a).reshape(-1)) for a in arrays]
    if not scans:
        raise CodecError("agreed_shifts needs at least one tensor")
    n = scans[0].n
    exps = [s.max_exponent() for s in scans]
    ored = np.zeros(block_count(n, block), np.uint32)
    for s, e in zip(scans, exps):
        ored |= block_words(s.idx, s.raw, n, block, e)
    known = [e for e in exps if e is not None]
    shift = shift_for(max(known) if known else None, len(scans),
                      DEFAULT_HEADROOM if headroom is None else headroom) + shift_bias
    offsets = block_offsets(ored)
    if split:
        flags = np.bitwise_or.reduce([split_flags(s.idx, s.raw, n, block, enabled)
                                      for s in scans])
        pos = split_positions(split_blocks(flags, n, block), n, block)
        words = np.bitwise_or.reduce([element_words(s.idx, s.raw, pos, e)
                                      for s, e in zip(scans, exps)])
        offsets = split_offsets(offsets, block, n, pos, words)
    return shift + offsets
