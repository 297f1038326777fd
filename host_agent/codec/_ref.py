"""The codec's kernels in plain numpy: the reference the compiled ones (``_jit``) must match.

These are the definitions: the tests compare every numba kernel with its twin here, bit for bit,
and the codec runs these when numba is missing (``kernels``). Both modules have the same
functions with the same signatures; the codec checks the arguments (sizes, ranges) before it
calls either, and turns a ``None`` ("does not fit the union") into its CodecError.

Layouts shared by both: a packed bitmap has tensor bit i at bit 7-(i%8) of byte i//8, as uint32
words (``pack``); the sketch hash is two splitmix64 mixes per element (``M1``..``M3``), three
counter positions, one per partition of ``part`` counters, and three signs.
"""

from __future__ import annotations

import numpy as np

#: Counter positions per element: the hash below yields three (``sketch.K_HASHES``).
K = 3

M1 = np.uint64(0x9E3779B97F4A7C15)
M2 = np.uint64(0xBF58476D1CE4E5B9)
M3 = np.uint64(0x94D049BB133111EB)


def pack(mask: np.ndarray) -> np.ndarray:
    """Packed bitmap of a bool mask as uint32 words (no compiled twin: one numpy pass)."""
    b = np.packbits(mask)  # zero-pads the last byte
    pad = (-b.size) % 4
    if pad:
        b = np.concatenate([b, np.zeros(pad, np.uint8)])
    return b.view(np.uint32)


def scan(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bitmap words, sorted int64 non-zero positions, their values) of a 1-D float tensor."""
    words = pack(x != 0)
    idx = set_bits(words, x.size)
    return words, idx, x[idx]


def set_bits(words: np.ndarray, n: int) -> np.ndarray:
    """Sorted int64 positions < n set in contiguous uint32 ``words`` (n <= 32 * words.size)."""
    bits = np.unpackbits(words.view(np.uint8), count=n)
    return np.flatnonzero(bits.view(bool))


def ranks(union: np.ndarray, idx: np.ndarray) -> np.ndarray | None:
    """Rank of each sorted position of idx within the sorted union; None if one is not in it."""
    r = np.searchsorted(union, idx)
    if idx.size and (r[-1] >= union.size or not np.array_equal(union[r], idx)):
        return None
    return r


def union_size(words: np.ndarray, n: int) -> int:
    """Number of positions < n set in contiguous uint32 ``words``."""
    return int(np.count_nonzero(np.unpackbits(words.view(np.uint8), count=n)))


def encode_union(words: np.ndarray, n: int, idx: np.ndarray, val: np.ndarray
                 ) -> np.ndarray | None:
    """int32[u]: val at the union rank of each idx (0 elsewhere); None if idx leaves the union."""
    union = set_bits(words, n)
    r = ranks(union, idx)
    if r is None:
        return None
    v = np.zeros(union.size, np.int32)
    v[r] = val
    return v


def gather_union(words: np.ndarray, n: int, q: np.ndarray) -> np.ndarray:
    """int32[u]: a dense int32 tensor's ``q`` at the positions < n set in ``words``, by rank."""
    return np.ascontiguousarray(q[set_bits(words, n)], np.int32)


def decode_union(words: np.ndarray, n: int, values: np.ndarray, shift: int, dtype
                 ) -> np.ndarray | None:
    """Dense float tensor: values (per union rank) / 2**shift on the union, 0 off it; None if
    the bitmap's union size is not values.size."""
    union = set_bits(words, n)
    if union.size != values.size:
        return None
    return assemble(n, union, values, shift, dtype)


