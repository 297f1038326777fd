"""``homagg-ctl serve`` as its own process, killed (SIGKILL: no goodbye) during a run and
started again at the same address: the run completes, the restarted process serves the
running job's leases (read back from the switch), and the next join is served.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("p4runtime_sh")

from homagg.host_agent import Agent, AgentConfig  # noqa: E402
from homagg.launcher.local import LocalAggregator  # noqa: E402

pytestmark = pytest.mark.slow  # (conftest.py) homagg-ctl serve as a process, killed and restarted

ROOT = Path(__file__).resolve().parents[1]


def serve(config: Path, listen: str) -> tuple[subprocess.Popen, str, str]:
    """The service's process, its gRPC address and its metrics URL (both printed first)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOMAGG_")}
    proc = subprocess.Popen([sys.executable, "-m", "homagg.controller.cli", "-c", str(config),
                             "serve", "--listen", listen, "--no-token", "--lease", "1.5",
                             "--metrics-port", "0", "--metrics-job-names"],
                            env=dict(env, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first, second = proc.stdout.readline(), proc.stdout.readline()
    assert first.startswith("serving joins at ") and first.strip().endswith("without a token"), \
        first + (proc.stderr.read() if proc.stderr else "")
    assert second.startswith("metrics at http://127.0.0.1:"), second
    return proc, first.split()[3], second.split()[2]


def accepted(url: str) -> float:
    """The running job's accepted packets, by curl (urllib without it), from the metrics."""
    curl = shutil.which("curl")
    if curl:
        text = subprocess.run([curl, "-sSf", url], capture_output=True, text=True, check=True,
                              timeout=30).stdout
    else:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    (value,) = re.findall(r'^homagg_job_packets_accepted_total\{[^}]*name="127\.0\.0\.1:9/run"'
                          r"[^}]*\} (\S+)$", text, re.M)
    return float(value)


def test_a_killed_and_restarted_service_the_run_completes_and_the_next_join_is_served(
        tmp_path):
    agg = LocalAggregator(workdir=tmp_path).start()
    proc, address, metrics = serve(agg.path, "127.0.0.1:0")
    world, errors, done, cfgs = 2, [], [0, 0], {}
    restarted = threading.Event()
    base: dict[int, int] = {}  # each worker's renewals when the service came back

    def env(name, rank, n):
        return {"HOMAGG_CONTROLLER": address, "RANK": str(rank), "WORLD_SIZE": str(n),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9", "TORCHELASTIC_RUN_ID": name,
                "HOMAGG_JOIN_SECRET": f"join-secret-of/{name}"}

    def worker(rank):
        try:
            cfg = cfgs[rank] = AgentConfig.from_env(env("run", rank, world), deadline=20.0)
            with Agent(cfg) as agent:
                it, votes = 0, 0
                while votes < world:  # all stop after the same round (the sum of the votes)
                    xs = [np.full(2000, it + 3 * w, np.int32) for w in range(world)]
                    xs[rank][-1] = (restarted.is_set()
                                    and cfg.membership.renewals >= base.get(rank, 1 << 30) + 2)
                    got = agent.allreduce_int(xs[rank])
                    votes = int(got[-1])
                    assert np.array_equal(got[:-1], np.sum(xs, axis=0, dtype=np.int64)[:-1])
                    it += 1
                    done[rank] = it
                    assert it < 10**6
        except BaseException as e:
            errors.append((rank, e))

    ts = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    try:
        for t in ts:
            t.start()
        while min(done) < 3 and not errors:
            time.sleep(0.01)
        before = accepted(metrics)  # the job's counters move during the run
        mark = min(done)
        while min(done) < mark + 2 and not errors:
            time.sleep(0.01)
        assert accepted(metrics) > before > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        during = min(done)
        while min(done) < during + 5 and not errors:  # the data path goes on without it
            time.sleep(0.01)
        proc, again, _ = serve(agg.path, address)
        assert again == address
        for r in range(world):
            base[r] = cfgs[r].membership.renewals
        restarted.set()
        for t in ts:
            t.join(60)
        assert not any(t.is_alive() for t in ts), "an agent hung"
        assert not errors, errors
        assert all(cfgs[r].membership.lost is None for r in range(world))
        listing = subprocess.run([sys.executable, "-m", "homagg.controller.cli", "-c",
                                  str(agg.path), "job", "list"], capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
        assert listing.stdout.strip() == "no jobs installed", listing.stdout + listing.stderr
        with Agent(AgentConfig.from_env(env("next", 0, 1))) as agent:
            assert np.array_equal(agent.allreduce_int(np.arange(9, dtype=np.int32)),
                                  np.arange(9))
    finally:
        restarted.set()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        agg.stop()
