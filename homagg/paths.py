"""Where homagg reads its P4 source and writes build outputs and logs.

Nothing is computed from a checkout's layout alone, so a non-editable ``pip install .`` works:
- the P4 source ships inside the package (``homagg/p4``); ``HOMAGG_P4_DIR`` overrides it;
- outputs (compiled pipeline, logs) go under ``HOMAGG_STATE_DIR``; without it, ``build/`` of the
  checkout when running from one, else ``$XDG_CACHE_HOME/homagg`` (``~/.cache/homagg``).
"""

from __future__ import annotations

import os
from pathlib import Path

_PKG = Path(__file__).resolve().parent


#: homagg's compiled P4Info (p4c's output, shipped in the package; ``homagg-ctl build``
#: refreshes it): the pipeline both targets implement, which the software aggregator's
#: P4Runtime server serves and the controller checks a switch against.
P4INFO_FILE = _PKG / "_p4info.txtpb"


def p4_dir() -> Path:
    """The P4 program's directory (homagg.p4 and include/)."""
    env = os.environ.get("HOMAGG_P4_DIR")
    return Path(env) if env else _PKG / "p4"


def checkout_root() -> Path | None:
    """The source checkout this package runs from, or None when installed."""
    root = _PKG.parent
    return root if (root / "pyproject.toml").is_file() and (root / "p4").is_dir() else None


def state_dir() -> Path:
    env = os.environ.get("HOMAGG_STATE_DIR")
    if env:
        return Path(env)
    root = checkout_root()
    if root is not None:
        return root / "build"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "homagg"


def build_dir() -> Path:
    """The compiled pipeline (bmv2 JSON and P4Info)."""
    return state_dir() / "p4"


def log_dir(*parts: str) -> Path:
    return state_dir().joinpath("logs", *parts)
