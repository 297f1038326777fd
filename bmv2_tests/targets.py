"""One interface over every aggregation target, so the same packet tests run on all of them.

- ``ModelTarget``: the switch model (``homagg.switch_model``) alone, in memory;
- ``SoftTarget``: the software aggregator's switch, its ``handle`` called in process;
- ``SoftUdpTarget``: the software aggregator's UDP server, hosts being loopback sockets;
- ``Bmv2Target``: simple_switch_grpc through veth pairs (homagg/targets/testbed.py).

Host ``i`` is a worker host; ``addr(i)`` its (ip, udp port). The soft and bmv2 targets install
jobs with the controller's job logic (``homagg.controller.jobs``): over P4Runtime, or in
process. The model has no tables: its target installs the model's own job entry, as the
software aggregator's tables would describe it.
"""

from __future__ import annotations

import collections
import socket
import time
from dataclasses import replace

from homagg import wire
from homagg.controller import jobs
from homagg.controller.local import LocalSwitch, install, job_spec
from homagg.netconfig import Uplink
from homagg.switch_model import JobEntry, ParentLink, SwitchModel
from homagg.targets.soft import SoftSwitch, SoftSwitchServer
from homagg.targets.testbed import homagg_frame, host_ip, is_homagg, result_of

PORT = wire.DEFAULT_AGENT_PORT


class _Inbox:
    """Replies kept by destination, for the in-process targets."""

    def __init__(self):
        self.inbox: dict[tuple[str, int], collections.deque] = collections.defaultdict(
            collections.deque)

    def recv(self, host, timeout=1.0, count=None, port=PORT):
        q = self.inbox[(host_ip(host), port)]
        out = []
        while q and (count is None or len(out) < count):
            out.append(wire.unpack(q.popleft()))
        return out

    def recv_all(self, timeout: float, hosts, expect: int | None = None
                  ) -> dict[int, list[wire.Packet]]:
        """Every reply to ``hosts`` so far (in process, nothing is in flight: no wait)."""
        by_ip = {host_ip(i): i for i in hosts}
        out: dict[int, list[wire.Packet]] = {}
        for (ip, _port), q in self.inbox.items():
            if ip in by_ip:
                out.setdefault(by_ip[ip], []).extend(wire.unpack(d) for d in q)
        self.inbox.clear()
        return out

    def drain(self):
        self.inbox.clear()

    def close(self):
        pass


class ModelTarget(_Inbox):
    name = "model"
    synchronous = True  # a packet is handled when send returns

    def __init__(self, words: int = wire.WORDS_PER_PACKET):
        super().__init__()
        self.model = SwitchModel(words=words)
        self.epoch = 0

    def addr(self, host):
        return (host_ip(host), PORT)

    def add_job(self, job_id, workers, slots=8, udp_port=PORT, uplink: Uplink | None = None,
                key: int = 0):
        self.epoch += 1
        parent = None if uplink is None else ParentLink(uplink.job, uplink.worker,
                                                        (uplink.ip, uplink.udp_port),
                                                        auth=uplink.key)
        job = JobEntry(job_id, [(host_ip(i), udp_port) for i in workers], self.epoch,
                       (job_id % 8) * slots, slots, uplink=parent, auth=key)
        self.model.install(job)
        return job

    def remove_job(self, job_id):
        self.model.uninstall(job_id)

    def reset_job(self, job_id):
        job = self.model.uninstall(job_id)
        self.epoch += 1
        self.model.install(replace(job, epoch=self.epoch))
        return self.epoch

    def send(self, host, payload, sport=PORT, src_ip=None):
        for data, dst in self.model.process(payload, (src_ip or host_ip(host), sport)).replies:
            self.inbox[dst].append(data)

    def stats(self):
        return {"switch": {n: int(self.model.stats[i]) for i, n in wire.STATS.items()}}


class SoftTarget(_Inbox):
    name = "soft"
    synchronous = True

    def __init__(self, words: int = wire.WORDS_PER_PACKET):
        super().__init__()
        self.sw = SoftSwitch(words=words)
        self.conn = LocalSwitch(self.sw)  # the controller's writes, in process

    def addr(self, host):
        return (host_ip(host), PORT)

    def add_job(self, job_id, workers, slots=8, udp_port=PORT, uplink=None, key=0):
        return install(self.sw, job_id, [(host_ip(i), udp_port) for i in workers], slots,
                       uplink=uplink, key=key)

    def remove_job(self, job_id):
        jobs.remove_job(self.conn, job_id)

    def reset_job(self, job_id):
        return jobs.reset_job(self.conn, job_id).epoch

    def send(self, host, payload, sport=PORT, src_ip=None):
        for data, dst in self.sw.handle(payload, (src_ip or host_ip(host), sport)):
            self.inbox[dst].append(data)

    def stats(self):
        return self.sw.read_stats()


def soft_engine(param: str) -> str:
    """The engine of a ``soft-native``/``soft-python`` fixture param; skips the native one,
    with the reason, where the native data path is off (not built, or HOMAGG_PURE_PYTHON)."""
    engine = param.split("-", 1)[1]
    if engine == "native":
        from homagg.targets.soft import native

        if not native.available():
            import pytest

            pytest.skip(f"the native engine is off: {native.why()}")
    return engine


