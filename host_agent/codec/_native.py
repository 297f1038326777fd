"""The codec's kernels that the native library (``homagg/native/codec.c``, ``union.c``,
``sketch.c``) runs, where it is built and not turned off (``homagg.native.load``).
``_compiled`` calls them first and runs numba's (``_jit``) where they give None; the tests hold
all three (C, numba, numpy) to the same bits.

- ``summary_f32``: round 1's reading of a float32 tensor whose scale block is a whole number of
  bitmap words (the default, 256): one pass with AVX2 where numba's takes three (10M elements
  at 1%: about 4 ms against numba's 23, 2.6 ms on two threads).
- ``quantize_f32`` and ``scale_i32``: the dense words of a float32 tensor at its block shifts,
  and the int32 sums back at their block scales, four float64 lanes at a time where numba's
  loops convert and round one element at a time.

- the union's and the sketch's kernels (``union.c``, ``sketch.c``), each with ``_jit``'s
  arguments (``union_size`` to ``peel``): with them a float32 tensor's codec never calls numba,
  in any mode. Their loops are built for x86-64's baseline and for x86-64-v3, the CPU's pick.

It splits a tensor of ``THREADS_FROM`` elements or more between threads, as many as the
process may run on (at most ``MAX_THREADS``): the pass is memory-bound, and a second core
reads the other half of the tensor while the first reads its own. ``threads_for`` is also the
rule of the union's decode (``_jit_bitmap``), whose numba kernel runs a share of the bitmap
on each of that many Python threads (it releases the GIL). The pass also lists a sparse
tensor's non-zeros, positions and values, while each word of 32 values is in registers (two
slots written whatever the word holds, a loop only for a third non-zero): a listing from the
bitmap afterwards (numba's ``set_bits``, numpy's gather) read each value again, a cache miss
each, 1.5 ms for 100k values of a 10M tensor.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

import numpy as np

from homagg import native

#: The tensor size (elements) from which the passes run on several threads: below it, starting
#: a thread costs more than the pass's share (2M float32 values: about 1 ms a pass).
THREADS_FROM = 1 << 21
#: The most threads a pass takes.
MAX_THREADS = 4


def threads_for(n: int) -> int:
    """How many threads a pass over n elements takes."""
    if n < THREADS_FROM:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def summary_f32(x: np.ndarray, block: int, binades: int, run: int, split: bool,
                baseline: bool = False, cap: int = -1
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int,
                           tuple[np.ndarray, np.ndarray] | None] | None:
    """(bitmap words, per-block peaks, split mask, first non-finite position or -1, count of
    non-zeros, and the non-zeros (positions, values) or None) of a contiguous float32 ``x``, as
    ``_jit_blocks``' kernels give them; None where the library is not loaded or ``block`` is
    not a multiple of 32. ``cap`` > 0: list the non-zeros in the same pass if there are at most
    that many (None where the pass gave up: too many, or a share of the tensor too dense; the
    caller lists them from the bitmap). ``baseline``: the loop for x86-64's baseline even where
    the CPU has AVX2 (the tests check both)."""
    lib = native.load()
    if lib is None or block <= 0 or block % 32 or x.dtype != np.float32:
        return None
    n = x.size
    nb = -(-n // block)
    words = np.empty((n + 31) // 32, np.uint32)
    peaks = np.empty(nb, np.float64)
    mask = np.empty(nb, np.bool_)
    nnz, listed = ctypes.c_int64(0), ctypes.c_int64(-1)
    room = min(cap, n)
    idx = np.empty(max(room, 0), np.int64)  # (pages touched only where written)
    raw = np.empty(max(room, 0), np.float32)
    bad = lib.hc_summary_f32(x.ctypes.data, n, block, binades, run, int(split),
                             words.ctypes.data, peaks.ctypes.data, mask.ctypes.data,
                             ctypes.byref(nnz), int(baseline), threads_for(n),
                             idx.ctypes.data if room > 0 else None, raw.ctypes.data, room,
                             ctypes.byref(listed))
    k = listed.value
    nz = (idx[:k], raw[:k]) if 0 <= k <= cap and k == nnz.value else None
    return words, peaks, mask, int(bad), int(nnz.value), nz


def quantize_f32(x: np.ndarray, shifts: np.ndarray, block: int, at: np.ndarray,
                 at_shifts: np.ndarray, baseline: bool = False, out: np.ndarray | None = None
                 ) -> tuple[np.ndarray, int] | None:
    """``quantize_blocks`` of a contiguous float32 ``x`` (int64 ``shifts``, ``at`` and
    ``at_shifts``, every shift in -1022..1023: the caller checks), into ``out`` where given;
    None where the library is not loaded."""
    lib = native.load()
    if lib is None or x.dtype != np.float32 or block <= 0:
        return None
    out = np.empty(x.size, np.int32) if out is None else out
    assert out.dtype == np.int32 and out.size == x.size and out.flags.c_contiguous
    bad = lib.hc_quantize_f32(x.ctypes.data, x.size, shifts.ctypes.data, block,
                              at.ctypes.data, at_shifts.ctypes.data, at.size, out.ctypes.data,
                              int(baseline))
    return out, int(bad)


def scale_i32(values: np.ndarray, scales: np.ndarray, block: int, out: np.ndarray,
              baseline: bool = False) -> np.ndarray | None:
    """``scale_blocks`` of contiguous int32 ``values`` (float64 ``scales``) into ``out``
    (float32 or float64, contiguous); None where the library is not loaded."""
    lib = native.load()
    if (lib is None or values.dtype != np.int32 or block <= 0
            or out.dtype not in (np.float32, np.float64) or not out.flags.c_contiguous):
        return None
    lib.hc_scale_i32(values.ctypes.data, values.size, scales.ctypes.data, block,
                     out.ctypes.data, int(out.dtype == np.float64), int(baseline))
    return out


# -- the union's and the sketch's kernels (union.c, sketch.c): the same arguments as ``_jit``'s,
# each giving None where the library is not loaded or an input is not one its loop takes ------

#: Peeling packs a counter's element count (8 bits) and rank xor (23 bits) in an int32 below
#: this union size, in an int64 (16 + 47 bits) from it on (C's kernel and numba's).
PEEL_INT32_STATE_BELOW = 2**23
_INTS = (np.int32, np.int64)
_FLOATS = (np.float32, np.float64)


def _lib():
    return native.load()


def union_size(words: np.ndarray, n: int) -> int | None:
    lib = _lib()
    return None if lib is None else int(lib.hc_union_size(words.ctypes.data, n))


def set_bits(words: np.ndarray, n: int) -> np.ndarray | None:
    lib = _lib()
    if lib is None:
        return None
    out = np.empty(lib.hc_union_size(words.ctypes.data, n), np.int64)
    lib.hc_set_bits(words.ctypes.data, n, out.ctypes.data)
    return out


def scan_f32(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``scan`` of a float32 tensor: its bitmap, then its non-zeros' positions and values."""
    lib = _lib()
    if lib is None or x.dtype != np.float32:
        return None
    x = np.ascontiguousarray(x)
    words = np.empty((x.size + 31) // 32, np.uint32)
    idx = np.empty(lib.hc_pack_nonzero_f32(x.ctypes.data, x.size, words.ctypes.data), np.int64)
    lib.hc_set_bits(words.ctypes.data, x.size, idx.ctypes.data)
    return words, idx, x[idx]


def gather_union(words: np.ndarray, n: int, q: np.ndarray) -> np.ndarray | None:
    lib = _lib()
    if lib is None:
        return None
    q = np.ascontiguousarray(q, np.int32)
    out = np.empty(lib.hc_union_size(words.ctypes.data, n), np.int32)
    lib.hc_gather_union(words.ctypes.data, n, q.ctypes.data, out.ctypes.data)
    return out


def subblocks(mid: np.ndarray, blocks: np.ndarray) -> np.ndarray | None:
    lib = _lib()
    if lib is None:
        return None
    mid = np.ascontiguousarray(mid)
    blocks = np.ascontiguousarray(blocks, np.int64)
    # (its sub-block bits are the mid level's first 16 per block, as a bitmap's positions)
    out = np.empty(lib.hc_union_size(mid.ctypes.data, 16 * blocks.size), np.int64)
    lib.hc_subblocks(mid.ctypes.data, blocks.ctypes.data, blocks.size, out.ctypes.data)
    return out


def level_counts(words: np.ndarray, n: int) -> tuple[int, int] | None:
    lib = _lib()
    if lib is None:
        return None
    c1, c2 = ctypes.c_int64(0), ctypes.c_int64(0)
    lib.hc_level_counts(words.ctypes.data, -(-n // 8), ctypes.byref(c1), ctypes.byref(c2))
    return c1.value, c2.value


def encode_union_f32(words: np.ndarray, n: int, idx: np.ndarray, raw: np.ndarray,
                     shifts: np.ndarray, block: int, at: np.ndarray, at_shifts: np.ndarray
                     ) -> tuple[np.ndarray | None] | None:
    """``encode_union_blocks`` of float32 ``raw`` (int64 shifts, every one in -1022..1023: the
    caller checks), in a 1-tuple: the values, or None where one does not quantize or leaves
    the union; None where the library does not take it."""
    lib = _lib()
    if lib is None or raw.dtype != np.float32 or block <= 0:
        return None
    idx = np.ascontiguousarray(idx, np.int64)
    raw = np.ascontiguousarray(raw)
    at = np.ascontiguousarray(at, np.int64)
    out = np.zeros(lib.hc_union_size(words.ctypes.data, n), np.int32)
    pre = np.empty((n + 31) // 32, np.int64)
    ok = lib.hc_encode_union_f32(words.ctypes.data, n, idx.ctypes.data, raw.ctypes.data,
                                 idx.size, shifts.ctypes.data, block, at.ctypes.data,
                                 at_shifts.ctypes.data, at.size, out.ctypes.data,
                                 pre.ctypes.data)
    return (out if ok else None,)


def decoder(values: np.ndarray, dt: np.dtype):
    """The C decode of the union (``_jit_bitmap._k_decode_union``'s arguments: out, words,
    values, scales, stride), or None where the library is not loaded or takes not these
    dtypes."""
    lib = _lib()
    if lib is None or values.dtype not in _INTS or dt not in _FLOATS:
        return None
    f = getattr(lib, f"hc_decode_union_i{8 * values.itemsize}_f{8 * dt.itemsize}")

    def decode(out: np.ndarray, words: np.ndarray, values: np.ndarray, scales: np.ndarray,
               stride: int) -> int:
        return int(f(out.ctypes.data, out.size, words.ctypes.data, values.ctypes.data,
                     values.size, scales.ctypes.data, stride))

    return decode


def assemble(n: int, union: np.ndarray, values: np.ndarray, scale: float, dt: np.dtype
             ) -> np.ndarray | None:
    lib = _lib()
    if lib is None or values.dtype not in _INTS or dt not in _FLOATS:
        return None
    union = np.ascontiguousarray(union, np.int64)
    values = np.ascontiguousarray(values)
    out = np.zeros(n, dt)
    lib.hc_assemble(out.ctypes.data, int(dt == np.float64), union.ctypes.data,
                    values.ctypes.data, int(values.dtype == np.int64), union.size, scale)
    return out


def scale_wide(values: np.ndarray, scales: np.ndarray, block: int, out: np.ndarray
               ) -> np.ndarray | None:
    """``scale_blocks`` of contiguous int64 or float64 ``values`` into ``out`` (float32 or
    float64, contiguous); None where the library does not take them."""
    lib = _lib()
    if (lib is None or values.dtype not in (np.int64, np.float64) or block <= 0
            or out.dtype not in _FLOATS or not out.flags.c_contiguous):
        return None
    scales = np.ascontiguousarray(scales, np.float64)
    lib.hc_scale_wide(values.ctypes.data, 1 if values.dtype == np.int64 else 2, values.size,
                      scales.ctypes.data, block, out.ctypes.data, int(out.dtype == np.float64))
    return out


def hashes(idx: np.ndarray, part: int, s1: np.uint64, s2: np.uint64
           ) -> tuple[np.ndarray, np.ndarray] | None:
    lib = _lib()
    if lib is None:
        return None
    idx = np.ascontiguousarray(idx, np.int64)
    pos = np.empty((3, idx.size), np.int64)
    sgn = np.empty((3, idx.size), np.int8)
    lib.hc_hashes(idx.ctypes.data, idx.size, part, int(s1), int(s2), pos.ctypes.data,
                  sgn.ctypes.data)
    return pos, sgn


def sketch_encode(idx: np.ndarray, val: np.ndarray, m: int, s1: np.uint64, s2: np.uint64
                  ) -> np.ndarray | None:
    lib = _lib()
    if lib is None or val.dtype not in _INTS or m < 3:
        return None
    idx = np.ascontiguousarray(idx, np.int64)
    val = np.ascontiguousarray(val)
    c = np.zeros(m, np.int64)
    lib.hc_sketch_encode(idx.ctypes.data, val.ctypes.data, int(val.dtype == np.int64),
                         idx.size, m, int(s1), int(s2), c.ctypes.data)
    return c


def peel(counters: np.ndarray, union: np.ndarray, s1: np.uint64, s2: np.uint64, small: bool
         ) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(values, resolved, rounds), the state packed in int32 where ``small``; None where the
    library is not loaded or a counter holds too many elements for the state."""
    lib = _lib()
    m = counters.size
    if lib is None or m < 3:
        return None
    union = np.ascontiguousarray(union, np.int64)
    values = np.zeros(union.size, np.int64)
    resolved = np.zeros(union.size, np.bool_)
    res = counters.astype(np.int64)  # (a copy: peeled in place)
    scratch = np.empty(4 * m, np.int64)
    rounds = lib.hc_peel(union.ctypes.data, union.size, int(s1), int(s2), values.ctypes.data,
                         resolved.ctypes.data, res.ctypes.data, m, scratch.ctypes.data,
                         int(small))
    if rounds == -2:
        raise MemoryError("homagg: the sketch's peeling could not allocate its state")
    return (values, resolved, int(rounds)) if rounds >= 0 else None


def decode_scaled(words: np.ndarray, n: int, values: np.ndarray, scales: np.ndarray,
                  dt: np.dtype, out: np.ndarray | None, size: Callable[[np.ndarray, int], int],
                  decode: Callable[..., int]) -> np.ndarray | None:
    """``decode_union_scaled`` with the given kernels (``decode_on_threads`` says which), on
    ``threads_for(n)`` threads; None where the union and the values disagree (a given ``out``
    is then untouched)."""
    values = np.ascontiguousarray(values)
    scales = np.ascontiguousarray(scales, np.float64)
    parts = threads_for(n)
    if parts > 1:
        return decode_on_threads(words, n, values, scales, dt, out, parts, size, decode)
    if out is None:
        out = np.empty(n, dt)
    elif size(words, n) != values.size:
        return None  # (a given out is written only once the sizes agree)
    return out if decode(out, words, values, scales, 1) == values.size else None


def decode_on_threads(words: np.ndarray, n: int, values: np.ndarray, scales: np.ndarray,
                      dt: np.dtype, out: np.ndarray | None, parts: int,
                      size: Callable[[np.ndarray, int], int],
                      decode: Callable[..., int]) -> np.ndarray | None:
    """``decode_union_scaled`` split between ``parts`` threads, a share of the bitmap's words
    each (C's and numba's kernels release the GIL): each share's values start at the union's
    count of the words before it. ``size(words, n)`` and ``decode(out, words, values, scales,
    stride)`` are the union size and decode kernels (C's, or numba's ``_k_union_size`` and
    ``_k_decode_union``). The counts are taken first, so nothing is written unless they
    agree."""
    nw = (n + 31) // 32
    bounds = [nw * i // parts for i in range(parts + 1)]
    ends = [min(n, 32 * b) for b in bounds]
    counts = [int(size(words[b0:b1], ends[i + 1] - ends[i]))
              for i, (b0, b1) in enumerate(zip(bounds, bounds[1:]))]
    if sum(counts) != values.size:
        return None
    out = np.empty(n, dt) if out is None else out
    firsts = np.concatenate(([0], np.cumsum(counts)))
    got = [0] * parts

    def share(i: int) -> None:
        got[i] = decode(out[ends[i]:ends[i + 1]], words[bounds[i]:bounds[i + 1]],
                        values[firsts[i]:firsts[i + 1]], scales[bounds[i]:bounds[i + 1]], 1)

    threads = [threading.Thread(target=share, args=(i,)) for i in range(1, parts)]
    for t in threads:
        t.start()
    share(0)
    for t in threads:
        t.join()
    return out if got == counts else None
