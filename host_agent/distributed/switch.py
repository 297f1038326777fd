"""What the "homagg" backend sends through the switch, and how: which tensors and ops the
switch can serve (``switch_refuses`` says why not), one tensor's SUM or AVG through the agent
(floats through the codec, integers exactly, in int32 words or 16-bit limbs; sparse COO tensors
by rows), and ``say_once``, how the backend tells what it sends to gloo instead.

The process group (``group``) calls these from its agent thread; the rules are in
``backend``'s module doc.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings

import numpy as np
import torch
from torch.distributed import ReduceOp

from homagg import wire
from homagg.host_agent.allreduce import Agent
from homagg.host_agent.config import AgentError
from homagg.host_agent.distributed.device import DeviceTensor
from homagg.host_agent.engine.transport import SwitchOverflow

log = logging.getLogger("homagg.torch")

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: Integer dtypes whose sum is exact in one int32 round (widened, then wrapped back).
SMALL_INTS = (torch.int8, torch.int16, torch.uint8)
#: The int32 limbs an integer is split into for an exact sum (16 bits each: a limb's sum
#: stays in int32 for up to 32767 workers).
LIMB_BITS = 16
FLOAT64 = ("float64 all_reduce goes through the switch quantized to the codec's int32 grid "
           "(exact sum of the quantized values, about 31 bits below each block's largest "
           "value, not float64's 53)")

_said: set[str] = set()
_said_lock = threading.Lock()


def say_once(what: str, message: str) -> None:
    """A warning, once per process for each ``what``."""
    with _said_lock:
        if what in _said:
            return
        _said.add(what)
    log.info("%s", message)
    warnings.warn(f"homagg: {message}", RuntimeWarning, stacklevel=3)


def switch_refuses(has_job: bool, tensors, op) -> str | None:
    """Why these tensors cannot go through the switch with ``op`` (None: they can);
    ``has_job``: whether the group has a homagg job (an agent, made or to be)."""
    if not has_job:
        return ("a subgroup has no homagg job of its own (the switch's job table for a "
                "subset of ranks needs the controller service): its collectives go to gloo")
    sum_like = op in (ReduceOp.SUM, ReduceOp.AVG)
    for t in tensors:
        if t.device.type not in ("cpu", "cuda"):
            return f"all_reduce of a {t.device.type} tensor goes to gloo (cpu and cuda only)"
        if not sum_like:
            return (f"all_reduce {_op_name(op)} goes to gloo: the switch only adds (SUM "
                    "and AVG go through it)")
        if t.is_sparse:
            if t.dtype not in FLOATS:
                return f"sparse all_reduce of {t.dtype} goes to gloo: floats only"
            continue
        if t.layout != torch.strided:
            return f"all_reduce of a {t.layout} tensor goes to gloo"
        if t.dtype in FLOATS:
            continue
        if op == ReduceOp.AVG:
            return (f"all_reduce AVG of {t.dtype} goes to gloo: an integer mean is not "
                    "an integer (gloo's answer, or its error, is gloo's)")
        if t.dtype in SMALL_INTS or t.dtype in (torch.int32, torch.int64):
            continue
        return (f"all_reduce SUM of {t.dtype} goes to gloo: the switch sums int32 words "
                "(floats through the codec, int8/16/32/64 and uint8 exactly)")
    return None


def switch_allreduce(agent: Agent, t: torch.Tensor, op) -> None:
    """One tensor's SUM or AVG through the switch, in place (the agent's thread)."""
    if t.numel() == 0:
        return
    if t.is_sparse:
        t.copy_(sparse_allreduce(agent, t, op))
        return
    src = t.detach().contiguous()
    key = ("torch", str(t.dtype), t.numel())
    if t.dtype in FLOATS:
        if t.dtype == torch.float64:
            say_once("float64", FLOAT64)
        if t.dtype == torch.float32 and op == ReduceOp.SUM:  # the hook's path
            arr = src.numpy().reshape(-1)
            if t.is_contiguous():  # src is t: the sum written over it, as gloo does
                agent.allreduce(arr, key=key, out=arr)
                return
            out = agent.allreduce(arr, key=key)
            t.copy_(torch.from_numpy(out).view(t.shape))
            return
        x = src.to(torch.float64).numpy().reshape(-1)  # exact for every float dtype
        s = agent.allreduce(x, key=key)  # float64: exact (int sums times 2**-shift)
        if op == ReduceOp.AVG:
            s = s / agent.cfg.workers
        t.copy_(torch.from_numpy(s).view(t.shape))  # rounded once to t's dtype
        return
    if t.dtype in SMALL_INTS:
        q = src.to(torch.int32).numpy().reshape(-1)
        s = agent.allreduce_int(q)
        t.copy_(torch.from_numpy(s.astype(_np_dtype(t.dtype))).view(t.shape))  # wraps
        return
    x64 = src.numpy().reshape(-1).astype(np.int64)
    if t.dtype == torch.int32:
        try:
            s = agent.transport.stream(wire.OP_ADD, x64.astype(np.int32))
        except SwitchOverflow:  # every rank sees the flag: all take the limbs
            s = _limb_sum(agent, x64, 2).astype(np.int32)
        t.copy_(torch.from_numpy(np.ascontiguousarray(s, np.int32)).view(t.shape))
        return
    t.copy_(torch.from_numpy(_limb_sum(agent, x64, 4)).view(t.shape))


class CudaStager:
    """CUDA tensors through the switch. A float tensor stays on its GPU: the codec's
    per-element work runs there (``device.DeviceTensor``) and only the words cross PCIe
    (``HOMAGG_CUDA_CODEC=host`` stages it whole and runs the CPU codec instead). Integer
    tensors are staged through a reused pinned host buffer and summed by the CPU path
    (``switch_allreduce``). Either way the same integers as a CPU tensor's, bit for bit.
    The work runs on a side stream of the tensor's device, after the producing stream's
    event; the group's thread then holds that stream as its current one, so the
    collective's CUDA-aware future records its completion there."""

    #: pinned buffers kept (DDP's buckets repeat a few sizes); the oldest goes past it
    KEEP = 32

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._pinned: dict[tuple, torch.Tensor] = {}
        self.codec = codec_place()

    @staticmethod
    def ready(device: torch.device) -> torch.cuda.Event:
        """An event on the caller's current stream of ``device`` (what produced the tensor)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return ev

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.dtype, t.numel())
        buf = self._pinned.pop(key, None)
        if buf is None:
            buf = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
            if len(self._pinned) >= self.KEEP:
                del self._pinned[next(iter(self._pinned))]
        self._pinned[key] = buf  # (the most recent last)
        return buf

    def allreduce(self, agent: Agent, t: torch.Tensor, op, ready: torch.cuda.Event) -> None:
        if t.is_sparse:
            t.copy_(sparse_allreduce(agent, t.cpu(), op).to(t.device))
            return
        side = self._streams.get(t.device)
        if side is None:
            side = self._streams[t.device] = torch.cuda.Stream(t.device)
        torch.cuda.set_stream(side)  # (this thread's: the future records its event here)
        side.wait_event(ready)
        if t.dtype in FLOATS and self.codec == "device":
            device_allreduce(agent, t, op)
            return
        host = self._buffer(t)
        host.copy_(t.detach().reshape(-1), non_blocking=True)
        side.synchronize()  # the values are on the host
        switch_allreduce(agent, host, op)
        t.detach().copy_(host.view(t.shape), non_blocking=True)


def codec_place() -> str:
    """Where a CUDA float tensor's codec runs: HOMAGG_CUDA_CODEC, ``device`` (default: on
    the GPU) or ``host`` (the tensor staged whole, the CPU codec)."""
    place = os.environ.get("HOMAGG_CUDA_CODEC", "device").strip().lower() or "device"
    if place not in ("device", "host"):
        raise AgentError(f"$HOMAGG_CUDA_CODEC={place!r}: device or host")
    return place


def device_allreduce(agent: Agent, t: torch.Tensor, op) -> None:
    """A float tensor's SUM or AVG with the codec on its own device (``DeviceTensor``), in
    place: the same words and sums as ``switch_allreduce`` of the same values on the CPU."""
    if t.numel() == 0:
        return
    if t.dtype == torch.float64:
        say_once("float64", FLOAT64)
    key = ("torch", str(t.dtype), t.numel())  # the CPU path's: a mixed job remembers alike
    sum32 = t.dtype == torch.float32 and op == ReduceOp.SUM
    res = agent.allreduce_detailed(DeviceTensor(t, torch.float32 if sum32 else torch.float64),
                                   key)
    out: torch.Tensor = res.out  # type: ignore[assignment]  # (a DeviceTensor's: a tensor)
    if op == ReduceOp.AVG:
        out = out / agent.cfg.workers
    t.detach().copy_(out.view(t.shape))  # rounded once to t's dtype


def sparse_allreduce(agent: Agent, t: torch.Tensor, op) -> torch.Tensor:
    """A sparse COO tensor's SUM or AVG: ``Agent.allreduce_rows``, as the DDP hook does."""
    g = t.detach().coalesce()
    sparse_shape = tuple(g.shape[:g.sparse_dim()])
    n_rows = int(np.prod(sparse_shape, dtype=np.int64))
    idx = g.indices().numpy()
    rows = (np.ravel_multi_index(tuple(idx), sparse_shape) if idx.size
            else np.zeros(0, np.int64))
    values = g.values().to(torch.float64).numpy()
    r = agent.allreduce_rows(n_rows, rows, values, key=("torch-sparse", g.shape))
    indices = torch.from_numpy(np.stack(np.unravel_index(r.rows, sparse_shape))
                               if r.rows.size
                               else np.zeros((len(sparse_shape), 0), np.int64))
    vals = r.values / agent.cfg.workers if op == ReduceOp.AVG else r.values
    return torch.sparse_coo_tensor(indices, torch.from_numpy(np.ascontiguousarray(vals))
                                   .to(t.dtype), g.shape).coalesce()


