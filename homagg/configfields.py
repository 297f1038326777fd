"""The checks of a config's values (an address, a MAC, an integer in range, a switch's TLS
files), each a ConfigError with one line naming the key: shared by ``netconfig`` (the switch,
its hosts and jobs) and ``treeconfig`` (a tree's switches), which import this and nothing of
each other's but the one way (netconfig imports treeconfig).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from homagg.errors import ConfigError

_MAC = re.compile(r"^([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}$")


@dataclass(frozen=True)
class GrpcTls:
    """How the controller reaches a switch's P4Runtime over TLS: the CA that signed the
    switch's certificate (``grpc_ca``), and for mutual TLS this controller's own certificate
    and key (``grpc_cert``, ``grpc_key``). PEM file paths."""

    ca: str
    cert: str | None = None
    key: str | None = None


def _tls(table: dict, where: str) -> GrpcTls | None:
    ca, cert, key = (table.get(k) for k in ("grpc_ca", "grpc_cert", "grpc_key"))
    if ca is None:
        if cert is not None or key is not None:
            raise ConfigError(f"{where}: grpc_cert and grpc_key need grpc_ca (the switch's CA)")
        return None
    if (cert is None) != (key is None):
        raise ConfigError(f"{where}: grpc_cert and grpc_key go together (mutual TLS)")
    return GrpcTls(str(ca), None if cert is None else str(cert), None if key is None
                   else str(key))


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
