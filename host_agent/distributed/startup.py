"""What the ranks of a new "homagg" process group tell each other as it starts: whether each
one's agent started (``group.HomaggProcessGroup``), so that all raise at once where one could
not.

Through the store, on the rank's own thread, not through a gloo collective: a rank that raises
next leaves no collective behind, whose tensor a gloo thread would let go of while the
interpreter exits (which aborts the process: "terminate called without an active
exception").
"""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist


def told(store: dist.Store, rank: int, size: int, mine: int) -> Counter[int]:
    """How many ranks of the group are in each start-up state (0: with an agent, 1: without,
    2: failed), each rank's ``mine`` told through ``store``."""
    at = dist.PrefixStore("homagg-start/", store)
    at.set(str(rank), str(mine))
    return Counter(int(at.get(str(r))) for r in range(size))
