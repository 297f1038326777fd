"""What a homagg-net run asks for (``NetOptions``), and whether this machine can run it: the
target (bmv2 where installed, else the software aggregator) and Mininet's needs.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from homagg import paths, wire
from homagg.errors import HomaggError
from homagg.targets.toolchain import missing


class NetError(HomaggError):
    """homagg-net cannot run as asked (the target, Mininet, the options)."""



def choose_target(requested: str) -> tuple[str, str]:
    """(target, why). ``auto``: bmv2 where p4c and simple_switch_grpc are installed."""
    gone = missing("p4c-bm2-ss", "simple_switch_grpc")
    if requested == "bmv2":
        if gone:
            raise NetError(f"--target bmv2, but {gone}")
        return "bmv2", "requested"
    if requested == "soft":
        return "soft", "requested"
    if gone:
        return "soft", f"bmv2 not installed: {gone}"
    return "bmv2", "simple_switch_grpc and p4c-bm2-ss found"


def preflight() -> None:
    if os.geteuid() != 0:
        raise NetError("Mininet needs root: run as root (sudo)")
    try:
        import mininet  # noqa: F401
    except ImportError:
        raise NetError("Mininet is not importable: apt-get install mininet (./run.sh setup "
                       "does it), and use a venv made with --system-site-packages") from None
    for tool in ("ip", "tc", "brctl", "ethtool"):
        if not shutil.which(tool):
            raise NetError(f"{tool} not found: ./run.sh setup installs it")


@dataclass
class NetOptions:
    workers: int = 4
    target: str = "auto"
    bw: float | None = None       # Mbit/s on each worker link
    delay: str | None = None      # e.g. "1ms"
    jitter: str | None = None     # e.g. "1ms" (with delay; reorders packets too)
    loss: float | None = None     # percent, each direction of each worker link
    dup: float | None = None      # percent duplicated
    reorder: float | None = None  # percent sent ahead of the delayed rest (needs delay)
    jobs: int = 1                 # workers are split evenly into this many jobs
    agent_args: tuple = ()        # extra homagg-agent options for every worker (fault injection)
    slots: int | None = None     # None: 16 on bmv2, 64 on the soft target
    switch_slots: int | None = None  # the switch's slot pool for homagg; None: all of it
    fallback: bool = True        # host fb: a software aggregator for jobs that do not fit
    words: int | None = None     # K, words per packet (None: the P4 default); agents learn it
    mtu: int = wire.DEFAULT_MTU  # every link's MTU; 9000 (jumbo frames) for K above 364
    job: int = 1
    log_dir: Path = field(default_factory=lambda: paths.log_dir("net"))
    topo: str = "star"           # star | leafspine (launcher/tree.py)
    leaves: int = 2              # leafspine: leaf switches ...
    workers_per_leaf: int = 4    # ... and the workers under each (workers = their product)
    service: bool = False        # workers join through homagg-ctl serve (HOMAGG_CONTROLLER)
    shards: int = 1              # processes per software aggregator (homagg-softswitch --shards)
