"""Training time per iteration of the demo model (host_agent/workloads.py GMF: 4000 users, 8000
items, dim 16, i.e. 200k fp32 parameters, 800 KB of gradients per worker per step) on the
Mininet star with every worker link shaped to 100 Mbit/s (HTB, both ends): homagg compressed
(agent mode ``auto``), homagg dense in-network (mode ``dense``), and the baseline users run
today, torch.distributed's gloo all_reduce of the same gradients over the same links.

    sudo python -m bench.training            # 4 workers, 20 timed iterations, soft + bmv2, ~3 min
    sudo python -m bench.training --quick    # 10 iterations, soft target only

How: one topology per target (launcher.net.HomaggNet, --bw 100). On each worker host
bench/train_worker.py trains the same model on the same per-(step, worker) batches as
``homagg-agent train`` and times each iteration (gradient, sum, update) after one untimed
warm-up; an iteration's time is the slowest worker's, and the table gives the median and mean
over iterations, and the median part spent summing gradients. gloo: one all_reduce of the four
gradients flattened into one buffer (as a DDP bucket), ring all-reduce between the hosts,
rendezvous over tcp:// at h1 (10.0.0.1). gloo runs on the software-target topology, where s1 is
a Linux bridge: the same shaped links, forwarding that is not the bottleneck (on the bmv2
topology gloo's traffic would be limited by bmv2's forwarding rate instead). homagg runs on
both targets (the software aggregator on host ``agg``, whose own link is not shaped; bmv2).
Speedup = gloo's median ms/iteration over each row's. Needs root and Mininet; the bmv2 rows need
p4c-bm2-ss and simple_switch_grpc and are skipped, with the reason, where missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from bench import plots

ROOT = Path(__file__).resolve().parents[1]
LOG_DIR = ROOT / "build" / "logs" / "bench"


def run_variant(net, backend: str, mode: str, iterations: int) -> dict:
    from homagg.launcher.net import AGENT_PORT, host_ip

    log_dir = net.opts.log_dir
    W = net.opts.workers
    if backend == "homagg":
        net.reset_jobs()  # new epoch: fresh agents start their round tags at 1 again
    procs = []
    for w, h in enumerate(net.worker_hosts()):
        out = log_dir / f"train{w}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "bench.train_worker", "--backend", backend,
               "--mode", mode, "--worker", str(w), "--workers", str(W),
               "--bind", f"{host_ip(w)}:{AGENT_PORT}", "--slots", str(net.opts.slots),
               "--master", f"{host_ip(0)}:29500", "--iterations", str(iterations),
               "--out", str(out)]
        env = dict(os.environ, GLOO_SOCKET_IFNAME=h.defaultIntf().name, OMP_NUM_THREADS="1")
        procs.append(net.popen(h, cmd, log_dir / f"train{w}.out", env=env, cwd=str(ROOT)))
    failed = [w for w, p in enumerate(procs) if p.wait(timeout=300) != 0]
    if failed:
        tail = (log_dir / f"train{failed[0]}.out").read_text().strip().splitlines()[-1:]
        raise RuntimeError(f"{backend}/{mode}: workers {failed} failed: {' '.join(tail)}")
    res = [json.loads((log_dir / f"train{w}.json").read_text()) for w in range(W)]
    per_iter = [max(r["seconds"][i] for r in res) for i in range(iterations)]
    comm = [max(r["comm_seconds"][i] for r in res) for i in range(iterations)]
    dense = res[0]["dense_bytes_per_iter"] * (iterations + 1) * W
    wire = sum(r["bytes_on_wire"] for r in res) if backend == "homagg" else None
    return {"median": statistics.median(per_iter), "mean": statistics.fmean(per_iter),
            "comm": statistics.median(comm), "iters": per_iter, "loss": res[0]["final_loss"],
            "digests": {r["digest"] for r in res},
            "wire": None if wire is None else wire / dense,
            "retrans": sum(r["retransmissions"] for r in res) if backend == "homagg" else None}


def figure_rows(rows: list[dict]) -> list[dict]:
    """``rows`` in bench.plots' format: the columns of the table, as in benchmarks.json."""
    return [{"variant": r["label"], "median_ms": r["median"] * 1e3, "mean_ms": r["mean"] * 1e3,
             "sum_ms": r["comm"] * 1e3,
             "vs_gloo": r["speedup"] if math.isfinite(r["speedup"]) else None,
             "wire_vs_dense": f"{r['wire']:.1%}" if r["wire"] is not None else "100% x ring",
             "retx": r["retrans"], "final_loss": r["loss"]} for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 iterations, soft target only")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=20, help="timed, after one warm-up")
    ap.add_argument("--bw", type=float, default=100.0, help="Mbit/s per worker link (HTB)")
    ap.add_argument("--targets", nargs="+", default=["soft", "bmv2"])
    a = ap.parse_args(argv)
    if a.quick:
        a.iterations, a.targets = 10, ["soft"]
    if os.geteuid() != 0:
        print("training: skipped, needs root (Mininet)")
        return 0
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        print("training: gloo baseline needs torch; skipped")
        return 0
    from homagg.launcher.net import HomaggNet, NetOptions
    from homagg.targets.toolchain import missing

    variants = {"soft": [("gloo", "dense"), ("homagg", "auto"), ("homagg", "dense")],
                "bmv2": [("homagg", "auto"), ("homagg", "dense")]}
    rows, skipped = [], []
    t_start = time.monotonic()
    for target in a.targets:
        if target == "bmv2":
            gone = missing("p4c-bm2-ss", "simple_switch_grpc")
            if gone:
                skipped.append(f"bmv2 rows skipped: {gone}")
                continue
        opts = NetOptions(workers=a.workers, target=target, bw=a.bw,
                          log_dir=LOG_DIR / f"train-{target}")
        with HomaggNet(opts) as net:
            for backend, mode in variants[target]:
                r = run_variant(net, backend, mode, a.iterations)
                label = ("gloo all_reduce" if backend == "gloo" else
                         f"homagg {'compressed' if mode == 'auto' else 'dense'}") + f" ({target})"
                rows.append({"label": label, "target": target, "backend": backend,
                             "mode": mode, **r})
                print(f"[{time.monotonic() - t_start:4.0f} s] {label}: "
                      f"{r['median'] * 1e3:.1f} ms/iteration", file=sys.stderr, flush=True)
    gloo = next((r for r in rows if r["backend"] == "gloo"), None)
    for r in rows:
        r["speedup"] = gloo["median"] / r["median"] if gloo else float("nan")

    print(f"GMF training, {a.workers} workers, {a.bw:g} Mbit/s HTB links, {a.iterations} timed "
          f"iterations after a warm-up, {os.cpu_count()} CPUs; ms are per iteration, slowest "
          f"worker; 'sum ms' is the median time in the all-reduce")
    hdr = (f"{'variant':<28} {'median ms':>9} {'mean ms':>8} {'sum ms':>7} {'vs gloo':>7} "
           f"{'wire/dense':>10} {'retx':>5} {'final loss':>10}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        wire = f"{r['wire']:.1%}" if r["wire"] is not None else "100% x ring"
        retx = r["retrans"] if r["retrans"] is not None else "-"
        print(f"{r['label']:<28} {r['median'] * 1e3:>9.1f} {r['mean'] * 1e3:>8.1f} "
              f"{r['comm'] * 1e3:>7.1f} {r['speedup']:>6.1f}x {wire:>10} {retx:>5} "
              f"{r['loss']:>10.5f}")
    for s in skipped:
        print(s)
    bad = [r["label"] for r in rows if len(r["digests"]) != 1]
    if bad:
        print(f"WARNING: workers' models differ in: {', '.join(bad)}")
    best = max((r for r in rows if r["backend"] == "homagg"), key=lambda r: r["speedup"],
               default=None)
    if best and gloo:
        print(f"target check: best homagg {best['speedup']:.1f}x gloo "
              f"({'meets' if best['speedup'] >= 4 else 'misses'} the >= 4x target)")
    print(f"total {time.monotonic() - t_start:.0f} s")
    plots.write_plot("training", plots.training, figure_rows(rows),
                     f"GMF demo model, {a.workers} workers, {a.bw:g} Mbit/s links "
                     f"(x: speed vs gloo)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
