"""The operator's TOML file: one switch, its hosts, and the jobs to install.

    [switch]
    name = "s1"
    target = "bmv2"                # or "soft": the software aggregator (homagg-softswitch)
    grpc = "127.0.0.1:9559"        # P4Runtime address
    device_id = 1
    thrift_port = 9090             # bmv2 Thrift CLI (optional: register resets; bmv2 only)
    ip = "10.0.0.254"              # the address workers send to
    mac = "00:00:0a:00:00:fe"
    slots = 256                    # optional: the slots homagg may use here (default: all the
                                   # switch has, as its P4Info says); jobs past it fall back

    [fallback]                     # optional: a software aggregator (homagg-softswitch) for
    name = "fb"                    # jobs that do not fit on the switch, or that ask for it
    ip = "10.0.0.253"              # the address its workers send to instead
    mac = "00:00:0a:00:00:fd"
    grpc = "unix:/run/homagg-fb.sock"   # its P4Runtime address (HOST:PORT or unix:PATH)
    device_id = 1
    port = 5                       # the switch port it is cabled to (the switch routes to it)

    [[hosts]]                      # routed and ARP-proxied by the switch
    name = "h1"
    ip = "10.0.0.1"
    mac = "00:00:0a:00:00:01"
    port = 1                       # the switch port it is cabled to

    [[jobs]]
    id = 1
    slots = 64                     # slot region size (the agents' window)
    workers = [ { host = "h1", udp_port = 50000 }, { host = "h2", udp_port = 50000 } ]
    place = "auto"                 # auto (the switch, else the fallback), switch or fallback
    key = 0x5f3a9c21               # required, 1 to 2**32 - 1: every packet of its workers
                                   # carries it (their HOMAGG_JOB_KEY); others are dropped
    # a tree's child job (optional): its parent job, this switch's worker id there, the
    # parent's address, and the port its partial sums leave from (one per child job under a
    # parent: the parent knows this switch's job by its address and that port)
    uplink = { job = 1, worker = 0, ip = "10.0.0.254", udp_port = 48864, src_port = 48864,
               key = 0x1d2e3f40 }       # the parent job's key

A tree of switches below ``[switch]`` (``[[switches]]``, for the controller service) is
``homagg.treeconfig``'s. Every problem is a ConfigError with one line naming the key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import secrets
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from homagg import wire
from homagg.configfields import GrpcTls, _int, _ip, _mac, _tls
from homagg.errors import ConfigError
from homagg.treeconfig import TreeSwitch, networks, parse_switches, render_switches

#: What runs the switch: bmv2 (``homagg-ctl install`` compiles and pushes the P4 program) or
#: the software aggregator (it runs homagg's pipeline natively: install needs no p4c).
TARGETS = ("bmv2", "soft", "tofino")
#: Where a job may be placed: ``auto`` is the switch while its slots last, then the fallback.
PLACES = ("auto", "switch", "fallback")




@dataclass(frozen=True)
class Host:
    name: str
    ip: str
    mac: str
    port: int


@dataclass(frozen=True)
class Worker:
    ip: str
    udp_port: int
    mac: str
    switch_port: int
    host: str = ""


@dataclass(frozen=True)
class Uplink:
    """A tree's child job (p4/include/control/uplink.p4): this switch is worker ``worker`` of
    job ``job`` at the parent switch, whose homagg address is ``ip``:``udp_port`` (``mac``),
    through this switch's port ``switch_port``. Partial sums leave from ``src_port``, the port
    this switch's workers send to, where the parent's answers come back."""

    job: int
    worker: int
    ip: str
    udp_port: int = wire.HOMAGG_UDP_PORT_MIN
    mac: str = "00:00:00:00:00:00"
    src_port: int = wire.HOMAGG_UDP_PORT_MIN
    switch_port: int = 0
    key: int = 0  # the parent job's key (its packets' auth word)


def uplink_clash(job_a: int, a: Uplink, job_b: int, b: Uplink) -> str | None:
    """Why child jobs ``job_a`` and ``job_b`` of one switch cannot go up as ``a`` and ``b``
    say, or None. The parent's job table knows a worker by (address, source port): two child
    jobs that go up to one parent address from one src_port would be one worker to it. And this
    switch's parents table knows a parent's answers by (its address, port, its job): two child
    jobs under one parent job could not tell whose final came down."""
    if a.ip == b.ip and a.src_port == b.src_port:
        return (f"jobs {job_a} and {job_b} both send their partial sums to {a.ip} from port "
                f"{a.src_port}: the parent knows a worker by its address and source port, so "
                f"each child job needs its own uplink src_port "
                f"({wire.HOMAGG_UDP_PORT_MIN}-{wire.HOMAGG_UDP_PORT_MAX})")
    if (a.ip, a.udp_port, a.job) == (b.ip, b.udp_port, b.job):
        return (f"jobs {job_a} and {job_b} both go up to job {a.job} at {a.ip}:{a.udp_port}: "
                "one child job per switch under a parent job")
    return None


@dataclass(frozen=True)
class JobSpec:
    id: int
    workers: tuple[Worker, ...]
    slots: int = 64
    place: str = "auto"  # one of PLACES
    uplink: Uplink | None = None  # a tree's child job: where its partial sums go
    #: the job's key: every packet of its workers carries it in its auth word, or the switch
    #: drops it as spoofed (p4/include/headers.p4); 0 where none was given
    key: int = 0


@dataclass(frozen=True)
class SwitchSpec:
    name: str = "s1"
    grpc: str = "127.0.0.1:9559"
    device_id: int = 1
    thrift_port: int = 9090
    ip: str = wire.DEFAULT_SWITCH_IP
    mac: str = wire.DEFAULT_SWITCH_MAC
    target: str = "bmv2"  # one of TARGETS
    slots: int | None = None  # the slot pool homagg may use; None: the whole register
    tls: GrpcTls | None = None  # P4Runtime over TLS (grpc_ca, grpc_cert, grpc_key)
    under: tuple[str, ...] = ()  # in a tree (treeconfig), the hosts cabled to the root


@dataclass(frozen=True)
class FallbackSpec:
    """A software aggregator (homagg-softswitch) that takes the jobs the switch cannot."""

    name: str = "fb"
    ip: str = wire.DEFAULT_FALLBACK_IP
    mac: str = wire.DEFAULT_FALLBACK_MAC
    grpc: str = "127.0.0.1:9560"
    device_id: int = 1
    port: int | None = None  # the switch port it hangs off, if the switch routes to it
    tls: GrpcTls | None = None


@dataclass(frozen=True)
class Config:
    switch: SwitchSpec
    hosts: tuple[Host, ...] = ()
    jobs: tuple[JobSpec, ...] = field(default_factory=tuple)
    fallback: FallbackSpec | None = None
    switches: tuple[TreeSwitch, ...] = ()  # a tree's switches below [switch] (treeconfig)

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ConfigError(f"unknown host {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    def job(self, job_id: int) -> JobSpec:
        for j in self.jobs:
            if j.id == job_id:
                return j
        raise ConfigError(f"job {job_id} is not in the config")


def host_ip(i: int) -> str:
    """The address of worker host i (0-based) in homagg's test topologies: 10.0.0.(i + 1)."""
    return f"10.0.0.{i + 1}"


