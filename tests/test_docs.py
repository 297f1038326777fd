"""The documentation is held to the code: README.md and docs/*.md.

Runs anywhere in seconds: no network, no root, no subprocess (the commands' parsers are built
in-process). What the tests check:

- every ``homagg-ctl``/``homagg-net``/``homagg-agent``/``homagg-softswitch`` command line in a
  code block uses only flags its (sub)command's parser has;
- relative links between pages, and their ``#anchors``, resolve;
- no commit hash or issue number appears in README.md or docs/;
- every error class of the package (a ``HomaggError`` subclass) has a section on the
  troubleshooting page, and every message it is raised with matches a pattern listed there;
- every figure a page shows is committed, is drawn by docs/figures/plots.py, and the page says
  the command that drew it;
- README.md stays short and keeps its first screen.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
TROUBLE = DOCS / "troubleshooting.md"
ELLIPSIS = "…"


# --- Markdown helpers -----------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~)")


def split_markdown(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, code lines): lines inside fenced blocks are code, the rest prose."""
    prose, code, inside = [], [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            inside = not inside
            continue
        (code if inside else prose).append(line)
    return prose, code


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"`", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose, _ = split_markdown(text)
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            a = anchor(m.group(2))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def links(text: str) -> list[str]:
    prose, _ = split_markdown(text)
    body = "\n".join(re.sub(r"`[^`]*`", "", line) for line in prose)
    return [a or b for a, b in LINK.findall(body)]


# --- 1. command lines against the parsers ---------------------------------------------------

def _parsers() -> dict[str, argparse.ArgumentParser]:
    from homagg.controller.cli import parser as ctl
    from homagg.host_agent.cli import parser as agent
    from homagg.launcher.cli import parser as net

    return {"homagg-ctl": ctl(), "homagg-agent": agent(), "homagg-net": net(),
            "homagg-softswitch": _softswitch_parser()}


def _softswitch_parser() -> argparse.ArgumentParser:
    from homagg.targets.soft.cli import parser

    return parser()


def _flags(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


MODULES = {"homagg.controller": "homagg-ctl", "homagg.host_agent": "homagg-agent",
           "homagg.launcher": "homagg-net", "homagg.targets.soft": "homagg-softswitch"}


@dataclass
class CommandLine:
    page: str
    line: str
    words: list[str]


def command_lines() -> list[CommandLine]:
    """Every homagg-* command line in a code block of README.md and docs/ (continuation lines
    joined; a shell prompt, comments and what follows a pipe or ; dropped; ``./run.sh demo``
    read as ``homagg-net demo``, which it runs)."""
    out = []
    for page in PAGES:
        _, code = split_markdown(page.read_text())
        joined, buf = [], ""
        for line in code:
            if line.rstrip().endswith("\\"):
                buf += line.rstrip()[:-1] + " "
                continue
            joined.append(buf + line)
            buf = ""
        for line in joined:
            s = re.sub(r"^\s*(\$|#)\s*", "", line)
            s = s.split(" #")[0]
            # ./run.sh demo passes its arguments to homagg-net demo
            s = re.sub(r"(?:^|(?<=\s))\./run\.sh demo\b", "homagg-net demo", s)
            # python -m homagg.<part> is the same command as its script
            for module, script in MODULES.items():
                s = re.sub(rf"\S*python3? -m {re.escape(module)}(?=\s|$)", script, s)
            pat = r"(?:^|(?<=[\s;(&|'\"]))homagg-(?:ctl|net|agent|softswitch)(?=\s|$)"
            starts = [m.start() for m in re.finditer(pat, s)]
            for start, end in zip(starts, [*starts[1:], len(s)]):
                # a command runs to the next command (one nested in sh -c '...'), ; | or &
                cmd = re.split(r"[;|&]", s[start:end])[0].rstrip(" '\"")
                if len(cmd.split()) > 1 and cmd.split()[1].startswith("("):
                    continue  # prose in a picture: "installed by homagg-ctl (P4Runtime)"
                try:
                    words = shlex.split(cmd.replace("[", " ").replace("]", " "))
                except ValueError:
                    words = cmd.replace("[", " ").replace("]", " ").split()
                out.append(CommandLine(page.relative_to(ROOT).as_posix(), line.strip(), words))
    return out


def check_command(parsers: dict[str, argparse.ArgumentParser], words: list[str]) -> list[str]:
    """Flags of ``words`` (a homagg-* command line) that its (sub)command does not have."""
    p = parsers[words[0]]
    known = _flags(p)
    bad = []
    for w in words[1:]:
        if w == "--":
            break  # what follows is another program's command line
        sub = _subparsers(p)
        if w in sub:
            p = sub[w]
            known = _flags(p)  # argparse: after a subcommand, only its own flags
            continue
        if w.startswith("--"):
            flag = w.split("=")[0]
            for part in flag.split("/"):
                part = part if part.startswith("--") else "--" + part
                if part not in known:
                    bad.append(part)
    return bad


def test_documented_commands_exist():
    parsers = _parsers()
    lines = command_lines()
    assert len(lines) >= 30, "the pages lost their command lines, or this test lost them"
    seen = {cl.words[0] for cl in lines}
    assert seen == set(parsers), f"no documented command line for {set(parsers) - seen}"
    bad = [f"{cl.page}: {cl.line!r}: {flag}" for cl in lines
           for flag in check_command(parsers, cl.words)]
    assert not bad, "documented flags that the parsers do not have:\n" + "\n".join(bad)


def test_flag_check_can_fail():
    parsers = _parsers()
    assert check_command(parsers, ["homagg-ctl", "job", "add", "1", "--slots", "4"]) == []
    assert check_command(parsers, ["homagg-ctl", "job", "list", "--no-such-flag"])
    # a subcommand's flag on another subcommand is refused
    assert check_command(parsers, ["homagg-net", "local", "--service"]) == ["--service"]
    assert check_command(parsers, ["homagg-softswitch", "--bind", "x", "--nope"]) == ["--nope"]
    # the top level's flags go before the subcommand
    assert check_command(parsers, ["homagg-ctl", "-c", "x", "stats", "--json"]) == []
    assert check_command(parsers, ["homagg-ctl", "stats", "--config", "x"]) == ["--config"]


def test_transcripts_say_what_produced_them():
    """A code block that quotes output (the demo's last lines, a ``$ homagg-...`` session) has
    the command that produced it in the paragraph before it."""
    bad = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"```[a-z]*\n(.*?)```", text, re.S):
            block = m.group(1)
            if not (block.startswith("$ homagg") or "done on " in block):
                continue
            before = text[max(0, m.start() - 700):m.start()]
            if not re.search(r"`(?:sudo |\./run\.sh|homagg-|\S*python|\S*pytest)[^`]*`", before):
                bad.append(f"{page.name}: {block.splitlines()[0][:60]!r}")
    assert not bad, "quoted output with no command before it:\n" + "\n".join(bad)


# --- 2. links and anchors -------------------------------------------------------------------

def test_links_resolve():
    bad = []
    for page in PAGES:
        for target in links(page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target}: no such file")
                continue
            if frag and dest.suffix == ".md" and frag not in anchors(dest.read_text()):
                bad.append(f"{page.name}: {target}: no heading #{frag} in {dest.name}")
    assert not bad, "\n".join(bad)


def test_link_check_can_fail():
    text = "# A page\n\n## Two words\n\n```\n## not a heading\n```\n"
    assert anchors(text) == {"a-page", "two-words"}
    assert anchor("The controller as a service: `homagg-ctl serve`") == \
        "the-controller-as-a-service-homagg-ctl-serve"
    assert links("see [x](a.md#b) and ![p](f.svg), not `[y](c.md)`") == ["a.md#b", "f.svg"]


def test_every_concept_has_a_page_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for name in ("architecture", "protocol", "switch", "controller", "agent", "deploy",
                 "reliability", "performance", "troubleshooting"):
        assert (DOCS / f"{name}.md").exists(), f"docs/{name}.md is missing"
        assert f"docs/{name}.md" in readme, f"README.md does not link docs/{name}.md"


# --- 3. no history in the docs ---------------------------------------------------------------

HEX = re.compile(r"(?<![\w.:/])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")
ISSUE = re.compile(r"(?i)\b(?:issue|pull request|PR)\s*#?\s*\d+")
NUMBER_SIGN = re.compile(r"(?<![\w&/])#\d+\b")
# hex strings that are not commits: a model digest the demo prints
DIGEST = re.compile(r"identical models \(([0-9a-f]{16})\)")


def history_found(text: str) -> list[str]:
    prose, code = split_markdown(text)
    found = []
    for line in prose:
        found += HEX.findall(line) + ISSUE.findall(line)
        found += NUMBER_SIGN.findall(re.sub(r"`[^`]*`", "", line))
    for line in code:
        line = DIGEST.sub("identical models (digest)", line)
        found += HEX.findall(line) + ISSUE.findall(line)
    return found


def test_no_commit_hashes_or_issue_numbers():
    bad = [f"{p.relative_to(ROOT)}: {h}" for p in PAGES for h in history_found(p.read_text())]
    # the figures' script and data too (read as code; SVGs hold colours, not history)
    for f in sorted(DOCS.rglob("*")):
        if f.suffix in (".py", ".json"):
            bad += [f"{f.relative_to(ROOT)}: {h}"
                    for h in history_found("```\n" + f.read_text() + "\n```")]
    assert not bad, "history belongs in CHANGELOG.md:\n" + "\n".join(bad)


def test_history_check_can_fail():
    assert history_found("fixed in 177edbe, see issue 15")
    assert history_found("bmv2 693e69e6 ran it; #12 too")
    assert history_found("```\nsimple_switch_grpc 1.15.5-9674187f\n```")
    assert not history_found("K = 256, 0xBEE0, 1078-byte frames, seq 17534, 4.53e+06")
    assert not history_found("```\nidentical models (51cbcb289c30a084)\n```")


# --- 4. the troubleshooting page against the code --------------------------------------------

def _package_files() -> list[Path]:
    files = []
    for d, _, names in os.walk(ROOT / "homagg", followlinks=True):
        files += [Path(d) / n for n in names if n.endswith(".py") and "_pb2" not in n]
    return sorted(files)


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def error_classes() -> dict[str, Path]:
    """Every class in the package that derives from HomaggError (by name, transitively)."""
    bases: dict[str, tuple[set[str], Path]] = {}
    for f in _package_files():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = ({n for b in node.bases if (n := _name(b))}, f)
    found = {"HomaggError": bases["HomaggError"][1]}
    grew = True
    while grew:
        grew = False
        for name, (bs, f) in bases.items():
            if name not in found and bs & set(found):
                found[name] = f
                grew = True
    return found


def _templates(node: ast.expr) -> list[str]:
    """The message(s) an expression makes, placeholders as ELLIPSIS; [] if none is literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else ELLIPSIS
                        for v in node.values)]
    if isinstance(node, ast.IfExp):
        return _templates(node.body) + _templates(node.orelse)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _templates(node.left) or [ELLIPSIS]
        right = _templates(node.right) or [ELLIPSIS]
        return [a + b for a in left for b in right]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return [re.sub(r"%[-\d.]*[sdrfx]", ELLIPSIS, t) for t in _templates(node.left)]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format"):
        return [re.sub(r"\{[^}]*\}", ELLIPSIS, t) for t in _templates(node.func.value)]
    return []


def _normal(s: str) -> str:
    s = re.sub(r"\s+", " ", s).strip()
    return re.sub(f"(?:{ELLIPSIS}\\s*)+{ELLIPSIS}", ELLIPSIS, s)


def _literal_letters(s: str) -> int:
    return len(re.findall(r"[A-Za-z]", s.replace(ELLIPSIS, " ")))


def _literal_words(s: str) -> int:
    return len(re.findall(r"[A-Za-z0-9_*]+", s.replace(ELLIPSIS, " ")))


@dataclass(frozen=True)
class Raise:
    cls: str
    message: str
    where: str


def raises() -> list[Raise]:
    """Every message the package makes an error of its own with: each call of a HomaggError
    subclass (``raise SwitchError(f"...")``, or an error built and raised later) whose last
    positional argument (the message: ``Refusal(code, message)``) is a literal or f-string,
    and each class's ``super().__init__(f"...")``. A message that says nothing of its own
    (fewer than 2 words outside the placeholders: ``f"{where}: {e}"`` or ``f"jobs: {e}"``
    pass another message on) is left out: it is listed where that one is."""
    classes = error_classes()
    out = []
    for f in _package_files():
        rel = f.relative_to(ROOT).as_posix()
        tree = ast.parse(f.read_text())
        calls: list[tuple[str, ast.Call]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name(node.func) in classes:
                calls.append((str(_name(node.func)), node))
            if isinstance(node, ast.ClassDef) and node.name in classes:
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                            and sub.func.attr == "__init__"
                            and isinstance(sub.func.value, ast.Call)
                            and _name(sub.func.value.func) == "super"):
                        calls.append((node.name, sub))
        for cls, call in calls:
            if not call.args:
                continue
            for t in _templates(call.args[-1]):
                t = _normal(t)
                if _literal_words(t) >= 2:
                    out.append(Raise(cls, t, f"{rel}:{call.lineno}"))
    return out


def documented() -> dict[str, list[str]]:
    """The troubleshooting page's patterns per error class: under each ``### ClassName``
    heading, the backticked text of each table row's first cell."""
    prose, _ = split_markdown(TROUBLE.read_text())
    out: dict[str, list[str]] = {}
    cls = None
    for line in prose:
        m = re.match(r"^#{2,3}\s+`?(\w+)`?\s*$", line)
        if m:
            cls = m.group(1)
            out.setdefault(cls, [])
            continue
        if line.startswith("#"):
            cls = None
        if cls and line.startswith("|") and not re.match(r"^\|\s*-", line):
            first = line.split("|")[1]
            out[cls] += [_normal(p) for p in re.findall(r"`([^`]+)`", first)]
    return out


def pattern_regex(pattern: str) -> re.Pattern[str]:
    parts = [re.escape(p) for p in pattern.split(ELLIPSIS)]
    return re.compile(".*?".join(parts), re.S)


def covered(message: str, patterns: list[str]) -> bool:
    return any(pattern_regex(p).fullmatch(message) for p in patterns)


def test_every_error_class_has_a_section():
    classes = error_classes()
    assert len(classes) >= 20, sorted(classes)
    doc = documented()
    missing = sorted(set(classes) - set(doc))
    assert not missing, f"troubleshooting.md has no ### section for {missing}"
    stale = sorted(c for c in doc if re.match(r"^[A-Z]\w*$", c) and c not in classes)
    assert not stale, f"troubleshooting.md documents classes the package lacks: {stale}"


def test_every_error_message_is_listed():
    doc = documented()
    rs = raises()
    assert len(rs) >= 150, f"only {len(rs)} messages found: the extraction broke"
    missing = [f"{r.cls}: {r.message!r} ({r.where})" for r in rs
               if not covered(r.message, doc.get(r.cls, []))]
    assert not missing, ("messages missing from docs/troubleshooting.md (add a row under the "
                         "class's section whose first cell's `pattern` matches, "
                         f"{ELLIPSIS} for any text):\n" + "\n".join(missing))


def test_every_listed_pattern_is_raised():
    """Both ways: a pattern no raise matches is stale, and a pattern must say something."""
    by_class: dict[str, list[str]] = {}
    for r in raises():
        by_class.setdefault(r.cls, []).append(r.message)
    bad = []
    for cls, patterns in documented().items():
        for p in patterns:
            if _literal_words(p) < 2 or _literal_letters(p) < 6:
                bad.append(f"{cls}: {p!r} is too vague (fewer than 2 words of its own)")
            elif not any(pattern_regex(p).fullmatch(m) for m in by_class.get(cls, [])):
                bad.append(f"{cls}: {p!r} matches no message the package raises")
    assert not bad, "\n".join(bad)


def test_message_check_can_fail():
    assert covered("job … is not installed", ["job … is not installed"])
    assert covered("job … is not installed on …", ["job … is not installed…"])
    assert not covered("job … is not installed on …", ["job … is not installed"])
    assert not covered("a brand new failure", ["job … is not installed…"])
    t = _templates(ast.parse('f"job {j}: " + "no " + x', mode="eval").body)
    assert [_normal(s) for s in t] == ["job …: no …"]


# --- 5. figures -------------------------------------------------------------------------------

def test_figures_are_committed_and_drawn_by_the_script():
    script = (DOCS / "figures" / "plots.py").read_text()
    shown = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text):
            path = (page.parent / target).resolve()
            assert path.exists(), f"{page.name} shows {target}, which is not committed"
            assert path.stat().st_size < 100_000, f"{target} is over 100 KB"
            name = path.stem
            assert f'"{name}": {name}' in script, f"plots.py does not draw {name}"
            after = text.split(f"]({target})", 1)[1][:400]
            assert f"plots.py {name}" in after or "plots.py`" in after, \
                f"{page.name}: no command under {target} says how it is drawn"
            shown.append(name)
    table = script.split("\nFIGURES: dict", 1)[1]
    drawn = set(re.findall(r'"(\w+)": \w+[,}]', table))
    assert drawn <= set(shown), f"figures drawn but shown on no page: {drawn - set(shown)}"
    for name in drawn:
        assert (DOCS / "figures" / f"{name}.svg").exists(), f"{name}.svg is not committed"


# --- 6. README --------------------------------------------------------------------------------

def test_readme_is_short_and_its_first_screen_has_what_a_newcomer_needs():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    first = "\n".join(lines[:60])
    for needed in ("./run.sh demo", "./run.sh test", "done on", "import homagg.torch",
                   'dist.init_process_group("homagg")', "homagg-net local"):
        assert needed in first, f"README's first screen lacks {needed!r}"
