"""homagg-softswitch: the software aggregator's command line.

    homagg-softswitch [--config net.toml] [--bind 10.0.0.254] [--grpc 127.0.0.1:9559]
                      [--words K] [--stats-file stats.json] [--port P] [--single-port]
                      [--shards N]

It serves homagg's whole UDP port range (0xBEE0-0xBEEF), as bmv2's parser does, and answers
from the port each request came to; a tree's child job sends its partial sums up from its
uplink's src_port. It serves P4Runtime too, so homagg-ctl drives it as it drives bmv2.

Jobs come from the controller (``homagg-ctl -c net.toml install`` / ``job add``), or from the
config's [[jobs]] at start, written by the controller's own job logic in process. SIGHUP resets
every job (new epoch, zeroed job counters), as ``homagg-ctl reset`` does.

With ``--shards N`` it aggregates on N cores: N processes, each serving the jobs the kernel
steers to it (``homagg.targets.soft.shards``); this process keeps the tables and P4Runtime.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from homagg import wire
from homagg.errors import HomaggError
from homagg.netconfig import is_local_address
from homagg.targets.soft.server import (
    ENGINES,
    SoftSwitchError,
    SoftSwitchServer,
    choose_engine,
    ports_text,
)
from homagg.targets.soft.tables import SoftSwitch

log = logging.getLogger("homagg.softswitch")

DEFAULT_GRPC = "127.0.0.1:9559"  # netconfig.SwitchSpec's default: where homagg-ctl looks


def _p4runtime(a, cfg, sw: SoftSwitch):
    """The P4Runtime server a's options ask for, started; None if --grpc none. A default
    address that cannot be served is a warning (the UDP aggregator runs on); an explicit one
    is an error."""
    addr = a.grpc or (cfg.switch.grpc if cfg else DEFAULT_GRPC)
    if addr.lower() == "none":
        return None
    device = a.device_id if a.device_id is not None else (cfg.switch.device_id if cfg else 1)
    tls_on = bool(a.grpc_tls_cert or a.grpc_tls_key or a.grpc_tls_client_ca)
    if tls_on and a.grpc_tls_client_ca is None and not a.grpc_tls_any_client:
        raise HomaggError("P4Runtime over TLS without --grpc-tls-client-ca takes any client as "
                          "primary (it may remove jobs and read their keys): give the "
                          "controllers' CA, or --grpc-tls-any-client to serve so knowingly")
    if tls_on and a.grpc_tls_client_ca is None:
        log.warning("P4Runtime at %s over TLS WITHOUT client certificates "
                    "(--grpc-tls-any-client): any client that reaches it can take the switch "
                    "as primary, remove jobs and read their keys", addr)
    elif not tls_on and not is_local_address(addr):
        log.warning("P4Runtime at %s in clear, WITHOUT client certificates: anyone who reaches "
                    "it can take the switch as primary, remove jobs and read their keys "
                    "(--grpc-tls-cert/--grpc-tls-key/--grpc-tls-client-ca, or a loopback or "
                    "unix: address)", addr)
    try:
        from homagg.targets.p4runtime_server import P4RuntimeServer

        tls = None
        if a.grpc_tls_cert or a.grpc_tls_key or a.grpc_tls_client_ca:
            if not (a.grpc_tls_cert and a.grpc_tls_key):
                raise HomaggError("P4Runtime TLS needs both --grpc-tls-cert and --grpc-tls-key")
            tls = (a.grpc_tls_cert, a.grpc_tls_key, a.grpc_tls_client_ca)
        return P4RuntimeServer(sw, addr, device, tls=tls).start()
    except (ImportError, HomaggError) as e:
        if isinstance(e, ImportError):
            e = HomaggError(f"grpcio or p4runtime missing ({e}); pip install 'homagg[controller]'")
        if a.grpc:
            raise e from None
        log.warning("P4Runtime not served: %s (--grpc HOST:PORT to choose, --grpc none to "
                    "silence)", e)
        return None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="homagg-softswitch",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", "-c", type=Path,
                    help="TOML: the switch's addresses, and jobs to install at start")
    ap.add_argument("--bind", help="address for homagg packets (default: the config's switch "
                                   "ip, else 0.0.0.0)")
    ap.add_argument("--port", type=int, default=wire.HOMAGG_UDP_PORT_MIN,
                    help="the aggregator's port (default %(default)s). In homagg's range "
                         f"({wire.HOMAGG_UDP_PORT_MIN}-{wire.HOMAGG_UDP_PORT_MAX}), the whole "
                         "range is served, as bmv2 does: a tree's child jobs send up from "
                         "ports of their own")
    ap.add_argument("--single-port", action="store_true",
                    help="serve --port alone (another aggregator may take the rest of the "
                         "range on this address; a child job's uplink src_port must be --port)")
    ap.add_argument("--shards", type=int, default=1, metavar="N",
                    help="aggregate on N cores: N processes, jobs spread over them, each "
                         "job's datagrams steered to its process by the kernel (default "
                         "%(default)s: this process alone)")
    ap.add_argument("--engine", choices=ENGINES, default="auto",
                    help="the datagram loop: 'native' (C, homagg/native), 'python' (the "
                         "reference), 'auto' (default: native where it is built)")
    ap.add_argument("--grpc", metavar="HOST:PORT",
                    help="serve P4Runtime here (default: the config's [switch] grpc, else "
                         f"{DEFAULT_GRPC}); 'none': do not")
    ap.add_argument("--grpc-tls-cert", type=Path, metavar="PEM",
                    help="serve P4Runtime over TLS with this certificate (and --grpc-tls-key)")
    ap.add_argument("--grpc-tls-key", type=Path, metavar="PEM", help="its private key")
    ap.add_argument("--grpc-tls-client-ca", type=Path, metavar="PEM",
                    help="mutual TLS: only controllers with a certificate this CA signed "
                         "(required with TLS, unless --grpc-tls-any-client)")
    ap.add_argument("--grpc-tls-any-client", action="store_true",
                    help="TLS without client certificates: any client that reaches P4Runtime "
                         "may take the switch as primary (said in a warning)")
    ap.add_argument("--device-id", type=int,
                    help="P4Runtime device id (default: the config's, else 1)")
    ap.add_argument("--words", type=int, default=wire.WORDS_PER_PACKET, metavar="K",
                    help=f"words per packet (default {wire.WORDS_PER_PACKET}, as the P4 "
                         "program's default build; agents learn it from the join); up to "
                         f"{wire.mtu_words()} at the default MTU, {wire.MAX_WORDS_PER_PACKET} "
                         f"with --mtu {wire.JUMBO_MTU}")
    ap.add_argument("--mtu", type=int, default=wire.DEFAULT_MTU,
                    help="the MTU of the network it serves (default %(default)s; "
                         f"{wire.JUMBO_MTU}: jumbo frames): --words must fit it")
    ap.add_argument("--stats-file", type=Path, help="write counters as JSON here every 0.2 s")
    ap.add_argument("--ready-file", type=Path,
                    help="once serving, write here as JSON the addresses served ({\"udp\": "
                         "[HOST, PORT], \"grpc\": \"HOST:PORT\" or null}): with --port 0 or "
                         "--grpc HOST:0, the ports the kernel gave")
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap


def main(argv=None) -> int:
    from homagg.controller import jobs
    from homagg.controller.local import LocalSwitch
    from homagg.netconfig import load

    a = parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load(a.config) if a.config else None
        words = wire.check_words(a.words, a.mtu)
        if a.shards == 1:
            sw = SoftSwitch(words=words)
        else:
            from homagg.targets.soft.shards import ShardedSwitch

            sw = ShardedSwitch(words=words, shards=a.shards)
        local = LocalSwitch(sw, "softswitch")
        for j in cfg.jobs if cfg else ():
            job = jobs.add_job(local, j, pool=sw.slots)
            log.info("job %d: %d workers, slots %d-%d", j.id, job.workers, job.base,
                     job.base + job.size - 1)
        server = SoftSwitchServer(sw, (a.bind or (cfg.switch.ip if cfg else "0.0.0.0"), a.port),
                                  ports=() if a.single_port else None, engine=a.engine)
        for j in cfg.jobs if cfg else ():
            if j.uplink is not None and j.uplink.src_port not in server.socks:
                server.stop()
                raise SoftSwitchError(
                    f"job {j.id}: its uplink's src_port {j.uplink.src_port} is not served here "
                    f"(ports {ports_text(server.ports)}): its partial sums must leave from it")
        p4rt = _p4runtime(a, cfg, sw)
    except (HomaggError, OSError, RuntimeError) as e:
        print(f"homagg-softswitch: error: {e}", file=sys.stderr)
        return 1

    def reset_all():
        for job in jobs.list_jobs(local):
            log.info("job %d reset: epoch %d", job.id, jobs.reset_job(local, job.id).epoch)

    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    # The operator's "reset": every job starts afresh. In a thread of its own: the handler
    # runs in the main thread, which may hold the switch's lock (the stats file) when it fires.
    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=reset_all).start())
    engine = choose_engine(a.engine, server.faults) if server.shards > 1 else server.engine
    log.info("software aggregator listening on %s:%d (ports %s)%s, %s engine", *server.address,
             ports_text(server.ports), f", {a.shards} shards" if a.shards > 1 else "", engine)
    if p4rt is not None:
        log.info("P4Runtime on %s (device id %d)", p4rt.address, p4rt.device_id)
    try:
        server.start()
    except HomaggError as e:
        server.stop()
        if p4rt is not None:
            p4rt.stop()
        print(f"homagg-softswitch: error: {e}", file=sys.stderr)
        return 1
    if a.ready_file:
        _write_json(a.ready_file, {"udp": list(server.address),
                                   "grpc": p4rt.address if p4rt is not None else None})
    try:
        while server.running(wait=0.2):
            if a.stats_file:
                _write_stats(a.stats_file, sw, server)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if p4rt is not None:
            p4rt.stop()
        if a.stats_file:
            _write_stats(a.stats_file, sw, server)
    return 0


def _write_stats(path: Path, sw: SoftSwitch, server: SoftSwitchServer) -> None:
    """The counters as JSON (``_write_json``), for the launcher or a test polling the file.
    ``io``: the sockets' system calls and datagrams."""
    _write_json(path, {**sw.read_stats(), "io": server.io_counts()})


def _write_json(path: Path, value) -> None:
    """``value`` as JSON, replaced in one rename: a reader polling the file never sees it
    half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)

