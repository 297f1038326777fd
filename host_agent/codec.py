"""Lossless homomorphic gradient codec (after Li et al., MLSys 2024), exact by construction.

A switch can only add int32 words and OR 32-bit words, so every encoding here is *linear*: the
switch's combination of the workers' encodings is the encoding of the sum. Per tensor:

0. quantize fp32 to int32 with a power-of-two scale shared by the job (``shift_for``);
1. round 1: each worker's non-zero bitmap, ORed into the union support U;
2. round 2, one of
   - ``dense``:  all n int32 values (the SwitchML baseline);
   - ``union``:  the int32 values at the positions of U, in order (u words);
   - ``sketch``: a count sketch of the values on U (k = 3 partitioned hashes, +-1 signs, m counters
     derived from u alone), decoded by peeling;
3. round 3 (sketch only): the positions peeling left unresolved, sent densely, so the result is
   always exact. The paper estimates those values instead; we never do.

Every worker derives the same U, m, hashes and unresolved set from what the switch returned, so the
rounds need no extra messages. ``simulate`` runs all of it for several workers with the switch's own
arithmetic (int32 add with overflow detection, bitwise OR).

Note on bytes: once every worker knows U exactly, ``union`` costs u words and ``sketch`` about
1.23 u words, so the byte-count policy (``choose_mode``) prefers ``union``; ``sketch`` is kept,
tested and benchmarked as the paper's scheme (see README, "Codec").

Speed: the loops over the bitmap, the union and the sketch run as numba kernels (``USE_JIT``);
each has a numpy twin, kept as the reference the tests compare it with bit for bit, and used
when numba is missing. Mode ``union`` never lists U on the worker: ``encode_union`` ranks a
worker's non-zeros by popcounts of the ORed bitmap, and ``decode_union`` writes the dense sum in
one pass over that bitmap (``union_indices`` + ``assemble`` remain, for the sketch and as the
reference). ``Scan.of`` reads the tensor once for bitmap, positions and values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from homagg.errors import HomaggError

try:  # compiled kernels for the O(n) and O(u) loops; the numpy code below stays the reference
    import numba as _numba
except ImportError:  # pragma: no cover - numba is a declared dependency
    _numba = None

#: Use the compiled kernels (tests switch this off to run the numpy reference path).
USE_JIT = _numba is not None

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

#: Hash functions per element (the paper's k = 3; peeling threshold ~1.222 counters per element).
K_HASHES = 3
#: Default counters per union element. 1.23 is the paper's; we leave a margin above the 1.222
#: threshold so peeling finishes in few rounds and the residual stays small.
DEFAULT_RATIO = 1.25
#: Extra counters per hash partition: at small u peeling is far from its asymptotic behaviour.
SKETCH_SLACK = 4
#: Default headroom: how many worker-elements may share one counter before int32 can overflow.
DEFAULT_HEADROOM = 16

MODES = ("dense", "union", "sketch")

#: Peeling packs a counter's element count (8 bits) and rank xor (23 bits) in an int32 below this
#: union size, in an int64 (16 + 47 bits) from it on.
_PEEL_INT32_STATE_BELOW = 2**23


class CodecError(HomaggError, ValueError):
    """Input the codec refuses (NaN/Inf, wrong shape or dtype, inconsistent workers)."""


class AggregationOverflow(HomaggError, ArithmeticError):
    """An int32 add overflowed in the (simulated) switch: the sum would be wrong, so we stop."""

    def __init__(self, round_name: str, words: np.ndarray):
        self.round_name = round_name
        self.words = words
        super().__init__(
            f"int32 overflow in round {round_name!r} at {words.size} word(s) "
            f"(first at word {int(words[0]) if words.size else -1}); rescale and resend"
        )


# --------------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------------


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


def quantize(x: np.ndarray, shift: int) -> np.ndarray:
    """fp32/fp64 -> int32 fixed point rint(x * 2**shift); NaN/Inf and out-of-range raise."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise CodecError(f"quantize wants a floating-point tensor, got {x.dtype}")
    q = np.rint(np.ldexp(x.astype(np.float64, copy=False), shift))
    if not np.isfinite(q).all():
        bad = int(np.flatnonzero(~np.isfinite(q))[0])
        raise CodecError(f"tensor has a non-finite value ({x.flat[bad]}) at index {bad}")
    if q.size and (q.max() > INT32_MAX or q.min() < INT32_MIN):
        raise CodecError(f"value out of int32 range at shift {shift}: use shift_for()")
    return q.astype(np.int32)


