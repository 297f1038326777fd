"""Quantization: fp32 to int32 fixed point with a power-of-two scale shared by the job.

The switch adds int32 words, so every value goes through here first; ``shift_for`` picks the
scale that leaves room for the job's sums (``DEFAULT_HEADROOM``), so they cannot overflow.
"""

from __future__ import annotations

import math

import numpy as np

from homagg.host_agent.codec.errors import CodecError

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

#: Default headroom: how many worker-elements may share one counter before int32 can overflow.
DEFAULT_HEADROOM = 16


def max_exponent(x: np.ndarray) -> int | None:
    """Exponent e with max|x| < 2**e (``math.frexp`` convention), None for an all-zero tensor.

    NaN and Inf raise CodecError naming the first bad index: a sum containing them is meaningless.
    """
    x = np.asarray(x)
    if x.size == 0:
        return None
    hi, lo = x.max(), x.min()  # NaN propagates through max/min; no temporary array
    if not (np.isfinite(hi) and np.isfinite(lo)):
        bad = int(np.flatnonzero(~np.isfinite(x))[0])
        raise CodecError(f"tensor has a non-finite value ({x.flat[bad]}) at index {bad}")
    peak = max(float(hi), -float(lo))
    if peak == 0.0:
        return None
    return math.frexp(peak)[1]


def shift_for(max_exp: int | None, workers: int, headroom: int = DEFAULT_HEADROOM) -> int:
    """Binary scale shift s: q = rint(x * 2**s) leaves room for ``workers * headroom`` terms.

    |q| <= 2**(e+s) and workers * headroom * 2**(e+s) <= 2**30 < INT32_MAX, so no sum of at most
    ``headroom`` elements per worker in one int32 word can overflow.
    """
    if workers < 1:
        raise CodecError("workers must be >= 1")
    if max_exp is None:
        return 0
    budget = 30 - math.ceil(math.log2(workers)) - math.ceil(math.log2(max(headroom, 1)))
    return budget - max_exp


def quantize(x: np.ndarray, shift) -> np.ndarray:
    """fp32/fp64 -> int32 fixed point rint(x * 2**shift); NaN/Inf and out-of-range raise.

    ``shift``: an int, or an int array broadcast against x (per-element shifts, e.g. a
    ``Result.shift`` with block scales). A CodecError for a value names its ``index``."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise CodecError(f"quantize wants a floating-point tensor, got {x.dtype}")
    q = np.rint(np.ldexp(x.astype(np.float64, copy=False), shift))
    if not np.isfinite(q).all():
        bad = int(np.flatnonzero(~np.isfinite(q))[0])
        raise CodecError(f"tensor has a non-finite value ({x.flat[bad]}) at index {bad}",
                         index=bad)
    if q.size and (q.max() > INT32_MAX or q.min() < INT32_MIN):
        bad = int(np.flatnonzero((q > INT32_MAX) | (q < INT32_MIN))[0])
        at = int(np.broadcast_to(shift, q.shape).flat[bad])
        raise CodecError(f"value {x.flat[bad]} at index {bad} is out of int32 range at "
                         f"shift {at}: use shift_for()", index=bad)
    return q.astype(np.int32)


def dequantize(q: np.ndarray, shift, dtype=np.float32) -> np.ndarray:
    return np.ldexp(np.asarray(q, dtype=np.float64), -shift).astype(dtype)
