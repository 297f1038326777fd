"""Draw every figure under docs/figures/ (SVG) from committed data, with matplotlib.

    python docs/figures/plots.py            # all figures
    python docs/figures/plots.py models sequence   # some of them (names: see FIGURES)

The benchmark figures are drawn by bench/plots.py, the functions the benchmarks draw their PNGs
with, from ``docs/figures/data/benchmarks.json``: the numbers the benchmarks printed on the
machine that docs/performance.md describes, each section with the command that produced it
(rerun that command to get new numbers, update the JSON, rerun this script). The topology and
the packet sequence are drawn from the protocol's rules, not data.
Needs matplotlib (``pip install -e ".[bench]"``); no root, no network.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "benchmarks.json"


def _bench_plots():
    """bench/plots.py, loaded from its file (it imports nothing of the repository's): this
    script runs as a file, with no package of its own to import it from."""
    spec = importlib.util.spec_from_file_location("bench.plots",
                                                  HERE.parents[1] / "bench" / "plots.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = _bench_plots()

plt = figures.pyplot()
plt.rcParams.update({
    "svg.fonttype": "none",      # text stays text: small files
    "svg.hashsalt": "homagg",    # stable ids: a rerun rewrites identical files
})


def _data() -> dict:
    return json.loads(DATA.read_text())


def _rows(section: dict) -> list[dict]:
    return [dict(zip(section["columns"], r)) for r in section["rows"]]


def _save(fig, name: str) -> Path:
    path = HERE / f"{name}.svg"
    fig.savefig(path, metadata={"Date": None, "Creator": "docs/figures/plots.py"})
    plt.close(fig)
    return path


def aggregation() -> Path:
    return _save(figures.aggregation(_rows(_data()["aggregation"])), "aggregation")


def switch_cost() -> Path:
    import matplotlib.ticker

    sec = _data()["switch_cost"]
    rows = _rows(sec)
    fig, (ax, jx) = plt.subplots(1, 2, figsize=(8.5, 2.8), width_ratios=[1.4, 1])
    modes = ["window", "blast"]
    for i, prog in enumerate(["l2fwd", "homagg"]):
        med = [sorted(r[f"{prog}_pps"] for r in rows if r["mode"] == m)[1] / 1e3
               for m in modes]
        xs = [j + (i - 0.5) * 0.38 for j in range(len(modes))]
        ax.bar(xs, med, 0.38, label=prog, color="grey" if prog == "l2fwd" else "tab:blue")
        for x, v in zip(xs, med):
            ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
    ratio = {m: sorted(r["homagg_pps"] / r["l2fwd_pps"] for r in rows if r["mode"] == m)[1]
             for m in modes}
    ax.set_xticks(range(len(modes)), [f"{m} (homagg/l2fwd {ratio[m]:.0%})" for m in modes])
    ax.set_ylabel("kpackets/s out of bmv2 (median of 3)")
    ax.set_title("bmv2, K = 256: homagg.p4 (1-worker job) vs minimal L2 forwarding",
                 fontsize=8)
    ax.legend(fontsize=7)
    # jumbo frames, another run: elements/s of a 4-worker job at K = 256 and 2240
    j = sec["jumbo"]["four_worker_job"]
    ks = ["256", "2240"]
    frames = sec["jumbo"]["frame_bytes"]
    for i, (name, key) in enumerate([("l2fwd payload", "l2fwd_k{}_eps"),
                                     ("homagg 4 workers", "k{}_eps")]):
        vals = [j[key.format(k)] / 1e6 for k in ks]
        xs = [n + (i - 0.5) * 0.38 for n in range(len(ks))]
        jx.bar(xs, vals, 0.38, label=name, color="grey" if i == 0 else "tab:blue")
        for x, v in zip(xs, vals):
            jx.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
    jx.set_yscale("log")
    jx.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    jx.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    jx.set_ylim(1, 200)
    jx.set_xticks(range(len(ks)), [f"K = {k} ({frames[k]} B frames)\nhomagg/l2fwd "
                                   f"{j[f'k{k}_pct_of_l2fwd']:.1f}%" for k in ks])
    jx.set_ylabel("M elements/s (log)")
    jx.set_title(f"jumbo frames (one run): K = 2240 moves {j['k2240_over_k256']:.2f}x\n"
                 "the elements/s of K = 256", fontsize=8)
    jx.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, "switch_cost")


def ddp_step() -> Path:
    d = _data()
    fig = figures.ddp_step([("star, 4 workers", _rows(d["ddp_step"])),
                            ("leaf/spine, 2 x 2", _rows(d["ddp_step_leafspine"]))])
    return _save(fig, "ddp_step")


def _grouped_bars(ax, rows: list[dict], cols, scale: float = 1.0) -> None:
    """One bar per (row, column), the columns of a row side by side; ``cols``: (key, label,
    colour). Ticks go under each row's middle bar."""
    w = 0.27
    for k, (col, label, color) in enumerate(cols):
        ax.bar([i + w * k for i in range(len(rows))], [r[col] / scale for r in rows], w,
               label=label, color=color)
    ax.set_xticks([i + w for i in range(len(rows))], [""] * len(rows))


def linerate() -> Path:
    return _save(figures.linerate(_rows(_data()["linerate"])), "linerate")


def models() -> Path:
    return _save(figures.models(_rows(_data()["models"])), "models")


def codec() -> Path:
    rows = _rows(_data()["codec"])
    fig, ax = plt.subplots(figsize=(5.5, 2.6))
    cols = [("union_pct", "union u/n", "grey"), ("flat_pct", "flat index", "tab:orange"),
            ("hier_pct", "hier index", "tab:blue")]
    _grouped_bars(ax, rows, cols)
    ax.set_yscale("log")
    ax.set_xticklabels([r["density"].replace(", ", "\n") for r in rows], fontsize=7)
    ax.set_ylabel("% of dense fp32 bytes")
    ax.set_title("wire bytes per worker, 8 workers, N = 10M (simulator)", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, "codec")


def reliability() -> Path:
    rows = _rows(_data()["reliability"])
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(7, 2.8))
    for ax, col, label in ((axes[0], "retransmissions", "retransmissions (100 iterations)"),
                           (axes[1], "seconds", "seconds for the run")):
        for k, t in enumerate(["soft", "bmv2"]):
            ys = [next(r[col] for r in rows if r["case"] == c and r["target"] == t)
                  for c in cases]
            ax.bar([i + 0.38 * k for i in range(len(cases))], ys, 0.38, label=t,
                   color="tab:blue" if t == "soft" else "tab:orange")
        ax.set_xticks([i + 0.19 for i in range(len(cases))],
                      [c.replace(" + ", "\n+ ") for c in cases], fontsize=6)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle("faults injected at the agents' sockets, 4 workers: every sum exact",
                 fontsize=8)
    fig.tight_layout()
    return _save(fig, "reliability")


