"""homagg-ctl serve's service over gRPC, against a software aggregator on loopback.

Workers join by name (raw gRPC requests, or real agents through ``AgentConfig.from_env``);
every refusal of issue 24 is checked for its message and for writing nothing; leases expire;
a restarted service reads its jobs back from the switch and serves them; the CLI keeps
working against the same switch; the metrics move while a job runs. Every port is the
kernel's (port 0); the aggregator has a random loopback address of its own.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest

pytest.importorskip("p4runtime_sh")
pytest.importorskip("prometheus_client")

from homagg.controller.cli import main as ctl  # noqa: E402
from homagg.controller.p4client import P4RuntimeSwitch  # noqa: E402
from homagg.controller.placement import switch_place  # noqa: E402
from homagg.controller.serve import start  # noqa: E402
from homagg.controller.service import SERVICE_JOBS_CELL, JobService, ServeOptions  # noqa: E402
from homagg.host_agent import Agent, AgentConfig, AgentError  # noqa: E402
from homagg.launcher.local import LocalAggregator  # noqa: E402
from homagg.membership import pb2, rpc  # noqa: E402

pytestmark = pytest.mark.slow  # (conftest.py) services, leases and deadlines

TOKEN = "s3cret"


def not_yours(job: int, worker: int, port: int, ip: str = "127.0.0.1") -> str:
    """The one refusal of a lease request that did not prove it is the job's worker."""
    return (f"job {job} worker {worker} at {ip}:{port}: no lease of this service with this "
            "secret (only a job's own workers, from the address and with the secret their "
            "join returned, renew or leave it; a job that is gone, or never was, is refused "
            "alike)")


def secret_of(name: str) -> str:
    """The join secret every rank of job ``name`` presents, in these tests."""
    return f"join-secret-of/{name}"


KEY = b"the job secrets' key, kept in a --key-file"
POOL = 128


def connect(place):
    return P4RuntimeSwitch(place.grpc, place.device_id, (0, 2), None, place.name).open()


class Rig:
    """A software aggregator (pool of POOL slots), and the service in front of it."""

    def __init__(self, tmp_path, lease: float = 30.0, **opts):
        self.tmp = tmp_path
        self.agg = LocalAggregator(slots=POOL, workdir=tmp_path).start()
        self.opts = ServeOptions(token=TOKEN, lease=lease, slots=16, **{"key": KEY, **opts})
        self.srv = None
        self.serve("127.0.0.1:0")

    def serve(self, listen: str, metrics: bool = False):
        self.svc = JobService(self.agg.config, connect, self.opts)
        self.srv = start(self.svc, listen, metrics_port=0 if metrics else None,
                         metrics_addr="127.0.0.1")
        self.channel = grpc.insecure_channel(self.srv.address)
        self.stub = rpc.MembershipStub(self.channel)
        return self.srv

    def stop_service(self):
        self.channel.close()
        self.srv.stop()

    def close(self):
        self.stop_service()
        self.agg.stop()

    def jobs(self) -> list[dict]:
        """``homagg-ctl job list --json``: the switch's own table."""
        return self.ctl_json("job", "list", "--json")

    def ctl_json(self, *args):
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert ctl(["-c", str(self.agg.path), *args]) == 0
        return json.loads(out.getvalue())

    def join(self, name, rank, world, port, token=TOKEN, **kw):
        kw.setdefault("join_secret", secret_of(name))
        return self.stub.Join(pb2.JoinRequest(token=token, job=name, rank=rank, world_size=world,
                                              udp_port=port, **kw), timeout=30)

    def lease(self, job_id: int, worker: int, port: int, secret: str,
              token: str = TOKEN) -> pb2.LeaseRequest:
        return pb2.LeaseRequest(token=token, job_id=job_id, worker=worker, udp_port=port,
                                secret=secret)

    def env(self, name: str, rank: int, world: int) -> dict:
        return {"HOMAGG_CONTROLLER": self.srv.address, "HOMAGG_TOKEN": TOKEN, "RANK": str(rank),
                "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": name, "HOMAGG_JOIN_SECRET": secret_of(name)}


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def join_all(rig: Rig, name: str, world: int, ports=None, **kw) -> dict:
    """Every rank's Join at once, from threads; rank -> reply or RpcError."""
    out: dict = {}

    def one(rank):
        try:
            out[rank] = rig.join(name, rank, world, (ports or range(40000, 40100))[rank], **kw)
        except grpc.RpcError as e:
            out[rank] = e

    ts = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert len(out) == world, "a join hung"
    return out


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


