"""The paper's four models in plain torch, with random weights and synthetic data: NCF, an LSTM
language model, VGG19 and BERT-base (``bench.models`` runs them through homagg and gloo).

Every model comes in three shapes:

* ``paper``: the paper's (NCF on MovieLens-20M's 138,493 users and 26,744 items; a 2-layer
  LSTM over WikiText-2's 33,278 tokens; VGG19 at 224 x 224; BERT-base, 12 layers of 768 over
  30,522 tokens, sequences of 128);
* ``fit``: the same parameters (so the same gradients cross the network), with less compute
  per step so that 4 workers on a 2-core machine take seconds, not minutes: VGG19 on 64 x 64
  images (its classifier keeps its 25,088 inputs: an adaptive pool makes 7 x 7 of any
  image), BERT on sequences of 32, the LSTM on batches of 4 sequences of 35;
* ``tiny``: small everything, for tests.

Data are synthetic with the real data's skew: users, items and tokens drawn from a Zipf law
(exponent ``ZIPF``), so an embedding's gradient has as few non-zero rows as in training on the
real data; images are noise; targets random. Each (rank, step) has its own generator, so runs
are repeatable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

#: The Zipf exponent of users, items and tokens (MovieLens' and text's skew is near 1).
ZIPF = 1.1
MODELS = ("ncf", "lstm", "vgg19", "bert")
SHAPES = ("paper", "fit", "tiny")


@dataclass(frozen=True)
class Spec:
    """A model at one shape: how to build it, and a batch for (rank, step)."""

    name: str
    shape: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple]  # (rank, step) -> (inputs..., target)
    loss: Callable[..., torch.Tensor]   # (model, *batch) -> scalar loss
    sparse_note: str                    # where its gradients are sparse


def zipf(gen: torch.Generator, n: int, size) -> torch.Tensor:
    """Indices 0..n-1 with P(k) proportional to 1 / (k + 1) ** ZIPF."""
    w = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** ZIPF
    return torch.multinomial(w, math.prod(size), replacement=True, generator=gen).view(size)


def _gen(rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * rank + step)


# -- NCF (NeuMF: GMF + MLP over user and item embeddings) -----------------------------------
class NCF(nn.Module):
    def __init__(self, users: int, items: int, gmf: int, mlp: tuple[int, ...]):
        super().__init__()
        half = mlp[0] // 2
        self.user_gmf, self.item_gmf = nn.Embedding(users, gmf), nn.Embedding(items, gmf)
        self.user_mlp, self.item_mlp = nn.Embedding(users, half), nn.Embedding(items, half)
        layers: list[nn.Module] = []
        for a, b in zip(mlp, mlp[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(gmf + mlp[-1], 1)

    def forward(self, user, item):
        g = self.user_gmf(user) * self.item_gmf(item)
        m = self.mlp(torch.cat([self.user_mlp(user), self.item_mlp(item)], -1))
        return self.out(torch.cat([g, m], -1)).squeeze(-1)


def _ncf(shape: str) -> Spec:
    users, items, gmf, mlp, b = {"paper": (138_493, 26_744, 64, (256, 128, 64), 256),
                                 "fit": (138_493, 26_744, 64, (256, 128, 64), 256),
                                 "tiny": (500, 300, 8, (16, 8), 32)}[shape]

    def batch(rank, step):
        g = _gen(rank, step)
        return (zipf(g, users, (b,)), zipf(g, items, (b,)),
                torch.randint(0, 2, (b,), generator=g).float())

    def loss(model, user, item, y):
        return nn.functional.binary_cross_entropy_with_logits(model(user, item), y)

    return Spec("ncf", shape, lambda: NCF(users, items, gmf, mlp), batch, loss,
                "the four embedding tables: the rows of the batch's users and items")


# -- an LSTM language model ------------------------------------------------------------------
class LSTMLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, layers, batch_first=True)
        self.dec = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h, _ = self.lstm(self.emb(tokens))
        return self.dec(h)


def _lstm(shape: str) -> Spec:
    vocab, dim, layers, b, t = {"paper": (33_278, 650, 2, 20, 35), "fit": (33_278, 650, 2, 4, 35),
                                "tiny": (400, 16, 2, 4, 6)}[shape]

    def batch(rank, step):
        g = _gen(rank, step)
        x = zipf(g, vocab, (b, t + 1))
        return x[:, :-1], x[:, 1:]

    def loss(model, x, y):
        return nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))

    return Spec("lstm", shape, lambda: LSTMLM(vocab, dim, layers), batch, loss,
                "the input embedding: the rows of the batch's tokens (the decoder is dense)")


# -- VGG19 (configuration E) ------------------------------------------------------------------
VGG19_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
             512, 512, 512, 512, "M")


class VGG(nn.Module):
    def __init__(self, widths: tuple, hidden: int, classes: int):
        super().__init__()
        layers: list[nn.Module] = []
        c = 3
        for v in widths:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(nn.Linear(c * 49, hidden), nn.ReLU(inplace=True),
                                        nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
                                        nn.Linear(hidden, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def _vgg19(shape: str) -> Spec:
    widths = VGG19_CFG if shape != "tiny" else tuple(
        v if isinstance(v, str) else max(4, v // 32) for v in VGG19_CFG)
    hidden, classes, image, b = {"paper": (4096, 1000, 224, 2), "fit": (4096, 1000, 64, 2),
                                 "tiny": (32, 10, 32, 2)}[shape]

    def batch(rank, step):
        g = _gen(rank, step)
        return (torch.randn(b, 3, image, image, generator=g),
                torch.randint(0, classes, (b,), generator=g))

    def loss(model, x, y):
        return nn.functional.cross_entropy(model(x), y)

    return Spec("vgg19", shape, lambda: VGG(widths, hidden, classes), batch, loss,
                "none: every weight gets a gradient each step")


# -- BERT-base (masked language model) --------------------------------------------------------
class BERT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, ff: int, positions: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        self.norm = nn.LayerNorm(dim)
        block = nn.TransformerEncoderLayer(dim, heads, ff, dropout=0.0, activation="gelu",
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1])
        return self.head(self.encoder(self.norm(self.tok(tokens) + self.pos(pos))))


def _bert(shape: str) -> Spec:
    vocab, dim, layers, heads, ff, seq, b = {
        "paper": (30_522, 768, 12, 12, 3072, 128, 2), "fit": (30_522, 768, 12, 12, 3072, 32, 2),
        "tiny": (300, 16, 2, 2, 32, 8, 2)}[shape]

    def batch(rank, step):
        g = _gen(rank, step)
        x = zipf(g, vocab, (b, seq))
        return x, x  # (the masked-LM loss over every position: the same cost per token)

    def loss(model, x, y):
        return nn.functional.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))

    positions = 512 if shape != "tiny" else seq  # BERT's position table, whatever the batch's
    return Spec("bert", shape, lambda: BERT(vocab, dim, layers, heads, ff, positions), batch,
                loss,
                "the token embedding: the rows of the batch's tokens (the head is dense)")


_SPECS = {"ncf": _ncf, "lstm": _lstm, "vgg19": _vgg19, "bert": _bert}


def spec(name: str, shape: str = "fit") -> Spec:
    if name not in _SPECS or shape not in SHAPES:
        raise ValueError(f"model {name!r} at shape {shape!r}: models {', '.join(MODELS)}, "
                         f"shapes {', '.join(SHAPES)}")
    return _SPECS[name](shape)


def parameters(name: str, shape: str = "paper") -> int:
    """The model's parameter count, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = spec(name, shape).build()
    return sum(p.numel() for p in model.parameters())
