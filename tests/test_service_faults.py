"""The service when its switches fail under it (issue 57): an aggregator killed (SIGKILL) and
started again, a leaf of a tree killed mid-job and brought back. Every switch is a
``homagg-softswitch`` process of its own on loopback (``bench.softprocs``), driven over
P4Runtime as ``homagg-ctl serve`` drives it; the service runs in this process."""

from __future__ import annotations

import os
import re
import threading
import time

import grpc
import pytest

pytest.importorskip("p4runtime_sh")

from bench.softprocs import SoftProcess  # noqa: E402
from homagg.controller import jobs as J  # noqa: E402
from homagg.controller.p4client import P4RuntimeSwitch  # noqa: E402
from homagg.controller.serve import start  # noqa: E402
from homagg.controller.service import JobService, ServeOptions  # noqa: E402
from homagg.membership import pb2, rpc  # noqa: E402
from homagg.netconfig import Config, SwitchSpec, parse  # noqa: E402

SECRET = "the join secret of a job under faults"
NET = 100 + os.getpid() % 100  # (a loopback network of this run's own: 127.57.NET.0/24)


def connect(place):
    return P4RuntimeSwitch(place.grpc, place.device_id, (0, 2), None, place.name).open()


def jobs_on(sp: SoftProcess) -> list[J.InstalledJob]:
    with P4RuntimeSwitch(sp.grpc, 1, (0, 3), None, sp.name).open() as s:
        return J.list_jobs(s)


