"""Trees of switches (p4/include/control/uplink.p4) on the software target: two leaf switches of
four workers each under one spine, every switch a software aggregator on its own loopback
address, real agents on sockets. Every sum is compared bit for bit with the integer sum of all
eight workers' quantized inputs; faults on the spine's socket are loss, duplication and
reordering on the leaf-spine links, both ways. Several jobs share one tree with a source port
per child job at each leaf (the spine knows a leaf's job by it); a clash is an error."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time

import numpy as np
import pytest

from homagg import _p4consts as P4
from homagg import wire
from homagg.controller import jobs as ctl_jobs
from homagg.controller.local import LocalSwitch, install
from homagg.faults import FaultSpec, ImpairedSocket
from homagg.host_agent import Agent, AgentConfig, AggregationTimeout
from homagg.netconfig import Uplink
from homagg.targets.soft import SoftSwitch, SoftSwitchServer
from tests.staging import agent_addresses, job_key, wait_for
from tests.test_agent import (
    assert_exact,
    closing_factory,
    run_agents,
    sparse_tensors,
)

pytestmark = pytest.mark.slow  # (conftest.py) trees of three aggregators, lossy runs

_nets = itertools.count(1)
PORT = wire.HOMAGG_UDP_PORT_MIN


class Tree:
    """A spine, ``leaves`` leaf switches and ``per_leaf`` agents under each, one thread per
    agent; job ``job`` on every switch (the leaves' is the spine's child job). With ``jobs``
    > 1, jobs ``job`` .. ``job + jobs - 1``, each with ``per_leaf`` agents under every leaf:
    each leaf's child job k goes up from its own port (``PORT + k``) to job ``job + k`` at the
    spine, where the leaf is known by that port. Its agents send to the leaf at ``PORT``, or
    with ``job_ports`` at their job's port, as homagg-net's do (then the partials would leave
    from it even without the uplink's src_port: a reply leaves from the port asked). Agents
    are in job order, then leaf, then worker."""

    def __init__(self, leaves=2, per_leaf=4, slots=16, job=1, spine_faults=None, jobs=1,
                 job_ports=False, **agent_kw):
        net = next(_nets)
        self.spine_ip = f"127.0.{100 + net}.1"
        self.leaf_ips = [f"127.0.{100 + net}.{2 + i}" for i in range(leaves)]
        self.names = [f"leaf{i}" for i in range(leaves)]
        self.job_ids = [job + k for k in range(jobs)]
        self.spine = SoftSwitchServer(SoftSwitch(), (self.spine_ip, PORT), spine_faults).start()
        for k, j in enumerate(self.job_ids):
            install(self.spine.switch, j, [(ip, PORT + k) for ip in self.leaf_ips], slots)
        self.leaves = [SoftSwitchServer(SoftSwitch(), (ip, PORT)).start() for ip in self.leaf_ips]
        kw = dict(timeout=0.01, deadline=5.0)
        kw.update(agent_kw)
        self.configs = []
        for k, j in enumerate(self.job_ids):
            for i, (ip, leaf) in enumerate(zip(self.leaf_ips, self.leaves)):
                addrs = agent_addresses(per_leaf)
                install(leaf.switch, j, addrs, slots,
                        uplink=Uplink(j, i, self.spine_ip, PORT, src_port=PORT + k))
                self.configs += [AgentConfig(job=j, worker=w, workers=leaves * per_leaf,
                                             local_workers=per_leaf,
                                             switch=(ip, PORT + k if job_ports else PORT),
                                             bind=addrs[w], slots=slots,
                                             siblings=tuple(self.names), **kw)
                                 for w in range(per_leaf)]
        self.agents = [Agent(c) for c in self.configs]

    def job_stat(self, server, job, kind):
        """A job's counter (wire.JOB_STAT_*) at a switch."""
        return int(server.switch.model.job_stats[job * wire.JOB_STATS_PER_JOB + kind])

    def stat(self, server, name):
        return int(server.switch.model.stats[wire.STAT_INDEX[name]])

    def new_run(self, **changes):
        """Every agent stops and a new one starts on the same address, its config changed by
        ``changes`` (say, ``run``: the launcher's number for the new attempt)."""
        for a in self.agents:
            a.close()
        self.configs = [dataclasses.replace(c, **changes) for c in self.configs]
        self.agents = [Agent(c) for c in self.configs]

    def settle(self, quiet: float = 0.2) -> None:
        """Wait until no switch has taken a packet for ``quiet`` seconds: what the agents
        sent before they stopped has been handled."""
        state = {"rx": None, "since": 0.0}

        def quiet_for_long_enough() -> bool:
            rx = [self.stat(s, "STAT_RX") for s in [*self.leaves, self.spine]]
            if rx != state["rx"]:
                state["rx"], state["since"] = rx, time.monotonic()
            return time.monotonic() - state["since"] >= quiet

        wait_for(quiet_for_long_enough, what="the switches to go quiet")

    def start(self, fn, which, results, errors):
        """Start fn(agent, i) for the agents in ``which``, each on a thread; returns them."""
        def work(i):
            try:
                results[i] = fn(self.agents[i], i)
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                errors[i] = e

        threads = [threading.Thread(target=work, args=(i,)) for i in which]
        for t in threads:
            t.start()
        return threads

    def run(self, fn, skip=()):
        return run_agents(self.agents, fn, skip)

    def close(self):
        for a in self.agents:
            a.close()
        for s in [*self.leaves, self.spine]:
            s.stop()


@pytest.fixture
def make_tree():
    yield from closing_factory(Tree)


@pytest.mark.parametrize("mode", ["auto", "dense", "union", "sketch"])
def test_tree_sums_are_exact_in_every_mode(make_tree, mode):
    tree = make_tree(mode=mode)
    xs = sparse_tensors(np.random.default_rng(11), 8, 20_000, 0.01)
    res, err = tree.run(lambda a, i: a.allreduce_detailed(xs[i]))
    assert not any(err), err
    assert_exact(res, xs)
    assert res[0].mode == ("union" if mode == "auto" else mode)
    # each leaf sent its rounds up once; the spine multicast each to the two leaves only
    for leaf in tree.leaves:
        assert tree.stat(leaf, "STAT_PARTIAL_UP") == tree.stat(leaf, "STAT_COMPLETED") > 0
    assert tree.stat(tree.spine, "STAT_ACCEPTED") == sum(tree.stat(s, "STAT_PARTIAL_UP")
                                                        for s in tree.leaves)


def test_tree_integer_sum_is_exact(make_tree):
    tree = make_tree()
    rng = np.random.default_rng(12)
    qs = [rng.integers(-(2**27), 2**27, 3000).astype(np.int32) for _ in range(8)]
    res, err = tree.run(lambda a, i: a.allreduce_int(qs[i]))
    assert not any(err), err
    for r in res:
        np.testing.assert_array_equal(r, np.sum(qs, axis=0, dtype=np.int64))


def test_loss_duplication_and_reordering_on_the_leaf_spine_links_stay_exact(make_tree):
    tree = make_tree(spine_faults=FaultSpec(loss=0.05, dup=0.05, reorder=0.1, seed=5))
    rng = np.random.default_rng(13)
    for _ in range(3):
        xs = sparse_tensors(rng, 8, 50_000, 0.01)
        res, err = tree.run(lambda a, i, xs=xs: a.allreduce_detailed(xs[i]))
        assert not any(err), err
        assert_exact(res, xs)
    # losses were recovered through the leaves (partials sent up again), and the spine's
    # duplicates (sent twice, or by the fault injector) were never added twice
    assert sum(tree.stat(s, "STAT_PARTIAL_RESENT") for s in tree.leaves) > 0
    assert tree.stat(tree.spine, "STAT_DUP_PENDING") + tree.stat(
        tree.spine, "STAT_RETRANS_REPLY") + tree.stat(tree.spine, "DROP_STALE") > 0


def test_overflow_at_the_spine_is_flagged_to_every_worker(make_tree):
    # A scale 6 bits finer than negotiated: the sum of 8 overflows somewhere in the tree; the
    # flag reaches every worker, and all rescale the same way.
    tree = make_tree(mode="dense", shift_bias=6)
    x = np.full(500, -3.0, np.float32)
    res, err = tree.run(lambda a, i: a.allreduce_detailed(x))
    assert not any(err), err
    assert all(a.counters.rescales >= 1 for a in tree.agents)
    assert_exact(res, [x] * 8)
    assert tree.stat(tree.spine, "STAT_OVERFLOW") > 0


def test_runs_that_follow_each_other_get_the_roots_generation(make_tree):
    tree = make_tree(slots=8)
    rng = np.random.default_rng(14)
    for run in range(3):
        if run:
            tree.new_run()
        xs = sparse_tensors(rng, 8, 5_000, 0.05)
        res, err = tree.run(lambda a, i, xs=xs: a.allreduce_detailed(xs[i]))
        assert not any(err), err
        assert_exact(res, xs)
        assert {a.transport.gen for a in tree.agents} == {run + 1}
    for s in [*tree.leaves, tree.spine]:
        assert tree.stat(s, "DROP_STALE") == 0


def test_a_dead_worker_is_named_under_its_leaf_and_its_leaf_elsewhere(make_tree):
    tree = make_tree(deadline=1.0)
    x = np.ones(1000, np.float32)
    dead = 6  # leaf 1's worker 2
    tree.run(lambda a, i: a.allreduce(x))  # every worker joined: a run in progress
    res, err = tree.run(lambda a, i: a.allreduce(x), skip={dead})
    for i in range(8):
        if i == dead:
            continue
        assert isinstance(err[i], AggregationTimeout), err[i]
        if i >= 4:  # the dead worker's own leaf names it
            assert "waiting for worker(s) 2" in str(err[i])
        else:  # the other leaf's workers: the spine waits for leaf1
            assert "waits for leaf1" in str(err[i]) and "from leaf0" in str(err[i])


def stranded_join(tree, run=0):
    """Run 1's join never completes: leaf1's worker 3 (agent 7) never starts, so leaf1's join
    stays at 3 of 4, and the spine keeps leaf0's join. Then every agent restarts, with
    ``run`` its new run number."""
    x = np.ones(1000, np.float32)
    _, err = tree.run(lambda a, i: a.allreduce(x), skip={7})
    assert all(isinstance(e, AggregationTimeout) for i, e in enumerate(err) if i != 7), err
    assert tree.stat(tree.spine, "STAT_COMPLETED") == 0  # the spine holds leaf0's join only
    assert tree.leaves[1].switch.model.join_state[1][1] == 3  # leaf1's: 3 of 4
    # run 2 with the usual deadline: its agents wait for one another, on a loaded machine
    tree.new_run(deadline=10.0, run=run)
    tree.settle()  # run 1's last retransmissions, and the answers to them, are handled


def test_a_restarted_run_completes_after_a_join_that_never_completed(make_tree):
    """The order of a job that died during its join and was restarted (an elastic restart):
    in run 2 the worker missing from run 1's join joins first, at a leaf where the other
    three are still counted from run 1. Its run number differs from theirs, so the leaf
    starts afresh instead of completing the join with three stale members; so does the spine
    with leaf0's stale join. The others then join, in any order, and every sum is exact."""
    tree = make_tree(deadline=1.0, run=1)
    stranded_join(tree, run=2)
    leaf0, leaf1 = tree.leaves
    xs = sparse_tensors(np.random.default_rng(17), 8, 5_000, 0.05)
    results, errors = [None] * 8, [None] * 8
    work = lambda a, i: a.allreduce_detailed(xs[i])  # noqa: E731
    threads = tree.start(work, [7], results, errors)
    wait_for(lambda: tree.stat(leaf1, "STAT_JOIN_AFRESH") == 1, what="leaf1 starts afresh")
    threads += tree.start(work, [4, 5, 6], results, errors)
    wait_for(lambda: tree.stat(leaf1, "STAT_PARTIAL_UP") == 1, what="leaf1's join goes up")
    wait_for(lambda: tree.stat(tree.spine, "STAT_JOIN_AFRESH") == 1,
             what="the spine starts afresh (leaf0's join is run 1's)")
    threads += tree.start(work, range(4), results, errors)
    for t in threads:
        t.join(60)
    assert not any(errors), errors
    assert_exact(results, xs)
    assert len({a.transport.gen for a in tree.agents}) == 1
    assert tree.stat(leaf0, "STAT_JOIN_AFRESH") == 0  # leaf0's run 1 join had completed


def test_a_run_after_a_join_that_never_completed_is_not_stranded(make_tree):
    """The join race without run numbers (run 0 on every worker: agents started by hand),
    where the order is the one it allows: leaf1's three run-1 workers join again (each
    restarted process counted once), then the fourth. One of leaf0's workers joins first:
    the spine completes its join with leaf0's old one and answers while leaf0's own join is
    pending. leaf0 holds that answer (join.p4, held) and hands it out once its other workers
    have joined, instead of dropping it and sending a join up that starts the spine's next
    run (which would strand leaf0's workers, the others having gone on)."""
    tree = make_tree(deadline=1.0)
    stranded_join(tree)
    leaf0, leaf1 = tree.leaves
    xs = sparse_tensors(np.random.default_rng(16), 8, 5_000, 0.05)
    results, errors = [None] * 8, [None] * 8
    work = lambda a, i: a.allreduce_detailed(xs[i])  # noqa: E731
    accepted, relayed, dropped = (tree.stat(leaf0, n) for n in (
        "STAT_ACCEPTED", "STAT_FROM_PARENT", "DROP_PARENT_DUP"))
    accepted1 = tree.stat(leaf1, "STAT_ACCEPTED")
    threads = tree.start(work, [0], results, errors)  # leaf0's join is pending from here
    wait_for(lambda: tree.stat(leaf0, "STAT_ACCEPTED") > accepted, what="leaf0's first join")
    threads += tree.start(work, [4, 5, 6], results, errors)
    wait_for(lambda: tree.stat(leaf1, "STAT_ACCEPTED") == accepted1 + 3,
             what="leaf1's three restarted workers")
    threads += tree.start(work, [7], results, errors)
    wait_for(lambda: tree.stat(leaf0, "STAT_FROM_PARENT") > relayed,
             what="the spine's answer at leaf0")
    # the spine answered (its join completed with leaf0's old one) while leaf0's was pending
    assert tree.stat(tree.spine, "STAT_COMPLETED") == 1
    assert tree.stat(leaf0, "STAT_FROM_PARENT") == relayed + 1  # held, not dropped
    assert tree.stat(leaf0, "DROP_PARENT_DUP") == dropped
    assert leaf0.switch.model.join_state[1][6] == 1  # the held bit
    threads += tree.start(work, [1, 2, 3], results, errors)
    for t in threads:
        t.join(60)
    assert not any(errors), errors
    assert_exact(results, xs)
    assert len({a.transport.gen for a in tree.agents}) == 1
    assert tree.stat(tree.leaves[0], "DROP_PARENT_DUP") == 0


class SendLog:
    """An agent's socket that counts the datagrams it sends, by round tag (seq): the test's
    view of which worker retransmitted which round."""

    def __init__(self, sock):
        self.sock = sock
        self.sends: collections.Counter = collections.Counter()  # (op, seq) -> datagrams

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def _note(self, data, size: int, n: int) -> None:
        mv = memoryview(data)
        for i in range(n):
            head = wire.HEADER.unpack_from(mv, i * size)
            self.sends[head[_OP_FIELD] & 0xF, head[_SEQ_FIELD]] += 1

    def sendto(self, data, addr):
        n = self.sock.sendto(data, addr)
        self._note(data, len(data), 1)
        return n

    def send_many(self, data, size, addr):
        n = self.sock.send_many(data, size, addr)
        self._note(data, size, n)
        return n


_OP_FIELD, _SEQ_FIELD = ([name for name, _, _ in wire.BYTE_FIELDS].index(f)
                         for f in ("version_op", "seq"))


def test_a_lossy_tree_serves_finals_from_the_leaf_and_resends_up_once_per_timeout(make_tree):
    """Loss at the workers' sockets and on the leaf-spine links, every sum exact, and the two
    rules that keep a tree's retransmissions local, checked by counting:
    - a leaf remembers the parent's result (its final): a worker that lost it gets it from
      the leaf (STAT_RETRANS_REPLY there), not by another partial sent up;
    - of a round complete at the leaf and still at the parent, only the round's designated
      worker (seq & (workers - 1)) makes the leaf send the partial up again: every resend up
      (STAT_PARTIAL_RESENT) answers a retransmission by the designated worker (or a join's,
      which any worker resends), never one by the others."""
    tree = make_tree(spine_faults=FaultSpec(loss=0.05, seed=3), deadline=20.0,
                     timeout=0.01, max_timeout=0.05)
    for i, a in enumerate(tree.agents):
        a.transport.sock = SendLog(ImpairedSocket(a.transport.sock, FaultSpec(loss=0.03,
                                                                              seed=40 + i)))
    xs = sparse_tensors(np.random.default_rng(19), 8, 40_000, 0.05)
    res, err = tree.run(lambda a, i: [a.allreduce_detailed(x) for x in (xs[i], -xs[i])])
    assert not any(err), err
    assert_exact([r[0] for r in res], xs)
    assert_exact([r[1] for r in res], [-x for x in xs])
    per_leaf = 4
    for leaf_no, leaf in enumerate(tree.leaves):
        logs = [a.transport.sock for a in tree.agents[per_leaf * leaf_no:][:per_leaf]]
        designated = others = joins = 0
        for w, log in enumerate(logs):
            for (op, seq), n in log.sends.items():
                if op == wire.OP_JOIN:
                    joins += n - 1
                elif seq & (per_leaf - 1) == w:
                    designated += n - 1
                else:
                    others += n - 1
        assert tree.stat(leaf, "STAT_RETRANS_REPLY") > 0, "no final served from the leaf"
        assert others > 0  # the others did retransmit: the bound below can fail
        assert tree.stat(leaf, "STAT_PARTIAL_RESENT") <= designated + joins, (
            tree.stat(leaf, "STAT_PARTIAL_RESENT"), designated, joins, others)


def test_a_dead_leaf_is_named(make_tree):
    tree = make_tree(deadline=1.0)
    x = np.ones(1000, np.float32)
    tree.run(lambda a, i: a.allreduce(x))
    tree.leaves[1].stop()
    res, err = tree.run(lambda a, i: a.allreduce(x), skip=set(range(4, 8)))
    for i in range(4):
        assert isinstance(err[i], AggregationTimeout), err[i]
        assert "waits for leaf1" in str(err[i])


def test_the_spine_takes_one_stream_per_leaf(make_tree):
    """What the spine adds is a quarter of what a star's switch would add for the same 8
    workers: one partial per leaf per round (the join included), where the leaves take one
    contribution per worker per round."""
    tree = make_tree(mode="dense")
    xs = [np.random.default_rng(i).standard_normal(40_000).astype(np.float32) for i in range(8)]
    res, err = tree.run(lambda a, i: a.allreduce_detailed(xs[i]))
    assert not any(err), err
    assert_exact(res, xs)
    rounds = tree.stat(tree.leaves[0], "STAT_COMPLETED")  # the join and the data rounds
    assert rounds > 10
    assert tree.stat(tree.spine, "STAT_ACCEPTED") == 2 * rounds
    assert sum(tree.stat(s, "STAT_ACCEPTED") for s in tree.leaves) == 8 * rounds


def test_a_reset_tree_runs_again_exactly(make_tree):
    """homagg-ctl reset on every switch of the tree (new epochs: the leaves' parents entries
    move with their jobs), then a new run."""
    tree = make_tree(slots=8)
    rng = np.random.default_rng(15)
    for run in range(2):
        if run:
            for s in [tree.spine, *tree.leaves]:
                ctl_jobs.reset_job(LocalSwitch(s.switch), 1)
            tree.new_run()
        xs = sparse_tensors(rng, 8, 5_000, 0.05)
        res, err = tree.run(lambda a, i, xs=xs: a.allreduce_detailed(xs[i]))
        assert not any(err), err
        assert_exact(res, xs)
    for s in tree.leaves:
        # the new epochs' parents entries took every answer: the only ones dropped are
        # second copies of a final, each the parent's answer to a partial sent up again
        # (a retransmission that crossed the final on its way down)
        assert tree.stat(s, "DROP_PARENT_DUP") <= tree.stat(s, "STAT_PARTIAL_RESENT")


def test_a_tree_set_up_by_hand_from_configs_and_the_command_line(tmp_path):
    """What a user does without homagg-net: one homagg-softswitch per switch, each from its own
    config (the spine's job lists the leaves as its workers; each leaf's job has an uplink to
    the spine), and homagg-agent under each leaf with its id there, the tree's size and its
    rank in the whole job. Every aggregate is checked bit for bit (--check)."""
    import subprocess
    import sys

    net = next(_nets)
    spine, leaves = f"127.0.{100 + net}.1", [f"127.0.{100 + net}.{2 + i}" for i in range(2)]
    mac = "00:00:00:00:00:01"

    def config(name, ip, hosts, workers, uplink=""):
        hs = "".join(f'[[hosts]]\nname = "{n}"\nip = "{h}"\nmac = "{mac}"\nport = {k + 1}\n'
                     for k, (n, h) in enumerate(hosts))
        ws = ", ".join(f'{{ host = "{n}", udp_port = {p} }}' for n, p in workers)
        path = tmp_path / f"{name}.toml"
        path.write_text(f'[switch]\nname = "{name}"\ntarget = "soft"\nip = "{ip}"\n{hs}'
                        f"[[jobs]]\nid = 1\nslots = 16\nkey = {job_key(1)}\nworkers = [ {ws} ]\n"
                        f"{uplink}")
        return path

    procs = []
    try:
        cfgs = [config("spine", spine, [(f"leaf{i}", ip) for i, ip in enumerate(leaves)],
                       [(f"leaf{i}", PORT) for i in range(2)])]
        addrs = [agent_addresses(4) for _ in leaves]
        for i, ip in enumerate(leaves):
            cfgs.append(config(f"leaf{i}", ip, [(f"w{w}", addrs[i][w][0]) for w in range(4)],
                               [(f"w{w}", addrs[i][w][1]) for w in range(4)],
                               f'uplink = {{ job = 1, worker = {i}, ip = "{spine}", '
                               f'key = {job_key(1)} }}\n'))
        for c in cfgs:
            procs.append(subprocess.Popen([sys.executable, "-m", "homagg.targets.soft", "-c",
                                           str(c), "--grpc", "none", "--log-level", "warning"],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        agents = []
        for i, ip in enumerate(leaves):
            for w in range(4):
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "homagg.host_agent", "--job", "1", "--worker", str(w),
                     "--workers", "8", "--local-workers", "4", "--rank", str(4 * i + w),
                     "--siblings", "leaf0,leaf1", "--switch", ip, "--slots", "16",
                     "--bind", f"{addrs[i][w][0]}:{addrs[i][w][1]}", "--key", str(job_key(1)),
                     "bench", "--size", "30000",
                     "--iterations", "3", "--check"],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        procs += agents
        for k, a in enumerate(agents):
            out, _ = a.communicate(timeout=120)
            assert a.returncode == 0 and "every aggregate exact" in out, f"agent {k}:\n{out}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)


# -- several jobs in one tree ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["dense", "union", "sketch"])
def test_two_jobs_share_the_leaves_and_the_spine_every_sum_exact(make_tree, mode):
    """Two jobs at once in one tree: every leaf has two workers of each, each job is a child
    job of its own there (its own uplink src_port) under a parent job of its own at the spine.
    Every agent sends to its leaf's first port, so job 2's partials leave from its src_port
    only because the uplink says so. Each job's sums are exactly its own workers' (different
    data, different sizes), and each leaf's partials reached its own job's parent: the spine
    took one partial per leaf per round of each job, and refused or dropped nothing."""
    tree = make_tree(jobs=2, per_leaf=2, mode=mode)
    rng = np.random.default_rng(21)
    xs = [sparse_tensors(rng, 4, 20_000, 0.01), sparse_tensors(rng, 4, 26_000, 0.02)]
    res, err = tree.run(lambda a, i: a.allreduce_detailed(xs[i // 4][i % 4]))
    assert not any(err), err
    for k in range(2):
        assert_exact(res[4 * k:4 * (k + 1)], xs[k])
        assert {r.mode for r in res[4 * k:4 * (k + 1)]} == {mode}
    spine = tree.spine
    for j in tree.job_ids:
        rounds = [tree.job_stat(leaf, j, wire.JOB_STAT_COMPLETED) for leaf in tree.leaves]
        assert rounds[0] == rounds[1] > 2  # the join and the data rounds, finals come down
        assert tree.job_stat(spine, j, wire.JOB_STAT_ACCEPTED) == sum(rounds)
        assert tree.job_stat(spine, j, wire.JOB_STAT_COMPLETED) == rounds[0]
        assert tree.job_stat(spine, j, wire.JOB_STAT_DROPPED) == 0
    assert tree.job_stat(spine, 1, wire.JOB_STAT_COMPLETED) != tree.job_stat(
        spine, 2, wire.JOB_STAT_COMPLETED)  # (the sizes differ: a crossed partial would show)
    for name in ("DROP_UNKNOWN_SENDER", "DROP_WRONG_IDENTITY", "DROP_FORGED_RESULT"):
        assert tree.stat(spine, name) == 0
        assert sum(tree.stat(leaf, name) for leaf in tree.leaves) == 0


def test_two_jobs_in_one_tree_stay_exact_with_faults_on_the_leaf_spine_links(make_tree):
    """The same two jobs with loss, duplication and reordering at the spine, their agents
    sending to their job's port (as homagg-net's do): the leaves' resent partials go up from
    each job's own port too (the spine takes none as another job's: nothing refused as a wrong
    identity, nothing from an unknown sender)."""
    tree = make_tree(jobs=2, per_leaf=2, mode="auto", job_ports=True,
                     spine_faults=FaultSpec(loss=0.05, dup=0.05, reorder=0.1, seed=7))
    rng = np.random.default_rng(22)
    for _ in range(2):
        xs = [sparse_tensors(rng, 4, 30_000, 0.01) for _ in range(2)]
        res, err = tree.run(lambda a, i, xs=xs: a.allreduce_detailed(xs[i // 4][i % 4]))
        assert not any(err), err
        for k in range(2):
            assert_exact(res[4 * k:4 * (k + 1)], xs[k])
    assert sum(tree.stat(s, "STAT_PARTIAL_RESENT") for s in tree.leaves) > 0
    for name in ("DROP_UNKNOWN_SENDER", "DROP_WRONG_IDENTITY"):
        assert tree.stat(tree.spine, name) == 0


def test_two_child_jobs_of_a_leaf_on_one_source_port_are_an_error_not_a_wrong_sum(tmp_path,
                                                                                   capsys):
    """The parent knows a leaf's job by the leaf's address and source port: two child jobs of
    one leaf that go up to one parent from one src_port would be one worker to it. The config
    and the controller's job logic (whatever switch it writes) each refuse that, saying so,
    before writing anything; so do two child jobs under one parent job, and a src_port
    outside homagg's ports (the parent's answers come back to it)."""
    import tomllib

    from homagg.errors import ConfigError, JobError
    from homagg.netconfig import parse
    from homagg.targets.soft.cli import main as softswitch

    spine = "10.0.0.254"
    text = ('[switch]\nname = "leaf1"\ntarget = "soft"\nip = "127.0.3.1"\n'
            + "".join(f'[[hosts]]\nname = "h{w}"\nip = "127.0.3.{10 + w}"\n'
                      f'mac = "00:00:00:00:00:01"\nport = {w + 1}\n' for w in range(4))
            + "".join(f'[[jobs]]\nid = {j}\nkey = {job_key(j)}\nworkers = [ '
                      f'{{ host = "h{2 * j - 2}" }}, {{ host = "h{2 * j - 1}" }} ]\nuplink = '
                      f'{{ job = {j}, worker = 0, ip = "{spine}", src_port = SRC{j}, '
                      f'key = {job_key(j)} }}\n' for j in (1, 2)))

    def config(src1, src2, text=text):
        return text.replace("SRC1", str(src1)).replace("SRC2", str(src2))

    good = parse(tomllib.loads(config(PORT, PORT + 1)))
    assert [j.uplink.src_port for j in good.jobs] == [PORT, PORT + 1]
    with pytest.raises(ConfigError, match=f"jobs 1 and 2 both send their partial sums to "
                                          f"{spine} from port {PORT}.*its own uplink src_port"):
        parse(tomllib.loads(config(PORT, PORT)))
    with pytest.raises(ConfigError, match="both go up to job 1 at"):
        parse(tomllib.loads(config(PORT, PORT + 1).replace("job = 2, worker", "job = 1, worker")))
    with pytest.raises(ConfigError, match=r"src_port: 50000 is not an integer in \[48864, "):
        parse(tomllib.loads(config(PORT, 50000)))

    # what a config would say, written by the controller's job logic, here into a software
    # aggregator in process (bmv2's path is the same code over P4Runtime)
    one, two = good.jobs
    clash = dataclasses.replace(two, uplink=dataclasses.replace(two.uplink, src_port=PORT))
    soft = SoftSwitch()
    sw = LocalSwitch(soft)
    ctl_jobs.add_job(sw, one)
    with pytest.raises(JobError, match="jobs 1 and 2 both send their partial sums"):
        ctl_jobs.add_job(sw, clash)
    assert [j.id for j in ctl_jobs.list_jobs(sw)] == [1]  # nothing of job 2 written
    assert list(soft.jobs) == [1] and len(soft.read_entries(P4.TABLE_UPLINK)) == 1
    ctl_jobs.add_job(sw, two)
    assert {j.uplink.src_port for j in ctl_jobs.list_jobs(sw)} == {PORT, PORT + 1}
    assert sorted(soft.jobs) == [1, 2]

    # served on one port only, a child job going up from another is refused at start
    path = tmp_path / "leaf1.toml"
    path.write_text(config(PORT, PORT + 1))
    rc = softswitch(["-c", str(path), "--grpc", "none", "--single-port"])
    assert rc == 1
    assert f"job 2: its uplink's src_port {PORT + 1} is not served here" in capsys.readouterr().err


def test_the_software_aggregator_serves_homaggs_ports_and_answers_from_the_one_asked():
    """As bmv2's parser does, the software aggregator takes homagg packets on every port of
    0xBEE0-0xBEEF; a reply leaves from the port its request came to (bmv2's from_switch)."""
    import socket

    ip = f"127.0.{100 + next(_nets)}.1"
    with SoftSwitchServer(SoftSwitch(), (ip, PORT)) as server:
        assert server.ports == list(range(wire.HOMAGG_UDP_PORT_MIN,
                                          wire.HOMAGG_UDP_PORT_MAX + 1))
        assert server.address == (ip, PORT)
        socks = []
        for _ in range(2):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("127.0.0.1", 0))
            s.settimeout(2)
            socks.append(s)
        try:
            install(server.switch, 1, [s.getsockname() for s in socks], 4)
            words = [np.arange(8), np.full(8, 5)]
            # worker 0 to port +3, worker 1 (completing the round) to port +9: the result
            # comes to both from +9; worker 0's retransmission to +15 is answered from +15
            socks[0].sendto(wire.pack(wire.OP_ADD, 1, 0, 0, 1, words[0]), (ip, PORT + 3))
            wait_for(lambda: server.switch.model.stats[wire.STAT_INDEX["STAT_ACCEPTED"]] == 1)
            socks[1].sendto(wire.pack(wire.OP_ADD, 1, 1, 0, 1, words[1]), (ip, PORT + 9))
            for s in socks:
                data, src = s.recvfrom(4096)
                assert src == (ip, PORT + 9)
                np.testing.assert_array_equal(wire.unpack(data).words[:8], words[0] + words[1])
            socks[0].sendto(wire.pack(wire.OP_ADD, 1, 0, 0, 1, words[0]), (ip, PORT + 15))
            data, src = socks[0].recvfrom(4096)
            assert src == (ip, PORT + 15) and wire.unpack(data).flags & wire.FLAG_RETRANS
        finally:
            for s in socks:
                s.close()
    # bound elsewhere (port 0: a free one), it serves that port alone
    with SoftSwitchServer(SoftSwitch(), (ip, 0)) as server:
        assert server.ports == [server.address[1]] != [0]
