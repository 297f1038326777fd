"""The P4 pipelines homagg's one job logic drives, and their P4Info names, in one place.

Two programs speak homagg's protocol: the v1model program (``p4/homagg.p4``: bmv2, and the
software aggregator, which serves its P4Info) and the TNA program (``p4/tofino/homagg_tna.p4``:
Tofino, compiled by p4c-barefoot). Their tables, actions and counters hold the same keys and
parameters under other names (the TNA program nests its controls differently), and the TNA
program leaves out what it does not do (trees: no ``uplink`` or ``parents`` table).
``controller.jobs`` asks a switch's ``program`` for every name it writes, so one job logic
serves both.

    from homagg.programs import TOFINO, program_of
    names = program_of(sw)           # the switch's, V1MODEL where it says none
    sw.insert(TableEntry(names.table_job_workers, ...))

The v1model names come from the generated constants (``homagg._p4consts``); the TNA names from
the TNA program's P4Info, shipped as ``homagg/_p4info_tofino.txtpb`` (p4c-barefoot's own
output: ``homagg-ctl build --target tofino`` refreshes it), which tests/test_tofino.py holds
to these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from homagg import _p4consts as P4
from homagg import wire
from homagg.errors import HomaggError
from homagg.p4schema import P4Schema

#: the TNA program's P4Info, as p4c-barefoot wrote it (text format)
TOFINO_P4INFO_FILE = Path(__file__).resolve().parent / "_p4info_tofino.txtpb"


class ProgramError(HomaggError):
    pass


@dataclass(frozen=True)
class Program:
    """One compiled program's names for what the job logic writes and reads. A name that is
    None: the program has no such object (``supports_trees`` says which)."""

    name: str
    table_local_ip: str
    table_arp_proxy: str
    table_ipv4_route: str
    table_aggregators: str
    table_job_workers: str
    table_result_dst: str
    table_uplink: str | None
    table_parents: str | None
    action_to_switch: str
    action_arp_reply: str
    action_route: str
    action_trusted: str
    action_set_worker: str
    action_set_result_dst: str
    action_set_uplink: str | None
    action_set_parent: str | None
    counter_stats: str
    counter_job_stats: str
    counter_fwd_stats: str
    max_workers: int       # workers per job on one switch of this program
    words: int | None      # K, when the program is built for one (None: the build says)
    p4info_file: Path
    generated: P4Schema | None = None  # the schema already made from p4info_file, if any

    @property
    def supports_trees(self) -> bool:
        return self.table_uplink is not None

    @cached_property
    def schema(self) -> P4Schema:
        """The program's P4Info as a typed schema (read from its file on first use)."""
        return self.generated if self.generated is not None else load_schema(self.p4info_file)

    def names(self) -> dict[str, str]:
        """Every P4Info name this pipeline has, by its role."""
        return {k: v for k, v in self.__dict__.items()
                if k.split("_", 1)[0] in ("table", "action", "counter") and v is not None}


def load_schema(path: Path) -> P4Schema:
    """The schema of a P4Info text file (needs the p4runtime package: the controller's)."""
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2

    from homagg.p4schema import from_p4info

    if not path.is_file():
        raise ProgramError(f"{path} is missing: build it with homagg-ctl build --target tofino")
    return from_p4info(text_format.Parse(path.read_text(), p4info_pb2.P4Info()))


V1MODEL = Program(
    name="v1model",
    table_local_ip=P4.TABLE_LOCAL_IP,
    table_arp_proxy=P4.TABLE_ARP_PROXY,
    table_ipv4_route=P4.TABLE_IPV4_ROUTE,
    table_aggregators=P4.TABLE_AGGREGATORS,
    table_job_workers=P4.TABLE_JOB_WORKERS,
    table_result_dst=P4.TABLE_RESULT_DST,
    table_uplink=P4.TABLE_UPLINK,
    table_parents=P4.TABLE_PARENTS,
    action_to_switch=P4.ACTION_TO_SWITCH,
    action_arp_reply=P4.ACTION_ARP_REPLY,
    action_route=P4.ACTION_ROUTE,
    action_trusted=P4.ACTION_TRUSTED,
    action_set_worker=P4.ACTION_SET_WORKER,
    action_set_result_dst=P4.ACTION_SET_RESULT_DST,
    action_set_uplink=P4.ACTION_SET_UPLINK,
    action_set_parent=P4.ACTION_SET_PARENT,
    counter_stats=P4.COUNTER_STATS,
    counter_job_stats=P4.COUNTER_JOB_STATS,
    counter_fwd_stats=P4.COUNTER_FWD_STATS,
    max_workers=wire.MAX_WORKERS,
    words=None,
    p4info_file=Path(__file__).resolve().parent / "_p4info.txtpb",
    generated=P4.SCHEMA,  # homagg/_p4consts.py: made from that file, no protobuf needed
)

_IG = "HomaggIngress"
TOFINO = Program(
    name="tofino",
    table_local_ip=f"{_IG}.local_ip",
    table_arp_proxy=f"{_IG}.forwarding.arp_proxy",
    table_ipv4_route=f"{_IG}.forwarding.ipv4_route",
    table_aggregators=f"{_IG}.forwarding.aggregators",
    table_job_workers=f"{_IG}.admission.job_workers",
    table_result_dst="HomaggEgress.result_dst",
    table_uplink=None,
    table_parents=None,
    action_to_switch=f"{_IG}.to_switch",
    action_arp_reply=f"{_IG}.forwarding.arp_reply",
    action_route=f"{_IG}.forwarding.route",
    action_trusted=f"{_IG}.forwarding.trusted",
    action_set_worker=f"{_IG}.admission.set_worker",
    action_set_result_dst="HomaggEgress.set_result_dst",
    action_set_uplink=None,
    action_set_parent=None,
    counter_stats=f"{_IG}.stats",
    counter_job_stats=f"{_IG}.job_stats",
    counter_fwd_stats=f"{_IG}.fwd_stats",
    max_workers=32,  # p4/tofino/include/size.p4: TNA_MAX_WORKERS
    words=64,        # p4/tofino/include/size.p4: WORDS_PER_PACKET
    p4info_file=TOFINO_P4INFO_FILE,
)

#: by the name a config's ``[switch] target`` (or ``--target``) gives
PROGRAMS = {"bmv2": V1MODEL, "soft": V1MODEL, "tofino": TOFINO}


def program_of(sw: Any) -> Program:
    """The program a switch runs: its ``program`` attribute, else the v1model program."""
    p = getattr(sw, "program", None)
    return p if isinstance(p, Program) else V1MODEL
