"""Aggregation throughput: fp32 gradient elements all-reduced per second through homagg, dense
in-network aggregation (agent mode ``dense``, SwitchML-style: every element on the wire)
against compressed (mode ``auto``: index OR rounds, then union or sketch values), with the flat
bitmap index and with the hierarchical one, under Mininet.

    sudo python -m bench.aggregation            # both targets, 4 and 8 workers, ~4-5 min
    sudo python -m bench.aggregation --quick    # 4 workers, smaller tensors, ~2 min

How: launcher.net.HomaggNet starts the star topology once per (target, workers): the software
aggregator (host ``agg``) or bmv2 running p4/homagg.p4 with the job installed by the controller
(default windows: 16 slots on bmv2, 64 on the software target). On every worker host,
bench/agg_worker.py all-reduces random tensors of N fp32 elements (a given fraction non-zero,
independent supports per worker, as ``homagg-agent bench``) and times each all-reduce after one
untimed warm-up; the tensors are generated before the clock starts. An iteration's time is the
slowest worker's; throughput = N x iterations / sum of iteration times. No link shaping.

The baseline is dense in-network aggregation on the same switch, topology and run: it sends N
words per worker whatever the density, so it is measured once per (target, workers) and divides
every density's compressed figure. N is 1M on the software target and 256k on bmv2 (bmv2 runs
homagg.p4 at ~5-15k packets/s here: a dense 1M x 8 workers iteration would take ~30 s), so
compare elements/s within a target only; the ratio is the figure that travels. Also reported:
bytes on the wire against dense, and retransmissions (bmv2 drops bursts). Needs root and
Mininet; the bmv2 rows need p4c-bm2-ss and simple_switch_grpc (PATH, or HOMAGG_P4C /
HOMAGG_BMV2) and are skipped, with the reason, where they are missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench import plots

ROOT = Path(__file__).resolve().parents[1]
LOG_DIR = ROOT / "build" / "logs" / "bench"


def run_config(net, W: int, n: int, density: float, mode: str, iterations: int,
               index: str = "auto", rows_of: int = 1) -> dict:
    from homagg.launcher.net import AGENT_PORT, host_ip

    log_dir = net.opts.log_dir
    net.reset_jobs()  # new epoch: fresh agents start their round tags at 1 again
    procs = []
    for w, h in enumerate(net.worker_hosts()):
        (log_dir / f"agg{w}.json").unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "bench.agg_worker", "--job", "1",
               "--worker", str(w), "--workers", str(W), "--bind", f"{host_ip(w)}:{AGENT_PORT}",
               "--slots", str(net.opts.slots), "--mode", mode, "--size", str(n),
               "--density", str(density), "--iterations", str(iterations),
               "--index", index, "--check", "--rows-of", str(rows_of),
               "--out", str(log_dir / f"agg{w}.json")]
        procs.append(net.popen(h, cmd, log_dir / f"agg{w}.out", cwd=str(ROOT)))
    failed = [w for w, p in enumerate(procs) if p.wait() != 0]
    if failed:
        tail = (log_dir / f"agg{failed[0]}.out").read_text().strip().splitlines()[-1:]
        raise RuntimeError(f"workers {failed} failed: {' '.join(tail)}")
    res = [json.loads((log_dir / f"agg{w}.json").read_text()) for w in range(W)]
    per_iter = [max(r["seconds"][i] for r in res) for i in range(iterations)]
    return {"seconds": sum(per_iter), "eps": n * iterations / sum(per_iter),
            "bytes": sum(r["bytes_on_wire"] for r in res),
            "retrans": sum(r["retransmissions"] for r in res),
            "packets": sum(r["packets"] for r in res), "mode": res[0]["modes"][0],
            "exact": all(r["exact"] for r in res)}


def figure_rows(rows: list[dict]) -> list[dict]:
    """``rows`` in bench.plots' format: the columns of the table, as in benchmarks.json."""
    return [{"target": r["target"], "workers": r["workers"], "n": r["n"],
             "density": f"{r['density']:.2%}" + (f"r{r['rows_of']}" if r["rows_of"] > 1 else ""),
             "dense_eps": r["dense_eps"], "flat_eps": r["flat_eps"], "hier_eps": r["eps"],
             "wire_flat_pct": 100 * r["flat_bytes"] / r["dense_bytes"],
             "wire_hier_pct": 100 * r["bytes"] / r["dense_bytes"], "retx": r["retrans"]}
            for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 workers only, smaller tensors")
    ap.add_argument("--targets", nargs="+", default=["soft", "bmv2"])
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.0001, 0.001, 0.01, 0.1])
    ap.add_argument("--size-soft", type=int, default=1 << 20)
    ap.add_argument("--size-bmv2", type=int, default=1 << 18)
    ap.add_argument("--iterations", type=int, default=2, help="timed, after one warm-up")
    ap.add_argument("--row-sparse", type=float, default=0.001, metavar="FRACTION",
                    help="one more row: this fraction of the rows of 64 elements non-zero "
                         "(an embedding gradient); 0 leaves it out")
    a = ap.parse_args(argv)
    if a.quick:
        a.workers, a.size_soft, a.size_bmv2 = [4], 1 << 18, 1 << 16
    if os.geteuid() != 0:
        print("aggregation: skipped, needs root (Mininet)")
        return 0
    from homagg.launcher.net import HomaggNet, NetError, NetOptions
    from homagg.targets.toolchain import missing

    rows, skipped = [], []
    t_start = time.monotonic()
    for target in a.targets:
        if target == "bmv2":
            gone = missing("p4c-bm2-ss", "simple_switch_grpc")
            if gone:
                skipped.append(f"bmv2 rows skipped: {gone}")
                continue
        n = a.size_soft if target == "soft" else a.size_bmv2
        for W in a.workers:
            opts = NetOptions(workers=W, target=target, log_dir=LOG_DIR / f"agg-{target}-{W}")
            try:
                with HomaggNet(opts) as net:
                    dense = run_config(net, W, n, 0.01, "dense", a.iterations)
                    cases = [(d, 1) for d in a.densities]
                    if a.row_sparse:
                        cases.append((a.row_sparse, 64))
                    for d, rows_of in cases:
                        flat = run_config(net, W, n, d, "auto", a.iterations, "flat", rows_of)
                        c = run_config(net, W, n, d, "auto", a.iterations, "hier", rows_of)
                        rows.append({"target": target, "workers": W, "n": n, "density": d,
                                     "rows_of": rows_of,
                                     "dense_eps": dense["eps"], "dense_retrans": dense["retrans"],
                                     "dense_bytes": dense["bytes"], **c,
                                     "flat_eps": flat["eps"], "flat_bytes": flat["bytes"],
                                     "exact": c["exact"] and flat["exact"] and dense["exact"],
                                     "speedup": c["eps"] / dense["eps"]})
                        print(f"[{time.monotonic() - t_start:5.0f} s] {target} W={W} "
                              f"d={d:.2%}: hier {c['eps']:.3g}, flat {flat['eps']:.3g}, dense "
                              f"{dense['eps']:.3g} el/s", file=sys.stderr, flush=True)
            except NetError as e:
                skipped.append(f"{target}, {W} workers: {e}")

    print(f"homagg aggregation throughput: fp32 elements all-reduced per second per worker "
          f"tensor (N x iterations / time), {a.iterations} timed iteration(s) after a warm-up, "
          f"{os.cpu_count()} CPUs, Mininet, no shaping; dense = agent --mode dense; compressed = "
          f"--mode auto with the flat bitmap index (flat) and the hierarchical one (hier); "
          f"every aggregate of every run checked against the exact integer sum")
    hdr = (f"{'target':>6} {'W':>2} {'N':>8} {'density':>9} {'mode':>6} {'dense el/s':>11} "
           f"{'flat el/s':>10} {'hier el/s':>10} {'hier/dense':>10} {'hier/flat':>9} "
           f"{'wire flat':>9} {'wire hier':>9} {'retx':>5} {'exact':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        dens = f"{r['density']:.2%}" + (f"r{r['rows_of']}" if r["rows_of"] > 1 else "")
        print(f"{r['target']:>6} {r['workers']:>2} {r['n']:>8} {dens:>9} "
              f"{r['mode']:>6} {r['dense_eps']:>11.3g} {r['flat_eps']:>10.3g} {r['eps']:>10.3g} "
              f"{r['speedup']:>9.1f}x {r['eps'] / r['flat_eps']:>8.2f}x "
              f"{r['flat_bytes'] / r['dense_bytes']:>9.2%} {r['bytes'] / r['dense_bytes']:>9.2%} "
              f"{r['retrans']:>5} {'yes' if r['exact'] else 'NO':>5}")
    for s in skipped:
        print(s)
    hit = [r for r in rows if r["density"] == 0.01 and r["workers"] == 8 and r["rows_of"] == 1]
    for r in hit:
        print(f"target check ({r['target']}, 1%, 8 workers): {r['speedup']:.1f}x "
              f"({'meets' if r['speedup'] >= 8 else 'misses'} the >= 8x target)")
    print(f"total {time.monotonic() - t_start:.0f} s")
    plots.write_plot("aggregation", plots.aggregation, figure_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
