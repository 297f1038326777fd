"""Tests generated from the TNA program by P4Testgen's Tofino target, replayed through the
switch model (``homagg.switch_model.tna``): has the program ever run? This is its executor,
written by nobody here.

    homagg-ctl build --target tofino --testgen N [--seed S]

runs ``p4testgen`` (p4c's P4Tools, on PATH or ``$HOMAGG_P4TESTGEN``) on
p4/tofino/homagg_tna.p4 three times (``STEERS``), for at most N tests each, seeded, preferring
paths that cover new statements; it writes them as PTF (the only test back end that carries
the register cells a test starts from) under the state directory, and for each test compares
the frame P4Testgen says leaves (and on which port), or its drop, with the model's answer for
that pass, from the same table entries and register cells. Each test ends as one of:

- **agreed**: the same frame on the same port (bits P4Testgen leaves undecided aside), or both
  drop;
- **declared**: it agrees once a difference the TNA design declares is taken in
  (``tna.DIFFERENCES``), named;
- **a byte short**: the model's frame leaves on P4Testgen's port, and P4Testgen's frame after
  egress is the model's shifted as P4Testgen v1.2.5.16's 1-bit ``egress_rid`` shifts it
  (``SHORT``, ``rid_bug``): one byte short, and every bit it decides agrees (a P4Testgen with
  that fixed gives none of these);
- **outside**: its table entries or registers are no state homagg's control plane and
  protocol reach (a job entry homagg-ctl never writes, bookkeeping cells that disagree with
  each other): there is no model state to compare with, and the reason is named;
- **disagreed**: anything else, a bug in the program or the model.

It prints those counts and P4Testgen's statement coverage of the program, each run's and the
three runs' together (a statement any of them covers).
"""

from __future__ import annotations

import ast
import gzip
import itertools
import re
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homagg import paths
from homagg.controller.build_tofino import WORDS_BY_TARGET
from homagg.errors import HomaggError
from homagg.switch_model import tna
from homagg.targets.toolchain import require

#: target -> its architecture
TARGETS = {"tofino": "tna", "tofino2": "t2na"}

#: a table's keys as its entries name them (the P4 @name, or the field's last part)
KEY_NAMES = {"job_workers": ("src_addr", "src_port"), "local_ip": ("dst_addr",),
             "arp_proxy": ("tpa",), "aggregators": ("src_addr", "port"),
             "ipv4_route": ("dst_addr",), "result_dst": ("job", "rid")}


#: P4Testgen's runs, and the HOMAGG_TESTGEN_STEER each compiles the program with: "plain" is
#: the program as bf-p4c compiles it, which P4Testgen alone never gets past admission
#: (docs/switch.md says why); the other two steer it there, to a contribution or to a join
#: (``testgen_assume`` in p4/tofino/include/aggregation.p4)
STEERS = {"plain": 0, "contributions": 1, "joins": 2}


class TestgenError(HomaggError):
    pass


@dataclass
class GenTest:
    """One generated test: its name, the frame sent and the port, the frame expected (with the
    bits P4Testgen leaves undecided) and its port, or None for a drop; the tables and the
    register cells it starts from; the statement coverage reached when it was written."""

    name: str
    port: int
    frame: bytes
    out_port: int | None
    out_frame: bytes | None
    dont_care: list[tuple[int, int]]          # (first bit, bits)
    tables: tna.Tables
    registers: dict[str, dict[int, dict[str, int]]]
    coverage: float = 0.0
    trace: str = ""


@dataclass
class Result:
    test: GenTest
    outcome: str                  # agreed, declared, a byte short, outside, disagreed
    detail: str = ""
    declared: tuple[str, ...] = ()


