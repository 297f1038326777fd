"""Compile the TNA program (p4/tofino/homagg_tna.p4) for Tofino with p4c's open Tofino backend.

    homagg-ctl build --target tofino [--json]      (or tofino2)

runs ``bf-p4c`` (p4c's driver for ``p4c-barefoot`` and its assembler ``bfas``) and writes its
outputs under ``build/tofino`` (``build/tofino2``): ``pipe/context.json``, ``pipe/tofino.bin``,
``bfrt.json``, the P4Info (``homagg_tna.p4info.txtpb``) and the compiler's logs
(``pipe/logs/``). Then it prints what the program uses of the chip (``ResourceTable``): stages
used of those there are, SRAM and TCAM blocks, stateful and statistics ALUs, PHV containers,
and the values one packet adds per pass. ``--json`` prints the same table as JSON.

The compiler is looked up on PATH or through ``$HOMAGG_BF_P4C`` (homagg.targets.toolchain);
without it the build says which. A program that does not fit fails with the compiler's own
message, cut to its error lines. In a checkout, a tofino build refreshes the shipped P4Info
(``homagg/_p4info_tofino.txtpb``, which ``homagg.programs.TOFINO`` and its tests read).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from homagg import paths
from homagg.errors import HomaggError
from homagg.programs import TOFINO_P4INFO_FILE
from homagg.targets.toolchain import require

#: target -> (architecture, PHV containers of the normal PHV by width: the chip's, for the
#: table's "of")
TARGETS = {"tofino": ("tna", {8: 64, 16: 96, 32: 64}),
           "tofino2": ("t2na", {8: 80, 16: 120, 32: 80})}
#: target -> compiler flags it needs: p4c v1.2.5.16's assembler crashes ("No length for clot")
#: on the header CLOTs Tofino 2's backend gives this program, so Tofino 2 builds without them
TARGET_FLAGS = {"tofino2": ["-Xp4c=--no-clot"]}
#: target -> K, the words a packet carries and one pass adds (p4/tofino/include/size.p4). At
#: 128 on Tofino 2 (64 pairs in 16 stages) p4c v1.2.5.16 fails its PHV allocation
WORDS_BY_TARGET = {"tofino": 64, "tofino2": 64}
WORDS = WORDS_BY_TARGET["tofino"]
SWITCHML_VALUES = 64  # SwitchML's values per pass (its 256-byte payload)


class TofinoBuildError(HomaggError):
    pass


@dataclass(frozen=True)
class Usage:
    used: int
    available: int

    def __str__(self) -> str:
        pct = 100.0 * self.used / self.available if self.available else 0.0
        return f"{self.used} of {self.available} ({pct:.0f}%)"


@dataclass(frozen=True)
class ResourceTable:
    """What the compiled program uses of the chip, from the compiler's logs."""

    target: str
    stages: Usage                 # MAU stages of the ingress+egress pipeline
    sram: Usage                   # SRAM blocks, all stages
    tcam: Usage                   # TCAM blocks, all stages
    stateful_alus: Usage          # stateful (meter) ALUs: one per register
    stats_alus: Usage             # statistics ALUs: counters
    phv: dict[str, Usage]         # normal PHV containers, by width ("8", "16", "32")
    values_per_pass: int          # int32 values one packet adds in one pass (2 per pair)
    switchml_values_per_pass: int = SWITCHML_VALUES
    per_stage: list[dict] = field(default_factory=list)  # stage -> its counts

    def rows(self) -> list[tuple[str, str]]:
        out = [("target", self.target), ("stages", str(self.stages)),
               ("SRAM blocks", str(self.sram)), ("TCAM blocks", str(self.tcam)),
               ("stateful ALUs", str(self.stateful_alus)),
               ("statistics ALUs", str(self.stats_alus))]
        out += [(f"PHV {w}-bit containers", str(u)) for w, u in self.phv.items()]
        out.append(("values per packet per pass",
                    f"{self.values_per_pass} (SwitchML: {self.switchml_values_per_pass})"))
        return out

    def render(self) -> str:
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        lines.append("")
        lines.append(f"{'stage':>5}  {'SRAM':>4}  {'TCAM':>4}  {'stateful ALUs':>13}  "
                     f"{'stats ALUs':>10}  tables")
        for s in self.per_stage:
            lines.append(f"{s['stage']:>5}  {s['sram']:>4}  {s['tcam']:>4}  "
                         f"{s['stateful_alus']:>13}  {s['stats_alus']:>10}  "
                         f"{', '.join(s['tables'])}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("stages", "sram", "tcam", "stateful_alus", "stats_alus"):
            d[k] = asdict(getattr(self, k))
        d["phv"] = {w: asdict(u) for w, u in self.phv.items()}
        return d


def source() -> Path:
    return paths.p4_dir() / "tofino" / "homagg_tna.p4"


def out_dir(target: str) -> Path:
    return paths.state_dir() / target


def p4info_path(out: Path) -> Path:
    return out / "homagg_tna.p4info.txtpb"


def build(target: str = "tofino", out: Path | None = None) -> tuple[Path, ResourceTable]:
    """Compile for ``target`` (tofino, tofino2) into ``out``; return it and the resource
    table. Raises ToolMissing (no compiler) or TofinoBuildError (the compiler's errors: the
    program does not fit, or does not compile)."""
    if target not in TARGETS:
        raise TofinoBuildError(f"target {target!r}: one of {', '.join(TARGETS)}")
    arch, _ = TARGETS[target]
    compiler = require("bf-p4c")
    out = out or out_dir(target)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(compiler), "--target", target, "--arch", arch, "--std", "p4-16",
           "-o", str(out), "--verbose", "1",
           "--p4runtime-files", str(p4info_path(out)), "--p4runtime-force-std-externs",
           f"-DWORDS_PER_PACKET={WORDS_BY_TARGET[target]}", *TARGET_FLAGS.get(target, []),
           str(source())]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (out / "compile.log").write_text(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        raise TofinoBuildError(f"{compiler.name} failed for {target} (exit {proc.returncode}; "
                               f"the whole log: {out / 'compile.log'}):\n"
                               f"{compiler_errors(proc.stdout + proc.stderr)}")
    table = resources(out, target)
    if target == "tofino":
        _refresh_shipped_p4info(out)
    return out, table


def compiler_errors(text: str, most: int = 6) -> str:
    """The compiler's error lines and what each points at, at most ``most``: the point of a
    failed compile (a PHV or stage allocation failure, a syntax error) without its dumps."""
    lines = text.splitlines()
    picked: list[str] = []
    for i, line in enumerate(lines):
        if re.search(r"\berror\b", line, re.I) and not line.lstrip().startswith("#"):
            picked.append(line.strip())
            for nxt in lines[i + 1:i + 3]:  # the source line and its caret, if given
                if nxt.strip() and not re.search(r"\b(error|warning)\b", nxt, re.I):
                    picked.append("  " + nxt.rstrip())
        if len(picked) >= 3 * most:
            break
    return "\n".join(picked) if picked else "\n".join(lines[-10:])


def resources(out: Path, target: str) -> ResourceTable:
    """The resource table of a build in ``out`` (pipe/logs/resources.json, pipe/metrics.json
    and pipe/logs/table_summary.log, as p4c-barefoot writes them with --verbose 1)."""
    pipe = out / "pipe"
    res_file = pipe / "logs" / "resources.json"
    if not res_file.is_file():
        raise TofinoBuildError(f"{res_file} is missing: was it built with --verbose 1?")
    mau = json.loads(res_file.read_text())["resources"]["mau"]
    n_stages = int(mau["nStages"])
    per_stage = []
    sram = tcam = salu = stats = 0
    sram_avail = tcam_avail = salu_avail = stats_avail = 0
    for st in mau["mau_stages"]:
        s_sram = len(st["rams"]["srams"])
        s_tcam = len(st["tcams"]["tcams"])
        s_salu = len(st["meter_alus"]["meters"])
        s_stats = len(st["statistic_alus"]["stats"])
        sram += s_sram
        tcam += s_tcam
        salu += s_salu
        stats += s_stats
        # (every stage has the same; the log lists the stages used, the chip has n_stages)
        sram_avail = st["rams"]["nRows"] * st["rams"]["nColumns"] * n_stages
        tcam_avail = st["tcams"]["nRows"] * st["tcams"]["nColumns"] * n_stages
        salu_avail = st["meter_alus"]["nAlus"] * n_stages
        stats_avail = st["statistic_alus"]["nAlus"] * n_stages
        tables = sorted({u["used_by"] for m in st["meter_alus"]["meters"] for u in m["usages"]}
                        | {u["used_by"] for r in st["rams"]["srams"] for u in r["usages"]}
                        | {u["used_by"] for t in st["tcams"]["tcams"] for u in t["usages"]})
        per_stage.append({"stage": st["stage_number"], "sram": s_sram, "tcam": s_tcam,
                          "stateful_alus": s_salu, "stats_alus": s_stats,
                          "tables": [_short(t) for t in tables if "$" not in t]})
    used = stages_used(pipe)
    _, phv_total = TARGETS[target]
    phv: dict[str, Usage] = {}
    metrics = pipe / "logs" / "metrics.json"
    if metrics.is_file():
        for c in json.loads(metrics.read_text())["phv"]["normal"]:
            w = int(c["bit_width"])
            phv[str(w)] = Usage(int(c["containers_occupied"]), phv_total.get(w, 0))
    # the values one pass adds: two int32 lanes per register pair (pair.p4), counted from
    # the stateful ALUs the compiler gave them
    pairs = {u["used_by"] for st in mau["mau_stages"] for m in st["meter_alus"]["meters"]
             for u in m["usages"] if u["used_by"].endswith(".lanes")}
    return ResourceTable(target, Usage(used, n_stages), Usage(sram, sram_avail),
                         Usage(tcam, tcam_avail), Usage(salu, salu_avail),
                         Usage(stats, stats_avail), phv, 2 * len(pairs), per_stage=per_stage)


def _short(name: str) -> str:
    """A table or register without its control's prefix (HomaggIngress.p00.lanes: p00.lanes)."""
    return name.split(".", 1)[1] if name.startswith(("HomaggIngress.", "HomaggEgress.")) else name


def stages_used(pipe: Path) -> int:
    """'Number of stages in table allocation' from table_summary.log."""
    log = pipe / "logs" / "table_summary.log"
    if not log.is_file():
        raise TofinoBuildError(f"{log} is missing: was it built with --verbose 1?")
    found = re.findall(r"Number of stages in table allocation:\s*(\d+)", log.read_text())
    if not found:
        raise TofinoBuildError(f"{log}: no 'Number of stages in table allocation' line")
    return int(found[-1])  # (one line per allocation the compiler tried; the last is kept)


def _refresh_shipped_p4info(out: Path) -> None:
    """In a checkout, the shipped TNA P4Info follows the build (commit the change)."""
    built = p4info_path(out)
    if paths.checkout_root() is None or not built.is_file():
        return
    if not TOFINO_P4INFO_FILE.is_file() or TOFINO_P4INFO_FILE.read_text() != built.read_text():
        TOFINO_P4INFO_FILE.write_text(built.read_text())
