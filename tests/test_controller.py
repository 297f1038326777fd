"""Controller logic that needs no switch: config parsing, region allocation, what gets written."""

from __future__ import annotations

import pytest

from homagg import _p4consts as P4
from homagg import wire
from homagg.controller import jobs
from homagg.controller.cli import main as ctl
from homagg.controller.local import LocalSwitch
from homagg.controller.p4client import SwitchError, TableEntry
from homagg.netconfig import ConfigError, load, parse, render
from homagg.regions import allocate_region
from homagg.targets.soft import SoftSwitch

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
key = 0xC0FFEE42
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
    assert job.key == 0xC0FFEE42
    assert job.workers[1].udp_port == 50000 and job.workers[1].switch_port == 2


@pytest.mark.parametrize("edit,message", [
    (('ip = "10.0.0.254"', 'ip = "10.0.0.999"'), "switch.ip"),
    (('mac = "00:00:0a:00:00:01"', 'mac = "nope"'), r"hosts\[0\].mac"),
    (('{ host = "h2" }', '{ host = "h7" }'), "unknown host 'h7'"),
    (("slots = 32", "slots = 5000"), "slots"),
    (("id = 3", "id = 64"), "id"),
    (("key = 0xC0FFEE42", "key = 0x1C0FFEE42"), r"jobs\[0\].key"),
    (("key = 0xC0FFEE42", "key = -1"), r"jobs\[0\].key"),
    (("key = 0xC0FFEE42\n", ""), r"^jobs\[0\].key: missing: every job needs one, 1 to "
                                r"2\*\*32 - 1, which its agents give too \(HOMAGG_JOB_KEY\); "
                                r"one drawn at random: key = 0x[0-9a-f]{8}$"),
    (("key = 0xC0FFEE42", "key = 0"), r"^jobs\[0\].key: 0 is no key: every job needs one"),
    (('{ host = "h2" }', '{ host = "h1", udp_port = 50000 }'), "listed twice"),
    (('name = "s9"', 'name = "s9"\ncolour = "blue"'), "unknown key"),
    (("port = 2", ""), "missing 'port'"),
    (('{ host = "h2" } ]', '{ host = "h2" } ]\nplace = "moon"'), "place: 'moon'"),
    (('{ host = "h2" } ]', '{ host = "h2" } ]\nplace = "fallback"'), "no \\[fallback\\]"),
    (('mac = "00:00:0a:00:00:fe"', 'mac = "00:00:0a:00:00:fe"\nslots = 0'), "switch.slots"),
    (('[[hosts]]', '[fallback]\nip = "10.0.0.253"\nhue = 1\n\n[[hosts]]'),
     r"\[fallback\]: unknown key\(s\) hue"),
    (('[[hosts]]', '[fallback]\nip = "nowhere"\n\n[[hosts]]'), "fallback.ip"),
])
def test_bad_config_names_the_problem(edit, message):
    with pytest.raises(ConfigError, match=message):
        parse(__import__("tomllib").loads(GOOD.replace(*edit, 1)))


def test_fallback_and_places_parse_and_render_back():
    text = GOOD.replace('mac = "00:00:0a:00:00:fe"\n', 'mac = "00:00:0a:00:00:fe"\nslots = 48\n'
                        '\n[fallback]\nname = "fb"\nip = "10.0.0.253"\n'
                        'grpc = "unix:/tmp/fb.sock"\nport = 9\n')
    text = text.replace('{ host = "h2" } ]', '{ host = "h2" } ]\nplace = "fallback"')
    cfg = parse(__import__("tomllib").loads(text))
    assert cfg.switch.slots == 48 and cfg.fallback is not None
    assert (cfg.fallback.ip, cfg.fallback.grpc, cfg.fallback.port) == ("10.0.0.253",
                                                                       "unix:/tmp/fb.sock", 9)
    assert cfg.fallback.mac == wire.DEFAULT_FALLBACK_MAC and cfg.job(3).place == "fallback"
    assert parse(__import__("tomllib").loads(render(cfg))) == cfg
    plain = parse(__import__("tomllib").loads(GOOD))
    assert plain.fallback is None and plain.switch.slots is None
    assert parse(__import__("tomllib").loads(render(plain))) == plain


