"""The union's and the sketch's kernels in C (``homagg/native/union.c``, ``sketch.c``) and in
numba, each held bit for bit to the numpy reference (``_ref``) on the same inputs.

``engine``: ``"c"`` runs ``kernels.JIT`` with the C library (and checks that C took the
input), ``"numba"`` with the library off (``homagg.native.load`` gives None), where every
kernel is numba's."""

import numpy as np
import pytest

from homagg import native
from homagg.host_agent.codec import _native, kernels
from homagg.host_agent.codec.sketch import _seeds
from tests.test_codec import _peel_case

REF = kernels.REF
pytestmark = pytest.mark.skipif(kernels.JIT is None, reason="numba not installed")


@pytest.fixture(params=["c", "numba"])
def jit(request, monkeypatch):
    """The compiled kernels (``kernels.JIT``) on C's loops or on numba's."""
    if request.param == "c":
        if native.load() is None:
            pytest.skip(f"the C library is off: {native.why()}")
    else:
        monkeypatch.setattr(native, "load", lambda: None)
    return kernels.JIT


def _c_took(name: str, *args) -> None:
    """Where the library is loaded, C's twin gives an answer for these inputs (not None)."""
    if native.load() is not None:
        assert getattr(_native, name)(*args) is not None, name


def same(got, want) -> None:
    assert (got is None) == (want is None), (got, want)
    if want is None:
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def _bitmaps(foreign: bool = True):
    """(n, words): odd sizes and densities; with ``foreign``, the same sizes with every
    padding bit past n set too (a bitmap from elsewhere: the kernels read only n)."""
    rng = np.random.default_rng(31)
    for n in (0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4097, 100_003):
        for density in (0.0, 0.01, 0.3, 1.0):
            words = REF.pack(rng.random(n) < density)
            yield n, words
            if foreign and n % 32:
                w = words.copy()
                w.view(np.uint8)[n // 8:] |= np.uint8(0xFF >> (n % 8)) if n % 8 else 0
                w.view(np.uint8)[-(-n // 8):] = 0xFF
                yield n, w


def test_union_size_set_bits_and_gather_union(jit):
    rng = np.random.default_rng(32)
    for n, words in _bitmaps():
        assert jit.union_size(words, n) == REF.union_size(words, n)
        same(jit.set_bits(words, n), REF.set_bits(words, n))
        q = rng.integers(-2**31, 2**31, n).astype(np.int32)
        same(jit.gather_union(words, n, q), REF.gather_union(words, n, q))
    n, words = 100_003, REF.pack(rng.random(100_003) < 0.1)
    _c_took("set_bits", words, n)
    _c_took("gather_union", words, n, np.zeros(n, np.int32))


def test_scan(jit):
    rng = np.random.default_rng(38)
    for n in (0, 1, 31, 33, 1000, 100_003):
        for density in (0.0, 0.01, 0.5, 1.0):
            x = np.where(rng.random(n) < density, rng.standard_normal(n), 0).astype(np.float32)
            if n > 3:
                x[:3] = [-0.0, np.nan, -np.inf]  # -0.0 is a zero, NaN and Inf are not
            for g, w in zip(jit.scan(x), REF.scan(x)):
                same(g, w)
    _c_took("scan_f32", x)


def test_hierarchy_levels(jit):
    rng = np.random.default_rng(33)
    for blocks_n in (0, 1, 2, 7, 500):
        mid = REF.pack(rng.random(32 * -(-16 * blocks_n // 32)) < 0.4)
        blocks = np.sort(rng.choice(10 * blocks_n + 1, blocks_n, replace=False)).astype(np.int64)
        same(jit.subblocks(mid, blocks), REF.subblocks(mid, blocks))
    for n, words in _bitmaps(foreign=False):
        assert jit.level_counts(words, n) == REF.level_counts(words, n)
    _c_took("subblocks", mid, blocks)
    _c_took("level_counts", words, n)


def _listed(rng, n, density):
    """A worker's float32 non-zeros (positions, values) and a union holding them and more."""
    x = np.zeros(n, np.float32)
    idx = np.flatnonzero(rng.random(n) < density)
    x[idx] = rng.standard_normal(idx.size).astype(np.float32) * 2.0 ** rng.integers(-20, 10,
                                                                                   idx.size)
    union = REF.pack((x != 0) | (rng.random(n) < density))
    return idx.astype(np.int64), x[idx], union


@pytest.mark.parametrize("block", [32, 256, 100])
def test_encode_union_blocks(jit, block):
    rng = np.random.default_rng(block)
    for n in (1, 33, 1000, 70_001):
        idx, raw, words = _listed(rng, n, 0.05)
        nb = -(-n // block)
        shifts = rng.integers(0, 8, nb).astype(np.int64)
        at = np.sort(rng.choice(idx, min(idx.size, 5), replace=False)) if idx.size else idx
        at_shifts = rng.integers(8, 16, at.size).astype(np.int64)
        for a, s in ((np.zeros(0, np.int64), np.zeros(0, np.int64)), (at, at_shifts)):
            args = (words, n, idx, raw, shifts, block, a, s)
            want = REF.encode_union_blocks(*args)
            assert want is not None
            same(jit.encode_union_blocks(*args), want)
        if idx.size:  # a value that does not quantize, a position outside the union: None
            big = raw.copy()
            big[-1] = 2.0**40
            assert jit.encode_union_blocks(words, n, idx, big, shifts, block, a, s) is None
            assert REF.encode_union_blocks(words, n, idx, big, shifts, block, a, s) is None
            nan = raw.copy()
            nan[0] = np.nan
            assert jit.encode_union_blocks(words, n, idx, nan, shifts, block, a, s) is None
            outside = REF.pack(np.zeros(n, bool))
            assert jit.encode_union_blocks(outside, n, idx, raw, shifts, block, a, s) is None
    _c_took("encode_union_f32", words, n, idx, raw, shifts, block, a, s)


@pytest.mark.parametrize("vt", [np.int32, np.int64])
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_decoding_the_union(jit, vt, dt):
    rng = np.random.default_rng(34)
    for n, words in _bitmaps():
        u = REF.union_size(words, n)
        values = rng.integers(-2**31, 2**31, u).astype(vt)
        if u and vt == np.int64:
            values[0] = 2**53 + 1  # past float64's mantissa: one rounding, the same
        for shift in (0, 7, -5, 40):
            same(jit.decode_union(words, n, values, shift, dt),
                 REF.decode_union(words, n, values, shift, dt))
        scales = np.ldexp(1.0, -rng.integers(0, 40, max(1, -(-n // 32))))
        want = REF.decode_union_scaled(words, n, values, scales, dt)
        same(jit.decode_union_scaled(words, n, values, scales, dt), want)
        out = np.full(n, 3.0, dt)
        assert jit.decode_union_scaled(words, n, values, scales, dt, out) is out
        same(out, want)
        if u:  # values that disagree with the union: None, a given out untouched
            assert jit.decode_union(words, n, values[:-1], 0, dt) is None
            out = np.full(n, 3.0, dt)
            assert jit.decode_union_scaled(words, n, values[:-1], scales, dt, out) is None
            assert (out == 3.0).all()
    _c_took("decoder", values, np.dtype(dt))


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_assemble_and_scale_blocks(jit, dt):
    rng = np.random.default_rng(35)
    n = 10_007
    union = np.sort(rng.choice(n, 3000, replace=False)).astype(np.int64)
    for vt in (np.int32, np.int64):
        values = rng.integers(-2**31, 2**31, union.size).astype(vt)
        for shift in (0, 7, 30, -5):
            same(jit.assemble(n, union, values, shift, dt),
                 REF.assemble(n, union, values, shift, dt))
    _c_took("assemble", n, union, values, 1.0, np.dtype(dt))
    for vt in (np.int64, np.float64):
        v = rng.integers(-2**40, 2**40, n).astype(vt)
        for block in (1, 7, 256):
            scales = np.ldexp(1.0, -rng.integers(0, 60, -(-n // block)))
            same(jit.scale_blocks(v, scales, block, dt), REF.scale_blocks(v, scales, block, dt))
            _c_took("scale_wide", v, scales, block, np.empty(n, dt))


def test_sketch_hashes_and_encoding(jit):
    rng = np.random.default_rng(36)
    for size in (0, 1, 10, 5000):
        idx = np.sort(rng.choice(2**34, size, replace=False)).astype(np.int64)
        for vt in (np.int32, np.int64):
            val = rng.integers(-(2**18), 2**18, size).astype(vt)
            for m, (s1, s2) in ((3, (0, 1)), (4 * size + 5, (5, 2**63 + 7)),
                                (3 * 2**20, (2**40 + 3, 11))):
                s1, s2 = np.uint64(s1), np.uint64(s2)
                for g, w in zip(jit.hashes(idx, m // 3, s1, s2), REF.hashes(idx, m // 3, s1, s2)):
                    same(g, w)
                # (numpy's counters are float64, exact here: a few terms of |v| < 2**31 each)
                same(jit.sketch_encode(idx, val, m, s1, s2),
                     REF.sketch_encode(idx, val, m, s1, s2).astype(np.int64))
    _c_took("sketch_encode", idx, val, m, s1, s2)


@pytest.mark.parametrize("u,ratio", [(1, 1.25), (2, 1.25), (100, 1.25), (20_000, 1.25),
                                     (20_000, 0.8), (3000, 0.001)])
@pytest.mark.parametrize("int32_state", [True, False])
def test_peel(jit, monkeypatch, u, ratio, int32_state):
    # ratio 0.001 puts ~600 elements in a counter: past the int32 state (C then takes the int64
    # state; numba hands over to numpy): the same bits either way
    if not int32_state:
        monkeypatch.setattr(_native, "PEEL_INT32_STATE_BELOW", 0)
    union, vals, counters = _peel_case(np.random.default_rng(u), u, ratio, 3)
    s1, s2 = _seeds(3)  # (the seeds _peel_case's counters were encoded with)
    got, want = jit.peel(counters, union, s1, s2), REF.peel(counters, union, s1, s2)
    same(got[0], want[0])
    same(got[1], want[1])
    with monkeypatch.context() as m:  # the rounds: C's are numba's (numpy counts its own way)
        m.setattr(native, "load", lambda: None)
        assert got[2] == kernels.JIT.peel(counters, union, s1, s2)[2]
    np.testing.assert_array_equal(got[0][got[1]], vals[got[1]])
    if ratio >= 1.25:
        assert got[1].all()
    _c_took("peel", counters, union, s1, s2, False)


def test_a_float32_all_reduce_runs_no_numba_kernel(monkeypatch):
    """With the C library, every mode of a float32 tensor's all-reduce runs on C's loops: a
    worker never imports numba (about 100 MB of its peak memory)."""
    if native.load() is None:
        pytest.skip(f"the C library is off: {native.why()}")
    from homagg.host_agent.codec import _compiled
    from homagg.host_agent.simulate import simulate_allreduce

    def no_numba():
        raise AssertionError("a numba kernel ran")

    monkeypatch.setattr(_compiled, "jit", no_numba)
    monkeypatch.setattr(kernels, "active", kernels.JIT)
    rng = np.random.default_rng(37)
    n = 200_003
    for density in (0.001, 0.02, 0.5):
        xs = []
        for _ in range(3):
            x = np.zeros(n, np.float32)
            idx = rng.choice(n, int(n * density), replace=False)
            x[idx] = rng.standard_normal(idx.size).astype(np.float32)
            xs.append(x)
        x[:300] = rng.standard_normal(300) * 1e-6  # a run of small values: split blocks
        for mode in ("auto", "union", "sketch", "dense"):
            for index in ("flat", "hier"):
                got = simulate_allreduce(xs, mode=mode, index=index)
                with kernels.using("ref"):
                    want = simulate_allreduce(xs, mode=mode, index=index)
                for g, w in zip(got.out, want.out):
                    same(g, w)