def host_mac(i: int) -> str:
    return f"00:00:0a:00:00:{i + 1:02x}"


# -- addresses as P4Runtime carries them (integers), for the controller and the aggregator --

def is_local_address(addr: str) -> bool:
    """Whether a gRPC address (HOST:PORT or unix:PATH) is reachable from this host only: a
    unix socket (its file's permissions say who), or a loopback address."""
    if addr.startswith("unix:"):
        return True
    host = addr.rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def ip_int(ip: str) -> int:
    """An IPv4 address as the integer a table key or parameter holds."""
    try:
        return int(ipaddress.IPv4Address(ip))
    except ValueError:
        raise ConfigError(f"{ip!r} is not an IPv4 address") from None


def int_ip(value: int) -> str:
    return str(ipaddress.IPv4Address(value))


def mac_int(mac: str) -> int:
    return int(mac.replace(":", ""), 16)


def int_mac(value: int) -> str:
    return ":".join(f"{(value >> s) & 0xFF:02x}" for s in range(40, -8, -8))


def _key(value, where: str) -> int:
    """A config job's key: required, 1 to 2**32 - 1 (0 is no key: any sender that guesses 0
    would be taken for the job's worker). The message offers one drawn at random."""
    if value is None or value == 0:
        drawn = secrets.randbits(32) or 1
        why = "missing" if value is None else "0 is no key"
        raise ConfigError(f"{where}: {why}: every job needs one, 1 to 2**32 - 1, which its "
                          f"agents give too (HOMAGG_JOB_KEY); one drawn at random: "
                          f"key = {drawn:#010x}")
    return _int(value, where, 1, 2**32 - 1)


