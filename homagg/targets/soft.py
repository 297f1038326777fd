"""The software aggregator: the switch program's semantics over UDP sockets.

It runs where bmv2 is not installed (the embedded default), for jobs that do not fit in switch
memory, and as a baseline. The rules are ``homagg.switch_model`` (the same model the
conformance suite holds bmv2 to). ``SoftSwitch`` is the switch: that model plus the control
plane's state in P4Info terms (the five tables, the multicast groups, the counters), as
homagg-ctl writes and reads them on bmv2. ``SoftSwitchServer`` puts it on UDP sockets and
``homagg.targets.p4runtime_server`` on P4Runtime, so homagg-ctl drives it as it drives bmv2.

    homagg-softswitch [--config net.toml] [--bind 10.0.0.254] [--grpc 127.0.0.1:9559]
                      [--words K] [--stats-file stats.json] [--port P] [--single-port]

It serves homagg's whole UDP port range (0xBEE0-0xBEEF), as bmv2's parser does, and answers
from the port each request came to; a tree's child job sends its partial sums up from its
uplink's src_port (``SoftSwitchServer``).

Jobs come from the controller (``homagg-ctl -c net.toml install`` / ``job add``), or from the
config's [[jobs]] at start (written to the tables as homagg-ctl would). SIGHUP resets every job
(new epoch, zeroed job counters), as ``homagg-ctl reset`` does.

How the tables drive the model (the P4 program's meaning, see p4/include/control/):
- a job is in the model when its ``job_workers`` entries (``set_worker``) describe it whole:
  worker ids 0 .. workers-1, one entry each, all with the same ``workers``. Until then (between
  the controller's one-entry writes) its senders are unknown; bmv2 applies each entry on its
  own, but the controller never leaves a job half-written;
- the job's epoch, region and group are its most recently written entry's: a reset's first
  MODIFY moves the whole job to the new epoch;
- a completed round goes where bmv2's egress sends it: one datagram per replica of the job's
  multicast group that has a ``result_dst`` entry (to its ip and port); other replicas drop;
- ``local_ip``, ``arp_proxy`` and ``ipv4_route`` are kept and read back: there is no forwarding
  plane here (``fwd_stats`` stays 0). A ``set_worker``'s switch port is kept, unchecked: a UDP
  socket cannot tell ports, so nothing is DROP_SPOOFED;
- counters count packets; their byte counts are what was last written (bmv2 also counts
  ``job_stats`` bytes);
- a job's epoch comes from the STATS counter's EPOCH_STORE cell, the controller's way;
  loading the pipeline again (P4Runtime) empties tables, groups, counters and slot memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from homagg import _p4consts as P4
from homagg import udpio, wire
from homagg.errors import HomaggError, JobError, TableError
from homagg.faults import FaultSpec, ImpairedSocket
from homagg.netconfig import Uplink as UplinkSpec
from homagg.netconfig import uplink_clash
from homagg.regions import allocate_region, mcast_group
from homagg.switch_model import Address, JobEntry, SwitchModel, Uplink

log = logging.getLogger("homagg.softswitch")

# google.rpc codes of a refused control-plane write: what bmv2 answers through P4Runtime
INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, RESOURCE_EXHAUSTED, OUT_OF_RANGE = 3, 5, 6, 8, 11

Match = tuple  # a table key: its fields' values in P4Info order (lpm: (value, prefix length))


@dataclass
class Entry:
    """A table entry's action; ``seq`` is its write order (a job's parameters are its
    latest-written entry's)."""

    action: str
    params: dict[str, int]
    seq: int = 0


def ip_int(ip: str) -> int:
    try:
        return int(ipaddress.IPv4Address(ip))
    except ValueError:
        raise JobError(f"{ip!r} is not an IPv4 address") from None


def int_ip(value: int) -> str:
    return str(ipaddress.IPv4Address(value))


