"""The agent's native engine (homagg/native/agent_loop.c, ``host_agent.engine.native``): its
packets byte for byte against the Python engine's, the engine each agent runs and why, and
what the C loop decides itself under loss at the switch, with every sum exact.

Every test of tests/test_agent.py runs on both engines already (its ``make_job`` fixture);
these are the native engine's own: what the fixture's tests cannot see.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from homagg import native, wire
from homagg.faults import FaultSpec
from homagg.host_agent import AgentConfig, AgentError
from homagg.host_agent.engine import Counters, Transport
from homagg.host_agent.engine import native as engine_native
from homagg.host_agent.engine.loss import HELD_PROBES, PROBE_SAMPLES, PROBES
from homagg.host_agent.engine.packets import pack
from homagg.host_agent.engine.rto import MIN_EPOCH, RtoEstimator
from tests.test_agent import Job, assert_exact, closing_factory, sparse_tensors
from tests.test_loss import FakeRound

needs_native = pytest.mark.skipif(native.load() is None,
                                  reason=f"the native data path is off: {native.why()}")


@pytest.fixture
def make_job():
    yield from closing_factory(Job)


def native_link(job: Job, w: int = 0) -> engine_native.NativeLink:
    link = job.agents[w].transport.native
    assert link is not None, job.agents[w].transport.engine
    return link


@needs_native
@pytest.mark.parametrize("flags", [0, wire.FLAG_OVERFLOW])
@pytest.mark.parametrize("n,k,g0,slots", [
    (1, 16, 0, 1), (300, 256, 0, 4), (256 * 7, 256, 13, 4), (1000, 100, (1 << 32) - 3, 7),
    (2239 * 3 + 5, 2239, 64 * 5 + 1, 64), (50, 16, 1 << 40, 3)])
def test_the_native_packets_are_the_python_engines_byte_for_byte(n, k, g0, slots, flags):
    """Headers (op, job, worker, run, key, the header's flags: FLAG_OVERFLOW for a host's
    partial sum that overflowed; each chunk's copy flag, slot and round tag, the tag wrapping
    at 2**32) and the words in the wire's order, the last chunk's tail zero."""
    rng = np.random.default_rng(n)
    flat = rng.integers(-(1 << 31), 1 << 31, n, dtype=np.int64).astype(np.int32)
    nchunks = -(-n // k)
    head = wire.header(op=wire.OP_OR, job=513, worker=7, slot=0, seq=0, gen=201,
                       auth=0xDEADBEEF, flags=flags)
    link = engine_native.NativeLink.__new__(engine_native.NativeLink)
    link.lib = native.load()
    got = link.pack(flat, k, nchunks, g0, slots, head)
    want = pack(flat, k, nchunks, g0, slots, head)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()
    phase = np.where((g0 + np.arange(nchunks)) // slots % 2 == 1, wire.FLAG_PHASE, 0)
    assert np.array_equal(want["flags"], phase | flags)


@needs_native
def test_an_agent_runs_the_native_engine_where_it_can_and_says_why_not(make_job):
    job = make_job(2)
    assert [a.transport.engine for a in job.agents] == ["native", "native"]
    base = dict(job=1, worker=0, workers=2, switch=("127.0.0.1", wire.HOMAGG_UDP_PORT_MIN))
    sock = job.agents[0].transport.sock
    assert engine_native.choose(AgentConfig(**base), sock) == "native"
    assert engine_native.choose(AgentConfig(**base, engine="python"), sock) == "python"
    for options, why in [({"congestion": True}, "congestion control"),
                         ({"rate_pps": 1000.0}, "rate_pps")]:
        cfg = AgentConfig(**base, **options)
        assert engine_native.choose(cfg, sock) == "python"
        with pytest.raises(AgentError, match=f"native engine was asked for, but .*{why}"):
            engine_native.choose(AgentConfig(**base, engine="native", **options), sock)
    with pytest.raises(AgentError, match="engine 'fast': auto, native or python"):
        AgentConfig(**base, engine="fast")


@needs_native
def test_faults_at_the_agents_socket_run_the_python_engine(make_job):
    job = make_job(2, per_worker=lambda w: {"faults": FaultSpec(loss=0.02, seed=w)}
                   if w == 1 else {})
    assert [a.transport.engine for a in job.agents] == ["native", "python"]
    rng = np.random.default_rng(2)
    xs = sparse_tensors(rng, 2, 40_000, 0.05)
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err), err
    assert_exact(res, xs)
    with pytest.raises(AgentError, match="native engine was asked for, but faults are"):
        Job(1, per_worker=lambda w: {"faults": FaultSpec(loss=0.1)}, agent_engine="native")


def test_pure_python_runs_the_python_engine_and_says_so_once():
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from homagg.host_agent import AgentConfig\n"
            "from homagg.host_agent.engine import native\n"
            "for _ in range(3):\n"
            "    print(native.choose(AgentConfig(job=1, worker=0, workers=1), None))\n"
            "try:\n"
            "    native.choose(AgentConfig(job=1, worker=0, workers=1, engine='native'), None)\n"
            "except Exception as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"HOMAGG_PURE_PYTHON": "1", "PATH": "/usr/bin:/bin"}, check=True)
    assert out.stdout.splitlines()[:3] == ["python"] * 3
    assert "the native data path is off: HOMAGG_PURE_PYTHON is set" in out.stdout
    assert out.stderr.count("native data path off") == 1, out.stderr


@needs_native
@pytest.mark.parametrize("k", [64, wire.MAX_WORDS_PER_PACKET])
def test_both_engines_send_the_same_packets_and_get_the_same_sums(make_job, k):
    """The same seeded tensors through a job of each engine: the same sums bit for bit, and
    the same rounds, new packets, bytes and results (resends are the machine's timing: a
    probe after a peer's scheduling lag), the native loop taking every result itself."""
    rng = np.random.default_rng(k)
    tensors = [sparse_tensors(rng, 3, n, d) for n, d in
               [(100_000, 0.01), (7, 1.0), (30_000, 1.0), (250_000, 0.002)]]
    outs, counts = {}, {}
    for engine in ("native", "python"):
        job = make_job(3, switch_words=k, agent_engine=engine)
        got = []
        for xs in tensors:
            res, err = job.run(lambda a, w, xs=xs: a.allreduce_detailed(xs[w]))
            assert not any(err), err
            assert_exact(res, xs)
            got.append([r.values for r in res] + [r.out for r in res])
        outs[engine] = got
        counts[engine] = [(c.rounds, c.packets_sent - c.retransmissions,
                           c.bytes_sent - c.retransmissions * wire.packet_bytes(k), c.results,
                           c.join_packets) for c in (a.counters for a in job.agents)]
        if engine == "native":
            for w, a in enumerate(job.agents):  # every result but the join's, in C
                assert native_link(job, w).results == a.counters.results - 1
    for a, b in zip(outs["native"], outs["python"]):
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()
    assert counts["native"] == counts["python"]


@needs_native
def test_the_native_loop_resends_on_racks_evidence_before_the_timeout(make_job):
    """Loss at the switch (5% each way, seeded) and a 0.5 s timeout: the C loop's timers wake
    Python's recovery on RACK's deadline, long before the timeout; every sum exact."""
    job = make_job(3, faults=FaultSpec(loss=0.05, seed=5), timeout=0.5, min_timeout=0.5,
                   max_timeout=0.5, deadline=30.0)
    assert {a.transport.engine for a in job.agents} == {"native"}
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(200_000).astype(np.float32) for _ in range(3)]
    t0 = time.monotonic()
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err), err
    assert_exact(res, xs)
    c = [a.counters for a in job.agents]
    assert sum(x.early_resends for x in c) > 0
    assert all(x.early_resends <= x.retransmissions for x in c)
    assert time.monotonic() - t0 < 10.0


