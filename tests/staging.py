"""How the tests stage what they need without races: addresses of their own for agents, and
waiting on a condition (a counter) instead of on time or thread start order.

Agents get a loopback address of their own, never a port picked by binding port 0, closing and
reusing the number (another process can take it in between).

Every address handed out in one test session is distinct: 127.(64 + pid % 64).x.y with a
counter for x.y, so two sessions on one machine (a developer's and a helper's) almost never
meet either. The port is fixed and below the kernel's ephemeral range (32768 and up here), so
the kernel never hands it to anyone else's bind(port 0); a rerun of an agent on its address (a
script run again, as the switch's job table expects) binds the same address and port.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable

AGENT_PORT = 20_000  # below /proc/sys/net/ipv4/ip_local_port_range
_subnet = 64 + os.getpid() % 64
_next = itertools.count(1)


def agent_address() -> tuple[str, int]:
    """A fresh (ip, port) for one agent, unique in this test session."""
    n = next(_next)
    if n >= 254 * 256:
        raise RuntimeError("tests.staging: out of addresses")
    return f"127.{_subnet}.{n // 254}.{1 + n % 254}", AGENT_PORT


def agent_addresses(n: int) -> list[tuple[str, int]]:
    return [agent_address() for _ in range(n)]


def wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Return once ``cond()`` is true; fail the test, naming ``what``, after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for "
                                 f"{what or 'a condition'}")
        time.sleep(0.002)


def job_key(job: int) -> int:
    """The key the tests' configs give job ``job`` (a config job needs one, as its agents do)."""
    return 0x5EC0_0000 | job
