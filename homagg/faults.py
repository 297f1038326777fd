"""Packet faults injected at a UDP socket: loss, duplication and reordering.

For tests and demos on machines whose kernel has no netem (``tc qdisc ... netem`` fails there):
the agent's socket, or the software aggregator's, drops, duplicates or holds back datagrams
with the given probabilities. Seeded, so a failing run can be replayed. Faults are per
datagram also when the socket batches (``homagg.udpio``): a run sent is cut into its datagrams
first, and a coalesced run received loses each of its datagrams on its own.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import numpy as np

from homagg.udpio import BatchSocket


@dataclass(frozen=True)
class FaultSpec:
    loss: float = 0.0      # probability a datagram is dropped (each direction)
    dup: float = 0.0       # probability a sent datagram goes out twice
    reorder: float = 0.0   # probability a sent datagram is held back behind the next one
    seed: int = 0

    def __post_init__(self):
        for name in ("loss", "dup", "reorder"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"fault {name}={v}: a probability in [0, 1)")

    @property
    def active(self) -> bool:
        return bool(self.loss or self.dup or self.reorder)


class ImpairedSocket:
    """A UDP socket whose sends and receives suffer ``spec``'s faults; counts what it did."""

    def __init__(self, sock: socket.socket | BatchSocket, spec: FaultSpec):
        self.sock = sock
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        self.held: tuple | None = None
        self.dropped_out = self.dropped_in = self.duplicated = self.reordered = 0

    # the parts of the socket API the agent uses
    def fileno(self):
        return self.sock.fileno()

    def setblocking(self, flag):
        self.sock.setblocking(flag)

    def close(self):
        self.sock.close()

    def sendto(self, data, addr):
        r = self.rng.random(3)
        out = []
        if r[0] < self.spec.loss:
            self.dropped_out += 1
        elif r[2] < self.spec.reorder and self.held is None:
            self.held = (bytes(data), addr)  # goes out after the next datagram
            self.reordered += 1
        else:
            out.append((data, addr))
            if r[1] < self.spec.dup:
                out.append((data, addr))
                self.duplicated += 1
        if out and self.held is not None:
            out.append(self.held)
            self.held = None
        for d, a in out:
            self.sock.sendto(d, a)
        return len(data)

    def send_many(self, data, size: int, addr) -> int:
        """``udpio.BatchSocket.send_many``, one datagram at a time (each suffers its faults)."""
        view = memoryview(data).cast("B")
        for at in range(0, len(view), size):
            self.sendto(view[at:at + size], addr)
        return -(-len(view) // size)

    def recv_many(self, buf: bytearray | memoryview) -> tuple[int, int, tuple]:
        """``udpio.BatchSocket.recv_many`` (or one datagram, from a plain socket), each datagram
        of the run lost on its own; the survivors are moved together, end to end."""
        while True:
            if isinstance(self.sock, BatchSocket):
                nb, seg, src = self.sock.recv_many(buf)
            else:
                nb, src = self.sock.recvfrom_into(buf)
                seg = nb
            kept = 0
            for at in range(0, nb, seg or 1):
                length = min(seg, nb - at)
                if self.rng.random() < self.spec.loss:
                    self.dropped_in += 1
                    continue
                buf[kept:kept + length] = buf[at:at + length]
                kept += length
            if kept:
                return kept, seg, src

    def recvfrom_into(self, buf):
        while True:
            nb, src = self.sock.recvfrom_into(buf)  # BlockingIOError when empty, as usual
            if self.rng.random() < self.spec.loss:
                self.dropped_in += 1
                continue
            return nb, src
