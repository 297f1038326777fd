"""The paper's four models side by side: NCF, an LSTM language model, VGG19 and BERT-base
trained by 4 workers with DDP, their gradients all-reduced by gloo's ring, through homagg
(the DDP hook, mode auto) and through homagg dense, in one ``homagg-net`` topology per
(target, link rate).

    sudo python -m bench.models                                  # soft, 100 Mbit/s and unshaped
    sudo python -m bench.models --targets soft,bmv2 --rates 100,1000,0
    sudo python -m bench.models --models ncf,lstm --shape tiny --steps 3   # a quick look
    sudo python -m bench.models --variants "gloo,homagg,homagg unpipelined"  # pipelining A/B
    sudo python -m bench.models --part 1048576   # homagg's long buckets in parts of 2^20
    sudo python -m bench.models --mtu 9000 --words 2176  # jumbo frames (gloo's too)
    sudo python -m bench.models --slots 64              # homagg's window at 64 slots

Per model and variant: the step time (rank 0's median after the first step), the compute
time (the same steps under ``no_sync``, measured first), the all-reduce's exposed time (step
minus compute), the elements all-reduced per second of that time (the model's parameters per
step: aggregation throughput), the bytes an agent sent per step against dense fp32 (gloo's
ring sends 2 (W - 1) / W of dense fp32 per worker), rank 0's peak resident memory, its CPU
time per step (``cpu ms``: every thread of its process, the median after the first step; the
four workers and, for homagg, the aggregator share the machine's cores), and the mode and index
each homagg bucket took. The models are ``bench.model_zoo``'s at ``--shape fit`` by default:
the paper's parameters (the same gradients cross the network), less compute per step (its doc
says how).

Needs root and Mininet; figures go to bench/out/models.json. Whether homagg's sum is exact
on these models is ``tests/test_models.py``'s business (20 steps each, bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench import plots
from bench.model_zoo import MODELS, SHAPES, parameters

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
LOG_DIR = ROOT / "build" / "logs" / "bench-models"
VARIANTS = [("gloo", ["--backend", "gloo"]), ("homagg", ["--backend", "hook"]),
            ("homagg dense", ["--backend", "hook", "--mode", "dense"]),
            ("homagg unpipelined", ["--backend", "hook", "--no-pipeline"])]


def run_variant(net, model: str, shape: str, args: list[str], steps: int, tag: str) -> dict:
    """bench.model_worker on every worker host at once; rank 0's summary."""
    procs = []
    for w, h in enumerate(net.worker_hosts()):
        env = {**os.environ, **net.worker_env(w), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "bench.model_worker", "--model", model, "--shape", shape,
               "--steps", str(steps), *args]
        procs.append(net.popen(h, cmd, net.opts.log_dir / f"{tag}-w{w}.out", env=env,
                               cwd=str(ROOT)))
    failed = [w for w, p in enumerate(procs) if p.wait(timeout=1800) != 0]
    out = (net.opts.log_dir / f"{tag}-w0.out").read_text()
    if failed:
        tail = (net.opts.log_dir / f"{tag}-w{failed[0]}.out").read_text()[-800:]
        raise RuntimeError(f"{tag}: workers {failed} failed:\n{tail}")
    line = next(x for x in out.splitlines() if x.startswith("summary "))
    return json.loads(line[len("summary "):])


def figures(s: dict, workers: int) -> dict:
    step = statistics.median(s["step_ms"][1:] or s["step_ms"])
    compute = statistics.median(s["compute_ms"][1:] or s["compute_ms"])
    exposed = max(step - compute, 1e-3)
    cpu = s.get("cpu_ms")
    return {"step_ms": step, "compute_ms": compute, "allreduce_ms": step - compute,
            "elements_per_s": s["params"] / (exposed / 1e3),
            "wire_vs_dense": (s["bytes_per_step"] / s["dense_bytes"]
                              if s["bytes_per_step"] is not None
                              else 2 * (workers - 1) / workers),
            "taken": s["taken"], "params": s["params"], "losses": s["losses"],
            "max_rss_mb": s.get("max_rss_mb"), "pipelined": s.get("pipelined"),
            "cpu_ms": statistics.median(cpu[1:] or cpu) if cpu else None}


