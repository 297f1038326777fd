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


def test_a_trusted_aggregators_results_are_routed_from_its_own_port_only(testbed):
    """The fallback aggregator behind the switch (controller: [fallback] port) answers its
    workers from a homagg port: routed when it comes from its address on its port; the same
    from another port is still a forgery."""
    from homagg import _p4consts as P4
    from homagg.controller.p4client import TableEntry

    agg = 3  # host 3 plays the aggregator, on switch port 4
    entry = TableEntry(P4.TABLE_AGGREGATORS, {"src_addr": jobs.ip_int(host_ip(agg)),
                                              "port": agg + 1}, P4.ACTION_TRUSTED)
    testbed.conn.insert(entry)
    try:
        payload = wire.pack(wire.OP_ADD, 1, 0, 0, 1, np.ones(8), flags=wire.FLAG_RESULT)
        for p in testbed.ports:
            p.drain()
        before = jobs.read_stats(testbed.conn).forwarding["FWD_SPOOFED"]
        for sender in (agg, 0):  # its own port, then another host's port with its address
            testbed.ports[sender].send(
                Ether(src=host_mac(sender), dst=SWITCH_MAC) / IP(src=host_ip(agg), dst=host_ip(1))
                / UDP(sport=wire.HOMAGG_UDP_PORT_MIN, dport=wire.DEFAULT_AGENT_PORT)
                / Raw(payload))
            got = testbed.ports[1].recv(0.5, is_homagg)
            assert len(got) == (1 if sender == agg else 0), f"from port of host {sender}"
        assert jobs.read_stats(testbed.conn).forwarding["FWD_SPOOFED"] == before + 1
    finally:
        testbed.conn.delete(entry)
