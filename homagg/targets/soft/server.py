"""The software aggregator on UDP sockets: ``SoftSwitchServer`` feeds a ``SoftSwitch`` the
datagrams of homagg's port range and sends its replies, in runs (GSO/GRO, ``homagg.udpio``).

It serves homagg's whole UDP port range (0xBEE0-0xBEEF), as bmv2's parser does, and answers
from the port each request came to; a tree's child job sends its partial sums up from its
uplink's src_port.
"""

from __future__ import annotations

import dataclasses
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from homagg import udpio, wire
from homagg.errors import HomaggError
from homagg.faults import FaultSpec, ImpairedSocket
from homagg.targets.soft.tables import SoftSwitch

if TYPE_CHECKING:
    from homagg.targets.soft.native import NativeLoop

log = logging.getLogger("homagg.softswitch")


class SoftSwitchServer:
    """A SoftSwitch on UDP sockets, in a thread (tests) or in the foreground (CLI).

    Like bmv2, it takes homagg packets on every port of homagg's range (0xBEE0-0xBEEF), one
    socket per port, when ``bind``'s port is one of them; else (port 0 in tests: any free
    port) on that port alone. ``ports``: the ports to serve besides ``bind``'s, in place of
    that rule (``()``: ``bind``'s alone). ``address`` is the ``bind`` socket's.

    A reply leaves from the port its request came to (bmv2's from_switch: source port = the
    request's destination port), and a tree's child job sends its partial sums up from its
    uplink's ``src_port``: the parent knows this switch, as a worker of the parent's job, by
    (address, source port), so each child job under one parent has a port of its own (several
    jobs in one tree)."""

    def __init__(self, switch: SoftSwitch | None = None, bind: tuple[str, int] = ("0.0.0.0",
                 wire.HOMAGG_UDP_PORT_MIN), faults: FaultSpec | None = None,
                 ports: Iterable[int] | None = None, engine: str = "auto"):
        self.switch = switch or SoftSwitch()
        #: a ``ShardedSwitch``'s processes (``shards``): each binds every port (SO_REUSEPORT)
        self.shards = int(getattr(self.switch, "shards", 1))
        ip, main = bind
        if ports is None:  # the other ports to serve
            ports = wire.HOMAGG_UDP_PORTS if main in wire.HOMAGG_UDP_PORTS else ()
        # the bind port first: a port 0 bind learns its port there
        wanted = [main] + [p for p in dict.fromkeys(ports) if p != main]
        raws: dict[int, list[socket.socket]] = {}
        try:
            for port in wanted:
                first = self._socket(ip, port, wanted, self.shards)
                port = first.getsockname()[1]  # (port 0: the one the kernel chose)
                raws[port] = [first]
                for _ in range(1, self.shards):
                    raws[port].append(self._socket(ip, port, wanted, self.shards, False))
        except BaseException:
            for group in raws.values():
                for raw in group:
                    raw.close()
            raise
        self.faults = faults
        #: shard k's sockets, one per port (in the kernel's reuseport group, k-th of each)
        self.shard_socks = [{port: group[k] for port, group in raws.items()}
                            for k in range(self.shards)] if self.shards > 1 else []
        self._adopt({port: group[0] for port, group in raws.items()},
                    faults if self.shards == 1 else None, engine)
        self.requested_engine = engine
        self._procs: list = []

    def _adopt(self, raws: dict[int, socket.socket], faults: FaultSpec | None,
               engine: str = "auto") -> None:
        """Serve ``raws`` (port -> bound socket, the bind port's first)."""
        #: "native" (homagg.targets.soft.native: the datagram loop in C) or "python"; a
        #: sharded server's main process serves nothing itself ("shards"): its shards run
        #: the engine asked for
        self.engine = choose_engine(engine, faults) if self.shards == 1 else "shards"
        self.native: NativeLoop | None = None
        self._native_counts: dict[str, int] = {}
        self.socks: dict[int, udpio.BatchSocket | ImpairedSocket] = {}
        for k, (port, raw) in enumerate(raws.items()):
            # Non-blocking: serve() waits on all the ports at once (epoll), then drains each.
            raw.setblocking(False)
            # Runs of datagrams per system call both ways (udpio: GSO and GRO): a worker's
            # burst comes up in one receive, and the results of a run go to each worker in
            # one send.
            batch = udpio.BatchSocket(raw)
            self.socks[port] = batch
            if k == 0:
                self.address = raw.getsockname()
            if faults is not None and faults.active:  # tests: loss, dup, reorder here
                # each port its own draw; the bind port's is ``faults`` itself
                self.socks[port] = ImpairedSocket(
                    batch, dataclasses.replace(faults, seed=faults.seed + k) if k else faults)
        self.sock = next(iter(self.socks.values()))  # the bind port's
        self.ports = sorted(self.socks)
        self._unserved: set[int] = set()  # uplink src_ports warned about (not served here)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def on_sockets(cls, switch: SoftSwitch, raws: dict[int, socket.socket],
                   faults: FaultSpec | None = None, engine: str = "auto") -> SoftSwitchServer:
        """A server of sockets bound elsewhere (a shard's, ``shards``)."""
        self = cls.__new__(cls)
        self.switch, self.shards, self.shard_socks, self._procs = switch, 1, [], []
        self.faults, self.requested_engine = faults, engine
        self._adopt(raws, faults, engine)
        return self

    @staticmethod
    def _socket(ip: str, port: int, wanted: list[int], shards: int = 1,
                first: bool = True) -> socket.socket:
        """A UDP socket bound to (ip, port); with shards > 1, in the port's reuseport group
        (``first``: the group's first, only if no other socket holds the port)."""
        raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            if shards > 1:
                if first:
                    # SO_REUSEPORT would share a port another process (of this user) holds
                    # the same way: a plain bind first says whether the port is free
                    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                        probe.bind((ip, port))
                        port = probe.getsockname()[1]
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            raw.bind((ip, port))
        except OSError as e:
            raw.close()
            more = (f" (the software aggregator serves ports {ports_text(sorted(wanted))} "
                    "of this address, as bmv2 takes homagg's whole range; in use by another "
                    "process? --single-port serves --port alone)" if len(wanted) > 1 else "")
            raise SoftSwitchError(f"cannot bind UDP {ip}:{port}: {e.strerror}{more}") from None
        return raw

    def io_counts(self) -> dict[str, int]:
        """The system calls and datagrams of every port's socket, summed (udpio.io_counts);
        a sharded server's, over its shards."""
        if self.shards > 1:
            return self.switch.io_counts()  # type: ignore[attr-defined]
        total: dict[str, int] = {}
        for sock in self.socks.values():
            for name, n in udpio.io_counts(sock).items():
                total[name] = total.get(name, 0) + n
        native = self.native
        for name, n in (native.io_counts() if native is not None
                        else self._native_counts).items():
            if name in total:
                total[name] += n
        return total

    def serve(self, control: tuple[int, Callable[[], None]] | None = None) -> None:
        """Serve until stopped. ``control``: (a file descriptor, what to call when it is
        readable), waited on with the ports (a shard's pipe from the main process)."""
        if self.shards > 1:
            return self._watch_shards()
        if self.engine == "native":
            return self._serve_native(control)
        socks, sw = self.socks, self.switch
        buf = bytearray(udpio.RECV_BYTES)
        poller = select.epoll()
        by_fd = {}
        for port, sock in socks.items():
            poller.register(sock.fileno(), select.EPOLLIN)
            by_fd[sock.fileno()] = (port, sock)
        if control is not None:
            poller.register(control[0], select.EPOLLIN)
        try:
            while not self._stop.is_set():
                try:
                    ready = poller.poll(0.2)
                except InterruptedError:
                    continue
                for fd, _ in ready:
                    if control is not None and fd == control[0]:
                        control[1]()
                        continue
                    port, sock = by_fd[fd]
                    # Drain the port (a bounded number of runs, so no port starves the
                    # others): one wait per burst, not one per run.
                    for _ in range(_DRAIN_RUNS):
                        try:
                            nb, seg, src = sock.recv_many(buf)
                        except BlockingIOError:
                            break
                        except OSError as e:
                            if self._stop.is_set():
                                return
                            log.debug("receive on port %d failed: %s", port, e)
                            break
                        self._answer(sock, port, sw.handle_run(memoryview(buf)[:nb], seg, src))
        finally:
            poller.close()

    def _serve_native(self, control: tuple[int, Callable[[], None]] | None) -> None:
        """``serve`` with the native engine: the C loop serves the ports; the packets it hands
        back are the model's to decide, here (``soft.native``)."""
        from homagg.targets.soft.native import CONTROL, SLOW, NativeLoop

        ports = list(self.socks)
        loop = NativeLoop(self.switch, [self.socks[p].fileno() for p in ports], ports,
                          None if control is None else control[0])
        self.native = loop
        sw = self.switch
        try:
            while not self._stop.is_set():
                try:
                    r = loop.serve(200)
                except OSError as e:
                    if self._stop.is_set():
                        return
                    raise SoftSwitchError(str(e)) from None
                if r == SLOW:
                    data, src, at = loop.slow()
                    out: dict[tuple[str, int], list[bytes]] = {}
                    for d, a in sw.handle(data, src):
                        out.setdefault(a, []).append(d)
                    port = ports[at]
                    self._answer(self.socks[port], port, out)
                elif r == CONTROL and control is not None:
                    control[1]()
        finally:
            self._native_counts = loop.io_counts()
            self.native = None
            loop.close()

    def _answer(self, sock, port: int, replies: dict[tuple[str, int], list[bytes]]) -> None:
        """Send the replies to a request that came to ``port`` (on ``sock``)."""
        up = self.switch.uplink_ports
        for a, out in replies.items():
            ups = up.get(a) if up else None
            if ups is None:
                self._send(sock, out, a)
            else:
                self._send_up(sock, port, ups, out, a)

    def _send_up(self, sock, port: int, ups: dict[int, int], out: list[bytes], a) -> None:
        """Datagrams to a parent switch (``a``): each leaves from the src_port of the uplink of
        the job it carries (``ups``: parent job -> src_port), where the parent knows this
        switch as that job's worker; anything else to it from the port its request came to."""
        by_port: dict[int, list[bytes]] = {}
        for d in out:
            p = ups.get(int.from_bytes(d[_JOB_AT:_JOB_AT + 2], "big"), port)
            by_port.setdefault(p, []).append(d)
        for p, ds in by_port.items():
            s = self.socks.get(p)
            if s is None:
                if p not in self._unserved:
                    self._unserved.add(p)
                    log.warning("an uplink's src_port %d is not served here (ports %s): its "
                                "partials leave from port %d, where the parent does not know "
                                "them", p, ports_text(self.ports), port)
                s = sock
            self._send(s, ds, a)

    @staticmethod
    def _send(sock, out: list[bytes], a) -> None:
        """``out`` to ``a``: one run per system call where the datagrams are of one size. The
        socket does not block: a full send buffer is waited on for up to _SEND_WAIT seconds
        (a blocking socket's patience), then the rest is dropped (the workers' timeouts
        recover it)."""
        if len(out) > 1 and len({len(d) for d in out}) == 1:
            runs = [(b"".join(out), len(out[0]), len(out))]
        else:
            runs = [(d, len(d), 1) for d in out]
        for data, size, n in runs:
            sent, deadline = 0, 0.0
            while True:
                try:
                    if n == 1:
                        sock.sendto(data, a)
                        sent = 1
                    else:
                        sent += sock.send_many(memoryview(data)[sent * size:], size, a)
                except BlockingIOError:
                    pass
                except OSError as e:  # a worker gone: the others still get theirs
                    log.debug("send to %s failed: %s", a, e)
                    break
                if sent >= n:
                    break
                now = time.monotonic()
                deadline = deadline or now + _SEND_WAIT
                if now >= deadline:
                    log.debug("send buffer full for %.1f s: %d datagrams to %s dropped",
                              _SEND_WAIT, n - sent, a)
                    break
                select.select([], [sock], [], deadline - now)

    def _watch_shards(self) -> None:
        """A sharded server's thread: the shards serve; this one ends when one of them
        does (or on stop)."""
        while not self._stop.wait(0.2):
            dead = [k for k, p in enumerate(self._procs) if not p.is_alive()]
            if dead:
                log.error("software aggregator shard %d ended (exit status %s): stopping",
                          dead[0], self._procs[dead[0]].exitcode)
                return

    def start(self) -> SoftSwitchServer:
        if self.shards > 1:  # a ShardedSwitch (``shards``, which builds on this module)
            self._procs = self.switch.start_processes(  # type: ignore[attr-defined]
                self.shard_socks, self.faults, self.requested_engine)
        self._thread = threading.Thread(target=self.serve, name="softswitch", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """Ask the serving thread to end, without waiting (safe in a signal handler)."""
        self._stop.set()

    def running(self, wait: float = 0.0) -> bool:
        """Whether the serving thread still runs, after waiting up to ``wait`` seconds for it
        to end."""
        if self._thread is None:
            return False
        self._thread.join(wait)
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(2)
        if self._procs:
            self.switch.stop_processes(self._procs)  # type: ignore[attr-defined]
            self._procs = []
        for sock in self.socks.values():
            sock.close()
        for socks in self.shard_socks:
            for raw in socks.values():
                raw.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class SoftSwitchError(HomaggError):
    """The software aggregator cannot run as asked (a port it cannot bind)."""


#: the engines a server runs: "auto" is native where built, Python with faults or without it
ENGINES = ("auto", "native", "python")


def choose_engine(engine: str, faults: FaultSpec | None = None) -> str:
    """The engine a server runs for ``engine`` (ENGINES): "native" or "python". The native
    loop has no fault injection: with faults, "auto" is Python and "native" is refused."""
    from homagg.targets.soft import native

    if engine not in ENGINES:
        raise SoftSwitchError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
    impaired = faults is not None and faults.active
    if engine == "python" or (engine == "auto" and impaired):
        return "python"
    if not native.available():
        if engine == "native":
            raise SoftSwitchError("the native engine was asked for, but the native data path "
                                  f"is off: {native.why()}")
        return "python"
    if impaired:
        raise SoftSwitchError("the native engine injects no faults: run the Python engine "
                              "(--engine python) to impair the aggregator's sockets")
    return "native"


#: Runs received from one port before the others get their turn.
_DRAIN_RUNS = 16
#: How long a send waits for room in a full socket buffer (s).
_SEND_WAIT = 0.2
_JOB_AT = wire.OFFSETS["job"]


def ports_text(ports: list[int]) -> str:
    if len(ports) > 1 and ports == list(range(ports[0], ports[-1] + 1)):
        return f"{ports[0]}-{ports[-1]}"
    return ", ".join(map(str, ports))
