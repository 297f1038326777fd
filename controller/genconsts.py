"""Generate homagg/_p4consts.py, the Python side of the protocol, from the P4 program.

    python -m homagg.controller.genconsts [--p4info build/p4/homagg.p4info.txtpb] [--check]

The P4 source is the one place a protocol constant is written: every ``const bit<N> NAME = ...;``
and numeric ``#define`` under p4/include, the field list of ``header homagg_h`` and the members
of every serializable ``enum bit<N>``. The compiled P4Info adds the tables, their match fields,
actions and their parameters, counters and registers: their full names as constants
(``TABLE_LOCAL_IP``, ...) and all of it, ids and widths too, as ``SCHEMA``, a typed
``homagg.p4schema.P4Schema`` written out as Python (loading it needs no protobuf), so the
controller never types a P4 name. ``homagg-ctl build`` runs this after compiling; a test fails
when the committed file differs from what this makes now (the P4Info half only where p4c is
installed).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from pprint import pformat

import homagg
from homagg import paths
from homagg.p4schema import P4Schema, from_p4info

OUT = Path(homagg.__file__).resolve().parent / "_p4consts.py"
HEADER_NAME = "homagg_h"
# Counter groups: a constant's prefix says which counter array it indexes.
COUNTER_GROUPS = {"STATS": ("STAT_", "DROP_"), "FWD_STATS": ("FWD_",), "JOB_STATS": ("JOB_STAT_",)}

_CONST = re.compile(r"^\s*const\s+bit<\d+>\s+(\w+)\s*=\s*([^;]+);")
_DEFINE = re.compile(r"^\s*#define\s+([A-Z_][A-Z0-9_]*)\s+(.+?)\s*$")
_ENUM = re.compile(r"enum\s+bit<(\d+)>\s+(\w+)\s*\{(.*?)\}", re.S)


class GenError(RuntimeError):
    pass


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _eval(expr: str, env: dict[str, int]) -> int | None:
    """A P4/C constant expression over integers and earlier constants, or None if not one."""
    expr = re.sub(r"\b\d+w(\d+)\b", r"\1", expr.strip())  # width-prefixed literals: 8w1
    expr = re.sub(r"\((bit|int)<\d+>\)", "", expr)         # casts
    if not re.fullmatch(r"[\w\s()+\-*/%<>&|^~]+", expr):
        return None
    try:
        value = eval(expr.replace("/", "//"), {"__builtins__": {}}, dict(env))  # noqa: S307
    except Exception:  # a macro that is not a number (LANE_ADD(r, v), a type, ...)
        return None
    return value if isinstance(value, int) else None


def include_files(p4_dir: Path) -> list[Path]:
    """The include files in the order the top file includes them, then any others."""
    inc = p4_dir / "include"
    files = sorted(inc.rglob("*.p4"))
    top = (p4_dir / "homagg.p4").read_text()
    order = [inc / m for m in re.findall(r'#include\s+"include/([^"]+)"', top)]
    return [f for f in order if f in files] + [f for f in files if f not in order]


def parse_constants(p4_dir: Path) -> dict[str, int]:
    """Every numeric constant of the include files, in source order."""
    env: dict[str, int] = {}
    for f in include_files(p4_dir):
        for line in _strip_comments(f.read_text()).splitlines():
            m = _CONST.match(line) or _DEFINE.match(line)
            if not m or m.group(1).endswith("_P4"):  # include guards
                continue
            value = _eval(m.group(2), env)
            if value is not None:
                env[m.group(1)] = value
    return env


def parse_header(p4_dir: Path, name: str = HEADER_NAME) -> list[tuple[str, int]]:
    for f in include_files(p4_dir):
        m = re.search(rf"header\s+{name}\s*\{{(.*?)\}}", _strip_comments(f.read_text()), re.S)
        if m:
            return [(field, int(w)) for w, field in re.findall(r"bit<(\d+)>\s+(\w+)\s*;",
                                                                m.group(1))]
    raise GenError(f"header {name} not found under {p4_dir / 'include'}")


def parse_enums(p4_dir: Path) -> dict[str, dict[str, int]]:
    enums: dict[str, dict[str, int]] = {}
    for f in include_files(p4_dir):
        for _bits, name, body in _ENUM.findall(_strip_comments(f.read_text())):
            members = {}
            for item in body.split(","):
                if item.strip():
                    k, _, v = item.partition("=")
                    members[k.strip()] = int(v.strip(), 0)
            enums[name] = members
    return enums


def parse_p4info(path: Path) -> P4Schema:
    """The schema of a P4Info text file (p4c's output, or homagg/_p4info.txtpb)."""
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2

    info = p4info_pb2.P4Info()
    text_format.Parse(path.read_text(), info)
    return from_p4info(info)


def _short(name: str) -> str:
    """A Python name for a P4 object: its last component, upper case."""
    return re.sub(r"\W", "_", name.rsplit(".", 1)[-1]).upper()


def _fmt(value) -> str:
    return pformat(value, width=80, sort_dicts=False)


def render(p4_dir: Path, p4info: P4Schema | None) -> str:
    consts = parse_constants(p4_dir)
    header = parse_header(p4_dir)
    enums = parse_enums(p4_dir)
    lines = [
        '"""The homagg protocol and pipeline names, generated from the P4 program. Do not edit.',
        "",
        "Made by homagg.controller.genconsts from p4/include/*.p4 (constants, the homagg_h field",
        "list, enums) and the compiled P4Info (names and ids). Change the P4 source, then run",
        "`homagg-ctl build` or `python -m homagg.controller.genconsts --p4info ...`.",
        '"""',
        "",
        "import enum",
        "",
        "from homagg.p4schema import (P4Action, P4ActionParam, P4Counter, P4MatchField,",
        "                             P4Register, P4Schema, P4Table)",
        "",
        "# fmt: off",
        "# ---- constants (p4/include) ----",
    ]
    lines += [f"{k} = {v}" for k, v in consts.items()]
    lines += ["", "# ---- counter indices by counter array: index -> name ----"]
    for group, prefixes in COUNTER_GROUPS.items():
        entries = {v: k for k, v in consts.items() if k.startswith(prefixes)
                   and not (group == "STATS" and k.startswith("JOB_STAT"))
                   and k not in ("STATS_SIZE", "FWD_STATS_SIZE", "JOB_STATS_SIZE",
                                 "JOB_STATS_PER_JOB")}
        lines.append(f"{group}: dict[int, str] = {_fmt(dict(sorted(entries.items())))}")
    lines += ["", f"# ---- header {HEADER_NAME}: (field, bits), first on the wire first ----",
              f"HEADER_FIELDS: tuple[tuple[str, int], ...] = {tuple(header)!r}",
              "", "# ---- serializable enums: name -> member -> value ----",
              f"ENUMS: dict[str, dict[str, int]] = {_fmt(enums)}",
              ""]
    for name, members in enums.items():
        lines += ["", f"class {name}(enum.IntEnum):"]
        lines += [f"    {k} = {v}" for k, v in members.items()]
    lines += ["",
              "", "# ---- P4Info: full names, ids, match fields and parameters ----"]
    if p4info is None:  # only while bootstrapping: the committed file always has P4Info
        lines.append("# (no P4Info given: compile with homagg-ctl build and regenerate)")
        p4info = P4Schema()
    for kind, objs in (("TABLE", p4info.tables), ("ACTION", p4info.actions),
                       ("COUNTER", p4info.counters), ("REGISTER", p4info.registers)):
        short: dict[str, str] = {}
        for name in (o.name for o in objs):
            s = _short(name)
            if s in short:  # two objects share a last component: keep both fully named
                raise GenError(f"P4 names {short[s]} and {name} both end in {s}; rename one")
            short[s] = name
        for s, name in short.items():
            lines.append(f"{kind}_{s} = {name!r}")
    # the typed schema (homagg.p4schema), written out whole: the package needs no protobuf to
    # load it
    lines += ["", f"SCHEMA: P4Schema = {_fmt(p4info)}", "# fmt: on", ""]
    return "\n".join(lines)


def split_halves(text: str) -> tuple[str, str]:
    """(the part from the P4 source, the part from P4Info) of a generated file."""
    cut = text.index("# ---- P4Info")
    return text[:cut], text[cut:]


def generate(p4info_path: Path | None = None, p4_dir: Path | None = None,
             out: Path = OUT) -> bool:
    """Write the generated module; True if it changed."""
    text = render(p4_dir or paths.p4_dir(), parse_p4info(p4info_path) if p4info_path else None)
    old = out.read_text() if out.exists() else None
    if old == text:
        return False
    out.write_text(text)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p4info", type=Path, default=paths.build_dir() / "homagg.p4info.txtpb")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    a = ap.parse_args(argv)
    if not a.p4info.is_file():
        print(f"genconsts: {a.p4info} not found: run homagg-ctl build first", file=sys.stderr)
        return 1
    if a.check:
        fresh = render(paths.p4_dir(), parse_p4info(a.p4info))
        if a.out.read_text() != fresh:
            print(f"genconsts: {a.out} is out of date", file=sys.stderr)
            return 1
        return 0
    print(f"{a.out}: {'updated' if generate(a.p4info, out=a.out) else 'unchanged'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
