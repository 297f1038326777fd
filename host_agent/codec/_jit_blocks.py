"""The compiled kernels of block floating point (``blocks``): which blocks hold a run of
values far below their peak (``split_mask``), the integer values times their block's scale
(``scale_blocks``), and the two passes of a dense tensor: round 1's reading of it
(``summary``: bitmap, block peaks, split mask, non-finite check, in two reads of x, without a
position list for a dense tensor) and its words at the block scales (``quantize_blocks``, one
pass with no temporaries); a sparse tensor's words of mode union at the block scales
(``encode_union_blocks``: quantized and ranked in one pass over its non-zeros). A float32
tensor's ``summary``, ``quantize_blocks`` and ``scale_blocks`` run in the native library where
it is built (``_compiled`` calls it first: one pass, AVX2); these kernels where it is not.

Part of ``_jit`` (which ``kernels`` loads); numpy twins in ``_ref``.
"""

from __future__ import annotations

import math

import numpy as np

from homagg.host_agent.codec import _ref
from homagg.host_agent.codec._jit_bitmap import (
    _k_brev8,
    _k_popcount32,
    _k_rank,
    _k_set_bits,
    _k_union_size,
    _k_word_prefix,
    _njit,
)

# --------------------------------------------------------------------------------------------
# The interface (see _ref for what each returns)
# --------------------------------------------------------------------------------------------


def split_mask(idx: np.ndarray, raw: np.ndarray, nb: int, block: int, binades: int,
               run: int) -> np.ndarray:
    if raw.dtype not in (np.float32, np.float64):
        return _ref.split_mask(idx, raw, nb, block, binades, run)
    return _k_split_mask(np.ascontiguousarray(idx, np.int64), np.ascontiguousarray(raw), nb,
                         block, binades, run)


def block_peaks(idx: np.ndarray, raw: np.ndarray, nb: int, block: int) -> np.ndarray:
    if raw.dtype not in (np.float32, np.float64):
        return _ref.block_peaks(idx, raw, nb, block)
    return _k_block_peaks(np.ascontiguousarray(idx, np.int64), np.ascontiguousarray(raw), nb,
                          block)


def scale_blocks(values: np.ndarray, scales: np.ndarray, block: int, dtype,
                 out: np.ndarray | None = None) -> np.ndarray:
    if np.dtype(dtype) in (np.float32, np.float64):
        out = np.empty(values.size, dtype) if out is None else out
        _k_scale_blocks(out, values, scales, block)
        return out
    return _ref.scale_blocks(values, scales, block, dtype, out)


