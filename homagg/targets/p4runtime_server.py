"""P4Runtime for the software aggregator: homagg-ctl drives it as it drives bmv2.

``P4RuntimeServer`` serves (grpcio, the p4runtime package's p4.v1 messages) the part of
P4Runtime that homagg's controller uses, in front of a ``SoftSwitch``, so the controller keeps
one code path (``P4RuntimeSwitch``) for both targets. What the tables mean to the data plane is
``homagg.targets.soft``'s business; this module is the protocol, modelled on bmv2's server
(p4lang/PI):

- StreamChannel: arbitration only (``homagg.targets.arbitration``): the client with the
  highest election id is the primary, and writes need its election id. Packet-out and digests
  are not served.
- The pipeline: the software aggregator *is* homagg's pipeline, so GetForwardingPipelineConfig
  answers with homagg's P4Info from the start. SetForwardingPipelineConfig takes a P4Info only
  if its tables, actions and counters (names, ids, match fields, parameters, sizes) are
  homagg's, and refuses any other with INVALID_ARGUMENT naming what differs; the device config
  (bmv2 JSON, or none) is kept, not interpreted. Committing is loading the pipeline: empty
  tables and groups, zero counters and slot memory, as on bmv2. RECONCILE_AND_COMMIT keeps the
  state.
- Write: table entries of the five tables (INSERT, MODIFY, DELETE), counter cells (MODIFY; no
  index: every cell), multicast groups (INSERT, MODIFY, DELETE). Updates apply one by one
  (CONTINUE_ON_ERROR). If any fails, the RPC ends with UNKNOWN and, in grpc-status-details-bin,
  a google.rpc.Status holding one p4.v1.Error per update, OK for those that applied: PI's
  format, which p4runtime-shell's P4RuntimeWriteException reads. Codes: ALREADY_EXISTS (insert
  of an existing entry or group), NOT_FOUND (modify or delete of a missing one),
  INVALID_ARGUMENT (unknown table, field, action, parameter, counter; a value wider than its
  field; a missing exact field or parameter), RESOURCE_EXHAUSTED (a full table), OUT_OF_RANGE
  (a counter index), UNIMPLEMENTED (other entities).
- Read: table entries (one table, or all with table id 0; one entry when the match is given),
  counter cells (one counter or all; every index, or the one given), multicast groups (all
  with group id 0, or one). Values come back in P4Runtime's canonical (shortest) byte form.

Table entries are decoded and encoded by ``homagg.p4schema`` against the generated schema
(``homagg._p4consts.SCHEMA``), as the controller does them, and a pushed P4Info is held to that
schema by the same check the controller makes of a switch (``p4schema.pipeline_differences``).

Why the P4Info is shipped (``homagg/_p4info.txtpb``: p4c's own output, refreshed by
``homagg-ctl build`` next to ``homagg/_p4consts.py``, and held to the same schema by
tests/test_p4runtime_server.py) rather than synthesized from ``_p4consts``: every P4Runtime
client then sees exactly the P4Info bmv2 serves (match kinds, action scopes, counter units,
register types, annotations), the interactive p4runtime-shell included, which needs more than
``_p4consts`` holds. No p4c is needed to serve it.

Every request is logged at debug level (logger ``homagg.p4runtime``); the controller keeps its
own request log.
"""

from __future__ import annotations

import logging
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import text_format
from google.rpc import code_pb2, status_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2 as pb
from p4.v1 import p4runtime_pb2_grpc

from homagg import _p4consts as P4
from homagg.errors import HomaggError, TableError
from homagg.p4schema import (
    P4SchemaError,
    TableEntry,
    decode_entry,
    encode_entry,
    pipeline_differences,
)
from homagg.paths import P4INFO_FILE
from homagg.targets.arbitration import Arbitration

if TYPE_CHECKING:  # the switch it serves; soft.py imports this module to serve it
    from homagg.targets.soft.tables import SoftSwitch

log = logging.getLogger("homagg.p4runtime")

API_VERSION = "1.4.1"  # the p4runtime package homagg's controller is built with

_COUNTERS_BY_ID = {c.id: c.name for c in P4.SCHEMA.counters}


class P4RuntimeServerError(HomaggError):
    """The P4Runtime server cannot start (address in use, P4Info missing)."""


# -- P4Info ------------------------------------------------------------------------------------


def load_p4info(path: Path = P4INFO_FILE):
    """homagg's P4Info message, from the file shipped in the package."""
    info = p4info_pb2.P4Info()
    try:
        text_format.Parse(path.read_text(), info)
    except (OSError, text_format.ParseError) as e:
        raise P4RuntimeServerError(f"homagg's P4Info is unreadable ({e}); reinstall homagg, or "
                                   "run homagg-ctl build in a checkout") from None
    return info


