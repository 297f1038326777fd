"""Batched UDP I/O (homagg.udpio): runs of datagrams per system call through UDP GSO and GRO,
the same datagrams on the wire as one sendto each, the per-datagram fallback, faults per
datagram, and the agents and the software aggregator batching for real, with exact sums."""

from __future__ import annotations

import errno
import socket
import time

import numpy as np
import pytest

from homagg import udpio, wire
from homagg.faults import FaultSpec, ImpairedSocket
from tests.test_agent import Job

SIZE = wire.packet_bytes(256)


def _pair(gro=True):
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx.bind(("127.0.0.1", 0))
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    rx.setblocking(False)
    return udpio.BatchSocket(tx), (udpio.BatchSocket(rx, gro=gro) if gro is not None else rx)


def _payload(n, last=SIZE):
    """n datagrams of SIZE bytes (the last ``last`` bytes), each one different."""
    rng = np.random.default_rng(n)
    return rng.integers(0, 256, SIZE * (n - 1) + last, dtype=np.uint8).tobytes()


def _drain(rx, buf):
    """Every datagram queued at a BatchSocket, split by the segment sizes it reported."""
    got, calls = [], 0
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            nb, seg, _ = rx.recv_many(buf)
        except BlockingIOError:
            if got:
                time.sleep(0.05)
                try:
                    nb, seg, _ = rx.recv_many(buf)
                except BlockingIOError:
                    break
            else:
                time.sleep(0.01)
                continue
        calls += 1
        got += [bytes(buf[at:at + n]) for at, n in udpio.segments(nb, seg)]
    return got, calls


def test_a_run_goes_out_in_few_calls_and_comes_back_as_the_same_datagrams():
    tx, rx = _pair()
    data = _payload(150, last=100)
    n = tx.send_many(data, SIZE, rx.getsockname())
    want = [data[i:i + SIZE] for i in range(0, len(data), SIZE)]
    assert n == len(want) == 150
    assert tx.gso and tx.sent == 150
    assert tx.send_calls <= 150 // (udpio.MAX_GSO_BYTES // SIZE) + 1  # 3 calls, not 150
    got, calls = _drain(rx, bytearray(udpio.RECV_BYTES))
    assert got == want  # in order, byte for byte, the short last one included
    if rx.gro:  # loopback keeps a GSO run whole for a GRO socket: a few receives
        assert calls < 10 and rx.received == 150


def test_a_plain_receiver_sees_one_datagram_per_segment():
    """Nothing changes on the wire: a peer without GRO (bmv2, a plain socket) gets ordinary
    datagrams, one per segment."""
    tx, rx = _pair(gro=None)
    data = _payload(70)
    tx.send_many(data, SIZE, rx.getsockname())
    got = []
    deadline = time.monotonic() + 2
    while len(got) < 70 and time.monotonic() < deadline:
        try:
            got.append(rx.recv(udpio.RECV_BYTES))
        except BlockingIOError:
            time.sleep(0.01)
    assert got == [data[i:i + SIZE] for i in range(0, len(data), SIZE)]


class _NoGso:
    """A socket whose kernel refuses GSO, as Linux does (EIO) on a route whose device has no
    checksum offload: the launcher's bmv2 links."""

    def __init__(self, sock):
        self.sock = sock
        self.sendmsg_calls = 0

    def sendmsg(self, *a):
        self.sendmsg_calls += 1
        raise OSError(errno.EIO, "Input/output error")

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_a_kernel_that_refuses_gso_gets_one_datagram_per_call_for_good():
    raw, rx = _pair(gro=None)
    tx = udpio.BatchSocket(_NoGso(raw.sock))  # type: ignore[arg-type]
    data = _payload(40)
    assert tx.send_many(data, SIZE, rx.getsockname()) == 40
    assert not tx.gso and tx.send_calls == 40
    tx.send_many(data, SIZE, rx.getsockname())
    assert tx.sock.sendmsg_calls == 1  # tried once, then per datagram
    got = []
    deadline = time.monotonic() + 2
    while len(got) < 80 and time.monotonic() < deadline:
        try:
            got.append(rx.recv(udpio.RECV_BYTES))
        except BlockingIOError:
            time.sleep(0.01)
    assert got == 2 * [data[i:i + SIZE] for i in range(0, len(data), SIZE)]


def test_other_send_errors_are_raised():
    raw, _ = _pair(gro=None)
    with pytest.raises(OSError):  # port 0: a real error (EINVAL), not a refusal of GSO
        raw.send_many(_payload(4), SIZE, ("127.0.0.1", 0))
    assert raw.gso  # the plain retry failed too: GSO stays on


def test_faults_hit_each_datagram_of_a_run():
    """Loss at an ImpairedSocket is per datagram on a coalesced run too: the survivors come up
    end to end, each intact, and the drops are counted."""
    tx, rx = _pair()
    lossy = ImpairedSocket(rx, FaultSpec(loss=0.3, seed=7))
    data = _payload(120)
    tx.send_many(data, SIZE, rx.getsockname())
    want = {data[i:i + SIZE] for i in range(0, len(data), SIZE)}
    got, _ = _drain(lossy, bytearray(udpio.RECV_BYTES))
    assert set(got) <= want and len(got) == len(set(got))
    assert len(got) + lossy.dropped_in == 120
    assert 10 < lossy.dropped_in < 70

    out = ImpairedSocket(tx, FaultSpec(loss=0.5, seed=3))
    _, rx2 = _pair()
    out.send_many(data, SIZE, rx2.getsockname())
    got2, _ = _drain(rx2, bytearray(udpio.RECV_BYTES))
    assert len(got2) + out.dropped_out == 120 and set(got2) <= want


def test_agents_and_aggregator_batch_for_real_and_sums_stay_exact():
    """Four agents through the software aggregator on loopback: most datagrams travel in runs
    both ways, and the sum is the exact integer sum."""
    W = 4
    job = Job(W, slots=32)
    try:
        xs = [np.random.default_rng(w).integers(-1000, 1000, 200_000).astype(np.int32)
              for w in range(W)]
        res, err = job.run(lambda a, w: a.transport.stream(wire.OP_ADD, xs[w]))
        assert err == [None] * W
        want = np.sum(xs, axis=0, dtype=np.int64)
        for r in res:
            assert np.array_equal(np.asarray(r, np.int64), want)
        for a in job.agents:
            s = a.sock
            assert s.gso and s.sent > 2 * s.send_calls  # runs out
            assert s.received > 2 * s.recv_calls        # runs in
        srv = job.server.io_counts()  # (either engine's: the Python sockets' or the loop's)
        assert srv["received"] > 2 * srv["recv_calls"] and srv["sent"] > 2 * srv["send_calls"]
    finally:
        job.close()


def test_path_mtu_is_the_routes_interface_mtu():
    lo = int(open("/sys/class/net/lo/mtu").read())
    assert udpio.path_mtu(("127.0.0.1", 9)) == min(lo, 65535)  # (IPv4's own limit)
    assert udpio.path_mtu(("not an address", 9)) is None
