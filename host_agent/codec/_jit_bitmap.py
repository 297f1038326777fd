"""The compiled kernels of the bitmap and the union: scanning a tensor into its bitmap,
positions and values, the set bits and ranks, a value's place in the union, decoding the sums
from the union bitmap, and the hierarchical index's sub-blocks (``index``).

Part of ``_jit`` (which ``kernels`` loads, and which holds the rules every compiled kernel
follows); this module also owns what the other kernel modules share: ``_njit``, the one numba
setting every kernel is compiled with.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from homagg.host_agent.codec import _native, _ref
from homagg.host_agent.codec._ref import pack

# --------------------------------------------------------------------------------------------
# The interface (see _ref for what each returns)
# --------------------------------------------------------------------------------------------


def scan(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if x.dtype not in (np.float32, np.float64):
        words = pack(x != 0)
        idx = set_bits(words, x.size)
        return words, idx, x[idx]
    # One pass: bitmap, positions and values together (x is read once).
    x = np.ascontiguousarray(x)
    u = np.uint32 if x.dtype == np.float32 else np.uint64
    mag = u(np.iinfo(u).max >> 1)
    return _k_scan(x, x.view(u), mag)


def set_bits(words: np.ndarray, n: int) -> np.ndarray:
    return _k_set_bits(words, n)


def ranks(union: np.ndarray, idx: np.ndarray) -> np.ndarray | None:
    r, bad = _k_ranks(np.ascontiguousarray(union, np.int64), np.ascontiguousarray(idx, np.int64))
    return None if bad >= 0 else r


def union_size(words: np.ndarray, n: int) -> int:
    return int(_k_union_size(words, n))


def encode_union(words: np.ndarray, n: int, idx: np.ndarray, val: np.ndarray
                 ) -> np.ndarray | None:
    v, bad = _k_encode_union(words, n, np.ascontiguousarray(idx, np.int64),
                             np.ascontiguousarray(val, np.int32))
    return None if bad >= 0 else v


def gather_union(words: np.ndarray, n: int, q: np.ndarray) -> np.ndarray:
    out = np.empty(_k_union_size(words, n), np.int32)
    _k_gather_union(words, n, np.ascontiguousarray(q, np.int32), out)
    return out


def decode_union(words: np.ndarray, n: int, values: np.ndarray, shift: int, dtype
                 ) -> np.ndarray | None:
    dt = np.dtype(dtype)
    if (abs(shift) <= 1000 and dt in (np.float32, np.float64)
            and values.dtype in (np.int32, np.int64)):
        out = np.empty(n, dt)
        if _k_decode_union(out, words, np.ascontiguousarray(values),
                           np.array([math.ldexp(1.0, -shift)]), 0) != values.size:
            return None
        return out
    union = set_bits(words, n)
    if union.size != values.size:
        return None
    return assemble(n, union, values, shift, dtype)


def decode_union_scaled(words: np.ndarray, n: int, values: np.ndarray,
                        word_scales: np.ndarray, dtype, out: np.ndarray | None = None
                        ) -> np.ndarray | None:
    dt = np.dtype(dtype)
    if dt in (np.float32, np.float64) and values.dtype in (np.int32, np.int64):
        return _native.decode_scaled(words, n, values, word_scales, dt, out, _k_union_size,
                                     _k_decode_union)
    return _ref.decode_union_scaled(words, n, values, word_scales, dtype, out)


def subblocks(mid: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    return _k_subblocks(mid.view(np.uint8), np.ascontiguousarray(blocks, np.int64))


def level_counts(words: np.ndarray, n: int) -> tuple[int, int]:
    used = -(-n // 8)  # the bitmap's bytes: a byte is a sub-block, 16 bytes a block
    whole = used // 16
    c1, c2 = _k_level_counts(words[:4 * whole].view(np.uint64),
                             words.view(np.uint8)[16 * whole:used])
    return int(c1), int(c2)


def assemble(n: int, union: np.ndarray, values: np.ndarray, shift: int, dtype) -> np.ndarray:
    out = np.zeros(n, dtype)
    if abs(shift) <= 1000 and out.dtype in (np.float32, np.float64):
        # v * 2.0**-shift is ldexp(v, -shift) exactly: the scale is a normal float64.
        _k_assemble(out, np.ascontiguousarray(union, np.int64), np.ascontiguousarray(values),
                    math.ldexp(1.0, -shift))
        return out
    return _ref.assemble(n, union, values, shift, dtype)


# --------------------------------------------------------------------------------------------
# The compiled kernels
# --------------------------------------------------------------------------------------------


_njit = numba.njit(cache=True, nogil=True)

_ctz: Any  # count trailing zeros, in compiled code (an intrinsic: not callable from Python)
try:
    from numba.cpython.unsafe.numbers import trailing_zeros as _ctz
except ImportError:  # pragma: no cover - internal numba API; fall back to a de Bruijn table
    _DEBRUIJN = np.array([0, 1, 28, 2, 29, 14, 24, 3, 30, 22, 20, 15, 25, 17, 4, 8, 31, 27,
                          13, 23, 21, 19, 16, 7, 26, 12, 18, 6, 11, 5, 10, 9], np.int64)

    @_njit
    def _ctz(w):  # w: int64 in (0, 2**33); bit 32 alone is a sentinel (_k_decode_union)
        if (w & 0xFFFFFFFF) == 0:
            return 32
        return _DEBRUIJN[(((w & -w) * 0x077CB531) & 0xFFFFFFFF) >> 27]


@_njit
def _k_popcount32(w):
    w = w - ((w >> 1) & 0x55555555)
    w = (w & 0x33333333) + ((w >> 2) & 0x33333333)
    return (((w + (w >> 4)) & 0x0F0F0F0F) * 0x01010101 & 0xFFFFFFFF) >> 24


@_njit
def _k_set_bits(words, n):
    total = 0
    for i in range(words.size):
        total += _k_popcount32(np.int64(words[i]))
    out = np.empty(total, np.int64)
    k = 0
    for i in range(words.size):
        w = np.int64(words[i])
        if w == 0:
            continue
        # Tensor bit 8j+t is bit 7-t of byte j: reverse the bits of each byte so that it
        # becomes bit 8j+t of the (little-endian) word, then walk the set bits upwards.
        w = ((w >> 1) & 0x55555555) | ((w & 0x55555555) << 1)
        w = ((w >> 2) & 0x33333333) | ((w & 0x33333333) << 2)
        w = ((w >> 4) & 0x0F0F0F0F) | ((w & 0x0F0F0F0F) << 4)
        base = np.int64(i) * 32
        while w:
            out[k] = base + _ctz(w)
            k += 1
            w &= w - 1
    while k > 0 and out[k - 1] >= n:  # padding bits of a foreign bitmap
        k -= 1
    return out[:k]


@_njit
def _k_subblocks(mid, blocks):
    """mid: the mid level's bytes, two per union block (its 16 sub-block bits, MSB first)."""
    total = 0
    for i in range(2 * blocks.size):
        total += _k_popcount32(np.int64(mid[i]))
    out = np.empty(total + 16, np.int64)  # room for the last block's discarded writes
    k = np.int64(0)
    for r in range(blocks.size):
        w = (np.int64(mid[2 * r]) << 8) | np.int64(mid[2 * r + 1])  # sub-block s: bit 15 - s
        base = blocks[r] << 4
        for s in range(16):  # write always, advance on a set bit: no branch to mispredict
            out[k] = base + s
            k += (w >> (15 - s)) & 1
    return out[:total]