@dataclass
class Summary:
    results: list[Result] = field(default_factory=list)
    coverage: float = 0.0
    statements: tuple[int, int] | None = None   # covered, of all (p4testgen's logs)
    #: each run (``STEERS``): its tests, and the statements its log says it covered
    runs: dict[str, tuple[int, tuple[int, int] | None]] = field(default_factory=dict)

    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.results)

    def render(self) -> str:
        n = len(self.results)
        lines = [f"{'run':<19} tests  statement coverage"] if self.runs else []
        for name, (tests, cov) in self.runs.items():
            of = f"{100 * cov[0] / cov[1]:.0f}% ({cov[0]} of {cov[1]})" if cov else "?"
            lines.append(f"{name:<19} {tests:5}  {of}")
        lines += [f"tests generated     {n}",
                 f"agreed              {self.count('agreed')}",
                 f"declared            {self.count('declared')}"]
        by = Counter(d for r in self.results if r.outcome == "declared" for d in r.declared)
        lines += [f"  {k}: {v}" for k, v in sorted(by.items())]
        lines.append(f"a byte short        {self.count('a byte short')}  ({SHORT})")
        lines.append(f"outside             {self.count('outside')}")
        why = Counter(_kind(r.detail) for r in self.results if r.outcome == "outside")
        lines += [f"  {k}: {v}" for k, v in sorted(why.items())]
        lines.append(f"disagreed           {self.count('disagreed')}")
        of = f" ({self.statements[0]} of {self.statements[1]})" if self.statements else ""
        runs = ", the runs together" if len(self.runs) > 1 else ""
        lines.append(f"statement coverage  {100 * self.coverage:.0f}%{of}{runs}")
        for r in self.results:
            if r.outcome == "disagreed":
                lines.append(f"\n{r.test.name}: {r.detail}")
        return "\n".join(lines)


def _kind(detail: str) -> str:
    return re.sub(r"\d+", "N", re.sub(r"0x[0-9a-f]+", "X", detail))


