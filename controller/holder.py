"""The mark a controller service keeps on the switch it holds (STATS cell ``HOLDER_CELL``): a
random id as the packet count, the service's gRPC address as the byte count. Two services on
one switch would reap each other's jobs, so a second one that finds another's mark asks that
address: while something answers there it refuses to start, and once nothing does it takes
the switch over. Every placement and removal checks the mark, so a service that was only
paused, and was replaced meanwhile, stands down instead of fighting.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import socket

from homagg import _p4consts as P4
from homagg.controller.p4client import CounterValue
from homagg.controller.service_state import HOLDER_CELL, Refusal
from homagg.controller.switch import Switch
from homagg.errors import ConfigError

log = logging.getLogger("homagg.service")

#: How long a starting service waits for the holder's answer before it takes the switch over.
PROBE_TIMEOUT = 2.0


class HolderMark:
    """This service's mark on the switch named ``switch``."""

    def __init__(self, switch: str):
        self.switch = switch
        self.id = secrets.randbelow(2**62 - 1) + 1
        self.address: tuple[str, int] | None = None  # where this service serves
        self.deposed: str | None = None  # another service took the switch over: why

    @staticmethod
    def read(sw: Switch) -> CounterValue:
        return sw.read_counter(P4.COUNTER_STATS).get(HOLDER_CELL, CounterValue())

    def take(self, sw: Switch, address: tuple[str, int] | None) -> None:
        """Put this service's mark on the switch; refused while the service whose mark is
        there answers at the address it left."""
        mark = self.read(sw)
        if mark.packets not in (0, self.id):
            where = None
            if mark.bytes:
                where = f"{ipaddress.IPv4Address(mark.bytes >> 16)}:{mark.bytes & 0xFFFF}"
            mine = address is not None and where == f"{address[0]}:{address[1]}"
            # (at this service's own address, bound already: a predecessor that died)
            if where is not None and not mine and _answers(where):
                raise ConfigError(
                    f"switch {self.switch} is held by another homagg-ctl serve, which answers "
                    f"at {where}: two services on one switch would reap each other's jobs; "
                    "stop that one first")
            log.warning("switch %s: taking it over from a service that no longer answers%s",
                        self.switch, f" at {where}" if where else "")
        self.address = address
        self._write(sw)

    def _write(self, sw: Switch) -> None:
        code = 0
        if self.address is not None:
            code = int(ipaddress.IPv4Address(self.address[0])) << 16 | self.address[1]
        sw.write_counter(P4.COUNTER_STATS, {HOLDER_CELL: CounterValue(self.id, code)})

    def check(self, sw: Switch) -> None:
        """Refuse (UNAVAILABLE) once another service has taken the switch over: this one was
        paused, or lost its connection, while it was replaced. No mark at all (the switch
        restarted, and its counters with it) is this service's to set again."""
        holder = self.read(sw).packets
        if holder == 0 and not self.deposed:
            self._write(sw)
        elif holder != self.id:
            self.deposed = (f"another homagg-ctl serve took switch {self.switch} over (STATS "
                            f"cell {HOLDER_CELL} holds its mark)")
            log.error("%s: this service no longer places or removes jobs", self.deposed)
        if self.deposed:
            raise Refusal("UNAVAILABLE", self.deposed)

    def release(self, sw: Switch) -> None:
        """Clear the mark if it is still this service's (a clean stop)."""
        if self.read(sw).packets == self.id:
            sw.write_counter(P4.COUNTER_STATS, {HOLDER_CELL: CounterValue(0, 0)})


def _answers(address: str) -> bool:
    """Whether something (with the mark: the service that left it) listens at ``address``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), PROBE_TIMEOUT):
            return True
    except OSError:
        return False
