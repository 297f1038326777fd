"""A round's packets, built in one go before its first send: every chunk's header and words,
end to end, so a run of chunks leaves in one system call from the batch's own bytes.

``pack`` is numpy's (the reference, and the Python engine's); the native engine builds the
same bytes in C (``engine.native.NativeLink.pack``), and tests hold the two to each other.
"""

from __future__ import annotations

import numpy as np

from homagg import wire

_FIELD_NAMES = [name for name, _, _ in wire.BYTE_FIELDS]


def pack(flat: np.ndarray, k: int, nchunks: int, g0: int, slots: int, head: bytes,
         join_nonce: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """A round's packets (``wire.packet_dtype(k)``, one per chunk): ``head`` (its flags kept)
    with each chunk's copy (FLAG_PHASE), slot and round tag (the join's: its nonce), then its
    words in the wire's order, the last chunk's tail zero (neutral for ADD and OR). The native
    engine's ``ha_pack`` makes the same bytes (tests hold it to this). ``out``: where to build
    them (``nchunks`` packets of that dtype), else a new array."""
    n = flat.size
    g = g0 + np.arange(nchunks, dtype=np.int64)
    if out is None:
        batch = np.zeros(nchunks, wire.packet_dtype(k))
    else:
        batch = out
        batch["words"][-1] = 0  # (the last chunk's tail)
    fields = dict(zip(_FIELD_NAMES, wire.HEADER.unpack(head)))
    for name, value in fields.items():
        batch[name] = value
    # (head's flags: FLAG_OVERFLOW where the words are a partial sum that overflowed)
    batch["flags"] = np.where((g // slots) % 2 == 1, wire.FLAG_PHASE, 0) | fields["flags"]
    batch["slot"] = g % slots
    batch["seq"] = (g + 1) & 0xFFFFFFFF if join_nonce is None else join_nonce
    # the words straight into the packets (big-endian): no padded copy, and the batch's own
    # bytes are sent
    whole = n // k
    field = batch["words"]
    if whole:
        field[:whole] = flat[:whole * k].reshape(whole, k)
    if n > whole * k:
        field[whole, :n - whole * k] = flat[whole * k:]
    return batch
