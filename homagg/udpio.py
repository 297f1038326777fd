"""Batched UDP I/O: many datagrams per system call, through Linux's UDP GSO and GRO.

Python has no sendmmsg/recvmmsg, and one datagram per system call is the floor under every
per-packet loop (bench/pps.py measures it). Linux offers the same batching through the socket
options UDP_SEGMENT (GSO, 4.18) and UDP_GRO (5.0), which plain ``sendmsg``/``recvmsg_into``
reach:

- ``send_many``: one ``sendmsg`` carries a run of equal-size datagrams laid end to end, with a
  UDP_SEGMENT control message saying the size. The kernel cuts it into datagrams (in software
  where the device cannot): the peer sees ordinary datagrams, one per segment.
- ``recv_many``: with UDP_GRO set on the socket, a run of datagrams from one sender that reached
  the socket coalesced (a peer's GSO burst on loopback, veth or a bridge, or GRO on a
  receiving device) comes up in one ``recvmsg_into``, the segment size in a control message.
  Without GRO, or when nothing was coalesced, a call returns one datagram, as before.

Nothing changes on the wire, so bmv2 and any other peer see the datagrams they always saw. Where
the kernel refuses GSO (an old kernel, a device that cannot checksum), ``send_many`` falls back
to one ``sendto`` per datagram, for the life of the socket; ``gso`` says which is in use.
"""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Iterator

# linux/udp.h: not in Python's socket module
UDP_SEGMENT = 103
UDP_GRO = 104
# linux/in.h
IP_MTU = getattr(socket, "IP_MTU", 14)
#: Segments per GSO send: the kernel's UDP_MAX_SEGMENTS (64 before Linux 6.x raised it).
MAX_SEGMENTS = 64
#: A GSO send is one UDP datagram to the kernel: its payload stays under 64 KiB.
MAX_GSO_BYTES = 65507 - 8 - 20
#: A receive buffer that holds any coalesced run (GRO stops at 64 KiB).
RECV_BYTES = 1 << 16

_GSO_FAILED = {errno.EINVAL, errno.EIO, errno.ENOPROTOOPT, errno.EOPNOTSUPP}
_U16 = struct.Struct("=H")
_I32 = struct.Struct("=i")
_GRO_SPACE = socket.CMSG_SPACE(_I32.size)


class BatchSocket:
    """A UDP socket that sends and receives runs of datagrams (``send_many``, ``recv_many``),
    and is still a socket for everything else (``sendto``, ``fileno``, ``close``...).
    Counts its system calls and the datagrams they carried, each way: the batching achieved."""

    def __init__(self, sock: socket.socket, gro: bool = True):
        self.sock = sock
        self.gso = True
        self.gro = False
        self.send_calls = self.sent = self.recv_calls = self.received = 0
        if gro:
            try:
                sock.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
                self.gro = True
            except OSError:  # a kernel without UDP GRO: one datagram per receive
                pass

    def __getattr__(self, name):  # the rest of the socket API
        return getattr(self.sock, name)

    def sendto(self, data, addr) -> int:
        n = self.sock.sendto(data, addr)
        self.send_calls += 1
        self.sent += 1
        return n

    def recvfrom_into(self, buf):
        nb, src = self.sock.recvfrom_into(buf)
        self.recv_calls += 1
        self.received += 1
        return nb, src

    def send_many(self, data, size: int, addr) -> int:
        """Send ``data`` as datagrams of ``size`` bytes (the last may be shorter), in as few
        system calls as GSO allows; returns how many datagrams went out. A full socket buffer
        (BlockingIOError) stops the run there: the caller's timeout resends the rest."""
        view = memoryview(data).cast("B")
        total = len(view)
        if total <= size or not self.gso:
            return self._send_each(view, size, addr)
        per_call = max(1, min(MAX_SEGMENTS, MAX_GSO_BYTES // size)) * size
        cmsg = [(socket.SOL_UDP, UDP_SEGMENT, _U16.pack(size))]
        sent = 0
        for at in range(0, total, per_call):
            chunk = view[at:at + per_call]
            try:
                if len(chunk) <= size:
                    self.sock.sendto(chunk, addr)
                else:
                    self.sock.sendmsg([chunk], cmsg, 0, addr)
            except BlockingIOError:
                return sent
            except OSError as e:
                if e.errno not in _GSO_FAILED or sent:
                    raise
                # GSO refused, or a real error: a plain send of the first datagram tells
                # (it raises the real one). If it goes, this kernel or route will not segment
                # (no checksum offload on the device, as the launcher sets for bmv2's links):
                # per datagram from now on.
                self.sock.sendto(chunk[:size], addr)
                self.gso = False
                self.send_calls += 1
                self.sent += 1
                return sent + 1 + self._send_each(view[at + size:], size, addr)
            n = -(-len(chunk) // size)
            self.send_calls += 1
            self.sent += n
            sent += n
        return sent

    def _send_each(self, view: memoryview, size: int, addr) -> int:
        sent = 0
        for at in range(0, len(view), size):
            try:
                self.sock.sendto(view[at:at + size], addr)
            except BlockingIOError:
                break
            sent += 1
        self.send_calls += sent
        self.sent += sent
        return sent

    def recv_many(self, buf: bytearray | memoryview) -> tuple[int, int, tuple]:
        """One receive: ``(nbytes, segment size, source)``. ``buf[:nbytes]`` holds datagrams
        of ``segment size`` bytes end to end (the last may be shorter); one datagram when
        nothing was coalesced (segment size = nbytes). BlockingIOError when none is queued."""
        if not self.gro:
            nb, src = self.recvfrom_into(buf)
            return nb, nb, src
        nb, anc, _, src = self.sock.recvmsg_into([buf], _GRO_SPACE)
        seg = nb
        for level, kind, value in anc:
            if level == socket.SOL_UDP and kind == UDP_GRO:
                seg = _I32.unpack_from(value)[0] or nb
        self.recv_calls += 1
        self.received += -(-nb // seg) if seg else 1
        return nb, seg, src


def route_source(addr: tuple[str, int]) -> str:
    """This host's address on the route to ``addr`` (a connected UDP socket's; no packet is
    sent). OSError where there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def path_mtu(addr) -> int | None:
    """The MTU of this host's route to ``addr`` (IP_MTU of a connected UDP socket: the
    outgoing interface's, or a smaller path MTU the kernel learned); None if unknown."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockopt(socket.IPPROTO_IP, IP_MTU)
    except (OSError, TypeError, ValueError):
        return None


def io_counts(sock) -> dict[str, int]:
    """A socket's system calls and datagrams each way (a ``BatchSocket``, or one under a fault
    injector); zeros for any other socket."""
    while not isinstance(sock, BatchSocket) and hasattr(sock, "sock"):
        sock = sock.sock
    names = ("send_calls", "sent", "recv_calls", "received")
    return {n: getattr(sock, n) if isinstance(sock, BatchSocket) else 0 for n in names}


def segments(nbytes: int, size: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each datagram in a received run."""
    for at in range(0, nbytes, size or nbytes or 1):
        yield at, min(size, nbytes - at)
