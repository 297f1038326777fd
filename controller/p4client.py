"""P4Runtime sessions with switches: typed entries, every name from P4Info, several at once.

One ``P4RuntimeSwitch`` per switch; a process may hold as many as it likes (a leaf/spine tree
needs several). Each owns its own p4runtime-shell ``P4RuntimeClient`` (channel, arbitration
stream): we keep p4runtime-shell for that part, which is per instance, and do not use its
``shell`` module, whose entities go through one module-global client and P4Info. Table entries
are encoded and decoded by ``homagg.p4schema`` against the generated schema
(``homagg._p4consts.SCHEMA``, the compiled P4Info), as the software aggregator's P4Runtime
server does them (canonical bytes both ways), and on connecting the switch's own P4Info is
checked against that schema, so a stale pipeline is one clear error instead of wrong writes.

Every request is logged to a file per switch (``request_log``), after p4lang/tutorials'
helper: it turns "nothing happens" into a readable trace.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homagg.controller.build import Pipeline
from homagg.errors import HomaggError
from homagg.netconfig import GrpcTls
from homagg.p4schema import (
    P4Counter,
    P4Schema,
    P4SchemaError,
    TableEntry,
    decode_entry,
    encode_entry,
    pipeline_differences,
)
from homagg.programs import V1MODEL, Program

log = logging.getLogger("homagg.p4client")

#: google.rpc.Code.ALREADY_EXISTS: the only write error that turns an insert into a modify.
ALREADY_EXISTS = 6

Match = Mapping[str, "int | tuple[int, int]"]  # exact value, or (value, prefix length) for lpm


class SwitchError(HomaggError):
    """The switch is unreachable, refused a request, or runs another pipeline."""


@dataclass(frozen=True)
class CounterValue:
    packets: int = 0
    bytes: int = 0


def _write_errors(e: BaseException) -> list[tuple[int, int, str]] | None:
    """A failed Write's per-update errors (index, canonical code, message), the updates that
    applied (code OK) left out, from gRPC's grpc-status-details-bin (P4Runtime's format);
    None if ``e`` carries none (the switch went away, or refused the whole batch)."""
    from google.rpc import status_pb2
    from p4.v1 import p4runtime_pb2

    trailing = getattr(e, "trailing_metadata", None)
    if not callable(trailing):
        return None
    status = None
    for key, value in trailing() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
    if status is None or not status.details:
        return None
    errors = []
    for i, detail in enumerate(status.details):
        err = p4runtime_pb2.Error()
        if detail.Unpack(err) and err.canonical_code != 0:
            errors.append((i, err.canonical_code, err.message))
    return errors or None


def _code_name(code: int) -> str:
    from google.rpc import code_pb2

    return code_pb2.Code.Name(code) if code in code_pb2.Code.values() else str(code)


def _pb():
    try:
        from p4.v1 import p4runtime_pb2
        from p4runtime_sh import p4runtime
    except ImportError as e:  # pragma: no cover - the controller extra is missing
        raise SwitchError(f"p4runtime-shell is not installed ({e}); "
                          "pip install 'homagg[controller]'") from e
    return p4runtime, p4runtime_pb2


def _client_class(p4runtime: Any) -> Any:
    """p4runtime-shell's client, but its handshake tells a backup session to the log, not to
    stdout (where it broke ``homagg-ctl job list --json`` while a service held primary)."""

    class Client(p4runtime.P4RuntimeClient):
        primary = False
        primary_election: tuple[int, int] = (0, 0)  # the primary's, as the switch last said
        ended = False  # the stream ended (the switch went away)

        def arbitration(self) -> bool:
            """Whether this session is primary now: the switch's arbitration updates since
            the last call applied (it sends one to every client when the primary changes)."""
            q = self.stream_in_q["arbitration"]
            while not q.empty():
                rep = q.get_nowait()
                if rep is None:  # p4runtime-shell's mark of a stream that ended
                    self.ended, self.primary = True, False
                    continue
                self._arbitrated(rep)
            return self.primary

        def _arbitrated(self, rep: Any) -> None:
            e = rep.arbitration.election_id
            self.primary_election = (e.high, e.low)
            self.primary = rep.arbitration.status.code == 0  # google.rpc OK

        def handshake(self) -> None:
            _, p4runtime_pb2 = _pb()
            req = p4runtime_pb2.StreamMessageRequest()
            req.arbitration.device_id = self.device_id
            req.arbitration.election_id.high = self.election_id[0]
            req.arbitration.election_id.low = self.election_id[1]
            if self.role_name is not None:
                req.arbitration.role.name = self.role_name
            self.stream_out_q.put(req)
            rep = self.get_stream_packet("arbitration", timeout=2)
            if rep is None:
                raise SystemExit(1)  # as p4runtime-shell's own handshake; open() names it
            self._arbitrated(rep)
            if not self.primary:
                log.info("a backup P4Runtime session (read access only): another client is "
                         "primary")

    return Client


def _counter(name: str, schema: P4Schema) -> P4Counter:
    try:
        return schema.counter(name)
    except P4SchemaError as e:  # a SwitchError, as every error of a switch's methods
        raise SwitchError(str(e)) from None


#: Seconds a P4Runtime call may take before it fails (a switch that accepts connections and
#: then hangs must not hang its caller): every call but a pipeline push, which gets PUSH_TIMEOUT.
CALL_TIMEOUT = 30.0
PUSH_TIMEOUT = 300.0


class _LoggingStub:
    """Wraps the P4Runtime gRPC stub: every request (and error) goes to the request log, and
    every call has a deadline."""

    def __init__(self, stub, path: Path | None, name: str):
        self._stub = stub
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115
        self._name = name

    def _log(self, text: str) -> None:
        if self._file:
            with self._lock:
                self._file.write(text)
                self._file.flush()

    def __getattr__(self, method):
        target = getattr(self._stub, method)
        if method == "StreamChannel":
            return target  # arbitration only; its messages are not interesting to replay

        def call(request, *args, **kwargs):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            body = str(request) if method != "SetForwardingPipelineConfig" else \
                f"(pipeline: p4info {len(request.config.p4info.tables)} tables, " \
                f"{len(request.config.p4_device_config)} bytes of bmv2 JSON)\n"
            self._log(f"### {stamp} {self._name} {method}\n{body}")
            kwargs.setdefault("timeout", PUSH_TIMEOUT if method == "SetForwardingPipelineConfig"
                              else CALL_TIMEOUT)
            try:
                return target(request, *args, **kwargs)
            except Exception as e:
                self._log(f"!!! {method} failed: {e}\n")
                raise

        return call

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None


def reachable(addr: str, timeout: float) -> bool:
    """Whether something accepts connections at a P4Runtime address (HOST:PORT or unix:PATH)."""
    if addr.startswith("unix:"):  # a server in another network namespace (Mininet's hosts)
        path = addr[len("unix:"):].removeprefix("//")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(path)
            return True
        except OSError:
            return False
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout):
            return True
    except (OSError, ValueError):
        return False


class P4RuntimeSwitch:
    """A P4Runtime session with one switch: pipeline, table entries, multicast, counters."""

    def __init__(self, grpc_addr: str = "127.0.0.1:9559", device_id: int = 1,
                 election_id: tuple[int, int] = (0, 1), request_log: Path | None = None,
                 name: str = "s1", tls: GrpcTls | None = None, program: Program = V1MODEL):
        self.addr = grpc_addr
        self.program = program  # the P4 program it runs: its names and schema (homagg.programs)
        self.tls = tls
        self.device_id = device_id
        self.election_id = election_id
        self.request_log = request_log
        self.name = name
        self.client: Any = None
        self._homagg = True
        self._stub_wrapper: _LoggingStub | None = None

    # -- session ---------------------------------------------------------------------------
    def open(self, pipeline: Pipeline | None = None, timeout: float = 5.0,
             homagg: bool = True) -> P4RuntimeSwitch:
        """Connect; push ``pipeline`` if given; then require that the switch runs homagg's
        pipeline (``homagg=False``: any pipeline, e.g. a benchmark's baseline program)."""
        p4runtime, _ = _pb()
        deadline = time.monotonic() + timeout
        while not reachable(self.addr, 0.5):
            if time.monotonic() > deadline:
                raise SwitchError(f"switch {self.name} unreachable: nothing answers P4Runtime "
                                  f"at {self.addr}")
            time.sleep(0.2)
        ssl = None
        if self.tls is not None:
            for what, path in (("grpc_ca", self.tls.ca), ("grpc_cert", self.tls.cert),
                               ("grpc_key", self.tls.key)):
                if path is not None and not Path(path).is_file():
                    raise SwitchError(f"switch {self.name}: {what} {path}: no such file")
            ssl = p4runtime.SSLOptions(False, self.tls.ca, self.tls.cert, self.tls.key)
        try:
            client = _client_class(p4runtime)(self.device_id, self.addr, self.election_id,
                                              ssl_options=ssl)
        except SystemExit:  # p4runtime-shell exits on a failed handshake
            if self.tls is not None:
                raise SwitchError(f"switch {self.name} at {self.addr}: no P4Runtime session "
                                  "over TLS (does it serve TLS with a certificate grpc_ca "
                                  "signed, for this address? with mutual TLS, does it trust "
                                  "grpc_cert?)") from None
            raise SwitchError(f"switch {self.name} at {self.addr}: no P4Runtime session "
                              f"(device id {self.device_id}? a switch that serves TLS needs "
                              "grpc_ca)") from None
        self._stub_wrapper = _LoggingStub(client.stub, self.request_log, self.name)
        client.stub = self._stub_wrapper
        self.client = client
        self._homagg = homagg
        try:
            if pipeline is not None:
                self.push_pipeline(pipeline)
            elif homagg:
                self._check_p4info()
        except BaseException:
            self.close()
            raise
        return self

    def push_pipeline(self, pipeline: Pipeline) -> None:
        p4runtime, _ = _pb()
        if not pipeline.exists():
            raise SwitchError(f"pipeline missing: {pipeline.bmv2_json} / {pipeline.p4info} "
                              "(run homagg-ctl build)")
        # bmv2 keeps its packet replication engine's groups across a new pipeline while its
        # P4Runtime server forgets them: the next install's INSERT would then succeed and add
        # a second set of replicas (every worker gets each result twice). Delete the groups
        # the switch knows first, through P4Runtime, so both sides start empty.
        try:
            groups = self.read_multicast_groups()
        except SwitchError:  # no pipeline loaded yet: nothing to delete
            groups = {}
        for group in groups:
            self.delete_multicast_group(group)
        try:
            self.client.set_fwd_pipe_config(str(pipeline.p4info), str(pipeline.bmv2_json))
        except p4runtime.P4RuntimeException as e:
            raise SwitchError(f"switch {self.name} refused the pipeline: {e}") from None
        if self._homagg:
            self._check_p4info()

    def _check_p4info(self) -> None:
        """The switch must run the pipeline the generated ids describe."""
        p4runtime, _ = _pb()
        try:
            info = self.client.get_p4info()
        except p4runtime.P4RuntimeException as e:
            raise SwitchError(f"switch {self.name} has no pipeline ({e}); run homagg-ctl "
                              "install") from None
        if not info.tables:
            raise SwitchError(f"switch {self.name} has no pipeline; run homagg-ctl install")
        diff = pipeline_differences(info, self.program.schema)  # the aggregator's check too
        if diff:
            raise SwitchError(f"switch {self.name} runs another pipeline than this homagg's "
                              f"{self.program.name} program ({'; '.join(diff[:3])}); run "
                              "homagg-ctl install")

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.tear_down()
            finally:
                self.client = None
        if self._stub_wrapper:
            self._stub_wrapper.close()
            self._stub_wrapper = None

    def __enter__(self) -> P4RuntimeSwitch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- arbitration -------------------------------------------------------------------------
    @property
    def primary(self) -> bool:
        """Whether this session is the switch's primary controller now (only the primary
        writes); a session whose stream ended is not."""
        c = self.client
        return c is not None and (c.arbitration() if hasattr(c, "arbitration") else True)

    @property
    def primary_election(self) -> tuple[int, int]:
        """The primary's election id, as the switch last said."""
        return getattr(self.client, "primary_election", self.election_id)

    @property
    def ended(self) -> bool:
        return self.client is None or getattr(self.client, "ended", False)

    # -- writes and reads ------------------------------------------------------------------
    def _write(self, what: str, updates: list, or_modify: bool = False) -> None:
        """One Write; with ``or_modify``, updates refused with ALREADY_EXISTS become MODIFY."""
        _, pb = _pb()
        if not self.primary and not self.ended:
            h, low = self.primary_election
            raise SwitchError(
                f"switch {self.name}: {what} refused: another controller is primary (election "
                f"id {h},{low}, above this one's {self.election_id[0]},{self.election_id[1]}): "
                "only the primary writes; once it disconnects, this one can")
        req = pb.WriteRequest()
        req.updates.extend(updates)
        try:
            # p4runtime-shell's own error parsing (0.0.6) loops forever on a batch where some
            # updates succeeded (it skips an OK detail without moving on): call the write
            # undecorated and read the per-update errors here.
            type(self.client).write.__wrapped__(self.client, req)
        except Exception as e:  # grpc.RpcError: per-update errors, or the switch went away
            errors = _write_errors(e)
            if errors is None:
                raise SwitchError(f"switch {self.name}: {what} failed: {e}") from None
            codes = [code for _, code, _ in errors]
            if or_modify and codes and all(c == ALREADY_EXISTS for c in codes):
                for u in updates:
                    u.type = pb.Update.MODIFY
                self._write(what, updates)
                return
            detail = "; ".join(f"update {i}: {_code_name(c)}, {msg!r}" for i, c, msg in errors)
            raise SwitchError(f"switch {self.name}: {what} failed: {detail}") from None

    def _entry_pb(self, e: TableEntry):
        _pb()  # (p4runtime-shell installed: a clear error if not)
        try:
            return encode_entry(self.program.schema, e)
        except P4SchemaError as err:  # a typo or a stale build, before anything is sent
            raise SwitchError(str(err)) from None

    def _update(self, kind: str, entity_kind: str, message):
        _, pb = _pb()
        u = pb.Update(type=getattr(pb.Update, kind))
        getattr(u.entity, entity_kind).CopyFrom(message)
        return u

    def insert(self, entry: TableEntry, or_modify: bool = False) -> None:
        """Insert; with ``or_modify``, an entry that already exists is modified (idempotent
        re-installs). Any other refusal is a SwitchError."""
        self._write(f"insert {entry.table} {dict(entry.match)}",
                    [self._update("INSERT", "table_entry", self._entry_pb(entry))], or_modify)

    def modify(self, entry: TableEntry) -> None:
        self._write(f"modify {entry.table} {dict(entry.match)}",
                    [self._update("MODIFY", "table_entry", self._entry_pb(entry))])

    def delete(self, entry: TableEntry) -> None:
        te = self._entry_pb(TableEntry(entry.table, entry.match))
        self._write(f"delete {entry.table} {dict(entry.match)}",
                    [self._update("DELETE", "table_entry", te)])

    def _read(self, what: str, entity) -> list:
        p4runtime, _ = _pb()
        out = []
        try:
            for resp in self.client.read_one(entity):
                out.extend(resp.entities)
        except Exception as e:  # P4RuntimeException or grpc.RpcError mid-stream
            raise SwitchError(f"switch {self.name}: read {what} failed: {e}") from None
        return out

    def read(self, table: str) -> list[TableEntry]:
        """Every entry of a table, by P4Info names, with integer values."""
        _, pb = _pb()
        ent = pb.Entity(table_entry=self._entry_pb(TableEntry(table, {})))
        try:
            return [decode_entry(self.program.schema, e.table_entry)
                    for e in self._read(table, ent)]
        except P4SchemaError as err:  # the switch answered with what the schema cannot hold
            raise SwitchError(f"switch {self.name}: read {table}: {err}") from None

    # -- multicast -------------------------------------------------------------------------
    def set_multicast_group(self, group: int, replicas: Iterable[tuple[int, int]]) -> None:
        """Create or replace a group of (egress port, replication id) replicas."""
        _, pb = _pb()
        entry = pb.PacketReplicationEngineEntry()
        mg = entry.multicast_group_entry
        mg.multicast_group_id = group
        for port, rid in replicas:
            mg.replicas.add(egress_port=port, instance=rid)
        self._write(f"multicast group {group}",
                    [self._update("INSERT", "packet_replication_engine_entry", entry)],
                    or_modify=True)

    def delete_multicast_group(self, group: int) -> None:
        _, pb = _pb()
        entry = pb.PacketReplicationEngineEntry()
        entry.multicast_group_entry.multicast_group_id = group
        self._write(f"delete multicast group {group}",
                    [self._update("DELETE", "packet_replication_engine_entry", entry)])

    def read_multicast_groups(self) -> dict[int, list[tuple[int, int]]]:
        _, pb = _pb()
        ent = pb.Entity()
        ent.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 0
        groups = {}
        for e in self._read("multicast groups", ent):
            mg = e.packet_replication_engine_entry.multicast_group_entry
            groups[mg.multicast_group_id] = [(r.egress_port, r.instance) for r in mg.replicas]
        return groups

    # -- counters --------------------------------------------------------------------------
    def read_counter(self, name: str) -> dict[int, CounterValue]:
        """index -> value, one wildcard read."""
        _, pb = _pb()
        ent = pb.Entity()
        ent.counter_entry.counter_id = _counter(name, self.program.schema).id
        return {e.counter_entry.index.index: CounterValue(e.counter_entry.data.packet_count,
                                                          e.counter_entry.data.byte_count)
                for e in self._read(name, ent)}

    def write_counter(self, name: str, values: Mapping[int, CounterValue]) -> None:
        """Set counter cells, in one batched Write (bmv2 resets counters one index at a time)."""
        _, pb = _pb()
        if not values:
            return
        cid = _counter(name, self.program.schema).id
        updates = []
        for index, v in sorted(values.items()):
            ce = pb.CounterEntry(counter_id=cid)
            ce.index.index = index
            ce.data.packet_count = v.packets
            ce.data.byte_count = v.bytes
            updates.append(self._update("MODIFY", "counter_entry", ce))
        self._write(f"write counter {name}", updates)
