"""Which backend serves CUDA tensors the switch does not (``distributed.inner``): NCCL where
every rank has a GPU of its own, gloo otherwise, as every rank decides alike."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from homagg.host_agent.config import AgentError  # noqa: E402
from homagg.host_agent.distributed import inner  # noqa: E402


def rank(host, gpus, nccl=1, want="auto"):
    return torch.tensor([host, gpus, nccl, inner.CHOICES.index(want)], dtype=torch.int64)


@pytest.mark.parametrize("ranks,expected", [
    ([rank(1, 4)] * 4, "nccl"),                              # 4 ranks, 4 GPUs
    ([rank(1, 1)] * 4, "gloo"),                              # 4 ranks share one GPU
    ([rank(1, 2)] * 2 + [rank(2, 2)] * 2, "nccl"),           # 2 hosts, a GPU per rank
    ([rank(1, 2)] * 2 + [rank(2, 1)] * 2, "gloo"),           # the second host is short
    ([rank(1, 8)] * 2 + [rank(2, 0)] * 2, "gloo"),           # a host without GPUs
    ([rank(1, 0)] * 4, "gloo"),                              # CPU only
    ([rank(1, 4, nccl=0)] * 4, "gloo"),                      # no NCCL in this torch
    ([rank(1, 1, want="nccl")] * 4, "nccl"),                 # asked: the user's call
    ([rank(1, 4, want="gloo")] * 4, "gloo"),
    ([rank(1, 4)], "gloo"),                                  # one rank: nothing to send
    ([rank(1, 1, want="nccl")], "nccl"),
])
def test_the_ranks_decide_from_what_each_says(ranks, expected):
    assert inner.decide(ranks) == expected


def test_disagreeing_ranks_and_a_missing_nccl_are_errors():
    with pytest.raises(AgentError, match="differently"):
        inner.decide([rank(1, 4), rank(1, 4, want="gloo")])
    with pytest.raises(AgentError, match=r"rank\(s\) \[1\] have no NCCL"):
        inner.decide([rank(1, 4, want="nccl"), rank(1, 4, nccl=0, want="nccl")])


def test_the_variable_is_checked(monkeypatch):
    monkeypatch.setenv("HOMAGG_TORCH_CUDA_INNER", "NCCL")
    assert inner.asked() == "nccl"
    monkeypatch.setenv("HOMAGG_TORCH_CUDA_INNER", "mpi")
    with pytest.raises(AgentError, match=r"\$HOMAGG_TORCH_CUDA_INNER='mpi': auto, gloo or nccl"):
        inner.asked()
    monkeypatch.delenv("HOMAGG_TORCH_CUDA_INNER")
    assert inner.asked() == "auto"
    assert int(inner.describe_self()[1]) == (torch.cuda.device_count()
                                             if torch.cuda.is_available() else 0)


def inner_worker(rank, world, ref):
    import torch.distributed as dist

    return dist.group.WORLD.cuda_inner


def test_a_job_without_a_gpu_per_rank_keeps_gloo(tmp_path):
    from bench.torch_ranks import run_job

    for r in run_job(inner_worker, tmp_path, 27, world=2):
        assert r["out"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