def summary(x: np.ndarray, block: int, binades: int, run: int, split: bool, cap: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int,
                       tuple[np.ndarray, np.ndarray] | None]:
    if x.dtype not in (np.float32, np.float64):
        return _ref.summary(x, block, binades, run, split, cap)
    x = np.ascontiguousarray(x)
    if x.dtype == np.float32:
        xi, bits, mant = x.view(np.uint32), 32, 23
    else:
        xi, bits, mant = x.view(np.uint64), 64, 52
    u = xi.dtype.type
    mag = u((1 << (bits - 1)) - 1)
    expo = u(mag - ((1 << mant) - 1))  # the exponent's bits: all set for NaN and Inf
    words, bad, nnz = _k_summary_scan(xi, mag, expo)
    nb = -(-x.size // block)
    peaks, mask = np.zeros(nb, np.float64), np.zeros(nb, np.bool_)
    if bad < 0:
        bias = (1 << (bits - mant - 2)) - 1  # 127 or 1023
        _k_block_summary(x, xi, mag, block, binades, run, split, mant, bias, peaks, mask)
    nz = None
    if nnz <= cap:  # a sparse tensor: its non-zeros listed from the bitmap
        idx = _k_set_bits(words, x.size)
        nz = (idx, x[idx])
    return words, peaks, mask, bad, nz


def quantize_blocks(x: np.ndarray, shifts: np.ndarray, block: int, at: np.ndarray,
                    at_shifts: np.ndarray, out: np.ndarray | None = None
                    ) -> tuple[np.ndarray, int]:
    shifts = np.ascontiguousarray(shifts, np.int64)
    at_shifts = np.ascontiguousarray(at_shifts, np.int64)
    lo = min(shifts.min(initial=0), at_shifts.min(initial=0))
    hi = max(shifts.max(initial=0), at_shifts.max(initial=0))
    if x.dtype not in (np.float32, np.float64) or lo < -1022 or hi > 1023:
        # (2**shift a normal float64: then x * 2**shift is ldexp's, rounded the same way)
        return _ref.quantize_blocks(x, shifts, block, at, at_shifts, out)
    out = np.empty(x.size, np.int32) if out is None else out
    bad = _k_quantize_blocks(np.ascontiguousarray(x), shifts, block,
                             np.ascontiguousarray(at, np.int64), at_shifts, out)
    return out, int(bad)


def encode_union_blocks(words: np.ndarray, n: int, idx: np.ndarray, raw: np.ndarray,
                        shifts: np.ndarray, block: int, at: np.ndarray, at_shifts: np.ndarray
                        ) -> np.ndarray | None:
    shifts = np.ascontiguousarray(shifts, np.int64)
    at_shifts = np.ascontiguousarray(at_shifts, np.int64)
    lo = min(shifts.min(initial=0), at_shifts.min(initial=0))
    hi = max(shifts.max(initial=0), at_shifts.max(initial=0))
    if raw.dtype not in (np.float32, np.float64) or lo < -1022 or hi > 1023:
        return _ref.encode_union_blocks(words, n, idx, raw, shifts, block, at, at_shifts)
    out = np.zeros(_k_union_size(words, n), np.int32)
    ok = _k_encode_union_blocks(words, n, np.ascontiguousarray(idx, np.int64),
                                np.ascontiguousarray(raw), shifts, block,
                                np.ascontiguousarray(at, np.int64), at_shifts, out)
    return out if ok else None


# --------------------------------------------------------------------------------------------
# The compiled kernels
# --------------------------------------------------------------------------------------------


@_njit
def _k_block_peaks(idx, raw, nb, block):
    peaks = np.zeros(nb, np.float64)
    for k in range(idx.size):  # no temporaries: a 100M-element layer's scan is enough
        b = idx[k] // block
        peaks[b] = max(peaks[b], abs(np.float64(raw[k])))
    return peaks


@_njit
def _k_split_mask(idx, raw, nb, block, binades, run):
    flags = np.zeros(nb, np.bool_)
    n, s = idx.size, 0
    while s < n:  # one block's non-zeros at a time: its peak, then its runs of small values
        b = idx[s] // block
        e, peak = s, 0.0
        while e < n and idx[e] // block == b:
            peak = max(peak, abs(np.float64(raw[e])))
            e += 1
        limit = math.ldexp(1.0, math.frexp(peak)[1] - 1 - binades)
        count = 0
        for k in range(s, e):
            if abs(np.float64(raw[k])) >= limit:
                count = 0
            elif count and idx[k] == idx[k - 1] + 1:
                count += 1
            else:
                count = 1
            if count >= run:
                flags[b] = True
                break
        s = e
    return flags


@_njit
def _k_scale_blocks(out, values, scales, block):
    n = values.size
    for b in range(-(-n // block)):  # a block at a time: no division per element
        s = scales[b]
        for i in range(b * block, min(n, (b + 1) * block)):
            out[i] = np.float64(values[i]) * s


@_njit
def _k_summary_scan(xi, mag, expo):
    """The bitmap, the first non-finite position (-1: none) and the count of non-zeros: a
    word of 32 values at a time, its bits built without a branch."""
    n = xi.size
    nw = (n + 31) // 32
    words = np.empty(nw, np.uint32)
    bad, nnz = -1, 0
    for wi in range(nw):
        base = wi * 32
        count = min(32, n - base)
        t = np.int64(0)
        odd = False
        for j in range(count):
            v = xi[base + j]
            t |= np.int64((v & mag) != 0) << j
            odd |= (v & expo) == expo
        words[wi] = _k_brev8(t)
        nnz += _k_popcount32(t)
        if odd and bad < 0:
            for j in range(count):
                if (xi[base + j] & expo) == expo:
                    bad = base + j
                    break
    return words, bad, nnz


@_njit
def _k_block_summary(x, xi, mag, block, binades, run, split, mant, bias, peaks, mask):
    """Each block's peak (the largest magnitude, float64) and, with ``split``, whether it
    holds ``run`` consecutive non-zeros each under 2**(e_peak - 1 - binades). All finite: a
    magnitude's bits order as its value, so the peak is an integer maximum, and "small" an
    integer compare with the limit's bits (0 where the limit is below the dtype's least
    subnormal: nothing non-zero is under it)."""
    n = x.size
    for b in range(peaks.size):
        lo, hi = b * block, min(n, (b + 1) * block)
        top = xi[lo] & mag
        for i in range(lo + 1, hi):
            top = max(top, xi[i] & mag)
        if top == 0:
            continue
        peak = abs(np.float64(x[lo]))
        for i in range(lo, hi):
            if (xi[i] & mag) == top:
                peak = abs(np.float64(x[i]))
                break
        peaks[b] = peak
        if not split:
            continue
        m = math.frexp(peak)[1] - 1 - binades  # the limit is 2**m
        if m >= 1 - bias:
            limit = np.int64(m + bias) << mant
        elif m >= 1 - bias - mant:
            limit = np.int64(1) << (m + bias + mant - 1)
        else:
            limit = np.int64(0)
        small = 0  # first how many: most blocks have fewer than a run's (a vector loop)
        for i in range(lo, hi):
            a = np.int64(xi[i] & mag)
            small += (a != 0) & (a < limit)
        if small < run:
            continue
        count = 0
        for i in range(lo, hi):
            a = np.int64(xi[i] & mag)
            count = (count + 1) if (a != 0 and a < limit) else 0
            if count >= run:
                mask[b] = True
                break


@_njit
def _k_quantize_blocks(x, shifts, block, at, at_shifts, out):
    """``quantize_blocks``: returns the first bad position, or -1."""
    n, na = x.size, at.size
    j = 0
    for b in range(shifts.size):
        lo, hi = b * block, min(n, (b + 1) * block)
        s = math.ldexp(1.0, shifts[b])
        while j < na and at[j] < lo:
            j += 1
        if j < na and at[j] < hi:  # a split block: some elements at their own scale
            for i in range(lo, hi):
                if j < na and at[j] == i:
                    q = np.rint(np.float64(x[i]) * math.ldexp(1.0, at_shifts[j]))
                    j += 1
                else:
                    q = np.rint(np.float64(x[i]) * s)
                if not (q >= -2147483648.0 and q <= 2147483647.0):
                    return i
                out[i] = np.int32(q)
            continue
        ok = True
        for i in range(lo, hi):
            q = np.rint(np.float64(x[i]) * s)
            fits = (q >= -2147483648.0) & (q <= 2147483647.0)  # (False for NaN)
            ok &= fits
            out[i] = np.int32(q if fits else 0.0)
        if not ok:
            for i in range(lo, hi):
                q = np.rint(np.float64(x[i]) * s)
                if not (q >= -2147483648.0 and q <= 2147483647.0):
                    return i
    return -1


@_njit
def _k_encode_union_blocks(words, n, idx, raw, shifts, block, at, at_shifts, out):
    """``encode_union_blocks`` into ``out`` (zeros, the union's size): False where a value
    does not quantize or a position is outside the union. A position's rank is the popcount
    of the union before it: a per-word prefix, then O(1) per non-zero, as ``_k_encode_union``
    (the quantization is ``_k_quantize_blocks``')."""
    pre = _k_word_prefix(words)
    scale = np.empty(shifts.size, np.float64)
    for b in range(shifts.size):
        scale[b] = math.ldexp(1.0, shifts[b])
    na = at.size
    j = 0
    for k in range(idx.size):
        p = idx[k]
        r = _k_rank(words, pre, n, p)
        if r < 0:
            return False
        q = np.rint(np.float64(raw[k]) * scale[p // block])
        if na:  # split blocks: their elements at their own scale
            while j < na and at[j] < p:
                j += 1
            if j < na and at[j] == p:
                q = np.rint(np.float64(raw[k]) * math.ldexp(1.0, at_shifts[j]))
        if not (q >= -2147483648.0 and q <= 2147483647.0):  # (False for NaN)
            return False
        out[r] = np.int32(q)
    return True
