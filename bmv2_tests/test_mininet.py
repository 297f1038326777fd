"""End to end under Mininet, on both targets: the demo's training, and agents under loss.

Needs root and Mininet (./run.sh setup installs it); the bmv2 half also needs bmv2 and p4c.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from bmv2_tests.conftest import LOG_DIR


@pytest.fixture
def target(net_target):
    return net_target


def _loss_curves(out: str) -> list[list[float]]:
    """Worker 0's loss per step, one list per run of the example (a run starts at step 0)."""
    curves: list[list[float]] = []
    for step, loss in re.findall(r"\[w0\] step +(\d+) loss (\S+)", out):
        if int(step) == 0:
            curves.append([])
        curves[-1].append(float(loss))
    return curves


def _run(argv):
    from homagg.launcher.cli import main

    return main(argv)


def test_demo_trains_with_exact_aggregates(target, capsys):
    rc = _run(["demo", "--target", target, "--iterations", "6",
               "--log-dir", str(LOG_DIR / f"mn-demo-{target}")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"done on {target}" in out and "every aggregate bit-exact" in out
    iters = [line for line in out.splitlines() if re.match(r"\s*\d+\s+\d", line)]
    assert all(line.endswith("exact") for line in iters)
    assert len(iters) == 6
    losses = [float(line.split()[1]) for line in iters]
    assert losses[-1] < losses[0]


def test_agents_stay_exact_with_lossy_links(target, capsys):
    # injected at the agents' sockets: this machine's kernel has no netem for --loss
    rc = _run(["run", "--target", target, "--inject-loss", "5", "--log-dir",
               str(LOG_DIR / f"mn-loss-{target}"), "--", "bench", "--size", "200000",
               "--density", "0.01", "--iterations", "3", "--check"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "every aggregate exact" in out
    summary = json.loads((LOG_DIR / f"mn-loss-{target}" / "worker0.json").read_text())
    assert summary["injected"]["dropped_out"] + summary["injected"]["dropped_in"] > 0
    assert summary["retransmissions"] > 0


def test_jumbo_frames_carry_the_largest_k_exactly(target, capsys):
    """--mtu 9000 --words K: every link at 9000 bytes, the switch built (bmv2: 2176 words, 34
    chunks of 64) or started (soft: 2239, the wire's limit, 8972 bytes of UDP payload) for the
    largest K it takes, the agents learn it, and every aggregate is exact."""
    from homagg import wire

    k = wire.MAX_WORDS_PER_PACKET
    if target == "bmv2":
        k = k // wire.CHUNK_WORDS * wire.CHUNK_WORDS
    log_dir = LOG_DIR / f"mn-jumbo-{target}"
    rc = _run(["run", "--target", target, "--mtu", str(wire.JUMBO_MTU), "--words", str(k),
               "--log-dir", str(log_dir), "--", "bench", "--size", "200000", "--density",
               "0.5", "--iterations", "2", "--check"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "every aggregate exact" in out
    s = json.loads((log_dir / "worker0.json").read_text())
    assert s["bytes_on_wire"] == s["packets"] * wire.packet_bytes(k)  # (the join's not counted)


def test_a_k_the_mtu_cannot_carry_is_refused_before_the_topology_starts():
    from homagg.launcher.net import HomaggNet, NetError, NetOptions

    with pytest.raises(NetError, match="--words 2176 with --mtu 1500: .* raise the MTU"):
        HomaggNet(NetOptions(target="soft", words=2176))


def test_the_bmv2_window_holds_fewer_packets_when_they_are_jumbo():
    from bmv2_tests.conftest import bmv2_skip_reason
    from homagg.launcher.net import HomaggNet, NetOptions

    if bmv2_skip_reason():
        pytest.skip(bmv2_skip_reason())
    assert HomaggNet(NetOptions(target="bmv2")).slots == 16
    assert HomaggNet(NetOptions(target="bmv2", words=2176, mtu=9000)).slots == 8
    assert HomaggNet(NetOptions(target="soft", words=2176, mtu=9000)).slots == 64


def test_exec_runs_a_command_on_every_worker_with_its_settings(target, capsys):
    """homagg-net exec: each worker host gets its job's settings; output is prefixed per worker
    and logged; the exit status is the worst of the workers'."""
    log_dir = LOG_DIR / f"mn-exec-{target}"
    script = ('echo "$HOMAGG_JOB $HOMAGG_WORKER $HOMAGG_WORKERS $HOMAGG_SWITCH $HOMAGG_BIND '
              '$RANK $WORLD_SIZE $MASTER_ADDR $GLOO_SOCKET_IFNAME"; exit $((HOMAGG_WORKER * 3))')
    rc = _run(["exec", "--target", target, "--workers", "2", "--log-dir", str(log_dir),
               "--", "sh", "-c", script])
    out = capsys.readouterr().out
    assert rc == 3, out
    assert "[w0] 1 0 2 10.0.0.254:48864 10.0.0.1:50000 0 2 10.0.0.1 h1-eth0" in out
    assert "[w1] 1 1 2 10.0.0.254:48864 10.0.0.2:50000 1 2 10.0.0.1 h2-eth0" in out
    assert (log_dir / "exec-w1.log").read_text().startswith("1 1 2 ")


def test_exec_runs_the_agent_on_every_worker_twice_in_a_row(target, capsys):
    """The agent CLI, started by exec, finds its job from the environment alone; run twice in
    a row on the same topology, with no reset between (the join: include/control/join.p4)."""
    agent = ('"$0" -m homagg.host_agent --job $HOMAGG_JOB --worker $HOMAGG_WORKER '
             '--workers $HOMAGG_WORKERS --switch $HOMAGG_SWITCH --bind $HOMAGG_BIND '
             '--slots $HOMAGG_SLOTS bench --size 20000 --iterations 2 --check')
    rc = _run(["exec", "--target", target, "--workers", "2", "--log-dir",
               str(LOG_DIR / f"mn-exec-agent-{target}"), "--", "sh", "-c",
               f"{agent} && {agent}", __import__("sys").executable])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("every aggregate exact") == 4


def test_exec_runs_the_ddp_example_to_identical_replicas(target, capsys):
    """examples/ddp_train.py under homagg-net exec: DDP with homagg's hook, settings from the
    environment; every worker ends with the same parameters."""
    pytest.importorskip("torch", reason="torch not installed (optional extra)")
    from homagg import paths

    root = paths.checkout_root()
    if root is None:
        pytest.skip("needs the checkout's examples/")
    rc = _run(["exec", "--target", target, "--workers", "2", "--log-dir",
               str(LOG_DIR / f"mn-exec-ddp-{target}"), "--", __import__("sys").executable,
               str(root / "examples" / "ddp_train.py"), "--steps", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    digests = re.findall(r"rank \d: parameters (\w+)", out)
    assert len(digests) == 2 and len(set(digests)) == 1, out


# Run as each worker of the service test: the DDP example, except that a worker holds its
# place (does not Leave) until all four workers have trained. Without it, a fast job can leave
# before the other joins, and both fit the switch in turn: the test would stage the order by
# timing. Each worker writes a file on the shared file system when it is done, then waits for
# four (Mininet hosts share the file system; a pid names a process across their namespaces).
_HOLD_PLACES = """
import os, pathlib, runpy, sys, time
from homagg.host_agent import membership

done = pathlib.Path(sys.argv.pop(1))
leave = membership.Membership.leave


def held(self):
    (done / str(os.getpid())).touch()
    deadline = time.monotonic() + 180
    while len(list(done.iterdir())) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    leave(self)


membership.Membership.leave = held
sys.argv.pop(0)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_exec_with_the_service_two_jobs_join_and_one_falls_back(target, capsys, tmp_path):
    """homagg-net exec --service: the workers' environment names the controller service, not
    job and worker ids; each worker joins its job by name (MASTER_ADDR:MASTER_PORT) and the
    service places each job once both its ranks are in. The switch has room for one job of
    16 slots, and every worker holds its place until all have trained, so the job that
    completes its join second falls back to host fb. Both jobs train the DDP example to the
    same replicas, and both are gone once their workers leave."""
    pytest.importorskip("torch", reason="torch not installed (optional extra)")
    pytest.importorskip("grpc", reason="grpcio not installed (controller extra)")
    from homagg import paths

    root = paths.checkout_root()
    if root is None:
        pytest.skip("needs the checkout's examples/")
    hold, done = tmp_path / "hold.py", tmp_path / "done"
    hold.write_text(_HOLD_PLACES)
    done.mkdir()
    rc = _run(["exec", "--target", target, "--workers", "4", "--jobs", "2", "--slots", "16",
               "--switch-slots", "16", "--service", "--log-dir",
               str(LOG_DIR / f"mn-exec-service-{target}"), "--", "sh", "-c",
               'test -n "$HOMAGG_CONTROLLER" && test -z "$HOMAGG_JOB" && exec "$0" "$@"',
               __import__("sys").executable, str(hold), str(done),
               str(root / "examples" / "ddp_train.py"), "--steps", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert len(list(done.iterdir())) == 4, out[-3000:]  # every worker reached its leave
    digests = re.findall(r"rank \d: parameters (\w+)", out)
    assert len(digests) == 4 and len(set(digests)) == 1, out[-3000:]
    placed = re.findall(r"job \d+ \((\S+)\): placed on (\w+)", out)
    assert sorted(p for _, p in placed) == ["fb", "s1"], out[-3000:]
    assert len({name for name, _ in placed}) == 2  # a name per job: its master's address
    assert "jobs the service still holds: none" in out


def test_ddp_example_follows_gloo_to_1e_6_and_runs_twice_in_a_row(target, capsys):
    """examples/ddp_train.py on 4 workers, in one exec: plain DDP over gloo, then homagg's hook
    twice in a row on the same topology with no reset (the join). Every homagg run ends with
    bit-identical replicas, and its loss curve stays within 1e-6 (absolute) of gloo's from the
    same seeds; the two homagg runs are identical. Then once more with sparse gradients."""
    pytest.importorskip("torch", reason="torch not installed (optional extra)")
    from homagg import paths

    root = paths.checkout_root()
    if root is None:
        pytest.skip("needs the checkout's examples/")
    ex = f"{__import__('sys').executable} {root / 'examples' / 'ddp_train.py'} --steps 15"
    rc = _run(["exec", "--target", target, "--workers", "4", "--log-dir",
               str(LOG_DIR / f"mn-exec-ddp-curve-{target}"), "--", "sh", "-c",
               f"{ex} --backend gloo && {ex} && {ex} && {ex} --sparse"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    curves = _loss_curves(out)
    assert len(curves) == 4 and all(len(c) == 15 for c in curves), out[-3000:]
    gloo = np.array(curves[0])
    for c in curves[1:]:
        assert np.abs(np.array(c) - gloo).max() <= 1e-6, (c, list(gloo))
    assert curves[1] == curves[2]  # a second run on the same topology, no reset: the same
    digests = re.findall(r"rank \d: parameters (\w+)", out)
    assert len(digests) == 16
    for k in range(1, 4):  # the homagg runs: identical replicas
        assert len(set(digests[4 * k:4 * k + 4])) == 1, digests


def test_exec_each_workload_on_the_homagg_backend_tracks_gloo(target, capsys):
    """The torch.distributed backend under homagg-net exec, 4 workers, only the backend's name
    changed from gloo: DDP without a hook, a hand-written dist.all_reduce loop, FSDP2 (its
    reduce_scatter through the switch) and HSDP. Each homagg run: bit-identical replicas,
    losses within 1e-6 of the same workload on gloo, the int64 metric exact on every rank,
    and more packets through the switch than the metric's one per step."""
    pytest.importorskip("torch", reason="torch not installed (optional extra)")
    from homagg import paths

    root = paths.checkout_root()
    if root is None:
        pytest.skip("needs the checkout's examples/")
    steps, workloads = 4, ("ddp", "loop", "fsdp", "hsdp")
    ex = f"{__import__('sys').executable} {root / 'examples' / 'ddp_train.py'} --steps {steps}"
    chain = " && ".join(f"{ex} --workload {w} --backend gloo && "
                        f"HOMAGG_TORCH_REDUCE_SCATTER=switch {ex} --workload {w} "
                        "--backend homagg" for w in workloads)
    rc = _run(["exec", "--target", target, "--workers", "4", "--log-dir",
               str(LOG_DIR / f"mn-exec-backend-{target}"), "--", "sh", "-c", chain])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    curves = _loss_curves(out)
    assert len(curves) == 2 * len(workloads), out[-3000:]
    for k, w in enumerate(workloads):
        gloo, homagg = curves[2 * k], curves[2 * k + 1]
        assert len(gloo) == len(homagg) == steps
        assert np.abs(np.array(homagg) - np.array(gloo)).max() <= 1e-6, (w, homagg, gloo)
    digests = re.findall(r"rank \d: parameters (\w+)", out)
    seen = re.findall(r"rank \d: samples seen (\d+)", out)
    sent = [int(n) for n in re.findall(r"rank \d: homagg sent (\d+) packets", out)]
    assert len(digests) == len(seen) == 4 * 2 * len(workloads), out[-3000:]
    assert set(seen) == {str(4 * 64 * steps)}  # every rank of every run: the metric exact
    for k in range(len(workloads)):  # the homagg runs: identical replicas
        assert len(set(digests[8 * k + 4:8 * k + 8])) == 1, (workloads[k], digests)
    assert len(sent) == 4 * len(workloads) and min(sent) > steps, sent


@pytest.mark.parametrize("workers,jobs,switch_slots", [(8, 4, 32), (16, 8, 64)])
def test_jobs_past_the_switch_slots_fall_back_and_every_one_is_exact(target, capsys, workers,
                                                                     jobs, switch_slots):
    """Jobs of 16 slots on a switch that lends homagg ``switch_slots``: half of them fit, the
    rest fall back to the software aggregator on host fb. All run at once, each checked bit
    for bit against its own data (bench mixes the job id into its data); homagg-ctl, given
    the topology's net.toml, lists where each job lives and counts both places."""
    from homagg.controller.cli import main as ctl
    from homagg.launcher.cli import run_agents
    from homagg.launcher.net import HomaggNet, NetOptions

    log_dir = LOG_DIR / f"mn-fallback-{jobs}-{target}"
    opts = NetOptions(workers=workers, target=target, jobs=jobs, slots=16,
                      switch_slots=switch_slots, log_dir=log_dir)
    with HomaggNet(opts) as net:
        on_fb = {j for j, pj in net.placed.items() if pj.place.role == "fallback"}
        assert on_fb == set(range(jobs // 2 + 1, jobs + 1))
        summaries = run_agents(net, ["bench", "--size", "100000", "--density", "0.02",
                                     "--iterations", "3", "--check"], echo_worker0=False)
        assert all(s["checked"] for s in summaries) and len(summaries) == workers
        cfg = ["-c", str(log_dir / "net.toml"), "--request-log", str(log_dir / "ctl.log")]
        capsys.readouterr()
        assert ctl(cfg + ["job", "list"]) == 0
        listing = capsys.readouterr().out
        assert ctl(cfg + ["stats", "--json"]) == 0
        st = json.loads(capsys.readouterr().out)
        assert ctl(cfg + ["stats"]) == 0
        stats_text = capsys.readouterr().out
    (log_dir / "job-list.txt").write_text(listing)
    (log_dir / "stats.txt").write_text(stats_text)
    rows = {int(r.split()[0]): r.split() for r in listing.splitlines()[2:]}
    assert sorted(rows) == list(range(1, jobs + 1))
    for j, row in rows.items():
        assert row[1:3] == (["fb", "(fallback)"] if j in on_fb else ["s1", "10.0.0.254"])
    assert set(st) == {"s1", "fb"}
    for name, mine in (("s1", set(range(1, jobs + 1)) - on_fb), ("fb", on_fb)):
        assert set(map(int, st[name]["jobs"])) == mine
        for j in mine:  # 2 workers x 3 iterations, several rounds each: all completed here
            assert st[name]["jobs"][str(j)]["JOB_STAT_COMPLETED"]["packets"] >= 3
        for drop in ("DROP_UNKNOWN_SENDER", "DROP_WRONG_IDENTITY", "DROP_BAD_SLOT"):
            assert st[name]["switch"][drop] == 0, (name, drop)
    if target == "bmv2":  # the fallback's traffic crossed the switch as routed IPv4
        assert sum(st["s1"]["forwarding"].values()) > 0


# -- trees (launcher/tree.py) -------------------------------------------------------------------


def _digest(out: str) -> str:
    m = re.search(r"identical models \((\w+)\)", out)
    assert m, out
    return m.group(1)


def test_leafspine_demo_trains_to_the_same_model_as_the_star(target, capsys):
    """The issue's test: 2 leaves of 4 workers train, bit for bit, to the 8-worker star's
    model, every aggregate exact."""
    tree_dir = LOG_DIR / f"mn-tree-demo-{target}"
    rc = _run(["demo", "--target", target, "--topo", "leafspine", "--leaves", "2",
               "--workers-per-leaf", "4", "--iterations", "4", "--log-dir", str(tree_dir)])
    tree = capsys.readouterr().out
    assert rc == 0, tree
    assert f"done on {target}" in tree and "every aggregate bit-exact" in tree
    rc = _run(["demo", "--target", target, "--workers", "8", "--iterations", "4",
               "--log-dir", str(LOG_DIR / f"mn-tree-star-{target}")])
    star = capsys.readouterr().out
    assert rc == 0, star
    assert _digest(tree) == _digest(star)
    # the agents ran under their leaves, with their rank in the whole job
    w5 = json.loads((tree_dir / "worker5.json").read_text())
    assert (w5["worker"], w5["rank"]) == (1, 5)


def test_leafspine_stays_exact_with_loss_at_every_agent(target, capsys):
    log_dir = LOG_DIR / f"mn-tree-loss-{target}"
    rc = _run(["run", "--target", target, "--topo", "leafspine", "--leaves", "2",
               "--workers-per-leaf", "2", "--inject-loss", "5", "--log-dir", str(log_dir),
               "--", "bench", "--size", "100000", "--iterations", "3", "--check"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "every aggregate exact" in out
    summary = json.loads((log_dir / "worker0.json").read_text())
    assert summary["retransmissions"] > 0


def _tree_agents(net, workers, *args):
    """homagg-agent bench on ``workers`` only (the others never start), a short deadline;
    each one's exit status and output. A new run (its own run number, join.p4)."""
    net.new_run()
    hosts = net.worker_hosts()
    procs = {w: net.popen(hosts[w], net.agent_command(w, "--deadline", "3", "bench", "--size",
                                                       "20000", "--iterations", "2", *args))
             for w in workers}
    outs = {w: p.communicate(timeout=120)[0] for w, p in procs.items()}
    return {w: (procs[w].returncode, outs[w]) for w in procs}


def test_leafspine_names_a_dead_worker_and_a_dead_leaf(target):
    from homagg.launcher.net import NetOptions
    from homagg.launcher.tree import TreeNet

    opts = NetOptions(target=target, topo="leafspine", leaves=2, workers_per_leaf=2,
                      fallback=False, log_dir=LOG_DIR / f"mn-tree-dead-{target}")
    with TreeNet(opts) as net:
        # a run of every worker, leaf2 included
        for rc, out in _tree_agents(net, [0, 1, 2, 3], "--check").values():
            assert rc == 0 and "every aggregate exact" in out, out
        # the next run, without worker 3 (leaf2's second): leaf2's other worker names it;
        # leaf1's workers name leaf2, which the spine waits for
        got = _tree_agents(net, [0, 1, 2])
        for rc, out in got.values():
            assert rc == 1, out
        assert "waiting for worker(s) 1 to start" in got[2][1]
        for w in (0, 1):
            assert "waits for leaf2" in got[w][1] and "from leaf1" in got[w][1], got[w][1]
        # then leaf2 dies: leaf1's workers (a new run) name it
        net.kill_leaf(1)
        got = _tree_agents(net, [0, 1])
        for rc, out in got.values():
            assert rc == 1 and "waits for leaf2" in out, out


def test_leafspine_runs_two_jobs_at_once_each_exact_at_its_own_parent(target):
    """--topo leafspine --jobs 2: each leaf's 4 workers split 2 + 2 into two jobs, each a
    child job of its own on every leaf going up from a port of its own (0xBEE0, 0xBEE1) to its
    own job at the spine. Both run at once, each checked bit for bit against its own data
    (bench mixes the job id in); the spine's counters show each job's partials at its own
    parent job, and nothing refused or dropped as another job's."""
    from homagg.launcher.cli import run_agents
    from homagg.launcher.net import NetOptions
    from homagg.launcher.tree import TreeNet

    opts = NetOptions(target=target, topo="leafspine", leaves=2, workers_per_leaf=4, jobs=2,
                      log_dir=LOG_DIR / f"mn-tree-jobs-{target}")
    with TreeNet(opts) as net:
        assert "job 2: a tree" in net.placement()
        summaries = run_agents(net, ["bench", "--size", "100000", "--iterations", "3",
                                     "--check"], echo_worker0=False)
        stats = net.stats_all()
    assert len(summaries) == 8 and all(s["checked"] for s in summaries)
    # leaf1's workers h1, h2 are job 1's, h3, h4 job 2's; leaf2's likewise; ranks per job
    assert [(s["job"], s["worker"], s["rank"]) for s in summaries] == [
        (1, 0, 0), (1, 1, 1), (2, 0, 0), (2, 1, 1), (1, 0, 2), (1, 1, 3), (2, 0, 2), (2, 1, 3)]
    spine = stats["spine"]
    for j in (1, 2):
        # every round (the joins included) complete at the spine came down to both leaves,
        # and the spine took one partial per leaf per round (resent ones are not accepted)
        rounds = [stats[f"leaf{i}"]["jobs"][j]["JOB_STAT_COMPLETED"]["packets"] for i in (1, 2)]
        assert rounds[0] == rounds[1] == spine["jobs"][j]["JOB_STAT_COMPLETED"]["packets"] > 3
        assert spine["jobs"][j]["JOB_STAT_ACCEPTED"]["packets"] == sum(rounds)
    for drop in ("DROP_UNKNOWN_SENDER", "DROP_WRONG_IDENTITY", "DROP_FORGED_RESULT"):
        for name, st in stats.items():
            assert st["switch"][drop] == 0, (name, drop)


def test_exec_on_a_tree_runs_the_ddp_example_to_the_stars_model(target, capsys):
    """homagg-net exec --topo leafspine: each worker's environment names its leaf (its id
    there, the leaf's size, the spine's children) and its rank in the whole job; the DDP
    example (whose gloo process group crosses the tree) ends with the 4-worker star's
    parameters, bit for bit, on every replica."""
    pytest.importorskip("torch", reason="torch not installed (optional extra)")
    from homagg import paths

    root = paths.checkout_root()
    if root is None:
        pytest.skip("needs the checkout's examples/")
    ex = f"{__import__('sys').executable} {root / 'examples' / 'ddp_train.py'} --steps 3"
    env = ('echo "$HOMAGG_WORKER $HOMAGG_WORKERS $HOMAGG_LOCAL_WORKERS $HOMAGG_SIBLINGS '
           '$HOMAGG_SWITCH $RANK $WORLD_SIZE $MASTER_ADDR"')
    rc = _run(["exec", "--target", target, "--topo", "leafspine", "--leaves", "2",
               "--workers-per-leaf", "2", "--log-dir", str(LOG_DIR / f"mn-tree-exec-{target}"),
               "--", "sh", "-c", f"{env} && {ex}"])
    tree = capsys.readouterr().out
    assert rc == 0, tree[-3000:]
    assert "[w3] 1 4 2 leaf1,leaf2 10.0.0.201:48864 3 4 10.0.0.1" in tree
    assert "[w0] 0 4 2 leaf1,leaf2 10.0.0.200:48864 0 4 10.0.0.1" in tree
    rc = _run(["exec", "--target", target, "--workers", "4", "--log-dir",
               str(LOG_DIR / f"mn-tree-exec-star-{target}"), "--", "sh", "-c", ex])
    star = capsys.readouterr().out
    assert rc == 0, star[-3000:]
    digests = [set(re.findall(r"rank \d: parameters (\w+)", out)) for out in (tree, star)]
    assert len(digests[0]) == 1 and digests[0] == digests[1], (tree[-2000:], star[-2000:])
    assert len(re.findall(r"rank \d: parameters", tree)) == 4


def test_leafspine_root_falls_back_when_the_spine_is_full_and_stays_exact(target):
    """--topo leafspine --jobs 2 with a spine that lends homagg one job's slots: job 1's root
    is the spine, job 2's falls back to the software aggregator on host fb, and the leaves'
    uplinks of job 2 point there (through the spine, as routed IPv4). Both jobs run at once,
    each exact; each root took one partial per leaf per round. (A leaf's child job never
    falls back: its workers and its parent's answers arrive at its leaf.)"""
    from homagg.launcher.cli import run_agents
    from homagg.launcher.net import FALLBACK_IP, NetOptions
    from homagg.launcher.tree import TreeNet

    opts = NetOptions(target=target, topo="leafspine", leaves=2, workers_per_leaf=4, jobs=2,
                      slots=16, switch_slots=16, log_dir=LOG_DIR / f"mn-tree-fb-{target}")
    with TreeNet(opts) as net:
        assert {j: pj.place.role for j, pj in net.placed.items()} == {1: "switch",
                                                                      2: "fallback"}
        assert "job 2: a tree" in net.placement() and "fell back" in net.placement()
        assert net.leaf_config(0).jobs[1].uplink.ip == FALLBACK_IP
        summaries = run_agents(net, ["bench", "--size", "100000", "--iterations", "3",
                                     "--check"], echo_worker0=False)
        stats = net.stats_all()
    assert len(summaries) == 8 and all(s["checked"] for s in summaries)
    assert set(stats["spine"]["jobs"]) == {1} and set(stats["fb"]["jobs"]) == {2}
    for j, root in ((1, "spine"), (2, "fb")):
        rounds = [stats[f"leaf{i}"]["jobs"][j]["JOB_STAT_COMPLETED"]["packets"] for i in (1, 2)]
        assert rounds[0] == rounds[1] == stats[root]["jobs"][j]["JOB_STAT_COMPLETED"][
            "packets"] > 3
        assert stats[root]["jobs"][j]["JOB_STAT_ACCEPTED"]["packets"] == sum(rounds)
    for drop in ("DROP_UNKNOWN_SENDER", "DROP_WRONG_IDENTITY", "DROP_FORGED_RESULT",
                 "DROP_SPOOFED"):
        for name, st in stats.items():
            assert st["switch"][drop] == 0, (name, drop)


def test_bench_models_runs_the_four_models_at_tiny_shapes(target, tmp_path):
    """``bench.models`` end to end, quickly: the paper's four models at ``--shape tiny``, 4
    workers, unshaped links, every variant; its table's rows are there and sane."""
    pytest.importorskip("torch", reason="torch not installed (optional extra)")
    from bench.models import main

    out = tmp_path / "models.json"
    assert main(["--targets", target, "--rates", "0", "--shape", "tiny", "--steps", "2",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    got = {(r["model"], r["variant"]) for r in rows}
    assert got == {(m, v) for m in ("ncf", "lstm", "vgg19", "bert")
                   for v in ("gloo", "homagg", "homagg dense")}
    for r in rows:
        assert r["step_ms"] > 0 and r["max_rss_mb"] > 0
        assert all(np.isfinite(r["losses"]))
        if r["variant"] == "gloo":
            assert r["vs_gloo"] == 1.0
        elif r["variant"] == "homagg dense":  # every element's word at least once (bmv2's
            assert r["wire_vs_dense"] >= 1.0, r  # drops add retransmissions on top)
        else:  # homagg's agents counted what they sent
            assert r["wire_vs_dense"] > 0, r
