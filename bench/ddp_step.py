"""DDP training step time: homagg's hook against plain DDP over gloo (issue 12, item 5a).

examples/ddp_train.py (EmbeddingBag(20000, 32) + MLP, 642k parameters, batches of 64 x 8
indices) on 4 workers (``--workers``) of the Mininet star, started on every worker host at once as
``homagg-net exec`` does (launcher.net.HomaggNet, worker_env). Per (target, link rate) one
topology, and in it, one after the other: plain DDP over gloo (ring all-reduce between the
hosts, through the same switch: a Linux bridge on the soft target, bmv2 forwarding on bmv2),
homagg's hook (mode auto, overlapped: HookState) and homagg dense (SwitchML-style, every
value through the switch). A step is rank 0's wall time for zero_grad + forward + backward
(the all-reduce) + the optimizer step; the table gives the median over steps after the first
3 (warm-up), and gloo's median over each row's: the speedup (>1: faster than gloo). Beside it,
rank 0's CPU per step (every thread of its process, after the warm-up): on a machine with
fewer cores than processes, the step is as fast as the sum of that over the workers allows.

    sudo python -m bench.ddp_step                     # soft and bmv2, unshaped and 100 Mbit/s
    sudo python -m bench.ddp_step --targets soft --rates 0 --steps 15
    sudo python -m bench.ddp_step --words 64,256      # homagg at K = 64 and 256 side by side
    sudo python -m bench.ddp_step --slots 64,256      # homagg's window at 64 and 256 slots
    sudo python -m bench.ddp_step --workers 2         # 2 workers (default 4)
    sudo python -m bench.ddp_step --topo leafspine    # 2 leaves of 2 workers under a spine
    sudo python -m bench.ddp_step --mtu 9000 --words 2176   # jumbo frames (gloo's too)
    sudo python -m bench.ddp_step --pipeline-ab       # + the hook's buckets one at a time

``--words``: the switch's words per packet (K); with several, each K gets its own topology
(gloo runs in the first), so a change of K is measured against gloo in the same run.
``--slots``: the job's slots on the switch, its window (default: homagg-net's for the target);
with several, each gets its own topology, as ``--words``.
``--mtu``: every link's MTU (homagg-net --mtu), for gloo as for homagg; 9000 for K above 364.
``--topo leafspine --leaves L --workers-per-leaf N``: the same on a tree of switches
(launcher.tree: homagg aggregates at the leaves and the spine; gloo's ring crosses the tree,
routed by the switches on bmv2); figures go to ddp_step_leafspine.json (.png).

Needs root and Mininet; the bmv2 rows need bmv2 and p4c and are skipped, with the reason,
where missing. Figures go to bench/out/ddp_step.json (and .png where matplotlib is
installed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

from bench import plots

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
LOG_DIR = ROOT / "build" / "logs" / "bench-ddp"
EXAMPLE = ROOT / "examples" / "ddp_train.py"
VARIANTS = [("gloo", ["--backend", "gloo"]), ("homagg", ["--backend", "hook"]),
            ("homagg dense", ["--backend", "hook", "--mode", "dense"])]
WARMUP = 3


def run_variant(net, args: list[str], steps: int, tag: str) -> tuple[list[float], float]:
    """The example on every worker host at once; rank 0's step times (ms), and its CPU
    (every thread's) per step after the example's warm-up (ms)."""
    procs = []
    for w, h in enumerate(net.worker_hosts()):
        env = {**os.environ, **net.worker_env(w), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, str(EXAMPLE), "--steps", str(steps), *args]
        procs.append(net.popen(h, cmd, net.opts.log_dir / f"{tag}-w{w}.out", env=env,
                               cwd=str(ROOT)))
    failed = [w for w, p in enumerate(procs) if p.wait(timeout=600) != 0]
    if failed:
        tail = (net.opts.log_dir / f"{tag}-w{failed[0]}.out").read_text()[-800:]
        raise RuntimeError(f"{tag}: workers {failed} failed:\n{tail}")
    out = (net.opts.log_dir / f"{tag}-w0.out").read_text()
    cpu = re.search(r"cpu ms/step (\S+)", out)
    return [float(ms) for ms in re.findall(r"loss \S+ ms (\S+)", out)], (
        float(cpu.group(1)) if cpu else float("nan"))


def links(rate_mbit: float) -> str:
    return f"{rate_mbit:.0f} Mbit/s" if rate_mbit else "unshaped"


def figure_rows(rows: list[dict]) -> list[dict]:
    """``rows`` in bench.plots' format, as in benchmarks.json: one row per (target, links), a
    ``<variant>_ms`` column per variant (``_`` for a space): the median ms per step."""
    out: dict[tuple, dict] = {}
    for r in rows:
        link = links(r["rate_mbit"])
        row = out.setdefault((r["target"], link), {"target": r["target"], "links": link})
        row[f"{r['variant'].replace(' ', '_')}_ms"] = r["ms_per_step"]
    return list(out.values())


def main(argv=None) -> int:
    from homagg.launcher.net import NetError, NetOptions, choose_target, preflight
    from homagg.launcher.tree import make_net

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="soft,bmv2")
    ap.add_argument("--rates", default="0,100", help="Mbit/s per worker link; 0: unshaped")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--words", default="", help="K values, e.g. 64,256 (default: the P4 "
                                                 "default only)")
    ap.add_argument("--slots", default="", help="the job's slots (its window), e.g. 64,256 "
                                                 "(default: homagg-net's for the target)")
    ap.add_argument("--mtu", type=int, default=1500,
                    help="every link's MTU, gloo's included (9000: jumbo frames, K up to 2239; "
                         "2176 on bmv2)")
    ap.add_argument("--workers", type=int, default=4, help="star: worker hosts")
    ap.add_argument("--topo", default="star", choices=["star", "leafspine"])
    ap.add_argument("--leaves", type=int, default=2, help="leafspine: leaf switches")
    ap.add_argument("--workers-per-leaf", type=int, default=2, help="leafspine: workers a leaf")
    ap.add_argument("--pipeline-ab", action="store_true",
                    help="also homagg's hook with its buckets one at a time (--no-pipeline)")
    a = ap.parse_args(argv)
    catalog = VARIANTS + ([("homagg unpipelined", ["--backend", "hook", "--no-pipeline"])]
                          if a.pipeline_ab else [])
    words: list[int | None] = [int(k) for k in a.words.split(",")] if a.words else [None]
    slots: list[int | None] = [int(s) for s in a.slots.split(",")] if a.slots else [None]
    settings = [(k, s) for k in words for s in slots]
    preflight()
    rows = []
    for target in a.targets.split(","):
        got, why = choose_target(target)
        if got != target:
            print(f"{target}: skipped ({why})")
            continue
        for rate in (float(r) for r in a.rates.split(",")):
            med: dict[str, float] = {}
            cpu: dict[str, float] = {}
            for i, (k, s) in enumerate(settings):
                opts = NetOptions(target=target, workers=a.workers, bw=rate or None, words=k,
                                  mtu=a.mtu, topo=a.topo, leaves=a.leaves,
                                  workers_per_leaf=a.workers_per_leaf, slots=s)
                opts.log_dir = (LOG_DIR / a.topo / f"{target}-{int(rate)}"
                                / f"k{k or 'default'}-s{s or 'default'}")
                opts.log_dir.mkdir(parents=True, exist_ok=True)
                label = (f" K={k}" if len(words) > 1 else "") + (
                    f" S={s}" if len(slots) > 1 else "")
                variants = [(n + ("" if n == "gloo" else label), args) for n, args in catalog
                            if n != "gloo" or i == 0]  # gloo depends on neither K nor slots
                try:
                    with make_net(opts) as net:
                        times = {n: run_variant(net, args, a.steps,
                                                n.replace(" ", "-").replace("=", ""))
                                 for n, args in variants}
                except (NetError, RuntimeError) as e:
                    print(f"{target} {rate or 'unshaped'}{label}: failed: {e}")
                    continue
                med.update({n: statistics.median(t[WARMUP:]) for n, (t, _) in times.items()})
                cpu.update({n: c for n, (_, c) in times.items()})
            for n, m in med.items():
                rows.append({"target": target, "rate_mbit": rate, "variant": n,
                             "ms_per_step": m, "cpu_ms_per_step": cpu[n],
                             "vs_gloo": med["gloo"] / m if "gloo" in med else None})
    name = "ddp_step" if a.topo == "star" else f"ddp_step_{a.topo}"
    print(f"\ntopology: {a.topo}" + (f", {a.leaves} leaves of {a.workers_per_leaf} workers"
                                     if a.topo != "star" else f", {a.workers} workers")
          + f", MTU {a.mtu}")
    print(f"\n{'target':7} {'links':>9} {'variant':19} {'ms/step':>8} {'speedup vs gloo':>16}"
          f" {'rank 0 cpu ms/step':>19}")
    for r in rows:
        link = links(r["rate_mbit"])
        vs = f"{r['vs_gloo']:15.2f}x" if r["vs_gloo"] is not None else f"{'-':>16}"
        print(f"{r['target']:7} {link:>9} {r['variant']:19} {r['ms_per_step']:8.1f} {vs}"
              f" {r['cpu_ms_per_step']:19.2f}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(rows, indent=1))
    where = (f"star, {a.workers} workers" if a.topo == "star" else
             f"leaf/spine, {a.leaves} x {a.workers_per_leaf}")
    plots.write_plot(name, plots.ddp_step, [(where, figure_rows(rows))])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
