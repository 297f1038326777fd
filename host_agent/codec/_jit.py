"""The codec's kernels compiled with numba: the loops over the bitmap, the union and the sketch.

Same functions, same signatures and bit for bit the same results as their numpy twins in
``_ref`` (the tests hold them to it); ``kernels`` picks this module when numba imports. Each
public function here prepares the arrays (contiguous, int64 positions) and runs the ``_k_*``
kernels; where a kernel cannot take an input (another dtype, a scale outside the normal
floats, too many elements per sketch counter) it hands over to the numpy reference, with the
same result. Only this module imports numba.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from homagg.host_agent.codec import _ref
from homagg.host_agent.codec._ref import M1, M2, M3, pack

#: Peeling packs a counter's element count (8 bits) and rank xor (23 bits) in an int32 below this
#: union size, in an int64 (16 + 47 bits) from it on.
_PEEL_INT32_STATE_BELOW = 2**23

__all__ = ["pack", "scan", "set_bits", "ranks", "union_size", "encode_union", "decode_union",
           "subblocks", "hashes", "sketch_encode", "peel", "assemble", "split_mask"]


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
                        word_scales: np.ndarray, dtype) -> np.ndarray | None:
    dt = np.dtype(dtype)
    if dt in (np.float32, np.float64) and values.dtype in (np.int32, np.int64):
        out = np.empty(n, dt)
        if _k_decode_union(out, words, np.ascontiguousarray(values),
                           np.ascontiguousarray(word_scales, np.float64), 1) != values.size:
            return None
        return out
    return _ref.decode_union_scaled(words, n, values, word_scales, dtype)


def subblocks(mid: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    return _k_subblocks(mid.view(np.uint8), np.ascontiguousarray(blocks, np.int64))


def hashes(idx: np.ndarray, part: int, s1: np.uint64, s2: np.uint64
           ) -> tuple[np.ndarray, np.ndarray]:
    return _k_hashes(np.ascontiguousarray(idx, np.int64), part, s1, s2)


def sketch_encode(idx: np.ndarray, val: np.ndarray, m: int, s1: np.uint64, s2: np.uint64
                  ) -> np.ndarray:
    return _k_sketch_encode(np.ascontiguousarray(idx, np.int64), np.ascontiguousarray(val),
                            m, s1, s2)


def peel(counters: np.ndarray, union: np.ndarray, s1: np.uint64, s2: np.uint64
         ) -> tuple[np.ndarray, np.ndarray, int]:
    u, m = union.size, counters.size
    values = np.zeros(u, np.int64)
    resolved = np.zeros(u, bool)
    # Count in the low bits, rank xor above: 8 + 23 bits fit an int32 (half the traffic).
    small = u < _PEEL_INT32_STATE_BELOW
    state = np.zeros(m, np.int32 if small else np.int64)
    rounds = _k_peel(np.ascontiguousarray(union, np.int64), s1, s2, values, resolved,
                     state, counters.astype(np.int64), 8 if small else 16,
                     *(np.empty(m, np.int64) for _ in range(4)))
    if rounds >= 0:
        return values, resolved, rounds
    return _ref.peel(counters, union, s1, s2)  # a counter with too many elements for the state


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


_U1, _U27, _U30, _U31, _U32 = (np.uint64(v) for v in (1, 27, 30, 31, 32))
_LO32 = np.uint64(0xFFFFFFFF)


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
def _k_mix(x):
    x ^= x >> _U30
    x *= M2
    x ^= x >> _U27
    x *= M3
    x ^= x >> _U31
    return x


@_njit
def _k_hash(i, part, s1, s2):
    """(p0, p1, p2, g0, g1, g2): counters and signs of tensor position i (see _ref.hashes)."""
    base = np.uint64(i) * M1
    a = _k_mix(base + s1)
    b = _k_mix(base + s2)
    p = np.uint64(part)
    p0 = np.int64(((a >> _U32) * p) >> _U32)
    p1 = np.int64(((a & _LO32) * p) >> _U32) + part
    p2 = np.int64(((b >> _U32) * p) >> _U32) + 2 * part
    g0 = np.int64(b & _U1) * 2 - 1
    g1 = np.int64((b >> _U1) & _U1) * 2 - 1
    g2 = np.int64((b >> np.uint64(2)) & _U1) * 2 - 1
    return p0, p1, p2, g0, g1, g2


@_njit
def _k_hashes(idx, part, s1, s2):
    pos = np.empty((3, idx.size), np.int64)
    sgn = np.empty((3, idx.size), np.int8)
    for i in range(idx.size):
        p0, p1, p2, g0, g1, g2 = _k_hash(idx[i], part, s1, s2)
        pos[0, i], pos[1, i], pos[2, i] = p0, p1, p2
        sgn[0, i], sgn[1, i], sgn[2, i] = g0, g1, g2
    return pos, sgn


@_njit
def _k_sketch_encode(idx, val, m, s1, s2):
    part = m // 3
    c = np.zeros(m, np.int64)
    for i in range(idx.size):
        p0, p1, p2, g0, g1, g2 = _k_hash(idx[i], part, s1, s2)
        v = np.int64(val[i])
        c[p0] += g0 * v
        c[p1] += g1 * v
        c[p2] += g2 * v
    return c


@_njit
def _k_peel(union, s1, s2, values, resolved, state, res, bits, frontier, nxt, bc, br):
    """Peel a sketch in place; returns the number of rounds, or -1 if a counter has too many
    elements for this kernel (the caller then uses the numpy reference).

    ``state`` (zeros, m, int32 or int64) packs per counter the number of unresolved elements
    (low ``bits`` bits) and the xor of their union ranks (above), so a counter with one
    element names it; ``res`` (int64, m) is the aggregated sketch, reduced as elements are
    peeled. The accesses are random and the working set decides the speed, hence the packing.
    ``values``/``resolved`` are per union rank; ``frontier``, ``nxt``, ``bc``, ``br`` are
    scratch of size m.

    Rounds are level-synchronous, like the numpy reference: each round takes the counters
    that hold one element. A counter reaches that state at most once (counts only fall), so a
    frontier never exceeds m. A round runs in passes of independent loads (pure counters and
    their ranks; the ranks' tensor positions; then the updates), so that the cache misses of
    different elements overlap instead of queueing behind one another.
    """
    u = union.size
    m = res.size
    part = m // 3
    low = (1 << bits) - 1
    for r in range(u):
        p0, p1, p2, g0, g1, g2 = _k_hash(union[r], part, s1, s2)
        x = r << bits
        state[p0] = (state[p0] ^ x) + 1
        state[p1] = (state[p1] ^ x) + 1
        state[p2] = (state[p2] ^ x) + 1
        if ((state[p0] | state[p1] | state[p2]) & low) == low:
            return -1
    nf = 0
    for c in range(m):
        if (state[c] & low) == 1:
            frontier[nf] = c
            nf += 1
    rounds = 0
    while nf:
        rounds += 1
        end = nf
        nf = 0
        frontier, nxt = nxt, frontier
        nb = 0
        for i in range(end):  # counters still holding one element, and its rank
            c = nxt[i]
            s = state[c]
            bc[nb] = c
            br[nb] = s >> bits
            nb += (s & low) == 1
        for i in range(nb):  # rank -> tensor position
            nxt[i] = union[br[i]]
        for i in range(nb):
            c = bc[i]
            r = br[i]
            if resolved[r]:  # pure in two counters: peeled already this round
                continue
            p0, p1, p2, g0, g1, g2 = _k_hash(nxt[i], part, s1, s2)
            j = c // part
            g = g0 if j == 0 else (g1 if j == 1 else g2)
            v = g * res[c]
            values[r] = v
            resolved[r] = True
            res[p0] -= g0 * v
            res[p1] -= g1 * v
            res[p2] -= g2 * v
            x = r << bits
            state[p0] = (state[p0] - 1) ^ x
            state[p1] = (state[p1] - 1) ^ x
            state[p2] = (state[p2] - 1) ^ x
            if (state[p0] & low) == 1:
                frontier[nf] = p0
                nf += 1
            if (state[p1] & low) == 1:
                frontier[nf] = p1
                nf += 1
            if (state[p2] & low) == 1:
                frontier[nf] = p2
                nf += 1
    return rounds


def split_mask(idx: np.ndarray, raw: np.ndarray, nb: int, block: int, binades: int,
               run: int) -> np.ndarray:
    if raw.dtype not in (np.float32, np.float64):
        return _ref.split_mask(idx, raw, nb, block, binades, run)
    return _k_split_mask(np.ascontiguousarray(idx, np.int64), np.ascontiguousarray(raw), nb,
                         block, binades, run)


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


def scale_blocks(values: np.ndarray, scales: np.ndarray, block: int, dtype) -> np.ndarray:
    out = np.empty(values.size, dtype)
    if np.dtype(dtype) in (np.float32, np.float64):
        _k_scale_blocks(out, values, scales, block)
        return out
    return _ref.scale_blocks(values, scales, block, dtype)


@_njit
def _k_scale_blocks(out, values, scales, block):
    for i in range(values.size):
        out[i] = np.float64(values[i]) * scales[i // block]


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
    return words, idx[:k].copy(), raw[:k].copy()


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
def _k_encode_union(words, n, idx, val):
    """(int32[u] values by union rank, index of the first own position outside U or -1).

    A position's rank is the popcount of the union bitmap before it: a per-word prefix
    (n/32 words), then O(1) per non-zero."""
    nw = words.size
    pre = np.empty(nw, np.int64)
    acc = 0
    for i in range(nw):
        pre[i] = acc
        acc += _k_popcount32(np.int64(words[i]))
    out = np.zeros(_k_union_size(words, n), np.int32)
    for i in range(idx.size):
        p = idx[i]
        if p < 0 or p >= n:
            return out, i
        pw = p >> 5
        t = _k_brev8(np.int64(words[pw]))  # tensor order: bit j is element 32 pw + j
        j = p & 31
        if not (t >> j) & 1:
            return out, i
        out[pre[pw] + _k_popcount32(t & ((np.int64(1) << j) - 1))] = val[i]
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
