"""One worker of ``bench.models``: a model of ``bench.model_zoo`` trained with DDP, its gradients
all-reduced by gloo's ring or through homagg (the DDP communication hook), on every worker host
of a ``homagg-net`` topology at once (the environment is ``homagg-net exec``'s).

First ``--compute-steps`` steps under ``no_sync`` (forward, backward and the optimizer, no
all-reduce: the step's compute), then ``--steps`` steps as DDP runs them. Rank 0 prints one
JSON line per step and a summary line: the step times, the compute time, the process's CPU
time per step (every thread's: the training, DDP, gloo's or the agent's), and for homagg the
bytes it sent and the mode and index each bucket took.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import resource
import time

import torch
import torch.distributed as dist

from bench.model_zoo import MODELS, SHAPES, spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", choices=MODELS, required=True)
    ap.add_argument("--shape", choices=SHAPES, default="fit")
    ap.add_argument("--backend", choices=["gloo", "hook"], default="hook")
    ap.add_argument("--mode", default="auto", help="homagg's mode: auto, dense")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compute-steps", type=int, default=3)
    ap.add_argument("--part", type=int, default=None,
                    help="homagg: elements per part of a long bucket (AgentConfig.part)")
    ap.add_argument("--no-pipeline", action="store_true",
                    help="the hook's buckets one at a time (no round 1 riding ahead)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP checks)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    s = spec(a.model, a.shape)
    model = s.build()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    agent, state = None, None
    taken: collections.Counter[str] = collections.Counter()
    if a.backend == "hook":
        from homagg.host_agent import Agent, AgentConfig
        from homagg.host_agent.distributed.hook import HookState, homagg_hook

        # (a join waits for the slowest rank's start: DDP's first broadcast of a large model
        # takes seconds at 100 Mbit/s)
        agent = Agent(AgentConfig.from_env(mode=a.mode, deadline=60.0,
                                           **({} if a.part is None else {"part": a.part})))
        detailed = agent.allreduce_detailed

        def tally(x, key=None, out=None, **kw):  # which mode and index each bucket took
            r = detailed(x, key, out=out, **kw)
            taken[f"{r.mode.name.lower()}/{r.index or '-'}"] += 1
            return r

        agent.allreduce_detailed = tally  # type: ignore[method-assign]
        state = HookState.of(agent, model, pipeline=not a.no_pipeline)
        ddp.register_comm_hook(state=state, hook=homagg_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def step(n: int, sync: bool, ddp=ddp, opt=opt) -> tuple[float, float, float]:
        """One step: its wall ms, the process's CPU ms, its loss."""
        batch = s.batch(rank, n)
        t0, cpu0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        if sync:
            loss = s.loss(ddp, *batch)
            loss.backward()
        else:
            with ddp.no_sync():
                loss = s.loss(ddp, *batch)
                loss.backward()
        opt.step()
        value = float(loss.item())
        return (1e3 * (time.perf_counter() - t0), 1e3 * (time.process_time() - cpu0),
                value)

    compute = [step(n, False)[0] for n in range(a.compute_steps)]
    dist.barrier()  # every rank at the first synced step at once
    sent0 = agent.counters.bytes_sent if agent else 0
    times, cpu, losses = [], [], []
    for n in range(a.steps):
        ms, cpu_ms, loss = step(a.compute_steps + n, True)
        times.append(ms)
        cpu.append(cpu_ms)
        losses.append(loss)
        if rank == 0:
            print(json.dumps({"step": n, "ms": round(ms, 2), "loss": loss}), flush=True)
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print("summary " + json.dumps({
            "model": a.model, "shape": a.shape, "params": params,
            "compute_ms": compute, "step_ms": times, "cpu_ms": cpu, "losses": losses,
            "bytes_per_step": ((agent.counters.bytes_sent - sent0) / max(a.steps, 1)
                               if agent else None),
            "dense_bytes": 4 * params, "taken": dict(taken),
            "pipelined": agent.counters.pipelined if agent else None,
            # the run's resends by cause (loss.py; the warm-up steps' included)
            "resends": ({n: getattr(agent.counters, n) for n in (
                "retransmissions", "early_resends", "probes", "probes_held", "held_back",
                "waited_timeout", "waited_rack", "waited_probe")} if agent else None),
            # the worker's peak resident memory (Linux: kB): the model, its gradients, DDP's
            # buckets and the all-reduce's buffers together
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}),
            flush=True)
    if state is not None and agent is not None:
        state.close()
        agent.close()
    del ddp, model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
