"""The controller service under load and under attack (issue 34): renewals that never starve,
job ids that never overflow, one service per switch, and numbers checked at the edge.

Each test drives a real service over gRPC, in front of a software aggregator on loopback (the
``Rig`` of test_service.py); every port is the kernel's, and every loop is bounded.
"""

from __future__ import annotations

import math
import re
import socket
import threading
import time

import grpc
import numpy as np
import pytest

pytest.importorskip("p4runtime_sh")
pytest.importorskip("prometheus_client")

from homagg import _p4consts as P4  # noqa: E402
from homagg.controller.p4client import P4RuntimeSwitch  # noqa: E402
from homagg.controller.serve import start  # noqa: E402
from homagg.controller.service import (  # noqa: E402
    HOLDER_CELL,
    SERVICE_JOBS_CELL,
    JobService,
    Refusal,
    ServeOptions,
)
from homagg.errors import ConfigError  # noqa: E402
from homagg.host_agent import Agent, AgentConfig  # noqa: E402
from homagg.launcher.local import LocalAggregator  # noqa: E402
from homagg.membership import pb2  # noqa: E402
from tests.test_service import (  # noqa: E402
    POOL,
    TOKEN,
    Rig,
    connect,
    join_all,
    refused,
    secret_of,
)

pytestmark = pytest.mark.slow  # (conftest.py) hundreds of requests, leases and deadlines


@pytest.fixture(name="rig")
def _rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def run_job(rig: Rig, name: str, seconds: float) -> tuple[list, dict]:
    """A 2-worker job of real agents (joined through the service, renewing their leases)
    summing for ``seconds``, exactly; returns (errors, configs) once both are done."""
    world, errors, cfgs = 2, [], {}
    stop_at = time.monotonic() + seconds

    def worker(rank):
        try:
            cfg = cfgs[rank] = AgentConfig.from_env(rig.env(name, rank, world), deadline=30.0)
            with Agent(cfg) as agent:
                it, votes = 0, 0
                while votes < world:  # both stop after the same round (the sum of votes)
                    xs = [np.full(2000, it + 3 * w, np.int32) for w in range(world)]
                    xs[rank][-1] = time.monotonic() > stop_at
                    got = agent.allreduce_int(xs[rank])
                    votes = int(got[-1])
                    assert np.array_equal(got[:-1], np.sum(xs, axis=0, dtype=np.int64)[:-1])
                    it += 1
                    assert it < 10**6
                    time.sleep(0.01)
        except BaseException as e:
            errors.append((rank, e))

    ts = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + 60)
    assert not any(t.is_alive() for t in ts), "an agent hung"
    return errors, cfgs


def test_a_running_job_keeps_its_lease_while_600_joins_wait(tmp_path):
    """10 jobs of 61 ranks, 60 of each joined and waiting for the last (600 joins, each holding
    a server thread), while a 2-worker job with a 6 s lease runs for 9 s: its renewals are
    answered, it is not reaped, and every waiting join is answered with its missing rank."""
    rig = Rig(tmp_path, lease=6.0)
    try:
        futures = [rig.stub.Join.future(pb2.JoinRequest(
            token=TOKEN, job=f"crowd-{j}", rank=r, world_size=61, udp_port=20000 + 100 * j + r,
            wait_seconds=20.0, join_secret=secret_of(f"crowd-{j}")), timeout=40)
            for j in range(10) for r in range(60)]
        deadline = time.monotonic() + 30
        while rig.svc._waiting < 600 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rig.svc._waiting == 600
        errors, cfgs = run_job(rig, "busy", 9.0)
        assert not errors, errors
        assert all(c.membership.lost is None for c in cfgs.values())
        assert rig.svc.removals.get("lease expired", 0) == 0, rig.svc.removals
        assert all(c.membership.renewals >= 3 for c in cfgs.values())
        codes = {}
        for f in futures:
            e = f.exception(timeout=40)
            assert isinstance(e, grpc.RpcError), e
            codes[e.code()] = codes.get(e.code(), 0) + 1
            # (ranks that timed out a moment before are missing too, by then)
            assert re.match(r"job 'crowd-\d': ranks? [\d, ]*\b60 of world size 61 did not "
                            r"join within 20 s", e.details()), e.details()
        assert codes == {grpc.StatusCode.DEADLINE_EXCEEDED: 600}
        assert rig.jobs() == []
    finally:
        rig.close()


