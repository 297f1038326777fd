"""Lossless homomorphic gradient codec (after Li et al., MLSys 2024), exact by construction.

A switch can only add int32 words and OR 32-bit words, so every encoding here is *linear*: the
switch's combination of the workers' encodings is the encoding of the sum. Per tensor:

0. quantize fp32 to int32 with power-of-two scales shared by the job: one per block of 256
   elements (``blocks``: block floating point), under the tensor's headroom (``shift_for``);
1. the index, ORed into the union support U (``index``): round 1 carries each worker's flat
   non-zero bitmap (n/32 words), or the top level of a hierarchical bitmap (128 -> 8 -> 1
   elements) whose two further OR rounds carry only what the union's level above has set, so
   its size follows the union; both give every worker the same flat union bitmap;
2. the values (round 2 after a flat index, round 4 after the hierarchy), one of
   - ``dense``:  all n int32 values (the SwitchML baseline);
   - ``union``:  the int32 values at the positions of U, in order (u words);
   - ``sketch``: a count sketch of the values on U (k = 3 partitioned hashes, +-1 signs, m counters
     derived from u alone), decoded by peeling;
3. then (sketch only): the positions peeling left unresolved, sent densely, so the result is
   always exact. The paper estimates those values instead; we never do.

Every worker derives the same U, m, hashes and unresolved set from what the switch returned, so the
rounds need no extra messages. ``homagg.host_agent.simulate`` runs all of it for several workers
(the agents themselves) with the switch's own arithmetic (int32 add with overflow detection,
bitwise OR).

Note on bytes: once every worker knows U exactly, ``union`` costs u words and ``sketch`` about
1.23 u words, so the byte-count policy (``choose_mode``) prefers ``union``; ``sketch`` is kept,
tested and benchmarked as the paper's scheme (see docs/agent.md, "The codec").

Speed: the loops over the bitmap, the union and the sketch run as numba kernels (``kernels``);
each has a numpy twin, kept as the reference the tests compare it with bit for bit, and used
when numba is missing. Mode ``union`` never lists U on the worker: ``encode_union`` ranks a
worker's non-zeros by popcounts of the ORed bitmap, and ``decode_union`` writes the dense sum in
one pass over that bitmap (``union_indices`` + ``assemble`` remain, for the sketch and as the
reference). ``Scan.of`` reads the tensor once for bitmap, positions and values.

The modules, by concern: ``quantization`` (the scale), ``blocks`` (per-block scales),
``scan`` (a worker's tensor, round 1's bitmaps, the shifts a job agrees on), ``index``
(flat or hierarchical index, and the choice between them), ``sketch`` (count sketch and
peeling), ``modes`` (``Mode``, the byte-count choice),
``union`` (a worker's rounds 2 and 3), ``kernels`` (numba or numpy: ``_jit`` and ``_ref``;
``_jit`` gathers ``_jit_bitmap``, ``_jit_sketch`` and ``_jit_blocks``), ``errors``. This
package re-exports their public names.
"""

from homagg.host_agent.codec import kernels
from homagg.host_agent.codec.blocks import (
    DEFAULT_BLOCK,
    MAX_OFFSET,
    block_count,
    block_offsets,
    block_words,
    check_out,
    element_shifts,
    element_words,
    scale_blocks,
    split_flags,
    split_offsets,
    split_positions,
)
from homagg.host_agent.codec.errors import AggregationOverflow, CodecError
from homagg.host_agent.codec.index import (
    FLAT,
    HIER,
    INDEXES,
    ROUND_FLAT,
    ROUND_LEAF,
    ROUND_MID,
    ROUND_TOP,
    Levels,
    as_index,
    choose_index,
    hier_rounds,
    hier_saving,
    level_words,
    top_bits,
    union_bitmap,
    union_blocks,
    union_subblocks,
)
from homagg.host_agent.codec.modes import AUTO, MODES, Mode, as_mode, choose_mode, round2_words
from homagg.host_agent.codec.quantization import (
    DEFAULT_HEADROOM,
    INT32_MAX,
    INT32_MIN,
    dequantize,
    max_exponent,
    quantize,
    shift_for,
)
from homagg.host_agent.codec.scan import (
    Scan,
    Sparse,
    Summary,
    agreed_shifts,
    bitmap,
    bitmap_words,
    ranks_in,
    set_bits,
    split_blocks,
    union_indices,
    union_size,
)
from homagg.host_agent.codec.sketch import (
    DEFAULT_RATIO,
    K_HASHES,
    SKETCH_SLACK,
    PeelResult,
    peel,
    sketch_encode,
    sketch_hashes,
    sketch_size,
)
from homagg.host_agent.codec.union import (
    assemble,
    check_int32,
    decode_union,
    decode_union_blocks,
    decode_values,
    encode_union,
    encode_union_dense,
    encode_union_float,
    encode_values,
    residual_values,
)

__all__ = [
    "AUTO", "DEFAULT_BLOCK", "DEFAULT_HEADROOM", "MAX_OFFSET", "agreed_shifts", "block_count",
    "block_offsets", "block_words", "check_out", "decode_union_blocks", "element_shifts",
    "element_words", "scale_blocks", "split_blocks", "split_flags", "split_offsets",
    "split_positions", "DEFAULT_RATIO", "FLAT", "HIER", "INDEXES", "INT32_MAX",
    "INT32_MIN", "K_HASHES", "MODES", "ROUND_FLAT", "ROUND_LEAF", "ROUND_MID", "ROUND_TOP",
    "SKETCH_SLACK", "AggregationOverflow", "CodecError", "Levels", "Mode", "PeelResult", "Scan",
    "Sparse", "Summary", "as_index", "as_mode", "assemble", "bitmap", "bitmap_words",
    "check_int32", "choose_index", "choose_mode", "decode_union", "decode_values", "dequantize",
    "encode_union", "encode_union_dense", "encode_union_float", "encode_values", "hier_rounds",
    "hier_saving", "kernels", "level_words", "max_exponent",
    "peel", "quantize", "ranks_in", "residual_values", "round2_words", "set_bits", "shift_for",
    "sketch_encode", "sketch_hashes", "sketch_size",
    "top_bits", "union_bitmap", "union_blocks", "union_indices", "union_size", "union_subblocks",
]
