"""Plain forwarding on bmv2: proxy ARP, routing between hosts, forged results refused.

Needs p4c-bm2-ss, simple_switch_grpc and root (skips with the reason otherwise).
"""

from __future__ import annotations

import numpy as np
from scapy.layers.inet import ICMP, IP, UDP
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Raw

from homagg import wire
from homagg.controller import jobs
from homagg.targets.testbed import SWITCH_IP, SWITCH_MAC, host_ip, host_mac, is_homagg

# --- plain forwarding ----------------------------------------------------------------------


def test_arp_for_the_switch_is_answered(testbed):
    port = testbed.ports[0]
    port.drain()
    port.send(Ether(src=host_mac(0), dst="ff:ff:ff:ff:ff:ff")
              / ARP(op=1, hwsrc=host_mac(0), psrc=host_ip(0), pdst=SWITCH_IP))
    got = port.recv(1.0, lambda p: ARP in p, 1)
    assert got, "no ARP reply"
    assert got[0][ARP].op == 2 and got[0][ARP].hwsrc == SWITCH_MAC and got[0][ARP].psrc == SWITCH_IP


def test_plain_ipv4_is_routed_between_hosts(testbed):
    for p in testbed.ports:
        p.drain()
    testbed.ports[0].send(Ether(src=host_mac(0), dst=SWITCH_MAC)
                          / IP(src=host_ip(0), dst=host_ip(2), ttl=9) / ICMP() / Raw(b"hello"))
    got = testbed.ports[2].recv(1.0, lambda p: ICMP in p, 1)
    assert got, "ping not forwarded"
    assert got[0][Ether].dst == host_mac(2) and got[0][IP].ttl == 8
    assert bytes(got[0][Raw]) == b"hello"
    assert not testbed.ports[1].recv(0.2, lambda p: ICMP in p)


def test_forged_result_between_hosts_is_not_forwarded(testbed):
    for p in testbed.ports:
        p.drain()
    payload = wire.pack(wire.OP_ADD, 1, 0, 0, 1, np.ones(64), flags=wire.FLAG_RESULT)
    testbed.ports[0].send(Ether(src=host_mac(0), dst=SWITCH_MAC)
                          / IP(src=SWITCH_IP, dst=host_ip(1))
                          / UDP(sport=wire.HOMAGG_UDP_PORT_MIN, dport=wire.DEFAULT_AGENT_PORT)
                          / Raw(payload))
    assert not testbed.ports[1].recv(0.3, is_homagg)
    assert jobs.read_stats(testbed.conn).forwarding["FWD_SPOOFED"] >= 1
