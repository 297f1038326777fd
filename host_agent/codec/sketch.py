"""Round 2 in mode ``sketch``: a partitioned count sketch of the values on U, decoded by peeling.

k = 3 partitioned hashes with +-1 signs, m counters derived from u alone (``sketch_size``), so
every worker agrees on the layout without a message. Peeling resolves most of U; what it leaves
goes to round 3 (the residual), so the sum stays exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from homagg.host_agent.codec import kernels
from homagg.host_agent.codec.errors import AggregationOverflow, CodecError
from homagg.host_agent.codec.quantization import INT32_MAX, INT32_MIN
from homagg.host_agent.codec.scan import Sparse

#: Hash functions per element (the paper's k = 3; peeling threshold ~1.222 counters per element).
#: The hash kernels (``_ref.hashes`` and its twin) produce exactly this many positions.
K_HASHES = 3
#: Default counters per union element. 1.23 is the paper's; we leave a margin above the 1.222
#: threshold so peeling finishes in few rounds and the residual stays small.
DEFAULT_RATIO = 1.25
#: Extra counters per hash partition: at small u peeling is far from its asymptotic behaviour.
SKETCH_SLACK = 4


def sketch_size(u: int, ratio: float = DEFAULT_RATIO) -> int:
    """Counters for a union of u elements: k equal partitions, derived from u alone."""
    if u == 0:
        return 0
    part = math.ceil(ratio * u / K_HASHES) + SKETCH_SLACK
    return K_HASHES * part


def _seeds(seed: int) -> tuple[np.uint64, np.uint64]:
    s1, s2 = (np.uint64((seed * 2 + j + 1) * 0x2545F4914F6CDD1D % 2**64) for j in range(2))
    return s1, s2


def _check_size(m: int) -> None:
    if m // K_HASHES >= 2**32:
        raise CodecError(f"sketch of {m} counters is too large")


def sketch_hashes(idx: np.ndarray, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Counter positions (k, len) in [0, m) and signs (k, len) in {-1, +1} for tensor positions.

    Hash j maps into partition j (counters [j*m/k, (j+1)*m/k)), so an element's k counters are
    distinct. Seeded per job; identical on every worker. Two splitmix64 mixes per element give
    128 bits: three 32-bit words place the element (multiply-shift into the partition) and three
    low bits of the second mix are its signs.
    """
    idx = np.asarray(idx)
    _check_size(m)
    return kernels.active.hashes(idx, m // K_HASHES, *_seeds(seed))


def sketch_encode(s: Sparse, m: int, seed: int) -> np.ndarray:
    """One worker's count sketch (int32 counters). Raises AggregationOverflow if a counter of
    this worker alone leaves int32 (headroom exceeded: rescale)."""
    if m == 0:
        return np.zeros(0, np.int32)
    _check_size(m)
    c = kernels.active.sketch_encode(s.idx, s.val, m, *_seeds(seed))
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
    if union.size == 0:
        return PeelResult(np.zeros(0, np.int64), np.zeros(0, bool), 0)
    _check_size(counters.size)
    values, resolved, rounds = kernels.active.peel(counters, union, *_seeds(seed))
    return PeelResult(values, resolved, rounds)
