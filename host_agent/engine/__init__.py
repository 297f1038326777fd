"""The streaming engine: how an agent's rounds cross the network, below the protocol's
decisions (``allreduce.Agent`` decides what a tensor's rounds carry; the engine moves each
round's words through the switch's slots and back, reliably).

Its face is ``SwitchLink``: ``stream(op, words)`` runs one round and returns the switch's
result, with ``Counters`` counting what it cost; ``stream_fused`` (where a link has it) runs two
rounds of different ops in one window, for pipelined tensors. ``Transport`` (``transport``) is
the UDP engine; ``simulate.MemoryTransport`` is the in-memory one. A UDP round runs in one of
two engines behind the same ``Round``: Python's (the reference) or the native one (``native``:
homagg/native/agent_loop.c, the same loop in C with the GIL released, which hands back to Python
what the protocol decides). The modules, by concern: ``transport`` (the socket, the slot pool,
the window, a round's deadline, the engine), ``packets`` (a round's packets), ``round`` (one
round's send and receive loop), ``native`` (that loop in C), ``results`` (matching results to
their chunks), ``loss`` (timeouts, RACK, tail probes), ``deadline`` (the error when a round's
deadline passes), ``rto`` (the timeout estimate), ``congestion`` (the window per agent) and
``round_cost`` (what a round trip costs, in words).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass
class Counters:
    packets_sent: int = 0
    bytes_sent: int = 0
    retransmissions: int = 0
    early_resends: int = 0    # of those, resent on RACK's evidence before the timeout
    probes: int = 0           # of those, tail-loss probes (a round's tail, after silence)
    probes_held: int = 0      # probes the switch answered "held": the chunk was there
    tail_copies: int = 0      # while lossy, a round's last chunk sent twice (in packets_sent)
    held_back: int = 0        # overdue chunks a timeout did not resend: the switch holds
                              # them, or answered after they left (``loss.held_back``)
    # Where recovery's time goes: per cause of a resend (timeout, RACK, probe), the seconds the
    # resent copy had been out when it was resent, summed (``loss.LossRecovery``)
    waited_timeout: float = 0.0
    waited_rack: float = 0.0
    waited_probe: float = 0.0
    results: int = 0
    ignored: int = 0          # late duplicates, foreign or malformed datagrams
    refusals: int = 0         # configuration refusals (DROP_WRONG_IDENTITY, DROP_BAD_SLOT):
                              # fatal only once a resend is refused again; one alone may be
                              # forged
    spoofed: int = 0          # datagrams without the job's key (auth): not from the switch
    rounds: int = 0
    pipelined: int = 0        # tensors whose round 1 rode with the one before's (pipeline)
    rescales: int = 0
    seconds: float = 0.0
    # The run's join (transport: one packet per run, its retransmissions included), apart from
    # the rounds' packets and bytes above, which are per tensor.
    join_packets: int = 0



class SwitchLink(Protocol):
    """What an agent streams its rounds through: the UDP ``Transport`` to a switch, or
    ``simulate.MemoryTransport`` (the switch's arithmetic in memory)."""

    #: why the link cannot be used any more (an earlier round failed), or None
    broken: str | None
    #: the switch's resolved address
    switch: tuple[str, int]
    #: the socket to the switch (an ``ImpairedSocket`` with fault injection); None in memory
    sock: Any

    def stream(self, op: int, words: np.ndarray, flagged: bool = False) -> np.ndarray:
        """One round: ``words`` through the switch (``op``: OP_ADD or OP_OR), the result.
        ``flagged``: the words are a partial sum that overflowed (``hostreduce``)."""
        ...

    def close(self) -> None: ...


from homagg.host_agent.engine.transport import SwitchOverflow, Transport  # noqa: E402

__all__ = ["Counters", "SwitchLink", "SwitchOverflow", "Transport"]