def test_a_child_jobs_uplink_parses_renders_back_and_stays_on_its_switch():
    from homagg.netconfig import Uplink

    toml = __import__("tomllib")
    text = GOOD + 'uplink = { job = 7, worker = 1, ip = "10.0.1.254", port = 9, key = 77 }\n'
    cfg = parse(toml.loads(text))
    assert cfg.job(3).uplink == Uplink(7, 1, "10.0.1.254", wire.HOMAGG_UDP_PORT_MIN,
                                       "00:00:00:00:00:00", wire.HOMAGG_UDP_PORT_MIN, 9, 77)
    assert parse(toml.loads(render(cfg))) == cfg
    with pytest.raises(ConfigError, match="missing 'ip'"):
        parse(toml.loads(GOOD + "uplink = { job = 7, worker = 1 }\n"))
    with pytest.raises(ConfigError, match="unknown key"):
        parse(toml.loads(text.replace("port = 9", "port = 9, spine = 1")))
    with pytest.raises(ConfigError, match="not place 'fallback'"):
        parse(toml.loads(text.replace(
            'mac = "00:00:0a:00:00:fe"\n', 'mac = "00:00:0a:00:00:fe"\n\n[fallback]\n', 1)
            + 'place = "fallback"\n'))


def test_unreadable_config_is_one_line(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[switch\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load(p)


# -- region allocation --------------------------------------------------------------------


def test_regions_are_first_fit_and_never_overlap():
    taken = []
    for size in (100, 200, 50):
        base = allocate_region(size, taken)
        r = range(base, base + size)
        assert all(not set(r) & set(t) for t in taken)
        taken.append(r)
    assert [t.start for t in taken] == [0, 100, 300]
    taken.pop(1)  # a hole of 200 at 100
    assert allocate_region(150, taken) == 100
    assert allocate_region(250, taken) == 350


def test_a_job_that_does_not_fit_says_so():
    with pytest.raises(jobs.JobError, match="no free region of 600 slots"):
        allocate_region(600, [range(0, 500)], slots=1024)
    with pytest.raises(jobs.JobError, match="cannot exist"):
        allocate_region(0, [])


# -- what the controller writes, against a fake switch ----------------------------------



def local() -> LocalSwitch:
    """A software aggregator's switch, driven in process as P4Runtime drives bmv2: the tests
    below see the controller's writes as a switch holds them."""
    return LocalSwitch(SoftSwitch())

def test_every_name_the_controller_uses_is_in_the_p4info():
    """The controller's names come from the generated P4Info constants; the in-process switch
    checks every entry against P4Info, so a renamed table or key fails here, not on a switch."""
    for name in (P4.TABLE_LOCAL_IP, P4.TABLE_ARP_PROXY, P4.TABLE_IPV4_ROUTE,
                 P4.TABLE_JOB_WORKERS, P4.TABLE_RESULT_DST):
        assert P4.SCHEMA.has_table(name)
    for name in (P4.COUNTER_STATS, P4.COUNTER_JOB_STATS, P4.COUNTER_FWD_STATS):
        assert P4.SCHEMA.has_counter(name)
    assert set(P4.SCHEMA.table(P4.TABLE_JOB_WORKERS).field_names) == {"src_addr", "src_port"}


def test_the_in_process_switch_refuses_what_p4runtime_refuses():
    sw = local()
    e = TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 1}, P4.ACTION_TO_SWITCH)
    sw.insert(e)
    with pytest.raises(SwitchError, match="ALREADY_EXISTS"):
        sw.insert(e)
    sw.insert(e, or_modify=True)  # idempotent re-install
    with pytest.raises(SwitchError, match="NOT_FOUND"):
        sw.modify(TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 2}, P4.ACTION_TO_SWITCH))
    with pytest.raises(SwitchError, match="match fields"):
        sw.insert(TableEntry(P4.TABLE_LOCAL_IP, {"hdr.ipv4.dst_addr": 1}, P4.ACTION_TO_SWITCH))
    with pytest.raises(SwitchError, match="not one of"):
        sw.insert(TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 3}, P4.ACTION_ROUTE,
                             {"port": 1, "src_mac": 0, "dst_mac": 0}))


