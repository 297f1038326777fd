"""One base class for every error homagg raises on purpose, so a caller can catch them all.

Each part keeps its own subclasses next to the code that raises them (``SwitchError`` in the
controller, ``AgentError`` in the host agent, ...); the ones the core shares live here.
"""

from __future__ import annotations


class HomaggError(Exception):
    """Anything homagg refuses or cannot do; the message says what and why, in one line."""


class ConfigError(HomaggError, ValueError):
    """A config file, option or environment variable that does not make sense."""


class ToolMissing(HomaggError):
    """An external tool (p4c, bmv2) is not installed or not where a variable points."""


class TableError(HomaggError):
    """A control-plane write the switch refuses, with the google.rpc code bmv2 would give
    (``homagg.targets.soft``'s tables and its P4Runtime server raise it alike)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class JobError(HomaggError):
    """A job that cannot be installed, found or removed (either target)."""
