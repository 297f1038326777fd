"""The DDP communication hook: two processes train through the software aggregator; the
gradients DDP applies are the exact mean of the workers' quantized gradients."""

from __future__ import annotations

import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (optional extra)")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from homagg import wire  # noqa: E402
from homagg.host_agent import codec  # noqa: E402
from homagg.targets.soft import SoftSwitch, SoftSwitchServer  # noqa: E402

SWITCH = ("127.0.1.240", wire.HOMAGG_UDP_PORT_MIN)


def free_port(kind=socket.SOCK_DGRAM):
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def worker(rank, world, ports, tcp_port, out_dir):
    from homagg.host_agent import Agent, AgentConfig
    from homagg.host_agent.torch_hook import homagg_hook

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{tcp_port}", rank=rank,
                            world_size=world)
    agent = Agent(AgentConfig(1, rank, world, SWITCH, ("127.0.0.1", ports[rank]), slots=16,
                              timeout=0.01, deadline=20))
    model = make_model()
    ref = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state=agent, hook=homagg_hook)
    results = []
    for step in range(3):
        # what every worker computes locally, from identical parameters
        ref.load_state_dict(model.state_dict())
        per_worker = [local_grads(ref, r, step) for r in range(world)]
        ddp.zero_grad()
        idx, y = batch(rank, step)
        torch.nn.functional.mse_loss(ddp(idx), y).backward()
        got = [p.grad.detach().clone() for p in model.parameters()]
        results.append((got, per_worker))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    agent.close()
    dist.destroy_process_group()


def test_ddp_hook_gives_the_exact_mean(tmp_path):
    world = 2
    ports = [free_port() for _ in range(world)]
    server = SoftSwitchServer(SoftSwitch(), SWITCH).start()
    server.switch.add_job(1, [("127.0.0.1", p) for p in ports], 16)
    try:
        mp.spawn(worker, args=(world, ports, free_port(socket.SOCK_STREAM), str(tmp_path)),
                 nprocs=world, join=True)
    finally:
        server.stop()
    r0 = torch.load(tmp_path / "rank0.pt")
    r1 = torch.load(tmp_path / "rank1.pt")
    for step, ((got0, per_worker), (got1, _)) in enumerate(zip(r0, r1)):
        for k, (g0, g1) in enumerate(zip(got0, got1)):
            assert torch.equal(g0, g1), f"step {step}: workers disagree on parameter {k}"
        # One bucket holds every parameter, so one shift for all; quantization is elementwise.
        flat = [np.concatenate([g.reshape(-1).numpy() for g in grads]) for grads in per_worker]
        shift = codec.shift_for(max(codec.max_exponent(f) for f in flat), world)
        for k, g in enumerate(got0):
            exact = sum(codec.quantize(w[k].reshape(-1).numpy(), shift).astype(np.int64)
                        for w in per_worker)
            mean = np.ldexp(exact.astype(np.float64), -shift).astype(np.float32) / np.float32(world)
            np.testing.assert_array_equal(g.reshape(-1).numpy(), mean)
