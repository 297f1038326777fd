"""The device codec (``distributed.device.DeviceTensor``: torch operations, the GPU's path) is
the numpy codec bit for bit: run here on cpu tensors, the same torch operations a GPU runs, on
the codec's cases (sparse and dense, aligned and unaligned layers of mixed scales, split blocks,
NaN and Inf, overflow and rescale, every mode and index, float32, float64 and bfloat16). Each
case runs three jobs of 4 agents in memory: all numpy, all torch, and the two mixed; every
worker must send the same words in every round and decode the same sums, bit for bit. Where a
GPU is present the table runs on it too (``device`` "cuda", marked ``cuda``: skipped without
one; ``bench/gpu_check.py`` runs it)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from homagg.host_agent import codec  # noqa: E402
from homagg.host_agent.codec import CodecError  # noqa: E402
from homagg.host_agent.config import AgentError  # noqa: E402
from homagg.host_agent.distributed.device import DeviceTensor  # noqa: E402
from homagg.host_agent.simulate import MemoryJob  # noqa: E402
from tests.test_fidelity import bucket  # noqa: E402

WORKERS = 4

DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def sparse(seed, n=20_011, density=0.01, scale=1.0):
    rng = np.random.default_rng(seed)
    xs = []
    for _ in range(WORKERS):
        x = np.zeros(n, np.float32)
        at = rng.choice(n, max(1, int(n * density)), replace=False)
        x[at] = rng.normal(0, scale, at.size)
        xs.append(x)
    return xs


def dense(seed, n=5_003):
    rng = np.random.default_rng(seed)
    return [(rng.normal(0, 1, n) * np.logspace(-6, 3, n)).astype(np.float32)
            for _ in range(WORKERS)]


def layered(seed):
    xs, _ = bucket(seed, WORKERS)
    return [x[:80_000] for x in xs]


def with_bad(seed, bad):
    xs = sparse(seed, 3000, 0.05)
    xs[2][1234] = bad
    return xs


CASES = {
    "sparse 1%": lambda: sparse(1),
    "sparse 0.1% odd n": lambda: sparse(2, 100_003, 0.001),
    "tiny": lambda: sparse(3, 7, 0.5),
    "all zero": lambda: [np.zeros(1000, np.float32) for _ in range(WORKERS)],
    "one worker only": lambda: [sparse(4)[0]] + [np.zeros(20_011, np.float32)] * 3,
    "dense, mixed scales": lambda: dense(5),
    "layers 1e-1..1e-10 (split blocks)": lambda: layered(6),
    "subnormal floats": lambda: sparse(7, 4096, 0.05, 1e-39),
    "huge floats": lambda: sparse(8, 4096, 0.05, 1e37),
    "NaN": lambda: with_bad(9, np.nan),
    "Inf": lambda: with_bad(10, -np.inf),
}


def run(xs, torch_workers, key=None, rounds=2, device="cpu", **options):
    """A job of len(xs) agents in memory; the workers in ``torch_workers`` hand the agent a
    DeviceTensor (cpu) of their array, the others the numpy array. Returns each worker's
    results (one per call) and the words it streamed."""
    job = MemoryJob(len(xs), **options)
    sent: list[list] = [[] for _ in xs]
    for w, agent in enumerate(job.agents):
        stream = agent.transport.stream

        def record(op, words, w=w, stream=stream):
            sent[w].append((op, np.asarray(words).view(np.int32).copy()))
            return stream(op, words)

        agent.transport.stream = record
    out = []
    for _ in range(rounds):  # the second call reads the first's memory (key: index, mode)
        out.append(job.allreduce([DeviceTensor(torch.from_numpy(x).to(device))
                                  if w in torch_workers else x for w, x in enumerate(xs)], key))
    return out, sent


def as_numpy(out):
    return out.cpu().numpy() if isinstance(out, torch.Tensor) else out


def assert_same(ref, got):
    (r_out, r_sent), (g_out, g_sent) = ref, got
    for r_sim, g_sim in zip(r_out, g_out):
        for r, g in zip(r_sim.results, g_sim.results):
            a, b = as_numpy(r.out), as_numpy(g.out)
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
            np.testing.assert_array_equal(r.values, g.values)
            np.testing.assert_array_equal(r.block_shifts, g.block_shifts)
            assert (r.split is None) == (g.split is None)
            if r.split is not None:
                np.testing.assert_array_equal(r.split, g.split)
            assert (r.mode, r.index, r.rounds, r.wire_bytes, r.nonfinite) == \
                (g.mode, g.index, g.rounds, g.wire_bytes, g.nonfinite)
    for r_w, g_w in zip(r_sent, g_sent):
        assert len(r_w) == len(g_w)
        for (r_op, r_words), (g_op, g_words) in zip(r_w, g_w):
            assert r_op == g_op
            np.testing.assert_array_equal(r_words, g_words)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode,index", [("auto", "auto"), ("dense", "auto"), ("union", "flat"),
                                        ("union", "hier"), ("sketch", "flat"),
                                        ("sketch", "hier")])
def test_device_codec_is_the_numpy_codec_bit_for_bit(case, mode, index, device):
    xs = CASES[case]()
    ref = run(xs, (), "t", mode=mode, index=index)
    assert_same(ref, run(xs, range(WORKERS), "t", mode=mode, index=index, device=device))
    assert_same(ref, run(xs, (1, 3), "t", mode=mode, index=index,  # a mixed job
                         device=device))
    if case not in ("NaN", "Inf"):
        assert not np.isnan(as_numpy(ref[0][0].results[0].out)).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [100, 3, 256])
def test_unaligned_and_small_scale_blocks(block, device):
    xs = layered(11)
    for mode in ("union", "dense"):
        ref = run(xs, (), mode=mode, block=block, rounds=1)
        assert_same(ref, run(xs, (0, 2), mode=mode, block=block, rounds=1, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_float64_and_bfloat16_tensors(device):
    xs = [x.astype(np.float64) * 1e-3 for x in dense(12)]
    assert_same(run(xs, (), rounds=1), run(xs, range(WORKERS), rounds=1, device=device))
    xb = [torch.from_numpy(x).to(torch.bfloat16) for x in sparse(13)]
    wide = [x.float().numpy() for x in xb]  # bfloat16 widens to float32 exactly
    ref = run(wide, (), rounds=1)
    job = MemoryJob(WORKERS)
    got = job.allreduce([DeviceTensor(x.to(device), torch.float32) for x in xb])
    for r, g in zip(ref[0][0].results, got.results):
        np.testing.assert_array_equal(r.out, g.out.cpu().numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_overflow_rescales_alike(device):
    xs = sparse(14, 5000, 0.2)
    for mode in ("union", "dense"):
        ref = run(xs, (), mode=mode, shift_bias=7, rounds=1)
        plain = run(xs, (), mode=mode, rounds=1)[0][0].results[0].tensor_shift
        assert ref[0][0].results[0].tensor_shift < plain + 7  # the switch flagged, all rescaled
        assert_same(ref, run(xs, range(WORKERS), mode=mode, shift_bias=7, rounds=1,
                             device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_a_sketch_counter_out_of_int32_is_refused_alike(device):
    """A worker's own sketch counter past int32 (the scale forced 7 bits finer): the numpy
    codec refuses it before the round; the device codec the same way, naming the same
    counters. Only worker 0's counters overflow (its peers' values are 2**10 smaller): the job
    reports the first worker's error, and were every worker's to overflow, which of them got
    to its check before a peer's failure stopped the others would decide the message."""
    xs = sparse(14, 5000, 0.2)
    xs[1:] = [x * np.float32(2.0 ** -10) for x in xs[1:]]
    with pytest.raises(codec.AggregationOverflow) as ref:
        run(xs, (), mode="sketch", shift_bias=7, rounds=1)
    with pytest.raises(codec.AggregationOverflow) as got:
        run(xs, range(WORKERS), mode="sketch", shift_bias=7, rounds=1, device=device)
    assert str(got.value) == str(ref.value)


