"""What a round that got no answer says when its deadline passes: the slot, what the switch
last said of it (a refusal, a status that names the contributors it holds, a parent switch's
status) or its silence, whom the round waits for, and what the controller said of the job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from homagg import wire
from homagg.host_agent.config import AggregationTimeout

if TYPE_CHECKING:
    from homagg.host_agent.engine.round import Round

_DROP_MEANING = {
    "DROP_STALE": "rounds the switch holds as already finished or older than its own",
    "DROP_SEQ_MISMATCH": "another round is in progress in the same slot",
}


def timeout_error(self: Round, pending: np.ndarray) -> AggregationTimeout:
    """Round ``self``'s deadline passed with ``pending`` chunks out
    (``Round.give_up_if_silent``)."""
    t, cfg, g0 = self.t, self.cfg, self.g0
    S = cfg.slots
    W = cfg.workers if cfg.local_workers is None else cfg.local_workers  # at our switch
    c = int(pending[0]) if len(pending) else 0
    slot = (g0 + c) % S
    if self.join:
        msg = (f"{t.who}: the job's join (start of a run) got no answer in "
               f"{cfg.deadline:.1f} s; ")
    else:
        msg = (f"{t.who}: no result for slot {slot} (round tag {(g0 + c + 1) & 0xFFFFFFFF}"
               f", {len(pending)} chunk(s) outstanding) in {cfg.deadline:.1f} s; ")
    st = self.status.get(c) or (next(iter(self.status.values())) if self.status else None)
    why = self.refused.get(c) or next(iter(self.refused.values()), None)
    if why is not None:
        msg += (f"the switch drops this worker's packets as {why} "
                f"({_DROP_MEANING.get(why, '')}): is another run of job {cfg.job} still "
                "going, or was the job changed under it? (`homagg-ctl reset` starts it "
                "afresh)")
    elif st is None:
        msg += (f"the switch {t.switch[0]}:{t.switch[1]} did not answer at all: is it "
                f"up, and is this worker's address installed in job {cfg.job}, with "
                "this agent's key?")
    elif (c if c in self.status else next(iter(self.status), c)) in self.upstream:
        seen, count = st
        names = cfg.siblings
        missing = [n for i, n in enumerate(names) if not seen >> i & 1]
        have = [names[i] if i < len(names) else f"child {i}"
                for i in range(wire.MAX_WORKERS) if seen >> i & 1]
        what = "joins" if self.join else "partial sums"
        msg += (f"every worker under switch {t.switch[0]} has sent; its parent switch holds "
                f"{count} {what} (from {', '.join(have)})")
        msg += (f" and waits for {', '.join(missing)} (a dead switch, or a dead worker "
                "under it)" if names else "; another child switch (or a worker under "
                "it) is missing")
    else:
        seen, count = st
        absent = [w for w in range(W) if not seen >> w & 1]
        if cfg.local_workers is not None and not absent:
            # a tree: the leaf answers the round's other workers with its own status
            # while its designated worker's resends go up (uplink.p4)
            msg += (f"every worker under switch {t.switch[0]} has sent; its partial sum "
                    "got no answer from the parent switch (is the parent, or the link to "
                    "it, down?)")
        elif self.join:
            msg += (f"{count} of {W} workers joined; waiting for worker(s) "
                    f"{', '.join(map(str, absent))} to start")
        else:
            msg += (f"the switch holds {count} of {W} contributions; waiting for "
                    f"worker(s) {', '.join(map(str, absent))} (dead, or stuck in another "
                    "round)")
    lost = cfg.membership.lost if cfg.membership is not None else None
    if lost:  # the service removed the job (a lease ran out): it names whose
        msg += f"; the controller says: {lost}"
    return AggregationTimeout(msg)
