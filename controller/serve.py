"""``homagg-ctl serve``: ``service.JobService`` behind gRPC, with its leases and metrics.

    homagg-ctl -c net.toml serve --listen 0.0.0.0:9600 --token-file /etc/homagg/token \\
        [--tls-cert cert.pem --tls-key key.pem] [--metrics-port 9601] [--lease 15]

The token is required unless ``--no-token`` says otherwise (HOMAGG_TOKEN, or the first line of
``--token-file``: a token on the command line would show in ``ps``). The first lines printed
say where it serves (``--listen 127.0.0.1:0`` takes a port the kernel gives), for scripts.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import secrets
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from homagg.controller.p4client import reachable
from homagg.controller.service import JobService, Refusal, ServeOptions
from homagg.errors import ConfigError
from homagg.membership import REFUSAL_KEY, pb2, rpc
from homagg.netconfig import is_local_address
from homagg.udpio import route_source

log = logging.getLogger("homagg.serve")

#: Each waiting Join holds a server thread until its job completes; at most ``max_joins`` do
#: (the service refuses more), and these threads beyond them stay for renewals, leaves and
#: refusals, so no number of waiting joins can keep a renewal from being answered.
RESERVED_THREADS = 64


class _Servicer(rpc.MembershipServicer):
    def __init__(self, svc: JobService):
        self.svc = svc

    def _refuse(self, context, e: Refusal):
        with self.svc._cond:
            self.svc.refusals[e.code] = self.svc.refusals.get(e.code, 0) + 1
        log.info("refused (%s): %s", e.code, e)
        context.set_trailing_metadata(((REFUSAL_KEY, e.code),))
        context.abort(getattr(grpc.StatusCode, e.code), str(e))

    def _answer(self, context, call):
        """``call()``'s reply; a Refusal as its status, and anything else as INTERNAL with a
        message (never gRPC's bare UNKNOWN)."""
        try:
            return call()
        except Refusal as e:
            self._refuse(context, e)
        except Exception as e:
            log.exception("a request failed")
            self._refuse(context, Refusal("INTERNAL", f"the service failed on this request: "
                                                      f"{type(e).__name__}: {e}"))

    def Join(self, request, context):
        def call():
            self.svc.check_token(request.token)
            ip = self.svc.address_of(context.peer(), request.ip)
            wait = request.wait_seconds
            remaining = context.time_remaining()
            if remaining is not None and not math.isnan(wait):  # before the caller's deadline
                wait = min(wait or self.svc.opts.wait, max(remaining - 1.0, 0.1))
            a = self.svc.join(request.job, request.rank, request.world_size, ip,
                              request.udp_port, request.slots, wait, context.is_active,
                              request.join_secret)
            return pb2.JoinReply(send_to_ip=a.send_to[0], send_to_port=a.send_to[1],
                                 job_id=a.job_id, worker=a.worker, workers=a.workers,
                                 slots=a.slots, place=a.place, place_role=a.role, run=a.run,
                                 lease_seconds=a.lease, ip=a.ip, secret=a.secret, key=a.key,
                                 leaf_worker=a.leaf_worker, leaf_workers=a.leaf_workers,
                                 siblings=a.siblings)
        return self._answer(context, call)

    def Renew(self, request, context):
        received = self.svc._clock()  # the lease counts from here, however long the rest takes

        def call():
            self.svc.check_token(request.token)
            ip = self.svc.address_of(context.peer(), request.ip)
            lease = self.svc.renew(request.job_id, request.worker, ip, request.udp_port,
                                   request.secret, received)
            return pb2.RenewReply(lease_seconds=lease)
        return self._answer(context, call)

    def Leave(self, request, context):
        def call():
            self.svc.check_token(request.token)
            ip = self.svc.address_of(context.peer(), request.ip)
            removed = self.svc.leave(request.job_id, request.worker, ip, request.udp_port,
                                     request.secret)
            return pb2.LeaveReply(removed=removed)
        return self._answer(context, call)


#: The most characters one value (an argument, an exception's repr) adds to a log line, and
#: the most a whole line has, each after escaping: a client's bytes (a 4 MB malformed request,
#: each byte escaped to four characters) cannot fill the log's disk.
VALUE_LIMIT = 240
LINE_LIMIT = 1000
#: The most characters of a traceback (the service's own failures, which are bugs) logged.
TRACEBACK_LIMIT = 8000


def one_line(text: str) -> str:
    """``text`` with every character that is not printable (a newline, a carriage return, an
    escape sequence) written as its Python escape: a client's string cannot start a log line
    of its own, or rewrite the terminal's."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def capped(text: str, limit: int = VALUE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, with a marker that gives its whole length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[cut: {len(text)} characters in all]"


def _capped_arg(value: Any) -> Any:
    """A log record's argument with its text capped (numbers stay numbers, for ``%d``;
    the line's escaping comes after, on the whole message)."""
    if isinstance(value, (int, float)) or value is None:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value[:VALUE_LIMIT + 1])  # (its repr, 4 characters a byte, is cut below)
    text = value if isinstance(value, str) else str(value)
    return capped(text) if len(text) > VALUE_LIMIT else value