def dequantize(q: np.ndarray, shift: int, dtype=np.float32) -> np.ndarray:
    return np.ldexp(np.asarray(q, dtype=np.float64), -shift).astype(dtype)


# --------------------------------------------------------------------------------------------
# Sparse view of one worker's tensor
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sparse:
    """A worker's int32 tensor as sorted non-zero positions and values.

    ``words``, when set, is the packed round-1 bitmap, already computed from the same scan.
    """

    n: int
    idx: np.ndarray  # int64, sorted, unique
    val: np.ndarray  # int32 (a tiny float may round to 0: it stays, harmlessly)
    words: np.ndarray | None = None

    @classmethod
    def from_dense(cls, q: np.ndarray) -> "Sparse":
        q = np.asarray(q).reshape(-1)
        if q.dtype != np.int32:
            raise CodecError(f"expected int32 values, got {q.dtype}")
        words = _pack(q != 0)
        idx = set_bits(words, q.size)
        return cls(q.size, idx, q[idx], words)

    @classmethod
    def from_float(cls, x: np.ndarray, shift: int) -> "Sparse":
        return Scan.of(x).quantize(shift)

    def to_dense(self) -> np.ndarray:
        out = np.zeros(self.n, np.int32)
        out[self.idx] = self.val
        return out


@dataclass(frozen=True)
class Scan:
    """One pass over a float tensor: its non-zero positions, their values and the bitmap.

    Everything after the scan is O(nnz): the max exponent for the job's scale, quantization.
    """

    n: int
    idx: np.ndarray
    raw: np.ndarray
    words: np.ndarray

    @classmethod
    def of(cls, x: np.ndarray) -> "Scan":
        x = np.asarray(x).reshape(-1)
        if not np.issubdtype(x.dtype, np.floating):
            raise CodecError(f"expected a floating-point tensor, got {x.dtype}")
        # NaN != 0, so NaNs land in raw and max_exponent() names them
        if USE_JIT and x.dtype in (np.float32, np.float64):
            # One pass: bitmap, positions and values together (x is read once).
            x = np.ascontiguousarray(x)
            u = np.uint32 if x.dtype == np.float32 else np.uint64
            mag = u(np.iinfo(u).max >> 1)
            words, idx, raw = _k_scan(x, x.view(u), mag)
            return cls(x.size, idx, raw, words)
        words = _pack(x != 0)
        idx = set_bits(words, x.size)
        return cls(x.size, idx, x[idx], words)

    def max_exponent(self) -> int | None:
        try:
            return max_exponent(self.raw)
        except CodecError:
            bad = int(self.idx[np.flatnonzero(~np.isfinite(self.raw))[0]])
            raise CodecError(f"tensor has a non-finite value at index {bad}") from None

    def quantize(self, shift: int) -> Sparse:
        return Sparse(self.n, self.idx, quantize(self.raw, shift), self.words)


# --------------------------------------------------------------------------------------------
# Round 1: bitmaps
# --------------------------------------------------------------------------------------------


def bitmap_words(n: int) -> int:
    """Number of 32-bit words in the bitmap of an n-element tensor."""
    return (n + 31) // 32


def _pack(mask: np.ndarray) -> np.ndarray:
    b = np.packbits(mask)  # zero-pads the last byte
    pad = (-b.size) % 4
    if pad:
        b = np.concatenate([b, np.zeros(pad, np.uint8)])
    return b.view(np.uint32)


def bitmap(s: Sparse) -> np.ndarray:
    """Packed non-zero bitmap as uint32 words (bit i of the tensor is bit 7-(i%8) of byte i//8)."""
    if s.words is not None:
        return s.words
    mask = np.zeros(s.n, dtype=bool)
    mask[s.idx] = True
    return _pack(mask)


def set_bits(words: np.ndarray, n: int) -> np.ndarray:
    """Sorted int64 positions < n whose bit is set in a packed bitmap (``bitmap``'s layout)."""
    words = np.ascontiguousarray(words, dtype=np.uint32)
    if n > 32 * words.size:
        raise CodecError(f"bitmap of {words.size} words is too short for {n} elements")
    if USE_JIT:
        return _k_set_bits(words, n)
    bits = np.unpackbits(words.view(np.uint8), count=n)
    return np.flatnonzero(bits.view(bool))


