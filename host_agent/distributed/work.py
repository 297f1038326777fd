"""The Work handle of the "homagg" process group's collectives: ``HomaggWork``, whose future the
group's agent thread completes, and whose ``wait`` re-raises the collective's error (torch's
own future-backed Work loses it).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from homagg.host_agent.distributed.untraced import untraced


@untraced(dist.Work)
class HomaggWork(dist.Work):
    """A collective's handle: its future (value: the output tensors) is completed by the
    group's agent thread. ``wait`` raises the collective's error, if any."""

    def __init__(self, fut: torch.futures.Future):
        super().__init__()
        self._fut = fut
        # What get_future hands out: the same value, and an error as one raised in a callback,
        # which torch keeps as a C++ error (the message, with the original type's name). The
        # original Python exception in a future, reached from DDP's reducer in C++ (no comm
        # hook, no GIL), crashes the process (seen with torch 2.13: SIGSEGV in backward).
        # (The collective's profiler event ends before ``fut`` completes: a waiter that went
        # on under it could stop the profiler under its end, which killed a rank with SIGSEGV
        # after profiler_stop, torch 2.13.)
        self._public = fut.then(_value)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the collective; raise its error. (``timeout`` is not used: the agent's
        deadline bounds a switch collective, the group's timeout a gloo one.)"""
        self._fut.wait()  # raises what the agent thread set
        return True

    def get_future(self) -> torch.futures.Future:
        return self._public

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001 - that is the answer
            return False
        return True

    def exception(self):
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as err:  # noqa: BLE001
            return err
        return None

    def result(self) -> list[torch.Tensor]:
        return self._fut.value()


def _value(fut: torch.futures.Future) -> list[torch.Tensor]:
    return fut.value()
