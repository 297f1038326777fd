"""How round 2 carries the values (``Mode``), and which mode the byte count picks.

``Mode`` is a ``str`` enum: a member equals, hashes, formats and serialises (JSON) as its name,
so ``res.mode == "union"`` holds and callers and CLIs may keep passing plain strings ("dense",
"union", "sketch", and "auto" where the codec may choose).
"""

from __future__ import annotations

import enum

from homagg.host_agent.codec.errors import CodecError
from homagg.host_agent.codec.scan import bitmap_words
from homagg.host_agent.codec.sketch import DEFAULT_RATIO, sketch_size


class Mode(enum.StrEnum):
    DENSE = "dense"    # all n int32 values (the SwitchML baseline); no bitmap round
    UNION = "union"    # the int32 values at the positions of U, in order (u words)
    SKETCH = "sketch"  # a count sketch of the values on U, peeled, plus the residual round


#: Let the byte count choose (``choose_mode``) once the union size is known.
AUTO = "auto"
#: The modes' names, in order.
MODES = tuple(m.value for m in Mode)


def as_mode(mode: str, *, auto: bool = False) -> Mode | str:
    """The Mode named ``mode`` (a Mode passes through); ``AUTO`` too where ``auto`` allows it.
    Anything else raises CodecError naming what is expected."""
    if auto and isinstance(mode, str) and mode == AUTO:
        return AUTO
    try:
        return Mode(mode)
    except (ValueError, TypeError):
        expected = f"'auto' or one of {MODES}" if auto else f"one of {MODES}"
        raise CodecError(f"unknown mode {mode!r}; expected {expected}") from None


def round2_words(mode: str, n: int, u: int, ratio: float = DEFAULT_RATIO) -> int:
    mode = as_mode(mode)
    if mode == Mode.DENSE:
        return n
    if mode == Mode.UNION:
        return u
    return sketch_size(u, ratio)


def choose_mode(n: int, u: int, ratio: float = DEFAULT_RATIO,
                index_words: int | None = None) -> Mode:
    """The byte count decides, from n and the union size u only (every worker agrees).

    ``dense`` skips the index rounds, so the compressed modes must also pay for them:
    ``index_words`` words (default: the flat bitmap's, n/32; the hierarchical index's are known
    to every worker once it is complete). Ties go to the simpler encoding.
    """
    index = bitmap_words(n) if index_words is None else index_words
    dense = n
    union = index + u
    sketch = index + sketch_size(u, ratio)
    best = min(dense, union, sketch)
    return Mode.DENSE if best == dense else Mode.UNION if best == union else Mode.SKETCH
