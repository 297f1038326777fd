"""homagg host agent: the codec, the wire protocol, and the reliable all-reduce."""

from homagg.host_agent.agent import Agent, AgentConfig, AgentError, AggregationTimeout

__all__ = ["Agent", "AgentConfig", "AgentError", "AggregationTimeout"]
