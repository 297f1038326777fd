"""One worker of bench/training.py, run on a Mininet host: trains the demo model
(host_agent/workloads.py GMF, same data, seeds and update as ``homagg-agent train``) and times
every iteration, with the gradients summed either through homagg or with torch.distributed's
gloo all_reduce.

    python -m bench.train_worker --backend homagg --mode auto --worker 0 --workers 4 \\
        --bind 10.0.0.1:50000 --slots 64 --iterations 20 --out w0.json
    python -m bench.train_worker --backend gloo --worker 0 --workers 4 \\
        --master 10.0.0.1:29500 --iterations 20 --out w0.json

homagg: one all-reduce per tensor (U, V, b, w), keyed as in ``homagg-agent train``. gloo: the four
gradients flattened into one fp32 buffer and summed with one dist.all_reduce (what DDP's bucket
does; gloo's ring all-reduce), init over tcp:// to worker 0. Iteration 0 is a warm-up (numba,
connections, the workers' start barrier) and is not timed. Writes JSON: per-iteration seconds
(gradient + sum + update) and the part spent summing, the final loss and a model digest.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from homagg import wire
from homagg.host_agent.workloads import GMF, NCFConfig, SyntheticData


def homagg_sum(a):
    from homagg.host_agent import Agent, AgentConfig

    ip, _, port = a.bind.partition(":")
    agent = Agent(AgentConfig(1, a.worker, a.workers, (a.switch, wire.HOMAGG_UDP_PORT_MIN),
                              (ip, int(port)), a.slots, mode=a.mode, deadline=30.0))

    def summed(grads):
        # One flat buffer, as DDP's bucket (and the gloo variant below) does: 2 rounds a step
        # instead of 2 per tensor.
        return _unflatten(grads, agent.allreduce(_flatten(grads), key="bucket"))

    return summed, agent


def _flatten(grads):
    return np.concatenate([g.reshape(-1) for g in grads.values()])


def _unflatten(grads, buf):
    out, off = {}, 0
    for k, g in grads.items():
        out[k] = buf[off:off + g.size].reshape(g.shape)
        off += g.size
    return out


def gloo_sum(a):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.worker,
                            world_size=a.workers, timeout=timedelta(seconds=60))

    def summed(grads):
        flat = torch.from_numpy(_flatten(grads))
        dist.all_reduce(flat)
        return _unflatten(grads, flat.numpy())

    return summed, dist


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", required=True, choices=["homagg", "gloo"])
    p.add_argument("--mode", default="auto", choices=["auto", "dense"])
    p.add_argument("--worker", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--switch", default=wire.DEFAULT_SWITCH_IP)
    p.add_argument("--bind", default=f"0.0.0.0:{wire.DEFAULT_AGENT_PORT}")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--master", default="10.0.0.1:29500")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    cfg = NCFConfig()
    model, data = GMF(cfg), SyntheticData(cfg)
    summed_fn, handle = homagg_sum(a) if a.backend == "homagg" else gloo_sum(a)
    times, comm = [], []
    loss = None
    for it in range(a.iterations + 1):
        t0 = time.perf_counter()
        u, i, y = data.batch(it, a.worker)
        loss, grads = model.loss_and_grads(u, i, y)
        t1 = time.perf_counter()
        summed = summed_fn(grads)
        t2 = time.perf_counter()
        model.apply(summed, cfg.batch * a.workers)
        t3 = time.perf_counter()
        if it > 0:
            times.append(t3 - t0)
            comm.append(t2 - t1)
    if a.backend == "homagg":
        bytes_sent, retrans = handle.counters.bytes_sent, handle.counters.retransmissions
        handle.close()
    else:
        bytes_sent, retrans = None, None
        handle.destroy_process_group()
    Path(a.out).write_text(json.dumps({
        "worker": a.worker, "seconds": times, "comm_seconds": comm, "final_loss": loss,
        "digest": model.digest(), "bytes_on_wire": bytes_sent, "retransmissions": retrans,
        "dense_bytes_per_iter": 4 * sum(p.size for p in model.params().values())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
