"""One worker's side of rounds 2 and 3 on the union support U (the agent's value rounds): its
words in each mode, the decode of what the switch returns, and the float sum.

Mode ``union`` never lists U on the worker: ``encode_union`` ranks a worker's non-zeros by
popcounts of the ORed bitmap, and ``decode_union`` writes the dense sum in one pass over that
bitmap (``union_indices`` + ``assemble`` remain, for the sketch and as the reference).
"""

from __future__ import annotations

import numpy as np

from homagg.host_agent.codec import kernels
from homagg.host_agent.codec.blocks import check_out, scale_blocks
from homagg.host_agent.codec.errors import AggregationOverflow, CodecError
from homagg.host_agent.codec.modes import Mode, as_mode
from homagg.host_agent.codec.quantization import INT32_MAX, INT32_MIN
from homagg.host_agent.codec.scan import Scan, Sparse, checked_words, ranks_in
from homagg.host_agent.codec.sketch import (
    DEFAULT_RATIO,
    PeelResult,
    peel,
    sketch_encode,
    sketch_size,
)


def encode_union(s: Sparse, union_words: np.ndarray) -> np.ndarray:
    """Round-2 words in mode ``union`` straight from the ORed bitmap: int32[u], this worker's
    value at each union rank (0 elsewhere). Same words as ``encode_values(s, union, 'union', .)``
    without listing U: a position's rank is the popcount of the union bitmap before it."""
    words = checked_words(union_words, s.n)
    v = kernels.active.encode_union(words, s.n, s.idx, s.val)
    if v is None:
        raise CodecError("worker's support is not contained in the union bitmap")
    return v


def encode_union_float(scan: Scan, union_words: np.ndarray, shifts: np.ndarray, block: int,
                       at: np.ndarray | None = None, at_shifts: np.ndarray | None = None
                       ) -> np.ndarray | None:
    """``encode_union`` of ``scan.quantize`` at block scales, in one pass over the non-zeros:
    each value quantized at its block's shift (``shifts``, one per ``block`` elements) or,
    at the sorted positions ``at``, at its own (``at_shifts``), and written at its rank in
    the union, with no array per non-zero between the steps (a 10M-element tensor at 1%:
    its value words in 1.8 ms against 2.3). None where a value does not quantize or the
    worker's support is not in the union: the two steps (``Scan.quantize``,
    ``encode_union``) then raise the error that names it."""
    words = checked_words(union_words, scan.n)
    none = np.zeros(0, np.int64)
    return kernels.active.encode_union_blocks(
        words, scan.n, scan.idx, scan.raw, np.asarray(shifts, np.int64), block,
        none if at is None else np.asarray(at, np.int64),
        none if at_shifts is None else np.asarray(at_shifts, np.int64))


def encode_union_dense(q: np.ndarray, own_words: np.ndarray, union_words: np.ndarray
                       ) -> np.ndarray:
    """``encode_union`` of a worker's dense int32 words ``q`` (all n, 0 where its tensor is
    zero; ``own_words`` its non-zero bitmap): the same words, read off q at the union's
    positions, without listing the worker's positions (a mostly dense tensor's list is 12
    bytes an element)."""
    n = q.size
    words = checked_words(union_words, n)
    own = checked_words(own_words, n)
    if np.any(own[:words.size] & ~words[:own.size]):
        raise CodecError("worker's support is not contained in the union bitmap")
    return kernels.active.gather_union(words, n, q)


def decode_union(union_words: np.ndarray, n: int, values: np.ndarray, shift: int,
                 dtype=np.float32) -> np.ndarray:
    """Mode ``union``'s decoded sum as a dense float tensor, straight from the ORed bitmap:
    ``assemble(n, union_indices(union_words, n), values, shift, dtype)`` in one sequential pass
    over the bitmap that writes every output element once (0 off the union)."""
    words = checked_words(union_words, n)
    out = kernels.active.decode_union(words, n, np.asarray(values), shift, dtype)
    if out is None:
        raise CodecError("union bitmap and values disagree on the union size")
    return out


def encode_values(s: Sparse, union: np.ndarray, mode: str, seed: int,
                  ratio: float = DEFAULT_RATIO) -> np.ndarray:
    """Round-2 int32 words of one worker, for a union support every worker shares."""
    mode = as_mode(mode)
    if mode == Mode.DENSE:
        return s.to_dense()
    if mode == Mode.UNION:
        v = np.zeros(union.size, np.int32)
        v[ranks_in(union, s.idx)] = s.val
        return v
    return sketch_encode(s, sketch_size(union.size, ratio), seed)


def decode_values(agg: np.ndarray, union: np.ndarray, mode: str, seed: int) -> PeelResult:
    """Round-2 aggregate -> int values per union rank (per element for dense), and which are
    still unknown (sketch only: those go to the residual round)."""
    mode = as_mode(mode)
    if mode == Mode.SKETCH:
        return peel(agg, union, seed)
    return PeelResult(agg.astype(np.int64), np.ones(agg.size, bool), 0)


def residual_values(s: Sparse, positions: np.ndarray) -> np.ndarray:
    """Round-3 int32 words: this worker's values at the (shared) unresolved positions."""
    out = np.zeros(positions.size, np.int32)
    if s.idx.size:
        hit = np.minimum(np.searchsorted(s.idx, positions), s.idx.size - 1)
        ok = s.idx[hit] == positions
        out[ok] = s.val[hit[ok]]
    return out


def assemble(n: int, union: np.ndarray, values: np.ndarray, shift: int,
             dtype=np.float32) -> np.ndarray:
    """The decoded sum as a dense float tensor: values (per union rank) / 2**shift.

    Each value is rounded once, from the exact ``values * 2**-shift``, to ``dtype``.
    """
    return kernels.active.assemble(n, union, values, shift, dtype)


def check_int32(values: np.ndarray, round_name: str) -> None:
    """Decoded sums must fit the switch's int32 words: AggregationOverflow otherwise."""
    if values.size and (values.max() > INT32_MAX or values.min() < INT32_MIN):
        raise AggregationOverflow(round_name,
                                  np.flatnonzero((values > INT32_MAX) | (values < INT32_MIN)))


def decode_union_blocks(union_words: np.ndarray, n: int, values: np.ndarray,
                        block_shifts: np.ndarray, block: int, dtype=np.float32,
                        out: np.ndarray | None = None) -> np.ndarray:
    """``union.decode_union`` with block scales: the dense float sum, each value rounded once
    from the exact ``value * 2**-shift`` of its block; in one pass over the bitmap when the
    block is a whole number of bitmap words (32 elements), else decoded then scaled. Into
    ``out`` where given (``check_out``; it may be the worker's own tensor, an all-reduce in
    place: nothing is written there unless the union and the values agree)."""
    if out is not None:
        out = check_out(out, n, dtype)
    if block % 32:
        return scale_blocks(decode_union(union_words, n, values, 0, np.float64), block_shifts,
                            block, dtype, out)
    words = checked_words(union_words, n)
    scales = np.repeat(np.ldexp(1.0, -np.asarray(block_shifts, np.int64)), block // 32)
    out = kernels.active.decode_union_scaled(words, n, np.asarray(values),
                                             scales[:-(-n // 32)], dtype, out)
    if out is None:
        raise CodecError("union bitmap and values disagree on the union size")
    return out
