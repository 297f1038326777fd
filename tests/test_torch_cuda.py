"""CUDA tensors through the switch on the ``homagg`` backend (floats with the codec on the
GPU, integers staged through pinned host memory): the same integers as CPU tensors', bit for
bit; the collective waits for the stream
that produced its tensor, and the result is there for the stream that waits on its work; DDP
on CUDA through the switch tracks gloo; the inner backend for CUDA tensors is NCCL when asked
(one rank here) and gloo for ranks sharing a GPU. Marked ``cuda``: they skip without a GPU, and
``bench/gpu_check.py`` runs them where one is lent.
"""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU")]

import torch.distributed as dist  # noqa: E402
from torch.distributed import ReduceOp  # noqa: E402

from bench.torch_ranks import loss_of, make_model, run_job  # noqa: E402


def _inputs(rank: int):
    g = torch.Generator().manual_seed(rank)
    f = torch.randn(5000, generator=g) * torch.logspace(-3, 3, 5000)
    return {"f32": f, "bf16": f.to(torch.bfloat16), "f64": f.double(),
            "i64": torch.randint(-2**40, 2**40, (777,), generator=g, dtype=torch.int64)}


def same_as_cpu_worker(rank, world, ref):
    out = {}
    for name, x in _inputs(rank).items():
        for op in ((ReduceOp.SUM, ReduceOp.AVG) if x.is_floating_point() else (ReduceOp.SUM,)):
            cpu, gpu = x.clone(), x.cuda()
            dist.all_reduce(cpu, op=op)
            dist.all_reduce(gpu, op=op)
            out[f"{name} {op}"] = (cpu, gpu.cpu())
    return {"pairs": out, "counts": dict(dist.group.WORLD.counts)}


def test_cuda_tensors_sum_to_the_cpu_paths_integers_bit_for_bit(tmp_path):
    ranks = run_job(same_as_cpu_worker, tmp_path, 21)
    for r in ranks:
        for key, (cpu, gpu) in r["out"]["pairs"].items():
            assert gpu.dtype == cpu.dtype and torch.equal(gpu, cpu), key
        assert r["out"]["counts"].get("switch:allreduce cuda", 0) == 7
    for key in ranks[0]["out"]["pairs"]:
        assert torch.equal(ranks[0]["out"]["pairs"][key][1], ranks[1]["out"]["pairs"][key][1])


def streams_worker(rank, world, ref):
    """A tensor written on a side stream after a long sleep, then all-reduced from that stream
    (async): the collective must read it after the write; the result, once the work is
    waited on, is read on another stream."""
    dev = torch.device("cuda", 0)
    side, other = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    out = []
    for it in range(3):
        x = torch.zeros(100_000, device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))  # (x's zeros first)
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write
            x.fill_(float(rank + 1 + it))
            work = dist.all_reduce(x, async_op=True)
        with torch.cuda.stream(other):
            work.wait()
            y = x * 1  # on `other`, after the work
        torch.cuda.synchronize()
        out.append((float(y.min()), float(y.max())))
        # a collective gloo serves (broadcast): the same two promises
        z = torch.zeros(100_000, device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            z.fill_(float(rank + 7 + it))
            work = dist.broadcast(z, src=1, async_op=True)
        with torch.cuda.stream(other):
            work.wait()
            zz = z * 1
        torch.cuda.synchronize()
        out.append((float(zz.min()), float(zz.max())))
    return out


def test_the_collective_waits_for_its_stream_and_its_work_for_the_collective(tmp_path):
    ranks = run_job(streams_worker, tmp_path, 22)
    for r in ranks:
        want = []
        for it in range(3):
            want += [(3.0 + 2 * it, 3.0 + 2 * it), (8.0 + it, 8.0 + it)]
        assert r["out"] == want


def ddp_cuda_worker(rank, world, ref, steps):
    pg = dist.group.WORLD
    out = {}
    for which, group in (("homagg", None), ("gloo", ref)):
        before = Counter(pg.counts)
        model = make_model().cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0],
                                                        process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        losses = []
        for step in range(steps):
            opt.zero_grad()
            idx_loss = loss_of(_OnDevice(ddp), rank, step)
            idx_loss.backward()
            opt.step()
            losses.append(idx_loss.item())
        out[which] = (losses, [p.detach().cpu() for p in model.parameters()],
                      dict(Counter(pg.counts) - before))
    return out