class Served:
    """A service (``serve.start``) in front of ``cfg``, and a client of it."""

    def __init__(self, cfg: Config, lease: float):
        self.svc = JobService(cfg, connect, ServeOptions(token=None, lease=lease, slots=16,
                                                         key=b"k" * 16,
                                                         trust_claimed_address=True))
        self.srv = start(self.svc, "127.0.0.1:0")
        self.channel = grpc.insecure_channel(self.srv.address)
        self.stub = rpc.MembershipStub(self.channel)

    def join_all(self, name: str, addrs: list[tuple[str, int]], wait: float = 20.0) -> dict:
        """Every rank's Join at once; rank -> reply or RpcError."""
        out: dict = {}

        def one(r):
            try:
                out[r] = self.stub.Join(pb2.JoinRequest(
                    job=name, rank=r, world_size=len(addrs), udp_port=addrs[r][1],
                    ip=addrs[r][0], wait_seconds=wait, join_secret=SECRET), timeout=wait + 10)
            except grpc.RpcError as e:
                out[r] = e

        ts = [threading.Thread(target=one, args=(r,)) for r in range(len(addrs))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(wait + 20)
        assert len(out) == len(addrs), "a join hung"
        return out

    def lease(self, reply, addr: tuple[str, int]) -> pb2.LeaseRequest:
        return pb2.LeaseRequest(job_id=reply.job_id, worker=reply.worker, udp_port=addr[1],
                                ip=addr[0], secret=reply.secret)

    def close(self) -> None:
        self.channel.close()
        self.srv.stop()


def placed(replies: dict) -> None:
    bad = {r: (e.code(), e.details()) for r, e in replies.items() if isinstance(e, grpc.RpcError)}
    assert not bad, bad


def until(what, timeout: float, why: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{why}: not within {timeout:g} s")


def test_a_killed_aggregators_job_name_joins_again_once_it_is_back(tmp_path):
    """The aggregator is killed mid-job; the workers leave (the removal cannot reach it); it
    is started again, empty. The removal is owed, not forgotten: the job's name joins again,
    and nothing is left held."""
    agg = SoftProcess("s1", f"127.57.{NET}.1", tmp_path).start()
    cfg = Config(SwitchSpec(name="s1", grpc=agg.grpc, ip=agg.ip, target="soft"))
    s = Served(cfg, lease=3.0)
    try:
        addrs = [("127.0.0.1", 41000), ("127.0.0.1", 41001)]
        first = s.join_all("again", addrs)
        placed(first)
        agg.kill()
        for r, a in first.items():  # the workers exit: their leaves (or, once the service
            try:                    # noticed the switch died, the reason they are told)
                s.stub.Leave(s.lease(a, addrs[r]), timeout=30)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.NOT_FOUND, e.details()
                assert "switch s1 (" in e.details() and "is unreachable" in e.details()
        agg.start()
        second = s.join_all("again", [("127.0.0.1", 41002)], wait=15.0)
        placed(second)
        assert [j.id for j in jobs_on(agg)] == [second[0].job_id]
        s.stub.Leave(s.lease(second[0], ("127.0.0.1", 41002)), timeout=30)
        until(lambda: not s.svc.owed and not s.svc.held, 10, "a removal still owed")
        assert jobs_on(agg) == []
    finally:
        s.close()
        agg.kill()


def _two_leaves(tmp_path):
    """A spine and two leaves, each a software aggregator process, and their tree config
    (hosts 127.58.1.0/24 under leaf1, 127.58.2.0/24 under leaf2)."""
    sps = {"spine": SoftProcess("spine", f"127.57.{NET}.254", tmp_path).start(),
           "leaf1": SoftProcess("leaf1", f"127.57.{NET}.1", tmp_path).start(),
           "leaf2": SoftProcess("leaf2", f"127.57.{NET}.2", tmp_path).start()}
    cfg = parse({
        "switch": {"name": "spine", "target": "soft", "grpc": sps["spine"].grpc,
                   "ip": sps["spine"].ip},
        "switches": [{"name": f"leaf{i}", "parent": "spine", "ip": sps[f"leaf{i}"].ip,
                      "grpc": sps[f"leaf{i}"].grpc, "under": [f"127.58.{i}.0/24"]}
                     for i in (1, 2)]})
    return sps, cfg


def test_a_killed_leaf_fails_its_job_by_name_frees_the_tree_and_is_taken_back(tmp_path):
    """A 2-leaf job; leaf1 is killed while its workers still renew. Within one lease the job
    fails, its workers told that leaf1 is unreachable, and the spine and leaf2 hold nothing
    of it; a job wholly under leaf2 joins meanwhile, one that needs leaf1 is refused at once,
    naming it. leaf1 started again: a job across both leaves joins, and nothing is owed."""
    lease = 3.0
    sps, cfg = _two_leaves(tmp_path)
    s = Served(cfg, lease=lease)
    stop = threading.Event()
    try:
        addrs = [("127.58.1.1", 20000), ("127.58.2.1", 20000)]
        first = s.join_all("across", addrs)
        placed(first)
        job = first[0].job_id
        assert all([j.id for j in jobs_on(sps[n])] == [job] for n in sps)
        told: dict[int, str] = {}

        def renew(r):  # the workers keep renewing: only the dead leaf may end their job
            while not stop.is_set():
                try:
                    s.stub.Renew(s.lease(first[r], addrs[r]), timeout=10)
                except grpc.RpcError as e:
                    told[r] = f"{e.code().name}: {e.details()}"
                    return
                time.sleep(0.2)

        renewers = [threading.Thread(target=renew, args=(r,)) for r in (0, 1)]
        for t in renewers:
            t.start()
        sps["leaf1"].kill()
        killed = time.monotonic()
        until(lambda: len(told) == 2, lease + 2, "the workers were not told")
        assert time.monotonic() - killed < lease
        for r in (0, 1):  # (told while the removal is under way, or once it is done)
            assert re.match(rf"NOT_FOUND: job {job} \(across\) (was|is being) removed: switch "
                            rf"leaf1 \({sps['leaf1'].grpc}\) is unreachable \(nothing answers "
                            rf"P4Runtime at {sps['leaf1'].grpc}\): job {job} failed$",
                            told[r]), told[r]
        # (its removal may still be under way when they are told: freed within the lease)
        until(lambda: s.svc.owed == {job: ["leaf1"]}, lease, "the removal was not done")
        assert jobs_on(sps["spine"]) == [] and jobs_on(sps["leaf2"]) == []
        assert time.monotonic() - killed < lease
        # a job under leaf2 alone joins meanwhile; one that needs leaf1 is refused at once
        t0 = time.monotonic()
        under2 = s.join_all("under-leaf2", [("127.58.2.2", 20000), ("127.58.2.3", 20000)])
        placed(under2)
        assert under2[0].job_id != job and under2[0].place == "leaf2"
        (refused,) = s.join_all("needs-leaf1", [("127.58.1.2", 20000)]).values()
        assert time.monotonic() - t0 < 5.0
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert "leaf1" in refused.details() and "unreachable" in refused.details()
        # leaf1 back (empty): taken back into placement, what was owed there settled
        sps["leaf1"].start()
        again = s.join_all("across", [("127.58.1.1", 20000), ("127.58.2.1", 20001)], wait=15.0)
        placed(again)
        assert s.svc.owed == {} and s.svc.dead == {}
        assert [j.id for j in jobs_on(sps["leaf1"])] == [again[0].job_id]
    finally:
        stop.set()
        s.close()
        for sp in sps.values():
            sp.kill()


def test_a_dead_idle_leaf_keeps_no_join_waiting(tmp_path):
    """leaf1 holds no job and is killed: once a probe has passed (a third of the lease), a
    job under leaf2 joins at once, not refused once a session to leaf1 timed out
    (UNAVAILABLE after 5 s or more, before)."""
    sps, cfg = _two_leaves(tmp_path)
    s = Served(cfg, lease=3.0)
    try:
        sps["leaf1"].kill()
        time.sleep(2.5)
        t0 = time.monotonic()
        got = s.join_all("under-leaf2", [("127.58.2.1", 20000), ("127.58.2.2", 20000)])
        placed(got)
        assert time.monotonic() - t0 < 4.0  # (a session to the dead leaf waited 5 s, before)
        assert got[0].place == "leaf2"
    finally:
        s.close()
        for sp in sps.values():
            sp.kill()
