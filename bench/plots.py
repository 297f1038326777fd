"""The benchmarks' figures, each drawn by one function here: a benchmark draws its figure as PNG
from a fresh run (``write_plot``), docs/figures/plots.py draws the same function as SVG from the
committed numbers (docs/figures/data/benchmarks.json).

Every figure takes its rows in one format: a dict per row keyed by the columns of the
benchmark's section in benchmarks.json (the table the benchmark prints). A benchmark converts
its own rows with its ``figure_rows``. Functions return the matplotlib figure; the caller saves
it. Needs matplotlib, imported only when a figure is drawn, so the benchmarks run without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"

STYLE = {"font.size": 8, "axes.spines.top": False, "axes.spines.right": False}


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display), with the figures' style."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(STYLE)
    return plt


def write_plot(name: str, draw: Callable[..., Any], rows: list[dict], *args: Any) -> Path | None:
    """If there are rows: ``draw(rows, *args)`` into bench/out/<name>.png and print its path."""
    if not rows:
        return None
    try:
        plt = pyplot()
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return None
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.png"
    fig = draw(rows, *args)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
    return path


def aggregation(rows: list[dict]):
    """bench.aggregation: elements/s, dense against compressed with the flat and the hier
    index, one panel per (target, workers)."""
    plt = pyplot()
    groups = list(dict.fromkeys((r["target"], r["workers"]) for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(3.75 * len(groups), 3.0), squeeze=False)
    for ax, (t, W) in zip(axes[0], groups):
        rs = [r for r in rows if r["target"] == t and r["workers"] == W]
        ax.bar([0], [rs[0]["dense_eps"] / 1e6], color="grey", label="dense")
        xs = range(1, len(rs) + 1)
        ax.bar([x - 0.2 for x in xs], [r["flat_eps"] / 1e6 for r in rs], 0.4,
               color="tab:orange", label="flat index")
        bars = ax.bar([x + 0.2 for x in xs], [r["hier_eps"] / 1e6 for r in rs], 0.4,
                      color="tab:blue", label="hier index")
        for b, r in zip(bars, rs):
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(),
                    f"{r['hier_eps'] / r['dense_eps']:.0f}x", ha="center", va="bottom",
                    fontsize=7)
        ax.set_xticks([0, *xs], ["dense"] + [r["density"] for r in rs], fontsize=7)
        ax.set_title(f"{t}, {W} workers, N = {rs[0]['n']}", fontsize=8)
        ax.set_xlabel("density per worker (x: hier over dense)")
    axes[0][0].set_ylabel("M fp32 elements/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("all-reduce throughput: compressed (auto) vs dense in-network", fontsize=9)
    fig.tight_layout()
    return fig


def training(rows: list[dict], title: str):
    """bench.training: median ms per iteration of each variant (x: speed vs gloo)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 2.8))
    colors = ["grey" if r["variant"].startswith("gloo") else
              "tab:blue" if "compressed" in r["variant"] else "tab:orange" for r in rows]
    bars = ax.bar(range(len(rows)), [r["median_ms"] for r in rows], color=colors)
    for b, r in zip(bars, rows):
        if r["vs_gloo"] is not None:
            ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{r['vs_gloo']:.1f}x",
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [r["variant"] for r in rows], rotation=15, ha="right",
                  fontsize=7)
    ax.set_ylabel("ms / iteration (median)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return fig


def tree(rows: list[dict], title: str):
    """bench.tree: bytes into the top switch and ms per all-reduce, star against leaf/spine,
    per target (x: tree / star)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(6.5, 2.8))
    targets = list(dict.fromkeys(r["target"] for r in rows))
    for k, t in enumerate(targets):
        star = next(r for r in rows if r["target"] == t and r["topo"] == "star")
        tr = next(r for r in rows if r["target"] == t and r["topo"] == "leafspine")
        for ax, key in ((axes[0], "top_rx_mb"), (axes[1], "ms_per_allreduce")):
            bars = ax.bar([3 * k, 3 * k + 1], [star[key], tr[key]],
                          color=["grey", "tab:blue"])
            ax.text(bars[1].get_x() + 0.4, bars[1].get_height(),
                    f"{tr[key] / star[key]:.2f}x", ha="center", va="bottom", fontsize=7)
    for ax in axes:
        ax.set_xticks([3 * k + d for k in range(len(targets)) for d in (0, 1)],
                      [f"{t}\n{n}" for t in targets for n in ("star", "tree")], fontsize=7)
    axes[0].set_ylabel("MB into the top switch")
    axes[1].set_ylabel("ms per all-reduce (median)")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    return fig


DDP_COLORS = ["grey", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]


def ddp_step(panels: list[tuple[str, list[dict]]]):
    """bench.ddp_step: ms per DDP step, one bar per variant (the rows' ``<variant>_ms``
    columns, ``_`` for a space) per (target, links), ticks under the middle one; one panel per
    (title, rows); x: gloo over homagg, where both are there."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(sum(len(rs) for _, rs in panels) * 4 / 3,
                                                      3.0),
                             gridspec_kw={"width_ratios": [len(rs) for _, rs in panels]},
                             squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        cols = list(dict.fromkeys(c for r in rows for c in r if c.endswith("_ms")))
        w = 0.81 / len(cols)
        for k, col in enumerate(cols):
            ax.bar([i + w * k for i in range(len(rows))],
                   [r.get(col, math.nan) for r in rows], w,
                   label=col[:-3].replace("_", " "), color=DDP_COLORS[k % len(DDP_COLORS)])
        for i, r in enumerate(rows):
            if all(math.isfinite(r.get(c, math.nan)) for c in ("gloo_ms", "homagg_ms")):
                ax.text(i + w * cols.index("homagg_ms"), r["homagg_ms"],
                        f"{r['gloo_ms'] / r['homagg_ms']:.1f}x", ha="center", va="bottom",
                        fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks([i + w * (len(cols) - 1) / 2 for i in range(len(rows))],
                      [f"{r['target']}\n{r['links']}" for r in rows], fontsize=7)
        ax.set_title(title, fontsize=8)
    axes[0][0].set_ylabel("ms per DDP step (median, rank 0)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("examples/ddp_train.py: DDP over gloo vs homagg's hook (x: gloo / homagg)",
                 fontsize=8)
    fig.tight_layout()
    return fig


def linerate(rows: list[dict]):
    """bench.linerate: payload Gbit/s per CPU core of each target, one group per K, with each
    bar's fraction of the C GSO/GRO loop's."""
    plt = pyplot()
    ks = sorted({r["k"] for r in rows})
    targets = list(dict.fromkeys(r["target"] for r in rows))
    colors = {"c-plain": "lightgrey", "c-gso": "grey", "python": "tab:orange",
              "native": "tab:blue", "agent-python": "moccasin", "agent-native": "lightblue"}
    fig, ax = plt.subplots(figsize=(5.5, 2.8))
    width = 0.8 / len(targets)
    for i, t in enumerate(targets):
        xs, ys, fr = [], [], []
        for j, k in enumerate(ks):
            r = next((r for r in rows if r["k"] == k and r["target"] == t), None)
            if r is not None:
                xs.append(j + (i - (len(targets) - 1) / 2) * width)
                ys.append(r["gbit_core"])
                fr.append(r["of_c_gso"])
        ax.bar(xs, ys, width, label=t, color=colors.get(t))
        for x, y, f in zip(xs, ys, fr):
            ax.text(x, y, f"{y:.1f}" if t.startswith("c-") else f"{f:.0%}", ha="center",
                    va="bottom", fontsize=6)
    ax.set_xticks(range(len(ks)), [f"K = {k}" for k in ks])
    ax.set_ylabel("payload Gbit/s per CPU core")
    ax.set_title("software aggregator (4 workers) and agent vs C UDP loops, loopback "
                 "(%: of the C GSO/GRO loop)", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def models(rows: list[dict]):
    """bench.models: each model's step speed against gloo's ring (gloo's step / homagg's), for
    homagg (mode auto) and homagg dense, one panel per link rate; log scale, 1x dashed."""
    plt = pyplot()
    links = list(dict.fromkeys(r["links"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(2.3 * len(links) + 0.6, 2.7),
                             sharey=True, squeeze=False)
    cols = [("homagg_s", "homagg", "tab:blue"), ("homagg_dense_s", "homagg dense", "tab:orange")]
    for ax, link in zip(axes[0], links):
        mine = [r for r in rows if r["links"] == link]
        for k, (col, label, color) in enumerate(cols):
            xs = [i + (k - 0.5) * 0.38 for i, r in enumerate(mine) if r.get(col)]
            ys = [r["gloo_s"] / r[col] for r in mine if r.get(col)]
            ax.bar(xs, ys, 0.38, label=label, color=color)
            for x, y in zip(xs, ys):
                ax.text(x, y, f"{y:.2g}x", ha="center", va="bottom", fontsize=6)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(mine)), [r["model"] for r in mine])
        ax.set_yscale("log")
        ax.set_title(link, fontsize=8)
    axes[0][0].set_ylabel("step speed vs gloo's ring")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle("the paper's four models, 4 workers, software target", fontsize=8)
    fig.tight_layout()
    return fig
