"""The house rules, checked: one import graph without circles, modules that do one job, one job
logic, one P4Info conversion.

    python tools/house.py [ROOT]      # prints each broken rule; exit 1 if any

The rules (what a review of the tree asked for, kept by tests/test_house.py):
- no import circle among the package's modules. Every import counts, a deferred one (inside a
  function) as well as one at module level: a deferred import hides a circle from Python at
  import time, not from the design. Only imports under ``if TYPE_CHECKING:`` are left out
  (they never run). Importing ``a.b.c`` also imports ``a`` and ``a.b`` (their ``__init__``),
  as Python does;
- no module over 500 lines in homagg/, controller/, host_agent/ or launcher/ (generated files,
  marked as such in their first lines, excepted);
- no job logic outside controller/: no function named ``add_job``, ``remove_job`` or
  ``reset_job`` is defined in the package outside controller/ (``controller.jobs`` is the one);
- no second P4Info-to-Python conversion: only homagg/p4schema.py reads a P4Info entity's
  ``preamble``, which every such conversion must;
- no merge-conflict markers left in the tree's text files (git's tracked files where ROOT is a
  checkout);
- no ``sys.path`` patch in any Python file of the tree (tests, benchmarks and tools included):
  code is imported as the installed package, or run with ``python -m`` from the root;
- nothing outside the test suites (tests/, bmv2_tests/, tofino_tests/) imports from tests/: the
  package, the benchmarks, the examples and the tools stand on the package (a benchmark also on
  bench/), never on the tests.

The package is homagg/ with its symlinked parts (controller/, host_agent/, launcher/, p4/),
read from ``ROOT``; tests, benchmarks and examples are not part of it.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MAX_LINES = 500
LINE_DIRS = ("homagg", "controller", "host_agent", "launcher")
JOB_FUNCTIONS = {"add_job", "remove_job", "reset_job"}
JOB_HOME = "homagg.controller"
SCHEMA_MODULE = "homagg.p4schema"
PACKAGE = "homagg"
TEST_SUITES = ("tests/", "bmv2_tests/", "tofino_tests/")


@dataclass(frozen=True)
class Module:
    name: str     # dotted, e.g. homagg.controller.jobs
    path: Path    # as found under ROOT (through the package's symlinks)
    tree: ast.Module
    text: str


def modules(root: Path) -> dict[str, Module]:
    """Every module of the package, by dotted name (symlinked parts under their homagg. name,
    once)."""
    out: dict[str, Module] = {}
    base = root / PACKAGE
    found = []
    for folder, dirs, files in os.walk(base, followlinks=True):  # (the symlinked parts too)
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    for path in sorted(found):
        rel = path.relative_to(base).with_suffix("")
        parts = [PACKAGE, *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        text = path.read_text()
        out[name] = Module(name, path, ast.parse(text, str(path)), text)
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth (functions' bodies included),
    except those under ``if TYPE_CHECKING:``, which never run."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
        return
    if isinstance(node, ast.If) and _is_type_checking(node):
        for sub in node.orelse:
            yield from _import_nodes(sub)
        return
    for sub in ast.iter_child_nodes(node):
        yield from _import_nodes(sub)


def _with_parents(name: str, known: dict[str, Module]) -> list[str]:
    """``a.b.c`` imports ``a``, ``a.b`` and ``a.b.c``: those that are modules here."""
    parts = name.split(".")
    return [n for n in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if n in known]


def imports(mod: Module, known: dict[str, Module]) -> set[str]:
    """The package's modules that importing ``mod`` imports directly."""
    out: set[str] = set()
    is_pkg = mod.path.name == "__init__.py"
    for node in _import_nodes(mod.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.update(_with_parents(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = mod.name.split(".")
                pkg = pkg if is_pkg else pkg[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.update(_with_parents(base, known))
            for alias in node.names:  # from a.b import c: c may be a module
                if f"{base}.{alias.name}" in known:
                    out.add(f"{base}.{alias.name}")
    out.discard(mod.name)
    # a module's own packages are being imported already when it runs: not an edge back
    return {n for n in out if not mod.name.startswith(n + ".")}


def import_cycles(known: dict[str, Module]) -> list[list[str]]:
    """Each strongly connected group of modules (more than one, or one importing itself):
    Tarjan's algorithm over the import-time graph."""
    graph = {n: sorted(imports(m, known)) for n, m in known.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def _generated(text: str) -> bool:
    head = "\n".join(text.splitlines()[:5]).lower()
    return "generated" in head and ("do not edit" in head or "by controller/genconsts" in head)


def long_modules(root: Path) -> list[tuple[str, int]]:
    out = []
    for d in LINE_DIRS:
        for path in sorted((root / d).rglob("*.py")):
            if "__pycache__" in path.parts or (d == "homagg" and path.is_symlink()):
                continue
            rel = path.relative_to(root).as_posix()
            if d == "homagg" and rel.split("/")[1] in ("controller", "host_agent", "launcher"):
                continue  # the symlinked parts: counted under their own folder
            text = path.read_text()
            n = len(text.splitlines())
            if n > MAX_LINES and not _generated(text):
                out.append((rel, n))
    return out


def job_logic_outside(known: dict[str, Module]) -> list[str]:
    out = []
    for name, mod in known.items():
        if name == JOB_HOME or name.startswith(JOB_HOME + "."):
            continue
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name in JOB_FUNCTIONS:
                out.append(f"{name}:{node.lineno} defines {node.name}")
    return out


def p4info_conversions(known: dict[str, Module]) -> list[str]:
    out = []
    for name, mod in known.items():
        if name == SCHEMA_MODULE:
            continue
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Attribute) and node.attr == "preamble":
                out.append(f"{name}:{node.lineno} reads a P4Info preamble")
    return out


_MARKERS = ("<" * 7 + " ", "=" * 7 + "\n", ">" * 7 + " ")
_TEXT = {".py", ".md", ".toml", ".p4", ".txt", ".sh", ".cfg", ".json", ".txtpb", ".yml"}


def _tracked(root: Path) -> list[Path]:
    """The tree's files: git's tracked ones where ROOT is a checkout, else every file."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True,
                                text=True, check=True).stdout.split("\n")
        return [root / p for p in listed if p and (root / p).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a checkout: every file
        return [p for p in root.rglob("*") if p.is_file()]


def conflict_markers(root: Path) -> list[str]:
    """Files with a line a merge left: ``<<<<<<< ``, ``=======`` alone, ``>>>>>>> ``."""
    out = []
    for path in _tracked(root):
        if path.suffix not in _TEXT and path.name not in ("run.sh", "run"):
            continue
        try:
            lines = path.read_text().splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue
        for n, line in enumerate(lines, 1):
            if line.startswith(_MARKERS) and (line.endswith("\n") or line.strip()):
                out.append(f"{path.relative_to(root).as_posix()}:{n}")
                break
    return out


def _python_trees(root: Path) -> Iterator[tuple[str, ast.Module]]:
    """The tree's Python files that parse: (path from ROOT, its syntax tree)."""
    for path in _tracked(root):
        if path.suffix != ".py":
            continue
        try:
            tree = ast.parse(path.read_text(), str(path))
        except (OSError, UnicodeDecodeError, SyntaxError):
            continue
        yield path.relative_to(root).as_posix(), tree


def _is_sys_path(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" \
        and isinstance(node.value, ast.Name) and node.value.id == "sys"


def sys_path_patches(root: Path) -> list[str]:
    """Where a Python file changes ``sys.path``: a call of one of its methods, an assignment
    to it or to a slice of it."""
    out = []
    for rel, tree in _python_trees(root):
        for node in ast.walk(tree):
            hit = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and _is_sys_path(node.func.value)) or (
                isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                and any(_is_sys_path(t.value if isinstance(t, ast.Subscript) else t)
                        for t in (node.targets if isinstance(node, ast.Assign)
                                  else [node.target])))
            if hit:
                out.append(f"{rel}:{getattr(node, 'lineno', 0)}")
    return out


def _imported(node: ast.AST) -> list[str]:
    """The modules an import statement names (a relative one: none)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and not node.level and node.module:
        return [node.module]
    return []


def tests_imported(root: Path) -> list[str]:
    """Where a Python file outside the test suites imports a module of tests/."""
    out = []
    for rel, tree in _python_trees(root):
        if rel.startswith(TEST_SUITES) or rel == "conftest.py":
            continue
        for node in ast.walk(tree):
            if any(m == "tests" or m.startswith("tests.") for m in _imported(node)):
                out.append(f"{rel}:{getattr(node, 'lineno', 0)}")
    return out


def problems(root: Path) -> list[str]:
    known = modules(root)
    out = [f"import circle: {' -> '.join(c)}" for c in import_cycles(known)]
    out += [f"{p}: {n} lines (at most {MAX_LINES})" for p, n in long_modules(root)]
    out += [f"job logic outside controller/: {p}" for p in job_logic_outside(known)]
    out += [f"a second P4Info conversion: {p}" for p in p4info_conversions(known)]
    out += [f"merge-conflict marker: {p}" for p in conflict_markers(root)]
    out += [f"a sys.path patch: {p}" for p in sys_path_patches(root)]
    out += [f"an import of the tests outside the test suites: {p}" for p in tests_imported(root)]
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    found = problems(root)
    for p in found:
        print(p)
    print(f"house rules: {len(found)} broken" if found else "house rules: all kept")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
