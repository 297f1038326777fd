"""The GPU check, for a session lent a GPU: ``python -m bench.gpu_check [--out FILE]``.

One script, a few minutes: (1) the ``cuda`` tests (tests/test_torch_cuda.py, and the device
codec's table on the GPU against the numpy codec, bit for bit: tests/test_device_codec.py);
(2) 4 ranks on one GPU training CUDA models (the tests' embedding model, and a transformer
encoder block) with DDP on the ``homagg`` backend and on gloo, in one run: ranks identical,
losses within 1e-6, the gradients' all-reduces through the switch, and local reduction (two
torchrun nodes of 2 ranks, CUDA tensors: at most 0.6x a worker per rank's packets at the
switch, every rank's parameters the same bit for bit either way); (3) throughput, each
against a baseline measured in the same run: one worker's encode+decode of a bucket at 1%
density (round 1's words, the value words and the decode, with the words' trips over PCIe;
a job of one agent in memory) by the GPU codec and by the CPU codec, against a
device-to-device copy of the same bytes; where a call's time goes (each of the GPU codec's
steps, the agent's host work, the GPU's own kernel time); a profile of the GPU codec's
kernels; and the all-reduce of a CUDA bucket on ``homagg`` (the GPU codec, and the tensor
staged to the CPU codec: ``HOMAGG_CUDA_CODEC=host``) and on gloo, 2 ranks. Prints its figures
and writes them as JSON (default ``bench/out/gpu_check.json``). ``--only throughput``: the
codec's figures of (3) alone, in about a minute.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUCKET = 4 * 1024 * 1024  # float32 elements (16 MiB), DDP's default bucket is 25 MiB
DENSITY = 0.01


def _sparse_bucket(torch, rank: int, n: int = BUCKET, density: float = DENSITY):
    g = torch.Generator().manual_seed(rank)
    if density >= 1:
        return torch.randn(n, generator=g)
    x = torch.zeros(n)
    idx = torch.randperm(n, generator=g)[: int(n * density)]
    x[idx] = torch.randn(idx.numel(), generator=g)
    return x


def train_worker(rank, world, ref, steps, which_model):
    import torch
    import torch.distributed as dist

    from bench.torch_ranks import batch, make_model

    pg = dist.group.WORLD
    out = {}
    for which, group in (("homagg", None), ("gloo", ref)):
        before = Counter(pg.counts)
        torch.manual_seed(0)
        if which_model == "embedding":
            model = make_model().cuda()
        else:
            model = torch.nn.Sequential(
                torch.nn.Embedding(300, 64),
                torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True),
                torch.nn.Flatten(), torch.nn.Linear(4 * 64, 1)).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0],
                                                        process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            idx, y = batch(rank, step)
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(ddp(idx.cuda()),
                                                                        y.cuda())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        c = pg.agent.counters
        out[which] = {"losses": losses, "params": [p.detach().cpu() for p in model.parameters()],
                      "served": dict(Counter(pg.counts) - before), "packets": c.packets_sent}
    return out


def fsdp_worker(rank, world, ref, steps):
    """FSDP2 (fully_shard on a 1-D CUDA mesh) on the homagg backend: the tests' embedding
    model, its gradients' reduce_scatter through the switch (HOMAGG_TORCH_REDUCE_SCATTER)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bench.torch_ranks import batch, make_model

    pg = dist.group.WORLD
    model = make_model().cuda()
    fully_shard(model, mesh=init_device_mesh("cuda", (world,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        idx, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(idx.cuda()), y.cuda())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "counts": dict(pg.counts)}


def allreduce_worker(rank, world, ref, reps):
    import torch
    import torch.distributed as dist

    x0 = _sparse_bucket(torch, rank).cuda()
    out = {}
    for which, group in (("homagg", None), ("gloo", ref)):
        x = x0.clone()
        dist.all_reduce(x, group=group)  # warm-up (join, kernels, buffers)
        torch.cuda.synchronize()
        dist.barrier(group=ref)
        t0 = time.perf_counter()
        for _ in range(reps):
            x.copy_(x0)
            dist.all_reduce(x, group=group)
        torch.cuda.synchronize()
        out[which] = (time.perf_counter() - t0) / reps
    return out


def _timed(torch, fn, reps: int) -> float:
    """Seconds per call of ``fn`` (GPU work included), after warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def _codec_seconds(torch, x, reps: int) -> float:
    """One worker's encode+decode of ``x`` per call (cuda: the GPU codec; cpu: numpy): a
    job of one agent in memory, so the switch hands back its own words."""
    from homagg.host_agent.distributed.device import DeviceTensor
    from homagg.host_agent.simulate import MemoryJob

    agent = MemoryJob(1, mode="auto").agents[0]
    if x.is_cuda:
        return _timed(torch, lambda: agent.allreduce_detailed(DeviceTensor(x), "k"), reps)
    flat = x.numpy()
    return _timed(torch, lambda: agent.allreduce_detailed(flat, "k"), reps)


def _phases(torch, x, reps: int) -> dict:
    """Where one worker's encode+decode call spends its time (ms a call): each of the GPU
    codec's steps (``DeviceTensor``'s methods, the device synchronized at both ends), the
    rest (the agent's rounds and index work on the host, and the in-memory switch), and the
    GPU's own kernel time (the profiler's CUDA total)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from homagg.host_agent.distributed import device
    from homagg.host_agent.simulate import MemoryJob

    spent: dict[str, float] = {}

    class Timed(device.DeviceTensor):
        pass

    def timed(name):
        f = getattr(device.DeviceTensor, name)

        def step(self, *a, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return f(self, *a, **k)
            finally:
                torch.cuda.synchronize()
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return step

    for name in ("round1", "element_words", "value_words", "residual_words", "decode"):
        setattr(Timed, name, timed(name))
    agent = MemoryJob(1, mode="auto").agents[0]
    for _ in range(3):
        agent.allreduce_detailed(Timed(x), "k")
    spent.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        agent.allreduce_detailed(Timed(x), "k")
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    out = {k: round(1e3 * v / reps, 3) for k, v in spent.items()}
    out["host rounds and switch"] = round(1e3 * (total - sum(spent.values())) / reps, 3)
    out["call"] = round(1e3 * total / reps, 3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            agent.allreduce_detailed(device.DeviceTensor(x), "k")
        torch.cuda.synchronize()
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages()
                 if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    out["gpu kernels and copies"] = round(gpu_us / 1e3 / reps, 3)
    return out


def _profile(torch, x) -> str:
    """The GPU codec's top operations by GPU time, over 5 calls."""
    from torch.profiler import ProfilerActivity, profile

    from homagg.host_agent.distributed.device import DeviceTensor
    from homagg.host_agent.simulate import MemoryJob

    agent = MemoryJob(1, mode="auto").agents[0]
    for _ in range(3):
        agent.allreduce_detailed(DeviceTensor(x), "k")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            agent.allreduce_detailed(DeviceTensor(x), "k")
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)


def _throughput(torch, fig: dict) -> None:
    """(3)'s codec figures: encode+decode against a device-to-device copy and the CPU codec,
    where a call's time goes, and the GPU codec's profile."""
    fig["codec"] = {}
    for n in (BUCKET, 8 * BUCKET):
        x = _sparse_bucket(torch, 0, n).cuda()
        y = torch.empty_like(x)
        d2d = n * 4 / _timed(torch, lambda x=x, y=y: y.copy_(x), 50)
        gpu = n * 4 / _codec_seconds(torch, x, 20)
        row = {"elements": n, "density": DENSITY, "d2d_copy_GBps": round(d2d / 1e9, 1),
               "gpu_codec_GBps": round(gpu / 1e9, 2), "gpu_codec_vs_d2d": round(gpu / d2d, 4)}
        if n == BUCKET:
            cpu = n * 4 / _codec_seconds(torch, x.cpu(), 3)
            row.update(cpu_codec_GBps=round(cpu / 1e9, 3), gpu_vs_cpu=round(gpu / cpu, 1))
        fig["codec"][str(n)] = row
        print(f"encode+decode, {n} float32 at {DENSITY:.0%}: GPU codec {gpu / 1e9:.2f} GB/s "
              f"= {gpu / d2d:.4f} of a device-to-device copy ({d2d / 1e9:.0f} GB/s)"
              + (f"; CPU codec {row['cpu_codec_GBps']} GB/s (GPU {row['gpu_vs_cpu']}x)"
                 if "cpu_codec_GBps" in row else ""), flush=True)
    # a dense bucket (every element non-zero: a dense layer's gradient), n words each way
    x = _sparse_bucket(torch, 0, BUCKET, 1.0).cuda()
    y = torch.empty_like(x)
    d2d = BUCKET * 4 / _timed(torch, lambda: y.copy_(x), 50)
    gpu = BUCKET * 4 / _codec_seconds(torch, x, 20)
    cpu = BUCKET * 4 / _codec_seconds(torch, x.cpu(), 3)
    fig["codec"][f"{BUCKET} dense"] = {
        "elements": BUCKET, "density": 1.0, "d2d_copy_GBps": round(d2d / 1e9, 1),
        "gpu_codec_GBps": round(gpu / 1e9, 2), "gpu_codec_vs_d2d": round(gpu / d2d, 4),
        "cpu_codec_GBps": round(cpu / 1e9, 3), "gpu_vs_cpu": round(gpu / cpu, 1)}
    print(f"encode+decode, {BUCKET} float32, dense: GPU codec {gpu / 1e9:.2f} GB/s; CPU codec "
          f"{cpu / 1e9:.3f} GB/s (GPU {gpu / cpu:.1f}x)", flush=True)
    fig["codec_phases_ms"] = {}
    for n, density in ((BUCKET, DENSITY), (8 * BUCKET, DENSITY), (BUCKET, 1.0)):
        key = str(n) if density < 1 else f"{n} dense"
        ph = fig["codec_phases_ms"][key] = _phases(
            torch, _sparse_bucket(torch, 0, n, density).cuda(), 10)
        print(f"encode+decode, {key} float32, ms a call: "
              + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()), flush=True)
    fig["codec_profile"] = _profile(torch, _sparse_bucket(torch, 0).cuda())
    print(fig["codec_profile"], flush=True)


