"""One interface over the two aggregation targets, so the same packet tests run on both.

``Bmv2Target`` drives simple_switch_grpc through veth pairs (homagg/targets/testbed.py);
``SoftTarget`` calls the software aggregator's ``handle`` directly. Both install jobs with the
controller's job logic (``homagg.controller.jobs``): over P4Runtime, or in process.
"""

from __future__ import annotations

import collections
from dataclasses import replace

from homagg import wire
from homagg.controller import jobs
from homagg.controller.local import LocalSwitch, install
from homagg.targets.soft import SoftSwitch
from homagg.targets.testbed import homagg_frame, host_ip, is_homagg, result_of


class SoftTarget:
    name = "soft"

    def __init__(self, words: int = wire.WORDS_PER_PACKET):
        self.sw = SoftSwitch(words=words)
        self.conn = LocalSwitch(self.sw)  # the controller's writes, in process
        self.inbox = collections.defaultdict(collections.deque)

    def add_job(self, job_id, workers, slots=8, udp_port=wire.DEFAULT_AGENT_PORT, uplink=None):
        return install(self.sw, job_id, [(host_ip(i), udp_port) for i in workers], slots,
                       uplink=uplink)

    def remove_job(self, job_id):
        jobs.remove_job(self.conn, job_id)

    def reset_job(self, job_id):
        return jobs.reset_job(self.conn, job_id).epoch

    def send(self, host, payload, sport=wire.DEFAULT_AGENT_PORT, src_ip=None):
        for data, (ip, port) in self.sw.handle(payload, (src_ip or host_ip(host), sport)):
            self.inbox[(ip, port)].append(data)

    def recv(self, host, timeout=1.0, count=None, port=wire.DEFAULT_AGENT_PORT):
        q = self.inbox[(host_ip(host), port)]
        out = []
        while q and (count is None or len(out) < count):
            out.append(wire.unpack(q.popleft()))
        return out

    def drain(self):
        self.inbox.clear()

    def stats(self):
        return self.sw.read_stats()


class Bmv2Target:
    name = "bmv2"

    def __init__(self, testbed):
        self.bed = testbed

    def add_job(self, job_id, workers, slots=8, udp_port=wire.DEFAULT_AGENT_PORT, uplink=None):
        spec = self.bed.job(job_id, list(workers), slots, udp_port)
        return jobs.add_job(self.bed.conn, replace(spec, uplink=uplink))

    def remove_job(self, job_id):
        jobs.remove_job(self.bed.conn, job_id)

    def reset_job(self, job_id):
        return jobs.reset_job(self.bed.conn, job_id).epoch

    def send(self, host, payload, sport=wire.DEFAULT_AGENT_PORT, src_ip=None):
        self.bed.ports[host].send(homagg_frame(host, payload, sport=sport, src_ip=src_ip))

    def recv(self, host, timeout=1.0, count=None, port=wire.DEFAULT_AGENT_PORT):
        return [result_of(p) for p in self.bed.ports[host].recv(timeout, is_homagg, count)]

    def drain(self):
        for p in self.bed.ports:
            p.drain()

    def stats(self):
        return jobs.read_stats(self.bed.conn).to_json()
