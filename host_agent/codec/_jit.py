"""The codec's kernels compiled with numba: the loops over the bitmap, the union and the sketch.

Same functions, same signatures and bit for bit the same results as their numpy twins in
``_ref`` (the tests hold them to it); ``kernels`` picks this module when numba imports. This
module is the interface, the same names as ``_ref``'s; the kernels live by what they loop
over: ``_jit_bitmap`` (the bitmap, the union, the scan; it also holds ``_njit``, the one numba
setting), ``_jit_sketch`` (hashes, encoding, peeling) and ``_jit_blocks`` (block floating
point). Each public function there prepares the arrays (contiguous, int64 positions) and runs
the ``_k_*`` kernels; where a kernel cannot take an input (another dtype, a scale outside the
normal floats, too many elements per sketch counter) it hands over to the numpy reference,
with the same result. Only these modules import numba, and only ``kernels`` imports them,
when numba is there.
"""

from __future__ import annotations

from homagg.host_agent.codec._jit_bitmap import (
    assemble,
    decode_union,
    decode_union_scaled,
    encode_union,
    gather_union,
    level_counts,
    pack,
    ranks,
    scan,
    set_bits,
    subblocks,
    union_size,
)
from homagg.host_agent.codec._jit_blocks import (
    block_peaks,
    encode_union_blocks,
    quantize_blocks,
    scale_blocks,
    split_mask,
    summary,
)
from homagg.host_agent.codec._jit_sketch import hashes, peel, sketch_encode

__all__ = ["pack", "scan", "set_bits", "ranks", "union_size", "encode_union", "gather_union",
           "decode_union", "decode_union_scaled", "subblocks", "level_counts", "hashes",
           "sketch_encode", "peel", "assemble", "block_peaks", "scale_blocks", "split_mask",
           "summary", "quantize_blocks", "encode_union_blocks"]
