"""The TNA program (p4/tofino/homagg_tna.p4) through p4c's open Tofino backend: it compiles,
fits Tofino 1 (and Tofino 2), adds the values per pass the docs claim, and its P4Info is the
one homagg ships. Each target is compiled once per session (a few minutes on 2 cores); every
test skips, with the reason, where bf-p4c is not installed (docs/deploy.md, 'Tofino')."""

from __future__ import annotations

import json

import pytest

from homagg.controller import build_tofino
from homagg.controller.cli import main as ctl
from homagg.programs import TOFINO, TOFINO_P4INFO_FILE, load_schema
from homagg.targets.toolchain import missing

GONE = missing("bf-p4c")
pytestmark = [pytest.mark.skipif(GONE is not None, reason=f"no Tofino compiler: {GONE}"),
              pytest.mark.slow]  # minutes per target on 2 cores

#: what docs/switch.md states: the values one pass adds (SwitchML's: 64)
VALUES_PER_PASS = {"tofino": 64, "tofino2": 64}


@pytest.fixture(scope="session", params=["tofino", "tofino2"])
def built(request, tmp_path_factory):
    target = request.param
    out = tmp_path_factory.mktemp(target)
    try:
        where, table = build_tofino.build(target, out)
    except build_tofino.TofinoBuildError as e:
        pytest.fail(f"the TNA program does not compile for {target}:\n{e}")
    return target, where, table


def test_the_tna_program_fits_and_adds_64_values_per_pass(built):
    target, out, table = built
    assert table.target == target
    assert table.stages.available == (12 if target == "tofino" else 20)
    assert 0 < table.stages.used <= table.stages.available
    assert table.values_per_pass == VALUES_PER_PASS[target]
    assert table.switchml_values_per_pass == 64
    # every register pair, the slot copy's two bookkeeping registers and the join's two:
    # one stateful ALU each
    assert table.stateful_alus.used == VALUES_PER_PASS[target] // 2 + 2 + 2
    assert table.stateful_alus.used <= table.stateful_alus.available
    assert table.sram.used <= table.sram.available and table.tcam.used <= table.tcam.available
    assert table.phv and all(u.used <= u.available for u in table.phv.values())
    for name in ("bfrt.json", "pipe/context.json", build_tofino.p4info_path(out).name):
        assert (out / name).is_file(), name


def test_the_shipped_p4info_is_the_compilers(built):
    """homagg/_p4info_tofino.txtpb, which the control plane loads, is what the TNA program
    compiles to now (homagg-ctl build --target tofino refreshes it: commit it)."""
    target, out, _ = built
    if target != "tofino":
        pytest.skip("the shipped P4Info is Tofino 1's")
    fresh = load_schema(build_tofino.p4info_path(out))
    assert not TOFINO.schema.differences(fresh), TOFINO.schema.differences(fresh)
    assert build_tofino.p4info_path(out).read_text() == TOFINO_P4INFO_FILE.read_text()


def test_the_cli_prints_the_resource_table_as_json(built, capsys, monkeypatch, tmp_path):
    target, _, table = built
    if target != "tofino":
        pytest.skip("one target is enough for the CLI")
    monkeypatch.setenv("HOMAGG_STATE_DIR", str(tmp_path))
    assert ctl(["build", "--target", "tofino", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["stages"] == {"used": table.stages.used, "available": 12}
    assert got["values_per_pass"] == VALUES_PER_PASS["tofino"]


def test_a_program_that_does_not_compile_says_why(tmp_path, monkeypatch):
    bad = tmp_path / "tofino"
    bad.mkdir()
    (bad / "homagg_tna.p4").write_text("#include <tna.p4>\ncontrol C() { apply { x = 1; } }\n")
    monkeypatch.setenv("HOMAGG_P4_DIR", str(tmp_path))
    with pytest.raises(build_tofino.TofinoBuildError, match="(?i)error") as e:
        build_tofino.build("tofino", tmp_path / "out")
    assert len(str(e.value).splitlines()) < 30  # the point, not the compiler's dumps