@needs_native
def test_a_tail_loss_is_probed_by_the_native_loop(make_job):
    """One-chunk rounds and a 2 s timeout. After ten clean rounds (the probe timeout's
    samples), the switch loses 10% of datagrams each way: a lost chunk or result has nothing
    after it for RACK, and the probe the C loop wakes for finds it, with the statuses the
    probes draw decided by Python. A resend waits out the timeout only where both probes
    were lost too (both engines: 0-2 of some 45 resends in 30 rounds)."""
    lossy = FaultSpec(loss=0.1, seed=11)
    job = make_job(3, faults=lossy, timeout=2.0, min_timeout=2.0, max_timeout=2.0,
                   deadline=60.0)
    assert {a.transport.engine for a in job.agents} == {"native"}
    impaired = list(job.server.socks.values())

    def rounds(n):
        for _ in range(n):
            q = [rng.integers(-1000, 1000, 200).astype(np.int32) for _ in range(3)]
            res, err = job.run(lambda a, w, q=q: a.allreduce_int(q[w]))
            assert not any(err), err
            for r in res:
                np.testing.assert_array_equal(r, np.sum(q, axis=0, dtype=np.int64))

    rng = np.random.default_rng(7)
    for s in impaired:
        s.spec = dataclasses.replace(lossy, loss=0.0)
    rounds(10)
    assert all(a.transport.rtt.samples >= PROBE_SAMPLES for a in job.agents)
    for s in impaired:
        s.spec = lossy
    rounds(30)
    c = [a.counters for a in job.agents]
    assert sum(s.dropped_in + s.dropped_out for s in impaired) > 0
    probes = sum(x.probes for x in c)
    timeouts = sum(x.retransmissions - x.early_resends - x.probes for x in c)
    assert probes > 0
    assert timeouts * 4 < probes, (timeouts, probes)


