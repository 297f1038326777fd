"""The software aggregator: the switch program's semantics over a UDP socket.

It runs where bmv2 is not installed (the embedded default), for jobs that do not fit in switch
memory, and as a baseline. It follows p4/include/aggregation.p4 rule for rule: the same job
table keyed by (source address, source port), slot copies with shadow state, epochs and round
tags, int32 add with overflow flag, OR, status replies, and the same counters by reason. The
decision logic is ``SoftSwitch.handle`` (pure: bytes in, datagrams out), so tests drive it
without sockets; ``serve`` puts it on a socket.

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homagg import wire
from homagg.errors import JobError
from homagg.faults import FaultSpec, ImpairedSocket
from homagg.regions import allocate_region

log = logging.getLogger("homagg.softswitch")

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_HDR = wire.HEADER


def _newer(seq: int, tag: int) -> bool:
    d = (seq - tag) & 0xFFFFFFFF
    return 0 < d < 0x80000000


@dataclass
class SoftJob:
    id: int
    senders: dict  # (ip, port) -> worker id
    addrs: list  # worker id -> (ip, port)
    epoch: int
    base: int
    size: int


class SoftSwitch:
    def __init__(self, slots: int = wire.SLOTS):
        self.slots = slots
        n = 2 * slots
        self.seen = np.zeros(n, np.uint64)
        self.count = np.zeros(n, np.int64)
        self.tag = np.zeros(n, np.uint32)
        self.op = np.zeros(n, np.uint8)
        self.epoch = np.zeros(n, np.uint32)
        self.overflow = np.zeros(n, bool)
        self.lanes = np.zeros((n, wire.WORDS_PER_PACKET), np.int32)
        self.stats = np.zeros(wire.STATS_SIZE, np.int64)
        self.job_stats = np.zeros(wire.JOB_STATS_SIZE, np.int64)
        self.jobs: dict[int, SoftJob] = {}
        self.senders: dict[tuple[str, int], SoftJob] = {}
        self._epoch = 0
        self.lock = threading.Lock()

    # -- control ---------------------------------------------------------------------------
    def add_job(self, job_id: int, workers: list[tuple[str, int]], slots: int) -> SoftJob:
        """Install a job; its region is allocated first-fit as the controller does."""
        with self.lock:
            if job_id in self.jobs:
                raise JobError(f"job {job_id} is already installed")
            for addr in workers:
                if addr in self.senders:
                    raise JobError(f"{addr[0]}:{addr[1]} already sends for job "
                                   f"{self.senders[addr].id}")
            base = allocate_region(slots, [range(j.base, j.base + j.size)
                                           for j in self.jobs.values()], self.slots)
            self._epoch = self._epoch % 0xFFFF + 1
            job = SoftJob(job_id, {a: w for w, a in enumerate(workers)}, list(workers),
                          self._epoch, base, slots)
            self.jobs[job_id] = job
            for a in workers:
                self.senders[a] = job
            self.job_stats[job_id * wire.JOB_STATS_PER_JOB:
                           (job_id + 1) * wire.JOB_STATS_PER_JOB] = 0
            return job

    def remove_job(self, job_id: int) -> None:
        with self.lock:
            job = self.jobs.pop(job_id)
            for a in job.addrs:
                self.senders.pop(a, None)

    def reset_job(self, job_id: int) -> int:
        with self.lock:
            job = self.jobs[job_id]
            self._epoch = self._epoch % 0xFFFF + 1
            job.epoch = self._epoch
            self.job_stats[job_id * wire.JOB_STATS_PER_JOB:
                           (job_id + 1) * wire.JOB_STATS_PER_JOB] = 0
            return job.epoch

    def read_stats(self) -> dict:
        with self.lock:
            out = {"switch": {name: int(self.stats[i]) for i, name in wire.STATS.items()},
                   "jobs": {}}
            for j in self.jobs:
                base = j * wire.JOB_STATS_PER_JOB
                out["jobs"][j] = {name: {"packets": int(self.job_stats[base + k])}
                                  for k, name in wire.JOB_STATS.items()}
            return out

    # -- the data plane --------------------------------------------------------------------
    def _job_count(self, job: SoftJob, kind: int) -> None:
        self.job_stats[job.id * wire.JOB_STATS_PER_JOB + kind] += 1

    def handle(self, data: bytes, src: tuple[str, int]) -> list[tuple[bytes, tuple[str, int]]]:
        """One datagram in; the datagrams to send out (possibly none)."""
        with self.lock:
            return self._handle(data, src)

    def _drop(self, reason: str, job: SoftJob | None = None):
        self.stats[wire.STAT_INDEX[reason]] += 1
        if job is not None:
            self._job_count(job, 3)
        return []

    def _handle(self, data, src):
        s = self.stats
        s[0] += 1  # STAT_RX
        if len(data) < wire.PACKET_BYTES:
            return self._drop("DROP_MALFORMED")
        if len(data) > wire.PACKET_BYTES:
            return self._drop("DROP_BAD_LENGTH")
        vo, flags, job_id, worker, _res, slot, seq = _HDR.unpack_from(data)
        version, op = vo >> 4, vo & 0xF
        if version != wire.HOMAGG_VERSION:
            return self._drop("DROP_BAD_VERSION")
        if op not in (wire.OP_ADD, wire.OP_OR):
            return self._drop("DROP_BAD_OP")
        if flags & wire.FLAG_RESULT:
            return self._drop("DROP_FORGED_RESULT")
        job = self.senders.get(src)
        if job is None:
            return self._drop("DROP_UNKNOWN_SENDER")
        if job_id != job.id or worker != job.senders[src]:
            return self._drop("DROP_WRONG_IDENTITY", job)
        if slot >= job.size:
            return self._drop("DROP_BAD_SLOT", job)
        phase = 1 if flags & wire.FLAG_PHASE else 0
        idx = 2 * (job.base + slot) + phase
        me = np.uint64(1 << worker)
        seen = self.seen[idx]
        count = int(self.count[idx])
        tag = int(self.tag[idx])
        workers = len(job.addrs)

        first = False
        verdict = "accept"
        if self.epoch[idx] != job.epoch:
            first = True
        elif seen & me:
            if count == workers and tag == seq:
                verdict = "retrans"
            elif tag == seq:
                verdict = "pending"
            else:
                verdict = "stale"
        elif seen == 0:
            if _newer(seq, tag):  # serial arithmetic, as (int<32>)(seq - tag) > 0
                first = True
            else:
                verdict = "stale"
        elif count >= workers:
            verdict = "stale"
        elif _newer(tag, seq):
            verdict = "stale"  # an older round, delayed
        elif tag != seq or self.op[idx] != op:
            verdict = "seq_mismatch"

        words = np.frombuffer(data, ">i4", wire.WORDS_PER_PACKET, wire.HOMAGG_HDR_BYTES)
        if verdict == "accept":
            if first:  # overwrite whatever an older round or job left
                seen, count, ovf = me, 1, False
                new = words.astype(np.int32)
            else:
                seen, count, ovf = seen | me, count + 1, bool(self.overflow[idx])
                old = self.lanes[idx]
                if op == wire.OP_ADD:
                    wide = old.astype(np.int64) + words.astype(np.int64)
                    ovf = ovf or bool(((wide > INT32_MAX) | (wide < INT32_MIN)).any())
                    new = wide.astype(np.int32)  # wraps, as bit<32> does
                else:
                    new = old | words.astype(np.int32)
            self.lanes[idx] = new
            self.seen[idx] = seen
            self.count[idx] = count
            self.tag[idx] = seq
            self.op[idx] = op
            self.epoch[idx] = job.epoch
            self.overflow[idx] = ovf
            self.seen[idx ^ 1] &= ~me
            s[1] += 1
            self._job_count(job, 0)
            if count < workers:
                return []
            s[2] += 1
            self._job_count(job, 1)
            rflags = wire.FLAG_RESULT | (flags & wire.FLAG_PHASE)
            if ovf:
                rflags |= wire.FLAG_OVERFLOW
                s[5] += 1
            out = self._packet(vo, rflags, job_id, 0, slot, seq, new)
            return [(out, a) for a in job.addrs]
        if verdict == "retrans":
            s[3] += 1
            self._job_count(job, 2)
            rflags = wire.FLAG_RESULT | wire.FLAG_RETRANS | (flags & wire.FLAG_PHASE)
            if self.overflow[idx]:
                rflags |= wire.FLAG_OVERFLOW
            return [(self._packet(vo, rflags, job_id, worker, slot, seq, self.lanes[idx]), src)]
        if verdict == "pending":
            s[4] += 1
            self._job_count(job, 2)
            status = np.zeros(wire.WORDS_PER_PACKET, np.int32)
            i = wire.STATUS_WORD
            status[i] = np.uint32(int(seen) >> 32).view(np.int32)
            status[i + 1] = np.uint32(int(seen) & 0xFFFFFFFF).view(np.int32)
            status[i + 2] = count
            rflags = wire.FLAG_RESULT | wire.FLAG_STATUS | (flags & wire.FLAG_PHASE)
            return [(self._packet(vo, rflags, job_id, worker, slot, seq, status), src)]
        if verdict == "seq_mismatch":
            return self._drop("DROP_SEQ_MISMATCH", job)
        return self._drop("DROP_STALE", job)

    @staticmethod
    def _packet(vo, flags, job, worker, slot, seq, words) -> bytes:
        # The switch echoes the completing packet's header (worker and reserved included).
        return _HDR.pack(vo, flags, job, worker, 0, slot, seq) + words.astype(">i4").tobytes()


# --------------------------------------------------------------------------------------------
# On a socket
# --------------------------------------------------------------------------------------------


class SoftSwitchServer:
    """A SoftSwitch on a UDP socket, in a thread (tests) or in the foreground (CLI)."""

    def __init__(self, switch: SoftSwitch | None = None, bind: tuple[str, int] = ("0.0.0.0",
                 wire.HOMAGG_UDP_PORT_MIN), faults: FaultSpec | None = None):
        self.switch = switch or SoftSwitch()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
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
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                break
            for d, a in sw.handle(bytes(buf[:nb]), src):
                try:
                    sock.sendto(d, a)
                except OSError as e:  # a worker gone: the others still get theirs
                    log.debug("send to %s failed: %s", a, e)

    def start(self) -> "SoftSwitchServer":
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
    try:
        while server._thread.is_alive():
            server._thread.join(0.2)
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
