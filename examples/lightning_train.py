"""PyTorch Lightning on the homagg backend: the one line is the strategy's process group
backend.

    homagg-net local -- torchrun --nproc-per-node 2 examples/lightning_train.py --steps 8
    torchrun --nproc-per-node 2 examples/lightning_train.py --backend gloo   # the baseline

The line that matters::

    import homagg.torch  # registers the "homagg" backend
    Trainer(strategy=DDPStrategy(process_group_backend="homagg"), accelerator="cpu", ...)

Lightning reads torchrun's variables (its TorchElasticEnvironment) and initializes the process
group with that backend; DDP's gradient all-reduce then goes through the switch, unmodified.
The model is a small regression MLP on data seeded per (rank, step). Each rank prints its loss
at every step (9 decimals, to compare with gloo's to 1e-6) and a digest of its parameters at
the end (identical ranks print the same). Needs ``pip install lightning``.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backend", choices=["homagg", "gloo"], default="homagg")
    a = ap.parse_args()
    if a.backend == "homagg":
        import homagg.torch  # noqa: F401  (registers the backend)
    rank = int(os.environ["RANK"])

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)  # the same initial weights on every rank
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                           torch.nn.Linear(64, 1))

        def training_step(self, batch, step):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            print(f"rank {rank} step {self.global_step:3d} loss {loss.item():.9f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(1000 + rank)  # each rank's own data
    xs = [torch.randn(16, 32, generator=g) for _ in range(a.steps)]
    data = [(x, x.sum(1, keepdim=True).sin()) for x in xs]
    model = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        num_nodes=int(os.environ["WORLD_SIZE"])
                        // int(os.environ["LOCAL_WORLD_SIZE"]),
                        strategy=DDPStrategy(process_group_backend=a.backend),
                        max_steps=a.steps, logger=False, enable_checkpointing=False,
                        use_distributed_sampler=False,  # each rank its own data, as seeded
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    print(f"rank {rank}: parameters {digest(model)}", flush=True)
    if a.backend == "homagg":  # the gradients went through the switch
        import torch.distributed as dist

        c = dist.group.WORLD.agent.counters  # type: ignore[union-attr]
        print(f"rank {rank}: homagg sent {c.packets_sent} packets in {c.rounds} rounds",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
