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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

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


class CodecError(ValueError):
    """Input the codec refuses (NaN/Inf, wrong shape or dtype, inconsistent workers)."""


class AggregationOverflow(ArithmeticError):
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
        mask = q != 0
        idx = np.flatnonzero(mask)
        return cls(q.size, idx, q[idx], _pack(mask))

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
        mask = x != 0  # NaN != 0, so NaNs land in raw and max_exponent() names them
        idx = np.flatnonzero(mask)
        return cls(x.size, idx, x[idx], _pack(mask))

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
    pad = (-mask.size) % 32
    if pad:
        mask = np.concatenate([mask, np.zeros(pad, bool)])
    return np.packbits(mask).view(np.uint32)


def bitmap(s: Sparse) -> np.ndarray:
    """Packed non-zero bitmap as uint32 words (bit i of the tensor is bit 7-(i%8) of byte i//8)."""
    if s.words is not None:
        return s.words
    mask = np.zeros(s.n, dtype=bool)
    mask[s.idx] = True
    return _pack(mask)


def union_indices(words: np.ndarray, n: int) -> np.ndarray:
    """Positions set in an ORed bitmap (sorted), i.e. the union support U."""
    bits = np.unpackbits(np.asarray(words, dtype=np.uint32).view(np.uint8), count=n)
    return np.flatnonzero(bits.view(bool))


def ranks_in(union: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Rank of each of a worker's positions within U (they are a subset of U)."""
    r = np.searchsorted(union, idx)
    if idx.size and (r[-1] >= union.size or not np.array_equal(union[r], idx)):
        raise CodecError("worker's support is not contained in the union bitmap")
    return r


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


def sketch_hashes(idx: np.ndarray, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Counter positions (k, len) in [0, m) and signs (k, len) in {-1, +1} for tensor positions.

    Hash j maps into partition j (counters [j*m/k, (j+1)*m/k)), so an element's k counters are
    distinct. Seeded per job; identical on every worker.
    """
    part = m // K_HASHES
    base = idx.astype(np.uint64) * _M1
    pos = np.empty((K_HASHES, idx.size), np.int64)
    sgn = np.empty((K_HASHES, idx.size), np.int8)
    with np.errstate(over="ignore"):
        for j in range(K_HASHES):
            h = _mix(base + np.uint64((seed * K_HASHES + j + 1) * 0x2545F4914F6CDD1D % 2**64))
            pos[j] = ((h >> np.uint64(32)) * np.uint64(part)) >> np.uint64(32)
            pos[j] += j * part
            sgn[j] = ((h & np.uint64(1)).astype(np.int8) << 1) - 1
    return pos, sgn


def sketch_encode(s: Sparse, m: int, seed: int) -> np.ndarray:
    """One worker's count sketch (int32 counters). Raises AggregationOverflow if a counter of
    this worker alone leaves int32 (headroom exceeded: rescale)."""
    if m == 0:
        return np.zeros(0, np.int32)
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
    """The decoded sum as a dense float tensor: values (per union rank) / 2**shift."""
    out = np.zeros(n, dtype)
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
