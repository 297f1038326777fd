"""Issue 49's "done when" for local reduction, as a user runs it: plain DDP on the homagg
backend under ``homagg-net local``, torchrun's ranks joining through the service by themselves.

* Two torchrun nodes of 2 ranks on loopback (``--nnodes 2``, a c10d rendezvous): the switch
  accepts at most 0.6x the packets it accepts with HOMAGG_LOCAL_REDUCE=0 (a worker per rank);
  both runs end with the same parameters on every rank, bit for bit (and the same as each
  other: the sums are the same integers), and their losses are within 1e-6 of gloo's.
* One node of 8 ranks: at most 1/8 of a worker per rank's packets, plus 10%.

The switch's count is the software aggregator's STAT_ACCEPTED (``homagg-ctl stats``), read after
the job: every packet of every worker, joins included.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # (conftest.py) torchrun runs of 4 and 8 ranks

pytest.importorskip("torch")
pytest.importorskip("p4runtime_sh")
pytest.importorskip("prometheus_client")

from bench.torch_ranks import (  # noqa: E402
    ROOT,
    STATS,
    STEPS,
    accepted,
    clean_env,
    digests,
    launch,
    losses,
    torchrun,
    two_nodes,
)


@pytest.mark.parametrize("backend", ["homagg", "hook"])
def test_two_torchrun_nodes_of_two_ranks_send_the_switch_half_the_packets(tmp_path, backend):
    """``homagg``: plain DDP on the backend (the process group reduces locally); ``hook``: a
    gloo group and the DDP hook, its agent from ``homagg.torch.hook_agent``."""
    args = ("--backend", backend)
    on = launch(two_nodes(tmp_path, "on", *args), tmp_path, local_reduce=True)
    off = launch(two_nodes(tmp_path, "off", *args), tmp_path, local_reduce=False)
    for out in (on, off):
        d = digests(out)
        assert sorted(d) == [0, 1, 2, 3] and len(set(d.values())) == 1, out[-2000:]
        assert len(losses(out)) == STEPS
    # the same integers summed either way: the same parameters, bit for bit
    assert set(digests(on).values()) == set(digests(off).values())
    assert accepted(on) <= 0.6 * accepted(off), (accepted(on), accepted(off))
    print(f"{backend}: the switch accepted {accepted(on)} packets with local reduction, "
          f"{accepted(off)} with a worker per rank")

    gloo = subprocess.run(torchrun("--backend", "gloo"), env=clean_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert gloo.returncode == 0, gloo.stdout[-2000:] + gloo.stderr[-2000:]
    ref = losses(gloo.stdout)
    assert len(ref) == STEPS
    for out in (on, off):
        assert max(abs(a - b) for a, b in zip(losses(out), ref)) <= 1e-6, (losses(out), ref)


def test_one_node_of_eight_ranks_sends_an_eighth_of_the_packets(tmp_path):
    eight = [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "8", str(ROOT / "examples" / "ddp_train.py"),
             "--steps", str(STEPS), "--backend", "homagg"]
    script = f"{' '.join(eight)} && {STATS}"
    on = launch(script, tmp_path, local_reduce=True)
    off = launch(script, tmp_path, local_reduce=False)
    for out in (on, off):
        d = digests(out)
        assert sorted(d) == list(range(8)) and len(set(d.values())) == 1, out[-2000:]
    assert set(digests(on).values()) == set(digests(off).values())
    assert accepted(on) <= accepted(off) / 8 * 1.1, (accepted(on), accepted(off))
    print(f"8 ranks: the switch accepted {accepted(on)} packets with local reduction, "
          f"{accepted(off)} with a worker per rank")
