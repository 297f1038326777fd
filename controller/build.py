"""Compile p4/homagg.p4 with p4c-bm2-ss into bmv2 JSON and P4Info (text format).

    python -m homagg.controller.build [--out build/p4] [--words K]   (also: homagg-ctl build)

Rebuilds only when a source under p4/ is newer than the outputs. ``--words K`` sets the words
per packet (-DWORDS_PER_PACKET=K; the P4 default, 256, otherwise) and builds into its own
directory (``build/p4-k64``), so builds for several K live side by side; agents learn K from
the switch. K up to 320 fits the default 1500-byte MTU, up to 2176 a 9000-byte one (jumbo
frames: ``homagg-net --mtu 9000``). The generated constants and the shipped P4Info are
always the default build's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from homagg import paths
from homagg.errors import HomaggError
from homagg.targets.toolchain import require

DEFAULT_OUT = paths.build_dir()
log = logging.getLogger("homagg.build")


class BuildError(HomaggError):
    pass


@dataclass(frozen=True)
class Pipeline:
    """The build outputs a switch needs."""

    bmv2_json: Path
    p4info: Path

    @classmethod
    def in_dir(cls, out: Path) -> Pipeline:
        return cls(out / "homagg.json", out / "homagg.p4info.txtpb")

    def exists(self) -> bool:
        return self.bmv2_json.is_file() and self.p4info.is_file()

    def words(self) -> int:
        """K, the words per packet this pipeline was compiled for (its words header's
        width / 32: its 64-word chunks)."""
        data = json.loads(self.bmv2_json.read_text())
        for h in data.get("header_types", []):
            if h["name"] == "words_h":
                return sum(int(f[1]) for f in h["fields"]) // 32
        raise BuildError(f"{self.bmv2_json}: no words_h header: not homagg's pipeline")


def soft_pipeline(where: Path) -> Pipeline:
    """homagg's pipeline for a software aggregator: the P4Info shipped in the package and an
    empty device config (it runs the pipeline natively), written under ``where``. No p4c."""
    from homagg.paths import P4INFO_FILE

    if not P4INFO_FILE.is_file():
        raise BuildError(f"homagg's P4Info is missing ({P4INFO_FILE}); reinstall homagg")
    where.mkdir(parents=True, exist_ok=True)
    p = Pipeline(where / "no-device-config", P4INFO_FILE)
    p.bmv2_json.write_bytes(b"")
    return p


def sources() -> list[Path]:
    """The v1model program's sources (p4/tofino is the TNA program's: build_tofino)."""
    top = paths.p4_dir()
    return sorted(p for p in top.rglob("*.p4") if p.relative_to(top).parts[0] != "tofino")


def up_to_date(p: Pipeline) -> bool:
    if not p.exists():
        return False
    built = min(p.bmv2_json.stat().st_mtime, p.p4info.stat().st_mtime)
    return all(s.stat().st_mtime <= built for s in sources())


def build(out: Path = DEFAULT_OUT, force: bool = False, regenerate: bool = True,
          words: int | None = None) -> Pipeline:
    """Compile if needed, then bring the generated protocol module up to date; return the
    pipeline. ``words``: K, words per packet (None: the P4 default). Raises ToolMissing or
    BuildError (with p4c's own messages)."""
    from homagg import wire

    default = words is None or words == wire.WORDS_PER_PACKET
    if words is not None and not default:
        top = wire.MAX_WORDS_PER_PACKET // wire.CHUNK_WORDS * wire.CHUNK_WORDS
        if words % wire.CHUNK_WORDS or not wire.CHUNK_WORDS <= words <= top:
            raise BuildError(f"--words {words}: the P4 program takes a multiple of "
                             f"{wire.CHUNK_WORDS} from {wire.CHUNK_WORDS} to {top} (p4c's "
                             f"widest type is 64 words; {top} fill a {wire.JUMBO_MTU}-byte "
                             f"MTU, {wire.mtu_words()} words a {wire.DEFAULT_MTU}-byte one)")
        out = out.with_name(f"{out.name}-k{words}")
    p = Pipeline.in_dir(out)
    if not force and up_to_date(p):
        return p
    _compile(p, out, [] if default else [f"-DWORDS_PER_PACKET={words}"])
    if regenerate and default:
        _regenerate(p)
    return p


def portable_p4info(text: str) -> str:
    """A P4Info as the shipped file keeps it: p4c after 1.2.4.8 also writes each table's
    ``initial_default_action`` (what its default action is at start, which the program says
    too), and the shipped file stays the same whichever p4c built it."""
    return re.sub(r"\n  initial_default_action \{\n    action_id: \d+\n  \}", "", text)


def _regenerate(p: Pipeline) -> None:
    """In a checkout, rewrite homagg/_p4consts.py and homagg/_p4info.txtpb (the P4Info the
    software aggregator serves) from this build (commit the change). An installed homagg cannot
    change itself: a P4 source that no longer matches its constants is an error there."""
    from homagg.controller import genconsts
    from homagg.paths import P4INFO_FILE

    if paths.checkout_root() is not None and os.access(genconsts.OUT, os.W_OK):
        if genconsts.generate(p.p4info):
            log.warning("%s regenerated from the P4 program: restart running processes and "
                        "commit it", genconsts.OUT)
        shipped = portable_p4info(p.p4info.read_text())
        if not P4INFO_FILE.is_file() or P4INFO_FILE.read_text() != shipped:
            P4INFO_FILE.write_text(shipped)
            log.warning("%s refreshed from the build: commit it", P4INFO_FILE)
        return
    fresh = genconsts.render(paths.p4_dir(), genconsts.parse_p4info(p.p4info))
    if genconsts.OUT.read_text() != fresh:  # (the shipped P4Info has the same names and ids)
        raise BuildError(f"the P4 program in {paths.p4_dir()} no longer matches this homagg's "
                         f"generated constants ({genconsts.OUT}); regenerate them in a checkout")


def _compile(p: Pipeline, out: Path, defines: list[str]) -> None:
    p4c = require("p4c-bm2-ss")
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(p4c), "--std", "p4-16", "--arch", "v1model", *defines,
           "--p4runtime-files", str(p.p4info), "-o", str(p.bmv2_json),
           str(paths.p4_dir() / "homagg.p4")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log = out / "p4c.log"
    log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        raise BuildError(f"p4c-bm2-ss failed (exit {proc.returncode}):\n{proc.stderr.strip()}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument("--words", type=int, metavar="K", help="words per packet (default 256)")
    a = ap.parse_args(argv)
    try:
        p = build(a.out, a.force, words=a.words)
    except HomaggError as e:
        print(f"homagg build: {e}", file=sys.stderr)
        return 1
    print(f"{p.bmv2_json}\n{p.p4info}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
