"""P4Runtime arbitration, as bmv2's server (p4lang/PI) does it, for the software aggregator.

The client with the highest election id is the primary; a client gets a
MasterArbitrationUpdate (status OK when primary, ALREADY_EXISTS when backup) when it
arbitrates, and every client gets one when the primary changes; an election id already held,
or another device id, ends the stream with an error. Writes need the primary's election id
(PERMISSION_DENIED otherwise). Roles are not served.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.rpc import code_pb2
from p4.v1 import p4runtime_pb2 as pb

log = logging.getLogger("homagg.p4runtime")


@dataclass(eq=False)
class _Stream:
    """One StreamChannel: its election id once it arbitrated, and what goes out on it."""

    out: queue.Queue = field(default_factory=queue.Queue)
    election: tuple[int, int] | None = None


@dataclass(frozen=True)
class _End:
    """Ends a stream with this status."""

    code: Any
    message: str


class Arbitration:
    """The clients' streams of one device, and which of them is primary."""

    def __init__(self, device_id: int):
        self.device_id = device_id
        self._lock = threading.Lock()
        self._streams: list[_Stream] = []

    def primary(self) -> _Stream | None:
        held = [s for s in self._streams if s.election is not None]
        return max(held, key=lambda s: s.election or (0, 0)) if held else None

    def _notify(self, s: _Stream) -> None:
        primary = self.primary()
        assert primary is not None and primary.election is not None
        msg = pb.StreamMessageResponse()
        arb = msg.arbitration
        arb.device_id = self.device_id
        arb.election_id.high, arb.election_id.low = primary.election
        if s is primary:
            arb.status.code, arb.status.message = code_pb2.OK, "primary"
        else:
            arb.status.code, arb.status.message = code_pb2.ALREADY_EXISTS, "backup"
        s.out.put(msg)

    def arbitrate(self, s: _Stream, arb) -> None:
        if arb.device_id != self.device_id:
            s.out.put(_End(grpc.StatusCode.NOT_FOUND, f"no device {arb.device_id} here (this "
                                                      f"is device {self.device_id})"))
            return
        if arb.HasField("role") and (arb.role.name or arb.role.id):
            s.out.put(_End(grpc.StatusCode.UNIMPLEMENTED, "roles are not served"))
            return
        election = (arb.election_id.high, arb.election_id.low)
        with self._lock:
            if any(o is not s and o.election == election for o in self._streams):
                s.out.put(_End(grpc.StatusCode.INVALID_ARGUMENT,
                               f"election id {election} is held by another client"))
                return
            before = self.primary()
            s.election = election
            if s not in self._streams:
                self._streams.append(s)
            if self.primary() is not before:
                for o in self._streams:
                    self._notify(o)
            else:
                self._notify(s)
        log.debug("arbitration: election id %s, %s", election,
                  "primary" if self.primary() is s else "backup")

    def leave(self, s: _Stream) -> None:
        with self._lock:
            if s not in self._streams:
                return
            was = self.primary()
            self._streams.remove(s)
            if was is s and self.primary() is not None:
                for o in self._streams:
                    self._notify(o)

    def may_write(self, request, context) -> bool:
        """PI's rule: with clients connected, only the primary writes; without, only a request
        that names no election id."""
        with self._lock:
            primary = self.primary()
            given = (request.election_id.high, request.election_id.low) \
                if request.HasField("election_id") else None
            if primary is None and given is None:
                return True
            if primary is not None and primary.election == (given or (0, 0)):
                return True
        context.abort(grpc.StatusCode.PERMISSION_DENIED,
                      f"not the primary client (election id {given})")
        return False

    def stream(self, request_iterator, context):
        """StreamChannel: the messages to send, until the client goes or is refused."""
        s = _Stream()
        context.add_callback(lambda: s.out.put(None))

        def pump():
            try:
                for req in request_iterator:
                    kind = req.WhichOneof("update")
                    if kind == "arbitration":
                        self.arbitrate(s, req.arbitration)
                    else:
                        log.debug("stream message %s ignored (not served)", kind)
            except Exception as e:  # the client went away
                log.debug("stream closed: %s", e)
            finally:
                self.leave(s)
                s.out.put(None)

        threading.Thread(target=pump, name="p4runtime-stream", daemon=True).start()
        while True:
            msg = s.out.get()
            if msg is None:
                return
            if isinstance(msg, _End):
                self.leave(s)
                context.abort(msg.code, msg.message)
            yield msg
