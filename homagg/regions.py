"""Slot regions: how jobs share a switch's slot pool. The controller and the software
aggregator allocate the same way, so a job lands on the same slots on either target."""

from __future__ import annotations

from homagg import wire
from homagg.errors import JobError


class NoFreeRegion(JobError):
    """The pool has no free region of the size asked for; ``shortage`` says so without the
    advice (where the controller falls back, removing a job is not the remedy)."""

    def __init__(self, shortage: str):
        super().__init__(f"{shortage}; remove a job or ask for fewer slots")
        self.shortage = shortage


def allocate_region(size: int, taken: list[range], slots: int = wire.SLOTS) -> int:
    """First base b with [b, b + size) inside [0, slots) and disjoint from every taken range."""
    if size < 1 or size > slots:
        raise JobError(f"a region of {size} slots cannot exist (1 to {slots})")
    base = 0
    for r in sorted(taken, key=lambda r: r.start):
        if r.start - base >= size:
            return base
        base = max(base, r.stop)
    if slots - base >= size:
        return base
    free = slots - sum(len(r) for r in taken)
    raise NoFreeRegion(f"no free region of {size} slots ({free} of {slots} free, fragmented "
                       "or in use)")


def mcast_group(job_id: int) -> int:
    """The multicast group of a job's results: group 0 means "no multicast" in v1model."""
    return job_id + 1
