"""The dense passes of a worker's tensor: round 1's reading of it (``Summary``, the kernels'
``summary``) and its words at the block scales (``quantize_blocks``), held bit for bit to the
numpy reference and to the sparse path they replace (``Scan``'s block words, split flags and
max exponent; ``quantize`` at every element's shift)."""

from __future__ import annotations

import numpy as np
import pytest

import homagg.native
from homagg.host_agent import codec
from homagg.host_agent.codec import CodecError, _native, kernels
from homagg.host_agent.local import HostTensor, Scales

needs_jit = pytest.mark.skipif(kernels.JIT is None, reason="numba not installed")


def _tensors(dtype):
    """Layers of very different scales, zeros, -0.0, subnormals, runs across block ends,
    sparse and dense, at sizes around the words' and the blocks' edges."""
    rng = np.random.default_rng(35)
    for n in (0, 1, 31, 32, 33, 300, 4097, 5000, 100_003):
        for density in (0.0, 0.001, 0.2, 1.0):
            layers = 10.0 ** rng.integers(-12, 3, n // 1000 + 1)
            x = rng.standard_normal(n) * layers.repeat(1000)[:n]
            x[rng.random(n) >= density] = 0
            if n > 40:
                x[5:8] = [1e-40, -0.0, 3e-39]
                x[33:38] = x[33:38] * 1e-9  # a run far below its block's peak
            yield x.astype(dtype)


def _with_bad(x, rng):
    """Copies of x with a NaN, an Inf and a -Inf at random places (two of them)."""
    for bad in (np.nan, np.inf, -np.inf):
        if x.size:
            y = x.copy()
            at = np.sort(rng.choice(x.size, min(2, x.size), replace=False))
            y[at] = bad
            yield y, int(at[0])


@needs_jit
@pytest.mark.parametrize("native", ["c", "c-baseline", "c-threads", "numba"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_summary_kernels_agree_with_the_reference(dtype, native, monkeypatch):
    """The compiled summary (float32 with whole-word blocks: the C library's, with AVX2, with
    the baseline loop, and split between 3 threads at every size; else numba's) against
    numpy's."""
    if native == "numba":
        monkeypatch.setattr(_native, "summary_f32", lambda *args, **kw: None)
    else:
        if homagg.native.load() is None:
            pytest.skip(f"the native library is off: {homagg.native.why()}")
        if native == "c-baseline":
            c = _native.summary_f32
            monkeypatch.setattr(_native, "summary_f32",
                                lambda *args, **kw: c(*args, **kw, baseline=True))
        if native == "c-threads":  # shares' edges inside the small tensors too
            monkeypatch.setattr(_native, "threads_for", lambda n: 3)
        assert _native.summary_f32(np.zeros(64, np.float32), 32, 8, 5, True) is not None
    rng = np.random.default_rng(1)
    for x in _tensors(dtype):
        cases = [(x, -1), *_with_bad(x, rng)]
        for y, first_bad in cases:
            for block, split, binades, run in ((256, True, 8, 5), (100, True, 2, 1),
                                               (3, False, 8, 5), (16, True, 0, 3),
                                               (32, True, 8, 5), (64, True, 0, 1),
                                               (32, False, 8, 0)):
                for cap in (0, y.size // 4 + 64, y.size + 1):
                    got = kernels.JIT.summary(y, block, binades, run, split, cap)
                    with kernels.using("ref"):
                        want = kernels.REF.summary(y, block, binades, run, split, cap)
                    for g, w in zip(got[:3], want[:3]):
                        assert g.dtype == w.dtype
                        np.testing.assert_array_equal(g, w)
                    assert got[3] == want[3] == first_bad
                    assert (got[4] is None) == (want[4] is None)
                    if got[4] is not None:
                        np.testing.assert_array_equal(got[4][0], want[4][0])
                        np.testing.assert_array_equal(got[4][1], want[4][1])


def test_a_large_tensor_is_read_on_threads_with_the_same_bits():
    """From THREADS_FROM elements on the C passes split the tensor between threads (where the
    process may run on several cores); the same bits as numpy's, a non-finite value late in
    the tensor found, split blocks in every share."""
    if homagg.native.load() is None:
        pytest.skip(f"the native library is off: {homagg.native.why()}")
    rng = np.random.default_rng(36)
    n = _native.THREADS_FROM + 12_345
    for density in (0.01, 1.0):
        x = np.where(rng.random(n) < density, rng.standard_normal(n), 0).astype(np.float32)
        x[::50_000] *= 1e-7  # small values, some in runs: split blocks across the tensor
        x[n // 2:n // 2 + 600] = rng.standard_normal(600) * 1e-6
        for bad_at in (None, n - 40):
            y = x.copy()
            if bad_at is not None:
                y[bad_at] = np.nan
            got = kernels.JIT.summary(y, 256, 8, 5, True, n // 4 + 64)
            with kernels.using("ref"):
                want = kernels.REF.summary(y, 256, 8, 5, True, n // 4 + 64)
            for g, w in zip(got[:3], want[:3]):
                np.testing.assert_array_equal(g, w)
            assert got[3] == want[3] == (-1 if bad_at is None else bad_at)
            assert (got[4] is None) == (want[4] is None) == (density == 1.0)
            if got[4] is not None:
                np.testing.assert_array_equal(got[4][0], want[4][0])
                np.testing.assert_array_equal(got[4][1], want[4][1])
            if bad_at is None and density == 1.0:
                assert want[2].any()  # the split blocks are there to find


@pytest.mark.parametrize("which", ["jit", "ref"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_summary_gives_the_scans_round_1_words(which, dtype):
    """What round 1 sends from ``Summary`` equals what the sparse path (``Scan``) gave."""
    if which == "jit" and kernels.JIT is None:
        pytest.skip("numba not installed")
    with kernels.using(which):
        split_seen = 0
        for x in _tensors(dtype):
            for block in (256, 100, 3):
                for split in (True, False):
                    sm = codec.Summary.of(x, block, split)
                    scan = codec.Scan.of(x)
                    e = scan.max_exponent()
                    assert sm.finite() and sm.max_exponent() == e
                    np.testing.assert_array_equal(sm.words, scan.words)
                    np.testing.assert_array_equal(
                        sm.block_words(e), codec.block_words(scan.idx, scan.raw, x.size, block, e))
                    flags = codec.split_flags(scan.idx, scan.raw, x.size, block, split)
                    np.testing.assert_array_equal(sm.split_flags(), flags)
                    split_seen += int(flags.any())
                    if sm.scan is not None:  # a sparse tensor's positions come with it
                        np.testing.assert_array_equal(sm.scan.idx, scan.idx)
                        np.testing.assert_array_equal(sm.scan.raw, scan.raw)
                    else:
                        assert scan.idx.size > x.size // 4 + 64
        assert split_seen  # the cases do split blocks


def test_summary_names_the_first_non_finite_value():
    x = np.ones(1000, np.float32)
    x[[17, 600]] = [np.inf, np.nan]
    sm = codec.Summary.of(x, 256, True)
    assert not sm.finite() and sm.bad == 17
    assert not sm.peaks.any() and not sm.mask.any()  # nothing is scaled
    with pytest.raises(CodecError, match="non-finite value at index 17") as err:
        sm.max_exponent()
    assert err.value.index == 17
    with pytest.raises(CodecError, match="block size 0"):
        codec.Summary.of(x, 0, True)
    with pytest.raises(CodecError, match="floating-point"):
        codec.Summary.of(np.ones(4, np.int32), 256, True)


def _scales(x, block, rng, split: bool):
    e = codec.max_exponent(x)
    nb = codec.block_count(x.size, block)
    offsets = rng.integers(0, 3, nb)  # (finer than the job's at most by the headroom's bits)
    at = at_offsets = None
    if split and x.size:
        at = np.sort(rng.choice(x.size, max(1, x.size // 50), replace=False)).astype(np.int64)
        at_offsets = rng.integers(0, 3, at.size)
    return Scales(codec.shift_for(e, 4), offsets, block, at, at_offsets)


@pytest.mark.parametrize("which", ["jit", "ref"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dense_words_equal_quantize_at_every_elements_shift(which, dtype):
    if which == "jit" and kernels.JIT is None:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(7)
    compared = 0
    with kernels.using(which):
        for x in _tensors(dtype):
            for block in (256, 100, 3):
                for split in (False, True):
                    scales = _scales(x, block, rng, split)
                    try:
                        want = codec.quantize(x, scales.elements(x.size))
                    except CodecError:
                        continue  # (a random offset too fine for some value: tested below)
                    np.testing.assert_array_equal(HostTensor(x)._dense_words(scales), want)
                    compared += 1
    assert compared >= 150  # of 216: the cases run, not skipped


@needs_jit
def test_quantize_blocks_kernels_agree_on_the_first_bad_value():
    rng = np.random.default_rng(8)
    n, block = 20_000, 256
    x = rng.standard_normal(n).astype(np.float32)
    shifts = np.full(codec.block_count(n, block), 28, np.int64)
    at = np.array([5, 300, 301, 19_999], np.int64)
    at_shifts = np.array([29, 1, 29, 2], np.int64)
    for bad_at, value in ((None, None), (12_345, 40.0), (300, 7.0), (301, 9.0), (1, np.nan),
                          (19_999, -np.inf), (0, -9.0)):
        y = x.copy()
        if bad_at is not None:
            y[bad_at] = value
        got, gbad = kernels.JIT.quantize_blocks(y, shifts, block, at, at_shifts)
        want, wbad = kernels.REF.quantize_blocks(y, shifts, block, at, at_shifts)
        # (at 300 the shift is 1: 7.0 fits there; at 301 it is 29: 9.0 does not)
        expect = -1 if bad_at in (None, 300) else bad_at
        assert gbad == wbad == expect, (bad_at, gbad, wbad)
        if expect < 0:
            np.testing.assert_array_equal(got, want)
    # shifts outside the normal float64 powers go to the reference, with its result
    tiny = np.array([1e-30, 3e300, 2.0, -7.5], np.float64)
    none = np.zeros(0, np.int64)
    got, gbad = kernels.JIT.quantize_blocks(tiny, np.array([-1060], np.int64), 4, none, none)
    assert gbad == -1 and got.tolist() == [0, 0, 0, 0]
    got, gbad = kernels.JIT.quantize_blocks(tiny, np.array([-1000, 1060], np.int64), 2, none,
                                            none)
    assert gbad == 2 and got[:2].tolist() == [0, 0]


def _engine(native: str, monkeypatch) -> None:
    """The value rounds' kernels on the C library (AVX2 where the CPU has it, or the
    baseline's loop) or on numba."""
    if native == "numba":
        monkeypatch.setattr(_native, "quantize_f32", lambda *args, **kw: None)
        monkeypatch.setattr(_native, "scale_i32", lambda *args, **kw: None)
        return
    if homagg.native.load() is None:
        pytest.skip(f"the native library is off: {homagg.native.why()}")
    if native == "c-baseline":
        q, s = _native.quantize_f32, _native.scale_i32
        monkeypatch.setattr(_native, "quantize_f32", lambda *a, **kw: q(*a, **kw, baseline=True))
        monkeypatch.setattr(_native, "scale_i32", lambda *a, **kw: s(*a, **kw, baseline=True))
    none = np.zeros(0, np.int64)
    assert _native.quantize_f32(np.ones(4, np.float32), np.zeros(1, np.int64), 4, none,
                                none) is not None
    assert _native.scale_i32(np.ones(4, np.int32), np.ones(1), 4, np.empty(4)) is not None


@needs_jit
@pytest.mark.parametrize("native", ["c", "c-baseline", "numba"])
def test_quantize_and_scale_kernels_agree_with_the_reference_bit_for_bit(native, monkeypatch):
    """quantize_blocks (float32) and scale_blocks (int32 into float32 and float64), the C
    library's and numba's against numpy's: every word and float, ties to even included, every
    tail length and block, the split blocks' own shifts, and the first value that does not
    quantize."""
    _engine(native, monkeypatch)
    rng = np.random.default_rng(11)
    for n in (1, 3, 4, 7, 255, 256, 1000, 4099):
        for block in (1, 3, 4, 100, 256):
            nb = codec.block_count(n, block)
            x = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 10, n)).astype(np.float32)
            x[rng.random(n) < 0.1] = 0.0
            ties = rng.random(n) < 0.1             # ties at shift 0: to even
            x[ties] = rng.choice([0.5, 1.5, 2.5, -0.5, -3.5], ties.sum())
            shifts = rng.integers(-3, 4, nb).astype(np.int64) + 20
            at = np.sort(rng.choice(n, min(n, 5), replace=False)).astype(np.int64)
            at_shifts = rng.integers(0, 40, at.size).astype(np.int64)
            for s_ in (shifts, np.zeros(nb, np.int64)):
                got = kernels.JIT.quantize_blocks(x, s_, block, at, at_shifts)
                want = kernels.REF.quantize_blocks(x, s_, block, at, at_shifts)
                assert got[1] == want[1], (n, block)
                if want[1] < 0:
                    np.testing.assert_array_equal(got[0], want[0])
            v = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
            scales = np.ldexp(1.0, -rng.integers(0, 60, nb))
            for dt in (np.float32, np.float64):
                out = np.full(n, np.nan, dt)
                got = kernels.JIT.scale_blocks(v, scales, block, dt, out)
                want = kernels.REF.scale_blocks(v, scales, block, dt)
                assert got is out and got.tobytes() == want.tobytes(), (n, block, dt)


@pytest.mark.parametrize("baseline", [False, True])
def test_quantize_at_every_shift_around_a_float32_scales_range(baseline):
    """The C loop scales in float32 lanes where a block's 2**shift is a normal float32 (-126 to
    127) and in float64 elsewhere: at every shift from -140 to 159, numpy's words bit for bit,
    for values up to int32's edges, ties, products too small to be normal and subnormal inputs;
    and a value past int32 (or not finite) anywhere in a group of eight is the one named."""
    if homagg.native.load() is None:
        pytest.skip(f"the native library is off: {homagg.native.why()}")
    rng = np.random.default_rng(41)
    block = 40  # (five groups of eight a block)
    shifts = np.arange(-140, 160, dtype=np.int64)
    n = shifts.size * block
    s = shifts.repeat(block)
    m = rng.integers(-2**31 + 256, 2**31 - 256, n).astype(np.float64)  # q up to int32's edges
    ties = rng.random(n) < 0.3
    m[ties] = rng.integers(-1000, 1000, ties.sum()) + 0.5  # ties, to even
    edges = rng.random(n) < 0.1
    m[edges] = rng.choice([-2.0**31, 2.0**31 - 128, 0.49, -0.5, 1e-3], edges.sum())
    m = np.where(s < -95, m * 2.0 ** (s + 95 - 31), m)  # (x within float32's range)
    x = np.ldexp(m, -s).astype(np.float32)  # (some underflow: subnormal, 0)
    x[rng.random(n) < 0.05] = np.float32(1e-42)
    x[rng.random(n) < 0.05] = -np.float32(3e-39)
    q = np.rint(np.ldexp(x.astype(np.float64), s))
    x[(q < -2**31) | (q > 2**31 - 1)] = 0  # (float32's rounding of m)
    assert (q == -2**31).any() and (q == 2**31 - 128).any() and (x == 0).mean() < 0.3
    none = np.zeros(0, np.int64)
    want, wbad = kernels.REF.quantize_blocks(x, shifts, block, none, none)
    assert wbad == -1
    got, gbad = _native.quantize_f32(x, shifts, block, none, none, baseline=baseline)
    assert gbad == -1
    np.testing.assert_array_equal(got, want)
    for at in (0, 7, 8 * 700 + 3, n - 1, 5 * block + 17, 200 * block + 39):
        e = 31 - int(s[at])  # 2**31 at the element's scale: the first value past int32
        past = np.float32(np.ldexp(1.0, e)) if e <= 127 else np.float32(np.inf)
        for bad in (np.inf, np.nan, past, -2 * past):
            y = x.copy()
            y[at] = bad
            assert _native.quantize_f32(y, shifts, block, none, none, baseline=baseline)[1] \
                == kernels.REF.quantize_blocks(y, shifts, block, none, none)[1] == at


@needs_jit
@pytest.mark.parametrize("native", ["c", "c-baseline", "numba"])
def test_the_kernels_name_the_first_value_that_does_not_quantize(native, monkeypatch):
    _engine(native, monkeypatch)
    x = np.random.default_rng(8).standard_normal(20_000).astype(np.float32)
    shifts = np.full(codec.block_count(x.size, 256), 28, np.int64)
    at = np.array([5, 300, 301, 19_999], np.int64)
    at_shifts = np.array([29, 1, 29, 2], np.int64)
    for bad_at, value in ((12_345, 40.0), (300, 7.0), (301, 9.0), (1, np.nan), (2, np.inf),
                          (19_999, -np.inf), (0, -9.0), (7, 8.0), (8, -8.0)):
        y = x.copy()
        y[bad_at] = value
        # (at 300 the shift is 1: 7.0 fits there; at 301 it is 29: 9.0 does not; -8.0 at 28
        # is -2**31, the last int32, and 8.0 is 2**31, the first past it)
        expect = -1 if bad_at in (300, 8) else bad_at
        assert kernels.JIT.quantize_blocks(y, shifts, 256, at, at_shifts)[1] == expect
        assert kernels.REF.quantize_blocks(y, shifts, 256, at, at_shifts)[1] == expect


@pytest.mark.parametrize("which", ["jit", "ref"])
def test_a_value_out_of_range_is_named_by_its_index(which):
    if which == "jit" and kernels.JIT is None:
        pytest.skip("numba not installed")
    x = np.ones(3000, np.float32)
    x[2500] = 4.0
    scales = Scales(30, np.zeros(codec.block_count(3000, 256), np.int64), 256)
    with kernels.using(which), pytest.raises(CodecError) as err:
        HostTensor(x)._dense_words(scales)
    assert err.value.index == 2500
    assert str(err.value) == ("value 4.0 at index 2500 is out of int32 range at shift 30: "
                              "use shift_for()")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_split_round_words_are_read_where_they_are(dtype):
    """``HostTensor.element_words`` reads the split blocks' elements alone: the same words as
    the sparse path's over the whole scan."""
    rng = np.random.default_rng(9)
    for x in _tensors(dtype):
        if not x.size:
            continue
        scan = codec.Scan.of(x)
        e = scan.max_exponent()
        for k in (1, 7, x.size // 3 + 1):
            pos = np.sort(rng.choice(x.size, min(k, x.size), replace=False)).astype(np.int64)
            np.testing.assert_array_equal(HostTensor(x).element_words(pos, e),
                                          codec.element_words(scan.idx, scan.raw, pos, e))


@pytest.mark.parametrize("which", ["jit", "ref"])
def test_union_words_of_a_dense_tensor_equal_the_listed_ones(which):
    """Mode union on a tensor round 1 listed no positions for: its dense words read at the
    union's positions (``encode_union_dense``), the same words as from its non-zeros."""
    if which == "jit" and kernels.JIT is None:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(10)
    unlisted = 0
    with kernels.using(which):
        for x in _tensors(np.float32):
            n = x.size
            for other in (0.0, 0.3):  # the peers' non-zeros, ORed with this worker's
                own = codec.Scan.of(x)
                union = own.words | kernels.REF.pack(rng.random(n) < other)
                scales = _scales(x, 256, rng, split=False)
                try:
                    want = codec.encode_union(own.quantize(scales.of(own.idx)), union)
                except CodecError:
                    continue
                q = HostTensor(x)._dense_words(scales)
                got = codec.encode_union_dense(q, own.words, union)
                assert got.dtype == np.int32
                np.testing.assert_array_equal(got, want)
                h = HostTensor(x)
                h.round1(256, False)
                unlisted += h._scan is None
                np.testing.assert_array_equal(
                    h.value_words(codec.Mode.UNION, scales, union, None, 1, 1.25), want)
            if n and own.idx.size:
                foreign = own.words.copy()
                foreign[own.idx[0] // 32] = np.uint32(0)  # its first non-zero left out
                with pytest.raises(CodecError, match="not contained in the union"):
                    codec.encode_union_dense(q, own.words, foreign)
    assert unlisted >= 8  # the dense tensors took the new path


@needs_jit
def test_gather_union_kernels_agree_and_ignore_bits_past_n():
    rng = np.random.default_rng(11)
    for n in (0, 1, 31, 32, 33, 1000, 4097):
        q = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
        words = kernels.REF.pack(rng.random(32 * (-(-n // 32))) < 0.4)  # bits past n set too
        np.testing.assert_array_equal(kernels.JIT.gather_union(words, n, q),
                                      kernels.REF.gather_union(words, n, q))


def test_the_pass_lists_a_sparse_tensor_and_gives_up_on_a_dense_share(monkeypatch):
    """The C pass lists the non-zeros of a sparse tensor itself; where a share of the tensor
    is dense (a dense layer first, the rest sparse), it gives up and the bitmap lists them:
    the same positions and values either way, as numpy's."""
    if homagg.native.load() is None:
        pytest.skip(f"the native library is off: {homagg.native.why()}")
    rng = np.random.default_rng(37)
    n = 300_001
    for threads in (1, 3):
        monkeypatch.setattr(_native, "threads_for", lambda n, t=threads: t)
        sparse = np.where(rng.random(n) < 0.01, rng.standard_normal(n), 0).astype(np.float32)
        prefix = sparse.copy()
        prefix[:30_000] = rng.standard_normal(30_000) + 3  # a dense share, under n / 4 in all
        for x, listed_in_c in ((sparse, True), (prefix, False)):
            cap = n // 4 + 64
            c = _native.summary_f32(x, 256, 8, 5, True, cap=cap)
            assert (c[5] is not None) == listed_in_c
            got = kernels.JIT.summary(x, 256, 8, 5, True, cap)
            want = kernels.REF.summary(x, 256, 8, 5, True, cap)
            assert got[4] is not None and want[4] is not None
            np.testing.assert_array_equal(got[4][0], want[4][0])
            np.testing.assert_array_equal(got[4][1].view(np.uint32), want[4][1].view(np.uint32))


@pytest.mark.parametrize("which", ["jit", "ref"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_union_words_in_one_pass_equal_the_step_by_step_ones(which, dtype):
    """``encode_union_float`` (quantize at the block and split scales, rank in the union, in
    one pass) gives ``encode_union`` of ``Scan.quantize``'s words, bit for bit; where a value
    does not quantize or the union leaves out a non-zero, None (the steps name it)."""
    if which == "jit" and kernels.JIT is None:
        pytest.skip("numba not installed")
    rng = np.random.default_rng(12)
    compared = refused = 0
    with kernels.using(which):
        for x in _tensors(dtype):
            n = x.size
            own = codec.Scan.of(x)
            for block, split, other, finer in ((256, False, 0.0, 0), (256, True, 0.3, 0),
                                               (100, True, 0.0, 0), (3, False, 0.3, 0),
                                               (256, False, 0.0, 40)):
                union = own.words | kernels.REF.pack(rng.random(n) < other)
                s = _scales(x, block, rng, split)
                s = Scales(s.shift + finer, s.offsets, s.block, s.at, s.at_offsets)
                at_shifts = s.at_shifts() if s.at is not None else None
                got = codec.encode_union_float(own, union, s.blocks(), block, s.at, at_shifts)
                try:
                    want = codec.encode_union(own.quantize(s.of(own.idx)), union)
                except CodecError:
                    assert got is None
                    refused += 1
                    continue
                assert got is not None and got.dtype == np.int32
                np.testing.assert_array_equal(got, want)
                compared += 1
            if own.idx.size:
                foreign = own.words.copy()
                foreign[own.idx[-1] // 32] = np.uint32(0)  # its last non-zero left out
                assert codec.encode_union_float(own, foreign, s.blocks(), s.block) is None
    assert compared >= 100 and refused >= 5


@pytest.mark.parametrize("which", ["jit", "ref"])
def test_union_words_name_a_fault_the_one_pass_found(which):
    """Mode union's words of a sparse tensor: a value out of int32 at its scale, or a
    non-zero outside the union, raises the error that names it, as before the one pass."""
    if which == "jit" and kernels.JIT is None:
        pytest.skip("numba not installed")
    x = np.zeros(3000, np.float32)
    x[[7, 900, 2500]] = [0.5, 1.0, 4.0]
    scales = Scales(30, np.zeros(codec.block_count(3000, 256), np.int64), 256)
    with kernels.using(which):
        h = HostTensor(x)
        r1 = h.round1(256, False)
        with pytest.raises(CodecError) as err:
            h.value_words(codec.Mode.UNION, scales, r1.words, None, 1, 1.25)
        assert err.value.index == 2500
        assert str(err.value) == ("value 4.0 at index 2500 is out of int32 range at shift 30: "
                                  "use shift_for()")
        foreign = r1.words.copy()
        foreign[900 // 32] = np.uint32(0)
        with pytest.raises(CodecError, match="not contained in the union"):
            h.value_words(codec.Mode.UNION, scales.coarser(10), foreign, None, 1, 1.25)
