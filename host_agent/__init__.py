"""homagg host agent: the codec, the wire protocol, and the reliable all-reduce."""

from host_agent.agent import AggregationTimeout, Agent, AgentConfig, AgentError

__all__ = ["Agent", "AgentConfig", "AgentError", "AggregationTimeout"]