def test_add_job_writes_workers_results_and_group():
    cfg = parse(__import__("tomllib").loads(GOOD))
    sw = local()
    jobs.install_base(sw, cfg)
    j = jobs.add_job(sw, cfg.job(3))
    assert (j.base, j.size, j.group) == (0, 32, 4) and j.epoch == 1
    assert len(sw.read(P4.TABLE_IPV4_ROUTE)) == 2
    assert len(sw.read(P4.TABLE_ARP_PROXY)) == 3  # the switch and both hosts
    workers = sw.read(P4.TABLE_JOB_WORKERS)
    assert len(workers) == 2
    first = min(workers, key=lambda e: e.params["worker"])
    assert first.match == {"src_addr": jobs.ip_int("10.0.0.1"), "src_port": 50000}
    assert first.params == {"job": 3, "worker": 0, "workers": 2, "epoch": 1, "region_base": 0,
                            "region_size": 32, "mcast_group": 4, "port": 1, "auth": 0xC0FFEE42}
    assert jobs.list_jobs(sw)[0].key == 0xC0FFEE42 and j.to_json()["keyed"]
    assert sw.read_multicast_groups()[4] == [(1, 1), (2, 2)]
    assert len(sw.read(P4.TABLE_RESULT_DST)) == 2
    assert jobs.list_jobs(sw)[0].senders == (jobs.Sender(0, "10.0.0.1", 50000, 1),
                                             jobs.Sender(1, "10.0.0.2", 50000, 2))
    # epochs are never reused, even by a controller that restarts (kept in a counter cell)
    assert sw.read_counter(P4.COUNTER_STATS)[wire.EPOCH_STORE].packets == 1
    assert jobs.reset_job(sw, 3).epoch == 2
    assert jobs.list_jobs(sw)[0].epoch == 2
    # installing the same base forwarding again modifies, never duplicates
    jobs.install_base(sw, cfg)
    assert len(sw.read(P4.TABLE_ARP_PROXY)) == 3


def test_second_job_gets_a_disjoint_region_and_cannot_steal_senders():
    cfg = parse(__import__("tomllib").loads(GOOD))
    sw = local()
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
    assert [x.id for x in jobs.list_jobs(sw)] == [5] and 4 not in sw.read_multicast_groups()


def test_a_tree_child_job_writes_its_uplink_and_parent_and_keeps_them_in_step():
    """A child job (uplink.p4): the uplink entry says where partials go, the parents entry lets
    the parent's answers in with this job's parameters; a reset moves both to the new epoch
    and a removal takes both away."""
    from dataclasses import replace

    from homagg.netconfig import Uplink

    cfg = parse(__import__("tomllib").loads(GOOD))
    sw = local()
    up = Uplink(7, 1, "10.0.1.254", wire.HOMAGG_UDP_PORT_MIN, "00:00:0a:00:01:fe",
                wire.HOMAGG_UDP_PORT_MIN, 9, 0xABCD0123)  # the parent job's key
    j = jobs.add_job(sw, replace(cfg.job(3), uplink=up))
    assert j.uplink == up and jobs.find_job(sw, 3).uplink == up
    (u,) = sw.read(P4.TABLE_UPLINK)
    assert u.match == {"job": 3} and u.params == {
        "job": 7, "worker": 1, "mac": jobs.mac_int(up.mac), "ip": jobs.ip_int(up.ip),
        "udp_port": up.udp_port, "src_port": up.src_port, "port": 9, "auth": 0xABCD0123}
    (par,) = sw.read(P4.TABLE_PARENTS)
    # the parent's answers carry its job's key; down here they carry this job's
    assert par.match == {"src_addr": jobs.ip_int(up.ip), "src_port": up.udp_port,
                         "parent_job": 7, "parent_auth": 0xABCD0123}
    assert par.params == {"job": 3, "workers": 2, "epoch": j.epoch, "region_base": j.base,
                          "region_size": j.size, "mcast_group": j.group, "port": 9,
                          "auth": 0xC0FFEE42}
    epoch = jobs.reset_job(sw, 3).epoch
    assert epoch != j.epoch and sw.read(P4.TABLE_PARENTS)[0].params["epoch"] == epoch
    assert jobs.find_job(sw, 3).to_json()["uplink"] == {"job": 7, "worker": 1,
                                                         "ip": up.ip, "udp_port": up.udp_port,
                                                         "src_port": up.src_port}
    jobs.remove_job(sw, 3)
    assert not sw.read(P4.TABLE_UPLINK) and not sw.read(P4.TABLE_PARENTS)


def test_remove_unknown_job_is_an_error():
    with pytest.raises(jobs.JobError, match="job 9 is not installed"):
        jobs.remove_job(local(), 9)


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


def test_list_jobs_skips_entries_that_admit_nobody():
    """A job_workers entry with another action (NoAction, written by another P4Runtime client)
    is no job's sender: listed jobs ignore it instead of failing on its missing params."""
    cfg = parse(__import__("tomllib").loads(GOOD))
    sw = local()
    jobs.add_job(sw, cfg.job(3))
    sw.insert(TableEntry(P4.TABLE_JOB_WORKERS, {"src_addr": jobs.ip_int("10.0.0.9"),
                                                "src_port": 50000}, "NoAction", {}))
    assert [j.id for j in jobs.list_jobs(sw)] == [3]
