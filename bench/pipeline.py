"""Pipelined tensors: a list of tensors all-reduced one at a time against ``Agent.allreduce_many``,
whose tensors each send their round 1 with the one before's values (docs/agent.md, pipelined
tensors).

    python -m bench.pipeline                          # 4 workers, 8 tensors of 64k at 1%
    python -m bench.pipeline --tensors 16 --size 16384 --density 0.05 --repeat 20

On loopback, no root: the native software aggregator (``homagg-softswitch``, its own process)
and W agent processes, each all-reducing the same list of T tensors (its own values) R times
in each variant, the variants alternating so the machine's noise falls on both. Before each
list every worker waits at a barrier; a list's time is the slowest worker's, from the barrier
to its last sum. Per variant: the median time per list, and per list the rounds (round
trips) and fused rounds of worker 0 (``Counters``). Every sum of the pipelined lists is
checked, bit for bit, against the same list one at a time. The ratio is one-at-a-time's time
over the pipeline's (>1: pipelining is faster). On loopback a round trip costs tens of
microseconds, so this measures what pipelining saves where round trips are cheap; through a
switch with a longer round trip (bmv2, a real network) it saves a round trip per tensor.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.linerate import KEY, start_aggregator
from bench.pps import SWITCH_IP, free_port
from homagg import wire

VARIANTS = ("one at a time", "pipelined")


def tensors(seed: int, worker: int, t: int, n: int, density: float) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, worker])
    return [(rng.standard_normal(n) * (rng.random(n) < density)).astype(np.float32)
            for _ in range(t)]


def worker(w: int, a, hosts, barrier, results) -> None:
    from homagg.host_agent import Agent, AgentConfig

    cfg = AgentConfig(job=1, worker=w, workers=a.workers,
                      switch=(SWITCH_IP, wire.HOMAGG_UDP_PORT_MIN), bind=hosts[w],
                      slots=a.slots, key=KEY, deadline=30.0, engine=a.engine)
    with Agent(cfg) as agent:
        keys = list(range(a.tensors))
        for r in range(-1, a.repeat):  # (r = -1: a warm-up of each, not reported)
            xs = tensors(r + 1, w, a.tensors, a.size, a.density)
            sums = {}
            order = VARIANTS if r % 2 else VARIANTS[::-1]
            for v in order:
                c = agent.counters
                rounds, fused = c.rounds, c.pipelined
                barrier.wait()
                t0 = time.perf_counter()
                if v == "pipelined":
                    got = agent.allreduce_many(xs, keys)
                else:
                    got = [agent.allreduce_detailed(x, k) for k, x in zip(keys, xs)]
                dt = time.perf_counter() - t0
                sums[v] = [g.out for g in got]
                if r >= 0:
                    results.put((w, r, v, dt, c.rounds - rounds, c.pipelined - fused))
            for one, many in zip(*(sums[v] for v in VARIANTS)):
                if not np.array_equal(one, many):
                    raise SystemExit(f"worker {w}: a pipelined sum differs from one at a time")
        results.put((w, None, agent.transport.engine, 0.0, 0, 0))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--size", type=int, default=65536)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--words", type=int, default=wire.WORDS_PER_PACKET)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--engine", default="auto", help="the agents' engine: auto, native, python")
    a = ap.parse_args(argv)
    hosts = [("127.0.0.1", free_port("127.0.0.1")) for _ in range(a.workers)]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        agg = start_aggregator("native", Path(tmp), hosts, a.words, a.slots)
        try:
            barrier, results = ctx.Barrier(a.workers), ctx.Queue()
            procs = [ctx.Process(target=worker, args=(w, a, hosts, barrier, results))
                     for w in range(a.workers)]
            for p in procs:
                p.start()
            rows, engines = [], set()
            while len(engines) < 1 or len(rows) < a.workers * a.repeat * 2:
                try:
                    w, r, v, dt, rounds, fused = results.get(timeout=5)
                except queue.Empty:
                    if any(p.exitcode for p in procs):
                        raise SystemExit("a worker failed (see its error above)") from None
                    continue
                if r is None:
                    engines.add(v)
                else:
                    rows.append((w, r, v, dt, rounds, fused))
            for p in procs:
                p.join(timeout=60)
            if any(p.exitcode for p in procs):
                raise SystemExit("a worker failed (see its error above)")
        finally:
            agg.kill()
            agg.wait()
    report(a, rows, engines)


def report(a, rows, engines) -> None:
    print(f"{a.workers} workers, {a.tensors} tensors of {a.size} float32 at density "
          f"{a.density}, K = {a.words}, {a.slots} slots; agents' engine "
          f"{', '.join(sorted(engines))}, the native aggregator; {a.repeat} lists per "
          "variant, alternating")
    med = {}
    print(f"{'variant':<16}{'ms/list':>10}{'min':>9}{'max':>9}{'rounds':>8}{'fused':>7}")
    for v in VARIANTS:
        per_list = [max(dt for w, r, vv, dt, _, _ in rows if vv == v and r == i)
                    for i in range(a.repeat)]
        rounds = [ro for w, r, vv, _, ro, _ in rows if vv == v and w == 0]
        fused = [f for w, r, vv, _, _, f in rows if vv == v and w == 0]
        med[v] = statistics.median(per_list) * 1e3
        print(f"{v:<16}{med[v]:>10.2f}{min(per_list) * 1e3:>9.2f}{max(per_list) * 1e3:>9.2f}"
              f"{statistics.median(rounds):>8.0f}{statistics.median(fused):>7.0f}")
    # list by list: the two variants of one list ran back to back
    ratios = [max(dt for w, r, vv, dt, _, _ in rows if vv == VARIANTS[0] and r == i)
              / max(dt for w, r, vv, dt, _, _ in rows if vv == VARIANTS[1] and r == i)
              for i in range(a.repeat)]
    print(f"speedup (one at a time / pipelined): {med[VARIANTS[0]] / med[VARIANTS[1]]:.2f}x "
          f"of the medians; list by list, median {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