class FreezableProxy:
    """A TCP relay in front of a P4Runtime server; ``freeze()`` keeps accepting connections
    but relays nothing (a process stopped with SIGSTOP, as the kernel shows it)."""

    def __init__(self, target: str):
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.frozen = threading.Event()
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed.is_set():
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            if self.frozen.is_set():
                continue  # held open, never answered (closed with the test)
            s = socket.create_connection(self.target)
            for a, b in ((c, s), (s, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a, b):
        try:
            while True:
                data = a.recv(65536)
                while self.frozen.is_set() and not self.closed.is_set():
                    time.sleep(0.05)
                if not data or self.closed.is_set():
                    break
                b.sendall(data)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def freeze(self):
        self.frozen.set()

    def close(self):
        self.closed.set()
        self.lsock.close()


def test_a_running_job_keeps_its_lease_while_the_fallback_hangs(tmp_path):
    """The fallback stops answering (SIGSTOP, as its peers see it: connections accepted, no
    reply); each join then spends seconds on it. A job on the switch with a 3 s lease runs
    through 8 s of such joins, and is not reaped; the joins are refused, naming the fallback."""
    from homagg.netconfig import Config, FallbackSpec

    fb = LocalAggregator(workdir=tmp_path / "fb").start()
    proxy = FreezableProxy(fb.config.switch.grpc)
    rig = Rig(tmp_path, lease=3.0)
    try:
        rig.stop_service()
        rig.agg.config = Config(rig.agg.config.switch,
                                fallback=FallbackSpec(name="fb", ip=fb.config.switch.ip,
                                                      grpc=proxy.address))
        rig.serve("127.0.0.1:0")
        refusals: list = []
        stop = threading.Event()

        def joiners():
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    rig.join(f"other-{n}", 0, 1, 30000 + n)
                except grpc.RpcError as e:
                    refusals.append(e)

        started = threading.Event()

        def frozen_then_joins():
            started.wait()
            proxy.freeze()
            ts = [threading.Thread(target=joiners) for _ in range(4)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)

        side = threading.Thread(target=frozen_then_joins)
        side.start()
        try:
            # the job is placed while the fallback answers; then it freezes
            errs_cfgs: list = []

            def run():
                errs_cfgs.append(run_job(rig, "steady", 8.0))

            t = threading.Thread(target=run)
            t.start()
            deadline = time.monotonic() + 30
            while not rig.svc.held and time.monotonic() < deadline:
                time.sleep(0.05)
            started.set()
            t.join(120)
            errors, cfgs = errs_cfgs[0]
        finally:
            stop.set()
            started.set()
            side.join(120)
        assert not errors, errors
        assert all(c.membership.lost is None for c in cfgs.values())
        assert rig.svc.removals.get("lease expired", 0) == 0, rig.svc.removals
        assert refusals, "no join ran into the hung fallback"
        for e in refusals:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
            assert "fb unreachable" in e.details(), e.details()
    finally:
        rig.close()
        proxy.close()
        fb.stop()


def test_64_jobs_at_once_are_placed_or_refused_and_leave_nothing(tmp_path):
    """Job ids 1-63 are the switch's; 64 jobs joining at once: 63 placed (id 63 too, whose
    mark does not fit a 63-bit count), the 64th refused, saying why; once all leave, nothing
    is left on the switch, marks included. The jobs do not renew (bare joins), so their lease
    is longer than the test: with 30 s, a loaded machine's 64 joins outlasted it, and a job
    was being reaped, as it should, before the test asked it to leave."""
    rig = Rig(tmp_path, lease=600.0)
    try:
        _sixty_four_jobs(rig)
    finally:
        rig.close()


def _sixty_four_jobs(rig) -> None:
    out: dict = {}

    def one(n):
        try:
            out[n] = rig.join(f"many-{n}", 0, 1, 31000 + n, slots=POOL // 64)
        except grpc.RpcError as e:
            out[n] = e

    ts = [threading.Thread(target=one, args=(n,)) for n in range(64)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    placed = {n: r for n, r in out.items() if not isinstance(r, grpc.RpcError)}
    failed = [r for r in out.values() if isinstance(r, grpc.RpcError)]
    assert sorted(r.job_id for r in placed.values()) == list(range(1, 64))
    assert len(failed) == 1
    assert failed[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert failed[0].details().endswith(": no free job id (all 63 in use)")
    assert sorted(j["id"] for j in rig.jobs()) == list(range(1, 64))
    for n, r in placed.items():
        assert rig.stub.Leave(rig.lease(r.job_id, 0, 31000 + n, r.secret)).removed
    assert rig.jobs() == []
    with P4RuntimeSwitch(rig.agg.config.switch.grpc, 1, (0, 3)).open() as sw:
        cell = sw.read_counter(P4.COUNTER_STATS)[SERVICE_JOBS_CELL]
        assert (cell.packets, cell.bytes) == (0, 0)
    assert rig.svc.removals == {"every worker left": 63}


def test_a_restarted_service_reads_back_job_63(tmp_path):
    rig = Rig(tmp_path)
    try:
        replies = {n: rig.join(f"fill-{n}", 0, 1, 32000 + n, slots=1) for n in range(63)}
        assert replies[62].job_id == 63
        addr = rig.srv.address
        rig.stop_service()
        rig.serve(addr)
        assert sorted(rig.svc.held) == list(range(1, 64))
        assert rig.stub.Leave(rig.lease(63, 0, 32062, replies[62].secret)).removed
        assert 63 not in rig.svc.held and len(rig.jobs()) == 62
    finally:
        rig.close()


def test_a_second_service_on_the_same_switch_refuses_to_start(rig):
    """Two services on one switch would reap each other's jobs (each sees the other's as
    unrenewed): the second refuses while the first answers, starts at once after a clean
    stop, and takes over from one that died; one that was only paused then stands down."""
    replies = join_all(rig, "first", 2)
    with pytest.raises(ConfigError) as e:
        start(JobService(rig.agg.config, connect, rig.opts), "127.0.0.1:0")
    assert str(e.value) == ("switch local is held by another homagg-ctl serve, which answers "
                            f"at {rig.srv.address}: two services on one switch would reap each "
                            "other's jobs; stop that one first")
    assert [j["id"] for j in rig.jobs()] == [replies[0].job_id]  # untouched
    # the first one dies without a clean stop (its port closes): the next takes over
    first = rig.svc
    first._stop.set()
    rig.channel.close()
    rig.srv.grpc_server.stop(0).wait()
    rig.serve("127.0.0.1:0")
    assert sorted(rig.svc.held) == [replies[0].job_id]
    # the first was only paused, and comes back: its next removal sees it was replaced
    assert first.reap() == [] and first.leave(replies[0].job_id, 0, "127.0.0.1", 40000,
                                              replies[0].secret) is False
    with pytest.raises(Refusal) as r:
        first.leave(replies[0].job_id, 1, "127.0.0.1", 40001, replies[1].secret)
    assert r.value.code == "UNAVAILABLE"
    assert str(r.value) == ("another homagg-ctl serve took switch local over (STATS cell "
                            f"{HOLDER_CELL} holds its mark)")
    assert [j["id"] for j in rig.jobs()] == [replies[0].job_id]  # the new holder's, kept
    with pytest.raises(Refusal):
        first.join("another", 0, 1, "127.0.0.1", 40100, secret=secret_of("another"))
    # after a clean stop the next starts at once
    addr = rig.srv.address
    rig.stop_service()
    t0 = time.monotonic()
    rig.serve(addr)
    assert time.monotonic() - t0 < 2.0
    assert sorted(rig.svc.held) == [replies[0].job_id]


@pytest.mark.parametrize("field, value", [("lease", 0), ("lease", -1), ("lease", math.nan),
                                          ("lease", math.inf), ("wait", 0), ("wait", math.nan),
                                          ("wait", -5)])
def test_serve_options_refuse_numbers_that_would_spin_or_never_expire(field, value):
    option = {"lease": "--lease", "wait": "--join-wait"}[field]
    with pytest.raises(ConfigError) as e:
        ServeOptions(**{field: value})
    assert str(e.value) == f"{option} {value!r}: a finite number of seconds above 0"


def test_the_cli_refuses_a_nan_lease_before_it_touches_the_switch(tmp_path, capsys):
    from homagg.controller.cli import main as ctl

    agg = LocalAggregator(workdir=tmp_path).start()
    try:
        for args, want in ((["--lease", "nan"], "--lease nan"),
                           (["--lease", "0"], "--lease 0.0"),
                           (["--join-wait", "0"], "--join-wait 0.0"),
                           (["--join-wait=-inf"], "--join-wait -inf")):
            rc = ctl(["-c", str(agg.path), "serve", "--no-token", "--listen", "127.0.0.1:0",
                      *args])
            assert rc != 0
            err = capsys.readouterr().err
            assert f"{want}: a finite number of seconds above 0" in err, err
    finally:
        agg.stop()


def test_a_join_with_a_nan_wait_is_refused_at_once(rig):
    t0 = time.monotonic()
    e = refused(lambda: rig.join("j", 0, 2, 40000, wait_seconds=math.nan))
    assert time.monotonic() - t0 < 5
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details() == ("job 'j': wait_seconds nan: a finite number of seconds, at least 0 "
                           "(0: the service's)")


def test_a_job_name_with_a_line_break_is_refused(rig):
    e = refused(lambda: rig.join("j\n2026 INFO job 9 removed", 0, 1, 40000))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details() == "a job name is required (at most 512 printable characters)"


@pytest.mark.parametrize("claimed", ["0.0.0.0", "255.255.255.255", "224.0.0.1", "switch",
                                     "not-an-address"])
def test_a_worker_address_that_is_no_workers_is_refused_at_the_join(tmp_path, claimed):
    rig = Rig(tmp_path, trust_claimed_address=True)
    try:
        if claimed == "switch":
            claimed = rig.agg.config.switch.ip
        t0 = time.monotonic()
        e = refused(lambda: rig.join("j", 0, 2, 40000, ip=claimed))
        assert time.monotonic() - t0 < 5  # at once, not after the other rank
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e.details()
        assert claimed in e.details()
    finally:
        rig.close()


def test_joins_beyond_the_limit_are_refused_and_renewals_still_answered(tmp_path):
    rig = Rig(tmp_path, max_joins=3)
    try:
        job = join_all(rig, "running", 1, ports=[39000])[0]
        futures = [rig.stub.Join.future(pb2.JoinRequest(
            token=TOKEN, job="waiting", rank=r, world_size=5, udp_port=39100 + r,
            wait_seconds=10.0, join_secret=secret_of("waiting")), timeout=30) for r in range(3)]
        deadline = time.monotonic() + 10
        while rig.svc._waiting < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        e = refused(lambda: rig.join("waiting", 3, 5, 39103))
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.details() == ("job 'waiting': 3 joins are waiting, this service's limit "
                               "(homagg-ctl serve --max-joins); join again later")
        assert rig.stub.Renew(rig.lease(job.job_id, 0, 39000, job.secret)).lease_seconds == 30
        for f in futures:
            f.cancel()
    finally:
        rig.close()


def test_a_join_waits_for_the_room_a_crashed_jobs_lease_frees(tmp_path):
    """PyTorch's tests, run back to back, left jobs whose ranks had exited without leaving:
    a join that finds no room waits, within its wait, for their leases to run out."""
    rig = Rig(tmp_path, lease=1.0)
    try:
        crashed = join_all(rig, "crashed", 1, slots=POOL)[0]  # never renews
        time.sleep(0.6)  # it missed a renewal (agents renew every third of a lease)
        t0 = time.monotonic()
        r = rig.join("next", 0, 1, 40001, slots=16)
        assert 0.2 < time.monotonic() - t0 < 6
        assert r.job_id == crashed.job_id  # its id came free too
        assert rig.svc.removals == {"lease expired": 1}
    finally:
        rig.close()


def test_a_join_that_finds_no_room_beside_healthy_jobs_is_refused_at_once(rig):
    job = join_all(rig, "whole", 1, slots=POOL)[0]
    assert rig.stub.Renew(rig.lease(job.job_id, 0, 40000, job.secret))
    t0 = time.monotonic()
    e = refused(lambda: rig.join("more", 0, 1, 40001, slots=16))
    assert time.monotonic() - t0 < 5
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
