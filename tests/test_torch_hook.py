"""The DDP communication hook: two processes train through the software aggregator; the
gradients DDP applies are the exact mean of the workers' quantized gradients."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (optional extra)")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from homagg import wire  # noqa: E402
from homagg.controller.local import install  # noqa: E402
from homagg.host_agent import codec  # noqa: E402
from homagg.targets.soft import SoftSwitch, SoftSwitchServer  # noqa: E402
from tests.staging import agent_addresses  # noqa: E402

pytestmark = pytest.mark.slow  # (conftest.py) torch ranks in processes

SWITCH = ("127.0.1.240", wire.HOMAGG_UDP_PORT_MIN)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.EmbeddingBag(500, 8, mode="sum"), torch.nn.Linear(8, 1))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    idx = torch.randint(0, 500, (16, 4), generator=g)
    return idx, torch.randn(16, 1, generator=g)


def local_grads(model, rank, step):
    model.zero_grad()
    idx, y = batch(rank, step)
    torch.nn.functional.mse_loss(model(idx), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def finish(agent) -> None:
    """Both ranks done before either tears down (a rank that destroys its gloo group while
    the other is still in a collective fails the other's). The hook's thread is left to the
    exit, as a user's script leaves it: ``test_the_hook_thread_inside_set_result_at_exit``."""
    dist.barrier()
    agent.close()
    dist.destroy_process_group()


def worker(rank, world, addrs, out_dir, overlap):
    from homagg.host_agent import Agent, AgentConfig
    from homagg.host_agent.distributed.hook import HookState, homagg_hook

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=world)
    agent = Agent(AgentConfig(1, rank, world, SWITCH, addrs[rank], slots=16,
                              timeout=0.01, deadline=20))
    model = make_model()
    ref = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    pid = {id(p): k for k, p in enumerate(model.parameters())}
    orders: list = []

    def hook(state, bucket):  # records the bucket's layout: which parameters, in what order
        orders.append([pid[id(p)] for p in bucket.parameters()])
        return homagg_hook(state, bucket)

    # without overlap the hook blocks; with it, the agent's thread completes the futures
    state = HookState.of(agent, model, overlap=True) if overlap else HookState(agent,
                                                                                 overlap=False)
    ddp.register_comm_hook(state=state, hook=hook)
    results = []
    for step in range(3):
        # what every worker computes locally, from identical parameters
        ref.load_state_dict(model.state_dict())
        per_worker = [local_grads(ref, r, step) for r in range(world)]
        ddp.zero_grad()
        idx, y = batch(rank, step)
        torch.nn.functional.mse_loss(ddp(idx), y).backward()
        got = [p.grad.detach().clone() for p in model.parameters()]
        results.append((got, per_worker, orders[-1]))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    finish(agent)


@pytest.mark.parametrize("overlap", [False, True])
def test_ddp_hook_gives_the_exact_mean(tmp_path, overlap):
    world = 2
    addrs = agent_addresses(world)
    server = SoftSwitchServer(SoftSwitch(), SWITCH).start()
    install(server.switch, 1, addrs, 16)
    try:
        mp.spawn(worker, args=(world, addrs, str(tmp_path),
                               overlap), nprocs=world, join=True)
    finally:
        server.stop()
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    for step, ((got0, per_worker, order), (got1, _, _)) in enumerate(zip(r0, r1)):
        for k, (g0, g1) in enumerate(zip(got0, got1)):
            assert torch.equal(g0, g1), f"step {step}: workers disagree on parameter {k}"
        # One bucket holds every parameter (in ``order``): its per-element shifts are what the
        # workers' buckets negotiate (codec.agreed_shifts, split blocks included);
        # quantization is elementwise.
        assert sorted(order) == list(range(len(got0)))
        flat = [np.concatenate([grads[k].reshape(-1).numpy() for k in order])
                for grads in per_worker]
        shift = codec.agreed_shifts(flat, split=True)
        exact = sum(codec.quantize(f, shift).astype(np.int64) for f in flat)
        mean = np.ldexp(exact.astype(np.float64), -shift).astype(np.float32) / np.float32(world)
        start = 0
        for k in order:
            g = got0[k].reshape(-1).numpy()
            np.testing.assert_array_equal(g, mean[start:start + g.size])
            start += g.size