class _OnDevice(torch.nn.Module):
    """The test model's batches (CPU tensors) moved to the GPU on the way in."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        return self.inner(idx.cuda()).cpu()


def test_ddp_on_cuda_goes_through_the_switch_and_tracks_gloo(tmp_path):
    steps = 4
    ranks = run_job(ddp_cuda_worker, tmp_path, 23, steps)
    for r in ranks:
        losses, params, served = r["out"]["homagg"]
        ref_losses, _, _ = r["out"]["gloo"]
        assert served.get("switch:allreduce cuda", 0) >= steps, served
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6, (losses, ref_losses)
    for p0, p1 in zip(ranks[0]["out"]["homagg"][1], ranks[1]["out"]["homagg"][1]):
        assert torch.equal(p0, p1)


def scatter_worker(rank, world, ref):
    """reduce_scatter_tensor through the switch (HOMAGG_TORCH_REDUCE_SCATTER=switch): a CUDA
    input gives the CPU input's part, bit for bit."""
    x = _inputs(rank)["f32"][:4000]
    cpu_out, gpu_out = torch.empty(2000), torch.empty(2000, device="cuda")
    dist.reduce_scatter_tensor(cpu_out, x.clone())
    dist.reduce_scatter_tensor(gpu_out, x.cuda())
    return {"cpu": cpu_out, "gpu": gpu_out.cpu(), "counts": dict(dist.group.WORLD.counts)}


def test_a_cuda_reduce_scatter_through_the_switch_is_the_cpu_ones(tmp_path):
    ranks = run_job(scatter_worker, tmp_path, 24, env={"HOMAGG_TORCH_REDUCE_SCATTER": "switch"})
    for r in ranks:
        assert torch.equal(r["out"]["gpu"], r["out"]["cpu"])
        assert r["out"]["counts"].get("switch:reduce_scatter", 0) == 2


def own_gpu_worker(rank, world, ref):
    """One rank, one GPU: the collectives the switch does not serve take NCCL."""
    pg = dist.group.WORLD
    x = torch.arange(1000.0, device="cuda")
    dist.broadcast(x, src=0)
    gathered = [torch.zeros(1000, device="cuda") for _ in range(world)]
    dist.all_gather(gathered, x)
    m = torch.full((10,), 3.0, device="cuda")
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    s = torch.linspace(-1, 1, 5000, device="cuda")
    c = s.cpu()
    dist.all_reduce(s)  # SUM: through the switch
    dist.all_reduce(c)  # the CPU path: the same sum, bit for bit
    torch.cuda.synchronize()
    return {"inner": pg.cuda_inner, "counts": dict(pg.counts), "gathered": gathered[-1].cpu(),
            "max": m.cpu(), "sum": s.cpu(), "cpu sum": c}


def test_nccl_serves_what_the_switch_does_not_when_asked(tmp_path):
    """One rank (auto keeps gloo for one rank: nothing to communicate), NCCL asked: the
    collectives gloo would serve go to a NCCL group of the backend's own, with the right
    results. (Two ranks of NCCL need two GPUs.)"""
    ranks = run_job(own_gpu_worker, tmp_path, 25, world=1,
                    env={"HOMAGG_TORCH_CUDA_INNER": "nccl"})
    out = ranks[0]["out"]
    assert out["inner"] == "nccl"
    assert out["counts"].get("nccl:broadcast") == 1 and out["counts"].get("nccl:allgather") == 1
    assert out["counts"].get("nccl:allreduce") == 1  # MAX
    assert out["counts"].get("switch:allreduce cuda") == 1
    assert torch.equal(out["gathered"], torch.arange(1000.0))
    assert torch.equal(out["max"], torch.full((10,), 3.0))
    assert torch.equal(out["sum"], out["cpu sum"])
    assert out["counts"].get("switch:allreduce") == 2


def test_ranks_sharing_a_gpu_keep_gloo(tmp_path):
    ranks = run_job(own_gpu_worker, tmp_path, 26)  # 4 ranks on one GPU: NCCL would refuse
    for r in ranks:
        assert r["out"]["inner"] == "gloo"
        assert r["out"]["counts"].get("gloo:broadcast") == 1
