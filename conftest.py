"""Test tiers, applied by what a test needs rather than by hand (pytest markers):

- ``bmv2``: runs on a bmv2 switch (a ``bmv2`` target parameter, or the ``pipeline``,
  ``testbed`` or ``two_switches`` fixtures);
- ``mininet``: runs under Mininet (the ``net_target`` fixture, or a Mininet module);
- ``slow``: a module whose tests start many processes (torch ranks, launchers, services) or
  run for long; such a module says so itself with ``pytestmark = pytest.mark.slow``.

The quick tier is what is left: ``./run.sh test -m "not slow and not bmv2 and not mininet"``
(the model, the codec, the agent and the software target). ``./run.sh test`` runs them all.
"""

from __future__ import annotations

import pytest

_BMV2_FIXTURES = {"pipeline", "testbed", "two_switches"}
_MININET_MODULES = {"test_mininet.py", "test_reliability.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "bmv2" in params.values() or _BMV2_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.bmv2)
        if "net_target" in item.fixturenames or item.path.name in _MININET_MODULES:
            item.add_marker(pytest.mark.mininet)
