"""The software aggregator on several cores (homagg.targets.soft.shards): jobs through a sharded
aggregator sum bit for bit as through one process, its counters are the shards' summed, and
the control plane reaches every shard."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from homagg import _p4consts as P4
from homagg import wire
from homagg.controller import jobs
from homagg.controller.local import LocalSwitch, install
from homagg.faults import FaultSpec
from homagg.host_agent import Agent, AgentConfig
from homagg.targets.soft import SoftSwitchServer
from homagg.targets.soft.server import SoftSwitchError
from homagg.targets.soft.shards import ShardedSwitch, steering_program
from tests import test_tree
from tests.staging import agent_addresses, job_key
from tests.test_agent import assert_exact, run_agents, sparse_tensors

pytestmark = pytest.mark.slow  # (conftest.py) aggregator processes, one per shard

PORT = wire.HOMAGG_UDP_PORT_MIN
_ips = itertools.count(2)


class Jobs:
    """A sharded aggregator on its own loopback address and ``jobs`` jobs of ``workers``
    agents each (jobs 1, 2, ...), one thread per agent."""

    def __init__(self, jobs=3, workers=3, shards=2, slots=16, faults=None, **agent_kw):
        self.ip = f"127.0.3.{next(_ips)}"
        self.sw = ShardedSwitch(shards=shards)
        self.server = SoftSwitchServer(self.sw, (self.ip, PORT), faults).start()
        kw = dict(timeout=0.01, deadline=10.0)
        kw.update(agent_kw)
        self.agents = []
        for j in range(1, jobs + 1):
            addrs = agent_addresses(workers)
            install(self.sw, j, addrs, slots)
            self.agents += [Agent(AgentConfig(job=j, worker=w, workers=workers,
                                              switch=(self.ip, PORT), bind=addrs[w],
                                              slots=slots, **kw)) for w in range(workers)]
        self.workers = workers

    def run(self, fn):
        return run_agents(self.agents, fn)

    def per_shard(self):
        """Every shard's own (stats, job_stats)."""
        with self.sw.lock:
            return [(s, j) for s, j, _ in self.sw._call([("counts",)] * self.sw.shards)]

    def close(self):
        for a in self.agents:
            a.close()
        self.server.stop()


@pytest.fixture
def make_jobs():
    yield from test_tree.closing_factory(Jobs)


def test_jobs_through_two_shards_are_the_integer_sum_and_counters_are_summed(make_jobs):
    js = make_jobs(jobs=3, workers=3)
    assert sorted(js.sw.owner.values()) == [0, 0, 1]  # spread: the fewest jobs first
    rng = np.random.default_rng(1)
    qs = [rng.integers(-(2**29), 2**29, 4000).astype(np.int32) for _ in js.agents]
    res, err = js.run(lambda a, i: a.allreduce_int(qs[i]))
    assert not any(err), err
    for i, r in enumerate(res):
        job = i // js.workers
        np.testing.assert_array_equal(
            r, np.sum(qs[job * js.workers:(job + 1) * js.workers], axis=0, dtype=np.int64))
    # every shard took its jobs' packets and no other's
    shards = js.per_shard()
    stats = js.sw.read_stats()
    for j in (1, 2, 3):
        base = j * wire.JOB_STATS_PER_JOB + wire.JOB_STAT_ACCEPTED
        mine = js.sw.owner[j]
        assert shards[mine][1][base] > 0
        assert all(s[1][base] == 0 for k, s in enumerate(shards) if k != mine)
        assert stats["jobs"][j]["JOB_STAT_ACCEPTED"]["packets"] == shards[mine][1][base]
    rx = wire.STAT_INDEX["STAT_RX"]
    assert stats["switch"]["STAT_RX"] == sum(int(s[0][rx]) for s in shards) > 0
    for name, n in stats["switch"].items():
        if name.startswith("DROP_"):
            assert n == 0, name
    # the P4Runtime view (a counter read) is the same sum; so are the sockets' counts
    cells = js.sw.read_counter(P4.COUNTER_STATS)
    assert cells[rx][0] == stats["switch"]["STAT_RX"]
    assert js.server.io_counts()["received"] == stats["switch"]["STAT_RX"]
    js.server.stop()  # the last counters stay readable
    assert js.sw.read_stats()["switch"]["STAT_RX"] == stats["switch"]["STAT_RX"]


