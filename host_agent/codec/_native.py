"""The codec's kernels that the native library (``homagg/native/codec.c``) runs faster than
numba, where it is built and not turned off (``homagg.native.load``). ``_jit`` calls them first
and runs its own kernels where they give None; the tests hold all three (C, numba, numpy) to
the same bits.

- ``summary_f32``: round 1's reading of a float32 tensor whose scale block is a whole number of
  bitmap words (the default, 256): one pass with AVX2 where numba's takes three (10M elements
  at 1%: about 4 ms against numba's 23, 2.6 ms on two threads).
- ``quantize_f32`` and ``scale_i32``: the dense words of a float32 tensor at its block shifts,
  and the int32 sums back at their block scales, four float64 lanes at a time where numba's
  loops convert and round one element at a time.

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
                 at_shifts: np.ndarray, baseline: bool = False
                 ) -> tuple[np.ndarray, int] | None:
    """``quantize_blocks`` of a contiguous float32 ``x`` (int64 ``shifts``, ``at`` and
    ``at_shifts``, every shift in -1022..1023: the caller checks); None where the library is
    not loaded."""
    lib = native.load()
    if lib is None or x.dtype != np.float32 or block <= 0:
        return None
    out = np.empty(x.size, np.int32)
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