def union_indices(words: np.ndarray, n: int) -> np.ndarray:
    """Positions set in an ORed bitmap (sorted), i.e. the union support U."""
    return set_bits(words, n)


def ranks_in(union: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Rank of each of a worker's positions within U (they are a subset of U)."""
    if USE_JIT:
        r, bad = _k_ranks(np.ascontiguousarray(union, np.int64), np.ascontiguousarray(idx, np.int64))
        if bad >= 0:
            raise CodecError("worker's support is not contained in the union bitmap")
        return r
    r = np.searchsorted(union, idx)
    if idx.size and (r[-1] >= union.size or not np.array_equal(union[r], idx)):
        raise CodecError("worker's support is not contained in the union bitmap")
    return r


def union_size(words: np.ndarray, n: int) -> int:
    """u: the number of positions < n set in an ORed bitmap (without listing them)."""
    words = np.ascontiguousarray(words, dtype=np.uint32)
    if n > 32 * words.size:
        raise CodecError(f"bitmap of {words.size} words is too short for {n} elements")
    if USE_JIT:
        return int(_k_union_size(words, n))
    return int(np.count_nonzero(np.unpackbits(words.view(np.uint8), count=n)))


def encode_union(s: Sparse, union_words: np.ndarray) -> np.ndarray:
    """Round-2 words in mode ``union`` straight from the ORed bitmap: int32[u], this worker's
    value at each union rank (0 elsewhere). Same words as ``encode_values(s, union, 'union', .)``
    without listing U: a position's rank is the popcount of the union bitmap before it."""
    words = np.ascontiguousarray(union_words, dtype=np.uint32)
    if s.n > 32 * words.size:
        raise CodecError(f"bitmap of {words.size} words is too short for {s.n} elements")
    if USE_JIT:
        v, bad = _k_encode_union(words, s.n, np.ascontiguousarray(s.idx, np.int64),
                                 np.ascontiguousarray(s.val, np.int32))
        if bad >= 0:
            raise CodecError("worker's support is not contained in the union bitmap")
        return v
    return encode_values(s, union_indices(words, s.n), "union", 0)


def decode_union(union_words: np.ndarray, n: int, values: np.ndarray, shift: int,
                 dtype=np.float32) -> np.ndarray:
    """Mode ``union``'s decoded sum as a dense float tensor, straight from the ORed bitmap:
    ``assemble(n, union_indices(union_words, n), values, shift, dtype)`` in one sequential pass
    over the bitmap that writes every output element once (0 off the union)."""
    words = np.ascontiguousarray(union_words, dtype=np.uint32)
    if n > 32 * words.size:
        raise CodecError(f"bitmap of {words.size} words is too short for {n} elements")
    values = np.asarray(values)
    dt = np.dtype(dtype)
    if (USE_JIT and abs(shift) <= 1000 and dt in (np.float32, np.float64)
            and values.dtype in (np.int32, np.int64)):
        out = np.empty(n, dt)
        if _k_decode_union(out, words, np.ascontiguousarray(values),
                           math.ldexp(1.0, -shift)) != values.size:
            raise CodecError("union bitmap and values disagree on the union size")
        return out
    union = union_indices(words, n)
    if union.size != values.size:
        raise CodecError("union bitmap and values disagree on the union size")
    return assemble(n, union, values, shift, dtype)


# --------------------------------------------------------------------------------------------
# Round 2, sketch: partitioned count sketch and peeling
# --------------------------------------------------------------------------------------------


def sketch_size(u: int, ratio: float = DEFAULT_RATIO) -> int:
    """Counters for a union of u elements: k equal partitions, derived from u alone."""
    if u == 0:
        return 0
    part = math.ceil(ratio * u / K_HASHES) + SKETCH_SLACK
    return K_HASHES * part


_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, in place on a fresh uint64 array."""
    x ^= x >> np.uint64(30)
    x *= _M2
    x ^= x >> np.uint64(27)
    x *= _M3
    x ^= x >> np.uint64(31)
    return x


def _seeds(seed: int) -> tuple[np.uint64, np.uint64]:
    return tuple(np.uint64((seed * 2 + j + 1) * 0x2545F4914F6CDD1D % 2**64) for j in range(2))


def sketch_hashes(idx: np.ndarray, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Counter positions (k, len) in [0, m) and signs (k, len) in {-1, +1} for tensor positions.

    Hash j maps into partition j (counters [j*m/k, (j+1)*m/k)), so an element's k counters are
    distinct. Seeded per job; identical on every worker. Two splitmix64 mixes per element give
    128 bits: three 32-bit words place the element (multiply-shift into the partition) and three
    low bits of the second mix are its signs.
    """
    idx = np.asarray(idx)
    part = m // K_HASHES
    if part >= 2**32:
        raise CodecError(f"sketch of {m} counters is too large")
    if USE_JIT:
        return _k_hashes(np.ascontiguousarray(idx, np.int64), part, *_seeds(seed))
    s1, s2 = _seeds(seed)
    base = idx.astype(np.uint64) * _M1
    lo32 = np.uint64(0xFFFFFFFF)
    u32, p = np.uint64(32), np.uint64(part)
    pos = np.empty((K_HASHES, idx.size), np.int64)
    sgn = np.empty((K_HASHES, idx.size), np.int8)
    with np.errstate(over="ignore"):
        a = _mix(base + s1)
        b = _mix(base + s2)
        words = (a >> u32, a & lo32, b >> u32)
        for j in range(K_HASHES):
            pos[j] = (words[j] * p) >> u32
            pos[j] += j * part
            sgn[j] = (((b >> np.uint64(j)) & np.uint64(1)).astype(np.int8) << 1) - 1
    return pos, sgn


def sketch_encode(s: Sparse, m: int, seed: int) -> np.ndarray:
    """One worker's count sketch (int32 counters). Raises AggregationOverflow if a counter of
    this worker alone leaves int32 (headroom exceeded: rescale)."""
    if m == 0:
        return np.zeros(0, np.int32)
    if USE_JIT:
        if m // K_HASHES >= 2**32:
            raise CodecError(f"sketch of {m} counters is too large")
        c = _k_sketch_encode(np.ascontiguousarray(s.idx, np.int64), np.ascontiguousarray(s.val),
                             m, *_seeds(seed))
    else:
        pos, sgn = sketch_hashes(s.idx, m, seed)
        contrib = (sgn * s.val.astype(np.float64)).ravel()
        # float64 bincount is exact here: at most a few hundred terms of |v| < 2**31 per counter.
        c = np.bincount(pos.ravel(), weights=contrib, minlength=m)
    bad = np.flatnonzero((c > INT32_MAX) | (c < INT32_MIN))
    if bad.size:
        raise AggregationOverflow("sketch-encode", bad)
    return c.astype(np.int32)


@dataclass(frozen=True)
class PeelResult:
    values: np.ndarray  # int64 per union rank (0 where unresolved)
    resolved: np.ndarray  # bool per union rank
    rounds: int

    @property
    def unresolved(self) -> np.ndarray:
        return np.flatnonzero(~self.resolved)


def peel(counters: np.ndarray, union: np.ndarray, seed: int) -> PeelResult:
    """Decode an aggregated sketch on the known support U by peeling, vectorised by frontier.

    Every worker knows which union elements hash to each counter, so a counter holding exactly one
    unresolved element yields it (times its sign); that element is then removed from its other
    counters. Only counters touched in the previous round are re-examined.
    """
    u, m = union.size, counters.size
    if u == 0:
        return PeelResult(np.zeros(0, np.int64), np.zeros(0, bool), 0)
    if USE_JIT:
        if m // K_HASHES >= 2**32:
            raise CodecError(f"sketch of {m} counters is too large")
        values = np.zeros(u, np.int64)
        resolved = np.zeros(u, bool)
        # Count in the low bits, rank xor above: 8 + 23 bits fit an int32 (half the traffic).
        small = u < _PEEL_INT32_STATE_BELOW
        state = np.zeros(m, np.int32 if small else np.int64)
        rounds = _k_peel(np.ascontiguousarray(union, np.int64), *_seeds(seed), values, resolved,
                         state, counters.astype(np.int64), 8 if small else 16,
                         *(np.empty(m, np.int64) for _ in range(4)))
        if rounds >= 0:
            return PeelResult(values, resolved, rounds)
    pos, sgn = sketch_hashes(union, m, seed)
    flat = pos.ravel()
    cnt = np.bincount(flat, minlength=m)
    # Sum of member ranks per counter: for a counter with one member it *is* that member's rank.
    ranks = np.tile(np.arange(u, dtype=np.float64), K_HASHES)
    ridsum = np.bincount(flat, weights=ranks, minlength=m).astype(np.int64)
    res = counters.astype(np.int64)
    values = np.zeros(u, np.int64)
    resolved = np.zeros(u, bool)
    part = m // K_HASHES

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
        np.subtract.at(ridsum, touched.ravel(), np.tile(r, K_HASHES))
        t = touched.ravel()
        frontier = np.unique(t[cnt[t] == 1])
    return PeelResult(values, resolved, rounds)


# --------------------------------------------------------------------------------------------
# Mode choice
# --------------------------------------------------------------------------------------------


def round2_words(mode: str, n: int, u: int, ratio: float = DEFAULT_RATIO) -> int:
    if mode == "dense":
        return n
    if mode == "union":
        return u
    if mode == "sketch":
        return sketch_size(u, ratio)
    raise CodecError(f"unknown mode {mode!r}; expected one of {MODES}")


def choose_mode(n: int, u: int, ratio: float = DEFAULT_RATIO) -> str:
    """The byte count decides, from n and the union size u only (every worker agrees).

    ``dense`` skips the bitmap round, so the compressed modes must also pay for it. Ties go to
    the simpler encoding.
    """
    dense = n
    union = bitmap_words(n) + u
    sketch = bitmap_words(n) + sketch_size(u, ratio)
    best = min(dense, union, sketch)
    return "dense" if best == dense else "union" if best == union else "sketch"


# --------------------------------------------------------------------------------------------
# The switch's arithmetic, and the whole job in memory
# --------------------------------------------------------------------------------------------


def switch_add(contribs: list[np.ndarray], round_name: str) -> np.ndarray:
    """Sum int32 words as the switch does: in arrival order, wrapping, flagging any overflow.

    The switch checks each partial sum, so an intermediate overflow is flagged even when the
    final sum would fit (as on the switch). Raises AggregationOverflow.
    """
    acc = np.zeros(contribs[0].size, np.int64)
    over = np.zeros(contribs[0].size, bool)
    for c in contribs:
        acc += c
        over |= (acc > INT32_MAX) | (acc < INT32_MIN)
        acc = acc.astype(np.int32).astype(np.int64)  # wrap, as the switch's bit<32> add does
    if over.any():
        raise AggregationOverflow(round_name, np.flatnonzero(over))
    return acc.astype(np.int32)


def switch_or(contribs: list[np.ndarray]) -> np.ndarray:
    out = np.zeros(contribs[0].size, np.uint32)
    for c in contribs:
        out |= c
    return out


# --------------------------------------------------------------------------------------------
# One worker's side of rounds 2 and 3 (the agent and ``simulate`` both use these)
# --------------------------------------------------------------------------------------------


def encode_values(s: Sparse, union: np.ndarray, mode: str, seed: int,
                  ratio: float = DEFAULT_RATIO) -> np.ndarray:
    """Round-2 int32 words of one worker, for a union support every worker shares."""
    if mode == "dense":
        return s.to_dense()
    if mode == "union":
        v = np.zeros(union.size, np.int32)
        v[ranks_in(union, s.idx)] = s.val
        return v
    if mode == "sketch":
        return sketch_encode(s, sketch_size(union.size, ratio), seed)
    raise CodecError(f"unknown mode {mode!r}; expected one of {MODES}")


def decode_values(agg: np.ndarray, union: np.ndarray, mode: str, seed: int) -> PeelResult:
    """Round-2 aggregate -> int values per union rank (per element for dense), and which are
    still unknown (sketch only: those go to the residual round)."""
    if mode in ("dense", "union"):
        return PeelResult(agg.astype(np.int64), np.ones(agg.size, bool), 0)
    if mode == "sketch":
        return peel(agg, union, seed)
    raise CodecError(f"unknown mode {mode!r}; expected one of {MODES}")


def residual_values(s: Sparse, positions: np.ndarray) -> np.ndarray:
    """Round-3 int32 words: this worker's values at the (shared) unresolved positions."""
    out = np.zeros(positions.size, np.int32)
    if s.idx.size:
        hit = np.minimum(np.searchsorted(s.idx, positions), s.idx.size - 1)
        ok = s.idx[hit] == positions
        out[ok] = s.val[hit[ok]]
    return out


def assemble(n: int, union: np.ndarray, values: np.ndarray, shift: int,
             dtype=np.float32) -> np.ndarray:
    """The decoded sum as a dense float tensor: values (per union rank) / 2**shift.

    Each value is rounded once, from the exact ``values * 2**-shift``, to ``dtype``.
    """
    out = np.zeros(n, dtype)
    if USE_JIT and abs(shift) <= 1000 and out.dtype in (np.float32, np.float64):
        # v * 2.0**-shift is ldexp(v, -shift) exactly: the scale is a normal float64.
        _k_assemble(out, np.ascontiguousarray(union, np.int64), np.ascontiguousarray(values),
                    math.ldexp(1.0, -shift))
        return out
    out[union] = np.ldexp(values.astype(np.float64), -shift)
    return out


def check_int32(values: np.ndarray, round_name: str) -> None:
    if values.size and (values.max() > INT32_MAX or values.min() < INT32_MIN):
        raise AggregationOverflow(round_name, np.flatnonzero((values > INT32_MAX) | (values < INT32_MIN)))


@dataclass
class SimResult:
    """Outcome of ``simulate``: the exact int sum and what it cost per worker on the wire."""

    total: np.ndarray  # int32 (the switch's word width); equal to the integer sum
    mode: str
    n: int
    u: int
    m: int = 0
    unresolved: int = 0
    peel_rounds: int = 0
    bytes_per_worker: dict[str, int] = field(default_factory=dict)

    @property
    def wire_bytes(self) -> int:
        return sum(self.bytes_per_worker.values())

    @property
    def dense_bytes(self) -> int:
        return 4 * self.n

    @property
    def ratio(self) -> float:
        """Wire bytes per worker relative to dense fp32."""
        return self.wire_bytes / self.dense_bytes if self.n else 0.0


def simulate(
    int_arrays, seed: int, *, mode: str = "auto", ratio: float = DEFAULT_RATIO
) -> SimResult:
    """Run the codec rounds for several workers in memory, combining as the switch does.

    ``int_arrays``: one int32 array per worker, same size. Returns the decoded sum (bit-identical
    to the integer sum, or AggregationOverflow is raised) and per-round wire bytes per worker.
    """
    arrays = [np.asarray(a).reshape(-1) for a in int_arrays]
    if not arrays:
        raise CodecError("simulate needs at least one worker")
    n = arrays[0].size
    for w, a in enumerate(arrays):
        if a.size != n:
            raise CodecError(f"worker {w} has {a.size} elements, worker 0 has {n}")
        if a.dtype != np.int32:
            raise CodecError(f"worker {w}: expected int32, got {a.dtype}")
    if mode != "auto" and mode not in MODES:
        raise CodecError(f"unknown mode {mode!r}; expected 'auto' or one of {MODES}")

    if mode == "dense":
        total = switch_add(arrays, "dense")
        return SimResult(total, "dense", n, n, bytes_per_worker={"dense": 4 * n})

    sparse = [Sparse.from_dense(a) for a in arrays]
    union = union_indices(switch_or([bitmap(s) for s in sparse]), n)
    u = union.size
    nbytes = {"bitmap": 4 * bitmap_words(n)}
    if mode == "auto":
        mode = choose_mode(n, u, ratio)
        if mode == "dense":  # the agent would have skipped round 1 had it known u
            total = switch_add(arrays, "dense")
            return SimResult(total, "dense", n, u, bytes_per_worker={"dense": 4 * n})

    words = switch_add([encode_values(s, union, mode, seed, ratio) for s in sparse], mode)
    nbytes[mode] = 4 * words.size
    peeled = decode_values(words, union, mode, seed)
    values = peeled.values
    left = peeled.unresolved
    if left.size:
        positions = union[left]
        values = values.copy()
        values[left] = switch_add([residual_values(s, positions) for s in sparse], "residual")
        nbytes["residual"] = 4 * left.size
    # Only reachable if counters wrapped undetected: never hand back a wrong sum.
    check_int32(values, mode + "-decode")
    total = np.zeros(n, np.int32)
    total[union] = values.astype(np.int32)
    m = words.size if mode == "sketch" else 0
    return SimResult(total, mode, n, u, m, left.size, peeled.rounds, nbytes)


# --------------------------------------------------------------------------------------------
# Compiled kernels (numba). Each one has a numpy twin above that tests compare it against.
# --------------------------------------------------------------------------------------------

if _numba is not None:
    _jit = _numba.njit(cache=True, nogil=True)

    try:
        from numba.cpython.unsafe.numbers import trailing_zeros as _ctz
    except ImportError:  # pragma: no cover - internal numba API; fall back to a de Bruijn table
        _DEBRUIJN = np.array([0, 1, 28, 2, 29, 14, 24, 3, 30, 22, 20, 15, 25, 17, 4, 8, 31, 27,
                              13, 23, 21, 19, 16, 7, 26, 12, 18, 6, 11, 5, 10, 9], np.int64)

        @_jit
        def _ctz(w):  # w: int64 in (0, 2**33); bit 32 alone is a sentinel (_k_decode_union)
            if (w & 0xFFFFFFFF) == 0:
                return 32
            return _DEBRUIJN[(((w & -w) * 0x077CB531) & 0xFFFFFFFF) >> 27]

    _U1, _U27, _U30, _U31, _U32 = (np.uint64(v) for v in (1, 27, 30, 31, 32))
    _LO32 = np.uint64(0xFFFFFFFF)

    @_jit
    def _k_popcount32(w):
        w = w - ((w >> 1) & 0x55555555)
        w = (w & 0x33333333) + ((w >> 2) & 0x33333333)
        return (((w + (w >> 4)) & 0x0F0F0F0F) * 0x01010101 & 0xFFFFFFFF) >> 24

    @_jit
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

    @_jit
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

    @_jit
    def _k_mix(x):
        x ^= x >> _U30
        x *= _M2
        x ^= x >> _U27
        x *= _M3
        x ^= x >> _U31
        return x

    @_jit
    def _k_hash(i, part, s1, s2):
        """(p0, p1, p2, g0, g1, g2): counters and signs of tensor position i (see sketch_hashes)."""
        base = np.uint64(i) * _M1
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

    @_jit
    def _k_hashes(idx, part, s1, s2):
        pos = np.empty((3, idx.size), np.int64)
        sgn = np.empty((3, idx.size), np.int8)
        for i in range(idx.size):
            p0, p1, p2, g0, g1, g2 = _k_hash(idx[i], part, s1, s2)
            pos[0, i], pos[1, i], pos[2, i] = p0, p1, p2
            sgn[0, i], sgn[1, i], sgn[2, i] = g0, g1, g2
        return pos, sgn

    @_jit
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

    @_jit
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

    @_jit
    def _k_assemble(out, union, values, scale):
        for r in range(union.size):
            out[union[r]] = np.float64(values[r]) * scale

    @_jit
    def _k_brev8(w):
        """Reverse the bits of each byte: packed-bitmap word <-> tensor-order word (bit j is
        element 32i + j), and back."""
        w = ((w >> 1) & 0x55555555) | ((w & 0x55555555) << 1)
        w = ((w >> 2) & 0x33333333) | ((w & 0x33333333) << 2)
        return ((w >> 4) & 0x0F0F0F0F) | ((w & 0x0F0F0F0F) << 4)

    @_jit
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

    @_jit
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

    @_jit
    def _k_grow(idx, raw, k, cap):
        """Copies of idx and raw with room for ``cap`` entries, the first k kept."""
        idx2 = np.empty(cap, idx.dtype)
        idx2[:k] = idx[:k]
        raw2 = np.empty(cap, raw.dtype)
        raw2[:k] = raw[:k]
        return idx2, raw2

    @_jit
    def _k_scan(x, xi, mag):
        """Scan.of in one pass: packed bitmap (``_pack(x != 0)``), positions and values."""
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

    @_jit
    def _k_union_size(words, n):
        full = n // 32
        total = 0
        for i in range(full):
            total += _k_popcount32(np.int64(words[i]))
        rem = n - full * 32
        if rem:  # only the first rem tensor bits of the last word
            total += _k_popcount32(_k_brev8(np.int64(words[full])) & ((np.int64(1) << rem) - 1))
        return total

    @_jit
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

    @_jit
    def _k_decode_union(out, words, values, scale):
        """Write the dense sum in one pass: 0 off the union, values[rank] * scale on it. Returns
        the number of union positions (< n), or -1 if values is shorter than that.

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
