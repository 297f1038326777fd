"""Block floating point: one power-of-two scale per block of ``block`` elements, agreed in a
round the job sends anyway (no extra round trip).

A worker's tensor maximum has exponent e_w (``max_exponent``); the job's, e = max e_w, gives
the tensor shift s (``shift_for``). Per block of B elements each worker sends one word: bit d
set, d = min(31, e_w - e_b) with e_b the exponent of the block's largest magnitude on that
worker (0 for a block it has no non-zero in). The OR's lowest set bit d* (``block_offsets``)
is the job's offset; the block's shift is s + d* (0 for a block empty on every worker).

Why the sums still fit (``shift_for``'s headroom, per element): every worker's block maximum
satisfies e_b <= e_w - d_w <= e - d*, so |q| = |x| 2**(s + d*) < 2**(e + s): the same bound as
with one scale per tensor. A sketch counter mixing elements of different blocks is therefore
still bounded by ``headroom`` elements times that bound, as before.

The offset is relative to each worker's own maximum, so the job's block scale can only be
too coarse, never too fine: when the workers' tensor maxima differ, a block can lose up to
(e - min e_w) bits against the ideal; a block more than 31 binades below the tensor maximum
gets offset 31. Overhead: one word per B elements (B = 256: 0.39% of dense fp32).

Split blocks. A block that straddles a small-scale run and a large one (a layer of 1e-10 next to
one of 1e-1, at a parameter boundary inside a flat bucket) takes the large run's scale, which
crushes the small run to zero. Each worker therefore also flags (one bit per block,
``split_flags``) a block in which it holds ``SPLIT_RUN`` or more consecutive non-zeros each more
than ``SPLIT_BINADES`` binades below the block's peak: a run of values, not one small value, so
a normal layer's values near zero (probability about 2.3 * 2**-9 each, so about 1e-11 for a run
at a given position) practically never flag one, and a tensor without such a boundary pays no
extra round. A small layer shorter than ``SPLIT_RUN`` inside a block of a much larger one is not
split (its values take the large one's scale). The OR names the blocks every worker splits; for
those, one more OR round carries one word per element (``element_words``: bit min(31, e_w -
e_i)), and each element takes the lowest set bit as its own offset (``split_offsets``). That
offset is never below its block's (the element's peak is at most the block's, on every worker),
so the bound above holds per element unchanged. The split round costs one word per element of a
split block, and only tensors with such a block pay it.
"""

from __future__ import annotations

import numpy as np

from homagg.host_agent.codec import kernels
from homagg.host_agent.codec.errors import CodecError

#: Elements per scale block (one 32-bit word each in the negotiation: 1/256 of dense).
DEFAULT_BLOCK = 256
#: The largest offset a block word can carry.
MAX_OFFSET = 31
#: A block splits where a worker holds this many consecutive non-zeros each more than
#: ``SPLIT_BINADES`` binades below the block's peak. Below 8 binades an element keeps 21 of
#: the 29 bits a 4-worker sum leaves it (relative error under 1e-6); a run of 5 is what makes
#: a false split of a normal layer negligible (about 0.0062**5 = 1e-11 per position; a run of 3
#: split about 2 blocks of every 4 workers' 2M-element tensors, an extra round each time).
SPLIT_BINADES = 8
SPLIT_RUN = 5


