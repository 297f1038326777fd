"""Pipelined tensors: the next tensor's round 1 rides with this one's values.

A job's workers all-reduce their tensors in the same order (DDP's buckets, a list). One at a
time, each tensor pays its rounds one after the other: round 1 (the scale, the index), then
its values, each a round trip that waits for the slowest worker. Pipelined, the next tensor's
round 1 goes out in the same window as this tensor's first round after round 1 (its split
round or its values: ``Transport.stream_fused``, one round trip for both), so a run of
tensors pays about one round trip per tensor, not two, and the next tensor's negotiation is
settled by the time this one is decoded.

Every worker must fuse the same two tensors, or their chunk numbers part ways. A worker knows
only whether its own next tensor is ready (a DDP bucket may still be in the backward pass), so
each says so in round 1: a worker without one sets ``HOLD`` in its round-cost word
(``negotiation``), and the OR tells every worker whether all of them go on
(``Negotiation.pipelined``). Nothing waits for a tensor that is not there: a tensor held back
starts with a round 1 of its own, as without pipelining. A tensor whose round 1 ends it (a
non-finite value) or that sends no further round (an empty union) carries nothing, on every
worker alike; the next one then starts on its own.

``Pipeline`` is what the caller hands ``Agent.allreduce_detailed``: whether its next tensor
is ready, and that tensor, taken. ``Listed`` is ``Agent.allreduce_many``'s; the DDP hook's
thread has its own (``distributed.hook``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from homagg.host_agent.negotiation import Proposal


class Pipeline(Protocol):
    """The tensors that follow, in the order every worker all-reduces them."""

    def ready(self) -> bool:
        """Whether the next tensor is here now (it may ride with this one's next round)."""
        ...

    def take(self) -> tuple[Any, Any]:
        """The next tensor and its key, taken: the caller all-reduces that same object next
        (``Agent.allreduce_detailed`` finds its round 1 done)."""
        ...


class Listed:
    """A list's tensors, in order (``Agent.allreduce_many``): ``start(i)`` before tensor
    i; the next is i + 1, or later once taken."""

    def __init__(self, items: list[tuple[Any, Any]]):
        self.items = items
        self.next = 0

    def start(self, i: int) -> None:
        self.next = max(self.next, i + 1)

    def ready(self) -> bool:
        return self.next < len(self.items)

    def take(self) -> tuple[Any, Any]:
        item = self.items[self.next]
        self.next += 1
        return item


@dataclass
class Served:
    """A tensor whose round 1 rode with the tensor before's: the object the caller passes
    (``x``), its local tensor, what its round 1 proposed, the ORed words that came back, the
    fused round's bytes that were its part (by its share of the words), and the pipeline its
    round 1 said the next tensor's readiness of (it goes on with it where its call names
    none)."""

    x: Any
    local: Any
    proposal: Proposal
    first: np.ndarray
    wire_bytes: int
    pipeline: Pipeline
