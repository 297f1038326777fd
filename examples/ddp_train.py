"""A PyTorch DDP training script whose gradient all-reduce goes through homagg.

Run it on every worker of a Mininet topology (the hook, a DDP process group over gloo for
DDP's own bookkeeping, and the agent all find their settings in the environment):

    homagg-net exec --workers 4 -- python examples/ddp_train.py --steps 50

Model: an embedding table (the sparse-ish gradients homagg compresses) and an MLP, trained on
synthetic click data seeded per (worker, step). Worker 0 prints the loss (9 decimals: curves
from the two backends are compared to 1e-6); every worker prints a digest of its parameters at
the end, so identical replicas are easy to see. ``--backend`` picks the path of the gradients:

* ``hook`` (the default): a DDP process group over gloo, and homagg's communication hook
  (``HookState``, ``homagg_hook``) all-reduces the gradient buckets through the switch;
* ``homagg``: the torch.distributed backend ``import homagg.torch`` registers: the process group
  itself is ``dist.init_process_group("homagg")`` and DDP runs unmodified, no hook (its
  gradients' all_reduce goes through the switch, its start-up checks through gloo);
* ``gloo``: plain DDP (gloo all-reduce) on the same data, as the baseline.

``--sparse`` makes the embedding's gradient a sparse COO tensor (it goes through the switch
sparse, with the hook or the backend). ``--compile`` trains ``torch.compile`` of the wrapped
model (the DDP module, or FSDP2's); ``--batchnorm`` adds a BatchNorm layer, whose buffers DDP
broadcasts from rank 0 at every forward (inside the compiled forward, with ``--compile``).

``--workload`` picks what drives the all-reduce, for ``--backend homagg`` or ``gloo`` (the hook
needs DDP): ``ddp`` (the default, as above); ``loop``: no DDP, a hand-written loop that calls
``dist.all_reduce(grad, op=AVG)`` on every parameter's gradient; ``fsdp``: FSDP2's
``fully_shard`` on a 1-D device mesh; ``hsdp``: FSDP2 on a 2-D mesh of (world) replicas of one
shard, whose replicate all-reduce spans the world; ``hsdp2``: (world / 2) replicas of two
shards, whose replicate groups are subgroups: with the controller service each joins a homagg
job of its own, by itself. Every workload also sums an int64 counter
of the samples seen, each step, and checks it (the metric reduction a training loop does).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import time

import torch
import torch.distributed as dist

from homagg.host_agent.distributed.hook import HookState, homagg_hook

#: steps before the CPU count starts (imports, JIT, the first buckets' index choices)
WARMUP = 3


def make_model(rows: int, dim: int, sparse: bool = False,
               batchnorm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)  # identical replicas on every worker
    norm = [torch.nn.BatchNorm1d(32)] if batchnorm else []
    return torch.nn.Sequential(torch.nn.EmbeddingBag(rows, dim, mode="mean", sparse=sparse),
                               torch.nn.Linear(dim, 32), *norm, torch.nn.ReLU(),
                               torch.nn.Linear(32, 1))


def batch(rank: int, step: int, rows: int, size: int = 64):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, rows, (size, 8), generator=g)
    y = (idx.float().mean(1, keepdim=True) / rows > 0.5).float()  # a learnable rule
    return idx, y


MESH = None  # the device mesh of the FSDP2 workloads


def wrap(model: torch.nn.Module, workload: str, world: int) -> torch.nn.Module:
    """The model as the workload trains it: DDP, itself (the loop), or FSDP2-sharded."""
    if workload == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if workload == "loop":
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    global MESH
    if workload == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
    else:  # hsdp: (world) replicas of one shard; hsdp2: (world / 2) replicas of two shards
        shards = 2 if workload == "hsdp2" else 1
        mesh = init_device_mesh("cpu", (world // shards, shards),
                                mesh_dim_names=("replicate", "shard"))
    MESH = mesh
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        if hasattr(p, "full_tensor"):  # FSDP2's DTensor: the whole parameter, on every rank
            p = p.full_tensor()
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--backend", choices=["hook", "homagg", "gloo"], default="hook",
                    help="hook: gloo group + homagg's DDP hook; homagg: the homagg "
                    "process group, DDP unmodified; gloo: plain DDP")
    ap.add_argument("--init-method", default="env://",
                    help="torch.distributed's rendezvous (default: MASTER_ADDR/MASTER_PORT)")
    ap.add_argument("--sparse", action="store_true", help="sparse embedding gradients")
    ap.add_argument("--compile", action="store_true",
                    help="train torch.compile of the wrapped model")
    ap.add_argument("--batchnorm", action="store_true",
                    help="a BatchNorm layer (buffers DDP broadcasts at every forward)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the model trains (cuda: the GPU LOCAL_RANK picks, modulo the "
                    "GPUs; several ranks may share one)")
    ap.add_argument("--mode", default="auto", help="homagg's mode: auto, dense, union, sketch")
    ap.add_argument("--index", default="auto", help="homagg's index: auto, flat, hier")
    ap.add_argument("--no-overlap", action="store_true",
                    help="the hook blocks (no agent thread): for comparison")
    ap.add_argument("--no-pipeline", action="store_true",
                    help="the hook's buckets one at a time (no round 1 riding with the one "
                    "before's values): for comparison")
    ap.add_argument("--workload", choices=["ddp", "loop", "fsdp", "hsdp", "hsdp2"],
                    default="ddp",
                    help="ddp: DDP; loop: dist.all_reduce on each gradient; fsdp: FSDP2 on a "
                    "1-D mesh; hsdp: FSDP2 on a (world x 1) mesh; hsdp2: on a (world/2 x 2) "
                    "mesh, whose replicate groups are subgroups")
    a = ap.parse_args()
    if a.device == "cuda" and a.workload not in ("ddp", "loop"):
        ap.error("--device cuda takes --workload ddp or loop (the FSDP2 meshes are cpu's)")
    if a.workload != "ddp" and (a.backend == "hook" or a.sparse):
        ap.error(f"--workload {a.workload} takes --backend homagg or gloo, dense gradients")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.workload == "hsdp2" and world % 2:
        ap.error("--workload hsdp2 needs an even world size")
    if a.backend == "homagg":
        import homagg.torch  # registers the "homagg" backend

        homagg.torch.set_agent_options(mode=a.mode, index=a.index)
    # the only change the homagg backend asks of a DDP script: its name here
    dist.init_process_group("homagg" if a.backend == "homagg" else "gloo",
                            init_method=a.init_method, rank=rank, world_size=world)
    device = torch.device("cpu")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no CUDA GPU")
    if a.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))
                              % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model = make_model(a.rows, a.dim, a.sparse, a.batchnorm).to(device)
    ddp = wrap(model, a.workload, world)
    agent, state = None, None
    if a.backend == "homagg":
        agent = dist.group.WORLD.agent  # type: ignore[attr-defined]  # (for its counters)
    if a.backend == "hook":
        import homagg.torch

        # this rank's agent; the ranks of a host reduce locally where they join through the
        # controller service (homagg.torch.hook_agent's doc)
        agent = homagg.torch.hook_agent(mode=a.mode, index=a.index)
        # overlap: the agent's thread sums each bucket while autograd goes on
        state = HookState.of(agent, model, overlap=not a.no_overlap,
                             pipeline=not a.no_pipeline)
        ddp.register_comm_hook(state=state, hook=homagg_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
    net = torch.compile(ddp) if a.compile else ddp
    seen = 0
    cpu0 = 0.0
    for step in range(a.steps):
        if step == WARMUP:  # this process's CPU (every thread's) from here, per step
            cpu0 = time.process_time()
        idx, y = batch(rank, step, a.rows)
        idx, y = idx.to(device), y.to(device)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net(idx), y)
        loss.backward()  # DDP's all-reduce (hook or backend) runs here, overlapped with autograd
        if a.workload == "loop":  # what a loop without DDP does: average every gradient
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        # a metric: the samples the job has seen, summed as an int64 (exact on any backend)
        count = torch.tensor([idx.shape[0]], dtype=torch.int64, device=device)
        dist.all_reduce(count)
        seen += int(count.item())
        ms = 1e3 * (time.perf_counter() - t0)  # the step, all-reduce included
        if rank == 0:
            print(f"step {step:3d} loss {loss.item():.9f} ms {ms:.1f}", flush=True)
    if seen != world * idx.shape[0] * a.steps:
        raise SystemExit(f"rank {rank}: the job saw {seen} samples, not "
                         f"{world * idx.shape[0] * a.steps}")
    print(f"rank {rank}: samples seen {seen}", flush=True)
    if a.steps > WARMUP:
        cpu = 1e3 * (time.process_time() - cpu0) / (a.steps - WARMUP)
        print(f"rank {rank}: cpu ms/step {cpu:.2f} (after {WARMUP} warm-up steps)", flush=True)
    print(f"rank {rank}: parameters {digest(model)}", flush=True)
    if agent is not None:
        c = agent.counters
        print(f"rank {rank}: homagg sent {c.packets_sent} packets ({c.bytes_sent} B), "
              f"{c.retransmissions} retransmitted, {c.rounds} rounds, "
              f"{c.seconds:.2f} s in rounds", flush=True)
    if a.backend == "homagg" and MESH is not None and MESH.ndim == 2:
        g = MESH.get_group("replicate")  # a subgroup where the mesh has two shards
        if g is not dist.group.WORLD:
            ga = getattr(g, "agent", None)
            print(f"rank {rank}: replicate group {g.counts.get('switch:allreduce', 0)} "
                  f"switch all-reduces, {ga.counters.packets_sent if ga else 0} packets",
                  flush=True)
    if state is not None and agent is not None:  # the hook's (the backend closes its own)
        state.close()
        agent.close()
    del net, ddp, model, opt  # no DDP alive when the group goes (an abort at exit otherwise)
    gc.collect()
    # every rank done before any leaves: rank 0 holds the rendezvous store, and a rank still
    # tearing gloo down when it goes aborts (seen over bmv2 trees' slower routed links)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
