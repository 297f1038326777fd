"""Prometheus metrics of ``homagg-ctl serve`` (``--metrics-port``), read from the switches.

Every scrape reads the counters of each place (the switch, and the fallback where there is
one) through the service's own sessions, so the numbers are the data plane's, never a copy:

    homagg_job_packets_accepted_total{switch, job, name}   JOB_STAT_ACCEPTED
    homagg_job_rounds_completed_total{switch, job, name}   JOB_STAT_COMPLETED
    homagg_job_retransmissions_total{switch, job, name}    JOB_STAT_RETRANS
    homagg_job_drops_total{switch, job, name}              JOB_STAT_DROPPED (the switch counts
                                                           a job's drops as one total)
    homagg_switch_packets_total{switch, counter}           STAT_* and FWD_*
    homagg_switch_drops_total{switch, reason}              DROP_*, by reason
    homagg_slots{switch, state}                            in use and free, of the pool
    homagg_job_slots{switch, job, name}                    each job's region
    homagg_service_jobs_placed_total, homagg_service_refusals_total{code},
    homagg_service_removals_total{why}, homagg_service_jobs_held,
    homagg_service_removals_owed                           released, not yet off a switch

``job`` is the job id, ``name`` the job's name where the service placed it and
``--metrics-job-names`` asks for it (else empty, as for jobs installed with the CLI or read
back after a restart): the page needs no token, and a name is what a join asks for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server

from homagg import wire
from homagg.controller.service import JobService
from homagg.errors import HomaggError

log = logging.getLogger("homagg.metrics")

_JOB = {"JOB_STAT_ACCEPTED": ("homagg_job_packets_accepted", "packets accepted into a round"),
        "JOB_STAT_COMPLETED": ("homagg_job_rounds_completed", "rounds (slot uses) completed"),
        "JOB_STAT_RETRANS": ("homagg_job_retransmissions", "retransmissions answered"),
        "JOB_STAT_DROPPED": ("homagg_job_drops", "packets of the job dropped")}


class SwitchCollector:
    """A prometheus_client collector: the switches read under the service's lock by one
    scrape at a time, and a scrape that waited for another's reading, begun after it
    arrived, takes that one: 200 scrapes at once cost two readings, and a join waits for one
    at most, never for 200 in turn."""

    def __init__(self, svc: JobService, clock: Callable[[], float] = time.monotonic):
        self.svc = svc
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshot: list[Any] = []
        self._begun = float("-inf")  # when the latest reading began
        self.reads = 0  # readings of the switches so far

    def collect(self) -> Iterator[Any]:
        arrived = self._clock()
        with self._lock:
            if self._begun < arrived:
                self._begun = self._clock()
                self._snapshot = list(self._read())
                self.reads += 1
            snapshot = self._snapshot
        yield from snapshot

    def _read(self) -> Iterator[Any]:
        svc = self.svc
        jobs = {k: CounterMetricFamily(m, h, labels=["switch", "job", "name"])
                for k, (m, h) in _JOB.items()}
        pkts = CounterMetricFamily("homagg_switch_packets", "switch counters (STAT_*, FWD_*)",
                                   labels=["switch", "counter"])
        drops = CounterMetricFamily("homagg_switch_drops", "packets dropped, by reason",
                                    labels=["switch", "reason"])
        slots = GaugeMetricFamily("homagg_slots", "slots of the pool, in use and free",
                                  labels=["switch", "state"])
        job_slots = GaugeMetricFamily("homagg_job_slots", "a job's slot region",
                                      labels=["switch", "job", "name"])
        up = GaugeMetricFamily("homagg_switch_up", "1 if the place answered this scrape",
                               labels=["switch"])
        with svc._cond:  # the service's state, copied: never held across a switch read
            names = {h.job_id: h.name or "" for h in svc.held.values()} \
                if svc.opts.metrics_job_names else {}
            held = len(svc.held)
            placed_total, refusals = svc.joined, dict(svc.refusals)
            removals = dict(svc.removals)
            owed = len(svc._owed)
        with svc._switch:
            for name in svc.dead:  # (taken for dead: not waited on)
                up.add_metric([name], 0)
            try:
                with svc.fabric() as f:
                    stats = f.stats()
                    placed = f.list()
                    for name in f.unreachable:
                        up.add_metric([name], 0)
            except HomaggError as e:
                log.warning("metrics: switch unreadable: %s", e)
                stats, placed = {}, []
                up.add_metric([svc.cfg.switch.name], 0)
        for name, (place, st) in stats.items():
            up.add_metric([name], 1)
            for counter, v in list(st.switch.items()) + list(st.forwarding.items()):
                if counter.startswith("DROP_"):
                    drops.add_metric([name, counter], v)
                else:
                    pkts.add_metric([name, counter], v)
            for job_id, counts in st.jobs.items():
                for k, fam in jobs.items():
                    fam.add_metric([name, str(job_id), names.get(job_id, "")],
                                   counts.packets(k))
            used = 0
            for pj in placed:
                if pj.place.name == name:
                    used += pj.job.size
                    job_slots.add_metric([name, str(pj.job.id), names.get(pj.job.id, "")],
                                         pj.job.size)
            slots.add_metric([name, "used"], used)
            slots.add_metric([name, "free"], place.pool - used)
        yield from jobs.values()
        yield from (pkts, drops, slots, job_slots, up)
        c = CounterMetricFamily("homagg_service_jobs_placed", "jobs placed by joins")
        c.add_metric([], placed_total)
        yield c
        r = CounterMetricFamily("homagg_service_refusals", "requests refused, by gRPC code",
                                labels=["code"])
        for code, n in sorted(refusals.items()):
            r.add_metric([code], n)
        yield r
        rm = CounterMetricFamily("homagg_service_removals", "jobs removed, by why",
                                 labels=["why"])
        for why, n in sorted(removals.items()):
            rm.add_metric([why], n)
        yield rm
        g = GaugeMetricFamily("homagg_service_jobs_held", "jobs whose leases the service holds")
        g.add_metric([], held)
        yield g
        o = GaugeMetricFamily("homagg_service_removals_owed",
                              "jobs released whose removal a switch has not taken yet")
        o.add_metric([], owed)
        yield o


assert set(_JOB) == set(wire.JOB_STATS.values()), "a job counter without a metric"


def serve_metrics(svc: JobService, port: int, addr: str = "127.0.0.1"):
    """An HTTP server for /metrics in a thread; its ``server_port`` is the port (0: any)."""
    registry = CollectorRegistry()
    registry.register(SwitchCollector(svc))
    server, _thread = start_http_server(port, addr, registry)
    return server
