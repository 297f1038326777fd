"""The codec is exact: every mode returns, bit for bit, the integer sum of the workers' arrays."""

import inspect

import numpy as np
import pytest

from homagg.host_agent import codec
from homagg.host_agent.codec import AggregationOverflow, CodecError, kernels
from homagg.host_agent.simulate import simulate_ints, switch_add, switch_or

ALL_MODES = ["auto", "dense", "union", "sketch"]


def exact_sum(arrays):
    return np.sum(np.stack(arrays).astype(np.int64), axis=0)


def sparse_workers(rng, n, workers, density, lo=-(2**20), hi=2**20, support=None):
    out = []
    for _ in range(workers):
        a = np.zeros(n, np.int32)
        idx = support if support is not None else rng.choice(n, int(n * density), replace=False)
        a[idx] = rng.integers(lo, hi, len(idx), dtype=np.int64).astype(np.int32)
        out.append(a)
    return out


@pytest.fixture(params=["auto", "flat", "hier"])
def index(request):
    """The index a test's simulated job uses (codec.index; auto picks by size)."""
    return request.param


def assert_exact(arrays, mode, seed=1, **kw):
    res = simulate_ints(arrays, seed, mode=mode, **kw)
    assert res.total.dtype == np.int32
    np.testing.assert_array_equal(res.total.astype(np.int64), exact_sum(arrays))
    return res


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize(
    "n,workers,density",
    [(1, 1, 1.0), (7, 2, 0.5), (33, 3, 0.1), (1000, 4, 0.01), (4099, 8, 0.05), (100_003, 8, 0.01),
     (65_537, 64, 0.001), (10_000, 1, 0.02)],
)
def test_random_sparse_sums_are_exact(mode, n, workers, density, index):
    rng = np.random.default_rng(n * 31 + workers)
    assert_exact(sparse_workers(rng, n, workers, density), mode, index=index)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_all_zero(mode, index):
    res = assert_exact([np.zeros(1000, np.int32)] * 4, mode, index=index)
    assert res.u == 0 or res.mode == "dense"


@pytest.mark.parametrize("mode", ALL_MODES)
def test_single_nonzero_in_one_worker(mode, index):
    arrays = [np.zeros(12345, np.int32) for _ in range(5)]
    arrays[3][12344] = -7
    res = assert_exact(arrays, mode, index=index)
    if mode != "dense":
        assert res.u == 1


@pytest.mark.parametrize("mode", ALL_MODES)
def test_fully_dense(mode, index):
    rng = np.random.default_rng(2)
    arrays = [rng.integers(1, 2**20, 5000, dtype=np.int32) for _ in range(4)]
    res = assert_exact(arrays, mode, index=index)
    if mode == "auto":
        assert res.mode == "dense"  # the byte count says the bitmap cannot pay for itself


@pytest.mark.parametrize("mode", ALL_MODES)
def test_identical_supports(mode, index):
    rng = np.random.default_rng(3)
    support = rng.choice(50_000, 500, replace=False)
    assert_exact(sparse_workers(rng, 50_000, 8, 0, support=support), mode, index=index)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_disjoint_supports(mode, index):
    rng = np.random.default_rng(4)
    perm = rng.permutation(40_000)
    arrays = []
    for w in range(8):
        a = np.zeros(40_000, np.int32)
        a[perm[w * 400 : (w + 1) * 400]] = rng.integers(-1000, 1000, 400)
        arrays.append(a)
    res = assert_exact(arrays, mode, index=index)
    if mode in ("union", "sketch"):
        assert res.u == 8 * 400


@pytest.mark.parametrize("mode", ALL_MODES)
def test_cancelling_values_keep_support(mode, index):
    # Values that sum to zero are still in U; the sum there is an exact 0.
    a = np.zeros(100, np.int32)
    b = np.zeros(100, np.int32)
    a[[1, 50, 99]] = [5, -9, 2**29]
    b[[1, 50, 99]] = [-5, 9, -(2**29)]
    res = assert_exact([a, b], mode, index=index)
    assert not res.total.any()


