"""The "homagg" backend under ``torch.compile`` (issue 56, item 1).

DDP's C++ reducer calls the process group back from inside a compiled forward (its bucket
rebuild's broadcast; with a BatchNorm, the buffers' broadcast at every forward) and waits on its
Work: Dynamo must not trace those Python frames (``distributed.untraced``). Here:

* ``examples/ddp_train.py --compile`` (with and without a BatchNorm) on 2 ranks under
  ``homagg-net local``, on the backend and with the hook, against the same compiled run on gloo:
  both ranks bit-identical, every loss within 1e-6 of gloo's, and the gradients' all-reduces
  went through the switch (each rank took part in the rounds; the leader sent the packets);
* the functional collectives called inside a compiled function, and compiled autograd with
  DDP's Python reducer: exact (dyadic values, whose sums the codec makes exactly) and through
  the switch;
* every method of the group and of its Work that torch declares, or that is public, is one
  Dynamo does not trace.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch not installed (optional extra)")
pytest.importorskip("p4runtime_sh")
pytest.importorskip("prometheus_client")
import torch.distributed as dist  # noqa: E402

from bench.torch_ranks import (  # noqa: E402
    ROOT,
    clean_env,
    digests,
    losses,
    packets,
    rounds,
    run_job,
)
from homagg.host_agent.distributed.group import HomaggProcessGroup  # noqa: E402
from homagg.host_agent.distributed.untraced import traced_methods  # noqa: E402
from homagg.host_agent.distributed.work import HomaggWork  # noqa: E402

STEPS = 8


def test_no_method_of_the_group_or_its_work_is_traced():
    assert traced_methods(HomaggProcessGroup, dist.ProcessGroup) == []
    assert traced_methods(HomaggWork, dist.Work) == []
    # (and the decorator did cover the collectives: each carries disable's mark)
    for name in ("allreduce", "broadcast", "allgather", "_allgather_base", "reduce_scatter",
                 "alltoall", "barrier", "send", "recv"):
        assert getattr(vars(HomaggProcessGroup)[name], "_torchdynamo_disable", False), name
    for name in ("wait", "get_future", "is_completed"):
        assert getattr(vars(HomaggWork)[name], "_torchdynamo_disable", False), name


def _train(tmp_path, backend: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "examples" / "ddp_train.py"), "--steps", str(STEPS), "--compile",
           "--backend", backend, *args]
    if backend != "gloo":
        cmd = [sys.executable, "-m", "homagg.launcher", "local", "--", *cmd]
    proc = subprocess.run(cmd, env=clean_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("batchnorm", [False, True], ids=["linear", "batchnorm"])
def test_compiled_ddp_trains_on_homagg_as_on_gloo(tmp_path, batchnorm):
    args = ("--batchnorm",) if batchnorm else ()
    ref = losses(_train(tmp_path, "gloo", *args))
    assert len(ref) == STEPS
    for backend in ("homagg", "hook"):
        out = _train(tmp_path, backend, *args)
        d = digests(out)
        assert sorted(d) == [0, 1] and len(set(d.values())) == 1, (backend, out[-2000:])
        got = losses(out)
        assert len(got) == STEPS, out[-2000:]
        assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-6, (backend, got, ref)
        # the 2 ranks are one host: both take part in every round, its leader sends
        took, sent = rounds(out), packets(out)
        assert sorted(took) == [0, 1] and min(took.values()) >= STEPS, (backend, took)
        assert sent[0] >= took[0] and sent[1] == 0, (backend, sent)


def compiled_worker(rank, world, ref):
    """Functional collectives inside a compiled function, on the homagg group and on gloo;
    then compiled autograd over DDP's Python reducer, on the homagg group."""
    import torch.distributed._functional_collectives as funcol

    def collectives(x, group):
        return (funcol.all_reduce(x * 2, "sum", group),
                funcol.all_gather_tensor(x, 0, group),
                funcol.reduce_scatter_tensor(torch.cat([x, x]), "sum", 0, group),
                funcol.broadcast(x + 1, 0, group))

    compiled = torch.compile(collectives)
    x = (torch.arange(64, dtype=torch.float32) - 20 * rank) / 8  # dyadic: exact sums
    before = dist.group.WORLD.counts["switch:allreduce"]
    got = compiled(x, dist.group.WORLD)
    funcol_switch = dist.group.WORLD.counts["switch:allreduce"] - before
    want = collectives(x, ref)

    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    net = torch.compile(ddp)
    before = dist.group.WORLD.counts["switch:allreduce"]
    losses_seen = []
    with torch._dynamo.compiled_autograd._enable(torch.compile()):
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            loss = net(torch.randn(4, 4, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses_seen.append(loss.item())
    return {"got": [t.clone() for t in got], "want": [t.clone() for t in want],
            "funcol_switch": funcol_switch,
            "reducer_switch": dist.group.WORLD.counts["switch:allreduce"] - before,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


@pytest.mark.slow
def test_functional_collectives_and_compiled_autograd_on_homagg(tmp_path):
    ranks = run_job(compiled_worker, tmp_path, 31)
    for r in ranks:
        out = r["out"]
        for got, want in zip(out["got"], out["want"], strict=True):
            assert torch.equal(got, want), (got, want)
        assert out["funcol_switch"] == 1  # the functional all_reduce went through the switch
        assert out["reducer_switch"] >= 3  # a gradient all-reduce a step, at least
    assert torch.equal(ranks[0]["out"]["params"], ranks[1]["out"]["params"])