def topology() -> Path:
    """The launcher's leaf/spine topology (--topo leafspine --leaves 2 --workers-per-leaf 4)."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.set_axis_off()
    ax.set_xlim(-0.5, 8.5)
    ax.set_ylim(-0.9, 3.3)

    def box(x, y, text, color, w=1.6, h=0.5):
        ax.add_patch(plt.Rectangle((x - w / 2, y - h / 2), w, h, facecolor=color,
                                   edgecolor="black", linewidth=0.8))
        ax.text(x, y, text, ha="center", va="center", fontsize=7)

    spine = (4.0, 2.8)
    leaves = [(2.0, 1.5), (6.0, 1.5)]
    box(*spine, "spine s1\n10.0.0.254", "#cfe2f3", w=1.8)
    box(7.6, 2.8, "fb: fallback\n10.0.0.253", "#eeeeee", w=1.5)
    ax.plot([spine[0] + 0.9, 7.6 - 0.75], [2.8, 2.8], color="grey", linewidth=0.8,
            linestyle="--")
    for i, (lx, ly) in enumerate(leaves):
        box(lx, ly, f"leaf{i + 1} s{i + 2}\n10.0.0.{200 + i}", "#d9ead3", w=1.8)
        ax.annotate("", xy=(spine[0], spine[1] - 0.25), xytext=(lx, ly + 0.25),
                    arrowprops={"arrowstyle": "<->", "color": "tab:blue", "linewidth": 1.0})
        ax.text((lx + spine[0]) / 2 + (-0.75 if i == 0 else 0.75), 2.15,
                "one partial sum per round\nup; the final down", ha="center", fontsize=6,
                color="tab:blue")
        for k in range(4):
            wx = lx - 1.5 + k
            n = 4 * i + k + 1
            box(wx, 0.0, f"h{n}\n10.0.0.{n}", "white", w=0.85, h=0.45)
            ax.plot([wx, lx], [0.23, ly - 0.25], color="black", linewidth=0.6)
    ax.text(4.0, -0.55, "each worker sends to its leaf; a leaf sums its 4 workers and is one "
            "worker of the spine's job;\nthe spine's result comes back down and each leaf "
            "multicasts it", ha="center", va="top", fontsize=6)
    fig.tight_layout()
    return _save(fig, "topology")


def sequence() -> Path:
    """One tensor's rounds between 3 workers and a switch, with a lost result retransmitted."""
    cols = {"h1": 0.0, "h2": 1.0, "h3": 2.0, "switch": 4.6}
    fig, ax = plt.subplots(figsize=(7, 6.0))
    ax.set_axis_off()
    y = 0.0
    step = 0.32

    def up(src, label="", color="black"):
        nonlocal y
        x0, x1 = cols[src], cols["switch"]
        ax.annotate("", xy=(x1, y - step * 0.8), xytext=(x0, y),
                    arrowprops={"arrowstyle": "->", "color": color, "linewidth": 0.9})
        if label:
            xm = (cols["h3"] + x1) / 2
            ym = y - step * 0.8 * (xm - x0) / (x1 - x0)
            ax.text(xm, ym + 0.02, label, fontsize=6, color=color, ha="center",
                    va="bottom", rotation=-2)
        y -= step

    def multicast(dsts, color, label="result multicast", lost=()):
        nonlocal y
        x0 = cols["switch"]
        for k, d in enumerate(dsts):
            x1 = cols[d]
            yy = y - 0.12 * k
            if d in lost:
                mid = (x0 + x1) / 2 + 0.6
                ax.plot([x0, mid], [yy, yy - step * 0.4], color=color, linewidth=0.9,
                        linestyle="--")
                ax.text(mid, yy - step * 0.4, "x lost", fontsize=7, color="red",
                        ha="right", va="center")
            else:
                ax.annotate("", xy=(x1, yy - step * 0.8), xytext=(x0, yy),
                            arrowprops={"arrowstyle": "->", "color": color,
                                        "linewidth": 0.9})
        ax.text(x0 - 0.1, y + 0.04, label, fontsize=6, color=color, ha="right",
                va="bottom")
        y -= step + 0.12 * len(dsts)

    def note(text):
        ax.text(cols["switch"] + 0.12, y + step * 0.6, text, fontsize=6, va="center",
                ha="left")

    def phase(text):
        nonlocal y
        y -= 0.25
        ax.plot([-0.4, cols["switch"] + 1.9], [y, y], color="lightgrey", linewidth=0.6)
        ax.text(-0.4, y + 0.03, text, fontsize=7, weight="bold", ha="left", va="bottom",
                color="dimgrey")
        y -= 0.2

    phase("join: once per run")
    up("h1", "JOIN (header only, a nonce)")
    up("h2")
    up("h3")
    note("all 3 joined: hand out generation g")
    multicast(["h1", "h2", "h3"], "black", label="reply: gen g, K words")
    phase("OR round: exponents, NaN/Inf bit, block words, non-zero bitmap")
    up("h1", "OP_OR  slot 0, seq 1 (copy 1)", "tab:purple")
    up("h2", color="tab:purple")
    up("h3", color="tab:purple")
    note("3 of 3: OR complete")
    multicast(["h1", "h2", "h3"], "tab:purple")
    phase("ADD round: int32 values (dense, union or sketch)")
    up("h1", "OP_ADD  slot 0, seq 2 (copy 0)", "tab:blue")
    up("h2", color="tab:blue")
    up("h3", color="tab:blue")
    note("3 of 3: int32 sum, overflow flag")
    multicast(["h1", "h2", "h3"], "tab:blue", lost=("h2",))
    phase("h1 and h3 go on: slot 0's next round uses the other copy")
    up("h1", "OP_ADD  slot 0, seq 3 (copy 1)", "tab:green")
    up("h3", color="tab:green")
    note("copy 0 still holds seq 2's result (the shadow copy)")
    phase("h2 hears nothing within its retransmission timeout")
    up("h2", "seq 2 again: already counted", "tab:red")
    note("not added again: the result is answered from copy 0")
    multicast(["h2"], "tab:red", label="FLAG_RETRANS, unicast to h2")
    up("h2", "OP_ADD  slot 0, seq 3 (copy 1)", "tab:green")
    note("3 of 3: seq 3 complete")
    multicast(["h1", "h2", "h3"], "tab:green")
    for name, x in cols.items():
        ax.text(x, 0.35, name, ha="center", fontsize=8, weight="bold")
        ax.plot([x, x], [y, 0.25], color="grey", linewidth=0.6, zorder=0)
    ax.set_xlim(-0.5, cols["switch"] + 2.0)
    ax.set_ylim(y - 0.1, 0.6)
    fig.tight_layout()
    return _save(fig, "sequence")


FIGURES: dict[str, Callable[[], Path]] = {
    "aggregation": aggregation, "switch_cost": switch_cost, "ddp_step": ddp_step,
    "codec": codec,
    "reliability": reliability, "topology": topology, "sequence": sequence,
    "linerate": linerate, "models": models,
}


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(FIGURES)
    for n in names:
        if n not in FIGURES:
            print(f"unknown figure {n!r}; one of {', '.join(FIGURES)}", file=sys.stderr)
            return 2
        print(FIGURES[n]().relative_to(HERE.parent.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
