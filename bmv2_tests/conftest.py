"""Fixtures for tests against a real bmv2: they skip, with the reason, where it cannot run."""

from __future__ import annotations

import os

import pytest

from homagg import paths
from homagg.targets.toolchain import bmv2_unavailable

LOG_DIR = paths.log_dir("bmv2_tests")


bmv2_skip_reason = bmv2_unavailable  # the tests' name for it


@pytest.fixture(scope="session")
def pipeline():
    reason = bmv2_skip_reason()
    if reason:
        pytest.skip(reason)
    from homagg.controller.build import build

    return build()


@pytest.fixture(scope="module")
def testbed(pipeline):
    """A 5-port bmv2 switch with the homagg pipeline and base forwarding installed."""
    from homagg.controller import jobs
    from homagg.controller.p4client import P4RuntimeSwitch
    from homagg.targets.testbed import start_testbed, stop_testbed

    bed = start_testbed(5, LOG_DIR)
    try:
        conn = P4RuntimeSwitch(bed.switch.grpc_addr, request_log=LOG_DIR / "s1-p4runtime.log")
        conn.open(pipeline)
        jobs.install_base(conn, bed.config)
        bed.conn = conn
        yield bed
    finally:
        if getattr(bed, "conn", None):
            bed.conn.close()
        stop_testbed(bed)


def mininet_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (Mininet)"
    try:
        import mininet  # noqa: F401
    except ImportError:
        return "Mininet not installed (apt-get install mininet; ./run.sh setup does it)"
    return None


@pytest.fixture(params=["soft", "bmv2"])
def net_target(request):
    """Each Mininet test runs on the software aggregator and on bmv2 (each skips with its
    reason where it cannot run)."""
    reason = mininet_skip_reason()
    if reason is None and request.param == "bmv2":
        reason = bmv2_skip_reason()
    if reason:
        pytest.skip(reason)
    return request.param
