"""The native data path: its generated header, its build, and the software aggregator's native
engine held to the Python engine packet for packet.

The scenario test sends the same seeded stream through a server of each engine: rounds of two
jobs (ADD with overflowing lanes, contributions flagged as overflowed, OR), in single datagrams
and in GSO runs (in the tree runs, job 1's partial sums go up to a parent that answers each),
mixed with every kind of packet the native loop hands to the model (duplicates, stale rounds,
wrong keys and identities, bad slots and lengths, joins, forged results, unknown senders,
another version) and a job reset in the middle. Both engines must end with the same counters,
the same slot memory, the same replies to every host and the same partial sums, bit for bit;
and the native loop must have decided most packets itself.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from homagg import native, udpio, wire
from homagg.controller import jobs
from homagg.controller.local import LocalSwitch, install
from homagg.native import genheader
from homagg.netconfig import Uplink
from homagg.targets.soft import SoftSwitch, SoftSwitchServer
from homagg.targets.soft import native as soft_native
from homagg.targets.soft.server import SoftSwitchError, choose_engine

SERVER_IP = "127.0.0.254"
HOSTS = 6  # 0-2: job 1's workers; 3-4: job 2's; 5: no job's
KEYS = {1: 0x5EC0DE01, 2: 0x0BADF00D}
SLOTS = 4


def test_wire_header_is_current():
    assert genheader.OUT.read_text() == genheader.render(), (
        "homagg/native/wire.h is out of date with homagg.wire: run "
        "python -m homagg.native.genheader")


def test_built_where_a_compiler_is():
    if native.pure_python():
        pytest.skip(f"{native.PURE_ENV} is set")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: the Python engine runs")
    assert native.load() is not None, native.why()


def test_pure_python_turns_the_native_engine_off():
    code = ("from homagg.targets.soft.server import choose_engine, SoftSwitchError\n"
            "print(choose_engine('auto'))\n"
            "try:\n    choose_engine('native')\nexcept SoftSwitchError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, native.PURE_ENV: "1"}, check=True).stdout
    assert out.splitlines()[0] == "python"
    assert "HOMAGG_PURE_PYTHON is set" in out


def test_engines_by_name():
    with pytest.raises(SoftSwitchError, match="one of auto, native, python"):
        choose_engine("fast")
    assert choose_engine("python") == "python"


# -- the scenario ----------------------------------------------------------------------------
class Scenario:
    """A seeded stream of packets for two jobs, with every kind of packet the model decides."""

    def __init__(self, seed: int, k: int):
        self.rng = random.Random(seed)
        self.k = k
        self.members = {1: [0, 1, 2], 2: [3, 4]}
        # per (job, slot): [seq, phase, op, workers that sent this round]
        self.rounds = {(j, s): [1, 0, wire.OP_ADD if j == 1 else wire.OP_OR, set()]
                       for j in self.members for s in range(SLOTS)}
        self.sent: list[tuple[int, bytes]] = []
        self.kinds: list[int] = []

    def words(self) -> np.ndarray:
        r = self.rng
        if r.random() < 0.1:  # lanes near the top: sums that overflow
            return np.full(self.k, 2**31 - r.randrange(1, 1000), np.int32)
        return np.array([r.randrange(-2**20, 2**20) for _ in range(self.k)], np.int32)

    def flagged(self) -> int:
        """Now and then a contribution that says FLAG_OVERFLOW (a child switch's partial)."""
        return wire.FLAG_OVERFLOW if self.rng.random() < 0.05 else 0

    def contribution(self, job: int, slot: int) -> tuple[int, bytes]:
        st = self.rounds[(job, slot)]
        seq, phase, op, done = st
        w = self.rng.choice([m for m in self.members[job] if m not in done])
        worker = self.members[job].index(w)
        pkt = wire.pack(op, job, worker, slot, seq, self.words(),
                        flags=(wire.FLAG_PHASE if phase else 0) | self.flagged(), k=self.k,
                        auth=KEYS[job])
        done.add(w)
        if len(done) == len(self.members[job]):
            st[0], st[1], st[3] = seq + 1, phase ^ 1, set()
            if job == 2:
                st[2] = wire.OP_ADD if op == wire.OP_OR else wire.OP_OR
        return w, pkt

    def odd(self) -> tuple[int, bytes]:
        """A packet the native loop hands to the model."""
        r = self.rng
        if not self.kinds:  # every kind, in a shuffled cycle
            self.kinds = list(range(10))
            r.shuffle(self.kinds)
        kind = self.kinds.pop()
        if kind == 0 and self.sent:
            return r.choice(self.sent)  # a duplicate, or a stale round by now
        job = r.choice([1, 2])
        host = r.choice(self.members[job])
        worker = self.members[job].index(host)
        slot = r.randrange(SLOTS)
        seq, op = self.rounds[(job, slot)][0], self.rounds[(job, slot)][2]
        args = dict(k=self.k, auth=KEYS[job])
        if kind == 1:
            args["auth"] = KEYS[job] ^ 1  # DROP_SPOOFED
        elif kind == 2:
            worker = (worker + 1) % len(self.members[job])  # DROP_WRONG_IDENTITY
        elif kind == 3:
            slot = SLOTS + 3  # DROP_BAD_SLOT
        elif kind == 4:
            return host, wire.pack(wire.OP_ADD, job, worker, slot, seq, self.words(),
                                   **args)[:-4]  # DROP_MALFORMED
        elif kind == 5:
            return host, wire.pack(wire.OP_JOIN, job, worker, 0, 1, [], k=wire.JOIN_WORDS,
                                   auth=KEYS[job])
        elif kind == 6:
            return host, wire.pack(wire.OP_ADD, job, worker, slot, seq, self.words(),
                                   flags=wire.FLAG_RESULT, **args)  # DROP_FORGED_RESULT
        elif kind == 7:
            host = 5  # DROP_UNKNOWN_SENDER
        elif kind == 8:
            pkt = bytearray(wire.pack(wire.OP_ADD, job, worker, slot, seq, self.words(), **args))
            pkt[0] = (1 << 4) | wire.OP_ADD  # DROP_BAD_VERSION
            return host, bytes(pkt)
        else:
            seq -= 2  # a stale round
        return host, wire.pack(op, job, worker, slot, seq, self.words(), **args)

    def burst(self, job: int) -> tuple[int, list[bytes]] | None:
        """One worker's contributions to every slot whose round it has not sent, as a run."""
        r = self.rng
        host = r.choice(self.members[job])
        slots = [s for s in range(SLOTS) if host not in self.rounds[(job, s)][3]]
        out = []
        for s in slots:
            st = self.rounds[(job, s)]
            worker = self.members[job].index(host)
            out.append(wire.pack(st[2], job, worker, s, st[0], self.words(),
                                 flags=(wire.FLAG_PHASE if st[1] else 0) | self.flagged(),
                                 k=self.k, auth=KEYS[job]))
            st[3].add(host)
            if len(st[3]) == len(self.members[job]):
                st[0], st[1], st[3] = st[0] + 1, st[1] ^ 1, set()
                if job == 2:
                    st[2] = wire.OP_ADD if st[2] == wire.OP_OR else wire.OP_OR
        return (host, out) if len(out) > 1 else None


def _rx(sw: SoftSwitch) -> int:
    return sw.read_stats()["switch"]["STAT_RX"]


def _wait_rx(sw: SoftSwitch, target: int) -> None:
    deadline = time.monotonic() + 5
    while _rx(sw) < target:
        assert time.monotonic() < deadline, f"the aggregator took {_rx(sw)} of {target}"
        time.sleep(0.0005)


def _stat(sw: SoftSwitch, *names: str) -> int:
    st = sw.read_stats()["switch"]
    return sum(st[n] for n in names)


def _answer_partials(sw: SoftSwitch, parent: socket.socket, partials: list[bytes], dest) -> None:
    """The parent switch of a tree (host PARENT): every partial sum the aggregator has sent
    up so far is kept in ``partials`` and answered with a result (its words, the parent job's
    id and key), taken by the aggregator before this returns."""
    want = _stat(sw, "STAT_PARTIAL_UP", "STAT_PARTIAL_RESENT")
    deadline = time.monotonic() + 5
    while len(partials) < want:
        try:
            part = bytearray(parent.recv(65536))
        except BlockingIOError:
            assert time.monotonic() < deadline, f"{len(partials)} of {want} partials came up"
            time.sleep(0.0005)
            continue
        partials.append(bytes(part))
        h = wire.decode_header(part)
        assert (h.job, h.worker, h.auth) == (PARENT_JOB, PARENT_WORKER, PARENT_KEY)
        part[wire.OFFSETS["flags"]] = wire.FLAG_RESULT | (h.flags & (wire.FLAG_PHASE
                                                                     | wire.FLAG_OVERFLOW))
        rx = _rx(sw)
        parent.sendto(bytes(part), dest)
        _wait_rx(sw, rx + 1)


PARENT, PARENT_JOB, PARENT_WORKER, PARENT_KEY = 5, 9, 1, 0x7EA7E


class Recording(SoftSwitch):
    """A soft switch that keeps what each packet handed to the model one at a time did (the
    native loop's slow path): (its counter, its op)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.slow: list[tuple[str, int]] = []

    def handle(self, data, src, port=None):
        with self.lock:
            out = self.model.process(data, src, port)
        op = wire.decode_header(data).op if len(data) >= wire.HOMAGG_HDR_BYTES else -1
        self.slow.append((out.counter, op))
        return out.replies


def run_scenario(engine: str, seed: int, k: int, events: int = 300, tree: bool = False) -> dict:
    """The scenario on a server of ``engine``; with ``tree``, job 1 is a tree's child job whose
    parent is host PARENT, which answers every partial sum (the uplink's port served)."""
    sw = Recording(slots=16, words=k)
    server = SoftSwitchServer(sw, (SERVER_IP, wire.HOMAGG_UDP_PORT_MIN if tree else 0),
                              ports=(), engine=engine).start()
    socks = []
    try:
        for i in range(HOSTS):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((f"127.0.0.{i + 1}", 0))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.setblocking(False)
            socks.append(s)
        addrs = [s.getsockname() for s in socks]
        for job, members in ((1, [0, 1, 2]), (2, [3, 4])):
            up = (Uplink(PARENT_JOB, PARENT_WORKER, *addrs[PARENT], key=PARENT_KEY,
                         src_port=wire.HOMAGG_UDP_PORT_MIN) if tree and job == 1 else None)
            install(sw, job, [addrs[i] for i in members], SLOTS, uplink=up, key=KEYS[job])
        partials: list[bytes] = []
        sc = Scenario(seed, k)
        dest = server.address
        rx = _rx(sw)
        for e in range(events):
            pick = sc.rng.random()
            if e == events // 2:  # a control-plane write mid-stream: job 1 starts afresh
                jobs.reset_job(LocalSwitch(sw), 1)
                for s in range(SLOTS):
                    sc.rounds[(1, s)][3] = set()
            if pick < 0.2 and (b := sc.burst(sc.rng.choice([1, 2]))) is not None:
                host, pkts = b
                batch = udpio.BatchSocket(socks[host], gro=False)
                sent = batch.send_many(b"".join(pkts), len(pkts[0]), dest)
                assert sent == len(pkts)
                rx += len(pkts)
            else:
                if pick < 0.7:
                    host, pkt = sc.contribution(sc.rng.choice([1, 2]), sc.rng.randrange(SLOTS))
                    sc.sent.append((host, pkt))
                else:
                    host, pkt = sc.odd()
                socks[host].sendto(pkt, dest)
                rx += 1
            _wait_rx(sw, rx)  # in order: the next packet after this one is decided
            if tree:
                _answer_partials(sw, socks[PARENT], partials, dest)
                rx = _rx(sw)
        time.sleep(0.2)
        replies: dict[int, list[bytes]] = {}
        for i, s in enumerate(socks):
            got = replies.setdefault(i, [])
            while True:
                try:
                    got.append(s.recv(65536))
                except BlockingIOError:
                    break
        counts = server.native.io_counts() if server.native is not None else {}
        with sw.lock:
            m = sw.model.mem
            mem = {name: list(getattr(m, name)) for name in
                   ("seen", "count", "tag", "op", "epoch", "gen", "overflow", "final")}
            mem["words"] = m.words.copy()
            stats, job_stats = sw.model.stats.copy(), sw.model.job_stats.copy()
        return {"stats": stats, "job_stats": job_stats, "mem": mem,
                "replies": {i: sorted(r) for i, r in replies.items()}, "native": counts,
                "partials": partials, "slow": list(sw.slow),
                "engine": server.engine}
    finally:
        server.stop()
        for s in socks:
            s.close()


@pytest.mark.parametrize("seed,k,tree", [(1, 64, False), (2, 256, False), (3, 2239, False),
                                         (4, 256, True), (5, 2239, True)])
def test_native_engine_decides_as_the_python_engine(seed, k, tree):
    if not soft_native.available():
        pytest.skip(f"the native engine is off: {soft_native.why()}")
    py = run_scenario("python", seed, k, tree=tree)
    nat = run_scenario("native", seed, k, tree=tree)
    assert (py["engine"], nat["engine"]) == ("python", "native")
    names = {i: wire.STATS.get(i, f"stats[{i}]") for i in range(len(py["stats"]))}
    assert {names[i]: int(v) for i, v in enumerate(nat["stats"]) if v} == \
        {names[i]: int(v) for i, v in enumerate(py["stats"]) if v}
    assert np.array_equal(nat["job_stats"], py["job_stats"])
    for name in ("seen", "count", "tag", "op", "epoch", "gen", "overflow", "final"):
        assert nat["mem"][name] == py["mem"][name], name
    assert np.array_equal(nat["mem"]["words"], py["mem"]["words"])
    for host in py["replies"]:
        assert nat["replies"][host] == py["replies"][host], f"replies to host {host}"
    # the stream had every kind of packet, and the loop took the common one itself
    stats = {names[i]: int(v) for i, v in enumerate(py["stats"])}
    for c in ("STAT_COMPLETED", "STAT_OVERFLOW", "DROP_SPOOFED", "DROP_STALE",
              "DROP_WRONG_IDENTITY", "DROP_BAD_SLOT", "DROP_MALFORMED", "DROP_UNKNOWN_SENDER",
              "DROP_FORGED_RESULT", "DROP_BAD_VERSION"):
        assert stats[c] > 0, c
    assert nat["partials"] == py["partials"]  # (in order: each answered before the next)
    if tree:  # job 1's partial sums went up, and the parent's results came down
        assert stats["STAT_PARTIAL_UP"] > 0 and stats["STAT_FROM_PARENT"] > 0, stats
        flags = [p[wire.OFFSETS["flags"]] for p in py["partials"]]
        assert any(f & wire.FLAG_OVERFLOW for f in flags), "no partial overflowed"
    # The loop took every accepted contribution and every final result from the parent (this
    # parent sends no statuses or refusals, which the model relays); the model, the rest.
    slow = nat["slow"]
    assert not [c for c, op in slow if c == "STAT_ACCEPTED" and op != wire.OP_JOIN], slow
    assert "STAT_FROM_PARENT" not in {c for c, _ in slow}, slow
    assert nat["native"]["taken"] + len(slow) == stats["STAT_RX"]


def test_linerate_benchmark_runs(tmp_path):
    """bench.linerate on a short run: every target answered, every answer exact (the bench
    fails a run with a wrong sum), the figures written."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler for the benchmark's loops")
    from bench import linerate

    targets = ["c-gso", "python"] + (["native"] if soft_native.available() else [])
    out = tmp_path / "linerate.json"
    assert linerate.main(["--words", "64", "--seconds", "0.5", "--repeat", "1",
                          "--targets", ",".join(targets), "--quiet-wait", "0",
                          "--out", str(out)]) == 0
    import json

    table = json.loads(out.read_text())["table"]
    assert [r["target"] for r in table] == targets
    assert all(r["gbit_core"] > 0 for r in table)


class Stalling(SoftSwitch):
    """A soft switch whose model, given a packet by the native loop, says so (``stalled``) and
    waits until the test has sent what it wants (``go``): what comes meanwhile waits in the
    socket, and the loop receives it in one batch."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.stalled, self.go = threading.Event(), threading.Event()

    def handle(self, data, src, port=None):
        replies = super().handle(data, src, port)
        self.stalled.set()
        assert self.go.wait(10)
        return replies


def test_runs_decided_in_one_batch_reach_each_worker_as_one_gso_run():
    """Worker 1 completes 40 rounds in two runs of 20 that the loop receives together: each
    worker gets the 40 exact sums, in slot order, as one message (a GSO run) where the two
    runs' results lie end to end, not one message per run and worker."""
    if not soft_native.available():
        pytest.skip(f"the native engine is off: {soft_native.why()}")
    k, n = 64, 40
    sw = Stalling(slots=n, words=k)
    server = SoftSwitchServer(sw, (SERVER_IP, 0), ports=(), engine="native").start()
    socks = []
    try:
        for i in range(2):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((f"127.0.0.{i + 1}", 0))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.setblocking(False)
            socks.append(s)
        install(sw, 1, [s.getsockname() for s in socks], n, key=KEYS[1])
        words = np.random.default_rng(7).integers(-2**20, 2**20, (2, n, k), dtype=np.int32)

        def run(worker: int, slots: range) -> None:
            pkts = [wire.pack(wire.OP_ADD, 1, worker, s, 1, words[worker, s], k=k,
                              auth=KEYS[1]) for s in slots]
            sent = udpio.BatchSocket(socks[worker], gro=False).send_many(
                b"".join(pkts), len(pkts[0]), server.address)
            assert sent == len(pkts)

        run(0, range(n))
        _wait_rx(sw, n)
        before = server.native.io_counts()
        socks[1].sendto(b"\x00", server.address)  # the model's: the loop waits on it
        assert sw.stalled.wait(10)
        run(1, range(n // 2))
        run(1, range(n // 2, n))
        sw.go.set()
        _wait_rx(sw, 2 * n + 1)
        deadline = time.monotonic() + 5
        got: dict[int, list[bytes]] = {0: [], 1: []}
        while sum(map(len, got.values())) < 2 * n:
            assert time.monotonic() < deadline, {w: len(r) for w, r in got.items()}
            for w, s in enumerate(socks):
                try:
                    got[w].append(s.recv(65536))
                except BlockingIOError:
                    time.sleep(0.001)
        after = server.native.io_counts()
    finally:
        sw.go.set()
        server.stop()
        for s in socks:
            s.close()
    for w in (0, 1):
        heads = [wire.decode_header(r) for r in got[w]]
        assert [h.slot for h in heads] == list(range(n))
        assert all(h.flags & wire.FLAG_RESULT for h in heads)
        sums = np.stack([np.frombuffer(r, ">i4", offset=wire.HOMAGG_HDR_BYTES) for r in got[w]])
        assert np.array_equal(sums, words[0] + words[1])
    assert after["sent"] - before["sent"] == 2 * n
    assert after["send_runs"] - before["send_runs"] == 2, (before, after)
