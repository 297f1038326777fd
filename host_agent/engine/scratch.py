"""The arrays of a transport's rounds, kept from round to round: a round's packets, its
results and the words it sends.

Each is a part's worth of memory (8 MiB for a part of 2^21 elements). Made afresh every round,
each of their pages would be faulted in and zeroed by the kernel, and given back when freed
(glibc trims the heap of the agent's thread), every round. A ``Scratch`` keeps a few buffers
and hands one out again once nothing refers to it but the pool.
numpy's views name the array that owns their memory as their ``base`` (a view of a view too),
and anything that holds a view holds the view, so the owner's reference count tells whether any
view of it is alive: a result a caller keeps is never written over, it only costs a new buffer.
A buffer larger than ``largest`` is never kept (an all-reduce of a long tensor not cut into
parts would otherwise hold its size three times over after the call).
"""

from __future__ import annotations

import sys

import numpy as np

__all__ = ["Scratch"]

#: The largest buffer a ``Scratch`` keeps, in bytes: a part's words, packets or sums at parts of
#: up to 2^22 elements (``AgentConfig.part``).
LARGEST = 32 << 20


def _refs(owners: list[np.ndarray], i: int) -> int:
    return sys.getrefcount(owners[i])


#: What ``_refs`` reads of an owner that nothing but the pool holds (measured, not assumed: the
#: count a call adds differs between interpreters).
_IDLE = _refs([np.empty(1, np.uint8)], 0)


class Scratch:
    """Up to ``keep`` buffers of at most ``largest`` bytes, each handed out (``empty``) while no
    view of it is alive."""

    def __init__(self, keep: int = 6, largest: int = LARGEST):
        self.keep, self.largest = keep, largest
        self._owners: list[np.ndarray] = []
        self.made = 0    # buffers allocated (kept or not)
        self.reused = 0  # requests served by a kept buffer

    @property
    def nbytes(self) -> int:
        """The bytes the pool keeps."""
        return sum(o.size for o in self._owners)

    def empty(self, n: int, dtype) -> np.ndarray:
        """An uninitialised 1-D array of ``n`` elements of ``dtype``, as ``np.empty``'s."""
        dt = np.dtype(dtype)
        size = n * dt.itemsize
        if size > self.largest:
            self.made += 1
            return np.empty(n, dt)
        fit, small = -1, -1  # the smallest idle buffer that fits; an idle one that does not
        for i in range(len(self._owners)):
            if _refs(self._owners, i) != _IDLE:
                continue
            have = self._owners[i].size
            if have >= size and (fit < 0 or have < self._owners[fit].size):
                fit = i
            elif have < size and (small < 0 or have < self._owners[small].size):
                small = i
        if fit >= 0:
            self.reused += 1
            return self._owners[fit][:size].view(dt)
        owner = np.empty(max(size, 1), np.uint8)
        self.made += 1
        if small >= 0:  # (an idle buffer too small for it: the new one takes its place)
            self._owners[small] = owner
        elif len(self._owners) < self.keep:
            self._owners.append(owner)
        return owner[:size].view(dt)

    def clear(self) -> None:
        """Let every kept buffer go (those still in use live on in their views)."""
        self._owners.clear()
