"""The homagg wire protocol as Python sees it: every module imports its constants from here.

The constants and the header's field list come from the P4 program, through the generated
``homagg._p4consts`` (``homagg.controller.genconsts``): nothing here is typed twice. The
header is declared once, as the P4 field list; the struct, the numpy dtype, the byte offsets,
pack/unpack and the status reply all derive from it. Packets are UDP payloads (homagg header
+ K words); the kernel adds IPv4/UDP. K, the words per packet, is the switch's build-time
choice: WORDS_PER_PACKET is P4's default, and every function here takes ``k`` for another. A
join and its replies carry JOIN_WORDS words whatever K (the agent does not know K yet); the
join's replies say K in their slot field.

Also here, because agents and tests share them: the host-to-host conventions that ride inside
the words (the scale negotiation's exponent words) and the default addresses.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from homagg._p4consts import *  # noqa: F403 - the protocol's constants, generated from P4
from homagg._p4consts import (
    DEFAULT_MTU,
    ENUMS,
    FLAG_OVERFLOW,
    FLAG_PHASE,
    FLAG_RESULT,
    FLAG_STATUS,
    HEADER_FIELDS,
    HOMAGG_HDR_BYTES,
    HOMAGG_UDP_PORT_MAX,
    HOMAGG_UDP_PORT_MIN,
    HOMAGG_VERSION,
    JOIN_WORDS,
    JUMBO_MTU,
    MAX_WORDS_PER_PACKET,
    MIN_WORDS_PER_PACKET,
    OP_ADD,
    OP_JOIN,
    OP_OR,
    STATS,
    WORDS_PER_PACKET,
)
from homagg.errors import HomaggError

OPS = {OP_ADD: "add", OP_OR: "or", OP_JOIN: "join"}
# Every UDP port the switch program takes as homagg's (its parser: 0xBEE0-0xBEEF)
HOMAGG_UDP_PORTS = range(HOMAGG_UDP_PORT_MIN, HOMAGG_UDP_PORT_MAX + 1)
PACKET_BYTES = HOMAGG_HDR_BYTES + 4 * WORDS_PER_PACKET  # the UDP payload, at P4's default K
JOIN_BYTES = HOMAGG_HDR_BYTES + 4 * JOIN_WORDS  # a join and its replies, whatever K


def packet_bytes(k: int = WORDS_PER_PACKET) -> int:
    """The UDP payload of a packet of k words."""
    return HOMAGG_HDR_BYTES + 4 * k


def words_in(nbytes: int) -> int | None:
    """K of a datagram of ``nbytes`` (a reply or a contribution), or None if no K gives it."""
    k, rest = divmod(nbytes - HOMAGG_HDR_BYTES, 4)
    return k if rest == 0 and MIN_WORDS_PER_PACKET <= k <= MAX_WORDS_PER_PACKET else None


#: IPv4 (no options) and UDP around a homagg datagram
IP_UDP_BYTES = 20 + 8


def frame_bytes(k: int = WORDS_PER_PACKET) -> int:
    """The IPv4 packet of k words: what has to fit an interface's MTU."""
    return IP_UDP_BYTES + packet_bytes(k)


