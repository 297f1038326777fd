"""homagg-net local: a software aggregator and the controller service on loopback, no root.

    homagg-net local [--words K] [--slots S] -- torchrun --nproc-per-node 4 train.py

starts a software aggregator (``homagg.targets.soft``, its P4Runtime on a kernel-given port),
installs homagg's pipeline on it, starts ``homagg-ctl serve``'s service in front of it with a
fresh token, and runs the command with HOMAGG_CONTROLLER and HOMAGG_TOKEN in its environment
(and HOMAGG_CTL_CONFIG: a homagg-ctl config naming the aggregator, for ``job list`` or
``stats``). When the command exits, both stop; the exit status is the command's.

The aggregator takes homagg's whole UDP port range (0xBEE0-0xBEEF, where agents accept results
from) on a loopback address of its own, picked at random in 127.0.0.0/8 and kept once bound,
so several of these (and tests on 127.0.0.x) run side by side.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homagg import wire
from homagg.errors import HomaggError
from homagg.netconfig import Config, SwitchSpec, render

log = logging.getLogger("homagg.local")


class LocalError(HomaggError):
    pass


def bind_aggregator(switch, tries: int = 50) -> Any:
    """A SoftSwitchServer on homagg's port range at a free loopback address (random, not
    127.0.0.x), bound and kept."""
    from homagg.targets.soft import SoftSwitchServer

    rng = random.SystemRandom()
    last: OSError | None = None
    for _ in range(tries):
        ip = f"127.{rng.randrange(16, 250)}.{rng.randrange(0, 256)}.{rng.randrange(1, 255)}"
        try:
            return SoftSwitchServer(switch, (ip, wire.HOMAGG_UDP_PORT_MIN))
        except OSError as e:  # that address's ports are taken: another one
            last = e
    raise LocalError(f"no loopback address with homagg's ports free ({last})")


@dataclass
class LocalAggregator:
    """A software aggregator with its P4Runtime server, homagg's pipeline installed, and the
    homagg-ctl config that names it (``config``; ``path``: the same as TOML)."""

    words: int = wire.WORDS_PER_PACKET
    slots: int | None = None
    workdir: Path | None = None
    config: Config = field(init=False)
    path: Path = field(init=False)
    udp: Any = field(init=False, default=None)
    p4rt: Any = field(init=False, default=None)
    _tmp: Any = field(init=False, default=None)

    def start(self) -> LocalAggregator:
        from homagg.controller import jobs as J
        from homagg.controller.build import soft_pipeline
        from homagg.controller.p4client import P4RuntimeSwitch
        from homagg.targets.p4runtime_server import P4RuntimeServer
        from homagg.targets.soft import SoftSwitch

        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="homagg-local-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        sw = SoftSwitch(words=self.words)
        try:
            self.udp = bind_aggregator(sw).start()
            self.p4rt = P4RuntimeServer(sw, "127.0.0.1:0").start()
            ip = self.udp.address[0]
            self.config = Config(SwitchSpec(name="local", grpc=self.p4rt.address, ip=ip,
                                            target="soft", slots=self.slots))
            self.path = self.workdir / "net.toml"
            self.path.write_text(render(self.config))
            with P4RuntimeSwitch(self.p4rt.address, 1, (0, 1), None, "local").open(
                    soft_pipeline(self.workdir / "pipeline")) as s:
                J.install_base(s, self.config)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in (self.p4rt, self.udp):
            if s is not None:
                s.stop()
        self.p4rt = self.udp = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def run_local(command: list[str], words: int = wire.WORDS_PER_PACKET, slots: int | None = None,
              job_slots: int = 64, lease: float = 15.0, metrics_port: int | None = None) -> int:
    """Aggregator + service on loopback, ``command`` with their addresses; its exit status."""
    from homagg.controller.p4client import P4RuntimeSwitch
    from homagg.controller.serve import start
    from homagg.controller.service import JobService, ServeOptions

    token = secrets.token_hex(16)
    agg = LocalAggregator(words, slots).start()
    srv = None
    try:
        def connect(place):
            return P4RuntimeSwitch(place.grpc, place.device_id, (0, 2), None, place.name,
                                   place.tls).open()

        svc = JobService(agg.config, connect, ServeOptions(token=token, lease=lease,
                                                           slots=job_slots))
        srv = start(svc, "127.0.0.1:0", metrics_port=metrics_port, metrics_addr="127.0.0.1")
        # the join secret, for what does not share one through torch's store (a plain agent)
        env = dict(os.environ, HOMAGG_CONTROLLER=srv.address, HOMAGG_TOKEN=token,
                   HOMAGG_CTL_CONFIG=str(agg.path), HOMAGG_JOIN_SECRET=secrets.token_hex(16))
        print(f"homagg-net local: software aggregator at {agg.config.switch.ip} "
              f"(P4Runtime {agg.config.switch.grpc}), controller at {srv.address}"
              + (f", metrics at http://127.0.0.1:{srv.metrics_port}/metrics"
                 if srv.metrics_port is not None else ""), flush=True)
        try:
            proc = subprocess.Popen(command, env=env)
        except OSError as e:
            raise LocalError(f"cannot run {command[0]}: {e.strerror}") from None
        try:
            return proc.wait()
        except KeyboardInterrupt:  # Ctrl-C reaches the command too (same process group)
            proc.send_signal(signal.SIGINT)
            return proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    finally:
        if srv is not None:
            srv.stop()
        agg.stop()
