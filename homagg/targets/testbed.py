"""A bmv2 switch on veth pairs, driven with raw frames: no Mininet, just root.

Each switch port p is one end of a veth pair; the test owns the other end through an AF_PACKET
socket, sends frames crafted with scapy and reads what the switch emits.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from homagg import wire
from homagg.netconfig import (
    Config,
    Host,
    JobSpec,
    SwitchSpec,
    Worker,
    host_ip,
    host_mac,
)
from homagg.targets.bmv2 import Bmv2Switch

SWITCH_IP = wire.DEFAULT_SWITCH_IP
SWITCH_MAC = wire.DEFAULT_SWITCH_MAC
ETH_P_ALL = 0x0003



def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Port:
    """The test's end of one switch port."""

    def __init__(self, iface: str):
        self.iface = iface
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.bind((iface, 0))
        self.sock.setblocking(False)

    def send(self, frame) -> None:
        self.sock.send(bytes(frame))

    def drain(self) -> None:
        while self.recv_one(0) is not None:
            pass

    def recv_one(self, timeout: float) -> bytes | None:
        r, _, _ = select.select([self.sock], [], [], timeout)
        if not r:
            return None
        try:
            data, addr = self.sock.recvfrom(65535)
        except BlockingIOError:
            return None
        if addr[2] == socket.PACKET_OUTGOING:  # our own transmissions
            return self.recv_one(timeout)
        return data

    def recv(self, timeout: float = 0.5, want=None, count: int | None = None) -> list:
        """Frames received until ``timeout`` passes with nothing new (or ``count`` matched),
        as scapy packets, filtered by ``want``."""
        out = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            data = self.recv_one(max(0.0, deadline - time.monotonic()))
            if data is None:
                break
            pkt = Ether(data)
            if want is None or want(pkt):
                out.append(pkt)
                if count is not None and len(out) >= count:
                    break
        return out

    def close(self) -> None:
        self.sock.close()


def is_homagg(pkt) -> bool:
    return UDP in pkt and wire.HOMAGG_UDP_PORT_MIN <= pkt[UDP].sport <= wire.HOMAGG_UDP_PORT_MAX


def homagg_frame(i: int, payload: bytes, sport: int = wire.DEFAULT_AGENT_PORT,
                 src_ip: str | None = None,
                 dport: int = wire.HOMAGG_UDP_PORT_MIN):
    """A frame from host i to the switch carrying ``payload`` as the UDP payload."""
    return (Ether(src=host_mac(i), dst=SWITCH_MAC)
            / IP(src=src_ip or host_ip(i), dst=SWITCH_IP, id=1)
            / UDP(sport=sport, dport=dport) / Raw(payload))


def result_of(pkt) -> wire.Packet:
    return wire.unpack(bytes(pkt[UDP].payload))


@dataclass
class Testbed:
    switch: Bmv2Switch
    ports: list[Port]
    config: Config
    pairs: list[tuple[str, str]]   # (switch end, host end) of each port's veth pair
    conn: Any = None               # the controller's P4RuntimeSwitch, once a test opens one

    def job(self, job_id: int, workers: list[int], slots: int = 8,
            udp_port: int = wire.DEFAULT_AGENT_PORT) -> JobSpec:
        return JobSpec(job_id, tuple(Worker(host_ip(i), udp_port, host_mac(i), i + 1, f"h{i}")
                                     for i in workers), slots)


def start_testbed(n_ports: int, log_dir: Path, name: str = "s1") -> Testbed:
    """A bmv2 switch ``name`` with n_ports veth ports; several may run at once (distinct
    names): interface names carry the process id and the switch's index."""
    tag = f"{os.getpid() % 10000}{name[-1]}"
    pairs = []
    try:
        for i in range(n_ports):
            sw_end, host_end = f"hs{tag}s{i}", f"hs{tag}h{i}"
            subprocess.run(["ip", "link", "del", sw_end], capture_output=True)
            _ip("link", "add", sw_end, "type", "veth", "peer", "name", host_end)
            pairs.append((sw_end, host_end))
            for dev in (sw_end, host_end):
                subprocess.run(["sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.disable_ipv6=1"],
                               capture_output=True)
                _ip("link", "set", dev, "mtu", "9000", "up")
        sw = Bmv2Switch({i + 1: s for i, (s, _) in enumerate(pairs)}, log_dir, name).start()
    except Exception:
        for s, _ in pairs:
            subprocess.run(["ip", "link", "del", s], capture_output=True)
        raise
    hosts = tuple(Host(f"h{i}", host_ip(i), host_mac(i), i + 1) for i in range(n_ports))
    cfg = Config(SwitchSpec(name, sw.grpc_addr, 1, sw.thrift_port, SWITCH_IP, SWITCH_MAC), hosts)
    bed = Testbed(sw, [Port(h) for _, h in pairs], cfg, pairs)
    return bed


def stop_testbed(bed: Testbed) -> None:
    for p in bed.ports:
        p.close()
    bed.switch.stop()
    for s, _ in bed.pairs:
        subprocess.run(["ip", "link", "del", s], capture_output=True)
