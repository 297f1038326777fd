"""Controller logic that needs no switch: config parsing, region allocation, what gets written."""

from __future__ import annotations

import re

import pytest

from homagg import paths, wire
from homagg.controller import jobs
from homagg.controller.cli import main as ctl
from homagg.netconfig import ConfigError, load, parse

GOOD = """
[switch]
name = "s9"
grpc = "127.0.0.1:9560"
ip = "10.0.0.254"
mac = "00:00:0a:00:00:fe"

[[hosts]]
name = "h1"
ip = "10.0.0.1"
mac = "00:00:0a:00:00:01"
port = 1

[[hosts]]
name = "h2"
ip = "10.0.0.2"
mac = "00:00:0a:00:00:02"
port = 2

[[jobs]]
id = 3
slots = 32
workers = [ { host = "h1", udp_port = 50000 }, { host = "h2" } ]
"""


def test_config_parses_into_hosts_and_jobs(tmp_path):
    p = tmp_path / "net.toml"
    p.write_text(GOOD)
    cfg = load(p)
    assert cfg.switch.name == "s9" and cfg.switch.grpc == "127.0.0.1:9560"
    assert [h.name for h in cfg.hosts] == ["h1", "h2"]
    job = cfg.job(3)
    assert job.slots == 32 and [w.ip for w in job.workers] == ["10.0.0.1", "10.0.0.2"]
    assert job.workers[1].udp_port == 50000 and job.workers[1].switch_port == 2


@pytest.mark.parametrize("edit,message", [
    (('ip = "10.0.0.254"', 'ip = "10.0.0.999"'), "switch.ip"),
    (('mac = "00:00:0a:00:00:01"', 'mac = "nope"'), r"hosts\[0\].mac"),
    (('{ host = "h2" }', '{ host = "h7" }'), "unknown host 'h7'"),
    (("slots = 32", "slots = 5000"), "slots"),
    (("id = 3", "id = 64"), "id"),
    (('{ host = "h2" }', '{ host = "h1", udp_port = 50000 }'), "listed twice"),
    (('name = "s9"', 'name = "s9"\ncolour = "blue"'), "unknown key"),
    (("port = 2", ""), "missing 'port'"),
])
def test_bad_config_names_the_problem(edit, message):
    with pytest.raises(ConfigError, match=message):
        parse(__import__("tomllib").loads(GOOD.replace(*edit, 1)))