class SoftSwitch:
    """The switch model plus its control-plane state; every method is thread-safe (the UDP
    server, the P4Runtime server and signal handlers share one switch).

    ``add_job``/``remove_job``/``reset_job`` do what homagg-ctl does on bmv2 (first-fit regions,
    epochs from the EPOCH_STORE cell), through the same tables a P4Runtime client sees."""

    def __init__(self, slots: int = wire.SLOTS, words: int = wire.WORDS_PER_PACKET):
        self.slots = slots
        self.words = words  # K (SwitchModel checks it): agents learn it from the join's reply
        self.lock = threading.Lock()
        self._fresh()

    def _fresh(self) -> None:
        """The pipeline just loaded: empty tables and groups, zero counters and slot memory."""
        self.model = SwitchModel(self.slots, self.words)
        self.tables: dict[str, dict[Match, Entry]] = {t.name: {} for t in P4.SCHEMA.tables}
        self.groups: dict[int, list[tuple[int, int]]] = {}
        self.fwd_stats = np.zeros(wire.FWD_STATS_SIZE, np.int64)
        self.counter_bytes = {c.name: np.zeros(c.size, np.int64) for c in P4.SCHEMA.counters}
        self._seq = 0
        #: the uplink table's source ports, for the server: parent address -> {parent job:
        #: src_port} of the active child jobs (replaced whole on every change, so the server
        #: reads it without the lock)
        self.uplink_ports: dict[Address, dict[int, int]] = {}

    @property
    def jobs(self) -> dict[int, JobEntry]:
        return self.model.jobs

    def reset_pipeline(self) -> None:
        with self.lock:
            self._fresh()

    # -- tables, in P4Info names (what P4Runtime writes and reads) ------------------------------
    @staticmethod
    def _key(table: str, match: Mapping[str, Any]) -> Match:
        if not P4.SCHEMA.has_table(table):
            raise TableError(INVALID_ARGUMENT, f"no table {table!r} in homagg's P4Info")
        names = P4.SCHEMA.table(table).field_names
        if set(match) != set(names):
            raise TableError(INVALID_ARGUMENT, f"table {table}: match fields {sorted(match)}, "
                                               f"it has {list(names)}")
        return tuple(match[k] for k in names)

    @staticmethod
    def _show(table: str, key: Match) -> str:
        parts = []
        for k, v in zip(P4.SCHEMA.table(table).match_fields, key):
            name = k.name
            if k.bitwidth == 32:  # an IPv4 address
                v = (f"{int_ip(v[0])}/{v[1]}" if isinstance(v, tuple) else int_ip(v))
            parts.append(f"{name}={v}")
        return ", ".join(parts)

    def write_entry(self, kind: str, table: str, match: Mapping[str, Any],
                    action: str | None = None, params: Mapping[str, int] | None = None) -> None:
        """``kind``: INSERT, MODIFY or DELETE. Raises TableError with bmv2's code."""
        with self.lock:
            self._write_entry(kind, table, match, action, params)
            self._sync_jobs()

    def _write_entry(self, kind: str, table: str, match: Mapping[str, Any],
                     action: str | None, params: Mapping[str, int] | None) -> None:
        key = self._key(table, match)
        rows = self.tables[table]
        where = f"{table} ({self._show(table, key)})"
        if kind == "DELETE":
            if key not in rows:
                raise TableError(NOT_FOUND, f"no entry to delete in {where}")
            del rows[key]
            return
        if kind not in ("INSERT", "MODIFY"):
            raise TableError(INVALID_ARGUMENT, f"unknown update type {kind!r}")
        if action is None:
            raise TableError(INVALID_ARGUMENT, f"{kind} {where}: no action")
        t = P4.SCHEMA.table(table)
        a = P4.SCHEMA.action(action) if P4.SCHEMA.has_action(action) else None
        if a is None or a.id not in t.action_ids:
            raise TableError(INVALID_ARGUMENT, f"action {action!r} is not one of table {table}'s")
        params = dict(params or {})
        if set(params) != {p.name for p in a.params}:
            raise TableError(INVALID_ARGUMENT, f"action {action}: parameters {sorted(params)}, "
                                               f"it has {[p.name for p in a.params]}")
        if kind == "INSERT":
            if key in rows:
                raise TableError(ALREADY_EXISTS, f"entry exists in {where}; MODIFY changes it")
            if len(rows) >= t.size:
                raise TableError(RESOURCE_EXHAUSTED, f"table {table} is full "
                                                     f"({t.size} entries)")
        elif key not in rows:
            raise TableError(NOT_FOUND, f"no entry to modify in {where}")
        self._seq += 1
        rows[key] = Entry(action, params, self._seq)

    def read_entries(self, table: str) -> list[tuple[dict[str, Any], str, dict[str, int]]]:
        """Every entry of a table: (match by field name, action, parameters)."""
        if not P4.SCHEMA.has_table(table):
            raise TableError(INVALID_ARGUMENT, f"no table {table!r} in homagg's P4Info")
        names = P4.SCHEMA.table(table).field_names
        with self.lock:
            return [(dict(zip(names, key)), e.action, dict(e.params))
                    for key, e in sorted(self.tables[table].items())]

    # -- multicast groups -----------------------------------------------------------------------
    def write_group(self, kind: str, group: int, replicas: Iterable[tuple[int, int]] = ()) -> None:
        """(egress port, replication id) replicas of a multicast group; bmv2's codes."""
        with self.lock:
            self._write_group(kind, group, list(replicas))
            self._sync_jobs()

    def _write_group(self, kind: str, group: int, replicas: list[tuple[int, int]]) -> None:
        if group == 0:
            raise TableError(INVALID_ARGUMENT, "multicast group 0 means no multicast")
        if kind == "DELETE":
            if group not in self.groups:
                raise TableError(NOT_FOUND, f"no multicast group {group} to delete")
            del self.groups[group]
            return
        if len(set(replicas)) != len(replicas):
            raise TableError(INVALID_ARGUMENT, f"multicast group {group}: a replica twice")
        if kind == "INSERT" and group in self.groups:
            raise TableError(ALREADY_EXISTS, f"multicast group {group} exists; MODIFY changes it")
        if kind == "MODIFY" and group not in self.groups:
            raise TableError(NOT_FOUND, f"no multicast group {group} to modify")
        if kind not in ("INSERT", "MODIFY"):
            raise TableError(INVALID_ARGUMENT, f"unknown update type {kind!r}")
        self.groups[group] = replicas

    def read_groups(self) -> dict[int, list[tuple[int, int]]]:
        with self.lock:
            return {g: list(r) for g, r in sorted(self.groups.items())}

    # -- counters -------------------------------------------------------------------------------
    def _packets(self, name: str) -> np.ndarray:
        arrays = {P4.COUNTER_STATS: self.model.stats, P4.COUNTER_JOB_STATS: self.model.job_stats,
                  P4.COUNTER_FWD_STATS: self.fwd_stats}
        if name not in arrays:
            raise TableError(INVALID_ARGUMENT, f"no counter {name!r} in homagg's P4Info")
        return arrays[name]

    def read_counter(self, name: str) -> list[tuple[int, int]]:
        """(packets, bytes) of every cell, by index (the STATS counter's EPOCH_STORE included)."""
        with self.lock:
            packets, nbytes = self._packets(name), self.counter_bytes[name]
            return [(int(p), int(b)) for p, b in zip(packets, nbytes)]

    def write_counter(self, name: str, index: int | None, packets: int, nbytes: int) -> None:
        """Set one cell (``index``), or every cell (None)."""
        with self.lock:
            cells, cbytes = self._packets(name), self.counter_bytes[name]
            if index is not None and not 0 <= index < len(cells):
                raise TableError(OUT_OF_RANGE, f"counter {name} has no index {index} "
                                               f"(size {len(cells)})")
            if max(packets, nbytes) >= 2**63:
                raise TableError(OUT_OF_RANGE, f"counter {name}: value beyond 2**63 - 1")
            where = slice(None) if index is None else index
            cells[where], cbytes[where] = packets, nbytes

    # -- the job table drives the model -----------------------------------------------------------
    def _job_rows(self) -> dict[int, list[tuple[Match, Entry]]]:
        by_job: dict[int, list[tuple[Match, Entry]]] = {}
        for key, e in self.tables[P4.TABLE_JOB_WORKERS].items():
            if e.action == P4.ACTION_SET_WORKER:
                by_job.setdefault(e.params["job"], []).append((key, e))
        return by_job

    def _describe(self, job_id: int, rows: list[tuple[Match, Entry]]) -> JobEntry:
        """The job its entries describe (whole or not)."""
        latest = max(rows, key=lambda r: r[1].seq)[1].params
        rows = sorted(rows, key=lambda r: r[1].params["worker"])
        results = []
        dst = self.tables[P4.TABLE_RESULT_DST]
        for _port, rid in self.groups.get(latest["mcast_group"], []):
            e = dst.get((job_id, rid))
            if e is not None and e.action == P4.ACTION_SET_RESULT_DST:
                results.append((int_ip(e.params["ip"]), e.params["port"]))
        up = self.tables[P4.TABLE_UPLINK].get((job_id,))
        uplink = (Uplink(up.params["job"], up.params["worker"],
                         (int_ip(up.params["ip"]), up.params["udp_port"]), up.params["port"])
                  if up is not None and up.action == P4.ACTION_SET_UPLINK else None)
        return JobEntry(job_id, [(int_ip(k[0]), k[1]) for k, _ in rows], latest["epoch"],
                        latest["region_base"], latest["region_size"],
                        [e.params["port"] for _, e in rows], results, uplink)

    def _job_from(self, job_id: int, rows: list[tuple[Match, Entry]]) -> JobEntry | None:
        counts = {e.params["workers"] for _, e in rows}
        ids = sorted(e.params["worker"] for _, e in rows)
        if len(counts) != 1 or ids != list(range(counts.pop())):
            log.debug("job %d incomplete in the job table (workers %s); not active", job_id, ids)
            return None
        if job_id >= wire.MAX_JOBS or len(ids) > wire.MAX_WORKERS:
            log.warning("job %d with %d workers is beyond this switch (%d jobs, %d workers); "
                        "not active", job_id, len(ids), wire.MAX_JOBS, wire.MAX_WORKERS)
            return None
        job = self._describe(job_id, rows)
        if job.base + job.size > self.slots:
            log.warning("job %d: region %d+%d runs past the %d slots; cut to fit", job_id,
                        job.base, job.size, self.slots)
            job.size = max(0, self.slots - job.base)
        return job

    def _sync_jobs(self) -> None:
        """Make the model's jobs what the tables say (module docstring)."""
        active = [j for job_id, rows in self._job_rows().items()
                  if (j := self._job_from(job_id, rows)) is not None]
        m = self.model
        for old in list(m.jobs):
            m.uninstall(old)
        for job in active:
            m.install(job)
        # admission's parents table, as bmv2 has it: which answers reach which job (uplink.p4)
        m.children_of = {((int_ip(k[0]), k[1]), k[2]): m.jobs[e.params["job"]]
                         for k, e in self.tables[P4.TABLE_PARENTS].items()
                         if e.action == P4.ACTION_SET_PARENT and e.params["job"] in m.jobs}
        # uplink.p4's src_port: the model sends to the parent, the server picks the port
        ports: dict[Address, dict[int, int]] = {}
        for (job_id,), e in self.tables[P4.TABLE_UPLINK].items():
            if e.action == P4.ACTION_SET_UPLINK and job_id in m.jobs:
                p = e.params
                ports.setdefault((int_ip(p["ip"]), p["udp_port"]), {})[p["job"]] = p["src_port"]
        self.uplink_ports = ports

    def _write_uplink(self, job_id: int, u: UplinkSpec, workers: int, epoch: int, base: int,
                      slots: int, group: int) -> None:
        """controller.jobs' parents and uplink entries (SoftSwitchServer sends the partials
        from src_port's socket)."""
        pkey = {"src_addr": ip_int(u.ip), "src_port": u.udp_port, "parent_job": u.job}
        exists = self._key(P4.TABLE_PARENTS, pkey) in self.tables[P4.TABLE_PARENTS]
        self._write_entry("MODIFY" if exists else "INSERT", P4.TABLE_PARENTS, pkey,
                          P4.ACTION_SET_PARENT,
                          {"job": job_id, "workers": workers, "epoch": epoch,
                           "region_base": base, "region_size": slots, "mcast_group": group,
                           "port": u.switch_port})
        ukey = {"job": job_id}
        exists = self._key(P4.TABLE_UPLINK, ukey) in self.tables[P4.TABLE_UPLINK]
        self._write_entry("MODIFY" if exists else "INSERT", P4.TABLE_UPLINK, ukey,
                          P4.ACTION_SET_UPLINK,
                          {"job": u.job, "worker": u.worker, "mac": 0, "ip": ip_int(u.ip),
                           "udp_port": u.udp_port, "src_port": u.src_port,
                           "port": u.switch_port})

    def _uplinks(self, jobs: Iterable[int]) -> dict[int, UplinkSpec]:
        """The uplink table's entries of ``jobs``, as the config says them."""
        out = {}
        for job_id in jobs:
            e = self.tables[P4.TABLE_UPLINK].get((job_id,))
            if e is not None and e.action == P4.ACTION_SET_UPLINK:
                p = e.params
                out[job_id] = UplinkSpec(p["job"], p["worker"], int_ip(p["ip"]), p["udp_port"],
                                         src_port=p["src_port"], switch_port=p["port"])
        return out

    def _next_epoch(self) -> int:
        """As the controller does it: the STATS counter's EPOCH_STORE cell, 1..65535."""
        stats = self.model.stats
        epoch = int(stats[wire.EPOCH_STORE]) % 0xFFFF + 1
        stats[wire.EPOCH_STORE] = epoch
        return epoch

    # -- what the controller does, for jobs from a config file, SIGHUP and tests ---------------
    def add_job(self, job_id: int, workers: list[Address], slots: int,
                ports: list[int] | None = None, uplink: UplinkSpec | None = None) -> JobEntry:
        """Install a job: region first-fit, a new epoch, result addressing, its multicast group
        and job table entries, zeroed job counters (controller.jobs.add_job's writes). With
        ``uplink``, a tree's child job: its parent's answers and where its partials go."""
        if not 0 <= job_id < wire.MAX_JOBS:
            raise JobError(f"job id {job_id} is outside 0-{wire.MAX_JOBS - 1}")
        if not 1 <= len(workers) <= wire.MAX_WORKERS:
            raise JobError(f"job {job_id}: {len(workers)} workers; 1 to {wire.MAX_WORKERS} allowed")
        keys = [(ip_int(ip), port) for ip, port in workers]
        ports = list(ports) if ports is not None else [0] * len(workers)
        with self.lock:
            installed = {j: self._describe(j, rows) for j, rows in self._job_rows().items()}
            if job_id in installed:
                raise JobError(f"job {job_id} is already installed")
            senders = self.tables[P4.TABLE_JOB_WORKERS]
            for (ip, port), key in zip(workers, keys):
                if key in senders:
                    raise JobError(f"{ip}:{port} already sends for job "
                                   f"{senders[key].params.get('job', '(none)')}")
            if uplink is not None:
                for other, up in self._uplinks(installed).items():
                    why = uplink_clash(other, up, job_id, uplink)
                    if why:
                        raise JobError(why)
            base = allocate_region(slots, [range(j.base, j.base + j.size)
                                           for j in installed.values()], self.slots)
            epoch, group = self._next_epoch(), mcast_group(job_id)
            for w, (ip, port) in enumerate(workers):
                rkey = {"job": job_id, "rid": w + wire.RID_WORKER_OFFSET}
                dst = {"mac": 0, "ip": ip_int(ip), "port": port}
                exists = self._key(P4.TABLE_RESULT_DST, rkey) in self.tables[P4.TABLE_RESULT_DST]
                self._write_entry("MODIFY" if exists else "INSERT", P4.TABLE_RESULT_DST, rkey,
                                  P4.ACTION_SET_RESULT_DST, dst)
            self._write_group("MODIFY" if group in self.groups else "INSERT", group,
                              [(ports[w], w + wire.RID_WORKER_OFFSET) for w in range(len(keys))])
            if uplink is not None:
                self._write_uplink(job_id, uplink, len(keys), epoch, base, slots, group)
            for w, key in enumerate(keys):
                self._write_entry("INSERT", P4.TABLE_JOB_WORKERS,
                                  {"src_addr": key[0], "src_port": key[1]}, P4.ACTION_SET_WORKER,
                                  {"job": job_id, "worker": w, "workers": len(keys),
                                   "epoch": epoch, "region_base": base, "region_size": slots,
                                   "mcast_group": group, "port": ports[w]})
            self._sync_jobs()
            self.model.clear_job_stats(job_id)
            return self.model.jobs[job_id]

    def remove_job(self, job_id: int) -> JobEntry:
        with self.lock:
            rows = self._job_rows().get(job_id)
            if not rows:
                raise JobError(f"job {job_id} is not installed")
            job = self.model.jobs.get(job_id) or self._describe(job_id, rows)
            group = max(rows, key=lambda r: r[1].seq)[1].params["mcast_group"]
            for key, e in rows:
                del self.tables[P4.TABLE_JOB_WORKERS][key]
                self.tables[P4.TABLE_RESULT_DST].pop(
                    (job_id, e.params["worker"] + wire.RID_WORKER_OFFSET), None)
            self.groups.pop(group, None)
            self.tables[P4.TABLE_UPLINK].pop((job_id,), None)
            for key in [k for k, e in self.tables[P4.TABLE_PARENTS].items()
                        if e.params.get("job") == job_id]:
                del self.tables[P4.TABLE_PARENTS][key]
            self._sync_jobs()
            return job

    def reset_job(self, job_id: int) -> int:
        """A new epoch (every slot of the region empty to the data plane), zeroed job counters."""
        with self.lock:
            rows = self._job_rows().get(job_id)
            if not rows:
                raise JobError(f"job {job_id} is not installed")
            epoch = self._next_epoch()
            for key, e in list(self.tables[P4.TABLE_PARENTS].items()):
                if e.params.get("job") == job_id:  # the parent's answers: the new epoch too
                    self._write_entry("MODIFY", P4.TABLE_PARENTS,
                                      dict(zip(P4.SCHEMA.table(P4.TABLE_PARENTS).field_names,
                                               key)),
                                      e.action, {**e.params, "epoch": epoch})
            for key, e in rows:
                self._write_entry("MODIFY", P4.TABLE_JOB_WORKERS,
                                  {"src_addr": key[0], "src_port": key[1]}, e.action,
                                  {**e.params, "epoch": epoch})
            self._sync_jobs()
            self.model.clear_job_stats(job_id)
            return epoch

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

    def handle_run(self, run: memoryview, size: int, src: tuple[str, int]
                   ) -> dict[tuple[str, int], list[bytes]]:
        """Datagrams of ``size`` bytes end to end (the last may be shorter), all from ``src``;
        the datagrams to send, by destination, each destination's in order."""
        out: dict[tuple[str, int], list[bytes]] = {}
        with self.lock:
            replies = self.model.process_run(run, size, src)
        for d, a in replies:
            out.setdefault(a, []).append(d)
        return out


