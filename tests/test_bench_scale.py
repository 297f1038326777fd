"""``python -m bench.scale`` small (issue 49, item 4): both layouts placed by the service on a
three-level tree and summed through the switch model, each with its exact line, and the racks'
tree refusing the per-rank layout with the service's message."""

from __future__ import annotations

import re
import subprocess
import sys


def scale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.scale", *args], capture_output=True,
                          text=True, timeout=120)


def test_a_small_scale_run_is_exact_in_both_layouts():
    p = scale("--hosts", "16", "--ranks-per-host", "4", "--hosts-per-leaf", "4",
              "--ranks-per-leaf", "8", "--elements", "300")
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert re.search(r"^per host: 16 switch workers \(4 ranks each\) on 4 leaves", out, re.M)
    assert "switch workers per switch: spine 2 (x1), middle 2 (x2), leaf 4 (x4)" in out
    assert re.search(r"^per rank: 64 switch workers \(1 rank each\) on 8 leaves", out, re.M)
    assert "switch workers per switch: spine 3 (x1), middle 2-3 (x3), leaf 8 (x8)" in out
    exact = re.findall(r"^  exact: all 64 ranks' sums equal the integer sum bit for bit, "
                       r"0 rescales \(no round flagged an int32 overflow\)$", out, re.M)
    assert len(exact) == 2, out
    assert re.search(r"^  joins: 16 in [\d.]+ s", out, re.M)
    assert "MISMATCH" not in out


def test_the_racks_tree_refuses_a_switch_worker_per_rank():
    p = scale("--hosts", "32", "--ranks-per-host", "8", "--hosts-per-leaf", "16",
              "--ranks-per-leaf", "64", "--elements", "64")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "per rank on the racks' tree: 256 switch workers (1 rank each) on 2 leaves of 128 " \
           "switch workers" in p.stdout
    assert "  refused by the service: job \"per rank on the racks' tree\": world size 256: 1 " \
           "to 128 workers per job on this tree of switches (64 under each of its 2 switches " \
           "with hosts)\n" in p.stdout, p.stdout
    assert len(re.findall(r"^  exact: all 256 ranks' sums", p.stdout, re.M)) == 2
