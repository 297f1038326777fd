"""Issue 24's "done when": ``homagg-net local -- torchrun --nproc-per-node 4
examples/ddp_train.py`` with nothing else set, no root.

The 4 ranks join through the controller service by themselves (torchrun's variables), end
with bit-identical parameters, and their losses match plain gloo's to 1e-6; the command runs
twice in a row with no step between, and afterwards ``homagg-ctl job list`` shows no job.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # (conftest.py) torchrun runs of 4 ranks, each a process tree

pytest.importorskip("torch")
pytest.importorskip("p4runtime_sh")
pytest.importorskip("prometheus_client")

from bench.torch_ranks import (  # noqa: E402
    STEPS,
    clean_env,
    digests,
    losses,
    packets,
    rounds,
    torchrun,
)


def test_local_torchrun_twice_bit_identical_ranks_losses_as_gloo_and_no_job_left(tmp_path):
    q = " ".join
    script = (f"{q(torchrun())} && echo '=== second run' && {q(torchrun())} && "
              f"echo '=== job list' && {sys.executable} -m homagg.controller.cli "
              '-c "$HOMAGG_CTL_CONFIG" job list')
    proc = subprocess.run([sys.executable, "-m", "homagg.launcher", "local", "--", "sh", "-c",
                           script], env=clean_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    first, rest = out.split("=== second run")
    second, listing = rest.split("=== job list")
    assert listing.strip() == "no jobs installed"
    for run in (first, second):
        d = digests(run)
        assert sorted(d) == [0, 1, 2, 3], run[-2000:]
        assert len(set(d.values())) == 1, d  # the 4 ranks: bit-identical parameters
        assert len(losses(run)) == STEPS
    assert digests(first) == digests(second)  # exact sums: the same model, run after run
    assert losses(first) == losses(second)

    gloo = subprocess.run(torchrun("--backend", "gloo"), env=clean_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert gloo.returncode == 0, gloo.stdout[-2000:] + gloo.stderr[-2000:]
    ref = losses(gloo.stdout)
    assert len(ref) == STEPS
    assert max(abs(a - b) for a, b in zip(losses(first), ref)) <= 1e-6, (losses(first), ref)


def test_local_passes_on_the_commands_exit_status(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "homagg.launcher", "local", "--", "sh", "-c",
                           'test -n "$HOMAGG_CONTROLLER" && test -n "$HOMAGG_TOKEN" && exit 7'],
                          env=clean_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 7, proc.stdout + proc.stderr


def test_local_slots_is_each_jobs_region(tmp_path):
    probe = ("from homagg.host_agent import AgentConfig; c = AgentConfig.from_env(); "
             "print('slots', c.slots, 'job', c.job); c.membership.leave()")
    env = clean_env() | {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": "1"}
    proc = subprocess.run([sys.executable, "-m", "homagg.launcher", "local", "--slots", "8",
                           "--switch-slots", "32", "--", sys.executable, "-c", probe],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "slots 8 job 1" in proc.stdout, proc.stdout


@pytest.mark.parametrize("workload", ["ddp", "loop", "fsdp", "hsdp", "hsdp2"])
def test_local_torchrun_each_workload_on_the_homagg_backend_tracks_gloo(tmp_path, workload):
    """The one-string change, under ``homagg-net local -- torchrun`` with 4 ranks: DDP without
    a hook, a hand-written loop of dist.all_reduce(AVG), FSDP2 (its reduce_scatter through
    the switch), HSDP (4 x 1) and HSDP on a 2 x 2 mesh (its replicate groups subgroups that
    join jobs of their own through the service) on ``--backend homagg``, against the same
    workload on gloo. Every rank ends bit-identical, the losses within 1e-6 of gloo's, the
    int64 metric exact (the example checks it: every rank prints the samples the job saw),
    and the gradients went through the switch: each rank's default group sent more packets
    than the metric's one per step, or (hsdp2) each replicate subgroup did its all-reduces."""
    env = clean_env() | {"HOMAGG_TORCH_REDUCE_SCATTER": "switch"}
    args = ("--workload", workload)
    runs = {}
    for backend in ("homagg", "gloo"):
        cmd = torchrun(*args, "--backend", backend)
        if backend == "homagg":
            cmd = [sys.executable, "-m", "homagg.launcher", "local", "--", *cmd]
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[backend] = proc.stdout
    out = runs["homagg"]
    d = digests(out)
    assert sorted(d) == [0, 1, 2, 3] and len(set(d.values())) == 1, out[-2000:]
    seen = re.findall(r"rank \d: samples seen (\d+)", out)
    assert seen == [str(4 * 64 * STEPS)] * 4, out[-2000:]  # 4 ranks x 64 samples x STEPS
    sent, took = packets(out), rounds(out)
    # the default group's rounds: the metric's one per step, and the gradients' (on hsdp2
    # the replicate subgroups carry those: below). The 4 ranks are one host: they reduce
    # locally, and its leader (rank 0) alone sends, for all of them (test_local_reduce.py)
    assert sorted(sent) == sorted(took) == [0, 1, 2, 3], (sent, took)
    assert min(took.values()) >= STEPS if workload == "hsdp2" else min(took.values()) > STEPS, \
        took
    assert sent[0] >= took[0] and sent[1] == sent[2] == sent[3] == 0, sent
    replicate = {int(r): (int(n), int(p)) for r, n, p in re.findall(
        r"rank (\d): replicate group (\d+) switch all-reduces, (\d+) packets", out)}
    if workload == "hsdp2":
        # the replicate groups ({0, 2} and {1, 3}) are subgroups: each joined a job of its own
        # through the service, by itself, and its gradients' all-reduce went through the switch
        assert sorted(replicate) == [0, 1, 2, 3], out[-2000:]
        assert all(n >= STEPS and p > 0 for n, p in replicate.values()), replicate
    else:
        assert replicate == {}, replicate
    ref = losses(runs["gloo"])
    assert len(ref) == STEPS and len(losses(out)) == STEPS
    assert max(abs(a - b) for a, b in zip(losses(out), ref)) <= 1e-6, (losses(out), ref)


