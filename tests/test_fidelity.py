"""Float fidelity of the whole all-reduce (``simulate_allreduce``: the agents' full logic on the
switch's arithmetic, in memory), with block floating point scales (``codec.blocks``): as good
as an fp32 all-reduce on layers of very different magnitudes in one flat tensor."""

from __future__ import annotations

import time

import numpy as np
import pytest

from homagg import wire
from homagg.host_agent import AgentError, codec, simulate_allreduce
from homagg.host_agent.negotiation import HEAD_WORDS

WORKERS = 4
LAYER = 20_000
SCALES = [10.0 ** -k for k in range(1, 11)]  # 1e-1 .. 1e-10


def layered(seed, workers=WORKERS, layer=LAYER, scales=SCALES):
    rng = np.random.default_rng(seed)
    return [np.concatenate([rng.normal(0, s, layer) for s in scales]).astype(np.float32)
            for _ in range(workers)]


def fidelity(out, exact, layer=LAYER):
    """Per layer: median relative error against the exact sum, and the fraction of non-zero
    exact sums returned as zero."""
    med, zero = [], []
    for k in range(exact.size // layer):
        o, e = out[k * layer:(k + 1) * layer], exact[k * layer:(k + 1) * layer]
        nz = e != 0
        med.append(float(np.median(np.abs(o[nz] - e[nz]) / np.abs(e[nz]))))
        zero.append(float(np.mean(o[nz] == 0)))
    return np.array(med), np.array(zero)


def assert_exact(sim, xs, delta=0, split=True):
    """Bit for bit the integer sum at the negotiated per-block shifts (plus ``delta``: the
    shift bias less the rescales), on every worker."""
    r0 = sim.results[0]
    np.testing.assert_array_equal(r0.block_shifts,
                                  codec.agreed_shifts(xs, block=r0.block) + delta)
    np.testing.assert_array_equal(r0.shift, codec.agreed_shifts(xs, block=r0.block, split=True,
                                                                enabled=split) + delta)
    expect = np.sum([codec.quantize(x, r0.shift).astype(np.int64) for x in xs], axis=0)
    for r in sim.results:
        np.testing.assert_array_equal(r.shift, r0.shift)
        np.testing.assert_array_equal(r.ints(), expect)
        np.testing.assert_array_equal(r.out, codec.scale_blocks(expect, r.shift, 1))


@pytest.mark.parametrize("mode,index", [("auto", "auto"), ("dense", "auto"), ("union", "flat"),
                                        ("sketch", "hier")])
def test_layers_from_1e_1_to_1e_10_are_as_good_as_fp32(mode, index):
    xs = layered(1)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    sim = simulate_allreduce(xs, mode=mode, index=index)
    assert_exact(sim, xs)
    med, zero = fidelity(sim.out[0], exact)
    assert med.max() <= 1e-6, med
    assert zero.max() <= 1e-4, zero
    # the fp32 all-reduce it is held to: same order of magnitude
    f32 = np.sum(np.stack(xs), axis=0, dtype=np.float32)
    med32, _ = fidelity(f32, exact)
    assert med.max() <= 10 * med32.max()


def test_one_scale_per_tensor_is_what_the_blocks_fix():
    xs = layered(2)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    n = xs[0].size
    one = simulate_allreduce(xs, mode="dense", block=n, split=False)  # the old single scale
    assert_exact(one, xs, split=False)
    med, zero = fidelity(one.out[0], exact)
    assert med[6] > 1e-2 and zero[-1] > 0.5  # 1e-7: percent errors; 1e-10: mostly zeros


def test_block_words_cost_under_1_percent_of_dense():
    xs = layered(3)
    n = xs[0].size
    sim = simulate_allreduce(xs, mode="dense")
    K = wire.WORDS_PER_PACKET
    dense_packets = -(-n // K)
    nb = codec.block_count(n, codec.DEFAULT_BLOCK)
    round1 = -(-(HEAD_WORDS + nb + -(-nb // 32)) // K)  # head, blocks, split flags
    split = sim.results[0].rounds.get("split", 0)  # blocks that straddle two layers, if any
    split_packets = -(-split // K)
    assert sim.wire_bytes[0] == (dense_packets + round1 + split_packets) * wire.PACKET_BYTES
    assert (round1 + split_packets) / dense_packets <= 0.01


@pytest.mark.parametrize("block", [128, 256, 1000, 4096])
@pytest.mark.parametrize("mode,index", [("union", "hier"), ("sketch", "flat"), ("dense", "auto")])
def test_other_block_sizes_stay_exact(mode, index, block):
    rng = np.random.default_rng(4)
    xs = []
    for _ in range(3):
        x = np.zeros(50_003, np.float32)
        idx = rng.choice(x.size, 2000, replace=False)
        x[idx] = rng.standard_normal(idx.size) * 10.0 ** rng.integers(-12, 3, idx.size)
        xs.append(x)
    sim = simulate_allreduce(xs, mode=mode, index=index, block=block)
    assert_exact(sim, xs)
    assert all(np.array_equal(o, sim.out[0]) for o in sim.out)


def test_workers_with_different_maxima_stay_exact_and_never_overflow():
    # worker 1's tensor is 1e6 times smaller: its offsets are relative to its own max, so
    # the job's block scales can only be coarser than ideal, never finer (no overflow)
    xs = layered(5, workers=3)
    xs[1] = xs[1] * np.float32(1e-6)
    sim = simulate_allreduce(xs, mode="union", index="hier")
    assert_exact(sim, xs)
    assert all(a == 0 for a in (r.tensor_shift - sim.results[0].tensor_shift
                                for r in sim.results))


def test_rescale_lowers_every_block_together():
    xs = layered(6)
    sim = simulate_allreduce(xs, mode="dense", shift_bias=7)
    ref = simulate_allreduce(xs, mode="dense")
    steps = (ref.results[0].tensor_shift + 7 - sim.results[0].tensor_shift)
    assert steps > 0 and steps % 4 == 0
    assert_exact(sim, xs, delta=7 - steps)
    np.testing.assert_array_equal(sim.results[0].block_shifts,
                                  ref.results[0].block_shifts + 7 - steps)


def test_a_worker_failing_stops_its_peers_at_once():
    xs = layered(7, workers=2, layer=1000)
    xs[0][5] = 3.0e3  # a local value out of int32 at 7 bits too fine: worker 0 raises
    t0 = time.monotonic()
    with pytest.raises(AgentError, match="index 5"):
        simulate_allreduce(xs, mode="union", shift_bias=7, deadline=30)
    assert time.monotonic() - t0 < 5  # worker 1 did not wait for the 30 s deadline


# -- blocks that straddle a small layer and a large one (a flat bucket's parameter boundary) ---

def bucket(seed, workers=WORKERS):
    """A DDP-like flat bucket: layers from 1e-1 down to 1e-10 of lengths that are not
    multiples of the block (some far shorter than one), a 7-element layer of 1e-10 between
    two layers of 1e-1, then a sparse tail at 1e-1: every small layer shares blocks with
    much larger neighbours. Returns (per-worker tensors, the layers' (start, end))."""
    rng = np.random.default_rng(seed)
    lens = [20011, 3001, 777, 12345, 999, 5003, 257, 40000, 1234, 9999, 131, 7, 301]
    scales = [10.0 ** -k for k in range(1, 11)] + [1e-1, 1e-10, 1e-1]
    bounds = np.cumsum([0] + lens)
    xs = []
    for _ in range(workers):
        tail = np.zeros(200_000)
        at = rng.choice(tail.size, 1000, replace=False)
        tail[at] = rng.normal(0, 1e-1, at.size)
        xs.append(np.concatenate([rng.normal(0, s, n) for s, n in zip(scales, lens)]
                                 + [tail]).astype(np.float32))
    return xs, list(zip(bounds[:-1], bounds[1:]))


def layer_fidelity(out, exact, layers):
    med, zero = [], []
    for a, b in layers:
        o, e = out[a:b], exact[a:b]
        nz = e != 0
        med.append(float(np.median(np.abs(o[nz] - e[nz]) / np.abs(e[nz]))))
        zero.append(float(np.mean(o[nz] == 0)))
    return np.array(med), np.array(zero)


@pytest.mark.parametrize("mode,index", [("auto", "auto"), ("dense", "auto"), ("union", "flat"),
                                        ("sketch", "hier"), ("union", "hier")])
def test_a_small_layer_next_to_a_large_one_keeps_its_own_scale(mode, index):
    xs, layers = bucket(8)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    sim = simulate_allreduce(xs, mode=mode, index=index)
    assert_exact(sim, xs)
    assert sim.results[0].rounds.get("split", 0) > 0  # the straddling blocks split
    med, zero = layer_fidelity(sim.out[0], exact, layers)
    assert med.max() <= 1e-6, med
    assert zero.max() <= 1e-4, zero
    # and it costs: the negotiation and the split round under 1% of dense bytes
    n = xs[0].size
    r = sim.results[0].rounds
    values = sum(v for k, v in r.items() if k in ("dense", "union", "sketch", "residual")
                 or k.startswith("index") or k == codec.ROUND_FLAT)
    assert sim.wire_bytes[0] / wire.PACKET_BYTES * wire.WORDS_PER_PACKET - values <= 0.01 * n


def test_without_the_split_the_small_layers_at_a_boundary_are_crushed():
    # the case above with the split turned off: what the split fixes, so the test above can
    # fail
    xs, layers = bucket(8)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    sim = simulate_allreduce(xs, mode="dense", split=False)
    assert "split" not in sim.results[0].rounds
    _, zero = layer_fidelity(sim.out[0], exact, layers)
    assert zero[9] > 0.01 and zero[11] == 1.0  # the 1e-10 layers beside a 1e-1 one


def test_normal_layers_do_not_split():
    # N(0, 1) values: a run of SPLIT_RUN values 8 binades below the block's peak is too rare
    # to happen, so a plain tensor pays no split round
    rng = np.random.default_rng(9)
    xs = [rng.normal(0, 1, 2_000_003).astype(np.float32) for _ in range(WORKERS)]
    sim = simulate_allreduce(xs, mode="dense")
    assert "split" not in sim.results[0].rounds
    assert_exact(sim, xs)


def test_split_flags_want_a_run_of_small_values_in_one_block():
    R, B = codec.blocks.SPLIT_RUN, 32
    x = np.zeros(5 * B, np.float32)
    x[::B] = 1.0            # each block's peak
    x[2:1 + R] = 1e-4       # block 0: a run of R - 1 small values: no split
    x[B + 4:B + 4 + R] = 1e-4            # block 1: a run of R: split
    x[2 * B + 2:2 * B + 2 + 2 * R:2] = 1e-4  # block 2: R small values, not consecutive
    x[3 * B + 5:3 * B + 5 + R] = 1e-3    # block 3: a run of R, 2**-10 below: split
    x[5 * B - R + 2:5 * B] = 1e-4        # block 4's end, R - 2 values ...
    x[4 * B + 1] = 0.5                   # (and a peak of its own)
    scan = codec.Scan.of(x)
    got = codec.split_blocks(codec.split_flags(scan.idx, scan.raw, x.size, B), x.size, B)
    assert got.tolist() == [1, 3]
    y = x.copy()
    y[B + 6] = 0.0          # a zero breaks block 1's run
    y[3 * B + 7] = 1e-2     # 2**-7 below the peak: not small, breaks block 3's
    scan = codec.Scan.of(y)
    got = codec.split_blocks(codec.split_flags(scan.idx, scan.raw, y.size, B), y.size, B)
    assert got.tolist() == []
    y[B + 6] = 1e-4         # a run again, across the block's middle
    scan = codec.Scan.of(y)
    got = codec.split_blocks(codec.split_flags(scan.idx, scan.raw, y.size, B), y.size, B)
    assert got.tolist() == [1]
    z = np.concatenate([np.full(B - 2, 1.0), np.full(R, 1e-4), np.full(B - R + 2, 1.0)])
    scan = codec.Scan.of(z.astype(np.float32))  # a run across a block boundary: 2 + (R - 2)
    got = codec.split_blocks(codec.split_flags(scan.idx, scan.raw, z.size, B), z.size, B)
    assert got.tolist() == []
