"""PyTorch DDP communication hook: gradient buckets all-reduced through homagg.

    from homagg.host_agent import Agent, AgentConfig
    from homagg.host_agent.torch_hook import homagg_hook
    agent = Agent(AgentConfig(job=1, worker=rank, workers=world, ...))
    ddp_model.register_comm_hook(state=agent, hook=homagg_hook)

That is all a user adds: no patched PyTorch. The hook returns the *mean* over workers, as DDP's
default all-reduce does; the sum behind it is exact on the quantized gradients. A NaN or Inf in
any worker's bucket makes the whole bucket NaN on every worker (``Agent.allreduce``), so AMP's
``GradScaler`` sees it on every rank and skips the step, as with DDP's own all-reduce.

An error names the parameter and the element within it, not a bucket offset: pass
``HookState(agent, names)`` as the state (``HookState.of(agent, model)`` takes the names from
``model.named_parameters()``) to have names; with the bare agent as the state, a parameter is
named by its place in ``bucket.parameters()`` and its shape. torch is an optional dependency
(the CPU build is enough); only this module imports it. (No ``from __future__ import
annotations`` here: DDP checks the hook's annotations as objects.)
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from homagg.host_agent.allreduce import Agent
from homagg.host_agent.config import AgentError


@dataclass
class HookState:
    """The hook's state: the agent, and parameter names by ``id(parameter)``."""

    agent: Agent
    names: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, agent: Agent, model: torch.nn.Module) -> "HookState":
        return cls(agent, {id(p): name for name, p in model.named_parameters()})


def locate(bucket, index: int, names: dict[int, str] | None = None) -> str:
    """Which parameter element the bucket's flat ``index`` is: "parameter NAME (#k of bucket
    B, shape S), index j" (j: the flat index within the parameter)."""
    start = 0
    for k, p in enumerate(bucket.parameters()):
        if index < start + p.numel():
            name = (names or {}).get(id(p), f"#{k}")
            where = f"parameter {name} (#{k} of bucket {bucket.index()}, shape "
            return f"{where}{tuple(p.shape)}), index {index - start}"
        start += p.numel()
    return f"bucket {bucket.index()} offset {index}"


def homagg_hook(state: Agent | HookState, bucket: torch.distributed.GradBucket
                ) -> torch.futures.Future[torch.Tensor]:
    agent, names = ((state.agent, state.names) if isinstance(state, HookState)
                    else (state, None))
    buf = bucket.buffer()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if buf.is_sparse:  # DDP gives a sparse gradient a bucket of its own
        fut.set_result(_sparse_mean(agent, bucket, buf, names))
        return fut
    arr = buf.detach().to("cpu", torch.float32).numpy()
    try:
        summed = agent.allreduce(np.ascontiguousarray(arr).reshape(-1),
                                 key=("ddp", bucket.index()))
    except AgentError as err:
        raise _named(err, bucket, names) from err
    out = torch.from_numpy(summed).to(buf.device, buf.dtype).div_(agent.cfg.workers)
    fut.set_result(out.reshape(buf.shape))
    return fut


def _sparse_mean(agent: Agent, bucket, grad: torch.Tensor, names) -> torch.Tensor:
    """The mean of a sparse COO gradient (``nn.Embedding(sparse=True)``, ``EmbeddingBag``),
    sparse again: its rows (the sparse dimensions, flattened) go through
    ``Agent.allreduce_rows``, so only the rows some worker touched are ever dense."""
    g = grad.detach().coalesce().to("cpu")
    sparse_shape = tuple(g.shape[:g.sparse_dim()])
    n_rows = int(np.prod(sparse_shape, dtype=np.int64))
    idx = g.indices().numpy()
    rows = np.ravel_multi_index(tuple(idx), sparse_shape) if idx.size else np.zeros(0, np.int64)
    values = g.values().to(torch.float32).numpy()
    try:
        r = agent.allreduce_rows(n_rows, rows, values, key=("ddp", bucket.index()))
    except AgentError as err:  # its index is already the parameter's flat index
        raise _named(err, bucket, names) from err
    indices = torch.from_numpy(np.stack(np.unravel_index(r.rows, sparse_shape))
                               if r.rows.size else np.zeros((len(sparse_shape), 0), np.int64))
    out = torch.from_numpy(np.ascontiguousarray(r.values)).to(grad.dtype)
    return torch.sparse_coo_tensor(indices, out.div_(agent.cfg.workers), g.shape,
                                   device=grad.device).coalesce()


def _named(err: AgentError, bucket, names) -> AgentError:
    """``err`` with its bucket offset named as a parameter and an index within it."""
    index = getattr(err, "index", None)
    if index is None:
        return err
    msg = str(err).replace(f"at index {index}", f"at bucket offset {index}", 1)
    named = AgentError(f"{msg} [{locate(bucket, index, names)}]")
    named.index = index  # type: ignore[attr-defined]
    return named