_LOW7 = np.uint64(0x7F7F7F7F7F7F7F7F)
_HIGH = np.uint64(0x8080808080808080)
_ONES = np.uint64(0x0101010101010101)


@_njit
def _k_nonzero_bytes(v):
    """How many of a uint64's 8 bytes are not zero (bit 7 of each byte says, no carries)."""
    m = (((v & _LOW7) + _LOW7) | v) & _HIGH
    return ((m >> np.uint64(7)) * _ONES) >> np.uint64(56)


@_njit
def _k_level_counts(q, tail):
    """q: the whole blocks' bytes as uint64 (two per block); tail: the last block's bytes."""
    c1 = 0
    c2 = 0
    for i in range(0, q.size, 2):
        k = _k_nonzero_bytes(q[i]) + _k_nonzero_bytes(q[i + 1])
        c2 += k
        c1 += k != 0
    hit = 0
    for j in range(tail.size):
        nz = tail[j] != 0
        c2 += nz
        hit |= nz
    return c1 + hit, c2


@_njit
def _k_ranks(union, idx):
    r = np.empty(idx.size, np.int64)
    j = 0
    u = union.size
    for i in range(idx.size):
        t = idx[i]
        while j < u and union[j] < t:
            j += 1
        if j == u or union[j] != t:
            return r, i
        r[i] = j
    return r, -1


