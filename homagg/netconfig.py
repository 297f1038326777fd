"""The operator's TOML file: one switch, its hosts, and the jobs to install.

    [switch]
    name = "s1"
    target = "bmv2"                # or "soft": the software aggregator (homagg-softswitch)
    grpc = "127.0.0.1:9559"        # P4Runtime address
    device_id = 1
    thrift_port = 9090             # bmv2 Thrift CLI (optional: register resets; bmv2 only)
    ip = "10.0.0.254"              # the address workers send to
    mac = "00:00:0a:00:00:fe"

    [[hosts]]                      # routed and ARP-proxied by the switch
    name = "h1"
    ip = "10.0.0.1"
    mac = "00:00:0a:00:00:01"
    port = 1                       # the switch port it is cabled to

    [[jobs]]
    id = 1
    slots = 64                     # slot region size (the agents' window)
    workers = [ { host = "h1", udp_port = 50000 }, { host = "h2", udp_port = 50000 } ]

Every problem is a ConfigError with one line naming the key.
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from homagg import wire
from homagg.errors import ConfigError

_MAC = re.compile(r"^([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}$")
#: What runs the switch: bmv2 (``homagg-ctl install`` compiles and pushes the P4 program) or
#: the software aggregator (it runs homagg's pipeline natively: install needs no p4c).
TARGETS = ("bmv2", "soft")




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
class JobSpec:
    id: int
    workers: tuple[Worker, ...]
    slots: int = 64


@dataclass(frozen=True)
class SwitchSpec:
    name: str = "s1"
    grpc: str = "127.0.0.1:9559"
    device_id: int = 1
    thrift_port: int = 9090
    ip: str = wire.DEFAULT_SWITCH_IP
    mac: str = wire.DEFAULT_SWITCH_MAC
    target: str = "bmv2"  # one of TARGETS


@dataclass(frozen=True)
class Config:
    switch: SwitchSpec
    hosts: tuple[Host, ...] = ()
    jobs: tuple[JobSpec, ...] = field(default_factory=tuple)

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


def _ip(value, where: str) -> str:
    try:
        return str(ipaddress.IPv4Address(value))
    except (ipaddress.AddressValueError, ValueError):
        raise ConfigError(f"{where}: {value!r} is not an IPv4 address") from None


def _mac(value, where: str) -> str:
    if not isinstance(value, str) or not _MAC.match(value):
        raise ConfigError(f"{where}: {value!r} is not a MAC address (aa:bb:cc:dd:ee:ff)")
    return value.lower()


def _int(value, where: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ConfigError(f"{where}: {value!r} is not an integer in [{lo}, {hi}]")
    return value


def validate_job(job_id: int, workers: list[Worker], slots: int) -> JobSpec:
    _int(job_id, "job id", 0, wire.MAX_JOBS - 1)
    _int(slots, f"job {job_id} slots", 1, wire.SLOTS)
    if not 1 <= len(workers) <= wire.MAX_WORKERS:
        raise ConfigError(f"job {job_id}: {len(workers)} workers; 1 to {wire.MAX_WORKERS} allowed")
    seen = set()
    for w in workers:
        key = (w.ip, w.udp_port)
        if key in seen:
            raise ConfigError(f"job {job_id}: worker {w.ip}:{w.udp_port} listed twice")
        seen.add(key)
    return JobSpec(job_id, tuple(workers), slots)


def parse(data: dict) -> Config:
    sw = data.get("switch", {})
    if not isinstance(sw, dict):
        raise ConfigError("[switch] must be a table")
    known = {"name", "target", "grpc", "device_id", "thrift_port", "ip", "mac"}
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
    )
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
    cfg = Config(switch, tuple(hosts))
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
        jobs.append(validate_job(_int(j["id"], f"{where}.id", 0, wire.MAX_JOBS - 1), workers,
                                 j.get("slots", 64)))
    ids = [j.id for j in jobs]
    if len(set(ids)) != len(ids):
        raise ConfigError("jobs: duplicate job ids")
    return Config(switch, tuple(hosts), tuple(jobs))


def load(path: Path) -> Config:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    return parse(data)