@pytest.mark.parametrize("device", DEVICES)
def test_the_sketchs_residual_round_is_the_numpy_codecs(device):
    """Too few counters (ratio 1.0, under peeling's 1.222 threshold): peeling stalls, and the
    unresolved positions' values go in the residual round, looked up on the device."""
    xs = [sparse(17 + w, 20_000, 0.05)[0] for w in range(WORKERS)]
    ref = run(xs, (), mode="sketch", ratio=1.0, rounds=1)
    assert ref[0][0].results[0].rounds.get("residual", 0) > 0, ref[0][0].results[0].rounds
    assert_same(ref, run(xs, range(WORKERS), mode="sketch", ratio=1.0, rounds=1,
                         device=device))
    assert_same(ref, run(xs, (0, 2), mode="sketch", ratio=1.0, rounds=1, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_the_hierarchys_levels_on_the_device_are_the_numpy_codecs(device):
    """``DeviceTensor.levels`` (built where the tensor lives) against ``codec.Levels.of`` of
    round 1's bitmap: the top level, and the mid and leaf words of any blocks and sub-blocks
    asked, on sizes around a byte, a word and a block."""
    rng = np.random.default_rng(18)
    for n in (1, 7, 8, 9, 127, 128, 129, 1000, 2049, 20_011):
        for density in (0.0, 0.01, 0.3, 1.0):
            x = (rng.random(n) < density) * rng.normal(0, 1, n)
            t = DeviceTensor(torch.from_numpy(x.astype(np.float32)).to(device))
            r1 = t.round1(256, True)
            ref, got = codec.Levels.of(r1.words, n), t.levels()
            np.testing.assert_array_equal(got.top, ref.top)
            nb = codec.top_bits(n)
            blocks = np.sort(rng.choice(nb, rng.integers(0, nb + 1), replace=False))
            subs = np.sort(rng.choice(16 * nb, rng.integers(0, 16 * nb + 1), replace=False))
            for a, b in ((got.mid(blocks), ref.mid(blocks)), (got.leaf(subs), ref.leaf(subs))):
                assert a.dtype == b.dtype == np.uint32
                np.testing.assert_array_equal(a, b)
            assert t.round1(256, True, words=False).words is None


def test_a_value_out_of_range_is_named_by_its_index():
    x = np.zeros(3000, np.float32)
    x[[5, 9, 2000]] = [1.5, -2.0, 3.0]  # a bias pushes them all out of int32: 5 is named
    for mode in ("union", "dense", "sketch"):
        for torch_workers in ((), (0,)):
            with pytest.raises(AgentError, match=r"value 1\.5 at index 5 is out of int32"):
                run([x], torch_workers, mode=mode, shift_bias=20, rounds=1)


def test_a_foreign_support_is_refused():
    t = DeviceTensor(torch.tensor([0.0, 1.0, 0.0, 2.0]))
    t.round1(256, True)
    from homagg.host_agent.local import Scales

    with pytest.raises(CodecError, match="not contained"):
        t.value_words("union", Scales(0, np.zeros(1, np.int64), 256),
                      np.array([0b0100_0000], np.uint32), None, 1, 1.23)


def test_the_backends_device_path_is_its_cpu_path_bit_for_bit():
    """``switch.device_allreduce`` (what a CUDA float tensor takes) against
    ``switch.switch_allreduce`` (a CPU tensor's), on cpu tensors: every dtype, SUM and AVG."""
    import threading

    from torch.distributed import ReduceOp

    from homagg.host_agent.distributed.switch import device_allreduce, switch_allreduce

    rng = np.random.default_rng(16)
    base = [torch.from_numpy((rng.normal(0, 1, 3001) * (rng.random(3001) < 0.3))
                             .astype(np.float32)) for _ in range(WORKERS)]
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for op in (ReduceOp.SUM, ReduceOp.AVG):
            outs: dict = {}
            for path in (switch_allreduce, device_allreduce):
                job = MemoryJob(WORKERS)
                ts = [b.to(dtype, copy=True) for b in base]

                def work(w, path=path, job=job, ts=ts, op=op):
                    path(job.agents[w], ts[w], op)

                threads = [threading.Thread(target=work, args=(w,)) for w in range(WORKERS)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                outs[path] = ts
            for a, b in zip(outs[switch_allreduce], outs[device_allreduce]):
                assert a.dtype == b.dtype == dtype
                assert torch.equal(a, b), (dtype, op)
            assert not torch.equal(outs[switch_allreduce][0], base[0].to(dtype))
