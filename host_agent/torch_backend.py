"""Deprecated: ``homagg.host_agent.distributed.backend``; this name goes in the next release."""

import sys
import warnings

from homagg.host_agent.distributed import backend as _moved

warnings.warn("homagg.host_agent.torch_backend moved to homagg.host_agent.distributed.backend; "
              "the old name goes in the next release", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved  # the same module object: its names, patches and state
