"""``python -m bench.chaos_soak`` for half a minute (issue 57): a star and a 2-leaf tree of
software aggregators, each behind a ``homagg-ctl serve`` process, while leaves, the
aggregator and the services are killed and started again. Every job exact or failed with a
named reason, and nothing left held on any switch or by any service."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("p4runtime_sh")

pytestmark = pytest.mark.slow  # (conftest.py) four aggregators, two services, ~1.5 minutes

ROOT = Path(__file__).resolve().parents[1]


def test_a_short_chaos_soak_leaves_nothing_held_and_every_failure_named(tmp_path):
    run = subprocess.run([sys.executable, "-m", "bench.chaos_soak", "--minutes", "0.5",
                          "--seed", "7", "--fault-min", "2", "--fault-max", "4",
                          "--workdir", str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    jobs = int(re.search(r"^jobs run: (\d+)$", out, re.M).group(1))
    exact = int(re.search(r"^jobs exact: (\d+)$", out, re.M).group(1))
    named = int(re.search(r"^jobs failed with a named reason: (\d+)", out, re.M).group(1))
    faults = int(re.search(r"^faults injected: (\d+)", out, re.M).group(1))
    assert jobs > 0 and faults >= 3, out
    assert exact + named == jobs, out
    assert "jobs failed WITHOUT a named reason: 0\n" in out
    assert "left held at the end: 0 job ids, 0 slots on the switches; services hold 0 jobs, " \
           "owe 0 removals\n" in out
    per_request = int(re.search(r"(\d+) bytes per request", out).group(1))
    assert per_request < 300, out
