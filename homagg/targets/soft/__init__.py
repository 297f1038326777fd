"""The software aggregator: the switch program's semantics over UDP sockets.

It runs where bmv2 is not installed (the embedded default), for jobs that do not fit in switch
memory, and as a baseline. The rules are ``homagg.switch_model`` (the same model the
conformance suite holds bmv2 to). Three parts, each one job:

- ``tables``: ``SoftSwitch``, the model plus the control plane's state in P4Info terms (the
  five tables, the multicast groups, the counters), as homagg-ctl writes and reads them on bmv2;
- ``server``: ``SoftSwitchServer``, that switch on UDP sockets;
- ``cli``: ``homagg-softswitch``, the two with a P4Runtime server
  (``homagg.targets.p4runtime_server``), so homagg-ctl drives it as it drives bmv2. Not
  imported here: it installs a config's jobs with the controller's job logic, which reaches
  ``tables`` in process through ``homagg.controller.local``.

Jobs are the controller's business (``homagg.controller.jobs``), written over P4Runtime or in
process (``homagg.controller.local``).
"""

import importlib
import warnings

from homagg.targets.soft.server import SoftSwitchError, SoftSwitchServer
from homagg.targets.soft.tables import SoftSwitch

__all__ = ["SoftSwitch", "SoftSwitchError", "SoftSwitchServer"]


def main(argv=None) -> int:
    """Deprecated: ``homagg.targets.soft.cli.main`` (the ``homagg-softswitch`` script's entry
    point since 0.2.0). Kept for one release; it reaches the CLI by name, at call time, so the
    package itself still does not import it (the CLI imports the controller, which imports
    this package's tables)."""
    warnings.warn("homagg.targets.soft.main is deprecated: use homagg.targets.soft.cli.main "
                  "(reinstall homagg to rewrite an old homagg-softswitch script)",
                  DeprecationWarning, stacklevel=2)
    return importlib.import_module("homagg.targets.soft.cli").main(argv)