@pytest.mark.parametrize("mode", ["dense", "union", "sketch"])
def test_extreme_magnitudes_that_fit(mode):
    # One worker at each int32 extreme, others zero: every partial sum fits, so no overflow.
    n = 3000
    a = np.zeros(n, np.int32)
    b = np.zeros(n, np.int32)
    a[::7] = codec.INT32_MAX
    b[3::7] = codec.INT32_MIN
    if mode == "sketch":
        # Several extremes may share a counter; the switch must flag that, never wrap silently.
        try:
            assert_exact([a, b], mode)
        except AggregationOverflow as e:
            assert e.round_name in ("sketch", "sketch-encode")
    else:
        assert_exact([a, b], mode)


@pytest.mark.parametrize("mode", ["dense", "union", "sketch"])
def test_overflowing_sum_is_flagged_not_wrapped(mode):
    a = np.zeros(100, np.int32)
    a[10] = 2**30 + 5
    with pytest.raises(AggregationOverflow):
        simulate_ints([a, a.copy()], 1, mode=mode)


def test_intermediate_overflow_is_flagged_like_the_switch():
    a = np.full(4, 2**30, np.int32)
    b = np.full(4, 2**30, np.int32)
    c = np.full(4, -(2**30), np.int32)
    # The final sum 2**30 fits, but the switch adds in arrival order and sees 2**31 first.
    with pytest.raises(AggregationOverflow):
        simulate_ints([a, b, c], 1, mode="dense")


def test_peeling_failure_is_repaired_by_the_residual_round():
    rng = np.random.default_rng(5)
    arrays = sparse_workers(rng, 200_000, 8, 0.01)
    # 0.8 counters per element is below the peeling threshold: most elements stay unresolved.
    res = assert_exact(arrays, "sketch", ratio=0.8)
    assert res.unresolved > res.u // 2
    assert res.bytes_per_worker["residual"] == 4 * res.unresolved


def test_peeling_at_design_ratio_resolves_nearly_everything():
    rng = np.random.default_rng(6)
    res = assert_exact(sparse_workers(rng, 1_000_000, 8, 0.01), "sketch")
    assert res.m == codec.sketch_size(res.u)
    assert res.unresolved <= res.u // 1000


def test_different_seeds_give_different_sketches_same_sum():
    rng = np.random.default_rng(7)
    arrays = sparse_workers(rng, 20_000, 4, 0.02)
    s = codec.Sparse.from_dense(arrays[0])
    m = codec.sketch_size(1000)
    assert not np.array_equal(codec.sketch_encode(s, m, 1), codec.sketch_encode(s, m, 2))
    for seed in (1, 2, 2**40 + 3):
        assert_exact(arrays, "sketch", seed=seed)


def test_sketch_hashes_are_distinct_per_element_and_in_range():
    idx = np.arange(0, 10**6, 37)
    pos, sgn = codec.sketch_hashes(idx, codec.sketch_size(idx.size), 9)
    m = codec.sketch_size(idx.size)
    assert pos.min() >= 0 and pos.max() < m
    assert np.all(pos[0] != pos[1]) and np.all(pos[1] != pos[2]) and np.all(pos[0] != pos[2])
    assert set(np.unique(sgn)) == {-1, 1}


def test_bitmap_round_trip_with_odd_sizes():
    for n in (1, 31, 32, 33, 1001):
        a = np.zeros(n, np.int32)
        a[[0, n - 1]] = 1
        words = codec.bitmap(codec.Sparse.from_dense(a))
        assert words.size == codec.bitmap_words(n)
        np.testing.assert_array_equal(codec.union_indices(words, n), np.unique([0, n - 1]))


# --- quantization --------------------------------------------------------------------------


def test_quantized_job_sums_fit_with_headroom():
    rng = np.random.default_rng(8)
    workers = 8
    xs = [rng.standard_normal(10_000).astype(np.float32) * 1e3 for _ in range(workers)]
    e = max(codec.max_exponent(x) for x in xs)
    shift = codec.shift_for(e, workers)
    qs = [codec.quantize(x, shift) for x in xs]
    res = assert_exact(qs, "dense")
    # Dequantized sum is within rounding of the float sum; the int sum itself is exact.
    ref = np.sum(np.stack(xs).astype(np.float64), axis=0)
    err = np.abs(codec.dequantize(res.total, shift, np.float64) - ref)
    assert np.max(err) <= workers * 2.0**-shift