@needs_native
def test_a_send_that_fails_is_an_error_naming_the_switch():
    """An unroutable switch address: the C loop's send fails with the kernel's reason, and the
    agent says so, as the Python engine does."""
    cfg = AgentConfig(job=1, worker=0, workers=1, switch=("127.0.0.1", wire.HOMAGG_UDP_PORT_MIN),
                      bind=("127.0.0.1", 0), engine="native", deadline=2.0)
    t = Transport(cfg, Counters())
    try:
        t.gen, t.k, t.packet_bytes = 1, 64, wire.packet_bytes(64)  # (as if joined)
        t.switch = ("240.0.0.1", wire.HOMAGG_UDP_PORT_MIN)  # class E: no route
        with pytest.raises(AgentError, match="cannot send to the switch 240.0.0.1"):
            t.stream(wire.OP_ADD, np.ones(1000, np.int32))
        assert t.broken
    finally:
        t.close()


def _c_state(fake: FakeRound) -> tuple[engine_native.NativeLink, engine_native._Round]:
    """A fake round's state in the C loop's struct (``NativeLink.push``), arrays by pointer."""
    link = engine_native.NativeLink.__new__(engine_native.NativeLink)
    link.st = st = engine_native._Round()
    link.t = SimpleNamespace(rtt=fake.t.rtt, sock=None)
    fake.ndone, fake.overflow = int(fake.done.sum()), False
    link.push(fake)
    st.nchunks, st.slots = fake.nchunks, fake.cfg.slots
    st.done, st.held = fake.done.ctypes.data, fake.held.ctypes.data
    st.sent_at, st.rto = fake.sent_at.ctypes.data, fake.rto.ctypes.data
    st.probes, st.probe_samples, st.held_max = PROBES, PROBE_SAMPLES, HELD_PROBES
    st.min_epoch = MIN_EPOCH
    return link, st