# --------------------------------------------------------------------------------------------
# On a socket
# --------------------------------------------------------------------------------------------


class SoftSwitchServer:
    """A SoftSwitch on UDP sockets, in a thread (tests) or in the foreground (CLI).

    Like bmv2, it takes homagg packets on every port of homagg's range (0xBEE0-0xBEEF), one
    socket per port, when ``bind``'s port is one of them; else (port 0 in tests: any free
    port) on that port alone. ``ports``: the ports to serve besides ``bind``'s, in place of
    that rule (``()``: ``bind``'s alone). ``address`` is the ``bind`` socket's.

    A reply leaves from the port its request came to (bmv2's from_switch: source port = the
    request's destination port), and a tree's child job sends its partial sums up from its
    uplink's ``src_port``: the parent knows this switch, as a worker of the parent's job, by
    (address, source port), so each child job under one parent has a port of its own (several
    jobs in one tree)."""

    def __init__(self, switch: SoftSwitch | None = None, bind: tuple[str, int] = ("0.0.0.0",
                 wire.HOMAGG_UDP_PORT_MIN), faults: FaultSpec | None = None,
                 ports: Iterable[int] | None = None):
        self.switch = switch or SoftSwitch()
        ip, main = bind
        if ports is None:  # the other ports to serve
            ports = wire.HOMAGG_UDP_PORTS if main in wire.HOMAGG_UDP_PORTS else ()
        # the bind port first: a port 0 bind learns its port there
        wanted = [main] + [p for p in dict.fromkeys(ports) if p != main]
        self.socks: dict[int, udpio.BatchSocket | ImpairedSocket] = {}
        try:
            for k, port in enumerate(wanted):
                raw = self._socket(ip, port, wanted)
                name = raw.getsockname()
                port = name[1]  # (port 0: the one the kernel chose)
                if k == 0:
                    self.address = name
                self.socks[port] = raw
                if faults is not None and faults.active:  # tests: loss, dup, reorder here
                    # each port its own draw; the bind port's is ``faults`` itself
                    self.socks[port] = ImpairedSocket(
                        raw, dataclasses.replace(faults, seed=faults.seed + k) if k else faults)
        except BaseException:
            for sock in self.socks.values():
                sock.close()
            raise
        self.sock = next(iter(self.socks.values()))  # the bind port's
        self.ports = sorted(self.socks)
        self._unserved: set[int] = set()  # uplink src_ports warned about (not served here)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _socket(ip: str, port: int, wanted: list[int]) -> udpio.BatchSocket:
        raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            raw.bind((ip, port))
        except OSError as e:
            raw.close()
            more = (f" (the software aggregator serves ports {_ports_text(sorted(wanted))} "
                    "of this address, as bmv2 takes homagg's whole range; in use by another "
                    "process? --single-port serves --port alone)" if len(wanted) > 1 else "")
            raise SoftSwitchError(f"cannot bind UDP {ip}:{port}: {e.strerror}{more}") from None
        # Non-blocking: serve() waits on all the ports at once (epoll), then drains each.
        raw.setblocking(False)
        # Runs of datagrams per system call both ways (udpio: GSO and GRO): a worker's burst
        # comes up in one receive, and the results of a run go to each worker in one send.
        return udpio.BatchSocket(raw)

    def io_counts(self) -> dict[str, int]:
        """The system calls and datagrams of every port's socket, summed (udpio.io_counts)."""
        total: dict[str, int] = {}
        for sock in self.socks.values():
            for name, n in udpio.io_counts(sock).items():
                total[name] = total.get(name, 0) + n
        return total

    def serve(self) -> None:
        socks, sw = self.socks, self.switch
        buf = bytearray(udpio.RECV_BYTES)
        poller = select.epoll()
        by_fd = {}
        for port, sock in socks.items():
            poller.register(sock.fileno(), select.EPOLLIN)
            by_fd[sock.fileno()] = (port, sock)
        try:
            while not self._stop.is_set():
                try:
                    ready = poller.poll(0.2)
                except InterruptedError:
                    continue
                for fd, _ in ready:
                    port, sock = by_fd[fd]
                    # Drain the port (a bounded number of runs, so no port starves the
                    # others): one wait per burst, not one per run.
                    for _ in range(_DRAIN_RUNS):
                        try:
                            nb, seg, src = sock.recv_many(buf)
                        except BlockingIOError:
                            break
                        except OSError as e:
                            if self._stop.is_set():
                                return
                            log.debug("receive on port %d failed: %s", port, e)
                            break
                        replies = sw.handle_run(memoryview(buf)[:nb], seg, src)
                        up = sw.uplink_ports
                        for a, out in replies.items():
                            ups = up.get(a) if up else None
                            if ups is None:
                                self._send(sock, out, a)
                            else:
                                self._send_up(sock, port, ups, out, a)
        finally:
            poller.close()

    def _send_up(self, sock, port: int, ups: dict[int, int], out: list[bytes], a) -> None:
        """Datagrams to a parent switch (``a``): each leaves from the src_port of the uplink of
        the job it carries (``ups``: parent job -> src_port), where the parent knows this
        switch as that job's worker; anything else to it from the port its request came to."""
        by_port: dict[int, list[bytes]] = {}
        for d in out:
            p = ups.get(int.from_bytes(d[_JOB_AT:_JOB_AT + 2], "big"), port)
            by_port.setdefault(p, []).append(d)
        for p, ds in by_port.items():
            s = self.socks.get(p)
            if s is None:
                if p not in self._unserved:
                    self._unserved.add(p)
                    log.warning("an uplink's src_port %d is not served here (ports %s): its "
                                "partials leave from port %d, where the parent does not know "
                                "them", p, _ports_text(self.ports), port)
                s = sock
            self._send(s, ds, a)

    @staticmethod
    def _send(sock, out: list[bytes], a) -> None:
        """``out`` to ``a``: one run per system call where the datagrams are of one size. The
        socket does not block: a full send buffer is waited on for up to _SEND_WAIT seconds
        (a blocking socket's patience), then the rest is dropped (the workers' timeouts
        recover it)."""
        if len(out) > 1 and len({len(d) for d in out}) == 1:
            runs = [(b"".join(out), len(out[0]), len(out))]
        else:
            runs = [(d, len(d), 1) for d in out]
        for data, size, n in runs:
            sent, deadline = 0, 0.0
            while True:
                try:
                    if n == 1:
                        sock.sendto(data, a)
                        sent = 1
                    else:
                        sent += sock.send_many(memoryview(data)[sent * size:], size, a)
                except BlockingIOError:
                    pass
                except OSError as e:  # a worker gone: the others still get theirs
                    log.debug("send to %s failed: %s", a, e)
                    break
                if sent >= n:
                    break
                now = time.monotonic()
                deadline = deadline or now + _SEND_WAIT
                if now >= deadline:
                    log.debug("send buffer full for %.1f s: %d datagrams to %s dropped",
                              _SEND_WAIT, n - sent, a)
                    break
                select.select([], [sock], [], deadline - now)

    def start(self) -> SoftSwitchServer:
        self._thread = threading.Thread(target=self.serve, name="softswitch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(2)
        for sock in self.socks.values():
            sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class SoftSwitchError(HomaggError):
    """The software aggregator cannot run as asked (a port it cannot bind)."""


#: Runs received from one port before the others get their turn.
_DRAIN_RUNS = 16
#: How long a send waits for room in a full socket buffer (s).
_SEND_WAIT = 0.2
_JOB_AT = wire.OFFSETS["job"]


def _ports_text(ports: list[int]) -> str:
    if len(ports) > 1 and ports == list(range(ports[0], ports[-1] + 1)):
        return f"{ports[0]}-{ports[-1]}"
    return ", ".join(map(str, ports))


DEFAULT_GRPC = "127.0.0.1:9559"  # netconfig.SwitchSpec's default: where homagg-ctl looks


def _p4runtime(a, cfg, sw: SoftSwitch):
    """The P4Runtime server a's options ask for, started; None if --grpc none. A default
    address that cannot be served is a warning (the UDP aggregator runs on); an explicit one
    is an error."""
    addr = a.grpc or (cfg.switch.grpc if cfg else DEFAULT_GRPC)
    if addr.lower() == "none":
        return None
    device = a.device_id if a.device_id is not None else (cfg.switch.device_id if cfg else 1)
    try:
        from homagg.targets.p4runtime_server import P4RuntimeServer

        return P4RuntimeServer(sw, addr, device).start()
    except (ImportError, HomaggError) as e:
        if isinstance(e, ImportError):
            e = HomaggError(f"grpcio or p4runtime missing ({e}); pip install 'homagg[controller]'")
        if a.grpc:
            raise e from None
        log.warning("P4Runtime not served: %s (--grpc HOST:PORT to choose, --grpc none to "
                    "silence)", e)
        return None


def main(argv=None) -> int:
    from homagg.netconfig import load

    ap = argparse.ArgumentParser(prog="homagg-softswitch",
                                 description=(__doc__ or "").split("\nHow the tables")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", "-c", type=Path,
                    help="TOML: the switch's addresses, and jobs to install at start")
    ap.add_argument("--bind", help="address for homagg packets (default: the config's switch "
                                   "ip, else 0.0.0.0)")
    ap.add_argument("--port", type=int, default=wire.HOMAGG_UDP_PORT_MIN,
                    help="the aggregator's port (default %(default)s). In homagg's range "
                         f"({wire.HOMAGG_UDP_PORT_MIN}-{wire.HOMAGG_UDP_PORT_MAX}), the whole "
                         "range is served, as bmv2 does: a tree's child jobs send up from "
                         "ports of their own")
    ap.add_argument("--single-port", action="store_true",
                    help="serve --port alone (another aggregator may take the rest of the "
                         "range on this address; a child job's uplink src_port must be --port)")
    ap.add_argument("--grpc", metavar="HOST:PORT",
                    help="serve P4Runtime here (default: the config's [switch] grpc, else "
                         f"{DEFAULT_GRPC}); 'none': do not")
    ap.add_argument("--device-id", type=int,
                    help="P4Runtime device id (default: the config's, else 1)")
    ap.add_argument("--words", type=int, default=wire.WORDS_PER_PACKET, metavar="K",
                    help=f"words per packet (default {wire.WORDS_PER_PACKET}, as the P4 "
                         "program's default build; agents learn it from the join)")
    ap.add_argument("--stats-file", type=Path, help="write counters as JSON here every 0.2 s")
    ap.add_argument("--ready-file", type=Path,
                    help="once serving, write here as JSON the addresses served ({\"udp\": "
                         "[HOST, PORT], \"grpc\": \"HOST:PORT\" or null}): with --port 0 or "
                         "--grpc HOST:0, the ports the kernel gave")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load(a.config) if a.config else None
        sw = SoftSwitch(words=a.words)
        for j in cfg.jobs if cfg else ():
            job = sw.add_job(j.id, [(w.ip, w.udp_port) for w in j.workers], j.slots,
                             [w.switch_port for w in j.workers], j.uplink)
            log.info("job %d: %d workers, slots %d-%d", j.id, len(j.workers), job.base,
                     job.base + job.size - 1)
        server = SoftSwitchServer(sw, (a.bind or (cfg.switch.ip if cfg else "0.0.0.0"), a.port),
                                  ports=() if a.single_port else None)
        for j in cfg.jobs if cfg else ():
            if j.uplink is not None and j.uplink.src_port not in server.socks:
                server.stop()
                raise SoftSwitchError(
                    f"job {j.id}: its uplink's src_port {j.uplink.src_port} is not served here "
                    f"(ports {_ports_text(server.ports)}): its partial sums must leave from it")
        p4rt = _p4runtime(a, cfg, sw)
    except (HomaggError, OSError, RuntimeError) as e:
        print(f"homagg-softswitch: error: {e}", file=sys.stderr)
        return 1

    def reset_all():
        for job_id in list(sw.jobs):
            log.info("job %d reset: epoch %d", job_id, sw.reset_job(job_id))

    signal.signal(signal.SIGTERM, lambda *_: server._stop.set())
    # The operator's "reset": every job starts afresh. In a thread of its own: the handler
    # runs in the main thread, which may hold the switch's lock (the stats file) when it fires.
    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=reset_all).start())
    log.info("software aggregator listening on %s:%d (ports %s)", *server.address,
             _ports_text(server.ports))
    if p4rt is not None:
        log.info("P4Runtime on %s (device id %d)", p4rt.address, p4rt.device_id)
    server.start()
    if a.ready_file:
        _write_json(a.ready_file, {"udp": list(server.address),
                                   "grpc": p4rt.address if p4rt is not None else None})
    thread = server._thread
    assert thread is not None
    try:
        while thread.is_alive():
            thread.join(0.2)
            if a.stats_file:
                _write_stats(a.stats_file, sw, server)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if p4rt is not None:
            p4rt.stop()
        if a.stats_file:
            _write_stats(a.stats_file, sw, server)
    return 0


def _write_stats(path: Path, sw: SoftSwitch, server: SoftSwitchServer) -> None:
    """The counters as JSON (``_write_json``), for the launcher or a test polling the file.
    ``io``: the sockets' system calls and datagrams."""
    _write_json(path, {**sw.read_stats(), "io": server.io_counts()})


def _write_json(path: Path, value) -> None:
    """``value`` as JSON, replaced in one rename: a reader polling the file never sees it
    half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
