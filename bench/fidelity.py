"""Fidelity benchmark: homagg's all-reduce (``simulate_allreduce``: the agents' whole logic on
the switch's arithmetic) against an fp32 all-reduce (np.float32 accumulation), both against
the exact float64 sum of the fp32 inputs; layers of very different magnitudes in one tensor.

    python -m bench.fidelity                      # 4 workers, layers 1e-1 .. 1e-10, 100K each
    python -m bench.fidelity --workers 8 --layer 50000 --block 256 --mode union

Per layer: the median relative error, and the fraction of non-zero exact sums returned as zero.
``--block N`` with N >= the tensor size gives one scale per tensor (the former scheme).
"""

from __future__ import annotations

import argparse

import numpy as np

from homagg.host_agent import codec, simulate_allreduce


def layer_stats(out: np.ndarray, exact: np.ndarray, layer: int) -> list[tuple[float, float]]:
    rows = []
    for k in range(exact.size // layer):
        o, e = out[k * layer:(k + 1) * layer], exact[k * layer:(k + 1) * layer]
        nz = e != 0
        rel = np.abs(o[nz].astype(np.float64) - e[nz]) / np.abs(e[nz])
        rows.append((float(np.median(rel)), float(np.mean(o[nz] == 0))))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--layer", type=int, default=100_000, help="elements per layer")
    ap.add_argument("--decades", type=int, default=10, help="layers 1e-1 .. 1e-DECADES")
    ap.add_argument("--block", type=int, default=codec.DEFAULT_BLOCK)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--index", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    scales = [10.0 ** -k for k in range(1, a.decades + 1)]
    xs = [np.concatenate([rng.normal(0, s, a.layer) for s in scales]).astype(np.float32)
          for _ in range(a.workers)]
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    sim = simulate_allreduce(xs, mode=a.mode, index=a.index, block=a.block)
    r = sim.results[0]
    f32 = np.zeros_like(xs[0])
    for x in xs:  # fp32 accumulation, as a ring/tree all-reduce in fp32 does
        f32 += x
    n = xs[0].size
    print(f"{a.workers} workers, {a.decades} layers of {a.layer} N(0, scale), block {a.block}: "
          f"homagg mode {r.mode}, index {r.index}, {sim.wire_bytes[0] / (4 * n):.4f} of dense "
          f"fp32 bytes")
    print(f"{'layer':>8} {'homagg median rel':>18} {'fp32 median rel':>16} "
          f"{'homagg zeros':>13} {'fp32 zeros':>11}")
    for s, (hm, hz), (fm, fz) in zip(scales, layer_stats(r.out, exact, a.layer),
                                     layer_stats(f32, exact, a.layer)):
        print(f"{s:8.0e} {hm:18.2e} {fm:16.2e} {hz:13.2e} {fz:11.2e}")


if __name__ == "__main__":
    main()
