"""``import homagg.torch``: registers the torch.distributed backend "homagg" (cpu and cuda).

    import homagg.torch
    dist.init_process_group("homagg")   # or "cpu:homagg"

The backend is ``homagg.host_agent.distributed.backend`` (its doc says what goes through the
switch and what goes to gloo). This module is named ``torch`` inside the package, which shadows
nothing: imports are absolute, so ``import torch`` anywhere (here too) is PyTorch.

``hook_agent()`` is the DDP hook's agent for this rank, its host reducing locally where that
applies (``homagg.host_agent.distributed.hosts``).

``init_process_group()`` is the one line where a framework would otherwise pick the backend
itself (the Hugging Face Trainer on the CPU: docs/frameworks.md).
"""

from typing import Any

from homagg.host_agent.distributed.backend import (
    BACKEND,
    HomaggProcessGroup,
    HomaggWork,
    register,
    set_agent_options,
    set_subgroup_config,
)
from homagg.host_agent.distributed.hosts import hook_agent

register()


def init_process_group(**kwargs: Any) -> None:
    """``dist.init_process_group("homagg", **kwargs)`` unless a default group exists already
    (then nothing: a second call is harmless, so a script can call it before a framework that
    would initialize one of its own). Under torchrun, no argument is needed."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(BACKEND, **kwargs)


__all__ = ["BACKEND", "HomaggProcessGroup", "HomaggWork", "hook_agent", "init_process_group",
           "register", "set_agent_options", "set_subgroup_config"]