def test_sparse_from_float_quantizes_only_nonzeros():
    x = np.array([0.0, 1.5, 0.0, 1e-9, -2.25], np.float32)
    s = codec.Sparse.from_float(x, 4)
    np.testing.assert_array_equal(s.idx, [1, 3, 4])  # 1e-9 rounds to 0 but stays in the support
    np.testing.assert_array_equal(s.val, [24, 0, -36])
    np.testing.assert_array_equal(s.to_dense(), codec.quantize(x, 4))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused_with_their_index(bad):
    x = np.ones(10, np.float32)
    x[6] = bad
    with pytest.raises(CodecError, match="index 6"):
        codec.max_exponent(x)
    with pytest.raises(CodecError, match="index 6"):
        codec.quantize(x, 3)


def test_all_zero_tensor_has_no_exponent():
    assert codec.max_exponent(np.zeros(5, np.float32)) is None
    assert codec.shift_for(None, 4) == 0


def test_shift_for_leaves_room_for_workers_and_headroom():
    e = codec.max_exponent(np.array([3.0]))  # 3 < 2**2
    s = codec.shift_for(e, 8, 16)
    assert 8 * 16 * 2 ** (e + s) <= 2**30


# --- refusals ------------------------------------------------------------------------------


def test_mismatched_sizes_are_refused():
    with pytest.raises(CodecError, match="worker 1"):
        simulate_ints([np.zeros(10, np.int32), np.zeros(11, np.int32)], 1)


def test_wrong_dtype_is_refused():
    with pytest.raises(CodecError, match="int32"):
        simulate_ints([np.zeros(10, np.int64)], 1)


def test_unknown_mode_is_refused():
    with pytest.raises(CodecError, match="mode"):
        simulate_ints([np.zeros(10, np.int32)], 1, mode="lossy")