def block_count(n: int, block: int) -> int:
    if block < 1:
        raise CodecError(f"block size {block}: must be >= 1")
    return -(-n // block)


def block_words(idx: np.ndarray, raw: np.ndarray, n: int, block: int,
                e_max: int | None) -> np.ndarray:
    """One worker's negotiation words, one per block: bit min(31, e_max - e_block) set (uint32),
    0 for a block without non-zeros. ``idx`` (sorted) and ``raw`` are the tensor's non-zeros
    (``Scan``), all finite; ``e_max`` its max exponent."""
    nb = block_count(n, block)
    if e_max is None or idx.size == 0:
        return np.zeros(nb, np.uint32)
    return peak_words(kernels.active.block_peaks(np.asarray(idx, np.int64), raw, nb, block),
                      e_max)


def peak_words(peaks: np.ndarray, e_max: int | None) -> np.ndarray:
    """``block_words`` from the blocks' peaks (float64, 0 for a block without non-zeros)."""
    words = np.zeros(peaks.size, np.uint32)
    if e_max is None:
        return words
    has = np.flatnonzero(peaks > 0)  # the blocks with a non-zero (|raw| > 0)
    e = np.frexp(peaks[has])[1].astype(np.int64)
    d = np.clip(e_max - e, 0, MAX_OFFSET).astype(np.uint32)
    words[has] = np.left_shift(np.uint32(1), d)
    return words


def split_flags(idx: np.ndarray, raw: np.ndarray, n: int, block: int,
                enabled: bool = True) -> np.ndarray:
    """This worker's split flags: a bitmap (``scan.bitmap``'s layout) of one bit per block,
    set where the block holds ``SPLIT_RUN`` consecutive non-zeros each more than
    ``SPLIT_BINADES`` below the block's peak. ``idx`` (sorted) and ``raw`` as ``block_words``.
    Not ``enabled``: all clear (the words are still sent, so the round's size is the same)."""
    nb = block_count(n, block)
    if not enabled or idx.size < SPLIT_RUN:
        return kernels.active.pack(np.zeros(nb, bool))
    return kernels.active.pack(kernels.active.split_mask(
        np.asarray(idx, np.int64), raw, nb, block, SPLIT_BINADES, SPLIT_RUN))


def split_positions(blocks: np.ndarray, n: int, block: int) -> np.ndarray:
    """The elements (sorted int64) of the split ``blocks``: one word each in the split round."""
    blocks = np.asarray(blocks, np.int64)
    if not blocks.size:
        return np.zeros(0, np.int64)
    pos = (blocks[:, None] * block + np.arange(block)).reshape(-1)
    return pos[pos < n]


def element_words(idx: np.ndarray, raw: np.ndarray, positions: np.ndarray,
                  e_max: int | None) -> np.ndarray:
    """This worker's split-round words: one per element of ``positions`` (sorted), bit
    min(31, e_max - e_i) set, 0 where the element is zero."""
    words = np.zeros(positions.size, np.uint32)
    if e_max is None or not positions.size or not idx.size:
        return words
    idx = np.asarray(idx, np.int64)
    at = np.searchsorted(positions, idx)
    hit = (at < positions.size) & (positions[np.minimum(at, positions.size - 1)] == idx)
    e = np.frexp(np.abs(np.asarray(raw, np.float64)[hit]))[1].astype(np.int64)
    words[at[hit]] = np.left_shift(np.uint32(1), np.clip(e_max - e, 0, MAX_OFFSET)
                                   .astype(np.uint32))
    return words


def split_offsets(offsets: np.ndarray, block: int, n: int, positions: np.ndarray,
                  ored: np.ndarray) -> np.ndarray:
    """Per-element offsets (int64, n): each block's ``offsets``, except at the split
    ``positions``, which take their ORed element word's lowest set bit (their block's where
    the element is zero on every worker)."""
    out = element_shifts(offsets, block, n)
    ored = np.asarray(ored).view(np.uint32)
    own = block_offsets(ored)
    out[positions] = np.where(ored != 0, own, out[positions])
    return out


def block_offsets(words: np.ndarray) -> np.ndarray:
    """The job's offset per block from the ORed block words: the lowest set bit (int64); 0 for
    a block empty on every worker."""
    w = np.asarray(words).view(np.uint32).astype(np.int64)
    low = w & -w
    return np.where(w != 0, np.frexp(low.astype(np.float64))[1] - 1, 0).astype(np.int64)


def element_shifts(block_shifts: np.ndarray, block: int, n: int) -> np.ndarray:
    """The per-element shift (int64, n) of per-block shifts."""
    return np.repeat(np.asarray(block_shifts, np.int64), block)[:n]


def scale_blocks(values: np.ndarray, block_shifts: np.ndarray, block: int,
                 dtype=np.float32, out: np.ndarray | None = None) -> np.ndarray:
    """Exact integer sums (dense, int or float64) times 2**-shift of their block, rounded once
    to ``dtype``: ldexp by a power of two is exact in float64 (the shifts stay far from its
    limits), so each element is rounded once, from the exact value. Into ``out`` where given
    (``check_out``)."""
    v = np.ascontiguousarray(values)
    if v.dtype not in (np.int32, np.int64, np.float64):
        v = v.astype(np.float64)
    scales = np.ldexp(1.0, -np.asarray(block_shifts, np.int64))
    return kernels.active.scale_blocks(v, scales, block, dtype,
                                       None if out is None else check_out(out, v.size, dtype))


def check_out(out: np.ndarray, n: int, dtype) -> np.ndarray:
    """``out`` if a decode may write its n values of ``dtype`` there (a contiguous, writeable
    array of that size and dtype, of any shape); CodecError saying what does not fit else."""
    if not isinstance(out, np.ndarray):
        raise CodecError(f"out must be a numpy array, got {type(out).__name__}")
    if out.dtype != np.dtype(dtype) or out.size != n:
        raise CodecError(f"out must hold {n} values of {np.dtype(dtype)}, got {out.size} of "
                         f"{out.dtype}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise CodecError("out must be a contiguous, writeable array")
    return out.reshape(-1)