def scaler_worker(rank, world, addrs, out_dir):
    from homagg.host_agent import Agent, AgentConfig
    from homagg.host_agent.distributed.hook import HookState, homagg_hook

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=world)
    agent = Agent(AgentConfig(2, rank, world, SWITCH, addrs[rank], slots=16,
                              timeout=0.01, deadline=20))
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state=HookState.of(agent, model), hook=homagg_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    log = []
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        opt.zero_grad()
        idx, y = batch(rank, step)
        if step == 1 and rank == 1:
            y[3] = float("inf")  # an overflowed loss on one rank only
        scaler.scale(torch.nn.functional.mse_loss(ddp(idx), y)).backward()
        scaler.step(opt)
        scaler.update()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        log.append((scale, scaler.get_scale(), changed,
                    [p.detach().clone() for p in model.parameters()]))
    torch.save(log, f"{out_dir}/rank{rank}.pt")
    finish(agent)


def test_ddp_grad_scaler_skips_the_step_on_every_rank_after_an_inf_on_one(tmp_path):
    world = 2
    addrs = agent_addresses(world)
    server = SoftSwitchServer(SoftSwitch(), SWITCH).start()
    install(server.switch, 2, addrs, 16)
    try:
        mp.spawn(scaler_worker, args=(world, addrs,
                                      str(tmp_path)), nprocs=world, join=True)
    finally:
        server.stop()
    logs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for step in range(3):
        for r in range(world):
            before, after, changed, _ = logs[r][step]
            if step == 1:  # inf on rank 1: every rank sees non-finite grads and skips
                assert not changed and after == before / 2, (r, step)
            else:
                assert changed and after == before, (r, step)
        for p0, p1 in zip(logs[0][step][3], logs[1][step][3]):
            assert torch.equal(p0, p1)


class FakeBucket:
    """What homagg_hook reads of a GradBucket."""

    def __init__(self, params):
        self.params = params

    def index(self):
        return 0

    def parameters(self):
        return self.params

    def buffer(self):
        return torch.cat([p.grad.reshape(-1) for p in self.params])


def test_the_hooks_state_is_a_hookstate_and_a_bare_agent_is_told_so():
    from homagg.host_agent import MemoryJob
    from homagg.host_agent.distributed.hook import HookState, homagg_hook

    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    agent = MemoryJob(1).agents[0]
    with pytest.raises(TypeError, match=r"homagg_hook's state is a HookState, not Agent: "
                                        r"HookState\.of\(agent, model\)"):
        homagg_hook(agent, FakeBucket(list(model.parameters())))  # type: ignore[arg-type]
    got = homagg_hook(HookState(agent, overlap=False), FakeBucket(list(model.parameters())))
    assert torch.equal(got.wait(), torch.ones(8))  # one worker: the mean is the bucket


def test_hook_errors_name_the_parameter_and_its_index():
    from homagg.host_agent import AgentError, MemoryJob
    from homagg.host_agent.distributed.hook import HookState, homagg_hook

    model = torch.nn.Sequential(torch.nn.Linear(2, 5), torch.nn.Linear(5, 60))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    params = list(model.parameters())  # 10 + 5 + 300 + 60 elements
    params[2].grad[3, 1] = 3.0         # bucket offset 15 + 16 = 31, in scale block 0
    params[0].grad[0, 0] = 0.25
    agent = MemoryJob(1, mode="union", shift_bias=6).agents[0]  # 6 bits too fine: 3.0 leaves
    for overlap in (False, True):  # raised by the hook, or through its future
        with pytest.raises(AgentError, match=r"parameter 1\.weight \(#2 of bucket 0, shape "
                                             r"\(60, 5\)\), index 16") as info:
            homagg_hook(HookState.of(agent, model, overlap=overlap), FakeBucket(params)).wait()
        assert "bucket offset 31" in str(info.value)
        agent = MemoryJob(1, mode="union", shift_bias=6).agents[0]  # (the last one broke)