def test_choose_mode_follows_the_byte_count():
    n = 1_000_000
    assert codec.choose_mode(n, 10_000) == "union"
    assert codec.choose_mode(n, n) == "dense"
    # Union pays n/32 for the bitmap: dense wins once u > n - n/32.
    assert codec.choose_mode(n, n - n // 64) == "dense"


# --- compiled kernels against the numpy reference ---------------------------------------------

needs_jit = pytest.mark.skipif(kernels.JIT is None, reason="numba not installed")


@pytest.fixture
def reference():
    """Run a callable with the numpy reference kernels (compiled kernels off)."""

    def run(fn, *args, **kw):
        with kernels.using("ref"):
            return fn(*args, **kw)

    return run


def select_kernels(monkeypatch, jit: bool) -> None:
    """Run the rest of the test on the compiled kernels (jit) or on the numpy reference."""
    if jit and kernels.JIT is None:
        pytest.skip("numba not installed")
    monkeypatch.setattr(kernels, "active", kernels.JIT if jit else kernels.REF)


@needs_jit
def test_both_kernel_sets_have_one_interface():
    ref = {name: fn for name, fn in vars(kernels.REF).items()
           if inspect.isfunction(fn) and not name.startswith("_")}
    assert set(ref) >= {"scan", "set_bits", "ranks", "union_size", "encode_union",
                        "decode_union", "hashes", "sketch_encode", "peel", "assemble", "pack",
                        "subblocks", "level_counts"}
    for name, fn in ref.items():
        assert inspect.signature(getattr(kernels.JIT, name)) == inspect.signature(fn), name
    assert kernels.active is kernels.JIT
    with kernels.using("ref") as k:
        assert k is kernels.active is kernels.REF
    assert kernels.active is kernels.JIT


@needs_jit
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_split_mask_kernels_agree(reference, dtype):
    # layers of very different scales, sparse tails, subnormals and runs across block ends
    rng = np.random.default_rng(22)
    for n, block in ((5000, 256), (4097, 16), (300, 7), (2, 256), (100_003, 256)):
        layers = 10.0 ** rng.integers(-12, 3, n // 1000 + 1)  # layers of 1000 elements
        x = rng.standard_normal(n) * layers.repeat(1000)[:n]
        x[rng.random(n) < 0.2] = 0
        x[:3] = np.array([1e-40, 1e-42, 3e-39])[:min(3, n)]
        x = x.astype(dtype)
        scan = codec.Scan.of(x)
        nb = codec.block_count(n, block)
        for binades, run in ((8, 3), (2, 1), (0, 5)):
            got = kernels.JIT.split_mask(scan.idx, scan.raw, nb, block, binades, run)
            want = reference(kernels.REF.split_mask, scan.idx, scan.raw, nb, block, binades,
                             run)
            np.testing.assert_array_equal(got, want)
            if n >= 5000 and (binades, run) == (8, 3):
                assert 0 < want.sum() < nb  # the case splits some blocks, not all
        np.testing.assert_array_equal(
            kernels.JIT.block_peaks(scan.idx, scan.raw, nb, block),
            reference(kernels.REF.block_peaks, scan.idx, scan.raw, nb, block))


def _bitmaps():
    rng = np.random.default_rng(21)
    for n in (0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 1000, 4097, 100_003):
        for density in (0.0, 0.01, 0.3, 0.9, 1.0):
            mask = rng.random(n) < density
            yield n, kernels.REF.pack(mask), mask


@needs_jit
def test_set_bits_matches_reference(reference):
    for n, words, mask in _bitmaps():
        got = codec.set_bits(words, n)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, np.flatnonzero(mask))
        np.testing.assert_array_equal(got, reference(codec.set_bits, words, n))


@pytest.mark.parametrize("jit", [True, False])
def test_set_bits_ignores_bits_past_n(jit, monkeypatch):
    select_kernels(monkeypatch, jit)
    full = np.full(3, 0xFFFFFFFF, np.uint32)  # a foreign bitmap with its padding bits set
    for n in (0, 1, 40, 95, 96):
        np.testing.assert_array_equal(codec.set_bits(full, n), np.arange(n))
    with pytest.raises(CodecError):
        codec.set_bits(full, 97)


@needs_jit
def test_ranks_in_matches_searchsorted(reference):
    rng = np.random.default_rng(22)
    for u in (0, 1, 5, 1000, 50_000):
        union = np.sort(rng.choice(10 * u + 1, u, replace=False)).astype(np.int64)
        for k in sorted({0, min(1, u), u // 3, u}):
            idx = np.sort(rng.choice(union, k, replace=False)) if k else np.zeros(0, np.int64)
            np.testing.assert_array_equal(codec.ranks_in(union, idx),
                                          reference(codec.ranks_in, union, idx))
    union = np.array([2, 5, 9])
    for idx in ([1], [3], [10], [2, 5, 9, 11]):
        with pytest.raises(CodecError, match="not contained"):
            codec.ranks_in(union, np.array(idx))
        with pytest.raises(CodecError, match="not contained"):
            reference(codec.ranks_in, union, np.array(idx))


@needs_jit
def test_sketch_hashes_and_encode_match_reference(reference):
    rng = np.random.default_rng(23)
    for size in (0, 1, 10, 5000):
        idx = np.sort(rng.choice(2**34, size, replace=False)).astype(np.int64)
        s = codec.Sparse(2**34, idx, rng.integers(-(2**18), 2**18, size).astype(np.int32))
        for m, seed in ((3, 0), (codec.sketch_size(max(size, 1)), 5), (3 * 2**20, 2**40 + 3)):
            pos, sgn = codec.sketch_hashes(idx, m, seed)
            rpos, rsgn = reference(codec.sketch_hashes, idx, m, seed)
            np.testing.assert_array_equal(pos, rpos)
            np.testing.assert_array_equal(sgn, rsgn)
            np.testing.assert_array_equal(codec.sketch_encode(s, m, seed),
                                          reference(codec.sketch_encode, s, m, seed))


def _peel_case(rng, u, ratio, seed):
    union = np.sort(rng.choice(50 * u + 1, u, replace=False)).astype(np.int64)
    vals = rng.integers(-(2**20), 2**20, u).astype(np.int32)
    m = codec.sketch_size(u, ratio)
    counters = codec.sketch_encode(codec.Sparse(50 * u + 1, union, vals), m, seed)
    return union, vals, counters


@needs_jit
@pytest.mark.parametrize("u,ratio", [(1, 1.25), (2, 1.25), (100, 1.25), (20_000, 1.25),
                                     (20_000, 0.8), (3000, 0.001)])
@pytest.mark.parametrize("int32_state", [True, False])
def test_peel_matches_reference(reference, monkeypatch, u, ratio, int32_state):
    # ratio 0.001 puts ~600 elements in a counter: past the int32 state, which hands over to numpy.
    if not int32_state:
        from homagg.host_agent.codec import _native  # where peel reads it

        monkeypatch.setattr(_native, "PEEL_INT32_STATE_BELOW", 0)
    rng = np.random.default_rng(u)
    union, vals, counters = _peel_case(rng, u, ratio, 3)
    got = codec.peel(counters, union, 3)
    ref = reference(codec.peel, counters, union, 3)
    np.testing.assert_array_equal(got.resolved, ref.resolved)  # the 2-core is order-free
    np.testing.assert_array_equal(got.values, ref.values)
    np.testing.assert_array_equal(got.values[got.resolved], vals[got.resolved])
    assert got.values.dtype == np.int64
    if ratio >= 1.25:
        assert got.resolved.all()


@needs_jit
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shift", [0, 7, 30, -5, 1050])
def test_assemble_matches_reference(reference, dtype, shift):
    rng = np.random.default_rng(24)
    n = 10_007
    union = np.sort(rng.choice(n, 3000, replace=False))
    values = rng.integers(-(2**31), 2**31, union.size, dtype=np.int64)
    values[:3] = [0, 2**24 + 1, -(2**31)]  # an odd value past fp32's mantissa: one rounding
    got = codec.assemble(n, union, values, shift, dtype)
    ref = reference(codec.assemble, n, union, values, shift, dtype)
    assert got.dtype == ref.dtype == dtype
    np.testing.assert_array_equal(got.view(np.uint8), ref.view(np.uint8))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_reference_path_is_exact(mode, monkeypatch):
    select_kernels(monkeypatch, False)
    rng = np.random.default_rng(25)
    for n, workers, density in ((33, 3, 0.1), (4099, 8, 0.05), (100_003, 8, 0.01)):
        assert_exact(sparse_workers(rng, n, workers, density), mode)


# --- union mode straight from the bitmap (never listing U) -------------------------------------


def _union_cases():
    """(n, worker int32 arrays): odd sizes, empty/full unions, a worker with no non-zeros,
    values at the last position."""
    rng = np.random.default_rng(26)
    for n in (0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 95, 1000, 4097, 100_003):
        for density in (0.0, 0.01, 0.3, 1.0):
            arrays = sparse_workers(rng, n, 3, density)
            arrays.append(np.zeros(n, np.int32))  # a worker with no non-zeros
            if n:
                arrays[0][n - 1] = -3  # the last position
            yield n, arrays


@pytest.mark.parametrize("jit", [True, False])
def test_encode_union_and_union_size_match_the_listed_union(jit, monkeypatch, reference):
    select_kernels(monkeypatch, jit)
    for n, arrays in _union_cases():
        sparse = [codec.Sparse.from_dense(a) for a in arrays]
        words = switch_or([s.words for s in sparse])
        union = reference(codec.union_indices, words, n)
        assert codec.union_size(words, n) == union.size
        for s in sparse:
            got = codec.encode_union(s, words)
            want = reference(codec.encode_values, s, union, "union", 0)
            assert got.dtype == want.dtype == np.int32
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("jit", [True, False])
def test_union_helpers_ignore_bits_past_n_and_refuse_foreign_supports(jit, monkeypatch):
    select_kernels(monkeypatch, jit)
    full = np.full(3, 0xFFFFFFFF, np.uint32)  # padding bits set past n
    for n in (0, 1, 40, 95, 96):
        assert codec.union_size(full, n) == n
        out = codec.decode_union(full, n, np.arange(n, dtype=np.int32), 0)
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32))
        q = np.zeros(n, np.int32)
        q[n - 1:] = 5
        np.testing.assert_array_equal(codec.encode_union(codec.Sparse.from_dense(q), full),
                                      q)
    with pytest.raises(CodecError):
        codec.union_size(full, 97)
    words = kernels.REF.pack(np.isin(np.arange(70), [2, 5, 69]))
    q = np.zeros(70, np.int32)
    for bad in (3, 68):
        q[:] = 0
        q[[2, bad]] = 1
        with pytest.raises(CodecError, match="not contained"):
            codec.encode_union(codec.Sparse.from_dense(q), words)
    for values in (np.zeros(2, np.int32), np.zeros(4, np.int32)):
        with pytest.raises(CodecError, match="disagree"):
            codec.decode_union(words, 70, values, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shift", [0, 7, 30, -5, 1050])
def test_decode_union_matches_assemble(reference, dtype, shift):
    rng = np.random.default_rng(27)
    for n, arrays in _union_cases():
        words = switch_or([codec.Sparse.from_dense(a).words for a in arrays])
        union = reference(codec.union_indices, words, n)
        for vdtype in (np.int32, np.int64):
            hi = 2**31 if vdtype == np.int32 else 2**40
            values = rng.integers(-hi, hi, union.size, dtype=np.int64).astype(vdtype)
            values[:3] = [0, 2**24 + 1, -(2**31)][:values.size]  # one rounding past fp32's mantissa
            want = reference(codec.assemble, n, union, values, shift, dtype)
            for fn in (codec.decode_union, lambda *a: reference(codec.decode_union, *a)):
                got = fn(words, n, values, shift, dtype)
                assert got.dtype == want.dtype == dtype
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@needs_jit
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scan_matches_reference(reference, dtype):
    rng = np.random.default_rng(28)
    for n in (0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 1000, 4097, 100_003):
        # 0.9 and 1.0 outgrow the kernel's first guess at the number of non-zeros.
        for density in (0.0, 0.01, 0.3, 0.9, 1.0):
            x = np.where(rng.random(n) < density, rng.standard_normal(n), 0).astype(dtype)
            if n:
                x[n - 1] = -0.5
            if n > 3:
                x[1], x[2] = -0.0, np.nan  # -0 is zero; NaN is not (max_exponent names it)
            got, want = codec.Scan.of(x), reference(codec.Scan.of, x)
            for a, b in ((got.words, want.words), (got.idx, want.idx), (got.raw, want.raw)):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("jit", [True, False])
def test_union_mode_from_the_bitmap_is_the_exact_sum(jit, monkeypatch):
    select_kernels(monkeypatch, jit)
    rng = np.random.default_rng(29)
    for n, workers, density in ((33, 3, 0.1), (4099, 8, 0.05), (100_003, 8, 0.01)):
        xs = [np.where(rng.random(n) < density, rng.standard_normal(n), 0).astype(np.float32)
              for _ in range(workers)]
        shift = codec.shift_for(max(codec.max_exponent(x) for x in xs), workers)
        sparse = [codec.Scan.of(x).quantize(shift) for x in xs]
        words = switch_or([s.words for s in sparse])
        agg = switch_add([codec.encode_union(s, words) for s in sparse], "union")
        exact = exact_sum([s.to_dense() for s in sparse])
        out = codec.decode_union(words, n, agg, shift)
        np.testing.assert_array_equal(
            out, np.ldexp(exact.astype(np.float64), -shift).astype(np.float32))


# --------------------------------------------------------------------------------------------
# Block floating point (codec.blocks)
# --------------------------------------------------------------------------------------------


def test_block_words_are_one_hot_offsets_from_the_tensor_max():
    x = np.zeros(1000, np.float32)
    x[3] = 5.0        # block 0: the tensor max, e = 3: offset 0
    x[300] = 0.3      # block 1: e = -1: offset 4
    x[700] = 1e-30    # block 2: e = -99: offset clamped to 31
    s = codec.Scan.of(x)
    e = s.max_exponent()
    words = codec.block_words(s.idx, s.raw, s.n, 256, e)
    assert words.tolist() == [1, 1 << 4, 1 << 31, 0]
    assert codec.block_offsets(words).tolist() == [0, 4, 31, 0]
    # the OR's lowest set bit is the largest block max over workers
    other = np.array([1 << 7, 1 << 2, 0, 1 << 9], np.uint32)
    assert codec.block_offsets(words | other).tolist() == [0, 2, 31, 9]


def test_agreed_block_shifts_keep_the_headroom_bound_per_element():
    # |q| <= 2**(e + s) for every element at its block's shift: shift_for's headroom holds
    # per element, so any counter of <= headroom elements per worker cannot overflow
    rng = np.random.default_rng(30)
    xs = [(rng.standard_normal(5000) * 10.0 ** rng.integers(-20, 5, 5000)).astype(np.float32)
          for _ in range(3)]
    xs[2] *= np.float32(1e-3)  # a worker with a smaller max: offsets only coarser
    shifts = codec.agreed_shifts(xs, block=128)
    e = max(codec.max_exponent(x) for x in xs)
    s = codec.shift_for(e, 3)
    assert (shifts >= s).all() and (shifts <= s + codec.MAX_OFFSET).all()
    per = codec.element_shifts(shifts, 128, 5000)
    split = codec.agreed_shifts(xs, block=128, split=True)  # split blocks: finer, still bound
    assert (split > per).sum() > 100 and (split >= per).all()
    for x in xs:
        assert np.abs(codec.quantize(x, per).astype(np.int64)).max() <= 2 ** (e + s)
        assert np.abs(codec.quantize(x, split).astype(np.int64)).max() <= 2 ** (e + s)


def test_quantize_takes_per_element_shifts_and_names_the_bad_index():
    x = np.array([1.0, 1.0, 1.0], np.float32)
    np.testing.assert_array_equal(codec.quantize(x, np.array([0, 3, 30])), [1, 8, 2 ** 30])
    with pytest.raises(CodecError, match="index 2") as info:
        codec.quantize(x, np.array([0, 3, 31]))
    assert info.value.index == 2


def test_scale_blocks_rounds_once_from_the_exact_value():
    v = np.array([3, 2 ** 40 + 1, -7, 5, 1], np.float64)
    out = codec.scale_blocks(v, np.array([1, 60, -2]), 2)
    expect = np.ldexp(v, -np.array([1, 1, 60, 60, -2])).astype(np.float32)
    np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=needs_jit)])
