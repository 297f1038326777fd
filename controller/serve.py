"""``homagg-ctl serve``: ``service.JobService`` behind gRPC, with its leases and metrics.

    homagg-ctl -c net.toml serve --listen 0.0.0.0:9600 --token-file /etc/homagg/token \\
        [--tls-cert cert.pem --tls-key key.pem] [--metrics-port 9601] [--lease 15]

The token is required unless ``--no-token`` says otherwise (HOMAGG_TOKEN, or the first line of
``--token-file``: a token on the command line would show in ``ps``). The first lines printed
say where it serves (``--listen 127.0.0.1:0`` takes a port the kernel gives), for scripts.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from homagg.controller.service import JobService, Refusal, ServeOptions
from homagg.errors import ConfigError
from homagg.membership import REFUSAL_KEY, pb2, rpc

log = logging.getLogger("homagg.serve")

#: Each waiting Join holds a server thread until its job completes: enough for many jobs of
#: many ranks joining at once (threads are made as needed).
MAX_THREADS = 512


class _Servicer(rpc.MembershipServicer):
    def __init__(self, svc: JobService):
        self.svc = svc

    def _refuse(self, context, e: Refusal):
        self.svc.refusals[e.code] = self.svc.refusals.get(e.code, 0) + 1
        log.info("refused (%s): %s", e.code, e)
        context.set_trailing_metadata(((REFUSAL_KEY, e.code),))
        context.abort(getattr(grpc.StatusCode, e.code), str(e))

    def Join(self, request, context):
        try:
            self.svc.check_token(request.token)
            ip = self.svc.address_of(context.peer(), request.ip)
            wait = request.wait_seconds or self.svc.opts.wait
            remaining = context.time_remaining()
            if remaining is not None:  # answer before the caller's own deadline
                wait = min(wait, max(remaining - 1.0, 0.1))
            a = self.svc.join(request.job, request.rank, request.world_size, ip,
                              request.udp_port, request.slots, wait, context.is_active)
        except Refusal as e:
            self._refuse(context, e)
        return pb2.JoinReply(send_to_ip=a.send_to[0], send_to_port=a.send_to[1],
                             job_id=a.job_id, worker=a.worker, workers=a.workers, slots=a.slots,
                             place=a.place, place_role=a.role, run=a.run,
                             lease_seconds=a.lease, ip=a.ip)

    def Renew(self, request, context):
        try:
            self.svc.check_token(request.token)
            ip = self.svc.address_of(context.peer(), request.ip)
            lease = self.svc.renew(request.job_id, request.worker, ip, request.udp_port)
        except Refusal as e:
            self._refuse(context, e)
        return pb2.RenewReply(lease_seconds=lease)

    def Leave(self, request, context):
        try:
            self.svc.check_token(request.token)
            ip = self.svc.address_of(context.peer(), request.ip)
            removed = self.svc.leave(request.job_id, request.worker, ip, request.udp_port)
        except Refusal as e:
            self._refuse(context, e)
        return pb2.LeaveReply(removed=removed)


@dataclass
class Server:
    """A running service: gRPC at ``address``, metrics at ``metrics_port`` (None: off)."""

    svc: JobService
    grpc_server: Any
    address: str
    metrics: Any = None
    metrics_port: int | None = None

    def stop(self, grace: float = 1.0) -> None:
        self.svc.stop()
        self.grpc_server.stop(grace).wait()
        if self.metrics is not None:
            self.metrics.shutdown()
            self.metrics.server_close()


def token_from(token_file: Path | None, no_token: bool,
               environ: dict[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    if no_token:
        return None
    if token_file is not None:
        try:
            lines = token_file.read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"--token-file {token_file}: {e.strerror}") from None
        token = lines[0].strip() if lines else ""
        if not token:
            raise ConfigError(f"--token-file {token_file}: empty")
        return token
    if env.get("HOMAGG_TOKEN"):
        return env["HOMAGG_TOKEN"]
    raise ConfigError("a token is required: --token-file FILE or HOMAGG_TOKEN (workers give the "
                      "same in HOMAGG_TOKEN), or --no-token to serve without one")


def start(svc: JobService, listen: str, tls: tuple[Path, Path] | None = None,
          metrics_port: int | None = None, metrics_addr: str = "0.0.0.0") -> Server:
    """Read back this service's jobs from the switch, then serve."""
    svc.recover()
    svc.start()
    server = grpc.server(futures.ThreadPoolExecutor(MAX_THREADS, "homagg-serve"),
                         options=[("grpc.so_reuseport", 0)])
    rpc.add_MembershipServicer_to_server(_Servicer(svc), server)
    try:
        if tls is not None:
            cert, key = (p.read_bytes() for p in tls)
            creds = grpc.ssl_server_credentials([(key, cert)])
            port = server.add_secure_port(listen, creds)
        else:
            port = server.add_insecure_port(listen)
    except (RuntimeError, OSError) as e:
        svc.stop()
        raise ConfigError(f"cannot serve at {listen}: {e}") from None
    if not port:
        svc.stop()
        raise ConfigError(f"cannot serve at {listen} (in use, or not an address of this host)")
    server.start()
    out = Server(svc, server, f"{listen.rpartition(':')[0]}:{port}")
    if metrics_port is not None:
        from homagg.controller.metrics import serve_metrics

        out.metrics = serve_metrics(svc, metrics_port, metrics_addr)
        out.metrics_port = out.metrics.server_port
    return out


def run(a, cfg, connect) -> int:
    """The CLI's ``serve``: until SIGTERM or Ctrl-C."""
    if bool(a.tls_cert) != bool(a.tls_key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    opts = ServeOptions(token=token_from(a.token_file, a.no_token), lease=a.lease,
                        slots=a.slots, wait=a.join_wait,
                        trust_claimed_address=a.trust_worker_address)
    svc = JobService(cfg, connect, opts)
    srv = start(svc, a.listen, (a.tls_cert, a.tls_key) if a.tls_cert else None, a.metrics_port,
                a.metrics_addr)
    print(f"serving joins at {srv.address}" + (" (TLS)" if a.tls_cert else "")
          + ("" if opts.token else " without a token"), flush=True)
    if srv.metrics_port is not None:
        print(f"metrics at http://{a.metrics_addr}:{srv.metrics_port}/metrics", flush=True)
    print(f"switch {cfg.switch.name} ({cfg.switch.target}, {cfg.switch.grpc}); "
          f"{len(svc.held)} job(s) read back", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    srv.stop()
    return 0