def validate_job(job_id: int, workers: list[Worker], slots: int, place: str = "auto",
                 key: int = 0) -> JobSpec:
    _int(job_id, "job id", 0, wire.MAX_JOBS - 1)
    _int(key, f"job {job_id} key", 0, 2**32 - 1)
    if place not in PLACES:
        raise ConfigError(f"job {job_id} place: {place!r} is not one of {', '.join(PLACES)}")
    _int(slots, f"job {job_id} slots", 1, wire.SLOTS)
    if not 1 <= len(workers) <= wire.MAX_WORKERS:
        raise ConfigError(f"job {job_id}: {len(workers)} workers; 1 to {wire.MAX_WORKERS} allowed")
    seen = set()
    for w in workers:
        addr = (w.ip, w.udp_port)
        if addr in seen:
            raise ConfigError(f"job {job_id}: worker {w.ip}:{w.udp_port} listed twice")
        seen.add(addr)
    return JobSpec(job_id, tuple(workers), slots, place, key=key)


def parse(data: dict) -> Config:
    sw = data.get("switch", {})
    if not isinstance(sw, dict):
        raise ConfigError("[switch] must be a table")
    known = {"name", "target", "grpc", "device_id", "thrift_port", "ip", "mac", "slots",
             "grpc_ca", "grpc_cert", "grpc_key", "under"}
    extra = set(sw) - known
    if extra:
        raise ConfigError(f"[switch]: unknown key(s) {', '.join(sorted(extra))}")
    d = SwitchSpec()
    target = sw.get("target", d.target)
    if target not in TARGETS:
        raise ConfigError(f"switch.target: {target!r} is not one of {', '.join(TARGETS)}")
    switch = SwitchSpec(
        name=str(sw.get("name", d.name)),
        grpc=str(sw.get("grpc", d.grpc)),
        device_id=_int(sw.get("device_id", d.device_id), "switch.device_id", 0, 2**64 - 1),
        thrift_port=_int(sw.get("thrift_port", d.thrift_port), "switch.thrift_port", 1, 65535),
        ip=_ip(sw.get("ip", d.ip), "switch.ip"),
        mac=_mac(sw.get("mac", d.mac), "switch.mac"),
        target=target,
        slots=None if "slots" not in sw else _int(sw["slots"], "switch.slots", 1, wire.SLOTS),
        tls=_tls(sw, "[switch]"),
        under=networks(sw.get("under", []), "switch.under"),
    )
    fallback = _fallback(data.get("fallback"))
    hosts = []
    for i, h in enumerate(data.get("hosts", [])):
        where = f"hosts[{i}]"
        for key in ("name", "ip", "mac", "port"):
            if key not in h:
                raise ConfigError(f"{where}: missing {key!r}")
        hosts.append(Host(str(h["name"]), _ip(h["ip"], f"{where}.ip"),
                          _mac(h["mac"], f"{where}.mac"), _int(h["port"], f"{where}.port", 0, 510)))
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ConfigError("hosts: duplicate host names")
    cfg = Config(switch, tuple(hosts), fallback=fallback)
    jobs = []
    for i, j in enumerate(data.get("jobs", [])):
        where = f"jobs[{i}]"
        if "id" not in j or "workers" not in j:
            raise ConfigError(f"{where}: needs 'id' and 'workers'")
        workers = []
        for k, w in enumerate(j["workers"]):
            wwhere = f"{where}.workers[{k}]"
            if "host" not in w:
                raise ConfigError(f"{wwhere}: needs 'host'")
            h = cfg.host(w["host"])
            port = _int(w.get("udp_port", wire.DEFAULT_AGENT_PORT), f"{wwhere}.udp_port", 1, 65535)
            workers.append(Worker(h.ip, port, h.mac, h.port, h.name))
        place = j.get("place", "auto")
        if place == "fallback" and fallback is None:
            raise ConfigError(f"{where}.place: 'fallback', but the config has no [fallback]")
        job_id = _int(j["id"], f"{where}.id", 0, wire.MAX_JOBS - 1)
        job = validate_job(job_id, workers, j.get("slots", 64), place,
                           _key(j.get("key"), f"{where}.key"))
        if "uplink" in j:
            if place == "fallback":
                raise ConfigError(f"{where}: a tree's child job (uplink) stays on its switch, "
                                  "where its parent answers: not place 'fallback'")
            job = dataclasses.replace(job, uplink=_uplink(j["uplink"], f"{where}.uplink"))
        jobs.append(job)
    ids = [j.id for j in jobs]
    if len(set(ids)) != len(ids):
        raise ConfigError("jobs: duplicate job ids")
    tree = [j for j in jobs if j.uplink is not None]
    for k, a in enumerate(tree):
        for b in tree[:k]:
            why = uplink_clash(b.id, b.uplink, a.id, a.uplink)  # type: ignore[arg-type]
            if why:
                raise ConfigError(f"jobs: {why}")
    switches = parse_switches(data.get("switches", []), switch.name, switch.under, wire.SLOTS)
    if switch.under and not switches:
        raise ConfigError("switch.under: a tree's root's hosts, but the config has no "
                          "[[switches]] below it")
    if fallback is not None and fallback.name in [s.name for s in switches]:
        raise ConfigError(f"switches: {fallback.name!r} is the [fallback]'s name")
    if switches:
        _one_switch_an_address(switch, switches, fallback)
    return Config(switch, tuple(hosts), tuple(jobs), fallback, switches)


