"""The codec's compiled kernels as ``kernels`` hands them out: the C library's
(``_native``) where it has the function and it applies, numba's (``_jit``) otherwise, and numba
imported only when a kernel of its is first called.

A dense float32 tensor's all-reduce (round 1's reading, its words, the sums' scaling) runs on
the C library alone, so an agent that only ever reduces dense tensors never imports numba (its
import and its kernels' machine code cost a worker about 110 MB). Every other name is
``_jit``'s, looked up at its first use (a module ``__getattr__``); the results are the same
bits either way (the tests hold C, numba and numpy to them).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np

from homagg.host_agent.codec import _native, _ref

_jit_module: ModuleType | None = None
#: below this many elements numpy's pass costs microseconds: a block-level array (one value
#: per block of 256) goes to it rather than import numba
SMALL = 1 << 16


def jit() -> ModuleType:
    """numba's kernels (``_jit``), imported at the first call."""
    global _jit_module
    if _jit_module is None:
        _jit_module = importlib.import_module("homagg.host_agent.codec._jit")
    return _jit_module


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(jit(), name)


def summary(x: np.ndarray, block: int, binades: int, run: int, split: bool, cap: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int,
                       tuple[np.ndarray, np.ndarray] | None]:
    if x.dtype == np.float32:
        x = np.ascontiguousarray(x)
        got = _native.summary_f32(x, block, binades, run, split, cap=cap)
        if got is not None:  # (the C library's one pass: float32, whole-word blocks)
            words, peaks, mask, bad, nnz, nz = got
            if nz is None and nnz <= cap:  # a sparse tensor: its non-zeros from the bitmap
                idx = jit().set_bits(words, x.size)
                nz = (idx, x[idx])
            return words, peaks, mask, bad, nz
    return jit().summary(x, block, binades, run, split, cap)


def quantize_blocks(x: np.ndarray, shifts: np.ndarray, block: int, at: np.ndarray,
                    at_shifts: np.ndarray) -> tuple[np.ndarray, int]:
    if x.dtype == np.float32:
        shifts = np.ascontiguousarray(shifts, np.int64)
        at_shifts = np.ascontiguousarray(at_shifts, np.int64)
        lo = min(shifts.min(initial=0), at_shifts.min(initial=0))
        hi = max(shifts.max(initial=0), at_shifts.max(initial=0))
        if lo >= -1022 and hi <= 1023:  # (2**shift a normal float64, as numba's kernel asks)
            got = _native.quantize_f32(np.ascontiguousarray(x), shifts, block,
                                       np.ascontiguousarray(at, np.int64), at_shifts)
            if got is not None:
                return got
    return jit().quantize_blocks(x, shifts, block, at, at_shifts)


def scale_blocks(values: np.ndarray, scales: np.ndarray, block: int, dtype,
                 out: np.ndarray | None = None) -> np.ndarray:
    dt = np.dtype(dtype)
    if values.dtype == np.int32 and dt in (np.float32, np.float64):
        target = np.empty(values.size, dt) if out is None else out
        if _native.scale_i32(np.ascontiguousarray(values),
                             np.ascontiguousarray(scales, np.float64), block, target) \
                is not None:
            return target
    return jit().scale_blocks(values, scales, block, dtype, out)


def pack(mask: np.ndarray) -> np.ndarray:
    if mask.size <= SMALL:  # (a block-level mask: round 1's split flags)
        return _ref.pack(mask)
    return jit().pack(mask)


def set_bits(words: np.ndarray, n: int) -> np.ndarray:
    if n <= SMALL:  # (block-level bitmaps: the split blocks)
        return _ref.set_bits(words, n)
    return jit().set_bits(words, n)
