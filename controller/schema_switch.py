"""A switch's control plane for any compiled homagg program, with no data plane behind it.

``SchemaSwitch`` holds what a P4Runtime switch running ``program`` (``homagg.programs``) would
hold after the controller's writes: table entries, multicast groups and counter cells. Every
entry goes through ``homagg.p4schema``'s encoding and back, against the program's own P4Info,
as ``P4RuntimeSwitch`` sends it: a name, field, parameter or width the program does not have
is refused as the switch would refuse it (INVALID_ARGUMENT), and so are a full table, an
existing entry (ALREADY_EXISTS) and a missing one (NOT_FOUND).

It is how the job logic (``controller.jobs``) is driven against a program nothing here runs
(the TNA program: Tofino), and a dry run of what ``homagg-ctl`` would write:

    sw = SchemaSwitch(TOFINO)
    jobs.add_job(sw, spec); jobs.list_jobs(sw); jobs.remove_job(sw, spec.id)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from homagg.controller.p4client import CounterValue, SwitchError, TableEntry
from homagg.p4schema import P4SchemaError, decode_entry, encode_entry
from homagg.programs import Program

__all__ = ["SchemaSwitch"]


class SchemaSwitch:
    """``P4RuntimeSwitch``'s methods on in-memory state shaped by ``program``'s P4Info."""

    def __init__(self, program: Program, name: str = "schema"):
        self.program = program
        self.name = name
        self.schema = program.schema
        self.tables: dict[str, dict[bytes, TableEntry]] = {t.name: {} for t in
                                                            self.schema.tables}
        self.groups: dict[int, list[tuple[int, int]]] = {}
        self.counters: dict[str, dict[int, CounterValue]] = {c.name: {} for c in
                                                              self.schema.counters}

    def __enter__(self) -> SchemaSwitch:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def close(self) -> None:
        pass

    def _refused(self, what: str, code: str, why: str) -> SwitchError:
        return SwitchError(f"switch {self.name}: {what} failed: {code}, {why!r}")

    # -- tables ----------------------------------------------------------------------------
    def _encode(self, what: str, entry: TableEntry, need_action: bool):
        """The entry's key (its match, as P4Runtime bytes) and the entry as the switch keeps
        it (decoded back from those bytes)."""
        try:
            pb = encode_entry(self.schema, entry)
            kept = decode_entry(self.schema, pb, need_action=need_action)
        except P4SchemaError as e:
            raise self._refused(what, "INVALID_ARGUMENT", str(e)) from None
        key = b"".join(m.SerializeToString() for m in pb.match)
        return key, kept

    def insert(self, entry: TableEntry, or_modify: bool = False) -> None:
        what = f"insert {entry.table} {dict(entry.match)}"
        key, kept = self._encode(what, entry, need_action=True)
        rows = self.tables[kept.table]
        if key in rows:
            if not or_modify:
                raise self._refused(what, "ALREADY_EXISTS", "the entry exists")
        elif len(rows) >= self.schema.table(kept.table).size:
            raise self._refused(what, "RESOURCE_EXHAUSTED", f"table {kept.table} is full")
        rows[key] = kept

    def modify(self, entry: TableEntry) -> None:
        what = f"modify {entry.table} {dict(entry.match)}"
        key, kept = self._encode(what, entry, need_action=True)
        if key not in self.tables[kept.table]:
            raise self._refused(what, "NOT_FOUND", "no such entry")
        self.tables[kept.table][key] = kept

    def delete(self, entry: TableEntry) -> None:
        what = f"delete {entry.table} {dict(entry.match)}"
        key, kept = self._encode(what, TableEntry(entry.table, entry.match), need_action=False)
        if self.tables[kept.table].pop(key, None) is None:
            raise self._refused(what, "NOT_FOUND", "no such entry")

    def read(self, table: str) -> list[TableEntry]:
        if table not in self.tables:
            raise self._refused(f"read {table}", "INVALID_ARGUMENT",
                                f"no table {table} in the {self.program.name} P4Info")
        return list(self.tables[table].values())

    # -- multicast -------------------------------------------------------------------------
    def set_multicast_group(self, group: int, replicas: Iterable[tuple[int, int]]) -> None:
        replicas = list(replicas)
        if group == 0 or len(set(replicas)) != len(replicas):
            raise self._refused(f"multicast group {group}", "INVALID_ARGUMENT",
                                "group 0, or a replica twice")
        self.groups[group] = replicas

    def delete_multicast_group(self, group: int) -> None:
        if self.groups.pop(group, None) is None:
            raise self._refused(f"delete multicast group {group}", "NOT_FOUND", "no such group")

    def read_multicast_groups(self) -> dict[int, list[tuple[int, int]]]:
        return {g: list(r) for g, r in sorted(self.groups.items())}

    # -- counters --------------------------------------------------------------------------
    def _counter(self, name: str) -> dict[int, CounterValue]:
        if name not in self.counters:
            raise self._refused(f"counter {name}", "INVALID_ARGUMENT",
                                f"no counter {name} in the {self.program.name} P4Info")
        return self.counters[name]

    def read_counter(self, name: str) -> dict[int, CounterValue]:
        cells = self._counter(name)
        return {i: cells.get(i, CounterValue()) for i in range(self.schema.counter(name).size)}

    def write_counter(self, name: str, values: Mapping[int, CounterValue]) -> None:
        cells, size = self._counter(name), self.schema.counter(name).size
        for index, v in values.items():
            if not 0 <= index < size:
                raise self._refused(f"write counter {name}", "OUT_OF_RANGE",
                                    f"no index {index} (size {size})")
            cells[index] = v
