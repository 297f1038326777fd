"""What a host agent raises when it cannot do what it was told. Its own module, below
everything else of the agent's: the config, the membership and the engines all raise them."""

from __future__ import annotations

from homagg.errors import HomaggError


class AgentError(HomaggError):
    """The all-reduce cannot complete; the message says who and what."""


class AggregationTimeout(AgentError):
    pass
