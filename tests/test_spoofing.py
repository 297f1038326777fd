"""The job's key (the header's auth word) against senders off the job's path, on the software
aggregator: an agent with another key is dropped as spoofed, and packets forged with another
source address (a raw socket on loopback, as root) change no sum and stop no worker; both
sides count them.

bmv2 checks the same key in P4 (bmv2_tests/test_conformance.py, the DROP_SPOOFED rows)."""

from __future__ import annotations

import os
import socket
import struct
import threading

import numpy as np
import pytest

from homagg import wire
from homagg.host_agent import AggregationTimeout
from tests.test_agent import make_job  # noqa: F401 - the fixture

KEY = 0xD1CE5EED


def ints(rng, n):
    return rng.integers(-1000, 1000, n).astype(np.int32)


def test_a_keyed_job_is_exact_and_nothing_is_spoofed(make_job):  # noqa: F811
    job = make_job(3, key=KEY)
    rng = np.random.default_rng(1)
    xs = [ints(rng, 40 * wire.WORDS_PER_PACKET + 7) for _ in range(3)]
    res, err = job.run(lambda a, w: a.allreduce_int(xs[w]))
    assert not any(err), err
    for r in res:
        assert np.array_equal(r, np.sum(xs, axis=0, dtype=np.int64))
    assert job.stat("DROP_SPOOFED") == 0
    assert all(a.counters.spoofed == 0 for a in job.agents)


def test_a_worker_with_another_key_is_dropped_as_spoofed_and_adds_nothing(make_job):  # noqa: F811
    """Its packets are counted, never answered (no refusal to an address the switch cannot
    vouch for), and add nothing: its peers' rounds wait for it, and time out naming it."""
    job = make_job(2, key=KEY, deadline=1.0,
                   per_worker=lambda w: {"key": KEY ^ 1} if w == 1 else {})
    x = np.ones(4 * wire.WORDS_PER_PACKET, np.int32)
    res, err = job.run(lambda a, w: a.allreduce_int(x))
    assert all(isinstance(e, AggregationTimeout) for e in err), err
    assert "waiting for worker(s) 1 to start" in str(err[0])
    assert "with this agent's key?" in str(err[1])
    assert job.stat("DROP_SPOOFED") >= 1
    assert job.stat("STAT_COMPLETED") == 0  # worker 0's contributions wait: no sum went out
    assert job.agents[1].counters.results == 0 and job.agents[1].counters.refusals == 0


# -- forged packets from a raw socket ------------------------------------------------------


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def forged(src: tuple[str, int], dst: tuple[str, int], payload: bytes) -> bytes:
    """An IPv4 packet from ``src`` (any address: that is the forgery) to ``dst``."""
    udp = struct.pack("!HHHH", src[1], dst[1], 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(src[0]), socket.inet_aton(dst[0]))
    ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
    return ip + udp


@pytest.mark.skipif(os.geteuid() != 0, reason="forging source addresses needs a raw socket "
                                                "(root)")
def test_forged_packets_from_off_path_change_no_sum_and_stop_no_worker(make_job):  # noqa: F811
    """While a keyed job runs, an attacker who knows every address and port but not the key
    sends, from forged source addresses: contributions as worker 1 (huge values), results to
    worker 0 as the aggregator (wrong sums), and refusals to worker 0 as the aggregator (a
    configuration drop reason, which would end a worker). Every sum stays exact, no worker
    fails, and the aggregator and the agent count what they dropped."""
    job = make_job(2, key=KEY)
    switch = (job.switch_ip, wire.HOMAGG_UDP_PORT_MIN)
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    stop = threading.Event()
    sent = {"contributions": 0, "results": 0}

    def attack():
        """A lucky guesser: it knows the run's generation and the rounds in flight (it reads
        worker 0's transport), everything but the key."""
        rng = np.random.default_rng(9)
        k, slots = wire.WORDS_PER_PACKET, 16
        refusal = np.zeros(k, np.int32)
        refusal[-1] = wire.STAT_INDEX["DROP_WRONG_IDENTITY"]
        t0 = job.agents[0].transport
        while not stop.is_set():
            guess = int(rng.integers(0, 2**32))
            if guess == KEY:
                continue
            g = t0.chunk + int(rng.integers(0, slots))  # a chunk of the window
            head = dict(slot=g % slots, seq=g + 1, gen=t0.gen or 0, auth=guess,
                        flags=wire.FLAG_PHASE if (g // slots) % 2 else 0)
            c = wire.pack(wire.OP_ADD, 1, 1, words=np.full(k, 10**6, np.int32), **head)
            raw.sendto(forged(job.addrs[1], switch, c), (switch[0], 0))
            sent["contributions"] += 1
            for flags, words in ((wire.FLAG_RESULT, np.full(k, 7, np.int32)),
                                 (wire.FLAG_RESULT | wire.FLAG_REFUSED, refusal)):
                r = wire.pack(wire.OP_ADD, 1, 0, words=words,
                              **{**head, "flags": head["flags"] | flags})
                raw.sendto(forged(switch, job.addrs[0], r), (job.addrs[0][0], 0))
                sent["results"] += 1

    t = threading.Thread(target=attack, daemon=True)
    rng = np.random.default_rng(2)
    t.start()
    try:
        for _ in range(20):
            xs = [ints(rng, 30 * wire.WORDS_PER_PACKET) for _ in range(2)]
            res, err = job.run(lambda a, w, xs=xs: a.allreduce_int(xs[w]))
            assert not any(err), err
            for r in res:
                assert np.array_equal(r, np.sum(xs, axis=0, dtype=np.int64))
    finally:
        stop.set()
        t.join(5)
        raw.close()
    assert sent["contributions"] > 100
    assert job.stat("DROP_SPOOFED") > 0
    assert job.agents[0].counters.spoofed > 0
    assert job.agents[0].counters.refusals == 0  # no forged refusal was believed
