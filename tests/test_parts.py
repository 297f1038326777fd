"""A long tensor all-reduced in place as parts (host_agent/parts.py): each part's sum exact and
bit for bit one call's, the parts riding one another's rounds, and the memory of one part at a
time, on both agent engines."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from homagg.host_agent.parts import Parted, bounds
from tests.test_agent import AGENT_ENGINES, Job, assert_exact, closing_factory
from tests.test_pipeline import assert_same


@pytest.fixture(params=AGENT_ENGINES, ids=["agent-auto", "agent-python"])
def make_job(request):
    yield from closing_factory(lambda *a, **kw: Job(*a, agent_engine=request.param, **kw))


def test_bounds_cut_every_element_once_in_order():
    assert bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert bounds(8, 4) == [(0, 4), (4, 8)]
    assert bounds(3, 4) == [(0, 3)]
    assert bounds(0, 4) == [(0, 0)]
    with pytest.raises(ValueError, match="part 0"):
        bounds(5, 0)


def test_a_tensor_of_one_part_keeps_its_key_and_its_memory():
    x = np.zeros(10, np.float32)
    one = Parted(x, ("ddp", 3), 10)
    assert one.keys == [("ddp", 3)] and one.views[0].base is x
    three = Parted(x, ("ddp", 3), 4)
    assert three.keys == [(("ddp", 3), "part", k) for k in range(3)]
    assert all(v.base is x for v in three.views)
    assert three.first()[0] is three.views[0]  # (what goes ahead is what its turn passes)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        Parted(np.zeros((2, 5), np.float32), None, 4)


def _inputs(w: int, n: int = 2500) -> np.ndarray:
    """Worker w's tensor: magnitudes over six decades, some zeros."""
    rng = np.random.default_rng(10 + w)
    return (rng.standard_normal(n) * np.logspace(-3, 3, n) * (rng.random(n) < 0.7)
            ).astype(np.float32)


def test_each_part_is_exact_in_place_and_bit_for_bit_one_call_per_part(make_job):
    part, workers = 1000, 3
    xs = [_inputs(w) for w in range(workers)]
    spans = bounds(xs[0].size, part)
    parted = make_job(workers)
    got: list[list] = [[] for _ in range(workers)]
    arrays = [x.copy() for x in xs]

    def run(agent, w):
        Parted(arrays[w], "t", part).allreduce(agent, each=got[w].append)

    _, err = parted.run(run)
    assert not any(err), err
    one = make_job(workers)
    want, err = one.run(lambda a, w: [a.allreduce_detailed(xs[w][lo:hi].copy(), ("t", "part", k))
                                      for k, (lo, hi) in enumerate(spans)])
    assert not any(err), err
    for w in range(workers):
        assert_same(got[w], want[w])
        # the sums were written into the tensor itself, part by part
        np.testing.assert_array_equal(arrays[w], np.concatenate([r.out for r in got[w]]))
        np.testing.assert_array_equal(arrays[w], arrays[0])
        # part k + 1's round 1 rode with part k's values: one round fewer a part
        assert parted.agents[w].counters.pipelined == len(spans) - 1
        assert parted.agents[w].counters.rounds == one.agents[w].counters.rounds - (
            len(spans) - 1)
    for k, (lo, hi) in enumerate(spans):  # each part: the integer sum at its own scales
        assert_exact([got[w][k] for w in range(workers)], [x[lo:hi] for x in xs])


def _peak(job, xs, part: int | None) -> int:
    """The traced memory's peak (numpy's allocations) while the job's workers all-reduce
    copies of ``xs`` in place, whole (``part`` None) or in parts."""
    arrays = [x.copy() for x in xs]
    tracemalloc.start()
    try:
        if part is None:
            _, err = job.run(lambda a, w: a.allreduce_detailed(arrays[w], "m", out=arrays[w]))
        else:
            _, err = job.run(lambda a, w: Parted(arrays[w], "m", part).allreduce(a))
        assert not any(err), err
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_parts_hold_the_memory_of_one_part_not_of_the_tensor(make_job):
    """Whole, a call holds its value words, their packets and the sums (about three times the
    tensor); in eight parts, about one eighth of that."""
    n, workers = 1 << 20, 2
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(workers)]
    job = make_job(workers, mode="dense")
    _peak(job, xs, n // 8)  # (warm: first calls' one-time allocations out of the way)
    whole = _peak(job, xs, None)
    parted = _peak(job, xs, n // 8)
    assert whole > 2 * 4 * n * workers, whole  # (at least words and sums of each tensor)
    assert parted < 0.3 * whole, (parted, whole)


# -- the torch layer: the process group and the DDP hook cut a long bucket ----------------------

def torch_worker(rank, world, ref):
    """A dyadic all_reduce (exact through the codec) of 2500 elements and DDP on the
    backend, then DDP over gloo with the homagg hook: each long tensor in parts of 1000."""
    import torch
    import torch.distributed as dist

    from bench.torch_ranks import loss_of, make_model  # (2561 parameters: one bucket)
    from homagg.host_agent.distributed.hook import HookState, homagg_hook

    agent = dist.group.WORLD.agent
    out = {"part": agent.cfg.part}
    x = (torch.arange(2500, dtype=torch.float32) - 1000 * rank) / 8
    want = x.clone()
    before = agent.counters.pipelined
    dist.all_reduce(x)
    dist.all_reduce(want, group=ref)
    out["sum"], out["gloo"], out["pipelined"] = x, want, agent.counters.pipelined - before
    for which in ("backend", "hook"):
        model = make_model()
        if which == "backend":
            ddp = torch.nn.parallel.DistributedDataParallel(model)
        else:
            ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=ref)
            state = HookState.of(agent, model)
            ddp.register_comm_hook(state=state, hook=homagg_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        before = agent.counters.pipelined
        losses = []
        for step in range(3):
            opt.zero_grad()
            loss = loss_of(ddp, rank, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if which == "hook":
            state.close()
        out[which] = {"losses": losses, "pipelined": agent.counters.pipelined - before,
                      "params": torch.cat([p.detach().reshape(-1)
                                           for p in model.parameters()])}
        del ddp
    return out


@pytest.mark.slow
def test_the_process_group_and_the_hook_sum_a_long_bucket_in_parts(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("p4runtime_sh")
    import torch

    from bench.torch_ranks import run_job

    # (dense: the index and mode choices, which follow measured round costs, stay out of it)
    ranks = run_job(torch_worker, tmp_path, 41, options={"part": 1000, "mode": "dense"})
    for r in ranks:
        out = r["out"]
        assert out["part"] == 1000
        assert torch.equal(out["sum"], out["gloo"])  # dyadic: exact, part by part
        assert out["pipelined"] == 2  # 3 parts: the 2nd and 3rd rode ahead
        for which in ("backend", "hook"):
            # one bucket of 2561 gradients a step, in 3 parts: at least 2 ride ahead a step
            assert out[which]["pipelined"] >= 2 * 3, (which, out[which])
    for which in ("backend", "hook"):
        assert torch.equal(ranks[0]["out"][which]["params"], ranks[1]["out"][which]["params"])
    # the two paths cut alike and sum alike: the same model, bit for bit
    assert torch.equal(ranks[0]["out"]["backend"]["params"], ranks[0]["out"]["hook"]["params"])
