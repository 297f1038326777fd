"""What an all-reduce returns (``Agent.allreduce_detailed``, ``Agent.allreduce_rows``): the
float sum and the exact integers behind it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from homagg.host_agent import codec
from homagg.host_agent.codec import Mode

__all__ = ["Result", "RowsResult"]


@dataclass
class Result:
    """One all-reduce: the float sum, and the exact integers behind it.

    The scale is per block of ``block`` elements (``codec.blocks``): ``block_shifts[k]`` for
    elements k*block .. (k+1)*block - 1, ``tensor_shift`` plus the block's agreed offset (after
    any rescale). ``shift`` is the per-element array (``codec.quantize`` takes it): the sum is,
    bit for bit, the integer sum of ``codec.quantize(x_w, shift)`` over workers w.
    ``nonfinite``: some worker had a NaN or Inf; ``out`` is then NaN everywhere, and there are
    no integers (``ints`` raises).
    """

    out: np.ndarray
    tensor_shift: int
    mode: Mode
    n: int
    union_words: np.ndarray | None  # ORed non-zero bitmap the values are on (None: dense)
    values: np.ndarray         # exact integer sums: dense, or per union rank (dense and
                               # union: the switch's int32 words; sketch: int64)
    wire_bytes: int            # homagg payload bytes this worker sent (retransmissions too)
    rounds: dict = field(default_factory=dict)  # words sent per round: index ("bitmap" or
                               # "index-top/mid/leaf", without the exponent and block words),
                               # values
    _union: np.ndarray | None = field(default=None, repr=False, compare=False)
    index: str | None = None   # "flat" or "hier"; None: no index round (dense remembered)
    block_shifts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    block: int = codec.DEFAULT_BLOCK
    nonfinite: bool = False
    # the split blocks' elements and their shifts, when any block split (``split``)
    _split_at: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False,
                                                            compare=False)
    _split: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def split(self) -> np.ndarray | None:
        """When any block split: the whole tensor's per-element shifts (int64, n), built on
        first use (n int64 a bucket: 0.3 s for 21M elements, which the hook never reads);
        else None."""
        if self._split_at is None:
            return None
        if self._split is None:
            at, shifts = self._split_at
            out = codec.element_shifts(self.block_shifts, self.block, self.n)
            out[at] = shifts
            self._split = out
        return self._split

    @property
    def shift(self) -> np.ndarray:
        """The per-element shift (int64, n): element i is in units of 2**-shift[i]."""
        split = self.split
        if split is not None:
            return split
        return codec.element_shifts(self.block_shifts, self.block, self.n)

    @property
    def union(self) -> np.ndarray | None:
        """Positions the values are on (None: dense), listed on first use only."""
        if self.union_words is None:
            return None
        if self._union is None:
            self._union = codec.union_indices(self.union_words, self.n)
        return self._union

    def ints(self) -> np.ndarray:
        """The exact integer sum as a dense int64 array."""
        if self.nonfinite:
            raise codec.CodecError("a worker had non-finite values: no integer sum")
        if self.union_words is None:
            return self.values.astype(np.int64)
        full = np.zeros(self.n, np.int64)
        full[self.union] = self.values
        return full


@dataclass
class RowsResult:
    """A row-sparse all-reduce (``Agent.allreduce_rows``): the union of the workers' rows,
    the summed rows on it, and the values' all-reduce behind them (its exact integers)."""

    rows: np.ndarray    # int64, sorted: the union
    values: np.ndarray  # (rows.size, *row shape), the sums
    result: Result
