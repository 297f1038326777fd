"""The switch model's state and values: int32 lanes, serial numbers, a job's entry, the slot
memory, what a packet did, and the reply a switch builds from a request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from homagg import wire
from homagg.wire import Verdict  # the P4 program's enum Verdict (types.p4), generated

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# The verdicts by name, at a global's cost: the per-packet path compares them, and looking an
# enum member up on its class costs five times as much (Python 3.11)
ACCEPT, RETRANS_REPLY, DUP_PENDING = Verdict.ACCEPT, Verdict.RETRANS_REPLY, Verdict.DUP_PENDING
SEQ_MISMATCH, STALE, RESEND_UP = Verdict.SEQ_MISMATCH, Verdict.STALE, Verdict.RESEND_UP


def lane_add(acc: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int32 lane-wise add as the switch does it: the wrapped sum and, per lane, whether it
    overflowed (operands of one sign, sum of the other: lanes.p4)."""
    a = np.asarray(acc, np.int32)
    b = np.asarray(words, np.int32)
    wide = a.astype(np.int64) + b
    return wide.astype(np.int32), (wide > INT32_MAX) | (wide < INT32_MIN)


def lane_or(acc: np.ndarray, words: np.ndarray) -> np.ndarray:
    return np.asarray(acc, np.int32) | np.asarray(words, np.int32)


def newer(seq: int, tag: int) -> bool:
    """seq is after tag in serial arithmetic: (int<32>)(seq - tag) > 0."""
    d = (seq - tag) & 0xFFFFFFFF
    return 0 < d < 0x80000000


def newer_gen(gen: int, than: int) -> bool:
    """A run generation after another, in 8-bit serial arithmetic: (int<8>)(gen - than) > 0."""
    d = (gen - than) & 0xFF
    return 0 < d < 0x80


Address = tuple[str, int]


@dataclass(frozen=True)
class ParentLink:
    """A tree job's parent (uplink.p4): this switch is worker ``worker`` of job ``job`` at the
    parent switch, whose homagg address is ``parent``. A round complete here goes up as one
    contribution (the partial sum); the parent's result (the final) comes down from
    ``parent`` and is multicast to this switch's workers."""

    job: int
    worker: int
    parent: Address
    port: int | None = None  # the switch port to the parent (None: the target cannot tell)
    auth: int = 0            # the parent job's key: what goes up carries it, and comes down


@dataclass
class JobEntry:
    """What the controller installs for a job (the job table and its multicast group)."""

    id: int
    workers: list[Address]          # worker id -> (ip, udp port)
    epoch: int
    base: int
    size: int
    ports: list[int] | None = None  # worker id -> switch port (None: the target cannot tell)
    #: where a completed round's result goes, one datagram per entry (the multicast group's
    #: replicas as egress addresses them); None: to every worker's own address
    results: list[Address] | None = None
    #: a tree's leaf (or any switch below the root): where its partial sums go
    uplink: ParentLink | None = None
    #: the job's key (admission.p4): its workers' packets carry it, or are spoofed
    auth: int = 0

    @property
    def result_addresses(self) -> list[Address]:
        """Where a completed round's (or join's) result goes."""
        return self.workers if self.results is None else self.results


@dataclass
class Outcome:
    """What one packet did: the counter it moved (a STATS name), the verdict of the slot state
    machine (None if admission dropped it), and the datagrams that go out."""

    counter: str
    verdict: Verdict | None = None
    replies: list[tuple[bytes, Address]] = field(default_factory=list)


class Cells:
    """A numpy array that reads and writes as a list of Python ints (or bools): the slot
    memory the native data path shares (``SlotMemory.shared``), for the model's per-packet
    code, which compares and combines Python ints (a 64-bit worker bitmap included)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __getitem__(self, i: int):
        return self.array.item(i)

    def __setitem__(self, i: int, value) -> None:
        self.array[i] = value

    def __len__(self) -> int:
        return len(self.array)

    def __iter__(self):
        return iter(self.array.tolist())

    def __eq__(self, other) -> bool:
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


class SlotMemory:
    """The slot registers, 2 copies per slot (index 2 * slot + phase). The bookkeeping is in
    Python lists, not arrays: the per-packet path reads and writes single cells, which a list
    does several times faster than numpy's scalar indexing. ``shared``: the same registers in
    numpy arrays, which the native data path reads and writes in place (``Cells``)."""

    #: the bookkeeping registers and their array types (``shared``)
    CELLS = {"seen": np.uint64, "count": np.int64, "tag": np.int64, "op": np.int64,
             "epoch": np.int64, "gen": np.int64, "overflow": np.bool_, "final": np.bool_}

    def shared(self) -> SlotMemory:
        """These registers moved into arrays (``Cells``) the native data path shares; the
        words are this memory's own array."""
        out = object.__new__(SlotMemory)
        for name, dtype in self.CELLS.items():
            setattr(out, name, Cells(np.array(list(getattr(self, name)), dtype)))
        out.words = self.words
        return out

    def __init__(self, slots: int, k: int = wire.WORDS_PER_PACKET):
        n = 2 * slots
        self.seen = [0] * n
        self.count = [0] * n
        self.tag = [0] * n
        self.op = [0] * n
        self.epoch = [0] * n
        self.gen = [0] * n
        self.overflow = [False] * n
        self.final = [False] * n  # a tree job's copy holds the parent's result, not a partial
        self.words = np.zeros((n, k), np.int32)


def reply(data: bytes, flags: int, words: np.ndarray, gen: int | None = None,
           job: int | None = None, worker: int | None = None, auth: int | None = None) -> bytes:
    """The switch echoes the packet's header (worker included) with new flags, and the gen
    the join hands out, followed by ``words``; in a tree, with the job (and worker, and key)
    of the switch it goes to."""
    hdr = bytearray(data[:wire.OFFSETS["words"]])
    hdr[wire.OFFSETS["flags"]] = flags
    if gen is not None:
        hdr[wire.OFFSETS["gen"]] = gen
    if job is not None:
        wire.put_field(hdr, "job", job)
    if worker is not None:
        hdr[wire.OFFSETS["worker"]] = worker
    if auth is not None:
        wire.put_field(hdr, "auth", auth)
    return bytes(hdr) + np.asarray(words, ">i4").tobytes()