@needs_native
def test_the_native_timers_wake_when_the_python_engines_would():
    """``ha_wake_at`` against ``LossRecovery.wake_at`` (timeouts, RACK, both probes, lossy
    or not, with and without an estimate) on random round states: the same time, exactly."""
    lib, rng = native.load(), np.random.default_rng(5)
    for case in range(3000):
        n = int(rng.integers(1, 40))
        r = FakeRound(n=n, srtt=float(rng.uniform(1e-4, 0.02)), rttvar=float(rng.uniform(0, 0.01)))
        r.cfg = AgentConfig(1, 0, 2, ("127.0.0.1", 48864), ("127.0.0.1", 0),
                            int(rng.integers(1, 20)))
        r.next_c = int(rng.integers(0, n + 1))
        r.done[:] = rng.random(n) < 0.4
        r.sent_at[:] = rng.uniform(0, 1, n)
        r.sent_at[rng.random(n) < 0.2] = 0.5  # ties
        r.rto[:] = rng.uniform(0.001, 0.1, n)
        r.held[:] = rng.random(n) < 0.3
        if rng.random() < 0.8:
            r.rack_c = int(rng.integers(0, n))
            r.rack_ts, r.rack_rtt = float(r.sent_at[r.rack_c]), float(rng.uniform(0, 0.01))
        r.nprobes = int(rng.integers(0, PROBES + 1))
        r.held_probes = int(rng.integers(0, HELD_PROBES + 1))
        r.t.rtt.min_cur, r.t.rtt.min_prev = (float(x) for x in rng.uniform(1e-5, 0.01, 2))
        r.probe_c = int(rng.integers(0, n))
        r.last_progress, r.last_new = (float(x) for x in rng.uniform(0, 1, 2))
        rtt = r.t.rtt
        rtt.samples = int(rng.integers(0, 2 * PROBE_SAMPLES))
        if rng.random() < 0.1:
            rtt.srtt = None
        r.counters.rounds = int(rng.integers(0, 40))
        rtt.loss_round = int(rng.integers(-5, 40))
        now = float(rng.uniform(0, 1.2))
        _, st = _c_state(r)
        want = r.wake_at(r.in_flight(), now)
        got = lib.ha_wake_at(ctypes.byref(st), now)
        assert got == want, (case, got, want)


@needs_native
def test_the_native_estimate_is_the_python_estimators():
    lib, rng = native.load(), np.random.default_rng(9)
    est = RtoEstimator(0.05, 0.02, 0.1)
    r = FakeRound()
    r.t.rtt = RtoEstimator(0.05, 0.02, 0.1)
    _, st = _c_state(r)
    for rtt in rng.exponential(0.01, 500):
        est.sample(float(rtt))
        lib.ha_rtt_sample(ctypes.byref(st), float(rtt))
        assert (st.srtt, st.rttvar, st.cur_rto, st.samples) == (est.srtt, est.rttvar, est.rto,
                                                                est.samples)
        assert (st.min_cur, st.min_prev, st.min_n) == (est.min_cur, est.min_prev, est.min_n)


@needs_native
@pytest.mark.parametrize("engine", ["native", "python"])
def test_the_agent_cli_runs_the_engine_asked_for_and_names_it(make_job, tmp_path, engine):
    """``homagg-agent --engine``: a one-worker job through the software aggregator, every sum
    checked bit for bit, and the summary names the engine that ran."""
    from homagg.host_agent import cli

    job = make_job(1)
    bind = job.addrs[0]
    job.agents[0].close()  # (its address is the CLI agent's)
    out = tmp_path / "summary.json"
    rc = cli.main(["--summary-json", str(out), "--job", "1", "--worker", "0", "--workers", "1",
                   "--switch", f"{job.switch_ip}:{wire.HOMAGG_UDP_PORT_MIN}",
                   "--bind", f"{bind[0]}:{bind[1]}", "--slots", "16", "--engine", engine,
                   "bench", "--size", "50000", "--iterations", "3", "--check"])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["engine"] == engine
    assert summary["checked"] and summary["rounds"] >= 3
