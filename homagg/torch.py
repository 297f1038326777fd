"""``import homagg.torch``: registers the torch.distributed backend "homagg" (cpu and cuda).

    import homagg.torch
    dist.init_process_group("homagg")   # or "cpu:homagg"

The backend is ``homagg.host_agent.distributed.backend`` (its doc says what goes through the
switch and what goes to gloo). This module is named ``torch`` inside the package, which shadows
nothing: imports are absolute, so ``import torch`` anywhere (here too) is PyTorch.
"""

from homagg.host_agent.distributed.backend import (
    BACKEND,
    HomaggProcessGroup,
    HomaggWork,
    register,
    set_agent_options,
    set_subgroup_config,
)

register()

__all__ = ["BACKEND", "HomaggProcessGroup", "HomaggWork", "register", "set_agent_options",
           "set_subgroup_config"]
