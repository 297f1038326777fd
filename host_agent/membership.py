"""Joining a job through the controller service (``homagg-ctl serve``), and holding the lease.

``join`` binds the agent's UDP socket first (an ephemeral port, on the address this host
speaks to the service from, since that is the address the service registers), tells the
service the port, and blocks until every rank has joined: the answer says where to send, the
job id, this worker's id, the slots and the run (the join's attempt). The socket stays open
from then on and the agent's transport takes it (``take_socket``), so the port the switch
knows cannot go to anyone else. A thread renews the lease; ``leave`` ends it (the service
removes the job once every worker has left, or once a lease runs out).

The service may be down a while (restarted): renewals keep trying, and the data path never
needs it. If the service says the job is gone, ``lost`` says why (a timeout quotes it).
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homagg import wire
from homagg.host_agent.errors import AgentError
from homagg.udpio import route_source

log = logging.getLogger("homagg.membership")


class JoinError(AgentError):
    """The service refused the join, or never answered; the message quotes it."""


def local_ip_towards(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (no packet is sent)."""
    try:
        return route_source((host, port))
    except OSError as e:
        raise JoinError(f"no route to the controller {host}:{port}: {e}") from None


def split_address(addr: str, what: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise JoinError(f"{what} {addr!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def open_channel(controller: str, ca: Path | None = None):
    import grpc

    if ca is None:
        return grpc.insecure_channel(controller)
    try:
        roots = ca.read_bytes()
    except OSError as e:
        raise JoinError(f"HOMAGG_CA {ca}: {e.strerror}") from None
    return grpc.secure_channel(controller, grpc.ssl_channel_credentials(root_certificates=roots))


#: The leases an agent takes from a service, in seconds: a renewal every third of one, so a
#: shorter lease would spin and a longer one (or an infinite one) never renews in time.
LEASE_RANGE = (0.1, 86400.0)


def check_reply(r: Any, what: str) -> None:
    """A JoinReply's fields checked before anything uses them (a service on a plaintext link
    can be impersonated, a buggy one can say anything): a JoinError names the first field
    that is out of range and its value, never a raw OverflowError, gaierror or struct.error
    later. ``what``: "job NAME rank R", for the message."""
    def bad(field: str, value: Any, want: str) -> JoinError:
        return JoinError(f"{what}: the controller's answer is unusable: {field} {value!r} is "
                         f"not {want}")

    try:
        ip = ipaddress.ip_address(r.send_to_ip)
    except ValueError:
        raise bad("send_to_ip", r.send_to_ip, "an IPv4 address") from None
    if ip.version != 4:
        raise bad("send_to_ip", r.send_to_ip, "an IPv4 address (the agent speaks IPv4 only)")
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise bad("send_to_ip", r.send_to_ip, "a unicast address")
    checks: tuple[tuple[str, int, int, int], ...] = (
        ("send_to_port", r.send_to_port, 1, 65535),
        ("job_id", r.job_id, 1, wire.MAX_JOBS - 1),
        ("workers", r.workers, 1, 1 << 16),
        ("worker", r.worker, 0, r.workers - 1),
        ("slots", r.slots, 1, wire.SLOTS),
        ("leaf_workers", r.leaf_workers, 0, wire.MAX_WORKERS),
        ("leaf_worker", r.leaf_worker, 0, max(r.leaf_workers - 1, 0)))
    for field_name, value, low, high in checks:
        if not low <= value <= high:
            raise bad(field_name, value, f"in {low} to {high}")
    lease = r.lease_seconds
    if not (math.isfinite(lease) and LEASE_RANGE[0] <= lease <= LEASE_RANGE[1]):
        raise bad("lease_seconds", lease, f"a finite number of seconds, {LEASE_RANGE[0]:g} to "
                                          f"{LEASE_RANGE[1]:g}")


@dataclass
class Membership:
    """This worker's place in a job the service placed, and its lease."""

    controller: str
    token: str
    name: str
    job_id: int
    worker: int
    workers: int
    slots: int
    send_to: tuple[str, int]
    ip: str
    udp_port: int
    run: int
    lease: float
    place: str
    claimed_ip: str = ""
    secret: str = field(default="", repr=False)  # the job's credential for Renew and Leave
    key: int = field(default=0, repr=False)      # the job's key, in every packet (auth)
    lost: str | None = None       # why the service says the job is gone
    # placed in a tree of switches: this worker's id at its leaf (what its packets carry),
    # the leaf job's workers, and the leaf's parent's children by name (0, 0, (): one switch;
    # ``worker`` is then the lease's identity, the worker's place in the tree's order)
    leaf_worker: int = 0
    leaf_workers: int = 0
    siblings: tuple[str, ...] = ()
    _sock: socket.socket | None = field(default=None, repr=False)
    _channel: Any = field(default=None, repr=False)
    _stub: Any = field(default=None, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    renewals: int = 0

    def take_socket(self) -> socket.socket:
        """The bound UDP socket the service registered (once)."""
        if self._sock is None:
            raise AgentError(f"job {self.job_id} worker {self.worker}: the joined socket was "
                             "already taken by another agent")
        sock, self._sock = self._sock, None
        return sock

    def _request(self):
        from homagg.membership import pb2

        return pb2.LeaseRequest(token=self.token, job_id=self.job_id, worker=self.worker,
                                udp_port=self.udp_port, ip=self.claimed_ip, secret=self.secret)

    def _renew_loop(self) -> None:
        import grpc

        every = max(self.lease / 3, 0.05)
        while not self._stop.wait(every):
            try:
                self._stub.Renew(self._request(), timeout=every)
                self.renewals += 1
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one failure
                if not isinstance(e, grpc.RpcError):
                    log.warning("lease renewal of job %d worker %d failed (%s: %s), retrying",
                                self.job_id, self.worker, type(e).__name__, e)
                    continue
                if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
                                grpc.StatusCode.UNAUTHENTICATED):
                    self.lost = e.details()
                    log.warning("job %d worker %d: lease lost: %s", self.job_id, self.worker,
                                self.lost)
                    return
                # the service is down or slow (a restart): the data path goes on; try again
                log.debug("lease renewal failed (%s), retrying", e.code())

    def start(self) -> Membership:
        self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                        name=f"homagg-lease-{self.job_id}-{self.worker}")
        self._thread.start()
        atexit.register(self.leave)
        return self

    def leave(self) -> None:
        """Give the place back (once; errors are logged: an unanswered leave ends with the
        lease)."""
        import grpc

        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        if self.lost is None:
            try:
                self._stub.Leave(self._request(), timeout=5)
            except grpc.RpcError as e:
                log.info("leave of job %d worker %d not taken (%s): the lease will end it",
                         self.job_id, self.worker, e.details())
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._channel.close()
        atexit.unregister(self.leave)


def join(controller: str, token: str, name: str, rank: int, world: int,
         bind: tuple[str | None, int] = (None, 0), slots: int = 0, wait: float = 120.0,
         ca: Path | None = None, claim_ip: str = "", retry: float = 10.0,
         join_secret: str = "") -> Membership:
    """Join job ``name`` as ``rank`` of ``world`` through the service at ``controller``
    (HOST:PORT); blocks until the whole job has joined, or raises JoinError. A service that
    cannot be reached (UNAVAILABLE: down, restarting) is tried again for ``retry`` seconds.
    ``join_secret``: what every rank of this attempt presents alike (the service refuses a
    join with another, so no other token holder can take a rank that has not joined yet)."""
    import grpc

    from homagg.membership import REFUSAL_KEY, pb2, rpc

    host, port = split_address(controller, "HOMAGG_CONTROLLER")
    ip = bind[0] or local_ip_towards(host, port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((ip, bind[1]))
    except OSError as e:
        sock.close()
        raise JoinError(f"job {name!r} rank {rank}: cannot bind {ip}:{bind[1]}: {e}") from None
    udp_port = sock.getsockname()[1]
    channel = open_channel(controller, ca)
    stub = rpc.MembershipStub(channel)
    req = pb2.JoinRequest(token=token, job=name, rank=rank, world_size=world, udp_port=udp_port,
                          ip=claim_ip, slots=slots, wait_seconds=wait, join_secret=join_secret)
    until = time.monotonic() + retry
    delay = 0.1
    while True:
        try:
            # the service answers within ``wait`` (naming missing ranks); the margin is for
            # the network, never for a silent hang
            r = stub.Join(req, timeout=wait + 10)
            break
        except grpc.RpcError as e:
            code = e.code()
            # the service's own refusals carry this mark; without it, the call never got there
            theirs = any(k == REFUSAL_KEY for k, _ in (e.trailing_metadata() or ()))
            if code == grpc.StatusCode.UNAVAILABLE and time.monotonic() + delay < until:
                # down, or restarting (or its switch is): the join is worth another try
                time.sleep(delay)
                delay = min(2 * delay, 2.0)
                continue
            sock.close()
            channel.close()
            if code == grpc.StatusCode.UNAVAILABLE and not theirs:
                raise JoinError(f"job {name!r} rank {rank}: cannot reach the controller at "
                                f"{controller} to join (UNAVAILABLE): {e.details()} (is "
                                "homagg-ctl serve up there? over TLS, HOMAGG_CA must name its "
                                "CA)") from None
            raise JoinError(f"job {name!r} rank {rank}: the controller refused the join "
                            f"({code.name if code else '?'}): {e.details()}") from None
    try:
        check_reply(r, f"job {name!r} rank {rank}")
    except JoinError:
        sock.close()
        channel.close()
        raise
    log.info("joined %s as worker %d of %d: job %d on %s (%s:%d), run %d", name, r.worker,
             r.workers, r.job_id, r.place, r.send_to_ip, r.send_to_port, r.run)
    return Membership(controller, token, name, r.job_id, r.worker, r.workers, r.slots,
                      (r.send_to_ip, r.send_to_port), ip, udp_port, r.run, r.lease_seconds,
                      r.place, claim_ip, r.secret, r.key, leaf_worker=r.leaf_worker,
                      leaf_workers=r.leaf_workers, siblings=tuple(r.siblings), _sock=sock,
                      _channel=channel, _stub=stub).start()