class SoftUdpTarget:
    """The software aggregator's server on 127.0.0.254; host i sends from 127.0.0.(i+1), from
    a port the kernel gives (``addr``). With ``p4runtime``, the controller writes its jobs and
    reads its counters over P4Runtime (``homagg.targets.p4runtime_server``, on a port the
    kernel gives), as it does bmv2's; else in process. ``engine``: the server's
    (``SoftSwitchServer``); ``words``: K."""

    name = "soft-udp"
    synchronous = False
    GRACE = 0.1  # seconds (recv_all)

    def __init__(self, hosts: int = 4, p4runtime: bool = False, engine: str = "auto",
                 words: int = wire.WORDS_PER_PACKET):
        self.sw = SoftSwitch(words=words)
        self.server = SoftSwitchServer(self.sw, ("127.0.0.254", wire.HOMAGG_UDP_PORT_MIN),
                                       engine=engine)
        self.name = f"soft-udp-{self.server.engine}"
        self.p4rt = None
        if p4runtime:
            from homagg.controller.p4client import P4RuntimeSwitch
            from homagg.targets.p4runtime_server import P4RuntimeServer

            self.p4rt = P4RuntimeServer(self.sw, "127.0.0.1:0").start()
            self.conn = P4RuntimeSwitch(self.p4rt.address).open()
        else:
            self.conn = LocalSwitch(self.sw)
        self.server.start()
        self.socks = {}
        for i in range(hosts):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((f"127.0.0.{i + 1}", 0))
            s.setblocking(False)
            self.socks[i] = s

    def addr(self, host):
        return self.socks[host].getsockname()

    def add_job(self, job_id, workers, slots=8, udp_port=None, uplink=None, key=0):
        """``udp_port``: unused, each host sends from its own socket's port."""
        spec = job_spec(job_id, [self.addr(i) for i in workers], slots, uplink=uplink, key=key)
        return jobs.add_job(self.conn, spec, pool=self.sw.slots)

    def remove_job(self, job_id):
        jobs.remove_job(self.conn, job_id)

    def reset_job(self, job_id):
        return jobs.reset_job(self.conn, job_id).epoch

    def send(self, host, payload, sport=None, src_ip=None):
        self.socks[host].sendto(payload, self.server.address)

    def recv(self, host, timeout=1.0, count=None, port=PORT) -> list[wire.Packet]:
        """What reaches ``host`` within ``timeout`` seconds, up to ``count`` packets
        (``port``: unused, each host has one socket)."""
        s, out = self.socks[host], []
        deadline = time.monotonic() + timeout
        while count is None or len(out) < count:
            try:
                out.append(wire.unpack(s.recv(65536)))
                continue
            except BlockingIOError:
                pass
            if time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        return out

    def recv_all(self, timeout: float, hosts, expect: int | None = None
                  ) -> dict[int, list[wire.Packet]]:
        """What reaches ``hosts`` within ``timeout`` seconds; with ``expect``, until that many
        have come and then ``GRACE`` seconds more (where one more, unexpected, would show:
        on loopback the server sends a reply as it counts the request)."""
        out: dict[int, list[wire.Packet]] = {}
        deadline = time.monotonic() + timeout
        got, graced = 0, False
        while time.monotonic() < deadline:
            for h in hosts:
                s = self.socks[h]
                try:
                    while True:
                        out.setdefault(h, []).append(wire.unpack(s.recv(65536)))
                        got += 1
                except BlockingIOError:
                    pass
            if expect is not None and got >= expect and not graced:
                deadline, graced = min(deadline, time.monotonic() + self.GRACE), True
            time.sleep(0.005)
        return out

    def drain(self):
        self.recv_all(0.05, self.socks)

    def stats(self):
        return jobs.read_stats(self.conn).to_json()

    def close(self):
        self.conn.close()
        if self.p4rt is not None:
            self.p4rt.stop()
        self.server.stop()
        for s in self.socks.values():
            s.close()


class Bmv2Target:
    name = "bmv2"
    synchronous = False

    def __init__(self, testbed):
        self.bed = testbed

    def addr(self, host):
        return (host_ip(host), PORT)

    def add_job(self, job_id, workers, slots=8, udp_port=PORT, uplink=None, key=0):
        spec = self.bed.job(job_id, list(workers), slots, udp_port)
        return jobs.add_job(self.bed.conn, replace(spec, uplink=uplink, key=key))

    def remove_job(self, job_id):
        jobs.remove_job(self.bed.conn, job_id)

    def reset_job(self, job_id):
        return jobs.reset_job(self.bed.conn, job_id).epoch

    def send(self, host, payload, sport=PORT, src_ip=None):
        self.bed.ports[host].send(homagg_frame(host, payload, sport=sport, src_ip=src_ip))

    def recv(self, host, timeout=1.0, count=None, port=PORT):
        return [result_of(p) for p in self.bed.ports[host].recv(timeout, is_homagg, count)]

    def recv_all(self, timeout: float, hosts, expect: int | None = None
                  ) -> dict[int, list[wire.Packet]]:
        """(each host's port waited on for ``timeout``: bmv2's replies come when they come)"""
        return {h: self.recv(h, timeout) for h in hosts}

    def drain(self):
        for p in self.bed.ports:
            p.drain()

    def stats(self):
        return jobs.read_stats(self.bed.conn).to_json()

    def close(self):
        pass
