"""The events a collective of the "homagg" process group waits on and records: the CUDA
events of the streams that produced its tensors (NCCL's stream promise), and its profiler
event, with its inputs as gloo's has them.
"""

from __future__ import annotations

from typing import Any

import torch

from homagg.host_agent.distributed.switch import CudaStager


def ready_events(*tensors) -> dict[torch.device, Any]:
    """For the CUDA devices of ``tensors`` (tensors, nested in lists as the collectives take
    them): an event on the caller's current stream of each, which the group's thread waits
    for before the collective reads them (the caller's stream produced them)."""
    devices: set[torch.device] = set()
    todo: list[Any] = list(tensors)
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            if x.device.type == "cuda":
                devices.add(x.device)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return {d: CudaStager.ready(d) for d in devices}


def wait_ready(ready: dict[torch.device, Any]) -> None:
    for d, ev in ready.items():
        torch.cuda.current_stream(d).wait_event(ev)


def wait_inner(work: Any, ready: dict[torch.device, Any]) -> None:
    """Wait for an inner backend's work; NCCL may hand back none (seen with one rank, torch
    2.11): then its devices are synchronized, so the result is there either way."""
    if work is not None:
        work.wait()
        return
    for d in ready:
        torch.cuda.synchronize(d)


def tensors_of(x: Any) -> list[torch.Tensor]:
    """The tensors of ``x``, nested in lists as the collectives take them, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in tensors_of(y)]
    return []


def profiler_event(op: str, inputs: Any) -> Any:
    """The profiler event of a collective, ``homagg:<op>``, with its input tensors as gloo's
    have them (their shapes and dtypes, where the profiler records shapes). Entered by the
    caller, exited by the group's thread when the work is done; without the profiler on,
    entering and exiting cost a check each."""
    fast = getattr(torch._C._profiler, "_RecordFunctionFast", None)  # (torch >= 2.2)
    if fast is None:
        return torch.autograd.profiler.record_function(f"homagg:{op}")
    return fast(f"homagg:{op}", tensors_of(inputs))