# -- joins --------------------------------------------------------------------------------

def test_every_rank_gets_the_same_job_and_the_switch_holds_it(rig):
    replies = join_all(rig, "10.0.0.1:29500/none", 3)
    assert all(not isinstance(r, grpc.RpcError) for r in replies.values()), replies
    ids = {r.job_id for r in replies.values()}
    runs = {r.run for r in replies.values()}
    assert len(ids) == 1 and len(runs) == 1 and runs != {0}
    # the job's key: one for the job, drawn at random, and the switch checks it
    keys = {r.key for r in replies.values()}
    assert len(keys) == 1 and keys != {0}
    place = switch_place(rig.agg.config)
    sw = P4RuntimeSwitch(place.grpc, place.device_id, (0, 1), None, place.name).open()
    try:
        from homagg.controller import jobs as J

        (installed,) = J.list_jobs(sw)
        assert installed.key == keys.pop()
    finally:
        sw.close()
    other = join_all(rig, "10.0.0.2:29500/none", 1, ports=[41000])
    assert other[0].key not in (0, installed.key)  # (1 in 2**32 to fail by chance)
    rig.stub.Leave(rig.lease(other[0].job_id, 0, 41000, other[0].secret))
    for rank, r in replies.items():
        assert (r.worker, r.workers, r.slots, r.place, r.place_role, r.ip) == \
            (rank, 3, 16, "local", "switch", "127.0.0.1")
        assert (r.send_to_ip, r.send_to_port) == (rig.agg.config.switch.ip, 0xBEE0)
    (job,) = rig.jobs()
    assert job["id"] == ids.pop()
    assert [(w["ip"], w["udp_port"]) for w in job["workers"]] == \
        [("127.0.0.1", 40000 + r) for r in range(3)]
    # the last to leave removes it
    for rank in range(3):
        r = rig.stub.Leave(rig.lease(job["id"], rank, 40000 + rank, replies[rank].secret))
        assert r.removed == (rank == 2)
    assert rig.jobs() == []


def test_agents_join_from_the_environment_and_sum_exactly(rig):
    """The agent's side: from_env with HOMAGG_CONTROLLER and torch's variables, an ephemeral
    port, the run from the service; sums bit for bit; closing leaves (the job is gone)."""
    world, errors, cfgs = 3, [], {}

    def worker(rank):
        try:
            cfg = AgentConfig.from_env(rig.env("agents", rank, world), deadline=20.0)
            cfgs[rank] = cfg
            with Agent(cfg) as agent:
                for it in range(3):
                    xs = [np.random.default_rng([it, w]).integers(-2**20, 2**20, 5000)
                          .astype(np.int32) for w in range(world)]
                    got = agent.allreduce_int(xs[rank])
                    assert np.array_equal(got, np.sum(xs, axis=0, dtype=np.int64)), it
        except BaseException as e:
            errors.append((rank, e))

    ts = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(90)
    assert not any(t.is_alive() for t in ts), "an agent hung"
    assert not errors, errors
    assert sorted(c.worker for c in cfgs.values()) == [0, 1, 2]
    assert len({c.run for c in cfgs.values()}) == 1 and cfgs[0].run != 0
    assert len({c.bind for c in cfgs.values()}) == 3
    assert all(c.bind[1] != 0 for c in cfgs.values())
    assert rig.jobs() == []


def test_several_jobs_join_at_once_each_placed_on_its_own(rig):
    out: dict = {}
    ts = [threading.Thread(target=lambda n=n: out.__setitem__(
        n, join_all(rig, f"job-{n}", 2, ports=[41000 + 10 * n, 41001 + 10 * n])))
        for n in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    ids = {n: {r.job_id for r in replies.values()} for n, replies in out.items()}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v.pop() for v in ids.values()}) == 3
    jobs = rig.jobs()
    regions = sorted((j["slot_base"], j["slots"]) for j in jobs)
    assert regions == [(0, 16), (16, 16), (32, 16)]


# -- refusals: each says what is wrong, and nothing is written ---------------------------------

def assert_nothing_written(rig):
    assert rig.jobs() == []


def test_a_wrong_token_is_refused(rig):
    e = refused(lambda: rig.join("j", 0, 1, 40000, token="guess"))
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED
    assert e.details() == ("wrong token (HOMAGG_TOKEN must be the one homagg-ctl serve was "
                           "given)")
    assert_nothing_written(rig)