# -- table entries -----------------------------------------------------------------------------


def _decode(te, need_action: bool) -> TableEntry:
    """A p4.v1.TableEntry in P4Info names (``homagg.p4schema.decode_entry``), refused with
    the code bmv2 gives: the default action is this server's own limit."""
    try:
        table = P4.SCHEMA.table(te.table_id)
        if te.is_default_action:
            raise TableError(code_pb2.UNIMPLEMENTED,
                             f"{table.name}: the default action is fixed here")
        return decode_entry(P4.SCHEMA, te, need_action)
    except P4SchemaError as e:
        raise TableError(code_pb2.INVALID_ARGUMENT, str(e)) from None


# -- the service -------------------------------------------------------------------------------


class _Service(p4runtime_pb2_grpc.P4RuntimeServicer):
    def __init__(self, switch: SoftSwitch, device_id: int):
        self.sw = switch
        self.device_id = device_id
        self.p4info = load_p4info()
        self.device_config = b""
        self.cookie: Any = None
        self._saved: Any = None  # a verified config waiting for COMMIT
        self.arbitration = Arbitration(device_id)

    def _check_device(self, request, context) -> None:
        if request.device_id != self.device_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no device {request.device_id} here "
                                                     f"(this is device {self.device_id})")

    def StreamChannel(self, request_iterator, context):
        yield from self.arbitration.stream(request_iterator, context)

    # -- pipeline ------------------------------------------------------------------------------
    def SetForwardingPipelineConfig(self, request, context):
        log.debug("SetForwardingPipelineConfig: action %s, p4info with %d tables, %d bytes of "
                  "device config", pb.SetForwardingPipelineConfigRequest.Action.Name(
                      request.action), len(request.config.p4info.tables),
                  len(request.config.p4_device_config))
        self._check_device(request, context)
        self.arbitration.may_write(request, context)
        A = pb.SetForwardingPipelineConfigRequest
        action = request.action
        if action == A.COMMIT:
            if self._saved is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no saved pipeline to commit")
            self._adopt(self._saved, reset=True)
            self._saved = None
            return pb.SetForwardingPipelineConfigResponse()
        if action not in (A.VERIFY, A.VERIFY_AND_SAVE, A.VERIFY_AND_COMMIT,
                          A.RECONCILE_AND_COMMIT):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no pipeline action given")
        diff = pipeline_differences(request.config.p4info, P4.SCHEMA)
        if diff:
            more = f" (+{len(diff) - 3} more)" if len(diff) > 3 else ""
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "the software aggregator runs homagg's pipeline only, and this P4Info "
                          f"is another: {'; '.join(diff[:3])}{more}")
        if action == A.VERIFY_AND_SAVE:
            self._saved = request.config
        elif action in (A.VERIFY_AND_COMMIT, A.RECONCILE_AND_COMMIT):
            self._adopt(request.config, reset=action == A.VERIFY_AND_COMMIT)
        return pb.SetForwardingPipelineConfigResponse()

    def _adopt(self, config, reset: bool) -> None:
        p4info = p4info_pb2.P4Info()
        p4info.CopyFrom(config.p4info)
        self.p4info = p4info
        self.device_config = bytes(config.p4_device_config)
        self.cookie = config.cookie if config.HasField("cookie") else None
        if reset:
            self.sw.reset_pipeline()
        log.info("pipeline %s (%d bytes of device config, not interpreted)",
                 "loaded: tables, groups, counters and slots emptied" if reset else "reconciled",
                 len(self.device_config))

    def GetForwardingPipelineConfig(self, request, context):
        log.debug("GetForwardingPipelineConfig: %s", request.response_type)
        self._check_device(request, context)
        R = pb.GetForwardingPipelineConfigRequest
        rep = pb.GetForwardingPipelineConfigResponse()
        kind = request.response_type
        if kind in (R.ALL, R.P4INFO_AND_COOKIE):
            rep.config.p4info.CopyFrom(self.p4info)
        if kind in (R.ALL, R.DEVICE_CONFIG_AND_COOKIE):
            rep.config.p4_device_config = self.device_config
        if self.cookie is not None:
            rep.config.cookie.CopyFrom(self.cookie)
        return rep

    def Capabilities(self, request, context):
        return pb.CapabilitiesResponse(p4runtime_api_version=API_VERSION)

    # -- write ---------------------------------------------------------------------------------
    def Write(self, request, context):
        log.debug("Write\n%s", request)
        self._check_device(request, context)
        if request.role or request.role_id:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "roles are not served")
        self.arbitration.may_write(request, context)
        if request.atomicity != pb.WriteRequest.CONTINUE_ON_ERROR:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "only CONTINUE_ON_ERROR atomicity")
        results = [self._update(u) for u in request.updates]
        failed = [(i, c, m) for i, (c, m) in enumerate(results) if c != code_pb2.OK]
        if not failed:
            return pb.WriteResponse()
        status = status_pb2.Status(code=code_pb2.UNKNOWN,
                                   message=f"{len(failed)} of {len(results)} update(s) failed")
        for c, m in results:
            status.details.add().Pack(pb.Error(canonical_code=c, message=m))
        context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
        context.set_code(grpc.StatusCode.UNKNOWN)
        context.set_details(status.message)
        return pb.WriteResponse()

    def _update(self, u) -> tuple[int, str]:
        which = u.entity.WhichOneof("entity")
        kind = f"update type {u.type}"
        try:
            if u.type not in pb.Update.Type.values():
                raise TableError(code_pb2.INVALID_ARGUMENT,
                                 f"update type {u.type} unknown (INSERT, MODIFY or DELETE)")
            kind = pb.Update.Type.Name(u.type)
            if kind == "UNSPECIFIED":
                raise TableError(code_pb2.INVALID_ARGUMENT, "update type unspecified")
            if which == "table_entry":
                e = _decode(u.entity.table_entry, need_action=kind != "DELETE")
                self.sw.write_entry(kind, e.table, e.match, e.action, e.params)
            elif which == "counter_entry":
                self._write_counter(kind, u.entity.counter_entry)
            elif which == "packet_replication_engine_entry":
                self._write_group(kind, u.entity.packet_replication_engine_entry)
            else:
                raise TableError(code_pb2.UNIMPLEMENTED,
                                 f"{which or 'an empty entity'}: not served by the software "
                                 "aggregator")
        except TableError as e:
            log.debug("%s %s refused: %s", kind, which, e)
            return e.code, str(e)
        except Exception as e:  # a bug here must not take the server down
            log.exception("%s %s failed", kind, which)
            return code_pb2.INTERNAL, f"{type(e).__name__}: {e}"
        return code_pb2.OK, ""

    def _write_counter(self, kind: str, ce) -> None:
        name = _COUNTERS_BY_ID.get(ce.counter_id)
        if name is None:
            raise TableError(code_pb2.INVALID_ARGUMENT,
                             f"no counter id {ce.counter_id} in homagg's P4Info")
        if kind != "MODIFY":
            raise TableError(code_pb2.INVALID_ARGUMENT, f"counter {name}: cells are modified, "
                                                        f"not {kind.lower()}ed")
        if ce.data.packet_count < 0 or ce.data.byte_count < 0:
            raise TableError(code_pb2.INVALID_ARGUMENT,
                             f"counter {name}: counts are never negative ({ce.data.packet_count} "
                             f"packets, {ce.data.byte_count} bytes)")
        index = ce.index.index if ce.HasField("index") else None
        self.sw.write_counter(name, index, ce.data.packet_count, ce.data.byte_count)

    def _write_group(self, kind: str, pre) -> None:
        if pre.WhichOneof("type") != "multicast_group_entry":
            raise TableError(code_pb2.UNIMPLEMENTED, "clone sessions are not served")
        mg = pre.multicast_group_entry
        replicas = []
        for r in mg.replicas:
            port = r.egress_port if r.WhichOneof("port_kind") != "port" else \
                int.from_bytes(r.port, "big")
            replicas.append((port, r.instance))
        self.sw.write_group(kind, mg.multicast_group_id, replicas)

    # -- read ----------------------------------------------------------------------------------
    def Read(self, request, context):
        log.debug("Read\n%s", request)
        self._check_device(request, context)
        rep = pb.ReadResponse()
        for ent in request.entities:
            which = ent.WhichOneof("entity")
            try:
                if which == "table_entry":
                    rep.entities.extend(self._read_tables(ent.table_entry))
                elif which == "counter_entry":
                    rep.entities.extend(self._read_counters(ent.counter_entry))
                elif which == "packet_replication_engine_entry":
                    rep.entities.extend(self._read_groups(ent.packet_replication_engine_entry))
                else:
                    raise TableError(code_pb2.UNIMPLEMENTED, f"{which or 'an empty entity'}: "
                                                             "not served by the software "
                                                             "aggregator")
            except TableError as e:
                context.abort(_status_code(e.code), str(e))
        yield rep

    def _read_tables(self, te) -> list:
        if te.table_id == 0:
            tables = [t.name for t in P4.SCHEMA.tables]
        else:
            try:
                tables = [P4.SCHEMA.table(te.table_id).name]
            except P4SchemaError as e:
                raise TableError(code_pb2.INVALID_ARGUMENT, str(e)) from None
        want = _decode(te, need_action=False).match if te.match else None
        out = []
        for table in tables:
            for match, action, params in self.sw.read_entries(table):
                if want is None or match == want:
                    out.append(pb.Entity(table_entry=encode_entry(
                        P4.SCHEMA, TableEntry(table, match, action, params))))
        return out

    def _read_counters(self, ce) -> list:
        if ce.counter_id == 0:
            names = [c.name for c in P4.SCHEMA.counters]
        elif ce.counter_id in _COUNTERS_BY_ID:
            names = [_COUNTERS_BY_ID[ce.counter_id]]
        else:
            raise TableError(code_pb2.INVALID_ARGUMENT,
                             f"no counter id {ce.counter_id} in homagg's P4Info")
        out = []
        for name in names:
            cells = self.sw.read_counter(name)
            indexes: range | list[int] = range(len(cells))
            if ce.HasField("index"):
                if not 0 <= ce.index.index < len(cells):
                    raise TableError(code_pb2.OUT_OF_RANGE, f"counter {name} has no index "
                                                            f"{ce.index.index}")
                indexes = [ce.index.index]
            for i in indexes:
                e = pb.Entity()
                e.counter_entry.counter_id = P4.SCHEMA.counter(name).id
                e.counter_entry.index.index = i
                e.counter_entry.data.packet_count, e.counter_entry.data.byte_count = cells[i]
                out.append(e)
        return out

    def _read_groups(self, pre) -> list:
        if pre.WhichOneof("type") != "multicast_group_entry":
            raise TableError(code_pb2.UNIMPLEMENTED, "clone sessions are not served")
        want = pre.multicast_group_entry.multicast_group_id
        out = []
        for group, replicas in self.sw.read_groups().items():
            if want in (0, group):
                e = pb.Entity()
                mg = e.packet_replication_engine_entry.multicast_group_entry
                mg.multicast_group_id = group
                for port, rid in replicas:
                    mg.replicas.add(egress_port=port, instance=rid)
                out.append(e)
        return out


