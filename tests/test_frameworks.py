"""The frameworks people train with, on the homagg backend under ``homagg-net local``:
PyTorch Lightning (``DDPStrategy(process_group_backend="homagg")``) and the Hugging Face
Trainer (the group initialized first, on the CPU). Each runs 2 ranks with torchrun, then the same
on gloo: every rank ends with the same parameters, the gradients went through the switch, and
each rank's losses are within 1e-6 of gloo's. Needs the optional ``frameworks`` extra
(``pip install -e ".[frameworks]"``); each test skips with the reason where its packages are
missing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # (conftest.py) two torchrun runs of 2 ranks each

pytest.importorskip("torch")
pytest.importorskip("p4runtime_sh")

from bench.torch_ranks import clean_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def losses(out: str) -> dict[int, list[float]]:
    """rank -> its losses, by step (the ranks share a pipe: no anchors)."""
    found: dict[int, dict[int, float]] = {}
    for r, s, v in re.findall(r"rank (\d) step +(\d+) loss (\d+\.\d{9})", out):
        found.setdefault(int(r), {})[int(s)] = float(v)
    return {r: [by[k] for k in sorted(by)] for r, by in found.items()}


def run(script: str, backend: str, tmp_path: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(ROOT / "examples" / script), "--steps", str(STEPS), "--backend", backend]
    if script == "hf_trainer_train.py":
        cmd += ["--out", str(tmp_path / f"hf-{backend}")]
    if backend == "homagg":
        cmd = [sys.executable, "-m", "homagg.launcher", "local", "--", *cmd]
    proc = subprocess.run(cmd, env=clean_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("script,needs", [
    ("lightning_train.py", ["lightning"]),
    ("hf_trainer_train.py", ["transformers", "accelerate"]),
])
def test_a_framework_trains_on_the_homagg_backend_as_on_gloo(tmp_path, script, needs):
    for package in needs:
        pytest.importorskip(package, reason=f"{package} is not installed (the frameworks "
                                            "extra: pip install -e '.[frameworks]')")
    out = run(script, "homagg", tmp_path)
    digests = dict(re.findall(r"rank (\d): parameters ([0-9a-f]{16})", out))
    assert sorted(digests) == ["0", "1"] and len(set(digests.values())) == 1, out[-2000:]
    sent = {int(r): (int(n), int(k)) for r, n, k in re.findall(
        r"rank (\d): homagg sent (\d+) packets in (\d+) rounds", out)}
    # both ranks took part in every step's rounds; they are one host, so its leader (rank 0)
    # alone sent, for both (local reduction)
    assert sorted(sent) == [0, 1] and min(k for _, k in sent.values()) >= STEPS, sent
    assert sent[0][0] >= STEPS and sent[1][0] == 0, sent
    ref = losses(run(script, "gloo", tmp_path))
    got = losses(out)
    assert sorted(got) == sorted(ref) == [0, 1], (got, ref)
    for r in (0, 1):
        assert len(got[r]) == len(ref[r]) == STEPS, (got, ref)
        assert max(abs(a - b) for a, b in zip(got[r], ref[r])) <= 1e-6, (r, got[r], ref[r])
