"""Software aggregators as processes of their own (``homagg-softswitch``), on loopback, that a
test or the chaos soak kills (SIGKILL: no goodbye) and starts again at the same addresses,
with homagg's pipeline and base entries installed as ``homagg-ctl install --no-jobs`` would.

Loopback only: every address here is 127.0.0.0/8.
"""

from __future__ import annotations

import ipaddress
import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port of 127.0.0.1 the kernel has free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback(ip: str) -> str:
    """``ip``, once it is known to be a loopback address (nothing here goes elsewhere)."""
    if not ipaddress.IPv4Address(ip).is_loopback:
        raise ValueError(f"{ip}: not a loopback address (127.0.0.0/8)")
    return ip


@dataclass
class SoftProcess:
    """One ``homagg-softswitch`` process: its homagg packets at ``ip`` (the UDP port range),
    P4Runtime at ``grpc`` (127.0.0.1, a port chosen once and kept across restarts)."""

    name: str
    ip: str
    workdir: Path
    grpc: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)
    starts: int = 0

    def __post_init__(self) -> None:
        loopback(self.ip)
        self.grpc = self.grpc or f"127.0.0.1:{free_port()}"
        self.workdir.mkdir(parents=True, exist_ok=True)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 30.0) -> SoftProcess:
        """Start it (again) and install homagg's pipeline and base entries on it."""
        ready = self.workdir / f"{self.name}.ready"
        ready.unlink(missing_ok=True)
        log = open(self.workdir / f"{self.name}.log", "ab")  # noqa: SIM115 - the child's
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "import sys; from homagg.targets.soft.cli import main; "
                 "sys.exit(main())", "--bind", self.ip,
                 "--grpc", self.grpc, "--ready-file", str(ready), "--log-level", "warning"],
                stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
        finally:
            log.close()
        self.starts += 1
        until = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): "
                                   f"{(self.workdir / f'{self.name}.log').read_text()[-2000:]}")
            if time.monotonic() > until:
                self.kill()
                raise RuntimeError(f"{self.name} not ready within {timeout:g} s")
            time.sleep(0.05)
        json.loads(ready.read_text())
        for attempt in range(20):  # (a controller's session may be primary a moment)
            try:
                self.install()
                break
            except Exception:
                if attempt == 19:
                    raise
                time.sleep(0.25)
        return self

    def install(self) -> None:
        from homagg.controller import jobs as J
        from homagg.controller.build import soft_pipeline
        from homagg.controller.p4client import P4RuntimeSwitch
        from homagg.netconfig import Config, SwitchSpec

        cfg = Config(SwitchSpec(name=self.name, grpc=self.grpc, ip=self.ip, target="soft"))
        # (an election id above the service's (0, 2): installing is the operator's word)
        with P4RuntimeSwitch(self.grpc, 1, (0, 3), None, self.name).open(
                soft_pipeline(self.workdir / "pipeline")) as s:
            J.install_base(s, cfg)

    def kill(self) -> None:
        """SIGKILL, and reaped."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    stop = kill