def test_float_allreduce_through_shards_with_loss_duplication_and_reordering(make_jobs):
    js = make_jobs(jobs=2, workers=4, faults=FaultSpec(loss=0.05, dup=0.05, reorder=0.1,
                                                        seed=3))
    rng = np.random.default_rng(3)
    xs = sparse_tensors(rng, 8, 30_000, 0.01)
    res, err = js.run(lambda a, i: a.allreduce_detailed(xs[i]))
    assert not any(err), err
    assert_exact(res[:4], xs[:4])
    assert_exact(res[4:], xs[4:])
    assert sum(a.counters.retransmissions for a in js.agents) > 0


def test_resets_counter_writes_and_a_pipeline_load_reach_every_shard(make_jobs):
    js = make_jobs(jobs=2, workers=2)
    qs = [np.arange(100, dtype=np.int32) * (i + 1) for i in range(4)]
    res, err = js.run(lambda a, i: a.allreduce_int(qs[i]))
    assert not any(err), err
    local = LocalSwitch(js.sw)
    for j in (1, 2):
        assert js.sw.read_stats()["jobs"][j]["JOB_STAT_ACCEPTED"]["packets"] > 0
        epoch = jobs.reset_job(local, j).epoch
        assert js.sw.jobs[j].epoch == epoch
        assert all(v["packets"] == 0 for v in js.sw.read_stats()["jobs"][j].values())
    # a counter write: the cell is the value written, whatever the shards counted
    rx = wire.STAT_INDEX["STAT_RX"]
    js.sw.write_counter(P4.COUNTER_STATS, rx, 7, 0)
    assert js.sw.read_counter(P4.COUNTER_STATS)[rx][0] == 7
    assert [int(s[0][rx]) for s in js.per_shard()] == [7, 0]
    # after the reset, the jobs run again, exactly
    res, err = js.run(lambda a, i: a.allreduce_int(qs[i]))
    assert not any(err), err
    np.testing.assert_array_equal(res[0], qs[0] + qs[1])
    np.testing.assert_array_equal(res[3], qs[2] + qs[3])
    # a pipeline load empties every shard
    js.sw.reset_pipeline()
    assert js.sw.jobs == {} and js.sw.owner == {}
    assert js.sw.read_stats()["switch"]["STAT_RX"] == 0
    assert all(int(s[0][rx]) == 0 and not s[1].any() for s in js.per_shard())


def test_trees_of_sharded_aggregators_are_exact(monkeypatch):
    """A spine and two leaves, each on two shards, two jobs: each leaf's child job k sends
    its partials up from its own port, and the spine's answers (the parent's job id) reach the
    leaf's shard of that child job."""
    monkeypatch.setattr(test_tree, "SoftSwitch", lambda: ShardedSwitch(shards=2))
    tree = test_tree.Tree(jobs=2, per_leaf=2, mode="dense")
    try:
        xs = sparse_tensors(np.random.default_rng(11), 8, 20_000, 0.01)
        res, err = tree.run(lambda a, i: a.allreduce_detailed(xs[i]))
        assert not any(err), err
        assert_exact(res[:4], xs[:4])
        assert_exact(res[4:], xs[4:])
        for leaf in tree.leaves:
            assert sorted(leaf.switch.owner.values()) == [0, 1]
            assert leaf.switch.read_stats()["switch"]["STAT_PARTIAL_UP"] > 0
    finally:
        tree.close()


def test_the_steering_program_sends_each_job_to_its_shard():
    def run(code, job):
        """The classic BPF program on a datagram of job ``job``: the shard it returns."""
        a, pc = 0, 0
        while True:
            op, jt, jf, k = code[pc]
            pc += 1
            if op == 0x28:
                a = job
            elif op == 0x15:
                pc += jt if a == k else jf
            elif op == 0x94:
                a %= k
            elif op == 0x06:
                return k
            elif op == 0x16:
                return a

    owner = {1: 0, 2: 0, 3: 1, 8: 1, 40: 0}
    code = steering_program(owner, 2)
    assert len(code) == 1 + 2 * 2 + 2  # jobs 2, 3, 40 (job % 2 is their shard): no test
    for job in range(64):
        assert run(code, job) == owner.get(job, job % 2)
    assert code[0][3] == wire.OFFSETS["job"]
    with pytest.raises(SoftSwitchError, match="beyond a classic BPF program"):
        steering_program({j: 1 for j in range(0, 8000, 2)}, 2)
    with pytest.raises(SoftSwitchError, match="1 to 64"):
        ShardedSwitch(shards=0)