LAZY = '''
import os, subprocess, sys
import torch, torch.distributed as dist, homagg.torch
dist.init_process_group("homagg")
r = dist.get_rank()
def jobs():
    out = subprocess.run([sys.executable, "-m", "homagg.controller.cli", "-c",
                          os.environ["HOMAGG_CTL_CONFIG"], "job", "list"],
                         capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines()[2:] if line.strip()]
g = dist.new_group([0, 1])
t = torch.tensor([float(r)])
dist.broadcast(t, 0, group=g)  # gloo's: no job needed
dist.barrier()
if r == 0:
    print("jobs after gloo", jobs(), flush=True)
dist.barrier()
unmade = g.agent is None
x = torch.ones(10) * (r + 1)
dist.all_reduce(x, group=g)  # the subgroup's first collective through the switch: it joins
dist.barrier()
if r == 0:
    print("jobs after the switch", jobs(), flush=True)
dist.barrier()
print(f"rank {r}: unmade {unmade}, made {g.agent is not None}, sent "
      f"{g.agent.counters.packets_sent if g.agent else 0}, sum {x.tolist()}", flush=True)
dist.destroy_process_group()
'''


def test_a_subgroup_joins_at_its_first_collective_through_the_switch(tmp_path):
    """Under the service, a subgroup's job is joined when the subgroup first sends through
    the switch: after a broadcast (gloo's) the switch holds the default group's job alone;
    after an all_reduce, the subgroup's too, and its sum is right on both ranks."""
    script = tmp_path / "lazy.py"
    script.write_text(LAZY)
    cmd = [sys.executable, "-m", "homagg.launcher", "local", "--", sys.executable, "-m",
           "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, env=clean_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert re.search(r"jobs after gloo \['1'\]", out), out[-2000:]
    assert re.search(r"jobs after the switch \['1', '2'\]", out), out[-2000:]
    for r in (0, 1):
        m = re.search(rf"rank {r}: unmade True, made True, sent (\d+), sum \[([^\]]*)\]", out)
        assert m, out[-2000:]
        assert [float(v) for v in m.group(2).split(",")] == [3.0] * 10
    # each rank sent the subgroup's packets (subgroups keep a worker per rank)
    assert all(int(re.search(rf"rank {r}: unmade True, made True, sent (\d+)", out).group(1)) > 0
               for r in (0, 1)), out[-2000:]