def _local_reduce() -> dict:
    """tests/test_local_reduce.py's two torchrun nodes on CUDA tensors (``--device cuda``):
    the switch's accepted packets with local reduction and without, and whether every rank of
    both runs ends with the same parameters."""
    from bench.torch_ranks import accepted, digests, launch, two_nodes

    try:
        with tempfile.TemporaryDirectory() as d:
            args = ("--backend", "homagg", "--device", "cuda")
            on = launch(two_nodes(Path(d), "on", *args), Path(d), local_reduce=True)
            off = launch(two_nodes(Path(d), "off", *args), Path(d), local_reduce=False)
    except RuntimeError as err:  # (a run that failed: its output's tail)
        return {"ok": False, "error": str(err)[-3000:]}
    got = (accepted(on), accepted(off))
    ranks = {**{f"on {r}": v for r, v in digests(on).items()},
             **{f"off {r}": v for r, v in digests(off).items()}}
    identical = len(ranks) == 8 and len(set(ranks.values())) == 1
    return {"accepted": got, "identical": identical,
            "ok": identical and got[0] <= 0.6 * got[1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "gpu_check.json")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", choices=("all", "throughput"), default="all",
                    help="throughput: the codec's figures alone (no tests, training or "
                         "all-reduce; the check does not pass or fail)")
    a = ap.parse_args()
    import torch

    from bench.torch_ranks import run_job

    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to check", file=sys.stderr)
        return 2
    fig: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    print(f"device: {fig['device']}, torch {fig['torch']}", flush=True)

    if a.only == "throughput":
        _throughput(torch, fig)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(fig, indent=1, default=float))
        print(f"wrote {a.out}")
        return 0

    # (1) the cuda tests
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-m", "cuda", "tests/test_torch_cuda.py", "tests/test_device_codec.py"],
                       cwd=ROOT, capture_output=True, text=True)
    tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    fig["cuda_tests"] = {"rc": r.returncode, "summary": tail[0],
                         "seconds": round(time.monotonic() - t0, 1)}
    print(f"cuda tests: {tail[0]} (rc {r.returncode})", flush=True)
    if r.returncode:
        print(r.stdout[-6000:], r.stderr[-3000:], flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".pytest.txt").write_text(r.stdout + r.stderr)

    # (2) 4 ranks on one GPU: DDP on homagg against gloo
    fig["training"] = {}
    for which_model in ("embedding", "transformer"):
        with tempfile.TemporaryDirectory() as d:
            ranks = run_job(train_worker, Path(d), 31 if which_model == "embedding" else 32,
                            a.steps, which_model, world=4)
        outs = [rk["out"] for rk in ranks]
        diff = max(abs(x - y) for o in outs for x, y in zip(o["homagg"]["losses"],
                                                            o["gloo"]["losses"]))
        identical = all(torch.equal(p, q) for o in outs[1:]
                        for p, q in zip(o["homagg"]["params"], outs[0]["homagg"]["params"]))
        served = [o["homagg"]["served"].get("switch:allreduce cuda", 0) for o in outs]
        fig["training"][which_model] = {"ranks_identical": identical, "max_loss_diff": diff,
                                        "switch_cuda_allreduces": served,
                                        "losses_homagg": outs[0]["homagg"]["losses"],
                                        "losses_gloo": outs[0]["gloo"]["losses"]}
        ok = identical and diff <= 1e-6 and min(served) >= a.steps
        fig["training"][which_model]["ok"] = ok
        print(f"DDP {which_model}, 4 ranks on one GPU: ranks identical {identical}, largest "
              f"loss difference to gloo {diff:.2e}, switch all-reduces per rank {served}: "
              f"{'ok' if ok else 'FAILED'}", flush=True)

    # FSDP2 on the GPU, against DDP's losses above (the same model, data and learning rate)
    try:
        with tempfile.TemporaryDirectory() as d:
            ranks = run_job(fsdp_worker, Path(d), 34, a.steps, world=4,
                            env={"HOMAGG_TORCH_REDUCE_SCATTER": "switch"})
        ddp = fig["training"]["embedding"]["losses_homagg"]
        fsdp = ranks[0]["out"]["losses"]
        counts = ranks[0]["out"]["counts"]
        diff = max(abs(x - y) for x, y in zip(fsdp, ddp))
        fig["fsdp2"] = {"losses": fsdp, "max_loss_diff_to_ddp": diff, "counts": counts,
                        "ok": diff <= 1e-5 and counts.get("switch:reduce_scatter", 0) >= a.steps}
        print(f"FSDP2, 4 ranks on one GPU: largest loss difference to DDP {diff:.2e}; "
              f"collectives {counts}", flush=True)
    except Exception as err:  # noqa: BLE001 - a figure, said, not the check's end
        fig["fsdp2"] = {"ok": False, "error": f"{type(err).__name__}: {str(err)[-1500:]}"}
        print(f"FSDP2 on the GPU failed: {fig['fsdp2']['error']}", flush=True)

    # local reduction on the GPU: two torchrun nodes of 2 ranks (one GPU, shared), plain DDP on
    # the homagg backend under homagg-net local, against a worker per rank
    fig["local_reduce"] = _local_reduce()
    print(f"local reduction, 2 torchrun nodes of 2 ranks, CUDA: the switch accepted "
          f"{fig['local_reduce'].get('accepted')} packets (with, without), parameters the same "
          f"bit for bit: {fig['local_reduce'].get('identical')}: "
          f"{'ok' if fig['local_reduce']['ok'] else 'FAILED'}", flush=True)

    # (3) throughput
    _throughput(torch, fig)
    per = {}
    for place in ("device", "host"):
        with tempfile.TemporaryDirectory() as d:
            ranks = run_job(allreduce_worker, Path(d), 33, a.reps,
                            env={"HOMAGG_CUDA_CODEC": place})
        per[f"homagg ({place} codec)"] = max(rk["out"]["homagg"] for rk in ranks)
        per["gloo"] = min(per.get("gloo", 1e9), max(rk["out"]["gloo"] for rk in ranks))
    fig["allreduce"] = {
        "bucket_elements": BUCKET, "density": DENSITY, "ranks": 2,
        "ms": {k: round(1e3 * v, 2) for k, v in per.items()},
        "speed_vs_gloo": {k: round(per["gloo"] / v, 3) for k, v in per.items() if k != "gloo"},
    }
    print(f"all_reduce of a CUDA bucket of {BUCKET} at {DENSITY:.0%}, 2 ranks: "
          + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in per.items()), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(fig, indent=1, default=float))
    print(f"wrote {a.out}")
    bad = (fig["cuda_tests"]["rc"] or not all(t["ok"] for t in fig["training"].values())
           or not fig["local_reduce"]["ok"])
    return 1 if bad else 0


if __name__ == "__main__":  # python -m bench.gpu_check, from the repository's root
    raise SystemExit(main())
