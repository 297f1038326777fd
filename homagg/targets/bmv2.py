"""Start and stop one simple_switch_grpc (bmv2) process, for tests and the Mininet launcher.

Logs go to a directory the caller names (never /tmp/*.log: ``mn -c`` deletes those).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from homagg.errors import HomaggError
from homagg.targets.toolchain import require


class Bmv2Error(HomaggError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Bmv2Switch:
    """``ports``: bmv2 port number -> interface name."""

    ports: dict[int, str]
    log_dir: Path
    name: str = "s1"
    device_id: int = 1
    grpc_port: int = field(default_factory=free_port)
    thrift_port: int = field(default_factory=free_port)
    log_level: str = os.environ.get("HOMAGG_BMV2_LOG", "warn")
    netns: str | None = None  # run inside this network namespace (Mininet host, test netns)
    proc: subprocess.Popen | None = None

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def log_file(self) -> Path:
        return self.log_dir / f"{self.name}-bmv2.log"

    def command(self) -> list[str]:
        exe = str(require("simple_switch_grpc"))
        cmd = [exe, "--device-id", str(self.device_id), "--thrift-port", str(self.thrift_port),
               "--log-file", str(self.log_dir / f"{self.name}-bmv2"), "--log-flush",
               "--log-level", self.log_level, "--no-p4"]
        for num, iface in sorted(self.ports.items()):
            cmd += ["-i", f"{num}@{iface}"]
        cmd += ["--", "--grpc-server-addr", self.grpc_addr]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns] + cmd
        return cmd

    def start(self, timeout: float | None = None) -> Bmv2Switch:
        """Start bmv2 and wait until it serves P4Runtime: as long as the process lives and is
        still starting, up to ``timeout`` seconds (``$HOMAGG_BMV2_START_TIMEOUT``, 120 by
        default: several switches starting at once on a loaded 2-core machine take tens of
        seconds). A start that fails says why, with the last lines of bmv2's output."""
        if timeout is None:
            timeout = float(os.environ.get("HOMAGG_BMV2_START_TIMEOUT", "120"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.out_file, "w")
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise Bmv2Error(f"simple_switch_grpc exited with {self.proc.returncode} before "
                                f"serving P4Runtime at {self.grpc_addr}; its output "
                                f"({self.out_file}) ends: {self.output_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.grpc_port), 0.2):
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        tail = self.output_tail()
        self.stop()
        raise Bmv2Error(f"simple_switch_grpc did not open {self.grpc_addr} in {timeout:g} s, "
                        f"still starting (HOMAGG_BMV2_START_TIMEOUT waits longer); its output "
                        f"({self.out_file}) ends: {tail}")

    @property
    def out_file(self) -> Path:
        return self.log_dir / f"{self.name}-bmv2.out"

    def output_tail(self, lines: int = 5) -> str:
        """The last lines of bmv2's output, on one line (what a failed start says)."""
        try:
            text = self.out_file.read_text(errors="replace").strip().splitlines()
        except OSError as e:
            return f"(unreadable: {e})"
        return " | ".join(text[-lines:]) if text else "(nothing)"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None