def test_unreadable_config_is_one_line(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[switch\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load(p)


# -- region allocation --------------------------------------------------------------------


def test_regions_are_first_fit_and_never_overlap():
    taken = []
    for size in (100, 200, 50):
        base = jobs.allocate_region(size, taken)
        r = range(base, base + size)
        assert all(not set(r) & set(t) for t in taken)
        taken.append(r)
    assert [t.start for t in taken] == [0, 100, 300]
    taken.pop(1)  # a hole of 200 at 100
    assert jobs.allocate_region(150, taken) == 100
    assert jobs.allocate_region(250, taken) == 350


def test_a_job_that_does_not_fit_says_so():
    with pytest.raises(jobs.JobError, match="no free region of 600 slots"):
        jobs.allocate_region(600, [range(0, 500)], slots=1024)
    with pytest.raises(jobs.JobError, match="cannot exist"):
        jobs.allocate_region(0, [])


# -- what the controller writes, against a fake switch ----------------------------------


class FakeSwitch:
    """Records writes; answers reads from what was written (as the switch would)."""

    def __init__(self):
        self.tables: dict[str, dict] = {}
        self.groups: dict[int, list] = {}
        self.counters: dict[str, dict] = {}

    def insert(self, table, match, action, params=None, replace=False):
        key = tuple(sorted(match.items()))
        if key in self.tables.setdefault(table, {}) and not replace:
            raise jobs.SwitchError("already exists")
        self.tables[table][key] = (action, dict(params or {}))

    def modify(self, table, match, action, params=None):
        self.tables[table][tuple(sorted(match.items()))] = (action, dict(params or {}))

    def delete(self, table, match):
        del self.tables[table][tuple(sorted(match.items()))]

    def read_table(self, table):
        out = []
        for key, (action, params) in self.tables.get(table, {}).items():
            match = {k: (jobs.ip_int(v) if isinstance(v, str) else v) for k, v in key}
            out.append((match, action, params))
        return out

    def set_multicast_group(self, group, replicas):
        self.groups[group] = list(replicas)

    def delete_multicast_group(self, group):
        del self.groups[group]

    def read_counter(self, name):
        return dict(self.counters.get(name, {}))

    def write_counter(self, name, values):
        self.counters.setdefault(name, {}).update(values)


def p4_names() -> set[str]:
    """Every table, action and counter instance named in the P4 source."""
    text = "".join(p.read_text() for p in paths.p4_dir().rglob("*.p4"))
    return set(re.findall(r"\b(?:table|action)\s+(\w+)", text)) | \
        set(re.findall(r"counter\([^)]*\)\s+(\w+);", text))


def test_every_name_the_controller_writes_exists_in_the_p4_source():
    names = p4_names()
    for full in (jobs.T_LOCAL_IP, jobs.T_ARP, jobs.T_ROUTE, jobs.T_JOB, jobs.T_RESULT,
                 jobs.C_STATS, jobs.C_JOB_STATS, jobs.C_FWD_STATS):
        assert full.rsplit(".", 1)[1] in names, full


def test_add_job_writes_workers_results_and_group():
    cfg = parse(__import__("tomllib").loads(GOOD))
    sw = FakeSwitch()
    jobs.install_base(sw, cfg)
    j = jobs.add_job(sw, cfg.job(3))
    assert (j.base, j.size, j.group) == (0, 32, 4) and j.epoch == 1
    assert jobs.T_JOB in sw.tables and len(sw.tables[jobs.T_ROUTE]) == 2
    assert len(sw.tables[jobs.T_ARP]) == 3  # the switch and both hosts
    workers = sw.tables[jobs.T_JOB]
    assert len(workers) == 2
    params = min((p for _, p in workers.values()), key=lambda p: p["worker"])
    assert params == {"job": 3, "worker": 0, "workers": 2, "epoch": 1, "region_base": 0,
                      "region_size": 32, "mcast_group": 4, "port": 1}
    assert sw.groups[4] == [(1, 1), (2, 2)]
    assert len(sw.tables[jobs.T_RESULT]) == 2
    assert jobs.list_jobs(sw)[0].workers == ((0, "10.0.0.1", 50000), (1, "10.0.0.2", 50000))
    # epochs are never reused, even by a controller that restarts (kept in a counter cell)
    assert sw.counters[jobs.C_STATS][wire.EPOCH_STORE][0] == 1
    assert jobs.reset_job(sw, 3)["epoch"] == 2


def test_second_job_gets_a_disjoint_region_and_cannot_steal_senders():
    cfg = parse(__import__("tomllib").loads(GOOD))
    sw = FakeSwitch()
    jobs.add_job(sw, cfg.job(3))
    with pytest.raises(jobs.JobError, match="already installed"):
        jobs.add_job(sw, cfg.job(3))
    from homagg.netconfig import validate_job

    thief = validate_job(4, [cfg.job(3).workers[0]], 8)
    with pytest.raises(jobs.JobError, match="already sends for job 3"):
        jobs.add_job(sw, thief)
    other = validate_job(5, [cfg.job(3).workers[0].__class__("10.0.0.9", 1, "00:00:00:00:00:09",
                                                               3)], 8)
    j = jobs.add_job(sw, other)
    assert j.base == 32
    jobs.remove_job(sw, 3)
    assert [x.id for x in jobs.list_jobs(sw)] == [5] and 4 not in sw.groups


def test_remove_unknown_job_is_an_error():
    with pytest.raises(jobs.JobError, match="job 9 is not installed"):
        jobs.remove_job(FakeSwitch(), 9)


# -- CLI errors are one line and a non-zero exit ---------------------------------------


def test_cli_unreachable_switch(capsys):
    assert ctl(["--grpc", "127.0.0.1:1", "job", "list"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unreachable" in err[0]


def test_cli_missing_config(capsys):
    assert ctl(["-c", "/nonexistent.toml", "install"]) == 1
    assert "not found" in capsys.readouterr().err


def test_cli_job_add_needs_a_config(capsys, monkeypatch):
    class Dummy:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            pass

    monkeypatch.setattr("homagg.controller.cli._connect", lambda *a, **k: Dummy())
    assert ctl(["job", "add", "1"]) == 1
    assert "needs --config" in capsys.readouterr().err
