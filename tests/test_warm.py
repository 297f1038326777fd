"""``warm`` compiles every kernel the data path calls: after it, all-reduces of every mode and
index through real agents and the software aggregator compile nothing more (a first run on a
fresh clone compiled inside its rounds, and timed out: 24.6 s against 4.6 s for the second)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from numba.core.registry import CPUDispatcher  # noqa: E402

from homagg.host_agent import results  # noqa: E402
from homagg.host_agent.codec import _jit_bitmap, _jit_blocks, _jit_sketch, kernels  # noqa: E402
from homagg.host_agent.warm import warm  # noqa: E402
from tests.test_agent import Job, sparse_tensors  # noqa: E402


def signatures() -> dict[str, int]:
    out = {}
    for mod in (_jit_bitmap, _jit_blocks, _jit_sketch, results):
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher):
                out[f"{mod.__name__}.{name}"] = len(obj.signatures)
    return out


def test_after_warm_the_data_path_compiles_nothing():
    assert kernels.active is kernels.JIT
    warm()
    before = signatures()
    assert sum(before.values()) >= 10, before  # (the kernels were found, and compiled)
    rng = np.random.default_rng(5)
    for mode, index, density, dt in (("auto", "hier", 0.01, np.float32),
                                     ("auto", "flat", 0.05, np.float32),
                                     ("sketch", "hier", 0.01, np.float32),
                                     ("dense", "flat", 1.0, np.float32),
                                     ("auto", "hier", 0.02, np.float64)):
        job = Job(3, mode=mode, index=index)
        try:
            xs = [x.astype(dt) for x in sparse_tensors(rng, 3, 30_000, density)]
            res, err = job.run(lambda a, w, xs=xs: a.allreduce(xs[w]))
            assert not any(err), err
        finally:
            job.close()
    after = signatures()
    grew = {k: (before.get(k, 0), v) for k, v in after.items() if v != before.get(k, 0)}
    assert not grew, f"compiled after warm (kernel: signatures before, after): {grew}"