@_njit
def _k_assemble(out, union, values, scale):
    for r in range(union.size):
        out[union[r]] = np.float64(values[r]) * scale


@_njit
def _k_brev8(w):
    """Reverse the bits of each byte: packed-bitmap word <-> tensor-order word (bit j is
    element 32i + j), and back."""
    w = ((w >> 1) & 0x55555555) | ((w & 0x55555555) << 1)
    w = ((w >> 2) & 0x33333333) | ((w & 0x33333333) << 2)
    return ((w >> 4) & 0x0F0F0F0F) | ((w & 0x0F0F0F0F) << 4)


@_njit
def _k_scan_into(x, xi, mag, i, words, idx, raw, k):
    """Scan full words from word i on, appending positions and values at k, until the
    buffers may not hold another word (k + 32 > capacity). Returns (next word, k).

    ``xi`` is x's bits as unsigned ints and ``mag`` the mask of all but the sign bit: a
    word whose 32 values OR to no magnitude bits is all (+-)zero, and that check vectorises
    far better than building the bits (most words of a sparse tensor are zero).
    Kept free of array (re)allocation: rebinding arrays in the loop costs 3x."""
    nfull = x.size // 32
    cap = idx.size
    while i < nfull and k + 32 <= cap:
        base = i * 32
        acc = xi[base]
        for j in range(1, 32):
            acc |= xi[base + j]
        if (acc & mag) == 0:
            words[i] = 0
            i += 1
            continue
        k = _k_scan_word(x, base, 32, words, i, idx, raw, k)
        i += 1
    return i, k


@_njit
def _k_scan_word(x, base, count, words, wi, idx, raw, k):
    """Bitmap word ``wi`` from x[base:base + count]; append its non-zeros at k."""
    t = np.int64(0)
    for j in range(count):
        t |= np.int64(x[base + j] != 0) << j
    words[wi] = _k_brev8(t)
    while t:
        p = base + _ctz(t)
        idx[k] = p
        raw[k] = x[p]
        k += 1
        t &= t - 1
    return k


@_njit
def _k_grow(idx, raw, k, cap):
    """Copies of idx and raw with room for ``cap`` entries, the first k kept."""
    idx2 = np.empty(cap, idx.dtype)
    idx2[:k] = idx[:k]
    raw2 = np.empty(cap, raw.dtype)
    raw2[:k] = raw[:k]
    return idx2, raw2


