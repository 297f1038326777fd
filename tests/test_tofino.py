"""The control plane of the TNA program (Tofino), with no compiler and no switch: its P4Info
(shipped, p4c-barefoot's own output) against the names the job logic uses, and the job logic
installing, listing and removing jobs on a switch that holds that P4Info's tables."""

from __future__ import annotations

import tomllib

import pytest

from homagg import _p4consts as P4
from homagg import wire
from homagg.controller import jobs
from homagg.controller.p4client import SwitchError, TableEntry
from homagg.controller.schema_switch import SchemaSwitch
from homagg.netconfig import parse, validate_job
from homagg.programs import PROGRAMS, TOFINO, TOFINO_P4INFO_FILE, V1MODEL, program_of
from tests.test_controller import GOOD

pytest.importorskip("p4.config.v1.p4info_pb2", reason="the controller extra (p4runtime)")


def test_the_tna_p4info_is_shipped_and_has_every_name_the_job_logic_uses():
    assert TOFINO_P4INFO_FILE.is_file()
    s = TOFINO.schema
    for role, name in TOFINO.names().items():
        kind = role.split("_", 1)[0]
        has = {"table": s.has_table, "action": s.has_action, "counter": s.has_counter}[kind]
        assert has(name), f"{role}: {name} is not in {TOFINO_P4INFO_FILE.name}"
    assert not TOFINO.supports_trees and V1MODEL.supports_trees


def test_the_tna_tables_take_the_v1model_keys_and_parameters():
    """Only names differ: the job logic writes the same keys and parameters to both."""
    for role in ("table_local_ip", "table_arp_proxy", "table_ipv4_route", "table_aggregators",
                 "table_job_workers", "table_result_dst"):
        mine = TOFINO.schema.table(getattr(TOFINO, role))
        theirs = V1MODEL.schema.table(getattr(V1MODEL, role))
        assert [(f.name, f.bitwidth, f.match_type) for f in mine.match_fields] == \
            [(f.name, f.bitwidth, f.match_type) for f in theirs.match_fields], role
        assert mine.size == theirs.size, role
    for role in ("action_to_switch", "action_arp_reply", "action_route", "action_trusted",
                 "action_set_worker", "action_set_result_dst"):
        mine_a = TOFINO.schema.action(getattr(TOFINO, role))
        theirs_a = V1MODEL.schema.action(getattr(V1MODEL, role))
        assert [(p.name, p.bitwidth) for p in mine_a.params] == \
            [(p.name, p.bitwidth) for p in theirs_a.params], role
    for role, size in (("counter_stats", wire.STATS_SIZE),
                       ("counter_job_stats", wire.JOB_STATS_SIZE),
                       ("counter_fwd_stats", P4.FWD_STATS_SIZE)):
        assert TOFINO.schema.counter(getattr(TOFINO, role)).size == size, role


def test_the_job_logic_installs_lists_resets_and_removes_a_job_on_tofino():
    cfg = parse(tomllib.loads(GOOD))
    sw = SchemaSwitch(TOFINO)
    assert program_of(sw) is TOFINO and PROGRAMS["tofino"] is TOFINO
    jobs.install_base(sw, cfg)
    assert len(sw.read(TOFINO.table_arp_proxy)) == 3  # the switch and both hosts
    assert len(sw.read(TOFINO.table_ipv4_route)) == 2
    j = jobs.add_job(sw, cfg.job(3))
    assert (j.base, j.size, j.group, j.epoch) == (0, 32, 4, 1)
    workers = sorted(sw.read(TOFINO.table_job_workers), key=lambda e: e.params["worker"])
    assert [e.match for e in workers] == [
        {"src_addr": jobs.ip_int("10.0.0.1"), "src_port": 50000},
        {"src_addr": jobs.ip_int("10.0.0.2"), "src_port": 50000}]
    assert workers[0].action == TOFINO.action_set_worker
    assert workers[0].params == {"job": 3, "worker": 0, "workers": 2, "epoch": 1,
                                 "region_base": 0, "region_size": 32, "mcast_group": 4,
                                 "port": 1, "auth": 0xC0FFEE42}
    assert sw.read_multicast_groups()[4] == [(1, 1), (2, 2)]
    assert {(e.match["job"], e.match["rid"]) for e in sw.read(TOFINO.table_result_dst)} == \
        {(3, 1), (3, 2)}
    listed = jobs.list_jobs(sw)
    assert [(x.id, x.workers, x.key) for x in listed] == [(3, 2, 0xC0FFEE42)]
    # the epoch store and the job's counters are the TNA program's stats counters
    assert sw.read_counter(TOFINO.counter_stats)[wire.EPOCH_STORE].packets == 1
    assert jobs.reset_job(sw, 3).epoch == 2
    assert {e.params["epoch"] for e in sw.read(TOFINO.table_job_workers)} == {2}
    stats = jobs.read_stats(sw)
    assert set(stats.jobs) == {3} and stats.switch["DROP_SPOOFED"] == 0
    jobs.remove_job(sw, 3)
    assert jobs.list_jobs(sw) == [] and sw.read(TOFINO.table_result_dst) == []
    assert 4 not in sw.read_multicast_groups()


