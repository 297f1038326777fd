"""A worker's own tensor as the agent's rounds see it: the per-element work of an all-reduce,
apart from the rounds themselves (``allreduce.Agent``), so that it can run where the tensor
lives.

The agent asks a local tensor for three things, and decides everything else (the index, the
mode, the scales, the rescale) from what the switch returned:

- ``round1``: the words this worker's round 1 carries (``Round1``): its max exponent or the
  non-finite flag, the block words, the split flags and the flat non-zero bitmap;
- ``element_words``: the split round's words, for the elements of the split blocks;
- ``value_words`` (and ``residual_words`` for the sketch): its int32 words at the agreed
  ``Scales``, in the mode the job chose; then ``decode``: the float sum from the switch's
  exact integers, each element rounded once.

``HostTensor`` does it in numpy (``codec``): the reference. ``distributed.device.DeviceTensor``
does it with torch operations on the tensor's own device (a GPU's), and only the words cross
to the host. Both give the same words and the same sums, bit for bit, so workers of either
kind can share a job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from homagg.host_agent import codec
from homagg.host_agent.codec import Mode


@dataclass(frozen=True)
class Scales:
    """The shifts a tensor's values go through the switch at: element i is in units of
    2**-shift(i), ``shift`` plus its block's ``offsets`` (one per block of ``block``), or,
    for the elements ``at`` of split blocks (sorted; None: no block split), ``shift`` plus
    their own ``at_offsets``."""

    shift: int
    offsets: np.ndarray
    block: int
    at: np.ndarray | None = None
    at_offsets: np.ndarray | None = None

    def blocks(self) -> np.ndarray:
        """Every block's shift (int64)."""
        return self.shift + self.offsets

    def elements(self, n: int) -> np.ndarray:
        """Every element's shift (int64, n)."""
        out = codec.element_shifts(self.blocks(), self.block, n)
        if self.at is not None:
            out[self.at] = self.at_shifts()
        return out

    def at_shifts(self) -> np.ndarray:
        """The shifts (int64) of the split blocks' elements ``at``."""
        assert self.at is not None and self.at_offsets is not None
        return self.shift + self.at_offsets

    def of(self, positions: np.ndarray) -> np.ndarray:
        """The shifts (int64) of the elements at sorted ``positions``."""
        out = self.blocks()[np.asarray(positions, np.int64) // self.block]
        if self.at is not None and self.at.size and positions.size:
            k = np.searchsorted(self.at, positions)
            hit = (k < self.at.size) & (self.at[np.minimum(k, self.at.size - 1)] == positions)
            out[hit] = self.at_shifts()[k[hit]]
        return out

    def coarser(self, bits: int) -> Scales:
        """Every shift ``bits`` lower (a rescale after the switch flagged an overflow)."""
        return replace(self, shift=self.shift - bits)


@dataclass(frozen=True)
class Round1:
    """What a worker's round 1 carries of its tensor (``Agent``'s negotiation lays it out):
    its max exponent (None: all zero, or not ``finite``), one word per block, the split flags,
    and the flat non-zero bitmap (NaN and Inf count as non-zero), where it was asked for (a
    dense round sends none, the hierarchical index its levels: the local tensor's
    ``levels()``)."""

    n: int
    finite: bool
    exponent: int | None
    blocks: np.ndarray  # uint32, one per scale block
    flags: np.ndarray   # uint32 words: one bit per block
    words: np.ndarray | None  # uint32 words: the flat bitmap (None: not asked for)


class HostTensor:
    """A worker's 1-D float tensor in host memory, done with the numpy codec (the
    reference: ``codec``'s functions, unchanged)."""

    def __init__(self, x: np.ndarray):
        self.x = np.asarray(x).reshape(-1)
        self.n = self.x.size
        self.dtype = self.x.dtype
        self._scan: codec.Scan | None = None
        self._words: np.ndarray | None = None  # round 1's non-zero bitmap
        self._sparse: codec.Sparse | None = None

    @property
    def scan(self) -> codec.Scan:
        if self._scan is None:
            self._scan = codec.Scan.of(self.x)
        return self._scan

    def round1(self, block: int, split: bool, words: bool = True) -> Round1:
        # (a dense tensor's positions are not listed: ``scan`` lists them if a mode needs
        # them, a sparse tensor's come with the summary; the bitmap comes whether ``words``
        # asks for it or not: the summary builds it anyway)
        sm = codec.Summary.of(self.x, block, split)
        self._words = sm.words
        if sm.scan is not None:
            self._scan = sm.scan
        finite = sm.finite()
        e = sm.max_exponent() if finite else None
        return Round1(self.n, finite, e, sm.block_words(e), sm.split_flags(), sm.words)

    def levels(self) -> codec.Levels:
        """The hierarchical index's levels of round 1's bitmap."""
        assert self._words is not None  # (round 1 first)
        return codec.Levels.of(self._words, self.n)

    def element_words(self, positions: np.ndarray, e: int | None) -> np.ndarray:
        # the split blocks' own elements, read where they are: no scan of the whole tensor
        # (a dense 21M-element bucket's scan and search took seconds for 100k positions)
        pos = np.asarray(positions, np.int64)
        v = self.x[pos]
        nz = np.flatnonzero(v != 0)
        return codec.element_words(pos[nz], v[nz], pos, e)

    def value_words(self, mode, scales: Scales, union_words: np.ndarray | None,
                    union: np.ndarray | None, seed: int, ratio: float,
                    alloc: Callable[[int, Any], np.ndarray] = np.empty) -> np.ndarray:
        """The value round's int32 words: dense (all n), on the union (from the bitmap), or
        the sketch's counters on the listed ``union``. A value out of int32 at its scale
        raises CodecError naming its index. ``alloc(n, dtype)`` makes the dense words' array
        (the transport's ``Scratch.empty``: memory kept from round to round)."""
        if mode == Mode.DENSE or union_words is None:
            self._scan = None  # (its positions and values: 12 bytes an element, not needed)
            return self._dense_words(scales, alloc)
        if mode == Mode.UNION and self._scan is None and self._words is not None:
            # a mostly dense tensor (round 1 listed no positions): its dense words, read at
            # the union's positions (the same words as from the positions, bit for bit)
            return codec.encode_union_dense(self._dense_words(scales, alloc), self._words,
                                            union_words)
        if mode == Mode.UNION:  # in one pass; where it finds a fault, step by step to name it
            got = codec.encode_union_float(
                self.scan, union_words, scales.blocks(), scales.block, scales.at,
                scales.at_shifts() if scales.at is not None else None)
            if got is not None:
                return got
        s = self._sparse = self.scan.quantize(scales.of(self.scan.idx))
        if mode == Mode.UNION:
            return codec.encode_union(s, union_words)
        assert union is not None  # mode sketch: the union listed
        return codec.encode_values(s, union, mode, seed, ratio)

    def _dense_words(self, scales: Scales,
                     alloc: Callable[[int, Any], np.ndarray] = np.empty) -> np.ndarray:
        """Every element quantized at its shift, in one pass (``quantize_blocks``: the
        numpy reference does a chunk of a million elements at a time, so the float64
        products of a large tensor are never whole). A value out of int32 at its scale
        raises ``codec.quantize``'s CodecError, with its index in the tensor."""
        at = scales.at if scales.at is not None else np.zeros(0, np.int64)
        at_shifts = scales.at_shifts() if scales.at is not None else np.zeros(0, np.int64)
        out, bad = codec.kernels.active.quantize_blocks(self.x, scales.blocks(), scales.block,
                                                        at, at_shifts, alloc(self.n, np.int32))
        if bad < 0:
            return out
        try:  # the first bad value alone, for quantize's own message
            codec.quantize(self.x[bad:bad + 1], scales.of(np.array([bad])))
        except codec.CodecError as err:
            raise codec.CodecError(str(err).replace("index 0", f"index {bad}", 1),
                                   index=bad) from None
        raise codec.CodecError(f"value {self.x[bad]} at index {bad} does not quantize",
                               index=bad)

    def residual_words(self, positions: np.ndarray) -> np.ndarray:
        """The residual round's words: this worker's values (at the scales of the last
        ``value_words``) at the positions peeling left."""
        assert self._sparse is not None
        return codec.residual_values(self._sparse, positions)

    def decode(self, values: np.ndarray, scales: Scales, mode, union_words: np.ndarray | None,
               union: np.ndarray | None, dtype, out: np.ndarray | None = None) -> np.ndarray:
        """The float sum (``dtype``): each element rounded once, from its exact value
        times 2**-(its shift), dense, from the union bitmap (mode union) or on the union's
        positions (sketch). Into ``out`` where given (``codec.check_out``: n values of
        ``dtype``, contiguous; it may be ``x`` itself), which saves a fresh array's first
        touch (a 10M-element sum at 1%: half of its 9 ms)."""
        n, B, bs = self.n, scales.block, scales.blocks()
        if union_words is None:
            out = codec.scale_blocks(values, bs, B, dtype, out)
        elif mode == Mode.UNION:
            out = codec.decode_union_blocks(union_words, n, values, bs, B, dtype, out)
        else:
            assert union is not None  # mode sketch: the union listed
            out = codec.scale_blocks(codec.assemble(n, union, values, 0, np.float64), bs, B,
                                     dtype, out)
        if scales.at is not None:
            # the split blocks' elements again at their own scales: per-element scales over
            # the whole tensor cost 40x the block decode (a 642k-element DDP bucket: 9.2 ms
            # against 0.2 ms), and only the split blocks need them
            at = scales.at
            out[at] = codec.scale_blocks(_exact_at(at, values, mode, union_words, union, n),
                                         scales.at_shifts(), 1, dtype)
        return out

    def nan(self, dtype, out: np.ndarray | None = None) -> np.ndarray:
        """The answer when some worker had a NaN or an Inf: NaN everywhere (in ``out`` where
        given)."""
        if out is None:
            return np.full(self.n, np.nan, dtype)
        out = codec.check_out(out, self.n, dtype)
        out.fill(np.nan)
        return out


def _exact_at(at: np.ndarray, values: np.ndarray, mode, union_words, union,
              n: int) -> np.ndarray:
    """The exact integer sums (float64: exact below 2**53) at positions ``at``."""
    if union_words is None:
        return np.asarray(values)[at]
    if mode == Mode.UNION:
        return codec.decode_union(union_words, n, values, 0, np.float64)[at]
    assert union is not None  # mode sketch
    return codec.assemble(n, union, values, 0, np.float64)[at]
