"""Every path a comment or docstring names in the code exists, so a reader who follows one is
not sent to a file that moved or never was. A path here: a name with a slash under one of the
checkout's own top-level folders (``host_agent/workloads.py``, ``p4/include/control/join.p4``),
or a Markdown page (``docs/agent.md``, ``CHANGELOG.md``). Files the code writes at run time
(``build/``, ``bench/out/``) are not the checkout's, and are left out."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (".py", ".p4", ".sh", ".proto")
GENERATED = ("build/", "bench/out/")
# a path-like token: folders and a file name with an extension, not inside a longer word
TOKEN = re.compile(r"(?<![\w./$-])((?:[\w.-]+/)*[\w.-]+\.(?:py|p4|md|toml|json|txtpb|proto|sh))"
                   r"(?![\w/])")


def tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout")
    return out.split()


def prose(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of a source's comments and docstrings: Python's from its tokens and
    syntax tree; other languages' whole text (their comments are what names files)."""
    text = path.read_text(errors="replace")
    if path.suffix != ".py":
        return [(1, text)]
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def named_paths(files: list[str]) -> list[tuple[str, int, str]]:
    """(file, line, path) for every checked path named in the sources' comments and
    docstrings."""
    tops = {f.split("/", 1)[0] + "/" for f in files if "/" in f}
    found = []
    for f in files:
        if not f.endswith(SOURCES):
            continue
        for line, text in prose(ROOT / f):
            for m in TOKEN.finditer(text):
                tok = m.group(1)
                if tok.startswith(GENERATED):
                    continue
                if ("/" in tok and tok.split("/", 1)[0] + "/" in tops) or \
                        ("/" not in tok and tok.endswith(".md")):
                    found.append((f, line + text.count("\n", 0, m.start()), tok))
    return found


def exists(tok: str, files: set[str]) -> bool:
    # the top-level folders are linked into homagg/: a name under homagg/controller is one under
    # controller
    alias = tok[len("homagg/"):] if tok.startswith("homagg/") else tok
    return any(p in files or (ROOT / p).is_dir() for p in (tok, alias, "docs/" + tok))


def test_every_path_a_comment_names_exists():
    files = tracked()
    named = named_paths(files)
    assert len(named) > 20  # the scan finds the references there are
    missing = [f"{f}:{line}: {tok}" for f, line, tok in named if not exists(tok, set(files))]
    assert not missing, "paths named in the code that do not exist:\n" + "\n".join(missing)


def test_a_dead_reference_is_found(tmp_path):
    # the check above can fail: a name under a real folder that is not there
    files = tracked()
    assert not exists("host_agent/ncf.py", set(files))
    assert exists("host_agent/workloads.py", set(files))
    assert not exists("DESIGN.md", set(files))
    assert exists("agent.md", set(files))
