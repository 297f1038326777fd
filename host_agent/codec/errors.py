"""The codec's two errors: input it refuses, and an int32 sum that would be wrong."""

from __future__ import annotations

import numpy as np

from homagg.errors import HomaggError


class CodecError(HomaggError, ValueError):
    """Input the codec refuses (NaN/Inf, wrong shape or dtype, inconsistent workers);
    ``index``: the element at fault, when there is one."""

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


class AggregationOverflow(HomaggError, ArithmeticError):
    """An int32 add overflowed in the (simulated) switch: the sum would be wrong, so we stop."""

    def __init__(self, round_name: str, words: np.ndarray):
        self.round_name = str(round_name)  # a Mode names its round by its value
        self.words = words
        super().__init__(
            f"int32 overflow in round {self.round_name!r} at {words.size} word(s) "
            f"(first at word {int(words[0]) if words.size else -1}); rescale and resend"
        )
