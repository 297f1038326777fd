"""Malformed and hostile homagg packets, crafted with scapy, sent raw from one host.

    python -m bmv2_tests.fuzz --iface h1-eth0 --src 10.0.0.1 --mac 00:00:0a:00:00:01 \\
        --job 1 --worker 0 --slots 16 --key 1234 --peer 10.0.0.2 --count 50 --out sent.json

Each category is built to hit one drop reason of the switch and nothing else (none is a valid
contribution); the packets carry the job's key (``--key``), but for ``wrong_key``'s.
``--out`` records how many of each were sent, for the test to compare with the switch's
counters.
"""

from __future__ import annotations

import argparse
import json
import socket
import time

import numpy as np
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from homagg import wire

SWITCH_IP = wire.DEFAULT_SWITCH_IP
SWITCH_MAC = wire.DEFAULT_SWITCH_MAC

#: category -> the counter it must move
EXPECT = {
    "truncated": "DROP_MALFORMED",
    "overlong": "DROP_BAD_LENGTH",
    "bad_version": "DROP_BAD_VERSION",
    "bad_op": "DROP_BAD_OP",
    "forged_result": "DROP_FORGED_RESULT",
    "unknown_sender": "DROP_UNKNOWN_SENDER",
    "wrong_job": "DROP_WRONG_IDENTITY",
    "wrong_worker": "DROP_WRONG_IDENTITY",
    "bad_slot": "DROP_BAD_SLOT",
    "spoofed_peer": "DROP_SPOOFED",
    "wrong_key": "DROP_SPOOFED",
}


def payloads(category: str, a, rng) -> tuple[bytes, str, int]:
    """(UDP payload, source ip, source port) for one packet of ``category``."""
    words = rng.integers(-(2**31), 2**31, wire.WORDS_PER_PACKET, dtype=np.int64).astype(np.int32)
    slot = int(rng.integers(0, a.slots))
    seq = int(rng.integers(1, 2**32))
    good = dict(op=wire.OP_ADD, job=a.job, worker=a.worker, slot=slot, seq=seq, words=words,
                auth=a.key)
    src, sport = a.src, a.sport
    if category == "truncated":
        return wire.pack(**good)[: int(rng.integers(1, wire.PACKET_BYTES))], src, sport
    if category == "overlong":
        return wire.pack(**good) + bytes(int(rng.integers(1, 200))), src, sport
    if category == "bad_version":
        other = [v for v in (0, 1, 2, 7, 15) if v != wire.HOMAGG_VERSION]
        return wire.pack(**good, version=int(rng.choice(other))), src, sport
    if category == "bad_op":
        bad = [op for op in range(16) if op not in wire.OPS]  # OPS: every op the switch takes
        return wire.pack(**{**good, "op": int(rng.choice(bad))}), src, sport
    if category == "forged_result":
        return wire.pack(**good, flags=wire.FLAG_RESULT), src, sport
    if category == "unknown_sender":
        if rng.random() < 0.5:
            return wire.pack(**good), f"10.0.0.{int(rng.integers(100, 200))}", sport
        return wire.pack(**good), src, int(rng.integers(1024, 49000))
    if category == "wrong_job":
        return wire.pack(**{**good, "job": int(rng.integers(a.job + 1, 60))}), src, sport
    if category == "wrong_worker":
        return wire.pack(**{**good, "worker": int(rng.integers(a.worker + 1, 64))}), src, sport
    if category == "bad_slot":
        return wire.pack(**{**good, "slot": int(rng.integers(a.slots, 65536))}), src, sport
    if category == "spoofed_peer":
        return wire.pack(**good), a.peer, sport
    if category == "wrong_key":  # one to all 32 bits off
        return wire.pack(**{**good, "auth": a.key ^ int(rng.integers(1, 2**32))}), src, sport
    raise ValueError(category)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iface", required=True)
    ap.add_argument("--src", required=True, help="this host's registered address")
    ap.add_argument("--sport", type=int, default=wire.DEFAULT_AGENT_PORT)
    ap.add_argument("--mac", required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--peer", help="another worker's address (spoofed_peer)")
    ap.add_argument("--key", type=int, default=0, help="the job's key")
    ap.add_argument("--categories", nargs="+", default=list(EXPECT))
    ap.add_argument("--count", type=int, default=50, help="packets per category")
    ap.add_argument("--interval", type=float, default=0.002)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write {category: sent} as JSON")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    sock.bind((a.iface, 0))
    sent = {c: 0 for c in a.categories}
    order = [c for c in a.categories for _ in range(a.count)]
    rng.shuffle(order)
    for c in order:
        payload, src, sport = payloads(c, a, rng)
        frame = (Ether(src=a.mac, dst=SWITCH_MAC) / IP(src=src, dst=SWITCH_IP)
                 / UDP(sport=sport, dport=wire.HOMAGG_UDP_PORT_MIN) / Raw(payload))
        sock.send(bytes(frame))
        sent[c] += 1
        time.sleep(a.interval)
    sock.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(sent, f)
    print(json.dumps(sent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
