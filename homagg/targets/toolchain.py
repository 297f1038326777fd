"""Where the external P4 tools are: PATH, or the environment variables the README documents.

bmv2 and p4c are not in any package registry homagg installs from, so they are looked up, never
installed; whatever needs one and does not find it says exactly what is missing.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from homagg.errors import ToolMissing

#: tool name -> environment variable that may point at it
TOOLS = {
    "p4c-bm2-ss": "HOMAGG_P4C",
    "simple_switch_grpc": "HOMAGG_BMV2",
    "simple_switch_CLI": "HOMAGG_BMV2_CLI",
    "bf-p4c": "HOMAGG_BF_P4C",  # p4c's driver for p4c-barefoot (Tofino): docs/deploy.md
    "p4testgen": "HOMAGG_P4TESTGEN",  # P4Tools' test generator, with its Tofino target
}
#: where the docs say how to get a tool, where not README's "bmv2 and p4c"
WHERE = {"bf-p4c": "docs/deploy.md, 'Tofino': p4c built with -DENABLE_TOFINO=ON",
         "p4testgen": "docs/deploy.md, 'Tofino': p4c built with -DENABLE_TOFINO=ON "
                      "-DENABLE_TEST_TOOLS=ON"}
README_BMV2 = "README, 'bmv2 and p4c'"




@dataclass(frozen=True)
class Tool:
    name: str
    path: Path | None
    how: str  # where it was found, or why not

    @property
    def found(self) -> bool:
        return self.path is not None


def find(name: str) -> Tool:
    var = TOOLS[name]
    value = os.environ.get(var)
    if value:
        p = Path(value)
        if p.is_file() and os.access(p, os.X_OK):
            return Tool(name, p, f"${var}")
        return Tool(name, None, f"${var}={value} is not an executable file")
    hit = shutil.which(name)
    if hit:
        return Tool(name, Path(hit), "PATH")
    return Tool(name, None, f"{name} is not on PATH and ${var} is not set")


def require(name: str) -> Path:
    tool = find(name)
    if tool.path is None:
        raise ToolMissing(f"{tool.how}: install {name} ({WHERE.get(name, README_BMV2)}) or "
                          f"set {TOOLS[name]}=/path/to/{name}")
    return tool.path


def missing(*names: str) -> str | None:
    """None if every tool is found, else one line naming what is missing (for skip reasons)."""
    gone = [t.how for t in (find(n) for n in names) if not t.found]
    return "; ".join(gone) if gone else None


def bmv2_unavailable(*extra_tools: str) -> str | None:
    """None if bmv2, p4c, root and the Python packages the bmv2 tests and benchmarks need are
    all there; else one line saying what is missing (a skip reason)."""
    gone = missing("p4c-bm2-ss", "simple_switch_grpc", *extra_tools)
    if gone:
        return f"bmv2/p4c not found ({gone})"
    if os.geteuid() != 0:
        return "needs root (veth pairs)"
    try:
        import p4runtime_sh  # noqa: F401
        import scapy  # noqa: F401
    except ImportError as e:
        return f"missing Python package: {e.name}"
    return None