# -- generating --------------------------------------------------------------------------------
def generate(n: int, seed: int = 1, target: str = "tofino", out: Path | None = None,
             timeout: float | None = None, steer: str = "plain") -> Path:
    """Run p4testgen for at most ``n`` tests, steered as ``STEERS[steer]`` says; return the
    PTF file it wrote (its log, with the statements it left uncovered, beside it)."""
    if target not in TARGETS:
        raise TestgenError(f"target {target!r}: one of {', '.join(TARGETS)}")
    if steer not in STEERS:
        raise TestgenError(f"run {steer!r}: one of {', '.join(STEERS)}")
    tool = require("p4testgen")
    out = out or paths.state_dir() / f"{target}-testgen" / steer
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.py"):
        old.unlink()
    src = paths.p4_dir() / "tofino" / "homagg_tna.p4"
    # (bf-p4c's driver defines __TARGET_TOFINO__, which tna.p4 and t2na.p4 check; p4testgen's
    # does not)
    cmd = [str(tool), "--target", target, "--arch", TARGETS[target], "--std", "p4-16",
           f"-D__TARGET_TOFINO__={2 if target == 'tofino2' else 1}",
           f"-DWORDS_PER_PACKET={WORDS_BY_TARGET[target]}",
           *([f"-DHOMAGG_TESTGEN_STEER={STEERS[steer]}"] if STEERS[steer] else []),
           "--test-backend", "PTF", "--out-dir", str(out), "--max-tests", str(n),
           "--seed", str(seed), "--path-selection", "GREEDY_STATEMENT_SEARCH",
           "--track-coverage", "STATEMENTS", "--print-coverage", str(src)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise TestgenError(f"p4testgen ran past {timeout} s") from e
    (out / "testgen.log").write_text(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    files = sorted(out.glob("*.py"))
    if proc.returncode != 0 or not files:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise TestgenError(f"p4testgen failed (exit {proc.returncode}; the log: "
                           f"{out / 'testgen.log'}):\n{tail}")
    return files[0]


def coverage_of(log: str) -> tuple[int, int] | None:
    """The statements covered and those there are, as p4testgen reports after its last test
    ("Nodes covered: 0.85 (170/200)")."""
    found = re.findall(r"Nodes covered: [0-9.e+-]+ \((\d+)/(\d+)\)", log)
    return (int(found[-1][0]), int(found[-1][1])) if found else None


def uncovered(log: str) -> set[tuple[str, int, str]] | None:
    """The statements p4testgen left uncovered (``--print-coverage``: "Not covered program
    nodes:", then a tab, the file, a backslash, the line, and the statement), as (file's
    name, line, statement); None if the log has no such list."""
    if "Not covered program nodes:" not in log:
        return None
    last = log.rsplit("Not covered program nodes:", 1)[1]
    return {(m[1].rsplit("/", 1)[-1], int(m[2]), m[3].strip())
            for m in re.finditer(r"^\t(\S+?)\\(\d+): (.*)$", last, re.M)}


def union_coverage(logs: dict[str, str]) -> tuple[int, int] | None:
    """The statements of the plain program that any run covered, and all there are. A run
    steered by ``testgen_assume`` has the same statements at the same lines (the
    preprocessor keeps them), and its assumptions besides, which the plain program lacks."""
    plain = logs.get("plain")
    total = coverage_of(plain) if plain else None
    left = [uncovered(log) for log in logs.values()]
    if total is None or any(u is None for u in left):
        return None
    never = set.intersection(*(u for u in left if u is not None))
    return total[1] - len(never), total[1]


# -- reading PTF -------------------------------------------------------------------------------
def _last(name: str, parts: int = 1) -> str:
    return ".".join(name.split(".")[-parts:])


def _value(node: ast.AST) -> Any:
    return ast.literal_eval(node)


def _method(cls: ast.ClassDef, name: str) -> list[ast.stmt]:
    for f in cls.body:
        if isinstance(f, ast.FunctionDef) and f.name == name:
            return f.body
    return []


def _calls(body: list[ast.stmt]) -> list[ast.Call]:
    return [n for s in body for n in ast.walk(s) if isinstance(n, ast.Call)]


def _elts(node: ast.AST) -> list[ast.expr]:
    assert isinstance(node, (ast.List, ast.Tuple))
    return node.elts


def _tuple_args(node: ast.AST) -> tuple[str, list]:
    """gc.KeyTuple('name', v[, mask] | low=, high= | prefix_len=) or gc.DataTuple('p', v)."""
    assert isinstance(node, ast.Call)
    name = _value(node.args[0])
    vals = [_value(a) for a in node.args[1:]]
    kw = {k.arg: _value(k.value) for k in node.keywords}
    if "prefix_len" in kw:
        vals = [(vals[0], kw["prefix_len"])]
    elif "low" in kw:
        vals = [(kw["low"], kw["high"])]
    elif len(vals) == 2:
        vals = [(vals[0], vals[1])]
    return str(name), vals


def compact(text: str) -> str:
    """A PTF file without its tests' traces (each class's docstring: the statements p4testgen
    stepped through, megabytes for this program), everything ``parse_ptf`` reads kept."""
    return re.sub(r"\n    '''\n.*?\n    '''\n", "\n", text, flags=re.S)


def read_ptf(path: Path) -> str:
    """A PTF file's text, gzipped (``.gz``: how the committed ones are kept) or not."""
    if path.suffix == ".gz":
        return gzip.decompress(path.read_bytes()).decode()
    return path.read_text()


def parse_ptf(path: Path, run: str = "") -> list[GenTest]:
    """The tests of a PTF file, named ``run/TestN`` where ``run`` is given."""
    text = read_ptf(path)
    tree = ast.parse(text)
    # (each class's first lines: "# Current statement coverage: 0.61"; read once, the file
    # is over 100 MB with its traces)
    coverage = {m[1]: float(m[2]) for m in re.finditer(
        r"^class (Test\d+)\(.*\n(?:    #.*\n)*?    # Current statement coverage: ([0-9.]+)",
        text, re.M)}
    return [_test(cls, coverage.get(cls.name, 0.0), run) for cls in tree.body
            if isinstance(cls, ast.ClassDef) and re.fullmatch(r"Test\d+", cls.name)]


def _test(cls: ast.ClassDef, coverage: float, run: str = "") -> GenTest:
    tables = tna.Tables()
    regs: dict[str, dict[int, dict[str, int]]] = {}
    for call in _calls(_method(cls, "setupCtrlPlane")):
        fn = call.func.attr if isinstance(call.func, ast.Attribute) else ""
        if fn == "insertTableEntry":
            table = _last(str(_value(call.args[0])))
            keys = dict(_tuple_args(k) for k in _elts(call.args[1]))
            action = _last(str(_value(call.args[2])))
            params = {n: v[0] for n, v in (_tuple_args(d) for d in _elts(call.args[3]))}
            names = KEY_NAMES.get(table, tuple(keys))
            kv = {_last(k): v[0] for k, v in keys.items()}
            key = tuple(kv.get(n, next(iter(kv.values()), 0) if len(kv) == 1 else 0)
                        for n in names)
            tables.entries.setdefault(table, []).append((key, action, params))
        elif fn == "overrideDefaultEntry":
            table = _last(str(_value(call.args[0])))
            action = _last(str(_value(call.args[1])))
            params = {n: v[0] for n, v in (_tuple_args(d) for d in _elts(call.args[2]))}
            tables.defaults[table] = (action, params)
        elif fn == "setRegisterValue":
            reg = _last(str(_value(call.args[0])), 2)
            value = _value(call.args[1])
            index = int(_value(call.args[2]))
            if isinstance(value, list):
                cell = {_last(n): int(v) for n, v in value}
            else:
                cell = {"f1": int(value)}
            regs.setdefault(reg, {})[index] = cell
    send = {t.targets[0].id: _value(t.value) for t in _method(cls, "sendPacket")
            if isinstance(t, ast.Assign) and isinstance(t.targets[0], ast.Name)
            and t.targets[0].id in ("ig_port", "pkt")}
    verify = {t.targets[0].id: t.value for t in _method(cls, "verifyPackets")
              if isinstance(t, ast.Assign) and isinstance(t.targets[0], ast.Name)
              and isinstance(t.value, ast.Constant)}
    care = [(int(_value(c.args[0])), int(_value(c.args[1])))
            for c in _calls(_method(cls, "verifyPackets"))
            if isinstance(c.func, ast.Attribute) and c.func.attr == "set_do_not_care"]
    out_port = out_frame = None
    if "eg_port" in verify:
        out_port = int(_value(verify["eg_port"]))
        out_frame = bytes(_value(verify["exp_pkt"]))
    name = f"{run}/{cls.name}" if run else cls.name
    return GenTest(name, int(send["ig_port"]), bytes(send["pkt"]), out_port, out_frame,
                   care, tables, regs, coverage, ast.get_docstring(cls) or "")


# -- replaying ---------------------------------------------------------------------------------
def _differ(exp: tna.Expect, t: GenTest) -> str | None:
    """None if the model's answer is P4Testgen's, else how they differ."""
    if exp.frame is None or t.out_frame is None:
        if exp.frame is None and t.out_frame is None:
            return None
        if exp.frame is None:
            return f"model drops ({exp.rule}); P4Testgen sends on port {t.out_port}"
        return f"model sends ({exp.rule}) on port {exp.port}; P4Testgen drops"
    if exp.port is not None and exp.port != t.out_port:
        return f"model sends on port {exp.port} ({exp.rule}); P4Testgen on {t.out_port}"
    a, b = exp.frame, t.out_frame
    care = bytearray(exp.care or b"\xff" * len(a))
    short = len(a) == len(b) + 1 and exp.port is not None and exp.port == t.out_port
    if short:   # (P4Testgen's egress_rid of 1 bit: SHORT)
        a, shifted = rid_bug(a, bytes(care))
        care = bytearray(shifted)
    if len(a) != len(b):
        return f"model's frame is {len(a)} bytes ({exp.rule}); P4Testgen's {len(b)}"
    for first, bits in t.dont_care:
        for bit in range(first, first + bits):
            care[bit // 8] &= ~(0x80 >> bit % 8) & 0xFF
    bad = [i for i in range(len(a)) if (a[i] ^ b[i]) & care[i]]
    if not bad:
        return SHORT if short else None
    how = " (as P4Testgen shifts it, SHORT)" if short else ""
    return (f"{exp.rule}{how}: frames differ at bytes {bad[:8]}{'...' if len(bad) > 8 else ''}: "
            f"model {a[bad[0]:bad[0] + 8].hex()} P4Testgen {b[bad[0]:bad[0] + 8].hex()}")


def _compare(t: GenTest, declared: frozenset[str], tofino2: bool) -> str | None:
    p = tna.TnaPass(t.tables, t.registers, tofino2, declared)
    exp = p.expect(t.port, t.frame)
    if exp.frame is not None and exp.job is not None:   # a multicast: the replica let out
        reps = p.replicas(exp.job, exp)
        if t.out_frame is None:   # the replica's rid had no entry (drop_replica)
            return None
        whys = [_differ(r, t) for r in reps] or ["no result_dst entry lets a replica out"]
        return None if None in whys else whys[0]
    return _differ(exp, t)


#: P4Testgen v1.2.5.16's Tofino targets give ``eg_intr_md.egress_rid`` 1 bit, not 16
#: (targets/tofino/tofino/cmd_stepper.cpp and tofino2/: ``sixteenBitType`` is
#: ``Type_Bits::get(1)``), so the egress intrinsic metadata they put before the packet is 15
#: bits short of what the egress parser extracts, in every program that reads egress_rid (this
#: one does: result_dst). Their frame after egress is then the model's less its first 15 bits,
#: behind 7 zero bits: one byte short, what egress parsed shifted and left undecided. Such a
#: test is compared on its port and on every bit P4Testgen decides, shifted so (``rid_bug``)
SHORT = "P4Testgen v1.2.5.16's egress_rid is 1 bit wide: its egress frame is 15 bits short"


def rid_bug(frame: bytes, care: bytes) -> tuple[bytes, bytes]:
    """``frame`` (and its ``care`` mask) as P4Testgen v1.2.5.16 gives it after egress
    (``SHORT``): its first 15 bits lost, 7 zero bits in front, one byte shorter."""
    n = 8 * len(frame) - 15
    keep = (1 << n) - 1
    out = (int.from_bytes(frame, "big") & keep).to_bytes(len(frame) - 1, "big")
    mask = (int.from_bytes(care, "big") & keep | 0x7F << n).to_bytes(len(frame) - 1, "big")
    return out, mask


def replay(t: GenTest, tofino2: bool = False) -> Result:
    try:
        why = _compare(t, frozenset(), tofino2)
    except tna.Outside as e:
        return Result(t, "outside", str(e))
    if why is None:
        return Result(t, "agreed")
    if why == SHORT:
        return Result(t, "a byte short", SHORT)
    names = list(tna.DIFFERENCES)
    for size in range(1, len(names) + 1):
        for combo in itertools.combinations(names, size):
            try:
                if _compare(t, frozenset(combo), tofino2) is None:
                    return Result(t, "declared", why, combo)
            except tna.Outside:
                continue
    return Result(t, "disagreed", why)


def run(n: int, seed: int = 1, target: str = "tofino",
        ptfs: dict[str, Path] | None = None) -> Summary:
    """Generate the runs' tests (``STEERS``, ``n`` each), or read them (``ptfs``: run -> its
    PTF file, a log beside it where there is one), and replay each through the model."""
    if ptfs is None:
        ptfs = {steer: generate(n, seed, target, steer=steer) for steer in STEERS}
    s = Summary()
    logs = {}
    for name, ptf in ptfs.items():
        tests = parse_ptf(ptf, name)
        s.results += [replay(t, target == "tofino2") for t in tests]
        log = ptf.parent / "testgen.log"
        if log.is_file():
            logs[name] = log.read_text()
        s.runs[name] = (len(tests), coverage_of(logs[name]) if name in logs else None)
    if len(logs) == len(ptfs):
        s.statements = (union_coverage(logs) if len(logs) > 1
                        else coverage_of(next(iter(logs.values()))))
    s.coverage = (s.statements[0] / s.statements[1] if s.statements
                  else max((r.test.coverage for r in s.results), default=0.0))
    return s