def main(argv=None) -> int:
    from homagg.launcher.net import NetError, NetOptions, choose_target, preflight
    from homagg.launcher.tree import make_net

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="soft")
    ap.add_argument("--rates", default="100,0", help="Mbit/s per worker link; 0: unshaped")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--shape", choices=SHAPES, default="fit")
    ap.add_argument("--steps", type=int, default=4, help="timed steps (the first is warm-up)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--out", type=Path, default=OUT / "models.json")
    ap.add_argument("--variants", default=",".join(n for n, _ in VARIANTS[:3]),
                    help="which of gloo, homagg, homagg dense, homagg unpipelined (the hook's "
                    "buckets one at a time); gloo is every ratio's base")
    ap.add_argument("--words", type=int, default=None,
                    help="the switch's words per packet, K (default: the P4 program's)")
    ap.add_argument("--slots", type=int, default=None,
                    help="the job's slots on the switch, its window (default: homagg-net's "
                    "for the target)")
    ap.add_argument("--mtu", type=int, default=1500,
                    help="every link's MTU (homagg-net --mtu), gloo's as homagg's; 9000 for K "
                    "above 364")
    ap.add_argument("--part", type=int, default=None,
                    help="homagg: elements per part of a long bucket (AgentConfig.part; "
                    "default its own)")
    a = ap.parse_args(argv)
    models = a.models.split(",")
    part = [] if a.part is None else ["--part", str(a.part)]
    variants = [(n, args + (part if n != "gloo" else [])) for n, args in VARIANTS
                if n in a.variants.split(",")]
    if not variants:
        ap.error(f"--variants: some of {', '.join(n for n, _ in VARIANTS)}")
    for m in models:
        print(f"{m}: {parameters(m, a.shape) / 1e6:.1f}M parameters at shape {a.shape} "
              f"({parameters(m, 'paper') / 1e6:.1f}M at the paper's)", flush=True)
    preflight()
    rows = []
    t_start = time.monotonic()
    for target in a.targets.split(","):
        got, why = choose_target(target)
        if got != target:
            print(f"{target}: skipped ({why})")
            continue
        for rate in (float(r) for r in a.rates.split(",")):
            opts = NetOptions(target=target, workers=a.workers, bw=rate or None,
                              words=a.words, mtu=a.mtu, slots=a.slots)
            opts.log_dir = LOG_DIR / f"{target}-{int(rate)}"
            opts.log_dir.mkdir(parents=True, exist_ok=True)
            try:
                with make_net(opts) as net:
                    for m in models:
                        got_v: dict[str, dict] = {}
                        for name, args in variants:
                            tag = f"{m}-{name.replace(' ', '-')}"
                            print(f"[{time.monotonic() - t_start:6.0f} s] {target} "
                                  f"{rate or 'unshaped'}: {m}, {name}", flush=True)
                            got_v[name] = figures(run_variant(net, m, a.shape, args, a.steps,
                                                              tag), a.workers)
                        for name, f in got_v.items():
                            rows.append({"target": target, "rate_mbit": rate, "model": m,
                                         "words": a.words, "mtu": a.mtu,
                                         "slots": net.slots,
                                         "variant": name, **f,
                                         "vs_gloo": (got_v["gloo"]["step_ms"] / f["step_ms"]
                                                     if "gloo" in got_v else None)})
            except (NetError, RuntimeError) as e:
                print(f"{target} {rate or 'unshaped'}: failed: {e}")
    print(f"\n{a.workers} workers, shape {a.shape}, {a.steps} steps (median after the first), "
          f"K = {a.words or 'default'}, MTU {a.mtu}, slots {a.slots or 'default'}")
    print(f"{'target':6} {'links':>9} {'model':6} {'variant':18} {'ms/step':>9} "
          f"{'compute':>8} {'allreduce':>9} {'vs gloo':>8} {'wire/dense':>10} "
          f"{'elements/s':>11} {'peak MB':>8} {'cpu ms':>7}  buckets")
    for r in rows:
        link = f"{r['rate_mbit']:.0f} Mbit/s" if r["rate_mbit"] else "unshaped"
        print(f"{r['target']:6} {link:>9} {r['model']:6} {r['variant']:18} "
              f"{r['step_ms']:9.0f} {r['compute_ms']:8.0f} {r['allreduce_ms']:9.0f} "
              + (f"{r['vs_gloo']:7.2f}x " if r["vs_gloo"] is not None else f"{'-':>8} ")
              + f"{r['wire_vs_dense']:10.3f} {r['elements_per_s']:11.3g} "
              f"{r['max_rss_mb'] or 0:8.0f} {r.get('cpu_ms') or 0:7.0f}  "
              f"{', '.join(f'{k} {v}' for k, v in sorted(r['taken'].items()))}"
              + (f"; {r['pipelined']} fused" if r.get("pipelined") else ""))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1))
    print(f"\n{time.monotonic() - t_start:.0f} s; figures in {a.out}")
    plots.write_plot("models", plots.models, figure_rows(rows))
    return 0


def figure_rows(rows: list[dict]) -> list[dict]:
    """``plots.models``' rows (docs/figures/data/benchmarks.json's "models" columns): one per
    (target, link rate, model) that gloo ran, step seconds, rank 0's peak resident memory
    (MB) and its CPU per step (ms) per variant (None: not run)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        link = f"{r['rate_mbit']:.0f} Mbit/s" if r["rate_mbit"] else "unshaped"
        row = out.setdefault((r["target"], link, r["model"]),
                             {"model": r["model"], "links": link, "gloo_s": None,
                              "homagg_s": None, "homagg_dense_s": None,
                              "gloo_peak_mb": None, "homagg_peak_mb": None,
                              "homagg_dense_peak_mb": None, "gloo_cpu_ms": None,
                              "homagg_cpu_ms": None, "homagg_dense_cpu_ms": None})
        name = r["variant"].replace(" ", "_")
        row[f"{name}_s"] = r["step_ms"] / 1e3  # (plotted: the first three's)
        row[f"{name}_peak_mb"] = r.get("max_rss_mb")
        row[f"{name}_cpu_ms"] = r.get("cpu_ms")
    return [r for r in out.values() if r["gloo_s"]]


if __name__ == "__main__":
    raise SystemExit(main())