def _op_name(op) -> str:
    return str(op).rsplit(".", 1)[-1]


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def _limb_sum(agent: Agent, x: np.ndarray, limbs: int) -> np.ndarray:
    """The exact sum over workers of int64 ``x``, modulo 2**64 (gloo's wrapping), from
    ``limbs`` int32 sums of 16-bit limbs (the top one signed) in one round."""
    n = x.size
    parts = np.empty((limbs, n), np.int32)
    u = x.view(np.uint64)
    for k in range(limbs - 1):
        parts[k] = ((u >> np.uint64(LIMB_BITS * k)) & np.uint64(0xFFFF)).astype(np.int32)
    parts[limbs - 1] = (x >> np.int64(LIMB_BITS * (limbs - 1))).astype(np.int32)
    if limbs < 4 and np.any(parts[limbs - 1] != x >> np.int64(LIMB_BITS * (limbs - 1))):
        raise AgentError(f"{agent.cfg.who}: a value does not fit {limbs} limbs")
    sums = agent.allreduce_int(parts.reshape(-1)).reshape(limbs, n)
    total = np.zeros(n, np.uint64)
    for k in range(limbs):  # in uint64: wraps modulo 2**64, as gloo's int64 sum does
        total += sums[k].astype(np.int64).view(np.uint64) << np.uint64(LIMB_BITS * k)
    return total.view(np.int64)
