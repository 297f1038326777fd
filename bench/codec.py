"""Codec benchmark: wire bytes against dense fp32, and one worker's encode + decode time against a
numpy copy of the same fp32 tensor, measured in the same run (ratios travel; seconds do not).

    python -m bench.codec                 # N = 1M and 10M, densities 0.1%, 1%, 10%, 8 workers
    python -m bench.codec --sizes 1000000 --densities 0.01 --workers 4
    python -m bench.codec --sizes 10000000 --densities 0.01 0.001 0.0001
    python -m bench.codec --sizes 2000000 --densities --dense    # the dense rows alone

Every row is also checked: the simulated job's sum must equal the integer sum bit for bit.
Each worker has an independent random support of the given density, so the union is larger than
any worker's support (about 1 - (1 - d)**W of the tensor); one more support per size is
row-sparse ("r64:0.1%": each worker has 0.1% of the rows of 64 elements, whole rows).
A dense row per size (all N non-zero, as a DDP bucket of a dense layer): one worker's
per-element work as the agent does it (``local.HostTensor``: round 1's reading, the words at
the block scales, the decode), checked against ``codec.quantize`` at every element's shift.
Each support runs with both indexes (``codec.index``): the flat bitmap (n/32 words, 1 round) and
the hierarchical one (3 rounds, its size follows the union); the time then includes building
the levels and rebuilding the union bitmap from the ORed levels.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time

import numpy as np

from homagg.host_agent import codec
from homagg.host_agent.local import HostTensor, Scales
from homagg.host_agent.simulate import simulate_ints, switch_add, switch_or


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


def make_row_workers(rng, n, workers, rows_of, fraction):
    xs = []
    rows = n // rows_of
    for _ in range(workers):
        x = np.zeros(n, np.float32)
        r = rng.choice(rows, max(1, int(rows * fraction)), replace=False)
        idx = (r[:, None] * rows_of + np.arange(rows_of)).ravel()
        x[idx] = rng.standard_normal(idx.size).astype(np.float32)
        xs.append(x)
    return xs


def ored_index(sparse, n, index):
    """What the switch returns in the index rounds: the ORed flat bitmap, or the ORed top, mid
    and leaf levels of the hierarchy."""
    if index == codec.FLAT:
        return switch_or([s.words for s in sparse])
    levels = [codec.Levels.of(s.words, n) for s in sparse]
    top = switch_or([lv.top for lv in levels])
    blocks = codec.union_blocks(top, n)
    mid = switch_or([lv.mid(blocks) for lv in levels])
    subs = codec.union_subblocks(blocks, mid)
    leaf = switch_or([lv.leaf(subs) for lv in levels])
    return top, mid, leaf


def worker_index(h, index, ored):
    """A worker's side of the index rounds (``h`` a ``HostTensor`` after its round 1), given
    the ORed levels: (union bitmap, index words)."""
    if index == codec.FLAT:
        return ored, ored.size
    top, mid, leaf = ored
    levels = h.levels()
    blocks = codec.union_blocks(top, h.n)
    levels.mid(blocks)
    subs = codec.union_subblocks(blocks, mid)
    levels.leaf(subs)
    return codec.union_bitmap(h.n, subs, leaf), top.size + mid.size + leaf.size


def one_worker(x, shift, index, ored, agg, mode, seed, resid_agg=None, out=None):
    """Everything worker 0 computes for one all-reduce, given what the switch sends back: the
    same calls as ``Agent.allreduce_detailed`` (less the network) on a ``HostTensor``: round
    1's reading, the index, the value words, the decode, block scales included (here every
    block's agreed shift is ``shift``: the same words and sums, the same per-block code
    path). ``out``: where the sum goes (``Agent.allreduce(x, out=...)``; the DDP hook's is
    the bucket's buffer)."""
    h = HostTensor(x)
    B = codec.DEFAULT_BLOCK
    h.round1(B, True, words=index == codec.FLAT)
    n = h.n
    scales = Scales(shift, np.zeros(codec.block_count(n, B), np.int64), B)
    union_words, index_words = worker_index(h, index, ored)
    codec.choose_mode(n, codec.union_size(union_words, n), index_words=index_words)
    if mode == "union":  # U is never listed: ranks and the output come from the bitmap
        h.value_words(codec.Mode.UNION, scales, union_words, None, seed, 1.0)
        return h.decode(agg, scales, codec.Mode.UNION, union_words, None, x.dtype, out)
    union = codec.union_indices(union_words, n)
    h.value_words(mode, scales, union_words, union, seed, codec.DEFAULT_RATIO)
    peeled = codec.decode_values(agg, union, mode, seed)
    values = peeled.values
    left = peeled.unresolved
    if left.size:
        h.residual_words(union[left])
        values = values.copy()
        values[left] = resid_agg
    return h.decode(values, scales, mode, union_words, union, x.dtype, out)


def supports(rng, n, densities, workers, rows_of, row_fraction):
    """(label, worker tensors): one independent random support per density, then row-sparse."""
    for d in densities:
        yield f"{d:.3%}", make_workers(rng, n, workers, d)
    if row_fraction > 0 and n >= rows_of:
        yield (f"r{rows_of}:{row_fraction:.1%}",
               make_row_workers(rng, n, workers, rows_of, row_fraction))


def _round1(x):
    return HostTensor(x).round1(codec.DEFAULT_BLOCK, True)


def dense_rows(sizes, workers, repeat, rng) -> list[dict]:
    """The dense rows: HostTensor's round 1, words and decode against x.copy()."""

    header = (f"{'N':>10} {'dense':>9} {'round 1':>8} {'words':>8} {'decode':>8} "
              f"{'copy ms':>8} {'all ms':>8} {'x copy':>7} {'exact':>5}")
    print(header)
    print("-" * len(header))
    rows = []
    for n in sizes:
        x = rng.standard_normal(n).astype(np.float32)
        h = HostTensor(x)
        r1 = h.round1(codec.DEFAULT_BLOCK, True)
        scales = Scales(codec.shift_for(r1.exponent, workers), codec.block_offsets(r1.blocks),
                        codec.DEFAULT_BLOCK)
        words = h.value_words(codec.Mode.DENSE, scales, None, None, 0, 1.0)
        ok = np.array_equal(words, codec.quantize(x, scales.elements(n)))
        parts = [functools.partial(_round1, x),
                 functools.partial(h.value_words, codec.Mode.DENSE, scales, None, None, 0, 1.0),
                 functools.partial(h.decode, words, scales, codec.Mode.DENSE, None, None,
                                   np.float32)]
        ts = interleaved([x.copy, *parts], repeat)
        copy_t, *med = [float(np.median(t)) for t in ts]
        total = sum(med)
        print(f"{n:>10} {'1.0':>9} {med[0] * 1e3:>8.2f} {med[1] * 1e3:>8.2f} "
              f"{med[2] * 1e3:>8.2f} {copy_t * 1e3:>8.2f} {total * 1e3:>8.2f} "
              f"{total / copy_t:>7.2f} {('yes' if ok else 'NO'):>5}", flush=True)
        rows.append(dict(n=n, density=1.0, index="-", mode="dense", exact=ok,
                         time_ratio=total / copy_t))
    return rows


def run(sizes, densities, workers, repeat, seed=11, rows_of=64, row_fraction=0.001,
        dense=True):
    rng = np.random.default_rng(seed)
    header = (f"{'N':>10} {'density':>9} {'union':>7} {'index':>5} {'mode':>7} {'exact':>5} "
              f"{'wire/dense':>10} {'peel rds':>8} {'unres':>6} {'copy ms':>8} "
              f"{'enc+dec ms':>10} {'x copy':>7} {'best x':>7} {'in place':>8} {'x copy':>7}")
    print(f"homagg codec benchmark: {workers} workers, numpy {np.__version__}, codec and "
          f"x.copy() timed interleaved, {repeat} repetitions each; ms are medians, 'x copy' is "
          f"median/median, 'best x' best/best; 'in place': the sum decoded into an array in "
          f"use (Agent.allreduce(x, out=...), as the DDP hook and the torch backend do), "
          f"'enc+dec' into a fresh one")
    if densities or row_fraction > 0:
        print(header)
        print("-" * len(header))
    rows = []
    for n in sizes:
        for d, xs in supports(rng, n, densities, workers, rows_of, row_fraction):
            e = max((codec.max_exponent(x) for x in xs), key=lambda v: -999 if v is None else v)
            shift = codec.shift_for(e, workers)
            sparse = [codec.Sparse.from_float(x, shift) for x in xs]
            ints = [s.to_dense() for s in sparse]
            exact = np.sum(np.stack(ints).astype(np.int64), axis=0)
            union_words = switch_or([s.words for s in sparse])
            union = codec.union_indices(union_words, n)
            copy = xs[0].copy  # the baseline
            oreds = {index: ored_index(sparse, n, index) for index in (codec.FLAT, codec.HIER)}
            for index, mode in itertools.product((codec.FLAT, codec.HIER),
                                                 ("auto", "union", "sketch")):
                res = simulate_ints(ints, seed, mode=mode, index=index)
                ok = np.array_equal(res.total.astype(np.int64), exact)
                ored = oreds[index]
                real = res.mode
                peel_rounds = 0
                if real == "dense":
                    # Dense skips the codec entirely: quantize and dequantize only.
                    fn = lambda: codec.dequantize(codec.quantize(xs[0], shift), shift)  # noqa
                    fn_in = fn
                else:
                    agg = switch_add(
                        [codec.encode_values(s, union, real, seed) for s in sparse], real)
                    resid = None
                    peeled = codec.decode_values(agg, union, real, seed)
                    left, peel_rounds = peeled.unresolved, peeled.rounds
                    if left.size:
                        resid = switch_add(
                            [codec.residual_values(s, union[left]) for s in sparse], "residual")
                    out = one_worker(xs[0], shift, index, ored, agg, real, seed, resid)
                    want = np.ldexp(exact.astype(np.float64), -shift).astype(np.float32)
                    ok = ok and np.array_equal(out.view(np.uint32), want.view(np.uint32))
                    h0 = HostTensor(xs[0])
                    h0.round1(codec.DEFAULT_BLOCK, True)
                    ok = ok and np.array_equal(worker_index(h0, index, ored)[0], union_words)
                    fn = functools.partial(one_worker, xs[0], shift, index, ored, agg, real,
                                           seed, resid)
                    buf = np.zeros_like(xs[0])  # (in use: its pages touched)
                    fn_in = functools.partial(fn, out=buf)
                    fn_in()
                    ok = ok and np.array_equal(buf.view(np.uint32), want.view(np.uint32))
                copy_ts, ts, in_ts = interleaved([copy, fn, fn_in], repeat)
                copy_t, t, in_t = np.median(copy_ts), np.median(ts), np.median(in_ts)
                label = f"{mode}>{real}" if mode == "auto" else real
                print(f"{n:>10} {d:>9} {res.u / n:>7.2%} {index:>5} {label:>7} "
                      f"{('yes' if ok else 'NO'):>5} "
                      f"{res.ratio:>10.2%} {peel_rounds:>8} {res.unresolved:>6} "
                      f"{copy_t * 1e3:>8.2f} {t * 1e3:>10.2f} {t / copy_t:>7.2f} "
                      f"{ts.min() / copy_ts.min():>7.2f} {in_t * 1e3:>8.2f} "
                      f"{in_t / copy_t:>7.2f}", flush=True)
                rows.append(dict(n=n, density=d, index=index, mode=label, exact=ok,
                                 ratio=res.ratio, time_ratio=t / copy_t,
                                 in_place_ratio=in_t / copy_t))
    if dense:
        rows += dense_rows(sizes, workers, repeat, rng)
    bad = [r for r in rows if not r["exact"]]
    if bad:
        print(f"NOT EXACT: {len(bad)} row(s)", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--densities", type=float, nargs="*", default=[0.001, 0.01, 0.1])
    p.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True,
                   help="the dense rows (HostTensor's per-element work), after the others")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--rows-of", type=int, default=64,
                   help="row-sparse support: rows of this many elements")
    p.add_argument("--row-fraction", type=float, default=0.001,
                   help="row-sparse support: this fraction of the rows per worker (0: none)")
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    return run(a.sizes, a.densities, a.workers, a.repeat, rows_of=a.rows_of,
               row_fraction=a.row_fraction if a.densities else 0.0, dense=a.dense)


if __name__ == "__main__":
    raise SystemExit(main())