class _OneLine(logging.Filter):
    """Every record one line, and bounded: what a client sent (a job name, a claimed address)
    escaped where it is not printable and cut to ``VALUE_LIMIT`` characters a value, the line
    to ``LINE_LIMIT``; gRPC's report of a malformed request (a traceback of about 1 KB a
    request, an easy way to fill a disk) cut to its first line and the error's capped repr;
    any other traceback cut to ``TRACEBACK_LIMIT``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_capped_arg(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _capped_arg(v) for k, v in record.args.items()}
        try:
            text = capped(one_line(record.getMessage()), LINE_LIMIT)
        except Exception as e:  # (a bad format string: said, not raised at the handler)
            text = capped(one_line(f"{record.msg!r} (log formatting failed: {e!r})"),
                          LINE_LIMIT)
        if record.exc_info and "deserializ" in text:
            text = f"{text} ({capped(one_line(repr(record.exc_info[1])))})"
            record.exc_info = None
            record.exc_text = None
        elif record.exc_info:
            record.exc_text = capped(logging.Formatter().formatException(record.exc_info),
                                     TRACEBACK_LIMIT)
            record.exc_info = None
        record.msg, record.args = text, ()
        return True


#: Seconds a probe waits for a switch's P4Runtime port to accept a connection.
PROBE_CONNECT = 0.5

#: The loggers a request's strings reach: the service's, and gRPC's (malformed requests).
ONE_LINE_LOGGERS = ("homagg.serve", "homagg.service", "grpc._server", "grpc._common")


def one_line_logs() -> None:
    """Every record bounded and one line: those of ``ONE_LINE_LOGGERS`` (wherever they go),
    and every record the root logger's handlers write (whatever logger it comes from)."""
    for where in [logging.getLogger(n) for n in ONE_LINE_LOGGERS] + \
            list(logging.getLogger().handlers):
        if not any(isinstance(f, _OneLine) for f in where.filters):
            where.addFilter(_OneLine())


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


def key_from(path: Path | None) -> bytes | None:
    """The job secrets' key from ``--key-file`` (made, readable by its owner only, if it does
    not exist yet); None without one."""
    if path is None:
        return None
    try:
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
            log.info("made the job secrets' key %s", path)
        key = path.read_text().strip().encode()
    except OSError as e:
        raise ConfigError(f"--key-file {path}: {e.strerror}") from None
    if len(key) < 16:
        raise ConfigError(f"--key-file {path}: the key needs at least 16 characters")
    return key


def _tls_credentials(tls: tuple[Path, Path]):
    """The server credentials, with a key that does not match its certificate (or files that
    are not PEM) said as such, not as a failure to bind."""
    import ssl
    import tempfile

    cert_path, key_path = tls
    try:
        cert, key = cert_path.read_bytes(), key_path.read_bytes()
    except OSError as e:
        raise ConfigError(f"TLS: {e.filename}: {e.strerror}") from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as d:  # load_cert_chain reads files
        (Path(d) / "c.pem").write_bytes(cert)
        (Path(d) / "k.pem").write_bytes(key)
        try:
            ctx.load_cert_chain(Path(d) / "c.pem", Path(d) / "k.pem")
        except ssl.SSLError as e:
            why = "the key does not match the certificate" if "KEY_VALUES_MISMATCH" in str(e) \
                else f"not a PEM certificate and its key ({e.reason or e})"
            raise ConfigError(f"TLS: --tls-cert {cert_path} / --tls-key {key_path}: "
                              f"{why}") from None
    return grpc.ssl_server_credentials([(key, cert)])


