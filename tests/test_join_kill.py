"""A rank killed mid-run: its peers' error names it, the service frees the job within its
lease, and a new run of the same job name (an elastic restart) joins and completes.

Workers are processes (a kill must be a real one), joining through the service with
torchrun's variables set by hand; the service and a software aggregator run in this process
on kernel-given ports. Every sum is checked bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("p4runtime_sh")

from homagg.controller.p4client import P4RuntimeSwitch  # noqa: E402
from homagg.controller.serve import start  # noqa: E402
from homagg.controller.service import JobService, ServeOptions  # noqa: E402
from homagg.launcher.local import LocalAggregator  # noqa: E402

pytestmark = pytest.mark.slow  # (conftest.py) processes killed mid-run, leases run out

ROOT = Path(__file__).resolve().parents[1]
LEASE = 2.0

# One worker: joins from its environment, then all-reduces until told to stop (a vote in the
# sum's last word, so every rank stops after the same round) or an error, printing progress.
WORKER = r"""
import sys, numpy as np
from homagg.host_agent import Agent, AgentConfig, AgentError
rank, world, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cfg = AgentConfig.from_env(deadline=float(sys.argv[4]))
print(f"joined job {cfg.job} worker {cfg.worker} run {cfg.run}", flush=True)
try:
    with Agent(cfg) as agent:
        for it in range(rounds):
            xs = [np.random.default_rng([it, w]).integers(-2**24, 2**24, 20000).astype(np.int32)
                  for w in range(world)]
            got = agent.allreduce_int(xs[rank])
            assert np.array_equal(got, np.sum(xs, axis=0, dtype=np.int64)), it
            print(f"round {it} exact", flush=True)
except AgentError as e:
    print(f"ERROR {e}", flush=True)
    sys.exit(3)
print("done", flush=True)
"""


def connect(place):
    return P4RuntimeSwitch(place.grpc, place.device_id, (0, 2), None, place.name).open()


@pytest.fixture
def served(tmp_path):
    agg = LocalAggregator(workdir=tmp_path).start()
    svc = JobService(agg.config, connect, ServeOptions(token="t", lease=LEASE, slots=16))
    srv = start(svc, "127.0.0.1:0")
    yield agg, svc, srv
    srv.stop()
    agg.stop()


def spawn(srv, rank: int, world: int, rounds: int, deadline: float) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMAGG_")}
    env.update(PYTHONPATH=str(ROOT), HOMAGG_CONTROLLER=srv.address, HOMAGG_TOKEN="t",
               RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="10.1.2.3",
               MASTER_PORT="29500", TORCHELASTIC_RUN_ID="none",
               HOMAGG_JOIN_SECRET="join-secret-of/the-killed-job")
    return subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(world), str(rounds),
                             str(deadline)], env=env, stdout=subprocess.PIPE, text=True)


def read_until(p: subprocess.Popen, text: str) -> list[str]:
    lines = []
    assert p.stdout is not None
    for line in p.stdout:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"{text!r} never came: {''.join(lines)}")


def test_a_killed_rank_is_named_its_job_freed_and_an_elastic_restart_completes(served):
    agg, svc, srv = served
    world = 4
    procs = [spawn(srv, r, world, 10**6, deadline=3.0) for r in range(world)]
    try:
        read_until(procs[2], "round 2 exact")
        (job,) = svc.held
        procs[2].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        # when the service frees the job, watched from now: the peers' own deadline (3 s) and
        # their exit come after it and are no part of it
        freed_at: list[float] = []

        def watch() -> None:
            while job in svc.held and time.monotonic() - killed_at < LEASE + 5:
                time.sleep(0.02)
            freed_at.append(time.monotonic())

        watcher = threading.Thread(target=watch)
        watcher.start()
        for r in (0, 1, 3):
            out, _ = procs[r].communicate(timeout=60)
            assert procs[r].returncode == 3, out[-2000:]
            err = out.strip().splitlines()[-1]
            assert err.startswith(f"ERROR job {job} worker {r}: no result"), err
            # by the switch's status (the round waits for it), or by the service (its lease)
            assert "waiting for worker(s) 2 (dead" in err or "worker 2 (127.0.0.1:" in err, err
        # freed within its lease (and the reaper's period), named in the removal
        watcher.join()
        assert job not in svc.held
        assert freed_at[0] - killed_at < LEASE + 2.0
        assert svc._gone[job][0].startswith(f"job {job} (10.1.2.3:29500/none) was removed: its "
                                         "lease ran out: worker 2 (127.0.0.1:")
        # torchrun restarting the job: the same name, every rank again; it joins and completes
        procs = [spawn(srv, r, world, 5, deadline=20.0) for r in range(world)]
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out[-2000:]
            assert out.count(" exact") == 5 and out.endswith("done\n"), out
        assert svc.held == {}  # they all left
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_survivors_stop_once_the_service_removed_their_job_not_at_their_deadline(served):
    """A rank killed; its peers wait with a 60 s deadline, but the service removes the job
    when the dead rank's lease runs out (2 s), tells the survivors' next renewal, and they
    fail then, quoting it."""
    agg, svc, srv = served
    world = 3
    procs = [spawn(srv, r, world, 10**6, deadline=60.0) for r in range(world)]
    try:
        read_until(procs[1], "round 2 exact")
        (job,) = svc.held
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        for r in (0, 2):
            out, _ = procs[r].communicate(timeout=90)
            assert procs[r].returncode == 3, out[-2000:]
            err = out.strip().splitlines()[-1]
            assert err.startswith(f"ERROR job {job} worker {r}: no result"), err
            assert "the controller says: job" in err and "worker 1 (127.0.0.1:" in err, err
        # the lease, a renewal's interval (a third of it), the round's second of silence
        assert time.monotonic() - killed_at < LEASE + LEASE / 3 + 1.0 + 6.0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
