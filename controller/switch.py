"""The switch the controller drives, named: what ``controller.jobs`` and the service need of it.

Two classes have these methods: ``P4RuntimeSwitch`` (``controller.p4client``: bmv2, or the
software aggregator's P4Runtime server, over gRPC) and ``LocalSwitch`` (``controller.local``:
the software aggregator's tables in this process). Names are P4Info's; a refusal is a
``SwitchError`` naming the google.rpc code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from homagg.controller.p4client import CounterValue, TableEntry


class Switch(Protocol):
    name: str

    def insert(self, entry: TableEntry, or_modify: bool = False) -> None: ...

    def modify(self, entry: TableEntry) -> None: ...

    def delete(self, entry: TableEntry) -> None: ...

    def read(self, table: str) -> list[TableEntry]: ...

    def set_multicast_group(self, group: int, replicas: Iterable[tuple[int, int]]) -> None: ...

    def delete_multicast_group(self, group: int) -> None: ...

    def read_multicast_groups(self) -> dict[int, list[tuple[int, int]]]: ...

    def read_counter(self, name: str) -> dict[int, CounterValue]: ...

    def write_counter(self, name: str, values: Mapping[int, CounterValue]) -> None: ...

    def close(self) -> None: ...
