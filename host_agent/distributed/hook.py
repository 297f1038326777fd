"""PyTorch DDP communication hook: gradient buckets all-reduced through homagg.

    from homagg.host_agent import Agent, AgentConfig
    from homagg.host_agent.distributed.hook import HookState, homagg_hook
    agent = Agent(AgentConfig(job=1, worker=rank, workers=world, ...))
    ddp_model.register_comm_hook(state=HookState.of(agent, model), hook=homagg_hook)

That is all a user adds: no patched PyTorch. The hook returns the *mean* over workers, as DDP's
default all-reduce does; the sum behind it is exact on the quantized gradients. A NaN or Inf in
any worker's bucket makes the whole bucket NaN on every worker (``Agent.allreduce``; a bucket
longer than ``AgentConfig.part`` goes in parts, ``host_agent.parts``: the whole part), so
AMP's ``GradScaler`` sees it on every rank and skips the step, as with DDP's own all-reduce.

The state is a ``HookState``: ``HookState.of(agent, model)`` overlaps (the agent's own thread
sums a bucket while autograd computes the next) and names a parameter and the element within
it in errors (from ``model.named_parameters()``), not a bucket offset. ``HookState(agent,
overlap=False)`` blocks in the hook, and names a parameter by its place in
``bucket.parameters()`` and its shape.
Sparse COO gradients (``sparse=True`` embeddings) go through ``Agent.allreduce_rows`` and come
back sparse. torch is an optional dependency
(the CPU build is enough); only this subpackage (``backend``: the "homagg" process group, no
hook needed) and ``homagg.torch`` import it. (No ``from __future__ import
annotations`` here: DDP checks the hook's annotations as objects.)
"""

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from homagg.host_agent.allreduce import Agent
from homagg.host_agent.config import AgentError
from homagg.host_agent.distributed.serial import Behind, Serial
from homagg.host_agent.parts import Parted


@dataclass
class HookState:
    """The hook's state: the agent, parameter names by ``id(parameter)``, and whether the
    all-reduce overlaps the backward pass.

    With ``overlap`` (the default), the hook hands the bucket to the agent's own thread (one
    thread, first in first out) and returns at once a future that thread completes, as
    torch's built-in hooks do with their process group: autograd computes the next buckets'
    gradients while this one is on the wire. DDP calls the hook in bucket order on every rank
    (its reducer launches buckets in index order), so one FIFO thread keeps every worker's
    agent on the same tensor sequence. An error in that thread reaches DDP through the future
    (``set_exception``): it is raised where the gradients are waited for, never a hang.

    ``pipeline`` (with ``overlap``, the default): a bucket already queued behind this one has
    its round 1 ride with this one's values, where every worker has its next one queued too
    (``host_agent.pipeline``); the sums are the same, bit for bit.
    """

    agent: Agent
    names: dict[int, str] = field(default_factory=dict)
    overlap: bool = True
    pipeline: bool = True
    _thread: Serial | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def of(cls, agent: Agent, model: torch.nn.Module, overlap: bool = True,
           pipeline: bool = True) -> "HookState":
        return cls(agent, {id(p): name for name, p in model.named_parameters()}, overlap,
                   pipeline)

    def submit(self, work) -> None:
        """``work``: a callable, or a bucket (``_Bucket``) the agent's thread pipelines."""
        with self._lock:
            if self._thread is None:
                self._thread = Serial("homagg-agent", pipeline=self.pipeline)
            self._thread.submit(work)

    def close(self) -> None:
        """Wait for the buckets in flight, stop the thread (the agent stays open)."""
        with self._lock:
            if self._thread is not None:
                self._thread.shutdown(wait=True)
                self._thread = None


class _Bucket:
    """A bucket the agent's thread all-reduces (``serial.Offering``): its host array and its
    parts, made once (a pipelined bucket's first part has its round 1 go before its turn, and
    its turn must pass the same array), and the future DDP waits on."""

    def __init__(self, state: HookState, bucket, fut):
        self.state, self.bucket, self.fut = state, bucket, fut
        self.buf = bucket.buffer()
        self.arr: np.ndarray | None = None
        self.in_place = False
        self._parted: Parted | None = None

    def host(self) -> tuple[np.ndarray, bool]:
        """``_host`` of a dense bucket's buffer, made once."""
        if self.arr is None:
            self.arr, self.in_place = _host(self.buf)
        return self.arr, self.in_place

    def parted(self) -> Parted:
        """The dense bucket's host array in parts (``host_agent.parts``), made once."""
        if self._parted is None:
            self._parted = _parts(self.state.agent, self.bucket, self.host()[0])
        return self._parted

    def offer(self):
        """A dense bucket's first part and its key (a sparse one goes its own way: None)."""
        return None if self.buf.is_sparse else self.parted().first()

    def run(self, behind: Behind | None) -> None:
        state = self.state
        try:
            self.fut.set_result(_mean(state.agent, self.bucket, state.names, self, behind))
        except BaseException as err:  # noqa: BLE001 - DDP raises it where it waits
            self.fut.set_exception(err)


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


def homagg_hook(state: HookState, bucket: torch.distributed.GradBucket
                ) -> torch.futures.Future[torch.Tensor]:
    if not isinstance(state, HookState):  # register_comm_hook takes any state: say what fits
        raise TypeError(f"homagg_hook's state is a HookState, not {type(state).__name__}: "
                        "HookState.of(agent, model), or HookState(agent, overlap=False)")
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if state.overlap:
        state.submit(_Bucket(state, bucket, fut))  # DDP keeps the buffer until it completes
        return fut
    fut.set_result(_mean(state.agent, bucket, state.names))
    return fut


def _host(buf: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A dense bucket as a flat float32 host array, and whether it is the bucket's own
    memory (a contiguous float32 CPU buffer: the sum is written over it)."""
    in_place = buf.device.type == "cpu" and buf.dtype == torch.float32 and buf.is_contiguous()
    arr = np.ascontiguousarray(buf.detach().to("cpu", torch.float32).numpy()).reshape(-1)
    return arr, in_place


def _mean(agent: Agent, bucket, names, item: _Bucket | None = None,
          behind: Behind | None = None) -> torch.Tensor:
    """The bucket's mean over the workers (dense, or sparse for a sparse bucket). ``item``:
    the hook thread's record of it (its host array, made once); ``behind``: the buckets
    queued behind it, its pipeline."""
    buf = bucket.buffer() if item is None else item.buf
    if buf.is_sparse:  # DDP gives a sparse gradient a bucket of its own
        return _sparse_mean(agent, bucket, buf, names)
    arr, in_place = _host(buf) if item is None else item.host()
    parted = _parts(agent, bucket, arr) if item is None else item.parted()
    try:  # a CPU bucket's sum is written over its buffer, as gloo's all-reduce does; a long
        # bucket part by part (the memory of one part: host_agent.parts)
        parted.allreduce(agent, behind, pipelined=behind is not None)
    except AgentError as err:
        raise _named(err, bucket, names) from err
    if in_place:
        return buf.div_(agent.cfg.workers)
    out = torch.from_numpy(arr).to(buf.device, buf.dtype).div_(agent.cfg.workers)
    return out.reshape(buf.shape)


def _parts(agent: Agent, bucket, arr: np.ndarray) -> Parted:
    return Parted(arr, ("ddp", bucket.index()), agent.cfg.part)



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
