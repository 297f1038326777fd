"""Float fidelity of the whole all-reduce (``simulate_allreduce``: the agents' full logic on the
switch's arithmetic, in memory), with block floating point scales (``codec.blocks``): as good
as an fp32 all-reduce on layers of very different magnitudes in one flat tensor."""

from __future__ import annotations

import time

import numpy as np
import pytest

from homagg import wire
from homagg.host_agent import AgentError, codec, simulate_allreduce

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


def assert_exact(sim, xs, delta=0):
    """Bit for bit the integer sum at the negotiated per-block shifts (plus ``delta``: the
    shift bias less the rescales), on every worker."""
    r0 = sim.results[0]
    np.testing.assert_array_equal(r0.block_shifts,
                                  codec.agreed_shifts(xs, block=r0.block) + delta)
    expect = np.sum([codec.quantize(x, r0.shift).astype(np.int64) for x in xs], axis=0)
    for r in sim.results:
        np.testing.assert_array_equal(r.ints(), expect)
        np.testing.assert_array_equal(r.out, codec.scale_blocks(expect, r.block_shifts,
                                                                r.block))


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
    one = simulate_allreduce(xs, mode="dense", block=n)  # one block: the old single scale
    assert_exact(one, xs)
    med, zero = fidelity(one.out[0], exact)
    assert med[6] > 1e-2 and zero[-1] > 0.5  # 1e-7: percent errors; 1e-10: mostly zeros


def test_block_words_cost_under_1_percent_of_dense():
    xs = layered(3)
    n = xs[0].size
    sim = simulate_allreduce(xs, mode="dense")
    dense_packets = -(-n // wire.WORDS_PER_PACKET)
    round1 = -(-(wire.EXP_WORDS + codec.block_count(n, codec.DEFAULT_BLOCK))
               // wire.WORDS_PER_PACKET)
    assert sim.wire_bytes[0] == (dense_packets + round1) * wire.PACKET_BYTES
    assert round1 / dense_packets <= 0.01


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