@_njit
def _k_scan(x, xi, mag):
    """Scan.of in one pass: packed bitmap (``_ref.pack(x != 0)``), positions and values."""
    n = x.size
    nfull = n // 32
    words = np.empty((n + 31) // 32, np.uint32)
    cap = n // 64 + 64
    idx = np.empty(cap, np.int64)
    raw = np.empty(cap, x.dtype)
    i, k = _k_scan_into(x, xi, mag, 0, words, idx, raw, 0)
    while i < nfull:  # more non-zeros than guessed: grow and resume
        cap = min(2 * cap, n + 32)
        idx, raw = _k_grow(idx, raw, k, cap)
        i, k = _k_scan_into(x, xi, mag, i, words, idx, raw, k)
    if nfull < words.size:  # the partial last word
        if k + 32 > idx.size:
            idx, raw = _k_grow(idx, raw, k, k + 32)
        base = nfull * 32
        k = _k_scan_word(x, base, n - base, words, nfull, idx, raw, k)
    if 5 * k >= 4 * idx.size:  # nearly full (a dense tensor): no second copy of n entries
        return words, idx[:k], raw[:k]
    return words, idx[:k].copy(), raw[:k].copy()


@_njit
def _k_gather_union(words, n, q, out):
    """out[r] = q[the r-th position < n set in words]: the bitmap a word at a time."""
    k = 0
    for i in range((n + 31) // 32):
        t = _k_brev8(np.int64(words[i]))
        rem = n - 32 * i
        if rem < 32:
            t &= (np.int64(1) << rem) - 1
        base = 32 * i
        while t:
            out[k] = q[base + _ctz(t)]
            k += 1
            t &= t - 1


@_njit
def _k_union_size(words, n):
    full = n // 32
    total = 0
    for i in range(full):
        total += _k_popcount32(np.int64(words[i]))
    rem = n - full * 32
    if rem:  # only the first rem tensor bits of the last word
        total += _k_popcount32(_k_brev8(np.int64(words[full])) & ((np.int64(1) << rem) - 1))
    return total


@_njit
def _k_word_prefix(words):
    """Per bitmap word, the union's count in the words before it: a position's rank in the
    union is its word's count plus the bits below it in its word (``_k_rank``)."""
    pre = np.empty(words.size, np.int64)
    acc = 0
    for i in range(words.size):
        pre[i] = acc
        acc += _k_popcount32(np.int64(words[i]))
    return pre


@_njit
def _k_rank(words, pre, n, p):
    """Position p's rank in the union (``pre``: ``_k_word_prefix(words)``), or -1 where p is
    not in it (nor in 0..n-1)."""
    if p < 0 or p >= n:
        return -1
    pw = p >> 5
    t = _k_brev8(np.int64(words[pw]))  # tensor order: bit j is element 32 pw + j
    j = p & 31
    if not (t >> j) & 1:
        return -1
    return pre[pw] + _k_popcount32(t & ((np.int64(1) << j) - 1))


@_njit
def _k_encode_union(words, n, idx, val):
    """(int32[u] values by union rank, index of the first own position outside U or -1).

    A position's rank is the popcount of the union bitmap before it: a per-word prefix
    (n/32 words), then O(1) per non-zero."""
    pre = _k_word_prefix(words)
    out = np.zeros(_k_union_size(words, n), np.int32)
    for i in range(idx.size):
        r = _k_rank(words, pre, n, idx[i])
        if r < 0:
            return out, i
        out[r] = val[i]
    return out, -1


@_njit
def _k_decode_union(out, words, values, scales, stride):
    """Write the dense sum in one pass: 0 off the union, values[rank] * scale on it, the scale
    of word i being scales[i * stride] (stride 0: one scale). Returns the number of union
    positions (< n), or -1 if values is shorter than that.

    Per word: zero its 32 outputs, then write its first four set bits unconditionally (a
    sentinel bit 32 makes a missing one land on the next word's first output, which that
    word's zeroing overwrites), and loop only for the rest: no unpredictable loop exit for
    most words. The fast loop needs a next word and 32 values to read ahead."""
    n = out.size
    u = values.size
    nfull = n // 32
    sentinel = np.int64(1) << 32
    r = 0
    i = 0
    while i < nfull - 1 and r + 32 <= u:
        base = i * 32
        scale = scales[i * stride]
        for j in range(32):
            out[base + j] = 0
        w = _k_brev8(np.int64(words[i]))
        c = _k_popcount32(w)
        t = w | sentinel
        out[base + _ctz(t)] = np.float64(values[r]) * scale
        t = (t & (t - 1)) | sentinel
        out[base + _ctz(t)] = np.float64(values[r + 1]) * scale
        t = (t & (t - 1)) | sentinel
        out[base + _ctz(t)] = np.float64(values[r + 2]) * scale
        t = (t & (t - 1)) | sentinel
        out[base + _ctz(t)] = np.float64(values[r + 3]) * scale
        if c > 4:
            t &= t - 1  # drops the sentinel: bits 5.. of w remain
            k = r + 4
            while t:
                out[base + _ctz(t)] = np.float64(values[k]) * scale
                k += 1
                t &= t - 1
        r += c
        i += 1
    nw = (n + 31) // 32
    while i < nw:
        base = i * 32
        scale = scales[i * stride]
        lim = min(32, n - base)
        for j in range(lim):
            out[base + j] = 0
        w = _k_brev8(np.int64(words[i]))
        if lim < 32:
            w &= (np.int64(1) << lim) - 1
        while w:
            if r >= u:
                return -1
            out[base + _ctz(w)] = np.float64(values[r]) * scale
            r += 1
            w &= w - 1
        i += 1
    return r
