"""Trees against a star: what the spine receives and how long an all-reduce takes, for the same
L x N workers aggregated by one switch (star) or by L leaves under a spine (leafspine).

    sudo python -m bench.tree                 # both targets, 2 leaves x 4 workers, ~3 min
    sudo python -m bench.tree --targets soft --leaves 2 --workers-per-leaf 4 --size 200000

How: for each target, launcher.net (star) and launcher.tree (leafspine) start their topology
in turn, with the same workers, tensors and agent settings (bench/agg_worker.py on every worker
host: one untimed warm-up all-reduce, then --iterations timed ones, every sum checked bit for
bit). Reported per topology:
- packets the aggregating switch at the top received (the star's switch; the tree's spine): its
  STAT_RX counter, joins and retransmissions included, and the bytes those frames carry
  (STAT_RX x the K-word frame, Ethernet included; a join's frame is smaller, so this is an upper
  bound);
- the median all-reduce time (slowest worker per iteration).
The figure the issue asks for is spine / star switch: at most 1/N (a quarter for 4 workers a
leaf), since each leaf sends one partial sum per round where the star's switch gets one
contribution per worker. Time is the price of the extra level on this machine: every switch
and agent shares 2 cores. Needs root and Mininet; the bmv2 rows need p4c-bm2-ss and
simple_switch_grpc, and are skipped with the reason where missing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from bench import plots

ROOT = Path(__file__).resolve().parents[1]
LOG_DIR = ROOT / "build" / "logs" / "bench-tree"


def run(net, a) -> dict:
    """bench/agg_worker.py on every worker of ``net``; the top switch's counters after."""
    from homagg import wire
    from homagg.launcher.net import AGENT_PORT, SWITCH_IP, host_ip
    from homagg.launcher.tree import TreeNet, leaf_ip

    log_dir, W = net.opts.log_dir, net.opts.workers
    tree = isinstance(net, TreeNet)
    procs = []
    for w, h in enumerate(net.worker_hosts()):
        (log_dir / f"agg{w}.json").unlink(missing_ok=True)
        where = (["--switch", leaf_ip(net.leaf_of(w)), "--worker", str(w % a.workers_per_leaf),
                  "--local-workers", str(a.workers_per_leaf), "--rank", str(w)] if tree
                 else ["--switch", SWITCH_IP, "--worker", str(w)])
        cmd = [sys.executable, "-m", "bench.agg_worker", "--job", "1", "--workers", str(W),
               *where, "--bind", f"{host_ip(w)}:{AGENT_PORT}", "--slots", str(net.opts.slots),
               "--mode", a.mode, "--size", str(a.size), "--density", str(a.density),
               "--iterations", str(a.iterations), "--check", "--out",
               str(log_dir / f"agg{w}.json")]
        procs.append(net.popen(h, cmd, log_dir / f"agg{w}.out", cwd=str(ROOT)))
    failed = [w for w, p in enumerate(procs) if p.wait() != 0]
    if failed:
        tail = (log_dir / f"agg{failed[0]}.out").read_text().strip().splitlines()[-1:]
        raise RuntimeError(f"workers {failed} failed: {' '.join(tail)}")
    res = [json.loads((log_dir / f"agg{w}.json").read_text()) for w in range(W)]
    stats = net.stats_all()
    top = stats["spine" if tree else net.config.switch.name]["switch"]
    frame = 14 + 20 + 8 + wire.packet_bytes(net.opts.words or wire.WORDS_PER_PACKET)
    below = (sum(s["switch"]["STAT_RX"] for name, s in stats.items() if name != "spine")
             if tree else None)
    return {"top_rx": top["STAT_RX"], "top_bytes": top["STAT_RX"] * frame,
            "leaves_rx": below,
            "median_s": statistics.median(max(r["seconds"][i] for r in res)
                                          for i in range(a.iterations)),
            "retrans": sum(r["retransmissions"] for r in res),
            "exact": all(r["exact"] for r in res)}


def figure_rows(rows: list[dict]) -> list[dict]:
    """``rows`` in bench.plots' format: the columns of the table, as in benchmarks.json."""
    return [{"target": r["target"], "topo": r["topo"], "top_rx_pkts": r["top_rx"],
             "top_rx_mb": r["top_bytes"] / 1e6, "leaves_rx_pkts": r["leaves_rx"],
             "ms_per_allreduce": 1e3 * r["median_s"], "retx": r["retrans"]} for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=["soft", "bmv2"])
    ap.add_argument("--leaves", type=int, default=2)
    ap.add_argument("--workers-per-leaf", type=int, default=4)
    ap.add_argument("--mode", default="dense", help="agent mode (dense: every element sent)")
    ap.add_argument("--size", type=int, default=100_000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--iterations", type=int, default=5)
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("tree: skipped, needs root (Mininet)")
        return 0
    from homagg.launcher.net import NetOptions
    from homagg.launcher.tree import make_net
    from homagg.targets.toolchain import missing

    W = a.leaves * a.workers_per_leaf
    rows, skipped = [], []
    for target in a.targets:
        if target == "bmv2" and (gone := missing("p4c-bm2-ss", "simple_switch_grpc")):
            skipped.append(f"bmv2 rows skipped: {gone}")
            continue
        for topo in ("star", "leafspine"):
            opts = NetOptions(workers=W, target=target, fallback=False, topo=topo,
                              leaves=a.leaves, workers_per_leaf=a.workers_per_leaf,
                              log_dir=LOG_DIR / f"{target}-{topo}")
            with make_net(opts) as net:
                rows.append({"target": target, "topo": topo, **run(net, a)})
            print(f"{target:4s} {topo:9s} {rows[-1]}", file=sys.stderr, flush=True)
    print(f"leaf/spine ({a.leaves} leaves x {a.workers_per_leaf} workers) vs star ({W} "
          f"workers): mode {a.mode}, {a.size} elements, {a.iterations} timed all-reduces, "
          f"{os.cpu_count()} CPUs")
    print(f"{'target':6s} {'topology':9s} {'top rx pkts':>11s} {'top rx MB':>9s} "
          f"{'leaves rx':>9s} {'ms/allreduce':>12s} {'retx':>5s} exact")
    for r in rows:
        print(f"{r['target']:6s} {r['topo']:9s} {r['top_rx']:11d} {r['top_bytes'] / 1e6:9.2f} "
              f"{r['leaves_rx'] if r['leaves_rx'] is not None else '-':>9} "
              f"{1e3 * r['median_s']:12.1f} {r['retrans']:5d} {r['exact']}")
    for t in sorted({r["target"] for r in rows}):
        star = next(r for r in rows if r["target"] == t and r["topo"] == "star")
        tree = next(r for r in rows if r["target"] == t and r["topo"] == "leafspine")
        print(f"{t}: spine receives {tree['top_bytes'] / star['top_bytes']:.3f} of the star "
              f"switch's bytes (target <= {1 / a.workers_per_leaf:.3f}); an all-reduce takes "
              f"{tree['median_s'] / star['median_s']:.2f}x the star's")
    for s in skipped:
        print(s)
    plots.write_plot("tree", plots.tree, figure_rows(rows),
                     f"leaf/spine ({a.leaves} leaves x {a.workers_per_leaf}) vs star "
                     f"({W} workers), {a.mode}, {a.size} elements (x: tree / star)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
