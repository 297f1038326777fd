"""homagg in torch.distributed: the "homagg" process group and the DDP communication hook.

- ``backend``: registers the backend and configures its agents (``import homagg.torch`` does
  it); its module doc says what goes through the switch and what goes to the inner backend;
- ``group``: the process group (its agent thread, its gloo fallbacks); ``startup``: what its
  ranks tell each other as it starts;
- ``switch``: what goes through the switch, and how (CPU tensors, and CUDA tensors staged
  through pinned host memory);
- ``work``: the Work handle;
- ``hook``: the DDP communication hook, for a plain agent without the backend.

Every module here imports torch; this package's ``__init__`` does not, so that the rest of
homagg runs without it. The modules were ``homagg.host_agent.torch_backend``,
``torch_group``, ``torch_switch``, ``torch_work`` and ``torch_hook``: those names still import
(the same module objects), with a DeprecationWarning, until the next release.
"""
