"""The whole job in memory: several workers' codec rounds, combined with the switch's arithmetic.

``switch_add`` and ``switch_or`` are the switch's lane rules (``homagg.switch_model.lane_add``
and ``lane_or``, defined once there) applied in arrival order; ``simulate`` runs every round
for all workers (the index, flat or hierarchical, then the values) and returns the exact sum
with what each round cost per worker on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from homagg.host_agent.codec.errors import AggregationOverflow, CodecError
from homagg.host_agent.codec.index import (
    FLAT,
    ROUND_FLAT,
    Levels,
    as_index,
    choose_index,
    hier_rounds,
)
from homagg.host_agent.codec.modes import AUTO, Mode, as_mode, choose_mode
from homagg.host_agent.codec.scan import Sparse, bitmap, union_indices
from homagg.host_agent.codec.sketch import DEFAULT_RATIO
from homagg.host_agent.codec.union import (
    check_int32,
    decode_values,
    encode_values,
    residual_values,
)
from homagg.switch_model import lane_add, lane_or


def switch_add(contribs: list[np.ndarray], round_name: str) -> np.ndarray:
    """Sum int32 words as the switch does: in arrival order, wrapping, flagging any overflow.

    The switch checks each partial sum, so an intermediate overflow is flagged even when the
    final sum would fit (as on the switch). Raises AggregationOverflow.
    """
    acc = np.zeros(contribs[0].size, np.int32)
    over = np.zeros(contribs[0].size, bool)
    for c in contribs:
        acc, lanes = lane_add(acc, c)  # wraps, as the switch's bit<32> add does
        over |= lanes
    if over.any():
        raise AggregationOverflow(round_name, np.flatnonzero(over))
    return acc


def switch_or(contribs: list[np.ndarray]) -> np.ndarray:
    """OR uint32 words (bitmaps) as the switch does."""
    acc = np.zeros(contribs[0].size, np.int32)
    for c in contribs:
        acc = lane_or(acc, c)  # uint32 words are taken as their int32 bit patterns
    return acc.view(np.uint32)


@dataclass
class SimResult:
    """Outcome of ``simulate``: the exact int sum and what it cost per worker on the wire."""

    total: np.ndarray  # int32 (the switch's word width); equal to the integer sum
    mode: Mode
    n: int
    u: int
    m: int = 0
    unresolved: int = 0
    peel_rounds: int = 0
    bytes_per_worker: dict[str, int] = field(default_factory=dict)
    index: str | None = None  # "flat" or "hier"; None: dense, no index round

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
    int_arrays, seed: int, *, mode: str = AUTO, ratio: float = DEFAULT_RATIO,
    index: str = AUTO, last_u: int | None = None,
) -> SimResult:
    """Run the codec rounds for several workers in memory, combining as the switch does.

    ``int_arrays``: one int32 array per worker, same size. ``mode``: a Mode (or its name), or
    "auto". ``index``: "flat", "hier" or "auto" (``choose_index``, with ``last_u`` as the
    agent's previous union size of this tensor, if any). Returns the decoded sum
    (bit-identical to the integer sum, or AggregationOverflow is raised) and per-round wire
    bytes per worker: "bitmap" (flat) or "index-top", "index-mid", "index-leaf" (a level
    with nothing to carry is not sent), then the value rounds. Round 1's exponent words are
    not counted.
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
    asked = as_mode(mode, auto=True)
    as_index(index)

    if asked == Mode.DENSE:
        total = switch_add(arrays, "dense")
        return SimResult(total, Mode.DENSE, n, n, bytes_per_worker={"dense": 4 * n})

    sparse = [Sparse.from_dense(a) for a in arrays]
    kind = choose_index(index, n, last_u)
    if kind == FLAT:
        union_words = switch_or([bitmap(s) for s in sparse])
        sent = {ROUND_FLAT: union_words.size}
    else:
        levels = [Levels.from_sparse(s) for s in sparse]
        union_words, sent = hier_rounds(levels, switch_or([lv.top for lv in levels]), switch_or)
    union = union_indices(union_words, n)
    u = union.size
    nbytes = {name: 4 * words for name, words in sent.items()}
    mode = (choose_mode(n, u, ratio, sum(sent.values())) if asked == AUTO
            else Mode(asked))
    if mode == Mode.DENSE:  # auto: the agent would have skipped round 1 had it known u
        total = switch_add(arrays, "dense")
        return SimResult(total, Mode.DENSE, n, u, bytes_per_worker={"dense": 4 * n})
    if u == 0:  # every worker sees an empty union: no value round (as the agent)
        return SimResult(np.zeros(n, np.int32), mode, n, 0, bytes_per_worker=nbytes,
                         index=kind)

    words = switch_add([encode_values(s, union, mode, seed, ratio) for s in sparse], mode)
    nbytes[str(mode)] = 4 * words.size
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
    m = words.size if mode == Mode.SKETCH else 0
    return SimResult(total, mode, n, u, m, left.size, peeled.rounds, nbytes, kind)