def _uplink(u, where: str) -> Uplink:
    """A child job's ``uplink = {job, worker, ip, udp_port, mac, src_port, port, key}``
    (Uplink)."""
    if not isinstance(u, dict):
        raise ConfigError(f"{where} must be a table")
    extra = set(u) - {"job", "worker", "ip", "udp_port", "mac", "src_port", "port", "key"}
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(extra))}")
    for key in ("job", "worker", "ip"):
        if key not in u:
            raise ConfigError(f"{where}: missing {key!r}")
    d = Uplink(0, 0, "0.0.0.0")
    return Uplink(_int(u["job"], f"{where}.job", 0, wire.MAX_JOBS - 1),
                  _int(u["worker"], f"{where}.worker", 0, wire.MAX_WORKERS - 1),
                  _ip(u["ip"], f"{where}.ip"),
                  _int(u.get("udp_port", d.udp_port), f"{where}.udp_port", 1, 65535),
                  _mac(u.get("mac", d.mac), f"{where}.mac"),
                  # the parent's answers come back to it: homagg's ports only parse as homagg
                  _int(u.get("src_port", d.src_port), f"{where}.src_port",
                       wire.HOMAGG_UDP_PORT_MIN, wire.HOMAGG_UDP_PORT_MAX),
                  _int(u.get("port", d.switch_port), f"{where}.port", 0, 510),
                  _key(u.get("key"), f"{where}.key"))


def _fallback(fb) -> FallbackSpec | None:
    if fb is None:
        return None
    if not isinstance(fb, dict):
        raise ConfigError("[fallback] must be a table")
    extra = set(fb) - {"name", "ip", "mac", "grpc", "device_id", "port", "grpc_ca", "grpc_cert",
                       "grpc_key"}
    if extra:
        raise ConfigError(f"[fallback]: unknown key(s) {', '.join(sorted(extra))}")
    d = FallbackSpec()
    return FallbackSpec(
        name=str(fb.get("name", d.name)),
        ip=_ip(fb.get("ip", d.ip), "fallback.ip"),
        mac=_mac(fb.get("mac", d.mac), "fallback.mac"),
        grpc=str(fb.get("grpc", d.grpc)),
        device_id=_int(fb.get("device_id", d.device_id), "fallback.device_id", 0, 2**64 - 1),
        port=None if "port" not in fb else _int(fb["port"], "fallback.port", 0, 510),
        tls=_tls(fb, "[fallback]"),
    )


