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


def test_after_warm_the_data_path_compiles_nothing(monkeypatch):
    # numba's kernels for every dtype: the C library off (with it, a float32 tensor's codec
    # runs in C and imports no numba: test_an_agent_whose_codec_runs_in_c_never_imports_numba)
    from homagg import native
    from homagg.host_agent import warm as warm_module

    monkeypatch.setattr(native, "load", lambda: None)
    monkeypatch.setattr(warm_module, "_done", set())  # (warmed before with C: again)
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


def test_an_agent_whose_codec_runs_in_c_never_imports_numba(tmp_path):
    """With the C library's kernels and the native engine, a worker's all-reduces of float32
    tensors, in every mode and index (split blocks included), run without numba, which is not
    imported (its import and its kernels cost a worker about 100 MB of peak memory); a float64
    tensor in the same process imports it, for that tensor's kernels."""
    import subprocess
    import sys
    import textwrap

    from homagg import native

    if native.load() is None:
        pytest.skip(f"the native library is off: {native.why()}")
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from tests.test_agent import Job, sparse_tensors
        rng = np.random.default_rng(3)
        xs = [rng.standard_normal(50_000).astype(np.float32) for _ in range(2)]
        xs[0][:600] *= 1e-7                      # a run of small values: split blocks
        sparse = [x.astype(np.float32) for x in sparse_tensors(rng, 2, 50_000, 0.01)]
        for mode, index, ts in (("dense", "flat", xs), ("auto", "hier", sparse),
                                ("auto", "flat", sparse), ("union", "hier", sparse),
                                ("sketch", "flat", sparse), ("sketch", "hier", xs)):
            job = Job(2, mode=mode, index=index, agent_engine="native")
            try:
                res, err = job.run(lambda a, w: a.allreduce_detailed(ts[w]))
                assert not any(err), err
                assert res[0].out.tobytes() == res[1].out.tobytes()
                if mode == "dense":
                    assert res[0]._split_at is not None      # (split blocks, decoded in C)
            finally:
                job.close()
        print("numba" in sys.modules)
        job = Job(2, mode="auto", agent_engine="native")
        try:
            res, err = job.run(lambda a, w: a.allreduce(sparse[w].astype(np.float64)))
            assert not any(err), err
        finally:
            job.close()
        print("numba" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True"], out.stdout
