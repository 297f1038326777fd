"""The software aggregator's switch driven in process, as ``P4RuntimeSwitch`` drives one over gRPC.

``controller.jobs`` is homagg's one job logic: it writes a job's table entries, multicast group
and counters to a switch. ``LocalSwitch`` lets it write them straight into a ``SoftSwitch``
(the same tables its P4Runtime server serves), where no gRPC is wanted: the aggregator's jobs
from its config at start, its SIGHUP reset, and tests. A refusal is the ``SwitchError`` a
P4Runtime switch gives, with bmv2's code name.

    sw = SoftSwitch()
    job = jobs.add_job(LocalSwitch(sw), spec, pool=sw.slots)
    # or, from (ip, port) addresses:
    job = install(sw, 1, [("127.0.0.1", 50000), ("127.0.0.1", 50001)], slots=16)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from homagg.controller import jobs
from homagg.controller.p4client import CounterValue, SwitchError, TableEntry
from homagg.errors import TableError
from homagg.netconfig import JobSpec, Uplink, Worker, validate_job
from homagg.targets.soft.tables import ALREADY_EXISTS, SoftSwitch

__all__ = ["LocalSwitch", "install", "job_spec"]

#: google.rpc code names, for messages shaped as a P4Runtime switch's
_CODES = {3: "INVALID_ARGUMENT", 5: "NOT_FOUND", 6: "ALREADY_EXISTS", 8: "RESOURCE_EXHAUSTED",
          11: "OUT_OF_RANGE"}


class LocalSwitch:
    """``P4RuntimeSwitch``'s methods on a ``SoftSwitch`` in this process."""

    def __init__(self, switch: SoftSwitch, name: str = "local"):
        self.switch = switch
        self.name = name

    def __enter__(self) -> LocalSwitch:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def close(self) -> None:
        pass

    def _refused(self, what: str, e: TableError) -> SwitchError:
        return SwitchError(f"switch {self.name}: {what} failed: "
                           f"{_CODES.get(e.code, str(e.code))}, {str(e)!r}")

    # -- tables ----------------------------------------------------------------------------
    def _write(self, kind: str, entry: TableEntry) -> None:
        try:
            self.switch.write_entry(kind, entry.table, entry.match, entry.action, entry.params)
        except TableError as e:
            raise self._refused(f"{kind.lower()} {entry.table} {dict(entry.match)}", e) from None

    def insert(self, entry: TableEntry, or_modify: bool = False) -> None:
        try:
            self.switch.write_entry("INSERT", entry.table, entry.match, entry.action,
                                    entry.params)
        except TableError as e:
            if not (or_modify and e.code == ALREADY_EXISTS):
                raise self._refused(f"insert {entry.table} {dict(entry.match)}", e) from None
            self._write("MODIFY", entry)

    def modify(self, entry: TableEntry) -> None:
        self._write("MODIFY", entry)

    def delete(self, entry: TableEntry) -> None:
        self._write("DELETE", entry)

    def read(self, table: str) -> list[TableEntry]:
        try:
            rows = self.switch.read_entries(table)
        except TableError as e:
            raise self._refused(f"read {table}", e) from None
        return [TableEntry(table, match, action, params) for match, action, params in rows]

    # -- multicast -------------------------------------------------------------------------
    def set_multicast_group(self, group: int, replicas: Iterable[tuple[int, int]]) -> None:
        replicas = list(replicas)
        kind = "MODIFY" if group in self.switch.read_groups() else "INSERT"
        try:
            self.switch.write_group(kind, group, replicas)
        except TableError as e:
            raise self._refused(f"multicast group {group}", e) from None

    def delete_multicast_group(self, group: int) -> None:
        try:
            self.switch.write_group("DELETE", group)
        except TableError as e:
            raise self._refused(f"delete multicast group {group}", e) from None

    def read_multicast_groups(self) -> dict[int, list[tuple[int, int]]]:
        return self.switch.read_groups()

    # -- counters --------------------------------------------------------------------------
    def read_counter(self, name: str) -> dict[int, CounterValue]:
        try:
            cells = self.switch.read_counter(name)
        except TableError as e:
            raise self._refused(f"read counter {name}", e) from None
        return {i: CounterValue(p, b) for i, (p, b) in enumerate(cells)}

    def write_counter(self, name: str, values: Mapping[int, CounterValue]) -> None:
        try:
            for index, v in sorted(values.items()):
                self.switch.write_counter(name, index, v.packets, v.bytes)
        except TableError as e:
            raise self._refused(f"write counter {name}", e) from None


def job_spec(job_id: int, workers: Sequence[tuple[str, int]], slots: int,
             ports: Sequence[int] | None = None, uplink: Uplink | None = None,
             key: int = 0) -> JobSpec:
    """A job of workers at (ip, udp port) addresses, checked as a config's job is
    (``netconfig.validate_job``); ``ports``: their switch ports (0 where none); ``key``: the
    job's key (its packets' auth word)."""
    ports = list(ports) if ports is not None else [0] * len(workers)
    spec = validate_job(job_id, [Worker(ip, port, "00:00:00:00:00:00", p)
                                 for (ip, port), p in zip(workers, ports)], slots, key=key)
    return JobSpec(spec.id, spec.workers, spec.slots, spec.place, uplink, spec.key)


def install(switch: SoftSwitch, job_id: int, workers: Sequence[tuple[str, int]], slots: int,
            ports: Sequence[int] | None = None, uplink: Uplink | None = None, key: int = 0
            ) -> jobs.InstalledJob:
    """``jobs.add_job`` on ``switch`` in process, for a job given by worker addresses."""
    return jobs.add_job(LocalSwitch(switch),
                        job_spec(job_id, workers, slots, ports, uplink, key),
                        pool=switch.slots)