@pytest.mark.parametrize("n", [1, 31, 33, 999, 4096, 70_001])
@pytest.mark.parametrize("block", [32, 256, 100])
def test_decode_union_blocks_is_the_two_pass_reference(monkeypatch, jit, n, block):
    monkeypatch.setattr(kernels, "active", kernels.JIT if jit else kernels.REF)
    rng = np.random.default_rng(n)
    x = np.zeros(n, np.float32)
    idx = rng.choice(n, max(1, n // 7), replace=False)
    x[idx] = rng.standard_normal(idx.size)
    scan = codec.Scan.of(x)
    values = codec.encode_union(scan.quantize(20), scan.words)
    shifts = rng.integers(-5, 60, codec.block_count(n, block))
    got = codec.decode_union_blocks(scan.words, n, values, shifts, block)
    exact = np.zeros(n, np.int64)
    exact[scan.idx] = values
    want = np.ldexp(exact.astype(np.float64), -codec.element_shifts(shifts, block, n))
    assert got.tobytes() == want.astype(np.float32).tobytes()
    assert codec.scale_blocks(exact, shifts, block).tobytes() == got.tobytes()


@needs_jit
@pytest.mark.parametrize("parts", [2, 3, 7])
def test_decode_on_threads_is_the_one_thread_decode(monkeypatch, reference, parts):
    """``decode_union_scaled`` split between threads (from THREADS_FROM elements on; forced
    here at every size, so shares are empty, partial, or a word each): the same bits as
    numpy's, into a fresh array and into a given one, and a union that disagrees with the
    values gives None with the given array untouched."""
    from homagg.host_agent.codec import _native

    monkeypatch.setattr(_native, "threads_for", lambda n: parts)
    rng = np.random.default_rng(parts)
    for n in (0, 1, 31, 32, 33, 100, 1000, 100_003):
        for density in (0.0, 0.05, 0.6, 1.0):
            words = kernels.REF.pack(rng.random(n) < density)
            u = kernels.REF.union_size(words, n)
            values = rng.integers(-2**31, 2**31, u).astype(np.int32)
            scales = np.ldexp(1.0, -rng.integers(0, 40, max(1, -(-n // 32))))
            for dtype in (np.float32, np.float64):
                want = reference(kernels.REF.decode_union_scaled, words, n, values, scales,
                                 dtype)
                got = kernels.JIT.decode_union_scaled(words, n, values, scales, dtype)
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
                out = np.full(n, 3.0, dtype)
                assert kernels.JIT.decode_union_scaled(words, n, values, scales, dtype,
                                                       out) is out
                np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
                if u:
                    out = np.full(n, 3.0, dtype)
                    assert kernels.JIT.decode_union_scaled(words, n, values[:-1], scales,
                                                           dtype, out) is None
                    assert (out == 3.0).all()
