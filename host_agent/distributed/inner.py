"""The inner backend for CUDA tensors: what serves the collectives the switch does not (a
broadcast, an all_gather, MAX, ...) when their tensors are on GPUs.

NCCL where every rank has a GPU of its own, as a job of one rank per GPU has (each host runs
at most as many ranks as it has GPUs; two ranks at least); gloo otherwise (several ranks
sharing a GPU, as in tests: NCCL refuses two ranks on one device). HOMAGG_TORCH_CUDA_INNER
(``auto``, the default; ``gloo``; ``nccl``) decides instead. The ranks decide together, from
what each says of itself in one gloo all_gather at start-up (its host, its GPUs, whether this
torch has NCCL, what it was asked), so they cannot take different backends.
"""

from __future__ import annotations

import os
import socket
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from homagg.host_agent.config import AgentError

CHOICES = ("auto", "gloo", "nccl")


def asked() -> str:
    """What HOMAGG_TORCH_CUDA_INNER asks (``auto`` when unset)."""
    want = os.environ.get("HOMAGG_TORCH_CUDA_INNER", "auto").strip().lower() or "auto"
    if want not in CHOICES:
        raise AgentError(f"$HOMAGG_TORCH_CUDA_INNER={want!r}: auto, gloo or nccl")
    return want


def describe_self() -> torch.Tensor:
    """What this rank says of itself: its host, its GPUs, NCCL, what it was asked."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.tensor([zlib.crc32(socket.gethostname().encode()), gpus,
                         int(dist.is_nccl_available()), CHOICES.index(asked())],
                        dtype=torch.int64)


def decide(every: list[torch.Tensor]) -> str:
    """``nccl`` or ``gloo`` from every rank's ``describe_self``, the same on every rank."""
    rows = [tuple(int(v) for v in t) for t in every]
    wants = {CHOICES[r[3]] for r in rows}
    if len(wants) > 1:
        raise AgentError("homagg: the ranks set HOMAGG_TORCH_CUDA_INNER differently "
                         f"({', '.join(sorted(wants))}): every rank must agree")
    want = wants.pop()
    if want == "gloo" or not any(r[1] for r in rows):
        return "gloo"
    without = [rank for rank, r in enumerate(rows) if not r[2]]
    if want == "nccl":
        if without:
            raise AgentError(f"homagg: HOMAGG_TORCH_CUDA_INNER=nccl, but rank(s) {without} "
                             "have no NCCL (a torch built without CUDA?)")
        return "nccl"
    if len(rows) == 1:
        return "gloo"  # one rank: nothing to communicate, and NCCL gains nothing
    per_host: dict[int, list[int]] = {}
    for r in rows:
        per_host.setdefault(r[0], []).append(r[1])
    own_gpu = all(len(gpus) <= min(gpus) for gpus in per_host.values())
    return "nccl" if own_gpu and not without else "gloo"


def agree(gloo: Any, size: int) -> str:
    """``decide`` over every rank's ``describe_self``, through ``gloo`` (a collective)."""
    every = [torch.zeros(4, dtype=torch.int64) for _ in range(size)]
    gloo.allgather([every], [describe_self()]).wait()
    return decide(every)


def nccl_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    """A NCCL group of its own (its communicators are made at its first collective)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("homagg-nccl/", store), rank, size, options)
