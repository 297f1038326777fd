"""Reliability and security under faults and hostile input, under Mininet, on both targets.

Every case asserts bit-exact sums (the agents' --check recomputes every worker's tensor and
compares each aggregate with the integer sum) or a specific, clear error. Needs root and Mininet;
the bmv2 half also needs bmv2 and p4c. Figures are recorded in docs/reliability.md.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from bmv2_tests.conftest import LOG_DIR
from bmv2_tests.fuzz import EXPECT
from homagg.launcher.net import HomaggNet, NetOptions, host_ip, host_mac
from tests.staging import wait_for


@pytest.fixture
def target(net_target):
    return net_target


def opts(target, name, **kw) -> NetOptions:
    o = NetOptions(target=target, **kw)
    o.log_dir = LOG_DIR / f"rel-{name}-{target}"
    return o


def start_agents(net: HomaggNet, *args: str, tag: str = "run") -> list[subprocess.Popen]:
    """homagg-agent on every worker: a new run (its own run number, join.p4)."""
    net.new_run()
    procs = []
    for w, h in enumerate(net.worker_hosts()):
        out = net.opts.log_dir / f"{tag}-worker{w}.out"
        wargs = [str(net.opts.log_dir / f"worker{w}.json") if x == "{json}" else x for x in args]
        procs.append(net.popen(h, net.agent_command(w, *wargs), out))
    return procs


def until_rounds(net, procs, rounds: int = 20, timeout: float = 60.0) -> None:
    """Wait until the switch has completed ``rounds`` rounds of the running job (its
    workers joined and are well into their run), while every agent still runs."""
    wait_for(lambda: net.stats()["switch"]["STAT_COMPLETED"] >= rounds
             or any(p.poll() is not None for p in procs), timeout, f"{rounds} rounds")
    assert all(p.poll() is None for p in procs), "an agent stopped before the fault"


def finish(net, procs, tag="run", timeout=240) -> list[tuple[int, str]]:
    results = []
    for w, p in enumerate(procs):
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = "hung"
        results.append((rc, (net.opts.log_dir / f"{tag}-worker{w}.out").read_text()))
    return results


def assert_all_exact(results):
    for w, (rc, out) in enumerate(results):
        assert rc == 0 and "every aggregate exact" in out, f"worker {w} (rc {rc}):\n{out[-2000:]}"


def test_fuzzed_packets_during_a_job_leave_sums_exact_and_are_counted(target):
    with HomaggNet(opts(target, "fuzz")) as net:
        procs = start_agents(net, "bench", "--size", "200000", "--iterations", "30", "--check")
        cats = [c for c in EXPECT if not (target == "soft" and c == "spoofed_peer")]
        sent_file = net.opts.log_dir / "fuzz-sent.json"
        h1 = net.worker_hosts()[0]
        fuzz = net.popen(h1, [sys.executable, "-m", "bmv2_tests.fuzz", "--iface",
                              str(h1.defaultIntf()), "--src", host_ip(0), "--mac", host_mac(0),
                              "--job", "1", "--worker", "0", "--slots", str(net.opts.slots),
                              "--key", str(net.job_key(1)),
                              "--peer", host_ip(1), "--count", "40", "--seed", "7",
                              "--categories", *cats, "--out", str(sent_file)],
                         net.opts.log_dir / "fuzz.out")
        assert fuzz.wait(120) == 0, (net.opts.log_dir / "fuzz.out").read_text()
        assert_all_exact(finish(net, procs))
        stats = net.stats()["switch"]
    sent = json.loads(sent_file.read_text())
    expected: dict[str, int] = {}
    for c, n in sent.items():
        expected[EXPECT[c]] = expected.get(EXPECT[c], 0) + n
    for counter, n in expected.items():
        assert stats[counter] == n, f"{counter}: switch counted {stats[counter]}, fuzzer sent {n}"
    assert sum(sent.values()) == 40 * len(cats)


def test_dead_worker_is_named_within_the_deadline_and_the_next_run_is_exact(target):
    with HomaggNet(opts(target, "dead")) as net:
        procs = start_agents(net, "--deadline", "3", "bench", "--size", "100000",
                             "--iterations", "100000", tag="long")
        until_rounds(net, procs)
        procs[3].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        results = finish(net, procs[:3], tag="long", timeout=30)
        elapsed = time.monotonic() - t_kill
        for w, (rc, out) in enumerate(results):
            assert rc == 1, f"worker {w} should fail, rc {rc}:\n{out[-1500:]}"
            assert "waiting for worker(s)" in out and "3" in out.split("waiting for worker(s)")[1]
            assert f"job 1 worker {w}" in out
        assert elapsed < 3 + 10, f"errors took {elapsed:.1f} s after the kill"

        # No reset: the next run joins, gets a new generation, and the dead run's unfinished
        # rounds are empty to it (join.p4).
        procs = start_agents(net, "bench", "--size", "100000", "--iterations", "5", "--check",
                             tag="after")
        assert_all_exact(finish(net, procs, tag="after"))


def test_switch_restart_mid_job_recovers_or_fails_clearly(target):
    iterations = "400" if target == "soft" else "150"  # about 10 s on this machine
    with HomaggNet(opts(target, "restart")) as net:
        procs = start_agents(net, "--deadline", "5", "bench", "--size", "100000",
                             "--iterations", iterations, "--check", tag="long")
        until_rounds(net, procs)
        net.restart_switch()
        results = finish(net, procs, tag="long", timeout=120)
        outcomes = []
        for w, (rc, out) in enumerate(results):
            assert "differs from the exact integer sum" not in out, out[-1500:]
            if rc == 0:
                assert "every aggregate exact" in out
                outcomes.append("recovered")
            else:
                assert rc == 1 and "no result for slot" in out, \
                    f"worker {w} rc {rc}:\n{out[-1500:]}"
                outcomes.append("failed clearly")
        print(f"after a {target} restart: {outcomes}")
        # The restarted switch serves a new run exactly after a reset: its join registers
        # restarted with it, so the next join could hand out the generation the surviving
        # run kept using (docs/protocol.md, "The join, runs and generations": limits).
        net.reset_jobs()
        procs = start_agents(net, "bench", "--size", "100000", "--iterations", "5", "--check",
                             tag="after")
        assert_all_exact(finish(net, procs, tag="after"))


def test_two_concurrent_jobs_are_each_exact(target):
    with HomaggNet(opts(target, "twojobs", jobs=2)) as net:
        procs = start_agents(net, "bench", "--size", "200000", "--iterations", "20", "--check")
        assert_all_exact(finish(net, procs))
        stats = net.stats()
    assert set(stats["jobs"]) == {1, 2}
    for j in (1, 2):
        assert stats["jobs"][j]["JOB_STAT_COMPLETED"]["packets"] > 0


def _summaries(net) -> list[dict]:
    return [json.loads((net.opts.log_dir / f"worker{w}.json").read_text())
            for w in range(net.opts.workers)]


@pytest.mark.parametrize("loss", [1, 5, 10])
def test_loss_duplication_and_reordering_stay_exact_for_100_iterations(target, loss):
    # This kernel has no netem: the agents inject the faults at their sockets, both ways.
    o = opts(target, f"loss{loss}")
    o.agent_args = ("--inject-loss", str(loss), "--inject-dup", "1", "--inject-reorder", "5")
    with HomaggNet(o) as net:
        procs = start_agents(net, "--summary-json", "{json}", "bench", "--size", "50000",
                             "--iterations", "100", "--check")
        results = finish(net, procs, timeout=600)
        assert_all_exact(results)
        summaries = _summaries(net)
    dropped = sum(s["injected"]["dropped_out"] + s["injected"]["dropped_in"] for s in summaries)
    print(f"{target} loss {loss}%: 100 iterations exact, {dropped} datagrams dropped, "
          f"{sum(s['injected']['duplicated'] for s in summaries)} duplicated, "
          f"{sum(s['injected']['reordered'] for s in summaries)} reordered, "
          f"{sum(s['retransmissions'] for s in summaries)} retransmissions, "
          f"{max(s['seconds'] for s in summaries):.1f} s")
    assert dropped > 0 and all(s["retransmissions"] > 0 for s in summaries)


def test_overflowing_sums_are_flagged_and_rescaled_never_wrapped(target):
    o = opts(target, "overflow")
    o.agent_args = ("--shift-bias", "6")  # every worker: a scale 6 bits too fine
    with HomaggNet(o) as net:
        procs = start_agents(net, "--summary-json", "{json}", "bench", "--size", "20000",
                             "--density", "0.5", "--iterations", "5", "--same-tensor",
                             "--check")
        assert_all_exact(finish(net, procs))
        summaries = _summaries(net)
        stats = net.stats()["switch"]
    assert all(s["rescales"] >= 1 for s in summaries)
    assert stats["STAT_OVERFLOW"] >= 1
