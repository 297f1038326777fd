"""The Work handle of the "homagg" process group's collectives: ``HomaggWork``, whose future the
group's agent thread completes, and whose ``wait`` re-raises the collective's error (torch's
own future-backed Work loses it).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class HomaggWork(dist.Work):
    """A collective's handle: its future (value: the output tensors) is completed by the
    group's agent thread. ``wait`` raises the collective's error, if any."""

    def __init__(self, fut: torch.futures.Future, ended: torch.futures.Future | None = None):
        super().__init__()
        self._fut = fut
        # ``ended``: completes once the collective's profiler event has ended too (the event's
        # end callback runs on the agent thread after ``fut`` completes). A waiter that went
        # on before it could stop the profiler under that callback: a rank died of SIGSEGV
        # after profiler_stop (torch 2.13), once in about ten runs of the profiler test.
        self._ended = ended
        # What get_future hands out: the same value, and an error as one raised in a callback,
        # which torch keeps as a C++ error (the message, with the original type's name). The
        # original Python exception in a future, reached from DDP's reducer in C++ (no comm
        # hook, no GIL), crashes the process (seen with torch 2.13: SIGSEGV in backward).
        self._public = fut.then(_value)  # (not ended's: it may hold the Python exception)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the collective; raise its error. (``timeout`` is not used: the agent's
        deadline bounds a switch collective, the group's timeout a gloo one.)"""
        try:
            self._fut.wait()  # raises what the agent thread set
        finally:
            if self._ended is not None:
                try:
                    self._ended.wait()
                except Exception:  # noqa: BLE001 - the collective's own error is raised
                    pass
        return True

    def get_future(self) -> torch.futures.Future:
        return self._public

    def is_completed(self) -> bool:
        return self._fut.done() and (self._ended is None or self._ended.done())

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
