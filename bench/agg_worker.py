"""One worker of bench/aggregation.py, run on a Mininet host: all-reduce random sparse fp32
tensors through homagg and time each all-reduce (tensor generation is done beforehand, so
only the all-reduce is timed: encode, rounds through the switch, decode).

    python -m bench.agg_worker --job 1 --worker 0 --workers 4 --bind 10.0.0.1:50000 \\
        --slots 16 --mode auto --size 1000000 --density 0.01 --iterations 5 --out w0.json

Same tensors as ``homagg-agent bench`` (seeded per iteration and worker). The first all-reduce
is a warm-up (and the workers' start barrier) and is not timed. Writes JSON: per-iteration
seconds, bytes on the wire, packets, retransmissions, the mode chosen.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from homagg import wire
from homagg.host_agent import Agent, AgentConfig, codec
from homagg.host_agent.cli import bench_tensor as _tensor
from homagg.host_agent.cli import check_exact


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", type=int, required=True)
    p.add_argument("--worker", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--switch", default=wire.DEFAULT_SWITCH_IP)
    p.add_argument("--bind", required=True, help="IP:PORT")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--mode", default=codec.AUTO, choices=[codec.AUTO, *codec.MODES])
    p.add_argument("--size", type=int, default=1_000_000)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--index", default="auto", choices=["auto", "flat", "hier"])
    p.add_argument("--rows-of", type=int, default=1,
                   help="row-sparse tensors: --density of the rows of this many elements")
    p.add_argument("--check", action="store_true",
                   help="after timing, compare every aggregate with the exact integer sum")
    p.add_argument("--deadline", type=float, default=30.0)
    p.add_argument("--local-workers", type=int, help="a tree: workers at this agent's leaf")
    p.add_argument("--rank", type=int, help="a tree: index among all --workers (its tensors)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    ip, _, port = a.bind.partition(":")
    cfg = AgentConfig(a.job, a.worker, a.workers, (a.switch, wire.HOMAGG_UDP_PORT_MIN),
                      (ip, int(port)), a.slots, mode=a.mode, index=a.index, deadline=a.deadline,
                      local_workers=a.local_workers)
    rank = a.worker if a.rank is None else a.rank
    xs = [_tensor(0, it, rank, a.size, a.density, a.rows_of)
          for it in range(a.iterations + 1)]
    times, modes, results = [], [], []
    with Agent(cfg) as agent:
        agent.allreduce_detailed(xs[0])  # warm-up: numba, sockets, and the start barrier
        c0 = (agent.counters.bytes_sent, agent.counters.packets_sent,
              agent.counters.retransmissions)
        for x in xs[1:]:
            t0 = time.perf_counter()
            res = agent.allreduce_detailed(x)
            times.append(time.perf_counter() - t0)
            modes.append(res.mode)
            results.append(res)
        c = agent.counters
    exact = None
    if a.check:  # outside the timed loop: every worker's tensors, regenerated from their seeds
        for it, res in enumerate(results, start=1):
            check_exact(res, [_tensor(0, it, w, a.size, a.density, a.rows_of)
                              for w in range(a.workers)], f"iteration {it}")
        exact = True
    out = {"worker": a.worker, "rank": rank, "seconds": times, "modes": modes,
           "bytes_on_wire": c.bytes_sent - c0[0], "packets": c.packets_sent - c0[1],
           "retransmissions": c.retransmissions - c0[2], "exact": exact,
           "index": results[0].index if results else None}
    Path(a.out).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
