"""bench.model_zoo's four models (the paper's NCF, LSTM, VGG19 and BERT-base): their shapes,
their data's skew, and 20 training steps of each through homagg, bit for bit against the same
all-reduce in memory with exact integer sums, beside gloo's fp32 sum (bench.models times
them; this file checks what they compute, on tiny shapes)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from bench.model_zoo import MODELS, parameters, spec, zipf  # noqa: E402


def test_the_paper_shapes():
    """VGG19 as torchvision counts it; BERT-base's encoder as the paper's 12 x 7.1M; NCF and
    the LSTM from their tables' sizes (the parts the network carries)."""
    assert parameters("vgg19") == 143_667_240
    with torch.device("meta"):
        bert = spec("bert", "paper").build()
    assert sum(p.numel() for p in bert.encoder.parameters()) == 12 * 7_087_872
    assert bert.tok.weight.shape == (30_522, 768)
    ncf = parameters("ncf")
    assert (138_493 + 26_744) * (64 + 128) < ncf < (138_493 + 26_744) * (64 + 128) + 100_000
    lstm = parameters("lstm")
    assert 2 * 33_278 * 650 < lstm < 2 * 33_278 * 650 + 8_000_000  # + the 2 layers of 650
    for m in MODELS:  # "fit" keeps the paper's parameters: the same gradients on the wire
        assert parameters(m, "fit") == parameters(m, "paper")


def test_zipf_data_make_embedding_gradients_sparse():
    g = torch.Generator().manual_seed(0)
    draws = zipf(g, 10_000, (100_000,))
    counts = torch.bincount(draws, minlength=10_000).double()
    # the head dominates: rank 1 against rank 10 by about 10 ** ZIPF
    assert 8 < counts[0] / counts[9] < 18
    s = spec("ncf", "tiny")
    model = s.build()
    s.loss(model, *s.batch(0, 0)).backward()
    rows = (model.user_gmf.weight.grad.abs().sum(1) > 0).float().mean()
    assert rows < 0.1  # a batch of 32 touches few of 500 users


@pytest.mark.parametrize("name", MODELS)
def test_every_tiny_model_trains(name):
    s = spec(name, "tiny")
    model = s.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first = None
    for step in range(3):
        opt.zero_grad()
        loss = s.loss(model, *s.batch(0, step))
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        first = loss.item() if first is None else first
    assert np.isfinite(first)


def _twenty_steps(rank, world, ref, name):
    """20 steps of model ``name``: every step's gradients summed through the switch (the
    "homagg" default group) and, from the same gradients gathered over gloo, in memory with
    exact integer sums (``simulate_allreduce``, the agents' codec without the network); the
    same model trained on gloo's fp32 sum beside it."""
    from homagg.host_agent import simulate_allreduce

    s = spec(name, "tiny")
    torch.manual_seed(0)
    model, fp32 = s.build(), s.build()
    fp32.load_state_dict(model.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, fp32)]
    exact, losses, losses_gloo = [], [], []
    for step in range(20):
        grads = []
        for m, opt, out in ((model, opts[0], losses), (fp32, opts[1], losses_gloo)):
            opt.zero_grad()
            loss = s.loss(m, *s.batch(rank, step))
            loss.backward()
            out.append(loss.item())
            grads.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
        mine, theirs = grads
        summed = mine.clone()
        dist.all_reduce(summed)  # through the switch
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=ref)
        sim = simulate_allreduce([g.numpy() for g in gathered]).out[rank]
        exact.append(bool(np.array_equal(summed.numpy().view(np.int32),
                                         np.asarray(sim, np.float32).view(np.int32))))
        dist.all_reduce(theirs, group=ref)  # gloo's fp32 sum
        for m, opt, g in ((model, opts[0], summed), (fp32, opts[1], theirs)):
            at = 0
            for p in m.parameters():
                p.grad.copy_(g[at:at + p.numel()].view_as(p) / world)
                at += p.numel()
            opt.step()
    digest = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
    return {"exact": exact, "losses": losses, "losses_gloo": losses_gloo,
            "digest": hashlib.sha256(digest).hexdigest()}


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_twenty_steps_through_homagg_are_bit_identical_to_exact_integer_sums(tmp_path, name):
    from bench.torch_ranks import run_job

    ranks = run_job(_twenty_steps, tmp_path, 1, name, world=4)
    for r in ranks:
        assert all(r["out"]["exact"]), (name, r["out"]["exact"])
    assert len({r["out"]["digest"] for r in ranks}) == 1  # the replicas are identical
    worst = max(abs(a - b) for a, b in zip(ranks[0]["out"]["losses"],
                                          ranks[0]["out"]["losses_gloo"]))
    print(f"{name}: 20 steps bit-identical to exact integer sums; loss against gloo's fp32 "
          f"sum differs by at most {worst:.2e}")
    assert worst < 1e-3


def test_the_models_figure_rows_and_plot(tmp_path):
    """bench.models' rows become the figure's (step seconds, peak memory and CPU per variant,
    one row per link rate and model that gloo ran), and ``plots.models`` draws them, a variant
    left out too."""
    from bench import models, plots

    def row(rate, model, variant, ms, mb):
        return {"target": "soft", "rate_mbit": rate, "model": model, "variant": variant,
                "step_ms": ms, "max_rss_mb": mb, "cpu_ms": ms / 2}

    rows = [row(100.0, "ncf", "gloo", 18000, 900.0), row(100.0, "ncf", "homagg", 1000, 950.0),
            row(100.0, "ncf", "homagg dense", 17000, 990.0),
            row(0.0, "lstm", "gloo", 2760, 700.0), row(0.0, "lstm", "homagg", 4300, 720.0),
            row(0.0, "vgg19", "homagg", 9000, 2000.0)]
    got = models.figure_rows(rows)
    assert got == [
        {"model": "ncf", "links": "100 Mbit/s", "gloo_s": 18.0, "homagg_s": 1.0,
         "homagg_dense_s": 17.0, "gloo_peak_mb": 900.0, "homagg_peak_mb": 950.0,
         "homagg_dense_peak_mb": 990.0, "gloo_cpu_ms": 9000, "homagg_cpu_ms": 500,
         "homagg_dense_cpu_ms": 8500},
        {"model": "lstm", "links": "unshaped", "gloo_s": 2.76, "homagg_s": 4.3,
         "homagg_dense_s": None, "gloo_peak_mb": 700.0, "homagg_peak_mb": 720.0,
         "homagg_dense_peak_mb": None, "gloo_cpu_ms": 1380, "homagg_cpu_ms": 2150,
         "homagg_dense_cpu_ms": None}]  # (vgg19: no gloo run to compare with)
    pytest.importorskip("matplotlib")
    fig = plots.models(got)
    fig.savefig(tmp_path / "models.png")
    assert (tmp_path / "models.png").stat().st_size > 0