def test_a_world_size_that_differs_names_both(rig):
    waiting = threading.Thread(target=lambda: refused(
        lambda: rig.join("j", 0, 4, 40000, wait_seconds=10)))
    waiting.start()
    deadline = time.monotonic() + 10
    while "j" not in rig.svc._pending and time.monotonic() < deadline:
        time.sleep(0.01)  # the first join must be pending first
    e = refused(lambda: rig.join("j", 1, 3, 40001))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details() == ("job 'j': rank 1 joins with world size 3, but rank 0 joined with "
                           "world size 4")
    waiting.join(30)
    assert_nothing_written(rig)


def test_a_rank_out_of_range_is_refused(rig):
    e = refused(lambda: rig.join("j", 4, 4, 40000))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details() == "job 'j': rank 4 is out of range for world size 4 (ranks 0 to 3)"
    assert_nothing_written(rig)


def test_a_rank_taken_by_another_address_is_refused(rig):
    t = threading.Thread(target=lambda: refused(
        lambda: rig.join("j", 0, 2, 40000, wait_seconds=10)))
    t.start()
    deadline = time.monotonic() + 10
    while "j" not in rig.svc._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    e = refused(lambda: rig.join("j", 0, 2, 40005))
    assert e.code() == grpc.StatusCode.ALREADY_EXISTS
    assert e.details() == ("job 'j': rank 0 is taken by 127.0.0.1:40000 (this join: "
                           "127.0.0.1:40005)")
    t.join(30)
    assert_nothing_written(rig)


def test_a_job_that_fits_nowhere_says_what_is_free_where(rig):
    e = refused(lambda: rig.join("big", 0, 1, 40000, slots=POOL + 1))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # more than the pool holds
    assert e.details() == ("job 'big' (1 workers, 129 slots) fits nowhere: local (switch) has "
                           f"{POOL} of {POOL} slots free")
    replies = join_all(rig, "most", 1, slots=POOL - 8)
    assert not isinstance(replies[0], grpc.RpcError)
    e = refused(lambda: rig.join("next", 0, 1, 40050, slots=16))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.details() == ("job 'next' (1 workers, 16 slots) fits nowhere: local (switch) has "
                           f"8 of {POOL} slots free")
    assert [j["slots"] for j in rig.jobs()] == [POOL - 8]  # only the first


def test_missing_ranks_are_named_before_the_deadline(rig):
    t0 = time.monotonic()
    e = refused(lambda: rig.join("j", 1, 4, 40001, wait_seconds=1.0))
    assert time.monotonic() - t0 < 10
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert e.details() == ("job 'j': ranks 0, 2, 3 of world size 4 did not join within 1 s "
                           "(joined: 1 from 127.0.0.1:40001)")
    # and from the agent's side, the same words, never a hang
    with pytest.raises(AgentError, match=r"ranks 0, 2 of world size 3 did not join within 1 s"):
        AgentConfig.from_env({**rig.env("lonely", 1, 3), "HOMAGG_JOIN_TIMEOUT": "1"})
    assert_nothing_written(rig)


def test_a_worker_registers_only_the_address_it_speaks_from(rig):
    e = refused(lambda: rig.join("j", 0, 1, 40000, ip="10.9.9.9"))
    assert e.code() == grpc.StatusCode.PERMISSION_DENIED
    assert e.details() == ("a worker registers only the address it speaks from: it claims "
                           "'10.9.9.9', and speaks from 127.0.0.1")
    assert_nothing_written(rig)


def test_the_token_can_be_turned_off_only_explicitly(tmp_path):
    from homagg.controller.serve import token_from
    from homagg.errors import ConfigError

    with pytest.raises(ConfigError, match="a token is required"):
        token_from(None, False, {})
    assert token_from(None, True, {"HOMAGG_TOKEN": "x"}) is None
    assert token_from(None, False, {"HOMAGG_TOKEN": "x"}) == "x"
    f = tmp_path / "token"
    f.write_text("abc\n")
    assert token_from(f, False, {}) == "abc"


# -- leases, restarts, the CLI alongside --------------------------------------------------------

