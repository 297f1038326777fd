"""The TNA program's frames as its ingress parser takes them (``parse``), its bridge header
(``bridge_h``, in front of a recirculated frame) and the IPv4 checksum its deparser writes:
what ``homagg.switch_model.tna`` reads a pass's input and writes its output with."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from homagg import wire

ETH, IP4, UDP, ARP = 14, 20, 8, 28
HB = wire.HOMAGG_HDR_BYTES


def bridge_bytes(kind: int, job: int, mcast: int, port: int, idx: int) -> bytes:
    """bridge_h: kind 8, job 16, mcast_group 16, pad 7, port 9, pad2 5, idx 11 bits."""
    return struct.pack("!BHHHH", kind, job, mcast, port & 0x1FF, idx & 0x7FF)


def parse_bridge(b: bytes) -> tuple[int, int, int, int, int]:
    kind, job, mcast, port, idx = struct.unpack("!BHHHH", b[:9])  # (as bridge_bytes)
    return kind, job, mcast, port & 0x1FF, idx & 0x7FF


def ipv4_checksum(h: bytes | bytearray) -> int:
    h = bytearray(h[:IP4])
    h[10:12] = b"\0\0"
    s = sum(struct.unpack("!10H", bytes(h)))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


@dataclass
class Frame:
    """A frame as the TNA ingress parser takes it: the offsets of the headers it extracted."""

    data: bytearray
    at: int = 0                    # where Ethernet starts (after bridge_h on a recirculation)
    ipv4: int | None = None
    udp: int | None = None
    arp: int | None = None
    homagg: int | None = None      # homagg_h, then the words (or a join's) if they parsed
    words: bool = False
    join: bool = False

    def u(self, off: int, n: int) -> int:
        return int.from_bytes(self.data[off:off + n], "big")

    def put(self, off: int, n: int, v: int) -> None:
        self.data[off:off + n] = (v & ((1 << 8 * n) - 1)).to_bytes(n, "big")


def parse(data: bytes, at: int = 0, k: int = 64) -> Frame:
    """homagg_tna.p4's ingress parser from Ethernet on (a header that does not fit is not
    extracted, and neither is anything after it)."""
    f = Frame(bytearray(data), at)
    n = len(data)
    if n < at + ETH:
        return f
    et = f.u(at + 12, 2)
    o = at + ETH
    if at == 0 and et == wire.ETHERTYPE_ARP and n >= o + ARP:
        f.arp = o
        return f
    if (at == 0 and et != wire.ETHERTYPE_IPV4) or n < o + IP4:   # (a recirculation: all)
        return f
    f.ipv4 = o
    ihl, frag, proto = data[o] & 0xF, f.u(o + 6, 2) & 0x1FFF, data[o + 9]
    if at == 0 and (ihl, frag, proto) != (5, 0, 17):
        return f
    o += IP4
    if n < o + UDP:
        return f
    f.udp = o
    if at == 0 and (f.u(o + 2, 2) & 0xFFF0) != wire.HOMAGG_UDP_PORT_MIN:
        return f
    o += UDP
    if n < o + HB:
        return f
    f.homagg = o
    join = at == 0 and data[o] & 0xF == wire.OP_JOIN
    need = 4 * (wire.JOIN_WORDS if join else k)
    if n >= o + HB + need:
        f.join, f.words = join, not join
    return f
