"""A run of datagrams from the switch matched to a round's chunks at once: the results on the
common path written in place, their chunks marked done, and what the round's loss recovery
needs of them (``Round.take_run`` applies it).

Two implementations of one contract, ``take(...) -> Taken``: ``take_ref`` (numpy: the
reference the tests compare against, and the fallback without numba) and ``take_jit`` (numba:
one compiled pass over the run's rows). The numpy one is a couple dozen array operations per
run whatever its length; in an agent on a loaded machine (woken after sleeping in select,
its caches cold) those cost 130-160 us a run of ~35 results, most of the agent's matching.

A row is on the common path (``plain``) when its header's first 8 bytes, under ``mask``, are
``expect`` (op, flags that need a closer look, job and generation), its auth word is the job's
key (``auth``) and its round tag names a chunk of the round; in a fused round (two parts of
different ops, ``Round``), chunks from ``split`` on expect ``expect2``, their part's op. The
others (``odd``) are the
caller's, one by one, before the plain ones (``after_odd``: the first call only classifies
when a run has odd rows). Of the plain rows,
the first copy of each chunk not already done is taken; later copies are ignored.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import NamedTuple

import numpy as np

from homagg import wire

#: numba is installed: the compiled pass is compiled (or loaded from numba's cache) at its
#: first use, a run of more than SMALL rows (a join's single reply goes to the reference: an
#: agent whose rounds all run in the C library then never imports numba)
HAVE_NUMBA = importlib.util.find_spec("numba") is not None
SMALL = 4

_SEQ_AT = wire.OFFSETS["seq"]
_AUTH_AT = wire.OFFSETS["auth"]
_WORDS_AT = wire.OFFSETS["words"]
assert (_SEQ_AT, _AUTH_AT, _WORDS_AT) == (8, 12, 16), \
    "the header's two words, the round tag and the key"


def head8(**fields: int) -> np.uint64:
    """The first 8 bytes of a header with these fields (the rest zero), read as a little-endian
    word, as ``take`` reads them: a mask, or what a plain result has under it."""
    names = [name for name, _, _ in wire.BYTE_FIELDS]
    head = wire.HEADER.pack(*(fields.get(name, 0) for name in names))
    return np.uint64(int.from_bytes(head[:_SEQ_AT], "little"))


#: What the common path checks: the op (not the version), the flags that need a closer look
#: (FLAG_RESULT | FLAG_REFUSED | FLAG_STATUS), the job and the generation.
MASK = head8(version_op=0x0F, flags=wire.FLAG_RESULT | wire.FLAG_REFUSED | wire.FLAG_STATUS,
             job=0xFFFF, gen=0xFF)
OVERFLOW = head8(flags=wire.FLAG_OVERFLOW)


class Taken(NamedTuple):
    """What ``take`` did. ``odd``: rows off the common path (in ``odd_rows[:odd]``); when
    nonzero and the call was not ``after_odd``, nothing was taken (the rest is zero).
    ``plain``: rows on it; ``added``: chunks newly done (their numbers in ``new[:added]``);
    ``last``: of those, the latest sent (highest-numbered among ties), -1 if none;
    ``fresh_sum``, ``fresh``: the send times summed, and the count, of those never resent;
    ``overflow``: a taken result carries FLAG_OVERFLOW."""

    odd: int
    plain: int
    added: int
    last: int
    fresh_sum: float
    fresh: int
    overflow: bool


def take_ref(run, count: int, psize: int, k: int, seq0: int, nchunks: int,
             expect: np.uint64, auth: int, done: np.ndarray, out: np.ndarray,
             sent_at: np.ndarray, resent: np.ndarray, new: np.ndarray, odd_rows: np.ndarray,
             after_odd: bool, split: int | None = None, expect2: np.uint64 | None = None
             ) -> Taken:
    """The numpy reference. ``run``: ``count`` datagrams of ``psize`` bytes end to end;
    ``out``: the round's int32 results (chunk c at c*k); ``new``, ``odd_rows``: int64 arrays
    of ``count`` at least, written."""
    h8 = np.ndarray((count,), "<u8", run, 0, (psize,))
    c = np.ndarray((count,), "<u4", run, _SEQ_AT, (psize,)).byteswap()  # the round tags
    np.subtract(c, np.uint32(seq0), out=c)  # chunk numbers (mod 2**32)
    head = np.bitwise_and(h8, MASK)
    if split is None or split >= nchunks:
        plain = head == expect
    else:  # a fused round: each part's op
        plain = head == np.where(c < split, expect, expect if expect2 is None else expect2)
    plain &= np.ndarray((count,), ">u4", run, _AUTH_AT, (psize,)) == np.uint32(auth)
    plain &= c < nchunks
    rows: np.ndarray | None = None
    if not plain.all():
        odd = np.flatnonzero(~plain)
        odd_rows[:odd.size] = odd
        if not after_odd:
            return Taken(odd.size, 0, 0, -1, 0.0, 0, False)
        rows = np.flatnonzero(plain)
    c_rows = c if rows is None else c[rows]
    nodd, nplain = count - c_rows.size, c_rows.size
    undone = ~done[c_rows]
    c_new = c_rows[undone]
    ndone = int(np.count_nonzero(done))
    done[c_new] = True
    added = int(np.count_nonzero(done)) - ndone
    if added != c_new.size or c_new.size != nplain:
        pos = np.flatnonzero(undone)  # the rows of c_new among the plain ones
        if added != c_new.size:  # a chunk twice in the run: its first copy
            c_new, first = np.unique(c_new, return_index=True)
            pos = pos[first]
        rows = pos if rows is None else rows[pos]
    if not added:
        return Taken(nodd, nplain, 0, -1, 0.0, 0, False)
    words = np.ndarray((count, k), ">i4", run, _WORDS_AT, (psize, 4))
    out.reshape(-1, k)[c_new] = words if rows is None else words[rows]
    new[:added] = c_new
    sent = sent_at[c_new]
    last = int(c_new[sent == sent.max()].max())
    unsent = ~resent[c_new]
    ovf = h8 if rows is None else h8[rows]
    return Taken(nodd, nplain, added, last, float(sent[unsent].sum()), int(unsent.sum()),
                 bool(np.bitwise_and(ovf, OVERFLOW).any()))


def _bswap32(w):
    """A big-endian word read as native (little-endian) uint32, as the wire sent it."""
    return ((w & 0xFF) << 24) | ((w >> 8) & 0xFF) << 16 | ((w >> 16) & 0xFF) << 8 | (w >> 24)


def _head(run32, b):
    """The first 8 header bytes of the row at word ``b``, as ``head8`` builds them."""
    return np.uint64(run32[b]) | (np.uint64(run32[b + 1]) << np.uint64(32))


def _plain_chunk(run32, b, seq0, nchunks, mask, expect, auth, split, expect2):
    """The chunk of the row at word ``b`` if it is on the common path, else -1."""
    h = _head(run32, b)
    c = (np.int64(_bswap32(run32[b + 2])) - seq0) & 0xFFFFFFFF
    if c >= nchunks or (h & mask) != (expect if c < split else expect2):
        return -1
    return c if _bswap32(run32[b + 3]) == auth else -1


def _take_kernel(run32, count, psize4, k, seq0, nchunks, mask, expect, auth, ovf_mask, done,
                 out, sent_at, resent, new, odd_rows, after_odd, split, expect2):
    """The compiled pass: ``run32`` the run as native uint32 words (a row is ``psize4``)."""
    nodd = 0
    for r in range(count):
        if _plain_chunk(run32, r * psize4, seq0, nchunks, mask, expect, auth, split,
                        expect2) < 0:
            odd_rows[nodd] = r
            nodd += 1
    if nodd and not after_odd:
        return nodd, 0, 0, -1, 0.0, 0, False
    nplain = added = fresh = 0
    last, last_t, fresh_sum, overflow = -1, -np.inf, 0.0, False
    for r in range(count):
        b = r * psize4
        c = _plain_chunk(run32, b, seq0, nchunks, mask, expect, auth, split, expect2)
        if c < 0:
            continue
        nplain += 1
        if done[c]:
            continue
        done[c] = True
        new[added] = c
        added += 1
        o, src = c * k, b + 4
        for j in range(k):
            out[o + j] = _bswap32(run32[src + j])
        t = sent_at[c]
        if t > last_t or (t == last_t and c > last):
            last, last_t = c, t
        if not resent[c]:
            fresh_sum += t
            fresh += 1
        if _head(run32, b) & ovf_mask:
            overflow = True
    return nodd, nplain, added, last, fresh_sum, fresh, overflow


_compiled = None
_compiling = threading.Lock()


def _kernel():
    """The compiled pass, compiled at the first call (the helpers first: the kernel finds
    them compiled, inlined)."""
    global _compiled, _bswap32, _head, _plain_chunk
    with _compiling:
        if _compiled is None:
            import numba

            _bswap32 = numba.njit(inline="always")(_bswap32)
            _head = numba.njit(inline="always")(_head)
            _plain_chunk = numba.njit(inline="always")(_plain_chunk)
            _compiled = numba.njit(cache=True, nogil=True)(_take_kernel)
    return _compiled


def take_jit(run, count: int, psize: int, k: int, seq0: int, nchunks: int,
             expect: np.uint64, auth: int, done: np.ndarray, out: np.ndarray,
             sent_at: np.ndarray, resent: np.ndarray, new: np.ndarray, odd_rows: np.ndarray,
             after_odd: bool, split: int | None = None, expect2: np.uint64 | None = None
             ) -> Taken:
    """``take_ref``'s contract, compiled (numba)."""
    assert HAVE_NUMBA, "take_jit needs numba"
    kernel = _compiled if _compiled is not None else _kernel()
    run32 = np.frombuffer(run, np.uint32, count * psize // 4)
    second = expect if split is None or expect2 is None else expect2
    return Taken(*kernel(run32, count, psize // 4, k, seq0, nchunks, MASK, expect,
                            np.uint32(auth), OVERFLOW, done, out.view(np.uint32), sent_at,
                            resent, new, odd_rows, after_odd,
                            np.int64(nchunks if split is None else split), np.uint64(second)))


def take(run, count: int, *args) -> Taken:
    """What ``Round.take_run`` calls: the compiled pass where numba is installed, but for a
    run of at most SMALL rows before it is compiled; else the reference."""
    if HAVE_NUMBA and (_compiled is not None or count > SMALL):
        return take_jit(run, count, *args)
    return take_ref(run, count, *args)