def test_a_tofino_switch_refuses_a_job_it_cannot_hold():
    cfg = parse(tomllib.loads(GOOD))
    sw = SchemaSwitch(TOFINO)
    w = cfg.job(3).workers[0]
    big = validate_job(5, [w.__class__(f"10.0.1.{i}", 50000, w.mac, 1) for i in range(33)], 8)
    with pytest.raises(jobs.JobError, match="at most 32"):
        jobs.add_job(sw, big)
    from homagg.netconfig import Uplink

    child = validate_job(6, [w], 8)
    child = child.__class__(child.id, child.workers, child.slots, child.place,
                            Uplink(1, 0, "10.0.9.9", 48864, "00:00:00:00:00:09", 48870, 3, 7),
                            child.key)
    with pytest.raises(jobs.JobError, match="no uplink"):
        jobs.add_job(sw, child)
    assert sw.read(TOFINO.table_job_workers) == []


def test_the_schema_switch_refuses_what_p4runtime_refuses():
    sw = SchemaSwitch(TOFINO)
    e = TableEntry(TOFINO.table_local_ip, {"dst_addr": 1}, TOFINO.action_to_switch)
    sw.insert(e)
    with pytest.raises(SwitchError, match="ALREADY_EXISTS"):
        sw.insert(e)
    sw.insert(e, or_modify=True)
    with pytest.raises(SwitchError, match="NOT_FOUND"):
        sw.delete(TableEntry(TOFINO.table_local_ip, {"dst_addr": 2}))
    assert V1MODEL.table_job_workers != TOFINO.table_job_workers
    with pytest.raises(SwitchError, match="INVALID_ARGUMENT"):  # the v1model program's name
        sw.insert(TableEntry(V1MODEL.table_job_workers, {"src_addr": 1, "src_port": 2},
                             V1MODEL.action_set_worker))
    with pytest.raises(SwitchError, match="INVALID_ARGUMENT"):  # wider than its field
        sw.insert(TableEntry(TOFINO.table_local_ip, {"dst_addr": 1 << 32},
                             TOFINO.action_to_switch))
    with pytest.raises(SwitchError, match="OUT_OF_RANGE"):
        sw.write_counter(TOFINO.counter_stats, {wire.STATS_SIZE: jobs.CounterValue()})


def test_a_status_without_a_count_is_counted_from_its_bitmap():
    """The TNA program keeps no count (docs/switch.md, "Tofino"): its status replies say 0,
    and the agent counts the contributors' bitmap; a count the switch gives is kept."""
    words = [0] * 61 + [0, 0b1011, 0]
    assert wire.parse_status(words) == (0b1011, 3)
    assert wire.parse_status([0] * 61 + [1, 0b1, 2]) == ((1 << 32) | 1, 2)
    assert wire.parse_status([0] * 64) == (0, 0)


def test_a_tofino_build_without_the_compiler_names_what_is_missing(monkeypatch, capsys):
    from homagg.controller.cli import main as ctl

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("HOMAGG_BF_P4C", raising=False)
    assert ctl(["build", "--target", "tofino"]) == 1
    err = capsys.readouterr().err
    assert "bf-p4c is not on PATH and $HOMAGG_BF_P4C is not set" in err
    assert "docs/deploy.md" in err
