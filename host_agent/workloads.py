"""The demo's model: a small embedding-heavy recommender in the spirit of NCF (GMF), in numpy.

score(u, i) = sum_k w_k * U[u, k] * V[i, k] + b_i, trained with logistic loss on synthetic
implicit feedback from a planted low-rank truth. A batch touches few rows of the embedding
tables, so their gradients are sparse (the codec's case); ``w`` is dense (the dense case).

Everything is deterministic from (seed, iteration, worker): any worker can recompute any other
worker's gradient, which is how the demo checks every aggregate bit for bit without extra
messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NCFConfig:
    users: int = 4000
    items: int = 8000
    dim: int = 16
    batch: int = 256
    lr: float = 30.0
    seed: int = 0
    truth_rank: int = 8


class SyntheticData:
    """Labels from a planted low-rank model; worker w's batch at step t is seeded by (t, w)."""

    def __init__(self, cfg: NCFConfig):
        rng = np.random.default_rng(cfg.seed + 1)
        self.cfg = cfg
        self.tu = rng.standard_normal((cfg.users, cfg.truth_rank))
        self.tv = rng.standard_normal((cfg.items, cfg.truth_rank))
        # popular users and items (Zipf-like): real sparse workloads are skewed
        self.pu = _zipf(cfg.users, rng)
        self.pi = _zipf(cfg.items, rng)

    def batch(self, step: int, worker: int):
        c = self.cfg
        rng = np.random.default_rng([c.seed, step, worker])
        u = rng.choice(c.users, c.batch, p=self.pu)
        i = rng.choice(c.items, c.batch, p=self.pi)
        y = (np.einsum("bk,bk->b", self.tu[u], self.tv[i]) > 0).astype(np.float32)
        return u, i, y


def _zipf(n, rng, a=1.1):
    p = 1.0 / np.arange(1, n + 1) ** a
    p = p[rng.permutation(n)]
    return p / p.sum()


class GMF:
    def __init__(self, cfg: NCFConfig):
        rng = np.random.default_rng(cfg.seed)
        self.cfg = cfg
        self.U = (rng.standard_normal((cfg.users, cfg.dim)) * 0.1).astype(np.float32)
        self.V = (rng.standard_normal((cfg.items, cfg.dim)) * 0.1).astype(np.float32)
        self.b = np.zeros(cfg.items, np.float32)
        self.w = np.ones(cfg.dim, np.float32)

    def params(self) -> dict[str, np.ndarray]:
        return {"U": self.U, "V": self.V, "b": self.b, "w": self.w}

    def loss_and_grads(self, u, i, y):
        """Mean logistic loss over the batch, and gradients summed over the batch (so that
        the all-reduce sum over workers divided by the global batch is the mean)."""
        Uu, Vi = self.U[u], self.V[i]
        z = (Uu * Vi) @ self.w + self.b[i]
        p = 1.0 / (1.0 + np.exp(-z))
        loss = float(np.mean(np.logaddexp(0, z) - y * z))
        d = (p - y).astype(np.float32)  # dL/dz per example
        gU = np.zeros_like(self.U)
        gV = np.zeros_like(self.V)
        gb = np.zeros_like(self.b)
        np.add.at(gU, u, d[:, None] * Vi * self.w)
        np.add.at(gV, i, d[:, None] * Uu * self.w)
        np.add.at(gb, i, d)
        gw = (d[:, None] * Uu * Vi).sum(0).astype(np.float32)
        return loss, {"U": gU, "V": gV, "b": gb, "w": gw}

    def apply(self, summed: dict[str, np.ndarray], global_batch: int) -> None:
        lr = self.cfg.lr / global_batch
        for k, p in self.params().items():
            p -= (lr * summed[k]).astype(np.float32)

    def digest(self) -> str:
        import hashlib

        h = hashlib.sha256()
        for k, p in sorted(self.params().items()):
            h.update(k.encode())
            h.update(np.ascontiguousarray(p).tobytes())
        return h.hexdigest()[:16]
