"""The Hugging Face Trainer on the homagg backend.

    homagg-net local -- torchrun --nproc-per-node 2 examples/hf_trainer_train.py --steps 8
    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --backend gloo   # the baseline

On the CPU the one line is the process group, initialized before ``TrainingArguments``::

    import homagg.torch
    homagg.torch.init_process_group()   # dist.init_process_group("homagg") under torchrun
    args = TrainingArguments(..., use_cpu=True)

``TrainingArguments(ddp_backend="homagg", use_cpu=True)`` alone does not work: on the CPU,
accelerate replaces every backend but MPI with gloo ("Your assigned backend homagg is not
available, please use gloo"). A group that exists already is used as it is, so the Trainer's
DDP then all-reduces its gradients through the switch. (On GPUs, ``ddp_backend="homagg"`` is
passed through.)

The model is a small regression MLP whose forward returns its loss, on data seeded per rank.
Each rank prints its loss at every step (9 decimals, to compare with gloo's to 1e-6) and a
digest of its parameters at the end. Needs ``pip install transformers accelerate``.
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


class Regression(torch.nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 1))
        self.rank, self.step = rank, 0

    def forward(self, x, labels):
        loss = torch.nn.functional.mse_loss(self.net(x), labels)
        if self.training:
            print(f"rank {self.rank} step {self.step:3d} loss {loss.item():.9f}", flush=True)
            self.step += 1
        return {"loss": loss}


class Data(torch.utils.data.Dataset):
    """Each rank's own samples (the Trainer's sampler splits a global dataset; here every
    rank draws its own, seeded by its rank, as the other examples do)."""

    def __init__(self, rank: int, n: int):
        g = torch.Generator().manual_seed(1000 + rank)
        self.x = torch.randn(n, 32, generator=g)
        self.y = self.x.sum(1, keepdim=True).sin()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def main() -> int:
    from transformers import Trainer, TrainingArguments

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backend", choices=["homagg", "gloo"], default="homagg")
    ap.add_argument("--out", default="hf-out")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if a.backend == "homagg":
        import homagg.torch

        homagg.torch.init_process_group()  # before TrainingArguments: see above
    args = TrainingArguments(output_dir=a.out, use_cpu=True, max_steps=a.steps,
                             per_device_train_batch_size=16, learning_rate=0.05,
                             optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
                             weight_decay=0.0, report_to="none", save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, seed=0,
                             data_seed=0, dataloader_drop_last=True,
                             ddp_find_unused_parameters=False,
                             ddp_backend=None if a.backend == "homagg" else "gloo")
    model = Regression(rank)
    trainer = Trainer(model=model, args=args, train_dataset=Data(rank, 16 * world * a.steps))
    trainer.train()
    print(f"rank {rank}: parameters {digest(model)}", flush=True)
    if a.backend == "homagg":  # the gradients went through the switch
        import torch.distributed as dist

        c = dist.group.WORLD.agent.counters  # type: ignore[union-attr]
        print(f"rank {rank}: homagg sent {c.packets_sent} packets in {c.rounds} rounds",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
