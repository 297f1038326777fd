"""The TNA program executed by P4Testgen's Tofino target, against the switch model.

``data/testgen_tofino.ptf`` holds the tests p4testgen generated from p4/tofino/homagg_tna.p4
(``homagg-ctl build --target tofino --testgen 150 --seed 1``: its PTF file without the traces,
``tna_testgen.compact``). Every one replays through the model (homagg.switch_model.tna) as
agreed, as a difference the TNA design declares, as a test compared on its port alone
(``tna_testgen.SHORT``), or as a test whose tables or registers homagg never reaches, and none
disagrees. That runs everywhere. Where p4testgen is installed (docs/deploy.md, 'Tofino'), the
slow test generates them afresh from the program as it is now, and holds those to the same,
and to the statement coverage docs/switch.md states."""

from __future__ import annotations

from pathlib import Path

import pytest

from homagg.controller import tna_testgen as tg
from homagg.targets.toolchain import missing

DATA = Path(__file__).parent / "data" / "testgen_tofino.ptf"
#: what docs/switch.md states of the committed run: tests, and statements covered of 556
TESTS = 150
COVERAGE = 342 / 556


def _check(summary: tg.Summary) -> None:
    bad = [f"{r.test.name}: {r.detail}" for r in summary.results if r.outcome == "disagreed"]
    assert not bad, "\n".join(bad)
    assert summary.count("agreed") > 0


def test_the_committed_tests_agree_with_the_model():
    tests = tg.parse_ptf(DATA)
    assert len(tests) == TESTS
    summary = tg.Summary([tg.replay(t) for t in tests])
    _check(summary)
    # every outcome is one the summary names
    assert {r.outcome for r in summary.results} <= {"agreed", "declared", "port only",
                                                    "outside"}


GONE = missing("p4testgen")


@pytest.mark.slow
@pytest.mark.skipif(GONE is not None, reason=f"no P4Testgen: {GONE}")
def test_tests_generated_now_agree_with_the_model(tmp_path):
    ptf = tg.generate(TESTS, seed=1, out=tmp_path, timeout=1800)  # (7.5 min on 2 cores)
    summary = tg.run(TESTS, 1, ptf=ptf)
    _check(summary)
    assert summary.coverage >= COVERAGE - 1e-9, summary.render()
