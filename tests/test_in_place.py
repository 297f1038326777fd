"""An all-reduce's sum written where the caller says (``Agent.allreduce(x, out=...)``, and the
codec's decodes under it): the same bits as a fresh array, in every mode and index, with split
blocks and non-finite values; nothing written on an error; a clear error for an ``out`` that
does not fit. In memory (``MemoryJob``: the agents' full logic on the switch's arithmetic)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from homagg.host_agent import AgentError, codec
from homagg.host_agent.codec import CodecError, kernels
from homagg.host_agent.simulate import MemoryJob


def run_all(job: MemoryJob, xs, outs=None, key=None):
    """allreduce on every worker at once (``outs[w]`` its out, if given); the results, and
    the errors."""
    res: list = [None] * len(xs)
    err: list = [None] * len(xs)

    def work(w):
        try:
            res[w] = job.agents[w].allreduce(xs[w], key, out=None if outs is None else outs[w])
        except BaseException as e:  # noqa: BLE001 - asserted below
            err[w] = e
            job.switch.barrier.abort()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return res, err


def tensors(rng, n, workers, density, dtype=np.float32):
    xs = []
    for _ in range(workers):
        x = np.where(rng.random(n) < density, rng.standard_normal(n), 0).astype(dtype)
        if n > 600:
            x[300:310] *= 1e-6  # a run far below its block's peak: a split block
        xs.append(x)
    return xs


@pytest.mark.parametrize("mode,index", [("dense", "flat"), ("union", "flat"), ("union", "hier"),
                                        ("sketch", "flat"), ("auto", "hier")])
@pytest.mark.parametrize("density", [0.01, 0.5, 1.0])
def test_in_place_is_bit_identical_to_a_fresh_sum(mode, index, density):
    rng = np.random.default_rng(7)
    n, workers = 20_011, 3
    xs = tensors(rng, n, workers, density)
    fresh, err = run_all(MemoryJob(workers, mode=mode, index=index), xs)
    assert err == [None] * workers
    # in place: each worker's own tensor is its out (copies, so the inputs above stay)
    mine = [x.copy() for x in xs]
    got, err = run_all(MemoryJob(workers, mode=mode, index=index), mine, mine)
    assert err == [None] * workers
    for w in range(workers):
        assert got[w].base is mine[w] or got[w] is mine[w]  # the sum is in the caller's array
        np.testing.assert_array_equal(mine[w].view(np.uint32), fresh[w].view(np.uint32))


def test_in_place_of_a_2d_tensor_and_a_separate_out():
    rng = np.random.default_rng(8)
    xs = [x.reshape(100, 50) for x in tensors(rng, 5000, 2, 0.3)]
    fresh, _ = run_all(MemoryJob(2), xs)
    outs = [np.full((100, 50), 7.0, np.float32) for _ in xs]
    got, err = run_all(MemoryJob(2), xs, outs)
    assert err == [None, None]
    for w in range(2):
        assert got[w].shape == (100, 50)
        np.testing.assert_array_equal(outs[w], fresh[w])


def test_a_non_finite_value_gives_nan_in_out():
    xs = [np.ones(1000, np.float32), np.ones(1000, np.float32)]
    xs[1][17] = np.inf
    outs = [np.zeros(1000, np.float32) for _ in xs]
    _, err = run_all(MemoryJob(2), xs, outs)
    assert err == [None, None]
    assert all(np.isnan(o).all() for o in outs)


BAD_OUTS = {
    "short": (lambda: np.zeros(999, np.float32),
              "out must hold 1000 values of float32, got 999 of float32"),
    "dtype": (lambda: np.zeros(1000, np.float64),
              "out must hold 1000 values of float32, got 1000 of float64"),
    "strided": (lambda: np.zeros(2000, np.float32)[::2],
                "out must be a contiguous, writeable array"),
    "list": (lambda: [0.0] * 1000, "out must be a numpy array, got list"),
}


@pytest.mark.parametrize("case", sorted(BAD_OUTS))
def test_an_out_that_does_not_fit_is_refused_before_any_round(case):
    make, match = BAD_OUTS[case]
    bad = make()
    job = MemoryJob(1)
    x = np.ones(1000, np.float32)
    with pytest.raises(AgentError, match=match):
        job.agents[0].allreduce(x, out=bad)
    assert job.agents[0].counters.rounds == 0


@pytest.mark.parametrize("which", ["jit", "ref"])
def test_decode_leaves_out_untouched_when_union_and_values_disagree(which):
    if which == "jit" and kernels.JIT is None:
        pytest.skip("numba not installed")
    n = 1000
    words = kernels.REF.pack(np.arange(n) % 7 == 0)
    u = codec.union_size(words, n)
    shifts = np.full(codec.block_count(n, 256), 3, np.int64)
    with kernels.using(which):
        for values in (np.arange(u - 1, dtype=np.int32), np.arange(u + 1, dtype=np.int32)):
            out = np.full(n, 5.0, np.float32)
            with pytest.raises(CodecError, match="disagree on the union size"):
                codec.decode_union_blocks(words, n, values, shifts, 256, np.float32, out)
            assert (out == 5.0).all()
        values = np.arange(u, dtype=np.int32)
        out = np.full(n, 5.0, np.float32)
        got = codec.decode_union_blocks(words, n, values, shifts, 256, np.float32, out)
        assert got.base is out or got is out
        np.testing.assert_array_equal(
            out, codec.decode_union_blocks(words, n, values, shifts, 256, np.float32))
