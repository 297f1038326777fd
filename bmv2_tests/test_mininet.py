"""End to end under Mininet, on both targets: the demo's training, and agents under loss.

Needs root and Mininet (./run.sh setup installs it); the bmv2 half also needs bmv2 and p4c.
"""

from __future__ import annotations

import json
import re

import pytest

from bmv2_tests.conftest import LOG_DIR


@pytest.fixture
def target(net_target):
    return net_target


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