def test_the_clis_json_stays_json_while_another_client_is_primary(tmp_path):
    """A listing is a read: as a backup session it works, and says so to the log only (p4runtime-
    shell printed "You are not the primary client" on stdout, before the JSON)."""
    agg = LocalAggregator(slots=POOL, workdir=tmp_path).start()
    place = switch_place(agg.config)
    held = P4RuntimeSwitch(place.grpc, place.device_id, (0, 99), None, place.name).open()
    try:
        assert held.client.primary
        out = subprocess.run([sys.executable, "-m", "homagg.controller.cli", "-c", str(agg.path),
                              "job", "list", "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == []
    finally:
        held.close()
        agg.stop()


def test_another_controller_taking_primary_is_not_silent(tmp_path):
    """Whoever reaches the switch's P4Runtime can take primary with a higher election id (TLS
    keeps them out): the service's writes are then refused, and its refusals say by whom."""
    rig = Rig(tmp_path)
    try:
        place = switch_place(rig.agg.config)
        with P4RuntimeSwitch(place.grpc, place.device_id, (0, 9), None, place.name).open():
            (r,) = join_all(rig, "usurped", 1).values()
            assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.UNAVAILABLE
            assert "another controller is primary (election id 0,9, above this one's 0,2)" in \
                r.details(), r.details()
            assert rig.jobs() == []
        # once it leaves, the service writes again
        (r,) = join_all(rig, "usurped", 1).values()
        assert not isinstance(r, grpc.RpcError), r
    finally:
        rig.close()


def test_a_job_whose_worker_stops_renewing_is_removed(tmp_path):
    rig = Rig(tmp_path, lease=1.0)
    try:
        replies = join_all(rig, "j", 2)
        job = replies[0].job_id
        # worker 0 renews, worker 1 is silent: the job goes within its lease (plus a check)
        t0 = time.monotonic()
        while rig.jobs() and time.monotonic() - t0 < 10:
            try:
                rig.stub.Renew(rig.lease(job, 0, 40000, replies[0].secret))
            except grpc.RpcError as e:  # being removed (it is still listed a moment)
                assert e.code() == grpc.StatusCode.NOT_FOUND
                assert e.details().startswith(f"job {job} (j) is being removed: its lease ran"), \
                    e.details()
            time.sleep(0.2)
        assert rig.jobs() == []
        assert time.monotonic() - t0 < 1.0 + 1.0 + 2.0  # lease + reaper period + slack
        assert rig.svc.removals == {"lease expired": 1}
        e = refused(lambda: rig.stub.Renew(rig.lease(job, 0, 40000, replies[0].secret)))
        assert e.code() == grpc.StatusCode.NOT_FOUND
        assert e.details() == (f"job {job} (j) was removed: its lease ran out: worker 1 "
                               "(127.0.0.1:40001) stopped renewing within 1 s")
        # the slots are free again: a job of the whole pool fits
        assert not isinstance(join_all(rig, "whole", 1, slots=POOL)[0], grpc.RpcError)
    finally:
        rig.close()


def test_a_restarted_service_reads_its_jobs_back_and_leaves_the_clis_alone(tmp_path):
    rig = Rig(tmp_path)
    try:
        # a job of the operator's, by the CLI, while the service runs
        cfg = tmp_path / "ops.toml"
        cfg.write_text(rig.agg.path.read_text() + '\n[[hosts]]\nname = "h1"\nip = "127.0.0.9"\n'
                       'mac = "00:00:0a:00:00:09"\nport = 9\n\n[[jobs]]\nid = 40\nslots = 8\n'
                       'key = 0x40404040\n'
                       'workers = [ { host = "h1", udp_port = 45000 } ]\n')
        assert ctl(["-c", str(cfg), "job", "add", "40"]) == 0
        replies = join_all(rig, "served", 2)
        job = replies[0].job_id
        addr = rig.srv.address
        rig.stop_service()
        rig.serve(addr)  # the same address: the workers' HOMAGG_CONTROLLER
        assert sorted(rig.svc.held) == [job]      # its own job, not the CLI's
        r = rig.stub.Renew(rig.lease(job, 1, 40001, replies[1].secret))
        assert r.lease_seconds == 30.0
        # a stranger cannot renew (or end) another's lease
        e = refused(lambda: rig.stub.Leave(rig.lease(job, 1, 40009, replies[1].secret)))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        # the secrets outlive the restart (the same --key-file): without one, refused
        e = refused(lambda: rig.stub.Leave(rig.lease(job, 1, 40001, "")))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        for w in range(2):
            rig.stub.Leave(rig.lease(job, w, 40000 + w, replies[w].secret))
        assert [j["id"] for j in rig.jobs()] == [40]
        with P4RuntimeSwitch(rig.agg.config.switch.grpc, 1, (0, 3)).open() as sw:
            from homagg import _p4consts as P4

            assert sw.read_counter(P4.COUNTER_STATS)[SERVICE_JOBS_CELL].packets == 0
        assert ctl(["-c", str(cfg), "job", "remove", "40"]) == 0
    finally:
        rig.close()


def test_the_service_restarted_during_a_run_the_run_completes_and_the_next_join_is_served(
        tmp_path):
    rig = Rig(tmp_path, lease=1.5)
    world, errors, done = 2, [], [0, 0]
    restarted = threading.Event()

    def worker(rank):
        try:
            cfg = AgentConfig.from_env(rig.env("run", rank, world), deadline=20.0)
            with Agent(cfg) as agent:
                it, votes = 0, 0
                # keep going until the service is back and has renewed every worker's lease:
                # each votes in the sum's last word, so all stop after the same round
                while votes < world:
                    xs = [np.full(3000, it * 7 + w, np.int32) for w in range(world)]
                    xs[rank][-1] = restarted.is_set() and rig.svc.renewed >= 2 * world
                    got = agent.allreduce_int(xs[rank])
                    votes = int(got[-1])
                    assert np.array_equal(got[:-1], np.sum(xs, axis=0, dtype=np.int64)[:-1])
                    it += 1
                    done[rank] = it
                    assert it < 100000
        except BaseException as e:
            errors.append((rank, e))

    try:
        ts = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
        for t in ts:
            t.start()
        while min(done) < 3 and not errors:
            time.sleep(0.01)
        addr = rig.srv.address
        rig.stop_service()
        during = min(done)
        while min(done) < during + 5 and not errors:  # the data path goes on without it
            time.sleep(0.01)
        rig.serve(addr)
        assert len(rig.svc.held) == 1
        restarted.set()
        for t in ts:
            t.join(60)
        assert not any(t.is_alive() for t in ts), "an agent hung"
        assert not errors, errors
        assert rig.svc.renewed >= 2 * world  # the restarted service kept the leases
        assert rig.jobs() == []  # both left through the restarted service
        assert not isinstance(join_all(rig, "next", 1)[0], grpc.RpcError)
    finally:
        restarted.set()
        rig.close()


# -- metrics ---------------------------------------------------------------------------------

def scrape(port: int) -> str:
    """The metrics page, by curl as an operator would (urllib where curl is missing)."""
    url = f"http://127.0.0.1:{port}/metrics"
    curl = shutil.which("curl")
    if curl:
        return subprocess.run([curl, "-sSf", url], capture_output=True, text=True, check=True,
                              timeout=30).stdout
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def metric(text: str, metric_name: str, **labels) -> float | None:
    for line in text.splitlines():
        m = re.match(rf"{metric_name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return None


def test_metrics_show_the_jobs_counters_moving_during_a_run(tmp_path):
    rig = Rig(tmp_path, metrics_job_names=True)  # names shown only when asked: next test
    rig.stop_service()
    rig.serve("127.0.0.1:0", metrics=True)
    port = rig.srv.metrics_port
    world, errors, rounds = 2, [], 3
    # the workers wait after each round (arrived) until the scrape is done (resume)
    arrived, resume = (threading.Barrier(world + 1, timeout=60) for _ in range(2))
    name = "127.0.0.1:29500/metered"

    def worker(rank):
        try:
            with Agent(AgentConfig.from_env(rig.env("metered", rank, world),
                                            deadline=20.0)) as agent:
                for _ in range(rounds):
                    agent.allreduce_int(np.full(4096, rank, np.int32))
                    arrived.wait()
                    resume.wait()
        except BaseException as e:
            errors.append(e)
            arrived.abort()

    try:
        ts = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
        for t in ts:
            t.start()
        seen = []
        for _ in range(rounds):
            arrived.wait()
            text = scrape(port)
            resume.wait()
            (job,) = rig.svc.held
            seen.append([metric(text, f"homagg_job_{m}_total", switch="local", job=job,
                                name=name)
                         for m in ("packets_accepted", "rounds_completed")])
            assert metric(text, "homagg_slots", switch="local", state="used") == 16
            assert metric(text, "homagg_slots", switch="local", state="free") == POOL - 16
        for t in ts:
            t.join(60)
        assert not errors, errors
        # every round adds the same: 4096 words in packets of K, from each worker
        accepted = [a for a, _ in seen]
        assert accepted[0] > 0 and accepted[1] - accepted[0] == accepted[2] - accepted[1] > 0
        completed = [c for _, c in seen]
        assert completed[0] > 0 and completed[2] > completed[1] > completed[0]
        assert accepted[0] == world * completed[0]  # every worker's packet of every slot use
        text = scrape(port)  # the job has left: its slots are free, its removal counted
        assert metric(text, "homagg_service_removals_total", why="every worker left") == 1
        assert metric(text, "homagg_slots", switch="local", state="free") == POOL
    finally:
        arrived.abort()
        resume.abort()
        rig.close()


def test_a_workers_address_is_the_peer_gRPC_sees():
    from homagg.controller.service import Refusal, peer_ip

    assert peer_ip("ipv4:10.0.0.7:41234") == "10.0.0.7"
    assert peer_ip("ipv6:[::1]:5000") == "::1"
    assert peer_ip("ipv6:%5B::ffff:10.0.0.7%5D:5000") == "10.0.0.7"
    with pytest.raises(Refusal, match="not a unix socket"):
        peer_ip("unix:/tmp/x")


def test_the_grafana_dashboard_uses_only_metrics_the_service_exposes(tmp_path):
    from pathlib import Path

    board = json.loads((Path(__file__).resolve().parents[1] / "controller" / "grafana"
                        / "homagg-dashboard.json").read_text())
    used = {m for p in board["panels"] for t in p["targets"]
            for m in re.findall(r"homagg_[a-z_]+", t["expr"])}
    rig = Rig(tmp_path)
    try:
        rig.stop_service()
        rig.serve("127.0.0.1:0", metrics=True)
        join_all(rig, "shown", 1)  # a job, so that the per-job families have samples
        text = scrape(rig.srv.metrics_port)
    finally:
        rig.close()
    # every family the service declares, samples or not (a counter's samples are NAME_total;
    # prometheus_client's TYPE line names it so, as OpenMetrics would not)
    exposed = {n if kind != "counter" or n.endswith("_total") else n + "_total"
               for n, kind in re.findall(r"^# TYPE (homagg_[a-z_]+) (\w+)$", text, re.M)}
    assert len(used) >= 10 and used <= exposed, used - exposed


def test_an_agent_claims_its_HOMAGG_BIND_address_which_needs_the_operators_leave(tmp_path):
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1",
           "HOMAGG_TOKEN": TOKEN, "HOMAGG_BIND": "127.0.0.2", "HOMAGG_JOIN_TIMEOUT": "10",
           "HOMAGG_JOIN_SECRET": secret_of("bind")}
    rig = Rig(tmp_path)
    try:
        with pytest.raises(AgentError, match="it claims '127.0.0.2', and speaks from 127.0.0.1"):
            AgentConfig.from_env({**env, "HOMAGG_CONTROLLER": rig.srv.address})
        assert rig.jobs() == []
        rig.stop_service()
        rig.opts = ServeOptions(token=TOKEN, lease=30.0, slots=16, trust_claimed_address=True)
        rig.serve("127.0.0.1:0")
        cfg = AgentConfig.from_env({**env, "HOMAGG_CONTROLLER": rig.srv.address})
        with Agent(cfg) as agent:
            assert cfg.bind[0] == "127.0.0.2"
            (job,) = rig.jobs()
            assert [w["ip"] for w in job["workers"]] == ["127.0.0.2"]
            got = agent.allreduce_int(np.arange(300, dtype=np.int32))
            assert np.array_equal(got, np.arange(300))
        assert rig.jobs() == []
    finally:
        rig.close()


def test_a_new_attempt_of_a_job_is_placed_once_the_old_ones_leases_lapse(tmp_path):
    """An elastic restart: every rank of the same job joins again (new ports) while the old
    attempt, whose workers died, is still placed; the join waits for the old one's leases to
    run out, then the new attempt is placed with a new run number."""
    rig = Rig(tmp_path, lease=1.0)
    try:
        old = join_all(rig, "elastic", 2)
        t0 = time.monotonic()
        new = join_all(rig, "elastic", 2, ports=[42000, 42001])
        waited = time.monotonic() - t0
        assert all(not isinstance(r, grpc.RpcError) for r in new.values()), new
        assert {r.run for r in new.values()} != {old[0].run}
        assert 0.5 < waited < 1.0 + 1.0 + 3.0, waited  # the lease (+ a reaper pass, slack)
        (job,) = rig.jobs()
        assert [w["udp_port"] for w in job["workers"]] == [42000, 42001]
        # the old one's id was freed first, and is the lowest free: the new attempt has it;
        # the old workers' leases are no longer theirs
        assert new[0].job_id == old[0].job_id == job["id"]
        e = refused(lambda: rig.stub.Renew(rig.lease(old[0].job_id, 0, 40000, old[0].secret)))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED
        assert e.details() == not_yours(job["id"], 0, 40000)
        assert rig.svc.removals == {"lease expired": 1}
    finally:
        rig.close()


def test_a_join_by_name_cannot_replace_a_running_job(rig):
    """Another token holder who knows a running job's name (a log, a guess) joins by it: the
    running job, whose workers renew, stays; the join is refused, naming it."""
    old = join_all(rig, "victim", 2)
    stop = threading.Event()

    def renew():
        while not stop.wait(0.2):
            for w in range(2):
                rig.stub.Renew(rig.lease(old[w].job_id, w, 40000 + w, old[w].secret))

    t = threading.Thread(target=renew)
    t.start()
    try:
        got = join_all(rig, "victim", 2, ports=[43000, 43001], wait_seconds=2.0)
    finally:
        stop.set()
        t.join()
    for r in got.values():
        assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.ALREADY_EXISTS, r
        # (nothing of the running job: whoever joins by its name need not be its own)
        assert r.details().startswith("job 'victim' is still running (its workers renew their "
                                      "leases): a join cannot replace it"), r.details()
    (job,) = rig.jobs()
    assert [w["udp_port"] for w in job["workers"]] == [40000, 40001]
    assert rig.svc.removals == {}


def test_another_token_holder_can_neither_renew_nor_end_a_job(rig):
    """The ports of a job's workers are public (/proc/net/udp, the P4Runtime job table): with
    the token and the right address but without the job's secret, Renew and Leave are
    refused, and the job stays."""
    replies = join_all(rig, "mine", 2)
    job = replies[0].job_id
    for secret in ("", "0" * 32, replies[1].secret):  # worker 1's secret is not worker 0's
        for call in (rig.stub.Renew, rig.stub.Leave):
            e = refused(lambda call=call, secret=secret: call(rig.lease(job, 0, 40000, secret)))
            assert e.code() == grpc.StatusCode.PERMISSION_DENIED
            assert e.details() == not_yours(job, 0, 40000)
    assert [j["id"] for j in rig.jobs()] == [job]
    assert rig.stub.Leave(rig.lease(job, 0, 40000, replies[0].secret)).removed is False
    assert rig.stub.Leave(rig.lease(job, 1, 40001, replies[1].secret)).removed is True
    assert rig.jobs() == []


def test_a_job_the_switch_has_no_room_for_falls_back_and_fits_nowhere_names_both(tmp_path):
    import dataclasses

    from homagg.netconfig import Config, FallbackSpec

    fb = LocalAggregator(workdir=tmp_path / "fb").start()
    rig = Rig(tmp_path)
    try:
        rig.stop_service()
        sw = dataclasses.replace(rig.agg.config.switch, slots=16)
        rig.agg.config = Config(sw, fallback=FallbackSpec(name="fb", ip=fb.config.switch.ip,
                                                          grpc=fb.config.switch.grpc))
        rig.serve("127.0.0.1:0")
        first = join_all(rig, "first", 1)[0]
        assert (first.place, first.place_role, first.send_to_ip) == \
            ("local", "switch", rig.agg.config.switch.ip)
        # the second goes to the fallback, and its agents sum there, exactly
        world, errors, cfgs = 2, [], []

        def worker(rank):
            try:
                cfg = AgentConfig.from_env(rig.env("second", rank, world), deadline=20.0)
                cfgs.append(cfg)
                with Agent(cfg) as agent:
                    got = agent.allreduce_int(np.full(1000, rank + 5, np.int32))
                    assert np.array_equal(got, np.full(1000, 11))
            except BaseException as e:
                errors.append(e)

        ts = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errors, errors
        assert {c.switch for c in cfgs} == {(fb.config.switch.ip, 0xBEE0)}
        held = join_all(rig, "held", 1, ports=[40060])[0]
        assert held.place == "fb"
        e = refused(lambda: rig.join("third", 0, 1, 40070, slots=1024))
        assert e.details() == ("job 'third' (1 workers, 1024 slots) fits nowhere: local (switch) "
                               "has 0 of 16 slots free; fb (fallback) has 1008 of 1024 slots "
                               "free")
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        rig.close()
        fb.stop()


def test_on_bmv2_a_worker_must_be_a_host_of_the_config_whose_port_and_mac_are_written():
    """The bmv2 branch (the same controller code, an in-process switch here): bmv2 needs each
    worker's switch port and MAC, which only the config's [[hosts]] know."""
    from homagg import _p4consts as P4
    from homagg.controller.local import LocalSwitch
    from homagg.controller.service import Refusal
    from homagg.netconfig import parse
    from homagg.targets.soft import SoftSwitch

    cfg = parse({"switch": {"target": "bmv2"},
                 "hosts": [{"name": f"h{i}", "ip": f"10.0.0.{i}", "mac": f"00:00:0a:00:00:0{i}",
                            "port": i} for i in (1, 2)]})
    fake = LocalSwitch(SoftSwitch())
    svc = JobService(cfg, lambda place: fake, ServeOptions(token=None, slots=8))
    with pytest.raises(Refusal, match=r"^10\.0\.0\.9 is not one of the config's hosts: the "
                                      r"switch \(s1, bmv2\) needs each worker's switch port and "
                                      r"MAC \(\[\[hosts\]\]\)$"):
        svc.join("j", 0, 2, "10.0.0.9", 50000, secret=secret_of("j"))
    assert svc._pending == {} and fake.read(P4.TABLE_JOB_WORKERS) == []
    answers = {}
    ts = [threading.Thread(target=lambda r=r: answers.__setitem__(
        r, svc.join("j", r, 2, f"10.0.0.{r + 1}", 50000 + r, secret=secret_of("j"))))
        for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert answers[0].job_id == answers[1].job_id == 1
    workers = sorted((e.match["src_port"], e.params["port"], e.params["worker"])
                     for e in fake.read(P4.TABLE_JOB_WORKERS))
    assert workers == [(50000, 1, 0), (50001, 2, 1)]
    assert fake.read_multicast_groups() == {2: [(1, 1), (2, 2)]}
    dst = sorted((e.match["rid"], e.params["mac"]) for e in fake.read(P4.TABLE_RESULT_DST))
    assert dst == [(1, 0x00000a000001), (2, 0x00000a000002)]
    assert fake.read_counter(P4.COUNTER_STATS)[SERVICE_JOBS_CELL].packets == 1 << 1


def test_a_join_whose_caller_went_away_is_withdrawn(rig):
    """A rank that dies while its join waits does not keep its rank: another may take it."""
    fut = rig.stub.Join.future(pb2.JoinRequest(token=TOKEN, job="j", rank=0, world_size=2,
                                               udp_port=40000, wait_seconds=30,
                                               join_secret=secret_of("j")), timeout=60)
    deadline = time.monotonic() + 10
    while not rig.svc._pending.get("j") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rig.svc._pending["j"].ranks == {0: ("127.0.0.1", 40000)}
    fut.cancel()
    while rig.svc._pending.get("j") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "j" not in rig.svc._pending
    e = refused(lambda: rig.join("j", 0, 2, 40005, wait_seconds=0.5))
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert e.details().endswith("(joined: 0 from 127.0.0.1:40005)")


def test_a_join_tries_a_restarting_service_again_and_tells_its_refusals_from_silence(
        rig, monkeypatch):
    from homagg.host_agent import membership

    addr = rig.srv.address
    rig.stop_service()
    retrying = threading.Event()
    real_sleep = time.sleep

    def sleep(s):  # the join's backoff: the service is down, and the agent knows it
        retrying.set()
        real_sleep(s)

    monkeypatch.setattr(membership.time, "sleep", sleep)
    got: dict = {}

    def joiner():
        try:
            got["cfg"] = AgentConfig.from_env({**rig.env("late", 0, 1), "HOMAGG_CONTROLLER": addr,
                                              "HOMAGG_JOIN_RETRY": "30"})
        except BaseException as e:
            got["error"] = e

    t = threading.Thread(target=joiner)
    t.start()
    assert retrying.wait(30)
    rig.serve(addr)
    t.join(60)
    assert "error" not in got, got
    cfg = got["cfg"]
    assert cfg.workers == 1 and [j["id"] for j in rig.jobs()] == [cfg.job]
    cfg.membership.leave()
    # the service's own UNAVAILABLE (its switch is down) is its refusal, quoted as such
    rig.agg.p4rt.stop()
    with pytest.raises(AgentError, match=r"the controller refused the join \(UNAVAILABLE\): "
                                         r"job '127\.0\.0\.1:29500/down': switch local "
                                         r"unreachable"):
        AgentConfig.from_env({**rig.env("down", 0, 1), "HOMAGG_JOIN_RETRY": "0"})
