"""Which kernels the codec runs: the compiled ones (``_compiled``: the C library's where it
has them, else numba's ``_jit``) when numba is installed, else numpy's.

``_ref`` (numpy) and ``_jit`` (numba) define the same functions with the same signatures; the
codec calls ``kernels.active.<function>``, so it has no branch on numba. ``_compiled`` is
``_jit`` with the C library's twins in front (a float32 tensor's kernels, every mode), and
numba imported at the first kernel of its that runs. ``_ref`` is the reference: the tests run them
all and compare them bit for bit, selecting one with ``use`` / ``using`` (or by setting
``active``).

    pack(mask)                                -> uint32 bitmap words
    scan(x)                                   -> (words, int64 positions, values) of non-zeros
    set_bits(words, n)                        -> int64 positions < n set in words
    ranks(union, idx)                         -> int64 ranks of idx in union, None if not in it
    union_size(words, n)                      -> int
    encode_union(words, n, idx, val)          -> int32 values by union rank, None if not in it
    gather_union(words, n, q)                 -> int32 q at the union's positions, by rank
    decode_union(words, n, values, shift, dt) -> dense float tensor, None on a size mismatch
    decode_union_scaled(words, n, values, word_scales, dt, out=None)
                                              -> the same, one scale per bitmap word; into
                                                 ``out`` where given (written only once the
                                                 sizes agree: it may be the worker's tensor)
    subblocks(mid, blocks)                    -> int64 sub-blocks set in a hierarchical index's
                                                 mid level (``index``), 16 bits per block
    level_counts(words, n)                    -> (blocks, sub-blocks) of a flat bitmap with a
                                                 bit set: its hierarchy's c1 and c2 (``index``)
    hashes(idx, part, s1, s2)                 -> (positions, signs), each (3, len)
    sketch_encode(idx, val, m, s1, s2)        -> m counters (unbounded)
    peel(counters, union, s1, s2)             -> (values, resolved, rounds)
    assemble(n, union, values, shift, dt)     -> dense float tensor
    scale_blocks(values, scales, block, dt, out=None)
                                              -> integer values times their block's scale,
                                                 rounded once to dt (``blocks``), into
                                                 ``out`` where given
    block_peaks(idx, raw, nb, block)          -> float64 per block: its largest magnitude
    split_mask(idx, raw, nb, block, binades, run)
                                              -> bool per block: a run of small values in it
                                                 (``blocks.split_flags``)
    summary(x, block, binades, run, split, cap)
                                              -> (words, peaks, split mask, first non-finite
                                                 or -1, (positions, values) or None): round 1
    quantize_blocks(x, shifts, block, at, at_shifts, out=None)
                                              -> (int32 words, in ``out`` where given, first
                                                 bad position or -1)
    encode_union_blocks(words, n, idx, raw, shifts, block, at, at_shifts)
                                              -> int32 values by union rank, quantized as
                                                 quantize_blocks does; None if one does not
                                                 quantize or idx leaves the union

``words`` are contiguous uint32 and long enough for n (the codec checks both first).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from homagg.host_agent.codec import _compiled, _ref

#: The numpy reference kernels.
REF: ModuleType = _ref
#: The compiled kernels (C, else numba, imported at its first kernel), None when numba is not
#: installed (compiled kernels for the O(n) and O(u) loops; _ref stays the reference)
JIT: ModuleType | None = _compiled if importlib.util.find_spec("numba") is not None else None
#: The kernels the codec calls now.
active: ModuleType = JIT if JIT is not None else REF


def _named(which: str) -> ModuleType:
    if which == "ref":
        return REF
    if which == "jit":
        if JIT is None:
            raise RuntimeError("the compiled kernels need numba, which is not installed")
        return JIT
    raise ValueError(f"kernels {which!r}: 'jit' or 'ref'")


def use(which: str) -> ModuleType:
    """Run the codec on ``'jit'`` or ``'ref'`` from now on; returns the set used before."""
    global active
    before, active = active, _named(which)
    return before


@contextmanager
def using(which: str) -> Iterator[ModuleType]:
    """``with kernels.using("ref"): ...``: the codec runs on that set inside the block."""
    global active
    before = use(which)
    try:
        yield active
    finally:
        active = before
