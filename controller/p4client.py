"""One P4Runtime session with one switch, through p4runtime-shell, with every request logged.

p4runtime-shell keeps its client in a module global, so one process talks to one switch at a
time through it; ``SwitchConnection`` owns that global while it is open. Its own ``setup()``
calls sys.exit() on errors, so we build the client ourselves and raise ``SwitchError`` with
one clear line instead.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Iterable

from homagg.controller.build import Pipeline
from homagg.errors import HomaggError

log = logging.getLogger("homagg.switch")


class SwitchError(HomaggError):
    """The switch is unreachable, refused a request, or has no pipeline."""


def _shell():
    try:
        from p4.v1 import p4runtime_pb2
        from p4runtime_sh import context as _context  # noqa: F401
        from p4runtime_sh import p4runtime, shell
    except ImportError as e:  # pragma: no cover - the controller extra is missing
        raise SwitchError(f"p4runtime-shell is not installed ({e}); "
                          "pip install 'homagg[controller]'") from e
    return shell, p4runtime, p4runtime_pb2


class _LoggingStub:
    """Wraps the P4Runtime gRPC stub: every request (and error) goes to the request log."""

    def __init__(self, stub, path: Path | None, name: str):
        self._stub = stub
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8") if path else None
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


def _reachable(addr: str, timeout: float) -> bool:
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout):
            return True
    except (OSError, ValueError):
        return False


class SwitchConnection:
    """A P4Runtime session: push the pipeline, write entries, read and reset counters."""

    def __init__(self, grpc_addr: str = "127.0.0.1:9559", device_id: int = 1,
                 election_id: tuple[int, int] = (0, 1), request_log: Path | None = None,
                 name: str = "s1"):
        self.addr = grpc_addr
        self.device_id = device_id
        self.election_id = election_id
        self.request_log = request_log
        self.name = name
        self.client = None
        self._stub_wrapper = None

    # -- session ------------------------------------------------------------------------
    def open(self, pipeline: Pipeline | None = None, timeout: float = 5.0) -> "SwitchConnection":
        """Connect; push ``pipeline`` if given, else require that the switch has one."""
        shell, p4runtime, _ = _shell()
        if shell.client is not None:
            raise SwitchError("another switch session is open in this process")
        deadline = time.monotonic() + timeout
        while not _reachable(self.addr, 0.5):
            if time.monotonic() > deadline:
                raise SwitchError(f"switch {self.name} unreachable: nothing answers P4Runtime "
                                  f"at {self.addr}")
            time.sleep(0.2)
        try:
            client = p4runtime.P4RuntimeClient(self.device_id, self.addr, self.election_id)
        except SystemExit:
            raise SwitchError(f"switch {self.name} at {self.addr}: no P4Runtime session "
                              f"(device id {self.device_id}?)") from None
        shell.global_options["verbose"] = False  # else it prints every match field it builds
        self._stub_wrapper = _LoggingStub(client.stub, self.request_log, self.name)
        client.stub = self._stub_wrapper
        self.client = client
        shell.client = client
        try:
            if pipeline is not None:
                self.push_pipeline(pipeline)
            else:
                self._load_p4info()
        except BaseException:
            self.close()
            raise
        return self

    def push_pipeline(self, pipeline: Pipeline) -> None:
        shell, p4runtime, _ = _shell()
        if not pipeline.exists():
            raise SwitchError(f"pipeline missing: {pipeline.bmv2_json} / {pipeline.p4info} "
                              "(run homagg-ctl build)")
        try:
            self.client.set_fwd_pipe_config(str(pipeline.p4info), str(pipeline.bmv2_json))
        except p4runtime.P4RuntimeException as e:
            raise SwitchError(f"switch {self.name} refused the pipeline: {e}") from None
        self._load_p4info()

    def _load_p4info(self) -> None:
        shell, p4runtime, _ = _shell()
        try:
            p4info = self.client.get_p4info()
        except p4runtime.P4RuntimeException as e:
            raise SwitchError(f"switch {self.name} has no pipeline ({e}); run homagg-ctl "
                              "install") from None
        if not p4info.tables:
            raise SwitchError(f"switch {self.name} has no pipeline; run homagg-ctl install")
        shell.context.set_p4info(p4info)

    def close(self) -> None:
        shell, _, _ = _shell()
        if self.client is not None:
            try:
                self.client.tear_down()
            finally:
                if shell.client is self.client:
                    shell.client = None
                self.client = None
        if self._stub_wrapper:
            self._stub_wrapper.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- tables -------------------------------------------------------------------------
    def table_entry(self, table: str, match: dict, action: str | None = None,
                    params: dict | None = None):
        shell, _, _ = _shell()
        te = shell.TableEntry(table)(action=action) if action else shell.TableEntry(table)
        for k, v in match.items():
            te.match[k] = str(v)
        for k, v in (params or {}).items():
            te.action[k] = str(v)
        return te

    def _do(self, what: str, fn):
        shell, p4runtime, _ = _shell()
        try:
            return fn()
        except (p4runtime.P4RuntimeWriteException, p4runtime.P4RuntimeException) as e:
            raise SwitchError(f"switch {self.name}: {what} failed: {e}".strip()) from None

    def insert(self, table: str, match: dict, action: str, params: dict | None = None,
               replace: bool = False) -> None:
        te = self.table_entry(table, match, action, params)
        if replace:
            # modify when present: reinstalling a config is idempotent
            try:
                te.insert()
                return
            except Exception:
                pass
            self._do(f"modify {table} {match}", te.modify)
        else:
            self._do(f"insert {table} {match}", te.insert)

    def modify(self, table: str, match: dict, action: str, params: dict | None = None) -> None:
        te = self.table_entry(table, match, action, params)
        self._do(f"modify {table} {match}", te.modify)

    def delete(self, table: str, match: dict) -> None:
        te = self.table_entry(table, match)
        self._do(f"delete {table} {match}", te.delete)

    def read_table(self, table: str) -> list[tuple[dict, str, dict]]:
        """All entries of a table as (match, action, params) with integer values."""
        shell, _, _ = _shell()
        out = []

        def collect(te):
            match = {}
            for name, fm in te.match._mk.items():  # name -> p4runtime FieldMatch
                if fm.HasField("exact"):
                    match[name] = int.from_bytes(fm.exact.value, "big")
                elif fm.HasField("lpm"):
                    match[name] = (int.from_bytes(fm.lpm.value, "big"), fm.lpm.prefix_len)
            action = te.action  # p4runtime-shell Action: name -> p4runtime Param message
            params = {name: int.from_bytes(p.value, "big")
                      for name, p in action._param_values.items()}
            action_name = action.action_name
            out.append((match, action_name, params))

        self._do(f"read {table}", lambda: shell.TableEntry(table).read(collect))
        return out

    # -- multicast ----------------------------------------------------------------------
    def set_multicast_group(self, group: int, replicas: Iterable[tuple[int, int]]) -> None:
        shell, _, _ = _shell()
        mg = shell.MulticastGroupEntry(group)
        for port, rid in replicas:
            mg.add(port, rid)
        try:
            mg.insert()
        except Exception:
            self._do(f"modify multicast group {group}", mg.modify)

    def delete_multicast_group(self, group: int) -> None:
        shell, _, _ = _shell()
        self._do(f"delete multicast group {group}", shell.MulticastGroupEntry(group).delete)

    def read_multicast_groups(self) -> dict[int, list[tuple[int, int]]]:
        shell, _, _ = _shell()
        groups = {}

        def collect(mg):
            groups[mg.group_id] = [(r._msg.egress_port, r._msg.instance) for r in mg.replicas]

        self._do("read multicast groups", lambda: shell.MulticastGroupEntry().read(collect))
        return groups

    # -- counters -----------------------------------------------------------------------
    def read_counter(self, name: str) -> dict[int, tuple[int, int]]:
        """index -> (packets, bytes), one wildcard read."""
        shell, _, _ = _shell()
        out = {}

        def collect(ce):
            d = ce._entry.data
            out[ce._entry.index.index] = (d.packet_count, d.byte_count)

        self._do(f"read counter {name}", lambda: shell.CounterEntry(name).read(collect))
        return out

    def write_counter(self, name: str, values: dict[int, tuple[int, int]]) -> None:
        """Set counter cells, in one batched Write (bmv2 resets counters one index at a time)."""
        shell, p4runtime, p4runtime_pb2 = _shell()
        if not values:
            return
        cid = shell.context.get_obj_id(shell.P4Type.counter, name)
        req = p4runtime_pb2.WriteRequest()
        for index, (packets, nbytes) in sorted(values.items()):
            up = req.updates.add()
            up.type = p4runtime_pb2.Update.MODIFY
            ce = up.entity.counter_entry
            ce.counter_id = cid
            ce.index.index = index
            ce.data.packet_count = packets
            ce.data.byte_count = nbytes
        self._do(f"write counter {name}", lambda: self.client.write(req))
