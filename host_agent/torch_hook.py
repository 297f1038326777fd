"""Deprecated: ``homagg.host_agent.distributed.hook``; this name goes in the next release."""

import sys
import warnings

from homagg.host_agent.distributed import hook as _moved

warnings.warn("homagg.host_agent.torch_hook moved to homagg.host_agent.distributed.hook; "
              "the old name goes in the next release", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved  # the same module object: its names, patches and state
