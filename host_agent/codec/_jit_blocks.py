"""The compiled kernels of block floating point (``blocks``): which blocks hold a run of
values far below their peak (``split_mask``), and the integer values times their block's scale
(``scale_blocks``).

Part of ``_jit`` (which ``kernels`` loads); numpy twins in ``_ref``.
"""

from __future__ import annotations

import math

import numpy as np

from homagg.host_agent.codec import _ref
from homagg.host_agent.codec._jit_bitmap import _njit

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


def scale_blocks(values: np.ndarray, scales: np.ndarray, block: int, dtype) -> np.ndarray:
    out = np.empty(values.size, dtype)
    if np.dtype(dtype) in (np.float32, np.float64):
        _k_scale_blocks(out, values, scales, block)
        return out
    return _ref.scale_blocks(values, scales, block, dtype)


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
    for i in range(values.size):
        out[i] = np.float64(values[i]) * scales[i // block]
