"""A tree of switches in the operator's config: the switches below ``[switch]`` (the root), whose
parent each is, and which hosts sit under which, for the controller service to place jobs
across them (``controller.treeplace``).

    [switch]                       # the root (the spine): as for one switch
    name = "spine"
    target = "soft"
    grpc = "10.9.0.1:9559"
    ip = "10.0.0.254"

    [[switches]]                   # a switch below it
    name = "leaf1"
    parent = "spine"               # the root's name, or another [[switches]] entry's
    target = "soft"                # or "bmv2"
    grpc = "10.9.0.11:9559"
    ip = "10.0.1.254"              # where its workers send, and its partial sums come from
    mac = "00:00:0a:00:01:fe"
    under = ["10.0.1.0/24"]        # the hosts cabled to it: networks or addresses
    slots = 1024                   # optional, as [switch] slots
    parent_port = 1                # bmv2: the parent's port this switch is cabled to
    uplink_port = 33               # bmv2: this switch's port toward its parent

Any depth: a middle level names the spine as parent and is the leaves' parent. Any switch may
have hosts (``under``), the root's in ``[switch] under``. A host sits under the switch whose
network holds its address most narrowly. Every problem is a ConfigError naming the key.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field

from homagg.configfields import GrpcTls, _int, _ip, _mac, _tls
from homagg.errors import ConfigError

NO_MAC = "00:00:00:00:00:00"
TREE_TARGETS = ("bmv2", "soft")
_KEYS = {"name", "parent", "target", "grpc", "device_id", "thrift_port", "ip", "mac", "slots",
         "grpc_ca", "grpc_cert", "grpc_key", "parent_port", "uplink_port", "under"}


@dataclass(frozen=True)
class TreeSwitch:
    """A switch of the tree below the root (``[[switches]]``)."""

    name: str
    parent: str
    ip: str
    grpc: str
    mac: str = NO_MAC
    target: str = "soft"
    device_id: int = 1
    thrift_port: int = 9090
    slots: int | None = None
    tls: GrpcTls | None = None
    parent_port: int = 0   # the parent's switch port this switch is cabled to
    uplink_port: int = 0   # this switch's port toward its parent
    under: tuple[str, ...] = ()  # the hosts under it: networks (a.b.c.d/n) or addresses


def networks(values, where: str) -> tuple[str, ...]:
    """``under``: a list of IPv4 networks or addresses, as their canonical text."""
    if not isinstance(values, list):
        raise ConfigError(f"{where}: a list of networks or addresses "
                          '(["10.0.1.0/24", "10.0.2.7"])')
    out = []
    for v in values:
        try:
            out.append(str(ipaddress.IPv4Network(str(v), strict=False)))
        except ValueError:
            raise ConfigError(f"{where}: {v!r} is not an IPv4 network or address") from None
    return tuple(out)


def parse_switches(items, root: str, root_under: tuple[str, ...], slots_max: int
                   ) -> tuple[TreeSwitch, ...]:
    """``[[switches]]`` checked: unique names, parents that exist, no loop, networks of two
    switches that do not overlap."""
    if not isinstance(items, list):
        raise ConfigError("[[switches]] must be an array of tables")
    out: list[TreeSwitch] = []
    for i, s in enumerate(items):
        where = f"switches[{i}]"
        if not isinstance(s, dict):
            raise ConfigError(f"{where} must be a table")
        extra = set(s) - _KEYS
        if extra:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(extra))}")
        for key in ("name", "parent", "ip", "grpc"):
            if key not in s:
                raise ConfigError(f"{where}: missing {key!r}")
        target = s.get("target", "soft")
        if target not in TREE_TARGETS:
            raise ConfigError(f"{where}.target: {target!r} is not one of "
                              f"{', '.join(TREE_TARGETS)}")
        out.append(TreeSwitch(
            str(s["name"]), str(s["parent"]), _ip(s["ip"], f"{where}.ip"), str(s["grpc"]),
            _mac(s.get("mac", NO_MAC), f"{where}.mac"), target,
            _int(s.get("device_id", 1), f"{where}.device_id", 0, 2**64 - 1),
            _int(s.get("thrift_port", 9090), f"{where}.thrift_port", 1, 65535),
            None if "slots" not in s else _int(s["slots"], f"{where}.slots", 1, slots_max),
            _tls(s, where), _int(s.get("parent_port", 0), f"{where}.parent_port", 0, 510),
            _int(s.get("uplink_port", 0), f"{where}.uplink_port", 0, 510),
            networks(s.get("under", []), f"{where}.under")))
    names = [root] + [s.name for s in out]
    for s in out:
        if names.count(s.name) > 1:
            raise ConfigError(f"switches: the name {s.name!r} is taken twice")
        if s.parent not in names:
            raise ConfigError(f"switches: {s.name}'s parent {s.parent!r} is neither [switch] "
                              f"({root}) nor one of [[switches]]")
    parent = {s.name: s.parent for s in out}
    for s in out:
        seen, at = {s.name}, s.parent
        while at != root:
            if at in seen:
                raise ConfigError(f"switches: {s.name}'s parents loop back to {at} (every "
                                  f"switch's parents lead to [switch], {root})")
            seen.add(at)
            at = parent[at]
    owned = [(root, n) for n in root_under] + [(s.name, n) for s in out for n in s.under]
    for k, (a, na) in enumerate(owned):
        for b, nb in owned[:k]:
            if ipaddress.IPv4Network(na).overlaps(ipaddress.IPv4Network(nb)):
                raise ConfigError(f"switches: {na} under {a} overlaps {nb} under {b}: a host "
                                  "sits under one switch")
    return tuple(out)


def render_switches(switches: Sequence[TreeSwitch]) -> list[str]:
    """``[[switches]]`` as ``parse_switches`` reads it back."""
    lines = []
    for s in switches:
        lines += ["[[switches]]", f'name = "{s.name}"', f'parent = "{s.parent}"',
                  f'target = "{s.target}"', f'grpc = "{s.grpc}"', f'ip = "{s.ip}"',
                  f'mac = "{s.mac}"', f"device_id = {s.device_id}",
                  f"thrift_port = {s.thrift_port}", f"parent_port = {s.parent_port}",
                  f"uplink_port = {s.uplink_port}",
                  "under = [" + ", ".join(f'"{n}"' for n in s.under) + "]"]
        lines += [f"slots = {s.slots}"] if s.slots else []
        if s.tls is not None:
            lines += [f"grpc_ca = {s.tls.ca!r}"] + ([f"grpc_cert = {s.tls.cert!r}",
                                                     f"grpc_key = {s.tls.key!r}"]
                                                    if s.tls.cert else [])
        lines.append("")
    return lines


@dataclass
class Tree:
    """The tree's shape: ``parent`` and ``children`` by switch name (the root first, then the
    config's order), and which switch each host network sits under."""

    root: str
    parent: dict[str, str] = field(default_factory=dict)
    children: dict[str, list[str]] = field(default_factory=dict)
    nets: list[tuple[ipaddress.IPv4Network, str]] = field(default_factory=list)

    @classmethod
    def of(cls, root: str, root_under: Sequence[str], switches: Sequence[TreeSwitch]) -> Tree:
        t = cls(root, {}, {root: []})
        for s in switches:
            t.parent[s.name] = s.parent
            t.children.setdefault(s.name, [])
        for s in switches:
            t.children[s.parent].append(s.name)
        owned = [(n, root) for n in root_under] + [(n, s.name) for s in switches for n in s.under]
        # the narrowest network first: a host sits under the switch that names it most closely
        t.nets = sorted(((ipaddress.IPv4Network(n), name) for n, name in owned),
                        key=lambda x: -x[0].prefixlen)
        return t

    def switch_of(self, ip: str) -> str | None:
        a = ipaddress.IPv4Address(ip)
        for net, name in self.nets:
            if a in net:
                return name
        return None

    def path(self, name: str) -> list[str]:
        """``name`` and its parents, up to the root."""
        out = [name]
        while out[-1] != self.root:
            out.append(self.parent[out[-1]])
        return out

    def top(self, names: Sequence[str]) -> str:
        """The lowest switch above (or at) every one of ``names``: where their job's root is."""
        paths = [self.path(n) for n in names]
        common = set(paths[0]).intersection(*map(set, paths[1:]))
        return next(n for n in paths[0] if n in common)

    def depth(self, name: str) -> int:
        return len(self.path(name)) - 1