def mtu_words(mtu: int = DEFAULT_MTU) -> int:
    """The largest K whose packets fit ``mtu`` (364 at 1500, 2239 at 9000), at most
    MAX_WORDS_PER_PACKET."""
    return min(MAX_WORDS_PER_PACKET, (mtu - IP_UDP_BYTES - HOMAGG_HDR_BYTES) // 4)


def check_words(k: int, mtu: int | None = None) -> int:
    """k, if it is a K the wire takes (and, with ``mtu``, one whose packets fit that MTU)."""
    if not MIN_WORDS_PER_PACKET <= k <= MAX_WORDS_PER_PACKET:
        raise WireError(f"{k} words per packet: {MIN_WORDS_PER_PACKET} to "
                        f"{MAX_WORDS_PER_PACKET} (what a {JUMBO_MTU}-byte MTU holds)")
    if mtu is not None and frame_bytes(k) > mtu:
        raise WireError(f"{k} words per packet make {frame_bytes(k)}-byte IPv4 packets, more "
                        f"than a {mtu}-byte MTU holds ({mtu_words(mtu)} words at most): "
                        f"raise the MTU (--mtu {JUMBO_MTU}) or use a smaller K")
    return k


STAT_INDEX = {v: k for k, v in STATS.items()}
VERDICTS: dict[str, int] = ENUMS["Verdict"]

# --- host conventions (not the switch's business) ---------------------------------------------
#: Scale negotiation inside the first OR round: a worker's max exponent e (frexp) is bit
#: e + EXP_BIAS of EXP_WORDS words; the OR gives every worker the job's max.
EXP_BIAS = 160
EXP_WORDS = 10  # 320 bits: fp32 exponents run from -148 to 128
DEFAULT_SWITCH_IP = "10.0.0.254"
DEFAULT_SWITCH_MAC = "00:00:0a:00:00:fe"
# The software aggregator that takes the jobs the switch has no slots for (the launcher's "fb").
DEFAULT_FALLBACK_IP = "10.0.0.253"
DEFAULT_FALLBACK_MAC = "00:00:0a:00:00:fd"
DEFAULT_AGENT_PORT = 50000


# --- the header, derived from its P4 field list -----------------------------------------------
def _byte_fields(bits: tuple[tuple[str, int], ...]) -> list[tuple[str, int, list[tuple[str, int]]]]:
    """Group P4 bit fields into whole-byte fields: (name, bytes, [(sub-field, bits), ...]).
    Sub-byte fields that share a byte are joined by '_' (version + op -> version_op)."""
    out: list[tuple[str, int, list[tuple[str, int]]]] = []
    group: list[tuple[str, int]] = []
    for name, w in bits:
        if w % 8 == 0 and not group:
            out.append((name, w // 8, [(name, w)]))
            continue
        group.append((name, w))
        if sum(g[1] for g in group) % 8 == 0:
            out.append(("_".join(g[0] for g in group), sum(g[1] for g in group) // 8, group))
            group = []
    if group:
        raise HomaggError(f"header fields {group} do not end on a byte boundary")
    return out


BYTE_FIELDS = _byte_fields(HEADER_FIELDS)
_CODES = {1: "B", 2: "H", 4: "I"}
HEADER = struct.Struct("!" + "".join(_CODES[n] for _, n, _ in BYTE_FIELDS))
#: byte offset of every header field within the UDP payload
OFFSETS = {}
_off = 0
for _name, _n, _ in BYTE_FIELDS:
    OFFSETS[_name] = _off
    _off += _n
OFFSETS["words"] = _off
assert HEADER.size == HOMAGG_HDR_BYTES, "constants.p4 HOMAGG_HDR_BYTES vs header homagg_h"
#: (byte offset, bytes) of every whole-byte header field (version and op share a byte: not here)
SPANS = {name: (OFFSETS[name], n) for name, n, subs in BYTE_FIELDS if len(subs) == 1}


def put_field(buf: bytearray, name: str, value: int) -> None:
    """Write a whole-byte header field (``SPANS``) into a datagram's bytes."""
    at, n = SPANS[name]
    buf[at:at + n] = value.to_bytes(n, "big")


class Header(NamedTuple):
    """A datagram's P4 header fields, in HEADER_FIELDS order (``decode_header``): by name, at a
    tuple index's speed (the per-packet path's reads). The P4 field list is the authority; the
    check below holds this class to it."""

    version: int
    op: int
    flags: int
    job: int
    worker: int
    gen: int
    slot: int
    seq: int
    auth: int


assert Header._fields == tuple(name for name, _ in HEADER_FIELDS), \
    "wire.Header vs the P4 header homagg_h (HEADER_FIELDS)"
#: position of every P4 header field in the ``Header`` that ``decode_header`` returns
FIELD = {name: k for k, name in enumerate(Header._fields)}


def _decoder():
    steps = []  # (struct tuple index, shift, mask) per P4 field, in HEADER_FIELDS order
    for i, (_, _, subs) in enumerate(BYTE_FIELDS):
        shift = sum(w for _, w in subs)
        for _, w in subs:
            shift -= w
            steps.append((i, shift, (1 << w) - 1))
    unpack = HEADER.unpack_from
    make = tuple.__new__

    def decode_header(buf) -> Header:
        """The P4 header fields of a datagram (the fast path for per-packet code, where
        ``fields`` builds a dict)."""
        t = unpack(buf)
        return make(Header, [(t[i] >> s) & m for i, s, m in steps])

    return decode_header


decode_header = _decoder()

_DTYPES: dict[int, np.dtype] = {}


def packet_dtype(k: int = WORDS_PER_PACKET) -> np.dtype:
    """One packet of k words as a numpy record: build many at once, then send each row's
    bytes."""
    if k not in _DTYPES:
        _DTYPES[k] = np.dtype([(name, "u1" if n == 1 else f">u{n}")
                               for name, n, _ in BYTE_FIELDS] + [("words", ">i4", (k,))])
        assert _DTYPES[k].itemsize == packet_bytes(k)
    return _DTYPES[k]


PACKET_DTYPE = packet_dtype()


class WireError(HomaggError, ValueError):
    """A datagram that is not a well-formed homagg packet (the reason is the message)."""


@dataclass(frozen=True)
class Packet:
    op: int
    flags: int
    job: int
    worker: int
    slot: int
    seq: int
    words: np.ndarray  # int32, K of them (JOIN_WORDS in a join)
    version: int = HOMAGG_VERSION
    gen: int = 0       # the run's generation (join.p4)
    auth: int = 0      # the job's key (admission.p4)

    @property
    def phase(self) -> int:
        return 1 if self.flags & FLAG_PHASE else 0

    @property
    def is_result(self) -> bool:
        return bool(self.flags & FLAG_RESULT)

    @property
    def overflow(self) -> bool:
        return bool(self.flags & FLAG_OVERFLOW)

    @property
    def status(self) -> tuple[int, int]:
        """(contributors bitmap, count) of a status reply (FLAG_STATUS)."""
        if not self.flags & FLAG_STATUS:
            raise WireError("not a status reply")
        return parse_status(self.words)


def header(*, version: int = HOMAGG_VERSION, op: int, flags: int = 0, job: int, worker: int,
           slot: int, seq: int, gen: int = 0, auth: int = 0) -> bytes:
    """The header's bytes from its P4 fields (sub-byte fields packed as the P4 header does)."""
    given = {"version": version, "op": op, "flags": flags, "job": job, "worker": worker,
             "slot": slot, "seq": seq & 0xFFFFFFFF, "gen": gen, "auth": auth}
    values = []
    for _, _, subs in BYTE_FIELDS:
        v = 0
        for name, w in subs:
            v = (v << w) | (given[name] & ((1 << w) - 1))
        values.append(v)
    return HEADER.pack(*values)


def pack(op: int, job: int, worker: int, slot: int, seq: int, words=(), flags: int = 0,
         version: int = HOMAGG_VERSION, gen: int = 0, k: int = WORDS_PER_PACKET,
         auth: int = 0) -> bytes:
    """One homagg UDP payload. ``words``: up to k int32 (or uint32 bit sets); fewer are
    zero-padded (zero is neutral for both ADD and OR). A join (OP_JOIN) has JOIN_WORDS words,
    whatever k."""
    w = np.asarray(words)
    if op == OP_JOIN:
        k = JOIN_WORDS
    if w.size > k:
        raise WireError(f"{w.size} words do not fit in one packet ({k})")
    body = np.zeros(k, ">i4")
    body[: w.size] = w.astype(np.uint32).view(np.int32) if w.dtype.kind == "u" else w
    return header(version=version, op=op, flags=flags, job=job, worker=worker, slot=slot,
                  seq=seq, gen=gen, auth=auth) + body.tobytes()


def fields(buf: bytes) -> dict[str, int]:
    """The header's P4 fields of a datagram (at least HOMAGG_HDR_BYTES long)."""
    out = {}
    for (_, _, subs), v in zip(BYTE_FIELDS, HEADER.unpack_from(buf)):
        for name, w in reversed(subs):
            out[name] = v & ((1 << w) - 1)
            v >>= w
    return out


def unpack(buf: bytes, k: int | None = None) -> Packet:
    """Parse one homagg UDP payload (of k words, or any K a switch can have); WireError says
    what is wrong with a bad one."""
    if len(buf) < HOMAGG_HDR_BYTES:
        raise WireError(f"homagg packet of {len(buf)} bytes, shorter than the header")
    f = fields(buf)
    join = f["op"] == OP_JOIN
    n = (JOIN_WORDS if len(buf) == JOIN_BYTES else None) if join else words_in(len(buf))
    if n is None or (k is not None and not join and n != k):
        want = packet_bytes(k) if k is not None else "header + 4 K"
        raise WireError(f"homagg packet of {len(buf)} bytes, expected {want}")
    if f["version"] != HOMAGG_VERSION:
        raise WireError(f"homagg version {f['version']}, expected {HOMAGG_VERSION}")
    if f["op"] not in OPS:
        raise WireError(f"unknown homagg op {f['op']}")
    words = np.frombuffer(buf, ">i4", n, HOMAGG_HDR_BYTES).astype(np.int32)
    return Packet(f["op"], f["flags"], f["job"], f["worker"], f["slot"], f["seq"], words,
                  f["version"], f["gen"], f["auth"])


def status_words(seen: int, count: int, k: int = WORDS_PER_PACKET) -> np.ndarray:
    """A status reply's words: 0 but for the last three, (bitmap high, bitmap low, count)
    (STATUS_WORD at P4's default K)."""
    w = np.zeros(k, np.uint32)
    w[k - 3:] = (seen >> 32, seen & 0xFFFFFFFF, count)
    return w.view(np.int32)


def parse_status(words) -> tuple[int, int]:
    """(contributors bitmap, count) from a status reply's words (int32 or big-endian). A
    count word of 0 under a bitmap that names contributors is a switch that keeps no count
    (the TNA program: docs/switch.md, "Tofino"): the count is the bitmap's."""
    w = np.asarray(words)[-3:].astype(np.int64) & 0xFFFFFFFF
    bitmap, count = (int(w[0]) << 32) | int(w[1]), int(w[2])
    if count == 0 and bitmap:
        count = bitmap.bit_count()
    return bitmap, count


def packets(n: int, k: int = WORDS_PER_PACKET) -> np.ndarray:
    """A zeroed batch of n packet records of k words (fill fields, then
    ``batch[i].tobytes()``)."""
    return np.zeros(n, packet_dtype(k))
