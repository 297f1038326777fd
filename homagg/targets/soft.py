"""The software aggregator: the switch program's semantics over a UDP socket.

It runs where bmv2 is not installed (the embedded default), for jobs that do not fit in switch
memory, and as a baseline. The rules are ``homagg.switch_model`` (the same model the
conformance suite holds bmv2 to); ``SoftSwitch`` adds job administration, and
``SoftSwitchServer`` puts it on a socket.

    homagg-softswitch --config net.toml [--bind 10.0.0.254] [--stats-file stats.json]

SIGHUP resets every job (new epoch, zeroed job counters), as ``homagg-ctl reset`` does on bmv2.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
from pathlib import Path

from homagg import wire
from homagg.errors import JobError
from homagg.faults import FaultSpec, ImpairedSocket
from homagg.regions import allocate_region
from homagg.switch_model import JobEntry, SwitchModel

log = logging.getLogger("homagg.softswitch")


class SoftSwitch:
    """The switch model plus what the controller does on bmv2: jobs get regions (first-fit, as
    on the switch) and epochs; every method is thread-safe (the server and a control API)."""

    def __init__(self, slots: int = wire.SLOTS):
        self.model = SwitchModel(slots)
        self.slots = slots
        self._epoch = 0
        self.lock = threading.Lock()

    @property
    def jobs(self) -> dict[int, JobEntry]:
        return self.model.jobs

    # -- control ---------------------------------------------------------------------------
    def add_job(self, job_id: int, workers: list[tuple[str, int]], slots: int,
                ports: list[int] | None = None) -> JobEntry:
        """Install a job; its region is allocated first-fit as the controller does."""
        with self.lock:
            if job_id in self.model.jobs:
                raise JobError(f"job {job_id} is already installed")
            for addr in workers:
                if addr in self.model.senders:
                    raise JobError(f"{addr[0]}:{addr[1]} already sends for job "
                                   f"{self.model.senders[addr][0].id}")
            base = allocate_region(slots, [range(j.base, j.base + j.size)
                                           for j in self.model.jobs.values()], self.slots)
            job = JobEntry(job_id, list(workers), self._next_epoch(), base, slots, ports)
            self.model.install(job)
            self.model.clear_job_stats(job_id)
            return job

    def _next_epoch(self) -> int:
        self._epoch = self._epoch % 0xFFFF + 1
        return self._epoch

    def remove_job(self, job_id: int) -> JobEntry:
        with self.lock:
            if job_id not in self.model.jobs:
                raise JobError(f"job {job_id} is not installed")
            return self.model.uninstall(job_id)

    def reset_job(self, job_id: int) -> int:
        with self.lock:
            if job_id not in self.model.jobs:
                raise JobError(f"job {job_id} is not installed")
            job = self.model.jobs[job_id]
            job.epoch = self._next_epoch()
            self.model.clear_job_stats(job_id)
            return job.epoch

    def read_stats(self) -> dict:
        with self.lock:
            m = self.model
            out: dict = {"switch": {name: int(m.stats[i]) for i, name in wire.STATS.items()},
                         "jobs": {}}
            for j in m.jobs:
                base = j * wire.JOB_STATS_PER_JOB
                out["jobs"][j] = {name: {"packets": int(m.job_stats[base + k])}
                                  for k, name in wire.JOB_STATS.items()}
            return out

    # -- the data plane --------------------------------------------------------------------
    def handle(self, data: bytes, src: tuple[str, int],
               port: int | None = None) -> list[tuple[bytes, tuple[str, int]]]:
        """One datagram in; the datagrams to send out (possibly none)."""
        with self.lock:
            return self.model.process(data, src, port).replies


# --------------------------------------------------------------------------------------------
# On a socket
# --------------------------------------------------------------------------------------------


class SoftSwitchServer:
    """A SoftSwitch on a UDP socket, in a thread (tests) or in the foreground (CLI)."""

    def __init__(self, switch: SoftSwitch | None = None, bind: tuple[str, int] = ("0.0.0.0",
                 wire.HOMAGG_UDP_PORT_MIN), faults: FaultSpec | None = None):
        self.switch = switch or SoftSwitch()
        self.sock: socket.socket | ImpairedSocket = socket.socket(socket.AF_INET,
                                                                   socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.sock.bind(bind)
        self.sock.settimeout(0.2)
        self.address = self.sock.getsockname()
        if faults is not None and faults.active:  # tests: loss, dup, reorder at this socket
            self.sock = ImpairedSocket(self.sock, faults)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def serve(self) -> None:
        sock, sw = self.sock, self.switch
        buf = bytearray(4096)
        while not self._stop.is_set():
            try:
                nb, src = sock.recvfrom_into(buf)
            except (TimeoutError, BlockingIOError):
                continue
            except OSError:
                break
            for d, a in sw.handle(bytes(buf[:nb]), src):
                try:
                    sock.sendto(d, a)
                except OSError as e:  # a worker gone: the others still get theirs
                    log.debug("send to %s failed: %s", a, e)

    def start(self) -> SoftSwitchServer:
        self._thread = threading.Thread(target=self.serve, name="softswitch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(2)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv=None) -> int:
    from homagg.netconfig import ConfigError, load

    ap = argparse.ArgumentParser(prog="homagg-softswitch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", "-c", type=Path, required=True, help="TOML: switch and jobs")
    ap.add_argument("--bind", help="address to listen on (default: the config's switch ip)")
    ap.add_argument("--port", type=int, default=wire.HOMAGG_UDP_PORT_MIN)
    ap.add_argument("--stats-file", type=Path, help="write counters as JSON here every 0.2 s")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load(a.config)
        sw = SoftSwitch()
        for j in cfg.jobs:
            job = sw.add_job(j.id, [(w.ip, w.udp_port) for w in j.workers], j.slots)
            log.info("job %d: %d workers, slots %d-%d", j.id, len(j.workers), job.base,
                     job.base + job.size - 1)
        server = SoftSwitchServer(sw, (a.bind or cfg.switch.ip, a.port))
    except (ConfigError, OSError, RuntimeError) as e:
        print(f"homagg-softswitch: error: {e}", file=sys.stderr)
        return 1

    def reset_all(*_):
        for job_id in list(sw.jobs):
            log.info("job %d reset: epoch %d", job_id, sw.reset_job(job_id))

    signal.signal(signal.SIGTERM, lambda *_: server._stop.set())
    signal.signal(signal.SIGHUP, reset_all)  # the operator's "reset": every job starts afresh
    log.info("software aggregator listening on %s:%d", *server.address)
    server.start()
    thread = server._thread
    assert thread is not None
    try:
        while thread.is_alive():
            thread.join(0.2)
            if a.stats_file:
                a.stats_file.write_text(json.dumps(sw.read_stats(), indent=1))
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if a.stats_file:
            a.stats_file.write_text(json.dumps(sw.read_stats(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
