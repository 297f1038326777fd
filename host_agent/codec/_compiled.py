"""The codec's compiled kernels as ``kernels`` hands them out: the C library's
(``_native``) where it has the function and it applies, numba's (``_jit``) otherwise, and numba
imported only when a kernel of its is first called.

A float32 tensor's all-reduce runs on the C library alone, in every mode: round 1's reading,
its words, the sums' scaling (``codec.c``), the union's and the hierarchical index's loops
(``union.c``) and the sketch's (``sketch.c``). So an agent whose tensors are float32 never
imports numba (its import and its kernels' machine code cost a worker about 100 MB of peak
memory). Every other name, and every other dtype, is ``_jit``'s, looked up at its first use (a
module ``__getattr__``); the results are the same bits either way (the tests hold C, numba and
numpy to them).
"""

from __future__ import annotations

import importlib
import math
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
                idx = set_bits(words, x.size)
                nz = (idx, x[idx])
            return words, peaks, mask, bad, nz
    return jit().summary(x, block, binades, run, split, cap)


def _normal_shifts(*shifts: np.ndarray) -> bool:
    """Whether every shift makes 2**shift a normal float64 (the compiled loops' rule)."""
    lo = min(s.min(initial=0) for s in shifts)
    hi = max(s.max(initial=0) for s in shifts)
    return lo >= -1022 and hi <= 1023


def quantize_blocks(x: np.ndarray, shifts: np.ndarray, block: int, at: np.ndarray,
                    at_shifts: np.ndarray, out: np.ndarray | None = None
                    ) -> tuple[np.ndarray, int]:
    if x.dtype == np.float32:
        shifts = np.ascontiguousarray(shifts, np.int64)
        at_shifts = np.ascontiguousarray(at_shifts, np.int64)
        if _normal_shifts(shifts, at_shifts):
            got = _native.quantize_f32(np.ascontiguousarray(x), shifts, block,
                                       np.ascontiguousarray(at, np.int64), at_shifts, out=out)
            if got is not None:
                return got
    return jit().quantize_blocks(x, shifts, block, at, at_shifts, out)


def scale_blocks(values: np.ndarray, scales: np.ndarray, block: int, dtype,
                 out: np.ndarray | None = None) -> np.ndarray:
    dt = np.dtype(dtype)
    if values.dtype in (np.int32, np.int64, np.float64) and dt in (np.float32, np.float64):
        target = np.empty(values.size, dt) if out is None else out
        v = np.ascontiguousarray(values)
        s = np.ascontiguousarray(scales, np.float64)
        scale = _native.scale_i32 if v.dtype == np.int32 else _native.scale_wide
        if scale(v, s, block, target) is not None:
            return target
    return jit().scale_blocks(values, scales, block, dtype, out)


def pack(mask: np.ndarray) -> np.ndarray:
    if mask.size <= SMALL:  # (a block-level mask: round 1's split flags)
        return _ref.pack(mask)
    return jit().pack(mask)


def set_bits(words: np.ndarray, n: int) -> np.ndarray:
    if n <= SMALL:  # (block-level bitmaps: the split blocks)
        return _ref.set_bits(words, n)
    got = _native.set_bits(words, n)
    return got if got is not None else jit().set_bits(words, n)


# -- the union and the sketch: C's loops where the library is loaded ----------------------------

def scan(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    got = _native.scan_f32(x)
    return got if got is not None else jit().scan(x)


def union_size(words: np.ndarray, n: int) -> int:
    got = _native.union_size(words, n)
    return got if got is not None else jit().union_size(words, n)


def gather_union(words: np.ndarray, n: int, q: np.ndarray) -> np.ndarray:
    got = _native.gather_union(words, n, q)
    return got if got is not None else jit().gather_union(words, n, q)


def subblocks(mid: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    got = _native.subblocks(mid, blocks)
    return got if got is not None else jit().subblocks(mid, blocks)


def level_counts(words: np.ndarray, n: int) -> tuple[int, int]:
    got = _native.level_counts(words, n)
    return got if got is not None else jit().level_counts(words, n)


def encode_union_blocks(words: np.ndarray, n: int, idx: np.ndarray, raw: np.ndarray,
                        shifts: np.ndarray, block: int, at: np.ndarray, at_shifts: np.ndarray
                        ) -> np.ndarray | None:
    if raw.dtype == np.float32:
        shifts = np.ascontiguousarray(shifts, np.int64)
        at_shifts = np.ascontiguousarray(at_shifts, np.int64)
        if _normal_shifts(shifts, at_shifts):
            got = _native.encode_union_f32(words, n, idx, raw, shifts, block, at, at_shifts)
            if got is not None:
                return got[0]
    return jit().encode_union_blocks(words, n, idx, raw, shifts, block, at, at_shifts)


def decode_union(words: np.ndarray, n: int, values: np.ndarray, shift: int, dtype
                 ) -> np.ndarray | None:
    dt = np.dtype(dtype)
    decode = _native.decoder(values, dt) if abs(shift) <= 1000 else None
    if decode is None:
        return jit().decode_union(words, n, values, shift, dtype)
    out = np.empty(n, dt)
    if decode(out, words, np.ascontiguousarray(values), np.array([math.ldexp(1.0, -shift)]),
              0) != values.size:
        return None
    return out


def decode_union_scaled(words: np.ndarray, n: int, values: np.ndarray,
                        word_scales: np.ndarray, dtype, out: np.ndarray | None = None
                        ) -> np.ndarray | None:
    dt = np.dtype(dtype)
    decode = _native.decoder(values, dt)
    if decode is None:
        return jit().decode_union_scaled(words, n, values, word_scales, dtype, out)
    return _native.decode_scaled(words, n, values, word_scales, dt, out, union_size, decode)


def assemble(n: int, union: np.ndarray, values: np.ndarray, shift: int, dtype) -> np.ndarray:
    got = None
    if abs(shift) <= 1000:  # (2**-shift a normal float64: the product is ldexp's)
        got = _native.assemble(n, union, values, math.ldexp(1.0, -shift), np.dtype(dtype))
    return got if got is not None else jit().assemble(n, union, values, shift, dtype)


def hashes(idx: np.ndarray, part: int, s1: np.uint64, s2: np.uint64
           ) -> tuple[np.ndarray, np.ndarray]:
    got = _native.hashes(idx, part, s1, s2)
    return got if got is not None else jit().hashes(idx, part, s1, s2)


def sketch_encode(idx: np.ndarray, val: np.ndarray, m: int, s1: np.uint64, s2: np.uint64
                  ) -> np.ndarray:
    got = _native.sketch_encode(idx, val, m, s1, s2)
    return got if got is not None else jit().sketch_encode(idx, val, m, s1, s2)


def peel(counters: np.ndarray, union: np.ndarray, s1: np.uint64, s2: np.uint64
         ) -> tuple[np.ndarray, np.ndarray, int]:
    # a counter with too many elements for the int32 state: the int64 state's (the same bits)
    small = union.size < _native.PEEL_INT32_STATE_BELOW
    for state32 in ((True, False) if small else (False,)):
        got = _native.peel(counters, union, s1, s2, state32)
        if got is not None:
            return got
    return jit().peel(counters, union, s1, s2)