def _advertised(host: str, port: int, svc: JobService) -> tuple[str, int] | None:
    """The IPv4 address a second service would reach this one at (the holder mark)."""
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host) if host not in ("", "localhost") else \
            ipaddress.ip_address("127.0.0.1")
    except ValueError:  # a host name
        return None
    if ip.is_unspecified:  # every address: the one on the route to the switch
        sw_host, _, sw_port = svc.cfg.switch.grpc.rpartition(":")
        try:
            return route_source((sw_host.strip("[]") or "127.0.0.1", int(sw_port))), port
        except (OSError, ValueError):
            return "127.0.0.1", port
    return (str(ip), port) if ip.version == 4 else None


def start(svc: JobService, listen: str, tls: tuple[Path, Path] | None = None,
          metrics_port: int | None = None, metrics_addr: str | None = None) -> Server:
    """Take the switch and read back this service's jobs from it, then serve. Metrics listen
    on ``metrics_addr``, by default the address the service listens on."""
    creds = _tls_credentials(tls) if tls is not None else None
    if svc.answers is None:  # a switch that refuses connections is down: its jobs fail
        svc.answers = lambda place: reachable(place.grpc, PROBE_CONNECT)
    one_line_logs()
    pool = futures.ThreadPoolExecutor(svc.opts.max_joins + RESERVED_THREADS, "homagg-serve")
    server = grpc.server(pool, options=[("grpc.so_reuseport", 0)])
    rpc.add_MembershipServicer_to_server(_Servicer(svc), server)
    try:
        if creds is not None:
            port = server.add_secure_port(listen, creds)
        else:
            port = server.add_insecure_port(listen)
    except (RuntimeError, OSError) as e:
        raise ConfigError(f"cannot serve at {listen}: {e}") from None
    if not port:
        raise ConfigError(f"cannot serve at {listen} (in use, or not an address of this host)")
    host = listen.rpartition(':')[0]
    try:
        svc.recover(_advertised(host, port, svc))
    except BaseException:
        server.stop(0)
        raise
    svc.start()
    server.start()
    out = Server(svc, server, f"{host}:{port}")
    if creds is None and not is_local_address(listen):
        log.warning("serving at %s without TLS: the token and the jobs' secrets cross the "
                    "network in clear (--tls-cert/--tls-key, or a private network)", listen)
    if metrics_port is not None:
        from homagg.controller.metrics import serve_metrics

        out.metrics = serve_metrics(svc, metrics_port,
                                    metrics_addr or host.strip("[]") or "0.0.0.0")
        out.metrics_port = out.metrics.server_port
    return out


def run(a, cfg, connect) -> int:
    """The CLI's ``serve``: until SIGTERM or Ctrl-C."""
    if bool(a.tls_cert) != bool(a.tls_key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    opts = ServeOptions(token=token_from(a.token_file, a.no_token), lease=a.lease,
                        slots=a.slots, wait=a.join_wait,  # (both checked by ServeOptions)
                        trust_claimed_address=a.trust_worker_address, max_joins=a.max_joins,
                        key=key_from(a.key_file), metrics_job_names=a.metrics_job_names)
    if a.metrics_port is not None and not 0 <= a.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port {a.metrics_port}: 0 to 65535")
    svc = JobService(cfg, connect, opts)
    srv = start(svc, a.listen, (a.tls_cert, a.tls_key) if a.tls_cert else None, a.metrics_port,
                a.metrics_addr)
    print(f"serving joins at {srv.address}" + (" (TLS)" if a.tls_cert else "")
          + ("" if opts.token else " without a token"), flush=True)
    if srv.metrics_port is not None:
        maddr = srv.metrics.server_address[0]
        print(f"metrics at http://{maddr}:{srv.metrics_port}/metrics", flush=True)
    print(f"switch {cfg.switch.name} ({cfg.switch.target}, {cfg.switch.grpc})"
          + (f" and the {len(cfg.switches)} switches of its tree" if cfg.switches else "") + "; "
          f"{len(svc.held)} job(s) read back", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        done.wait()
    except KeyboardInterrupt:
        pass
    srv.stop()
    return 0