def load(path: Path) -> Config:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    return parse(data)


def _render_tls(t: GrpcTls | None) -> list[str]:
    if t is None:
        return []
    return [f"grpc_ca = {t.ca!r}"] + ([f"grpc_cert = {t.cert!r}", f"grpc_key = {t.key!r}"]
                                      if t.cert else [])


def _one_switch_an_address(switch: SwitchSpec, switches: Sequence[TreeSwitch],
                           fallback: FallbackSpec | None) -> None:
    """A tree's places, each at addresses of its own: two at one ``ip`` would take each
    other's packets, two at one ``grpc`` would be one switch written as two (a job removed
    from one is removed from both). A ``grpc`` that names no address (no ``:``, as the
    in-process switches of ``bench.scale`` say) is not compared."""
    places = [("[switch]", switch.name, switch.ip, switch.grpc)]
    places += [("[[switches]]", s.name, s.ip, s.grpc) for s in switches]
    if fallback is not None:
        places.append(("[fallback]", fallback.name, fallback.ip, fallback.grpc))
    for key in ("ip", "grpc"):
        seen: dict[str, tuple[str, str]] = {}
        for table, name, ip, grpc in places:
            value = ip if key == "ip" else grpc
            if key == "grpc" and ":" not in value:
                continue
            if value in seen:
                raise ConfigError(f"switches: {name} ({table}) and {seen[value][1]} "
                                  f"({seen[value][0]}) are both at {key} {value!r}: each "
                                  "switch of a tree needs addresses of its own")
            seen[value] = (table, name)


def render(cfg: Config) -> str:
    """``cfg`` as the TOML ``load`` reads back: the launcher writes its topology's, so that
    homagg-ctl can drive a running Mininet network."""
    s = cfg.switch
    lines = ["[switch]", f'name = "{s.name}"', f'target = "{s.target}"', f'grpc = "{s.grpc}"',
             f"device_id = {s.device_id}", f"thrift_port = {s.thrift_port}", f'ip = "{s.ip}"',
             f'mac = "{s.mac}"'] + ([f"slots = {s.slots}"] if s.slots else []) \
        + _render_tls(s.tls) \
        + (["under = [" + ", ".join(f'"{n}"' for n in s.under) + "]"] if s.under else []) + [""]
    fb = cfg.fallback
    if fb is not None:
        lines += ["[fallback]", f'name = "{fb.name}"', f'ip = "{fb.ip}"', f'mac = "{fb.mac}"',
                  f'grpc = "{fb.grpc}"', f"device_id = {fb.device_id}"]
        lines += ([f"port = {fb.port}"] if fb.port is not None else []) + _render_tls(fb.tls)
        lines += [""]
    for h in cfg.hosts:
        lines += ["[[hosts]]", f'name = "{h.name}"', f'ip = "{h.ip}"', f'mac = "{h.mac}"',
                  f"port = {h.port}", ""]
    for j in cfg.jobs:
        ws = ", ".join(f'{{ host = "{w.host}", udp_port = {w.udp_port} }}' for w in j.workers)
        lines += ["[[jobs]]", f"id = {j.id}", f"slots = {j.slots}", f"workers = [ {ws} ]"]
        lines += ([f'place = "{j.place}"'] if j.place != "auto" else [])
        lines += [f"key = {j.key}"] if j.key else []
        u = j.uplink
        if u is not None:
            lines.append(f'uplink = {{ job = {u.job}, worker = {u.worker}, ip = "{u.ip}", '
                         f'udp_port = {u.udp_port}, mac = "{u.mac}", src_port = {u.src_port}, '
                         f"port = {u.switch_port}" + (f", key = {u.key}" if u.key else "")
                         + " }")
        lines.append("")
    return "\n".join(lines + render_switches(cfg.switches))
