"""Lossless homomorphic gradient codec (after Li et al., MLSys 2024), exact by construction.

A switch can only add int32 words and OR 32-bit words, so every encoding here is *linear*: the
switch's combination of the workers' encodings is the encoding of the sum. Per tensor:

0. quantize fp32 to int32 with a power-of-two scale shared by the job (``shift_for``);
1. round 1: each worker's non-zero bitmap, ORed into the union support U;
2. round 2, one of
   - ``dense``:  all n int32 values (the SwitchML baseline);
   - ``union``:  the int32 values at the positions of U, in order (u words);
   - ``sketch``: a count sketch of the values on U (k = 3 partitioned hashes, +-1 signs, m counters
     derived from u alone), decoded by peeling;
3. round 3 (sketch only): the positions peeling left unresolved, sent densely, so the result is
   always exact. The paper estimates those values instead; we never do.

Every worker derives the same U, m, hashes and unresolved set from what the switch returned, so the
rounds need no extra messages. ``simulate`` runs all of it for several workers with the switch's own
arithmetic (int32 add with overflow detection, bitwise OR).

Note on bytes: once every worker knows U exactly, ``union`` costs u words and ``sketch`` about
1.23 u words, so the byte-count policy (``choose_mode``) prefers ``union``; ``sketch`` is kept,
tested and benchmarked as the paper's scheme (see README, "Codec").

Speed: the loops over the bitmap, the union and the sketch run as numba kernels (``kernels``);
each has a numpy twin, kept as the reference the tests compare it with bit for bit, and used
when numba is missing. Mode ``union`` never lists U on the worker: ``encode_union`` ranks a
worker's non-zeros by popcounts of the ORed bitmap, and ``decode_union`` writes the dense sum in
one pass over that bitmap (``union_indices`` + ``assemble`` remain, for the sketch and as the
reference). ``Scan.of`` reads the tensor once for bitmap, positions and values.

The modules, by concern: ``quantization`` (the scale), ``scan`` (a worker's tensor, round 1's
bitmaps), ``sketch`` (count sketch and peeling), ``modes`` (``Mode``, the byte-count choice),
``union`` (a worker's rounds 2 and 3), ``simulation`` (the whole job in memory), ``kernels``
(numba or numpy: ``_jit`` and ``_ref``), ``errors``. This package re-exports their public names.
"""

from homagg.host_agent.codec import kernels
from homagg.host_agent.codec.errors import AggregationOverflow, CodecError
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
    bitmap,
    bitmap_words,
    ranks_in,
    set_bits,
    union_indices,
    union_size,
)
from homagg.host_agent.codec.simulation import SimResult, simulate, switch_add, switch_or
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
    decode_values,
    encode_union,
    encode_values,
    residual_values,
)

__all__ = [
    "AUTO", "DEFAULT_HEADROOM", "DEFAULT_RATIO", "INT32_MAX", "INT32_MIN", "K_HASHES", "MODES",
    "SKETCH_SLACK", "AggregationOverflow", "CodecError", "Mode", "PeelResult", "Scan",
    "SimResult", "Sparse", "as_mode", "assemble", "bitmap", "bitmap_words", "check_int32",
    "choose_mode", "decode_union", "decode_values", "dequantize", "encode_union",
    "encode_values", "kernels", "max_exponent", "peel", "quantize", "ranks_in",
    "residual_values", "round2_words", "set_bits", "shift_for", "simulate", "sketch_encode",
    "sketch_hashes", "sketch_size", "switch_add", "switch_or", "union_indices", "union_size",
]