def _status_code(code: int) -> grpc.StatusCode:
    """The grpc.StatusCode of a google.rpc code number."""
    for sc in grpc.StatusCode:
        if sc.value[0] == code:
            return sc
    return grpc.StatusCode.UNKNOWN


# -- the server --------------------------------------------------------------------------------


class P4RuntimeServer:
    """A SoftSwitch on P4Runtime: ``start()`` serves in grpcio's threads, ``stop()`` ends."""

    def __init__(self, switch: SoftSwitch, address: str = "127.0.0.1:9559", device_id: int = 1,
                 threads: int = 32, tls: tuple[Path, Path, Path | None] | None = None):
        """``tls``: (certificate, key, client CA or None) as PEM files: P4Runtime over TLS,
        and with a client CA, only clients holding a certificate it signed (mutual TLS)."""
        host, sep, port = address.rpartition(":")
        if not address.startswith("unix:") and (not sep or not host or not port.isdigit()):
            raise P4RuntimeServerError(f"P4Runtime address {address!r}: expected HOST:PORT "
                                       "or unix:PATH")
        self.switch = switch
        self.device_id = device_id
        self.address = address
        self._threads = threads
        self._tls = tls
        self._service = _Service(switch, device_id)
        self._server: Any = None

    def start(self) -> P4RuntimeServer:
        server = grpc.server(futures.ThreadPoolExecutor(self._threads, "p4runtime"),
                             options=[("grpc.so_reuseport", 0)])
        p4runtime_pb2_grpc.add_P4RuntimeServicer_to_server(self._service, server)
        creds = None
        if self._tls is not None:
            cert, key, client_ca = self._tls
            try:
                pair = (key.read_bytes(), cert.read_bytes())
                roots = client_ca.read_bytes() if client_ca is not None else None
            except OSError as e:
                raise P4RuntimeServerError(f"P4Runtime TLS: {e.filename}: {e.strerror}") \
                    from None
            creds = grpc.ssl_server_credentials([pair], root_certificates=roots,
                                                require_client_auth=roots is not None)
        try:
            port = server.add_secure_port(self.address, creds) if creds is not None \
                else server.add_insecure_port(self.address)
        except RuntimeError:
            port = 0
        if not port:
            raise P4RuntimeServerError(f"cannot serve P4Runtime at {self.address} (in use, or "
                                       "not an address of this host)")
        server.start()
        if not self.address.startswith("unix:"):  # port 0 asked for any: say which
            self.address = f"{self.address.rpartition(':')[0]}:{port}"
        self._server = server
        log.debug("serving P4Runtime at %s, device id %d", self.address, self.device_id)
        return self

    def stop(self, grace: float | None = 0.5) -> None:
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None

    def __enter__(self) -> P4RuntimeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
