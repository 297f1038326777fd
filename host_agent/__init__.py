"""homagg host agent: the codec, the wire protocol, and the reliable all-reduce.

``allreduce`` (the Agent: negotiation, modes, rescaling) over the streaming ``engine`` (its
``transport``: the slot pool, retransmission, deadline, with ``rto``'s timeout), configured by
``config``; ``local`` does a tensor's per-element work; ``codec`` holds the encodings;
``distributed`` plugs it into torch.distributed: its ``hook`` into DDP, its ``backend`` as a
backend ("homagg", registered by ``import homagg.torch``); ``simulate`` runs the whole
all-reduce in memory (``simulate_allreduce``; ``simulate_ints`` on integers).
"""

from homagg.host_agent.allreduce import Agent
from homagg.host_agent.config import AgentConfig, AgentError, AggregationTimeout
from homagg.host_agent.engine import transport as _transport
from homagg.host_agent.simulate import MemoryJob, simulate_allreduce, simulate_ints
from homagg.host_agent.warm import before_join as _before_join

_transport.before_join = _before_join  # (transport's doc: the kernels, before any round)

__all__ = ["Agent", "AgentConfig", "AgentError", "AggregationTimeout", "MemoryJob",
           "simulate_allreduce", "simulate_ints"]
