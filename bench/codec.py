"""Codec benchmark: wire bytes against dense fp32, and one worker's encode + decode time against a
numpy copy of the same fp32 tensor, measured in the same run (ratios travel; seconds do not).

    python -m bench.codec                 # N = 1M and 10M, densities 0.1%, 1%, 10%, 8 workers
    python -m bench.codec --sizes 1000000 --densities 0.01 --workers 4

Every row is also checked: the simulated job's sum must equal the integer sum bit for bit.
Each worker has an independent random support of the given density, so the union is larger than
any worker's support (about 1 - (1 - d)**W of the tensor).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import numpy as np

from homagg.host_agent import codec


def interleaved(fns, repeat: int) -> list[np.ndarray]:
    """Seconds per call of each fn, timed in turn (a, b, a, b, ...) so that all of them see the
    same machine state (frequency, caches, a noisy neighbour); one warm-up round first."""
    for fn in fns:
        fn()
    times = [np.empty(repeat) for _ in fns]
    for r in range(repeat):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t[r] = time.perf_counter() - t0
    return times


def make_workers(rng, n, workers, density):
    xs = []
    for _ in range(workers):
        x = np.zeros(n, np.float32)
        idx = rng.choice(n, max(1, int(n * density)), replace=False)
        x[idx] = rng.standard_normal(idx.size).astype(np.float32)
        xs.append(x)
    return xs


def one_worker(x, shift, union_words, agg, mode, seed, resid_agg=None):
    """Everything worker 0 computes for one all-reduce, given what the switch sends back: the
    same calls as ``Agent.allreduce_detailed`` (less the network)."""
    scan = codec.Scan.of(x)
    scan.max_exponent()
    n = scan.n
    codec.choose_mode(n, codec.union_size(union_words, n))
    s = scan.quantize(shift)
    if mode == "union":  # U is never listed: ranks and the output come from the bitmap
        codec.encode_union(s, union_words)
        return codec.decode_union(union_words, n, agg, shift, x.dtype)
    union = codec.union_indices(union_words, n)
    codec.encode_values(s, union, mode, seed)
    peeled = codec.decode_values(agg, union, mode, seed)
    values = peeled.values
    left = peeled.unresolved
    if left.size:
        codec.residual_values(s, union[left])
        values = values.copy()
        values[left] = resid_agg
    return codec.assemble(n, union, values, shift, x.dtype)


def run(sizes, densities, workers, repeat, seed=11):
    rng = np.random.default_rng(seed)
    header = (f"{'N':>10} {'density':>8} {'union':>7} {'mode':>7} {'exact':>5} "
              f"{'wire/dense':>10} {'peel rds':>8} {'unres':>6} {'copy ms':>8} "
              f"{'enc+dec ms':>10} {'x copy':>7} {'best x':>7}")
    print(f"homagg codec benchmark: {workers} workers, numpy {np.__version__}, codec and "
          f"x.copy() timed interleaved, {repeat} repetitions each; ms are medians, 'x copy' is "
          f"median/median, 'best x' best/best")
    print(header)
    print("-" * len(header))
    rows = []
    for n in sizes:
        for d in densities:
            xs = make_workers(rng, n, workers, d)
            e = max((codec.max_exponent(x) for x in xs), key=lambda v: -999 if v is None else v)
            shift = codec.shift_for(e, workers)
            sparse = [codec.Sparse.from_float(x, shift) for x in xs]
            ints = [s.to_dense() for s in sparse]
            exact = np.sum(np.stack(ints).astype(np.int64), axis=0)
            union_words = codec.switch_or([s.words for s in sparse])
            union = codec.union_indices(union_words, n)
            copy = xs[0].copy  # the baseline
            for mode in ("auto", "union", "sketch"):
                res = codec.simulate(ints, seed, mode=mode)
                ok = np.array_equal(res.total.astype(np.int64), exact)
                real = res.mode
                if real == "dense":
                    # Dense skips the codec entirely: quantize and dequantize only.
                    fn = lambda: codec.dequantize(codec.quantize(xs[0], shift), shift)  # noqa
                else:
                    agg = codec.switch_add(
                        [codec.encode_values(s, union, real, seed) for s in sparse], real)
                    resid = None
                    left = codec.decode_values(agg, union, real, seed).unresolved
                    if left.size:
                        resid = codec.switch_add(
                            [codec.residual_values(s, union[left]) for s in sparse], "residual")
                    out = one_worker(xs[0], shift, union_words, agg, real, seed, resid)
                    want = np.ldexp(exact.astype(np.float64), -shift).astype(np.float32)
                    ok = ok and np.array_equal(out.view(np.uint32), want.view(np.uint32))
                    fn = functools.partial(one_worker, xs[0], shift, union_words, agg, real,
                                           seed, resid)
                copy_ts, ts = interleaved([copy, fn], repeat)
                copy_t, t = np.median(copy_ts), np.median(ts)
                label = f"{mode}>{real}" if mode == "auto" else real
                print(f"{n:>10} {d:>8.3%} {res.u / n:>7.2%} {label:>7} "
                      f"{('yes' if ok else 'NO'):>5} "
                      f"{res.ratio:>10.2%} {res.peel_rounds:>8} {res.unresolved:>6} "
                      f"{copy_t * 1e3:>8.2f} {t * 1e3:>10.2f} {t / copy_t:>7.2f} "
                      f"{ts.min() / copy_ts.min():>7.2f}", flush=True)
                rows.append(dict(n=n, density=d, mode=label, exact=ok, ratio=res.ratio,
                                 time_ratio=t / copy_t))
    bad = [r for r in rows if not r["exact"]]
    if bad:
        print(f"NOT EXACT: {len(bad)} row(s)", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=15)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    return run(a.sizes, a.densities, a.workers, a.repeat)


if __name__ == "__main__":
    raise SystemExit(main())
