"""The switch's rules, once, in Python: state and a packet in; verdict, counters and replies out.

This is p4/homagg.p4's aggregation pipeline as a pure model (no sockets, no clock): admission
(include/control/admission.p4), the join (join.p4), the slot state machine (slot_state.p4),
the words and the round's overflow bit (words.p4, with lanes.p4's int32 lane arithmetic) and
the replies (reply.p4). The software aggregator (``homagg.targets.soft``) is this model on a
UDP socket; the in-memory simulator (``homagg.host_agent.simulate``) adds words with
``lane_add``/``lane_or``; and one table-driven conformance suite (bmv2_tests/
test_conformance.py) holds the model, the software target and bmv2 to the same verdicts,
counters, flags and replies.

Names of verdicts and counters are the P4 program's (generated constants): a new drop reason
there is a new counter here without an edit.

Four modules, each one layer: ``state`` (values: lanes, a job's entry, the slot memory),
``core`` (the state and the shared replies), ``join`` (join.p4), ``model`` (``SwitchModel``:
admission, slot state, words, runs, trees).
"""

from homagg.switch_model.model import SwitchModel
from homagg.switch_model.state import (
    INT32_MAX,
    INT32_MIN,
    Address,
    JobEntry,
    Outcome,
    ParentLink,
    SlotMemory,
    lane_add,
    lane_or,
    newer,
    newer_gen,
)

__all__ = ["INT32_MAX", "INT32_MIN", "Address", "JobEntry", "Outcome", "ParentLink",
           "SlotMemory", "SwitchModel", "lane_add", "lane_or", "newer", "newer_gen"]