def decode_union_scaled(words: np.ndarray, n: int, values: np.ndarray,
                        word_scales: np.ndarray, dtype, out: np.ndarray | None = None
                        ) -> np.ndarray | None:
    """``decode_union`` with a scale per bitmap word (32 elements): values (per union rank)
    times the scale of their word, rounded once to dtype, in ``out`` where given (n, dtype,
    contiguous; it may be the worker's own tensor: it is written only once the sizes agree);
    None on a union size mismatch."""
    union = set_bits(words, n)
    if union.size != values.size:
        return None
    if out is None:
        out = np.zeros(n, dtype)
    else:
        out[:] = 0
    out[union] = values.astype(np.float64) * np.asarray(word_scales, np.float64)[union // 32]
    return out


def subblocks(mid: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """Sorted int64 sub-block numbers (element // 8) set in a hierarchical index's mid level:
    bit 16r + s of contiguous uint32 ``mid`` is sub-block s of block ``blocks[r]`` (sorted
    int64), i.e. sub-block 16 * blocks[r] + s (16 * blocks.size <= 32 * mid.size)."""
    k = set_bits(mid, 16 * blocks.size)
    return (blocks[k >> 4] << 4) | (k & 15)


def level_counts(words: np.ndarray, n: int) -> tuple[int, int]:
    """(c1, c2) of a flat bitmap's hierarchy (``index``): its blocks of 128 elements and its
    sub-blocks of 8 with a bit set, among the first ceil(n / 8) bytes of contiguous uint32
    ``words`` (a byte is a sub-block; 16 bytes are a block)."""
    nonzero = words.view(np.uint8)[:-(-n // 8)] != 0
    pad = (-nonzero.size) % 16
    c1 = int(np.concatenate([nonzero, np.zeros(pad, bool)]).reshape(-1, 16).any(1).sum())
    return c1, int(nonzero.sum())


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, in place on a fresh uint64 array."""
    x ^= x >> np.uint64(30)
    x *= M2
    x ^= x >> np.uint64(27)
    x *= M3
    x ^= x >> np.uint64(31)
    return x


def hashes(idx: np.ndarray, part: int, s1: np.uint64, s2: np.uint64
           ) -> tuple[np.ndarray, np.ndarray]:
    """Counter positions (K, len) int64 and signs (K, len) int8 of tensor positions idx."""
    base = idx.astype(np.uint64) * M1
    lo32 = np.uint64(0xFFFFFFFF)
    u32, p = np.uint64(32), np.uint64(part)
    pos = np.empty((K, idx.size), np.int64)
    sgn = np.empty((K, idx.size), np.int8)
    with np.errstate(over="ignore"):
        a = _mix(base + s1)
        b = _mix(base + s2)
        words = (a >> u32, a & lo32, b >> u32)
        for j in range(K):
            pos[j] = (words[j] * p) >> u32
            pos[j] += j * part
            sgn[j] = (((b >> np.uint64(j)) & np.uint64(1)).astype(np.int8) << 1) - 1
    return pos, sgn


def sketch_encode(idx: np.ndarray, val: np.ndarray, m: int, s1: np.uint64, s2: np.uint64
                  ) -> np.ndarray:
    """One worker's m count-sketch counters, unbounded (the codec range-checks them)."""
    pos, sgn = hashes(idx, m // K, s1, s2)
    contrib = (sgn * val.astype(np.float64)).ravel()
    # float64 bincount is exact here: at most a few hundred terms of |v| < 2**31 per counter.
    return np.bincount(pos.ravel(), weights=contrib, minlength=m)


def peel(counters: np.ndarray, union: np.ndarray, s1: np.uint64, s2: np.uint64
         ) -> tuple[np.ndarray, np.ndarray, int]:
    """(int64 values per union rank, resolved per rank, rounds): peeling, vectorised by frontier.

    A counter with one member yields it; only counters touched in the previous round are
    re-examined.
    """
    u, m = union.size, counters.size
    pos, sgn = hashes(union, m // K, s1, s2)
    flat = pos.ravel()
    cnt = np.bincount(flat, minlength=m)
    # Sum of member ranks per counter: for a counter with one member it *is* that member's rank.
    rank_list = np.tile(np.arange(u, dtype=np.float64), K)
    ridsum = np.bincount(flat, weights=rank_list, minlength=m).astype(np.int64)
    res = counters.astype(np.int64)
    values = np.zeros(u, np.int64)
    resolved = np.zeros(u, bool)
    part = m // K

    frontier = np.flatnonzero(cnt == 1)
    rounds = 0
    while frontier.size:
        rounds += 1
        r, first = np.unique(ridsum[frontier], return_index=True)
        c = frontier[first]
        j = c // part
        v = sgn[j, r].astype(np.int64) * res[c]
        values[r] = v
        resolved[r] = True
        touched = pos[:, r]  # (k, len)
        np.subtract.at(res, touched.ravel(), (sgn[:, r] * v).ravel())
        np.subtract.at(cnt, touched.ravel(), 1)
        np.subtract.at(ridsum, touched.ravel(), np.tile(r, K))
        t = touched.ravel()
        frontier = np.unique(t[cnt[t] == 1])
    return values, resolved, rounds


def assemble(n: int, union: np.ndarray, values: np.ndarray, shift: int, dtype) -> np.ndarray:
    """Dense float tensor: each value rounded once, from the exact values * 2**-shift."""
    out = np.zeros(n, dtype)
    out[union] = np.ldexp(values.astype(np.float64), -shift)
    return out


def scale_blocks(values: np.ndarray, scales: np.ndarray, block: int, dtype,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Integer-valued ``values`` (float64 or int) times ``scales[i // block]`` (powers of two:
    exact), rounded once to ``dtype``, in ``out`` where given (n, dtype, contiguous)."""
    values = np.asarray(values, np.float64)
    n = values.size
    out = np.empty(n, dtype) if out is None else out
    full = n // block
    if full:
        out[:full * block] = (values[:full * block].reshape(full, block)
                              * scales[:full, None]).reshape(-1)
    if n > full * block:
        out[full * block:] = values[full * block:] * scales[full]
    return out


def block_peaks(idx: np.ndarray, raw: np.ndarray, nb: int, block: int) -> np.ndarray:
    """Per block (float64, nb): the largest magnitude among its non-zeros (``idx`` sorted
    int64 positions, ``raw`` their values), 0 for a block without one."""
    peaks = np.zeros(nb, np.float64)
    if idx.size:
        b = idx // block
        starts = np.flatnonzero(np.concatenate([[True], b[1:] != b[:-1]]))
        peaks[b[starts]] = np.maximum.reduceat(np.abs(np.asarray(raw, np.float64)), starts)
    return peaks


def split_mask(idx: np.ndarray, raw: np.ndarray, nb: int, block: int, binades: int,
               run: int) -> np.ndarray:
    """Per block (bool, nb): does it hold ``run`` consecutive non-zeros each under
    2**(e_peak - 1 - binades), e_peak the exponent of the block's largest magnitude? ``idx``
    sorted int64 positions of the non-zeros, ``raw`` their values (``blocks.split_flags``)."""
    flags = np.zeros(nb, bool)
    if idx.size < run:
        return flags
    b = idx // block
    starts = np.flatnonzero(np.concatenate([[True], b[1:] != b[:-1]]))
    mag = np.abs(np.asarray(raw, np.float64))
    peak = np.maximum.reduceat(mag, starts)
    limit = np.ldexp(1.0, np.frexp(peak)[1] - 1 - binades)
    small = mag < np.repeat(limit, np.diff(np.append(starts, idx.size)))
    k = idx.size - run + 1
    hit = small[:k].copy()
    for j in range(1, run):
        hit &= small[j:j + k]
    at = np.flatnonzero(hit)  # few: now check that they are consecutive, in one block
    last = at + run - 1
    at = at[(idx[last] - idx[at] == run - 1) & (b[last] == b[at])]
    flags[b[at]] = True
    return flags



#: Elements ``quantize_blocks`` scales at a time: 8 MB of float64 products and shifts.
CHUNK = 1 << 20


def summary(x: np.ndarray, block: int, binades: int, run: int, split: bool, cap: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int,
                       tuple[np.ndarray, np.ndarray] | None]:
    """Round 1's reading of a 1-D float tensor: (bitmap words, per-block peaks as
    ``block_peaks``, per-block ``split_mask`` (all False unless ``split``), the first
    non-finite position or -1, and the non-zeros (positions, values) as ``scan``, or None
    when there are more than ``cap``). With a non-finite value, the peaks and the mask are all
    zero: nothing is scaled."""
    words, idx, raw = scan(x)
    nb = -(-x.size // block)
    peaks, mask = np.zeros(nb, np.float64), np.zeros(nb, bool)
    fin = np.isfinite(raw)
    bad = -1 if fin.all() else int(idx[np.flatnonzero(~fin)[0]])
    if bad < 0:
        peaks = block_peaks(idx, raw, nb, block)
        if split:
            mask = split_mask(idx, raw, nb, block, binades, run)
    return words, peaks, mask, bad, ((idx, raw) if idx.size <= cap else None)


def quantize_blocks(x: np.ndarray, shifts: np.ndarray, block: int, at: np.ndarray,
                    at_shifts: np.ndarray, out: np.ndarray | None = None
                    ) -> tuple[np.ndarray, int]:
    """Every element of a 1-D float tensor as int32 ``rint(x * 2**shift)``, ``shift`` its
    block's (int64 ``shifts``, one per ``block`` elements) or, at the sorted positions ``at``,
    its own (``at_shifts``); and the first position whose value is not finite or not in int32
    there, or -1 (the words from that chunk on are then unspecified). The words go in ``out``
    (int32, contiguous, x.size of them) where given."""
    n = x.size
    out = np.empty(n, np.int32) if out is None else out
    step = max(block, CHUNK // block * block)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        s = np.repeat(shifts[lo // block:-(-hi // block)], block)[:hi - lo]
        k0, k1 = np.searchsorted(at, [lo, hi])
        s[at[k0:k1] - lo] = at_shifts[k0:k1]
        with np.errstate(over="ignore", invalid="ignore"):  # (reported as the position)
            q = np.rint(np.ldexp(x[lo:hi].astype(np.float64), s))
            ok = (q >= -2.0 ** 31) & (q <= 2.0 ** 31 - 1)  # (False for NaN)
        if not ok.all():
            return out, lo + int(np.flatnonzero(~ok)[0])
        out[lo:hi] = q
    return out, -1


def encode_union_blocks(words: np.ndarray, n: int, idx: np.ndarray, raw: np.ndarray,
                        shifts: np.ndarray, block: int, at: np.ndarray, at_shifts: np.ndarray
                        ) -> np.ndarray | None:
    """A worker's words of mode union from its listed non-zeros (sorted positions ``idx``,
    float values ``raw``): int32[u], each value at its union rank quantized as
    ``quantize_blocks`` does (0 where the worker has none); None where a value does not
    quantize or a position is outside the union (the codec's step-by-step path names which)."""
    idx = np.asarray(idx, np.int64)
    s = np.asarray(shifts, np.int64)[idx // block]
    if at.size and idx.size:
        k = np.minimum(np.searchsorted(at, idx), at.size - 1)
        hit = at[k] == idx
        s[hit] = np.asarray(at_shifts, np.int64)[k[hit]]
    with np.errstate(over="ignore", invalid="ignore"):
        q = np.rint(np.ldexp(np.asarray(raw).astype(np.float64), s))
        ok = (q >= -2.0 ** 31) & (q <= 2.0 ** 31 - 1)  # (False for NaN)
    if not ok.all():
        return None
    return encode_union(words, n, idx, q.astype(np.int32))
