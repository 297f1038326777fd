"""The software aggregator's switch: the model plus the control plane's tables, in P4Info terms.

``SoftSwitch`` holds what homagg-ctl writes and reads on bmv2 (the five tables, the multicast
groups, the counters) and keeps the switch model (``homagg.switch_model``) to what they say. It
knows nothing of jobs as the controller does: ``homagg.controller.jobs`` writes the entries,
through ``homagg.controller.local`` in process or ``homagg.targets.p4runtime_server`` over gRPC,
exactly as it writes bmv2's.

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
- loading the pipeline again (P4Runtime) empties tables, groups, counters and slot memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from homagg import _p4consts as P4
from homagg import wire
from homagg.errors import TableError
from homagg.netconfig import int_ip
from homagg.switch_model import Address, JobEntry, ParentLink, SwitchModel

if TYPE_CHECKING:
    from homagg.targets.soft.native import NativeLoop

log = logging.getLogger("homagg.softswitch")

# google.rpc codes of a refused control-plane write: what bmv2 answers through P4Runtime
INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, RESOURCE_EXHAUSTED, OUT_OF_RANGE = 3, 5, 6, 8, 11

Key = tuple  # a table entry's key: its match fields' values in P4Info order (lpm: (value, len))


@dataclass
class Entry:
    """A table entry's action; ``seq`` is its write order (a job's parameters are its
    latest-written entry's)."""

    action: str
    params: dict[str, int]
    seq: int = 0


class SoftSwitch:
    """The switch model plus its control-plane state; every method is thread-safe (the UDP
    server, the P4Runtime server, the controller in process and signal handlers share one
    switch)."""

    def __init__(self, slots: int = wire.SLOTS, words: int = wire.WORDS_PER_PACKET):
        self.slots = slots
        self.words = words  # K (SwitchModel checks it): agents learn it from the join's reply
        self.lock = threading.Lock()
        #: the server's native loop while one serves this switch (``soft.native``)
        self.native: NativeLoop | None = None
        self._fresh()

    def _fresh(self) -> None:
        """The pipeline just loaded: empty tables and groups, zero counters and slot memory."""
        self.model = SwitchModel(self.slots, self.words)
        self.tables: dict[str, dict[Key, Entry]] = {t.name: {} for t in P4.SCHEMA.tables}
        self.groups: dict[int, list[tuple[int, int]]] = {}
        self.fwd_stats = np.zeros(wire.FWD_STATS_SIZE, np.int64)
        self.counter_bytes = {c.name: np.zeros(c.size, np.int64) for c in P4.SCHEMA.counters}
        self._seq = 0
        #: the uplink table's source ports, for the server: parent address -> {parent job:
        #: src_port} of the active child jobs (replaced whole on every change, so the server
        #: reads it without the lock)
        self.uplink_ports: dict[Address, dict[int, int]] = {}
        if self.native is not None:
            self.native.bind(self.model)

    @property
    def jobs(self) -> dict[int, JobEntry]:
        return self.model.jobs

    def reset_pipeline(self) -> None:
        with self.lock:
            self._fresh()

    # -- tables, in P4Info names (what P4Runtime writes and reads) ------------------------------
    @staticmethod
    def _key(table: str, match: Mapping[str, Any]) -> Key:
        if not P4.SCHEMA.has_table(table):
            raise TableError(INVALID_ARGUMENT, f"no table {table!r} in homagg's P4Info")
        names = P4.SCHEMA.table(table).field_names
        if set(match) != set(names):
            raise TableError(INVALID_ARGUMENT, f"table {table}: match fields {sorted(match)}, "
                                               f"it has {list(names)}")
        return tuple(match[k] for k in names)

    @staticmethod
    def _show(table: str, key: Key) -> str:
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
    def _counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The data plane's packet counters: (stats, job_stats), under the lock. Here the
        model's own; a sharded switch's are every shard's summed (``shards``)."""
        return self.model.stats, self.model.job_stats

    def _counter_written(self, name: str, index: int | None, packets: int) -> None:
        """After ``write_counter`` set a cell, under the lock (a sharded switch passes it on
        to its shards)."""

    def _packets(self, name: str) -> np.ndarray:
        stats, job_stats = self._counts()
        arrays = {P4.COUNTER_STATS: stats, P4.COUNTER_JOB_STATS: job_stats,
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
            self._counter_written(name, index, packets)

    # -- the job table drives the model -----------------------------------------------------------
    def _job_rows(self) -> dict[int, list[tuple[Key, Entry]]]:
        by_job: dict[int, list[tuple[Key, Entry]]] = {}
        for key, e in self.tables[P4.TABLE_JOB_WORKERS].items():
            if e.action == P4.ACTION_SET_WORKER:
                by_job.setdefault(e.params["job"], []).append((key, e))
        return by_job

    def _describe(self, job_id: int, rows: list[tuple[Key, Entry]]) -> JobEntry:
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
        uplink = (ParentLink(up.params["job"], up.params["worker"],
                             (int_ip(up.params["ip"]), up.params["udp_port"]), up.params["port"],
                             up.params["auth"])
                  if up is not None and up.action == P4.ACTION_SET_UPLINK else None)
        return JobEntry(job_id, [(int_ip(k[0]), k[1]) for k, _ in rows], latest["epoch"],
                        latest["region_base"], latest["region_size"],
                        [e.params["port"] for _, e in rows], results, uplink, latest["auth"])

    def _job_from(self, job_id: int, rows: list[tuple[Key, Entry]]) -> JobEntry | None:
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
        m.children_of = {((int_ip(k[0]), k[1]), k[2], k[3]): m.jobs[e.params["job"]]
                         for k, e in self.tables[P4.TABLE_PARENTS].items()
                         if e.action == P4.ACTION_SET_PARENT and e.params["job"] in m.jobs}
        # uplink.p4's src_port: the model sends to the parent, the server picks the port
        ports: dict[Address, dict[int, int]] = {}
        for (job_id,), e in self.tables[P4.TABLE_UPLINK].items():
            if e.action == P4.ACTION_SET_UPLINK and job_id in m.jobs:
                p = e.params
                ports.setdefault((int_ip(p["ip"]), p["udp_port"]), {})[p["job"]] = p["src_port"]
        self.uplink_ports = ports
        if self.native is not None:  # (its uplinks' ports too)
            self.native.jobs_changed(m)

    def read_stats(self) -> dict:
        with self.lock:
            stats, job_stats = self._counts()
            out: dict = {"switch": {name: int(stats[i]) for i, name in wire.STATS.items()},
                         "jobs": {}}
            for j in self.model.jobs:
                base = j * wire.JOB_STATS_PER_JOB
                out["jobs"][j] = {name: {"packets": int(job_stats[base + k])}
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