def test_the_steering_program_is_attached_again_only_when_it_changes(monkeypatch):
    from homagg.targets.soft import shards

    attached = []
    real = shards.attach_program
    monkeypatch.setattr(shards, "attach_program",
                        lambda sock, code: (attached.append(code), real(sock, code)))
    ip = f"127.0.3.{next(_ips)}"
    sw = ShardedSwitch(shards=2)
    with SoftSwitchServer(sw, (ip, PORT), ports=()):
        install(sw, 2, agent_addresses(2), 8)  # job 2 on shard 0 (2 % 2): the same program
        install(sw, 4, agent_addresses(2), 8)  # job 4 on shard 1: a test for it
        assert len(attached) == 2 and attached[-1] == steering_program({2: 0, 4: 1}, 2)
        with sw.lock:
            for _ in range(3):  # what every table write does: no job moves, no attach
                sw._sync_jobs()
        assert len(attached) == 2
        sw.reset_pipeline()  # no jobs: the program without tests
        assert attached[-1] == steering_program({}, 2) and len(attached) == 3


def test_a_sharded_aggregator_does_not_share_a_port_in_use():
    ip = f"127.0.3.{next(_ips)}"
    with (SoftSwitchServer(ShardedSwitch(shards=2), (ip, PORT), ports=()),
          pytest.raises(SoftSwitchError, match="cannot bind UDP")):
        SoftSwitchServer(ShardedSwitch(shards=2), (ip, PORT), ports=())


def test_homagg_softswitch_shards_from_a_config_with_sighup_and_sigterm(tmp_path):
    """The command line: jobs from the config reach the shards at start, SIGHUP's reset
    reaches them (job counters zeroed, the jobs run again), SIGTERM stops every process and
    the last stats file holds the shards' counts."""
    import json
    import signal
    import subprocess
    import sys

    from tests.staging import wait_for

    ip = f"127.0.3.{next(_ips)}"
    addrs = [agent_addresses(2) for _ in range(2)]
    hosts = "".join(f'[[hosts]]\nname = "h{j}{w}"\nip = "{a[0]}"\nmac = "00:00:00:00:00:01"\n'
                    f"port = {2 * j + w + 1}\n" for j in range(2) for w, a in enumerate(addrs[j]))
    jobs_toml = "".join(f"[[jobs]]\nid = {j + 1}\nslots = 16\nkey = {job_key(j + 1)}\n"
                        "workers = [ "
                        + ", ".join(f'{{ host = "h{j}{w}", udp_port = {a[1]} }}'
                                    for w, a in enumerate(addrs[j])) + " ]\n"
                        for j in range(2))
    cfg = tmp_path / "net.toml"
    cfg.write_text(f'[switch]\nname = "fb"\ntarget = "soft"\nip = "{ip}"\n{hosts}{jobs_toml}')
    stats, ready = tmp_path / "stats.json", tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "homagg.targets.soft", "-c", str(cfg),
                             "--grpc", "none", "--shards", "2", "--stats-file", str(stats),
                             "--ready-file", str(ready), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    agents = [Agent(AgentConfig(job=j + 1, worker=w, workers=2, switch=(ip, PORT),
                                bind=addrs[j][w], slots=16, timeout=0.01, deadline=10.0,
                                key=job_key(j + 1)))
              for j in range(2) for w in range(2)]
    try:
        wait_for(lambda: ready.exists() and stats.exists(), 30, "the ready and stats files")
        qs = [np.arange(300, dtype=np.int32) * (i + 1) - i for i in range(4)]
        for _ in range(2):  # before and after the reset
            res, err = run_agents(agents, lambda a, i: a.allreduce_int(qs[i]))
            assert not any(err), err
            np.testing.assert_array_equal(res[0], qs[0] + qs[1])
            np.testing.assert_array_equal(res[2], qs[2] + qs[3])

            def accepted():
                s = json.loads(stats.read_text())
                return [s["jobs"][j]["JOB_STAT_ACCEPTED"]["packets"] for j in ("1", "2")]

            wait_for(lambda: min(accepted()) > 0, 10, "both jobs counted")
            proc.send_signal(signal.SIGHUP)
            wait_for(lambda: accepted() == [0, 0], 10, "the reset's zeroed job counters")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        final = json.loads(stats.read_text())
        assert final["switch"]["STAT_RX"] > 0 and final["io"]["received"] > 0
    finally:
        for a in agents:
            a.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
