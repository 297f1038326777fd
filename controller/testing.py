"""A fake switch for unit tests: ``P4RuntimeSwitch``'s methods, in memory, with its errors.

It holds table entries, multicast groups and counters as a P4Runtime server would, checks
every name against the generated P4Info (a typo fails here, not on a real switch), refuses a
duplicate insert with ALREADY_EXISTS and a missing modify/delete with NOT_FOUND, as bmv2 does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from homagg import _p4consts as P4
from homagg.controller.p4client import CounterValue, SwitchError, TableEntry


class FakeSwitch:
    name = "fake"

    def __init__(self) -> None:
        self.tables: dict[str, dict[tuple, TableEntry]] = {}
        self.groups: dict[int, list[tuple[int, int]]] = {}
        self.counters: dict[str, dict[int, CounterValue]] = {}
        self.writes = 0

    def __enter__(self) -> FakeSwitch:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def _key(e: TableEntry) -> tuple:
        if not P4.SCHEMA.has_table(e.table):
            raise SwitchError(f"no table {e.table!r} in P4Info")
        t = P4.SCHEMA.table(e.table)
        if set(e.match) != set(t.field_names):
            raise SwitchError(f"table {e.table}: match fields {sorted(e.match)}, P4Info has "
                              f"{sorted(t.field_names)}")
        if e.action is not None:
            a = P4.SCHEMA.action(e.action) if P4.SCHEMA.has_action(e.action) else None
            if a is None or a.id not in t.action_ids:
                raise SwitchError(f"action {e.action!r} is not one of table {e.table}'s")
            if set(e.params) != {p.name for p in a.params}:
                raise SwitchError(f"action {e.action}: parameters {sorted(e.params)}, P4Info "
                                  f"has {sorted(p.name for p in a.params)}")
        return tuple(sorted(e.match.items()))

    def insert(self, entry: TableEntry, or_modify: bool = False) -> None:
        key = self._key(entry)
        table = self.tables.setdefault(entry.table, {})
        if key in table and not or_modify:
            raise SwitchError(f"switch {self.name}: insert {entry.table} failed: ALREADY_EXISTS")
        table[key] = entry
        self.writes += 1

    def modify(self, entry: TableEntry) -> None:
        key = self._key(entry)
        if key not in self.tables.get(entry.table, {}):
            raise SwitchError(f"switch {self.name}: modify {entry.table} failed: NOT_FOUND")
        self.tables[entry.table][key] = entry
        self.writes += 1

    def delete(self, entry: TableEntry) -> None:
        key = tuple(sorted(entry.match.items()))
        if key not in self.tables.get(entry.table, {}):
            raise SwitchError(f"switch {self.name}: delete {entry.table} failed: NOT_FOUND")
        del self.tables[entry.table][key]
        self.writes += 1

    def read(self, table: str) -> list[TableEntry]:
        if not P4.SCHEMA.has_table(table):
            raise SwitchError(f"no table {table!r} in P4Info")
        return list(self.tables.get(table, {}).values())

    def set_multicast_group(self, group: int, replicas: Iterable[tuple[int, int]]) -> None:
        self.groups[group] = list(replicas)

    def delete_multicast_group(self, group: int) -> None:
        if group not in self.groups:
            raise SwitchError(f"switch {self.name}: delete multicast group {group}: NOT_FOUND")
        del self.groups[group]

    def read_multicast_groups(self) -> dict[int, list[tuple[int, int]]]:
        return {g: list(r) for g, r in self.groups.items()}

    def read_counter(self, name: str) -> dict[int, CounterValue]:
        if not P4.SCHEMA.has_counter(name):
            raise SwitchError(f"no counter {name!r} in P4Info")
        return dict(self.counters.get(name, {}))

    def write_counter(self, name: str, values: Mapping[int, CounterValue]) -> None:
        if not P4.SCHEMA.has_counter(name):
            raise SwitchError(f"no counter {name!r} in P4Info")
        size = P4.SCHEMA.counter(name).size
        bad = [i for i in values if not 0 <= i < size]
        if bad:
            raise SwitchError(f"counter {name} index {bad[0]} out of range ({size})")
        self.counters.setdefault(name, {}).update(values)

    def entries(self, table: str) -> list[TableEntry]:
        """Test helper: what a table holds."""
        return list(self.tables.get(table, {}).values())
