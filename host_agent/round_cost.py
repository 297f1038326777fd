"""Deprecated: ``homagg.host_agent.engine.round_cost``; this name goes in the next release."""

import sys
import warnings

from homagg.host_agent.engine import round_cost as _moved

warnings.warn("homagg.host_agent.round_cost moved to homagg.host_agent.engine.round_cost; "
              "the old name goes in the next release", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved  # the same module object: its names, patches and state