def make_sparse_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.EmbeddingBag(5_000, 8, mode="sum", sparse=True),
                               torch.nn.Linear(8, 1))


EXIT_RACE = """
import time, torch
from homagg.host_agent.distributed.serial import Serial
fut = torch.futures.Future()
def slow_callback(f):  # DDP's callbacks run inside set_result, the GIL released around them
    time.sleep(0.3)
    return 1
fut.then(slow_callback)
class SlowTeardown:  # the interpreter is still finalizing when the callback returns
    def __del__(self):
        time.sleep(1.0)
keep = SlowTeardown()
Serial().submit(lambda: fut.set_result(torch.ones(1)))
time.sleep(0.05)
print("main done", flush=True)
"""


def test_the_hook_thread_inside_set_result_at_exit(tmp_path):
    """The script ends while the agent's thread is inside a future's ``set_result`` (the last
    bucket of a step): the thread is joined before the interpreter finalizes, so it never
    wakes into one. Without that, pthread_exit unwinds its C++ frame: "terminate called
    without an active exception", SIGABRT (seen once in a while in this file's tests)."""
    script = tmp_path / "exit_race.py"
    script.write_text(EXIT_RACE)
    for _ in range(2):
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        assert "main done" in p.stdout and "terminate called" not in p.stderr


def sparse_worker(rank, world, addrs, out_dir):
    from homagg.host_agent import Agent, AgentConfig
    from homagg.host_agent.distributed.hook import HookState, homagg_hook

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=world)
    agent = Agent(AgentConfig(3, rank, world, SWITCH, addrs[rank], slots=16,
                              timeout=0.01, deadline=20))
    model = make_sparse_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state=HookState.of(agent, model), hook=homagg_hook)
    results = []
    for step in range(2):
        ddp.zero_grad()
        idx, y = batch(rank, step)
        idx = idx * 10 + rank  # each rank's own rows, and some shared: a real union
        torch.nn.functional.mse_loss(ddp(idx), y).backward()
        g = model[0].weight.grad
        results.append((g.is_sparse, g.detach().coalesce().clone()))
    torch.save(results, f"{out_dir}/sparse{rank}.pt")
    finish(agent)


def test_ddp_sparse_gradients_go_through_the_hook_sparse_and_exact(tmp_path):
    """nn.EmbeddingBag(sparse=True) under DDP: its gradient bucket is sparse COO; the hook
    returns the mean as a sparse tensor on the union of the ranks' rows, equal on every rank
    and equal to the dense mean (the integers behind it are tests/test_sparse.py's)."""
    world = 2
    addrs = agent_addresses(world)
    server = SoftSwitchServer(SoftSwitch(), SWITCH).start()
    install(server.switch, 3, addrs, 16)
    try:
        mp.spawn(sparse_worker, args=(world, addrs,
                                      str(tmp_path)), nprocs=world, join=True)
    finally:
        server.stop()
    r = [torch.load(tmp_path / f"sparse{k}.pt") for k in range(world)]
    for step in range(2):
        (s0, g0), (s1, g1) = r[0][step], r[1][step]
        assert s0 and s1
        assert torch.equal(g0.indices(), g1.indices()) and torch.equal(g0.values(), g1.values())
        # the dense mean of the ranks' local gradients, from the same parameters (the
        # worker loop applies no update)
        model = make_sparse_model()
        local = []
        for k in range(world):
            model.zero_grad()
            idx, y = batch(k, step)
            torch.nn.functional.mse_loss(model(idx * 10 + k), y).backward()
            local.append(model[0].weight.grad.to_dense())
        mean = (local[0] + local[1]) / 2
        rows = torch.nonzero(mean.abs().sum(1)).reshape(-1)
        assert set(g0.indices()[0].tolist()) >= set(rows.tolist())
        torch.testing.assert_close(g0.to_dense(), mean, rtol=1e-5, atol=1e-6)
