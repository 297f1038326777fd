"""The compiled kernels of the sketch: the hash of a position to its three counters and signs,
encoding values into counters, and peeling the summed counters back into values.

Part of ``_jit`` (which ``kernels`` loads); numpy twins in ``_ref``, the same hash (``M1``..
``M3``, splitmix64) bit for bit.
"""

from __future__ import annotations

import numpy as np

from homagg.host_agent.codec import _native, _ref
from homagg.host_agent.codec._jit_bitmap import _njit
from homagg.host_agent.codec._ref import M1, M2, M3

# --------------------------------------------------------------------------------------------
# The interface (see _ref for what each returns)
# --------------------------------------------------------------------------------------------


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
    small = u < _native.PEEL_INT32_STATE_BELOW
    state = np.zeros(m, np.int32 if small else np.int64)
    rounds = _k_peel(np.ascontiguousarray(union, np.int64), s1, s2, values, resolved,
                     state, counters.astype(np.int64), 8 if small else 16,
                     *(np.empty(m, np.int64) for _ in range(4)))
    if rounds >= 0:
        return values, resolved, rounds
    return _ref.peel(counters, union, s1, s2)  # a counter with too many elements for the state


# --------------------------------------------------------------------------------------------
# The compiled kernels
# --------------------------------------------------------------------------------------------


_U1, _U27, _U30, _U31, _U32 = (np.uint64(v) for v in (1, 27, 30, 31, 32))
_LO32 = np.uint64(0xFFFFFFFF)


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
