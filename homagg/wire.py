"""The homagg wire protocol as Python sees it: constants, and packets built straight from numpy.

The authoritative definitions are in p4/include/constants.p4 and p4/include/headers.p4 (the wire
diagram); tests/test_constants.py parses those files and fails if anything here drifts.
Packets are UDP payloads (homagg header + WORDS_PER_PACKET words); the kernel adds IPv4/UDP.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from homagg.errors import HomaggError

# --- protocol (constants.p4) ---------------------------------------------------------------
HOMAGG_UDP_PORT_MIN = 48864
HOMAGG_UDP_PORT_MAX = 48879
HOMAGG_VERSION = 1

OP_ADD = 1
OP_OR = 2
OPS = {OP_ADD: "add", OP_OR: "or"}

FLAG_RESULT = 0x80
FLAG_OVERFLOW = 0x40
FLAG_PHASE = 0x20
FLAG_RETRANS = 0x10
FLAG_STATUS = 0x08  # reply to a duplicate of an unfinished round: words 61-62 bitmap, 63 count
STATUS_WORD = 61    # first word of a status reply's (bitmap high, bitmap low, count)

WORDS_PER_PACKET = 64
HOMAGG_HDR_BYTES = 12
HOMAGG_PAYLOAD_BYTES = 4 * WORDS_PER_PACKET
HOMAGG_UDP_LEN = 8 + HOMAGG_HDR_BYTES + HOMAGG_PAYLOAD_BYTES
HOMAGG_IPV4_LEN = 20 + HOMAGG_UDP_LEN
PACKET_BYTES = HOMAGG_HDR_BYTES + HOMAGG_PAYLOAD_BYTES  # the UDP payload

# --- switch memory ---------------------------------------------------------------------------
SLOT_INDEX_WIDTH = 10
SLOTS = 1 << SLOT_INDEX_WIDTH
SLOT_STATE_SIZE = 2 << SLOT_INDEX_WIDTH
MAX_WORKERS = 64
JOB_ID_WIDTH = 6
MAX_JOBS = 1 << JOB_ID_WIDTH
RID_WORKER_OFFSET = 1

# --- counters: index -> name, in P4 order ----------------------------------------------------
STATS = {
    0: "STAT_RX",
    1: "STAT_ACCEPTED",
    2: "STAT_COMPLETED",
    3: "STAT_RETRANS_REPLY",
    4: "STAT_DUP_PENDING",
    5: "STAT_OVERFLOW",
    6: "DROP_MALFORMED",
    7: "DROP_BAD_LENGTH",
    8: "DROP_BAD_VERSION",
    9: "DROP_BAD_OP",
    10: "DROP_FORGED_RESULT",
    11: "DROP_UNKNOWN_SENDER",
    12: "DROP_WRONG_IDENTITY",
    13: "DROP_BAD_SLOT",
    14: "DROP_SEQ_MISMATCH",
    15: "DROP_STALE",
    16: "DROP_SPOOFED",
}
STATS_SIZE = 32
EPOCH_STORE = 31  # stats index the controller uses as storage (constants.p4)
STAT_INDEX = {v: k for k, v in STATS.items()}

FWD_STATS = {0: "FWD_ROUTED", 1: "FWD_ARP_REPLIES", 2: "FWD_NO_ROUTE", 3: "FWD_SPOOFED"}
FWD_STATS_SIZE = 4

JOB_STATS = {0: "JOB_STAT_ACCEPTED", 1: "JOB_STAT_COMPLETED", 2: "JOB_STAT_RETRANS",
             3: "JOB_STAT_DROPPED"}
JOB_STATS_PER_JOB = 4
JOB_STATS_SIZE = MAX_JOBS * JOB_STATS_PER_JOB

# --- the header: version/op, flags, job, worker, reserved, slot, seq (big-endian) ------------
HEADER = struct.Struct("!BBHBBHI")
assert HEADER.size == HOMAGG_HDR_BYTES

#: One packet as a numpy record: build many at once, then send each row's bytes.
PACKET_DTYPE = np.dtype(
    [
        ("version_op", "u1"),
        ("flags", "u1"),
        ("job", ">u2"),
        ("worker", "u1"),
        ("reserved", "u1"),
        ("slot", ">u2"),
        ("seq", ">u4"),
        ("words", ">i4", (WORDS_PER_PACKET,)),
    ]
)
assert PACKET_DTYPE.itemsize == PACKET_BYTES


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
    words: np.ndarray  # int32, WORDS_PER_PACKET of them
    version: int = HOMAGG_VERSION

    @property
    def phase(self) -> int:
        return 1 if self.flags & FLAG_PHASE else 0

    @property
    def is_result(self) -> bool:
        return bool(self.flags & FLAG_RESULT)

    @property
    def overflow(self) -> bool:
        return bool(self.flags & FLAG_OVERFLOW)


def pack(op: int, job: int, worker: int, slot: int, seq: int, words, flags: int = 0,
         version: int = HOMAGG_VERSION) -> bytes:
    """One homagg UDP payload. ``words``: up to WORDS_PER_PACKET int32 (or uint32 bit sets);
    fewer are zero-padded (zero is neutral for both ADD and OR)."""
    w = np.asarray(words)
    if w.size > WORDS_PER_PACKET:
        raise WireError(f"{w.size} words do not fit in one packet ({WORDS_PER_PACKET})")
    body = np.zeros(WORDS_PER_PACKET, ">i4")
    body[: w.size] = w.astype(np.uint32).view(np.int32) if w.dtype.kind == "u" else w
    return HEADER.pack((version << 4) | op, flags, job, worker, 0, slot, seq & 0xFFFFFFFF) \
        + body.tobytes()


def unpack(buf: bytes) -> Packet:
    """Parse one homagg UDP payload; WireError says what is wrong with a bad one."""
    if len(buf) != PACKET_BYTES:
        raise WireError(f"homagg packet of {len(buf)} bytes, expected {PACKET_BYTES}")
    vo, flags, job, worker, _res, slot, seq = HEADER.unpack_from(buf)
    version, op = vo >> 4, vo & 0xF
    if version != HOMAGG_VERSION:
        raise WireError(f"homagg version {version}, expected {HOMAGG_VERSION}")
    if op not in OPS:
        raise WireError(f"unknown homagg op {op}")
    words = np.frombuffer(buf, ">i4", WORDS_PER_PACKET, HOMAGG_HDR_BYTES).astype(np.int32)
    return Packet(op, flags, job, worker, slot, seq, words, version)


def packets(n: int) -> np.ndarray:
    """A zeroed batch of n packet records (fill fields, then ``batch[i].tobytes()``)."""
    return np.zeros(n, PACKET_DTYPE)
