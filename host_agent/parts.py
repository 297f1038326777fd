"""A long host tensor all-reduced in place as consecutive parts: the memory of one part at a
time.

One ``Agent.allreduce_detailed`` call holds its tensor's value words, their packets and the
switch's sums at once, each about the tensor's size: three copies of a bucket beside the bucket
itself. DDP's first step hands over one bucket of every parameter (BERT-base: 132M elements, so
1.6 GB more than gloo's ring, which sums in place). ``Parted`` cuts a contiguous float array
into parts of at most ``AgentConfig.part`` elements and all-reduces each in turn, decoded
straight into its place in the array before the next part is quantized, so at most one part's
words, packets and sums are alive.

Each part is a tensor of its own to the agent: its own round 1 (scale, index, mode), its own
key (the tensor's key and the part's number), its exact integer sum. The parts ride one
another's rounds as a list does (``pipeline``: part k + 1's round 1 goes with part k's values),
and the last part's round carries the next tensor's round 1 where the caller's pipeline has one
ready; so a long tensor pays about one round trip a part. Every worker cuts the same tensor the
same way (the parts depend on its size and ``part`` alone, which every worker of a job sets
alike), so they all-reduce the same parts in the same order. A tensor of at most ``part``
elements is one part, with the caller's key: what it was before.

An error in part k leaves parts 0 to k - 1 summed in place and the rest as they were (one call
leaves its ``out`` untouched; a parted tensor is its own ``out``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from homagg.host_agent.errors import AgentError

if TYPE_CHECKING:
    from homagg.host_agent.pipeline import Pipeline

#: elements per part (8 MiB of float32: a DDP bucket of the default 25 MiB goes in four)
DEFAULT_PART = 1 << 21


def bounds(n: int, part: int) -> list[tuple[int, int]]:
    """The parts of ``n`` elements: [lo, hi) ranges of at most ``part`` elements, in order
    (one, empty, for n = 0)."""
    if part < 1:
        raise ValueError(f"part {part}: elements per part, >= 1")
    return [(lo, min(lo + part, n)) for lo in range(0, n, part)] or [(0, 0)]


class Parted:
    """A contiguous 1-D host array and its key, cut into parts (views of it, made once: the
    part a pipeline takes ahead is the object its turn passes)."""

    def __init__(self, arr: np.ndarray, key: Any, part: int):
        if arr.ndim != 1 or not arr.flags.c_contiguous:
            raise ValueError("Parted: a contiguous 1-D array")
        spans = bounds(arr.size, part)
        self.starts = [lo for lo, _ in spans]
        self.views = [arr[lo:hi] for lo, hi in spans]
        self.keys = [key] if len(spans) == 1 else [(key, "part", k) for k in range(len(spans))]

    def first(self) -> tuple[np.ndarray, Any]:
        """The first part and its key: what the tensor offers to ride ahead."""
        return self.views[0], self.keys[0]

    def allreduce(self, agent, behind: Pipeline | None = None, pipelined: bool = True,
                  each: Callable[[Any], None] | None = None) -> None:
        """Each part's sum through ``agent``, in place, in order. ``behind``: the tensors
        after this one (the last part's round may carry the next one's round 1);
        ``pipelined``: False sends each part's round 1 on its own (and nothing ahead);
        ``each``: called with each part's ``Result`` (which holds that part's integer sums:
        kept, they are memory again). An error that names an element (``index``) names it
        in the whole tensor."""
        pipe = _Then(self, behind) if pipelined else None
        for k, (view, key) in enumerate(zip(self.views, self.keys)):
            if pipe is not None:
                pipe.start(k)
            try:
                r = agent.allreduce_detailed(view, key, out=view, pipeline=pipe)
            except AgentError as err:
                _shift_index(err, self.starts[k])
                raise
            if each is not None:
                each(r)
            del r


def _shift_index(err: AgentError, at: int) -> None:
    """``err``'s element index (if any), of a part that starts at ``at``, made the tensor's."""
    index = getattr(err, "index", None)
    if index is None or not at:
        return
    err.index = index + at  # type: ignore[attr-defined]
    err.args = (str(err).replace(f"at index {index}", f"at index {index + at}", 1),
                *err.args[1:])


class _Then:
    """The pipeline of the parts: this tensor's next part (after the one running, or after
    the one last taken: a taken part's round 1 speaks for the part after it), then
    ``behind``'s tensors."""

    def __init__(self, parted: Parted, behind: Pipeline | None):
        self.parted, self.behind, self.next = parted, behind, 0

    def start(self, k: int) -> None:
        """Part ``k`` is all-reduced now."""
        self.next = max(self.next, k + 1)

    def ready(self) -> bool:
        return self.next < len(self.parted.views) or (
            self.behind is not None and self.behind.ready())

    def take(self) -> tuple[Any, Any]:
        if self.next < len(self.parted.views):  # (the loop all-reduces it next)
            k, self.next = self.next, self.next + 1
            return self.parted.views[k], self.parted.keys[k]
        assert self.behind is not None  # (ready() said so)
        return self.behind.take()
