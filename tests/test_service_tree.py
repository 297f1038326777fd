"""The controller service over a tree of switches (issue 49, item 2): the config that names the
switches, the placement's plan and refusals, and the service's joins, leases, leaves, reaping
and read-back across every switch of a job's tree, each switch a software aggregator's tables
in this process (``LocalSwitch``: the tables a P4Runtime server would serve). The data path
through real aggregators on loopback is in tests/test_service_tree_data.py."""

from __future__ import annotations

import threading

import pytest

from homagg import wire
from homagg.controller import jobs as J
from homagg.controller import treeplace as T
from homagg.controller.local import LocalSwitch
from homagg.controller.placement import Place, fallback_place, switch_place, tree_places
from homagg.controller.service import JobService, Refusal, ServeOptions
from homagg.controller.service_state import read_jobs_mark
from homagg.errors import ConfigError
from homagg.netconfig import parse, render
from homagg.targets.soft import SoftSwitch

SECRET = "the join secret of this test"
KEY = b"the job secrets' key, in a --key-file"


def tree_data(leaves: int = 2, middles: int = 0, slots: int | None = None,
              fallback: bool = False) -> dict:
    """A config: a spine, ``middles`` middle switches (0: leaves under the spine), and
    ``leaves`` leaves spread over them in order, leaf i's hosts in 10.1.i.0/24."""
    sw: list[dict] = []
    for m in range(middles):
        sw.append({"name": f"mid{m + 1}", "parent": "spine", "ip": f"10.0.9.{m + 1}",
                   "grpc": f"127.0.0.1:{9700 + m}"})
    for i in range(leaves):
        parent = f"mid{i * middles // leaves + 1}" if middles else "spine"
        sw.append({"name": f"leaf{i + 1}", "parent": parent, "ip": f"10.0.8.{i + 1}",
                   "mac": f"00:00:0a:00:08:{i + 1:02x}", "grpc": f"127.0.0.1:{9800 + i}",
                   "under": [f"10.1.{i}.0/24"], **({"slots": slots} if slots else {})})
    data = {"switch": {"name": "spine", "target": "soft", "grpc": "127.0.0.1:9600",
                       "ip": "10.0.0.254"}, "switches": sw}
    if fallback:
        data["fallback"] = {"name": "fb", "ip": "10.0.0.253", "grpc": "127.0.0.1:9601"}
    return data


def host(leaf: int, h: int) -> str:
    return f"10.1.{leaf}.{h + 1}"


class Switches:
    """Every place of a config as a software aggregator's tables in this process."""

    def __init__(self, cfg):
        names = [p.name for p in [switch_place(cfg), *tree_places(cfg)]]
        fb = fallback_place(cfg)
        names += [fb.name] if fb else []
        self.soft = {n: SoftSwitch() for n in names}

    def connect(self, place: Place) -> LocalSwitch:
        return LocalSwitch(self.soft[place.name], place.name)

    def jobs(self, name: str) -> list[J.InstalledJob]:
        return J.list_jobs(LocalSwitch(self.soft[name], name))

    def mark(self, name: str) -> int:
        return read_jobs_mark(LocalSwitch(self.soft[name], name))


def plan_of(cfg, ranks, slots=16, installed=None):
    places = {p.name: p for p in [switch_place(cfg), *tree_places(cfg)]}
    return T.plan(cfg, places, fallback_place(cfg), 5, "job", ranks, slots, installed or {})


# -- the config ----------------------------------------------------------------------------------

def test_a_three_level_tree_config_reads_back_as_written():
    cfg = parse(tree_data(leaves=4, middles=2, slots=512))
    assert [(s.name, s.parent) for s in cfg.switches] == [
        ("mid1", "spine"), ("mid2", "spine"), ("leaf1", "mid1"), ("leaf2", "mid1"),
        ("leaf3", "mid2"), ("leaf4", "mid2")]
    assert parse_text(render(cfg)) == cfg
    tree = T.tree_of(cfg)
    assert tree.switch_of("10.1.2.77") == "leaf3" and tree.switch_of("10.2.0.1") is None
    assert tree.top(["leaf1", "leaf2"]) == "mid1" and tree.top(["leaf1", "leaf4"]) == "spine"


def parse_text(text: str):
    import tomllib

    return parse(tomllib.loads(text))


@pytest.mark.parametrize("change, message", [
    (lambda d: d["switches"][0].update(parent="nowhere"),
     r"leaf1's parent 'nowhere' is neither \[switch\] \(spine\) nor one of \[\[switches\]\]"),
    (lambda d: d["switches"][1].update(under=["10.1.0.128/25"]),
     r"10.1.0.128/25 under leaf2 overlaps 10.1.0.0/24 under leaf1: a host sits under one"),
    (lambda d: d["switches"][1].update(name="leaf1"), r"the name 'leaf1' is taken twice"),
    (lambda d: d["switches"][0].update(under=["10.1.0.300/24"]),
     r"switches\[0\].under: '10.1.0.300/24' is not an IPv4 network or address"),
    (lambda d: d["switches"].extend([{"name": "a", "parent": "b", "ip": "10.0.7.1",
                                      "grpc": "x:1"},
                                     {"name": "b", "parent": "a", "ip": "10.0.7.2",
                                      "grpc": "x:2"}]),
     r"a's parents loop back to a"),
    (lambda d: d["switches"][0].update(target="tofino"),
     r"switches\[0\].target: 'tofino' is not one of bmv2, soft"),
])
def test_a_wrong_tree_config_is_refused_naming_the_key(change, message):
    data = tree_data()
    change(data)
    with pytest.raises(ConfigError, match=message):
        parse(data)


# -- the plan ------------------------------------------------------------------------------------

def test_sixteen_hosts_under_two_leaves_are_two_child_jobs_under_the_spine():
    cfg = parse(tree_data())
    ranks = {r: (host(r % 2, r // 2), 20000) for r in range(16)}  # ranks alternate leaves
    tp = plan_of(cfg, ranks)
    assert [(sj.name, len(sj.spec.workers)) for sj in tp.jobs] == \
        [("spine", 2), ("leaf1", 8), ("leaf2", 8)]
    spine, leaf1, leaf2 = tp.jobs
    assert spine.spec.uplink is None and spine.send_port == wire.HOMAGG_UDP_PORT_MIN
    assert [(w.ip, w.udp_port, w.host) for w in spine.spec.workers] == \
        [("10.0.8.1", 0xBEE0, "leaf1"), ("10.0.8.2", 0xBEE0, "leaf2")]
    for i, leaf in enumerate([leaf1, leaf2]):
        u = leaf.spec.uplink
        assert (u.job, u.worker, u.ip, u.src_port, u.key) == (5, i, "10.0.0.254", 0xBEE0,
                                                              spine.spec.key)
        assert leaf.ranks == tuple(range(i, 16, 2))  # its ranks, in rank order
    assert len({sj.spec.key for sj in tp.jobs}) == 3  # a key per switch (1 in 2**31 to fail)
    assert tp.tree and tp.at(3) == (leaf2, 1) and tp.siblings(3) == ("leaf1", "leaf2")


def test_a_job_under_one_leaf_stays_on_that_leaf_alone():
    cfg = parse(tree_data(leaves=4, middles=2))
    tp = plan_of(cfg, {r: (host(2, r), 20000) for r in range(5)})
    (only,) = tp.jobs
    assert (only.name, only.spec.uplink, only.send_port, tp.tree) == \
        ("leaf3", None, wire.HOMAGG_UDP_PORT_MIN, False)
    assert tp.siblings(0) == ()


def test_a_three_level_job_goes_up_as_far_as_its_hosts_need():
    cfg = parse(tree_data(leaves=4, middles=2))
    under_mid1 = plan_of(cfg, {0: (host(0, 0), 1), 1: (host(1, 0), 1)})
    assert [sj.name for sj in under_mid1.jobs] == ["mid1", "leaf1", "leaf2"]
    across = plan_of(cfg, {0: (host(0, 0), 1), 1: (host(3, 0), 1), 2: (host(3, 1), 1)})
    assert [(sj.name, len(sj.spec.workers)) for sj in across.jobs] == \
        [("spine", 2), ("mid1", 1), ("mid2", 1), ("leaf1", 1), ("leaf4", 2)]
    leaf4 = across.jobs[-1]
    assert (leaf4.spec.uplink.ip, leaf4.spec.uplink.worker) == ("10.0.9.2", 0)


def test_a_leaf_with_more_than_64_workers_refuses_the_job_naming_it():
    cfg = parse(tree_data())
    ranks = {r: (host(0, r), 20000) for r in range(65)} | {65: (host(1, 0), 20000)}
    with pytest.raises(Refusal) as e:
        plan_of(cfg, ranks)
    assert e.value.code == "FAILED_PRECONDITION"
    assert str(e.value) == ("job 'job' (66 workers) does not fit the tree: leaf1 would hold "
                            "65 of its workers (65 ranks under it, 0 switches below), at most "
                            "64 per switch")


def test_a_leaf_short_of_slots_refuses_the_job_naming_it():
    cfg = parse(tree_data(slots=32))
    taken = J.InstalledJob(9, (), 1, 0, 24, 10)
    with pytest.raises(Refusal) as e:
        plan_of(cfg, {0: (host(0, 0), 1), 1: (host(1, 0), 1)}, slots=16,
                installed={"leaf2": [taken]})
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert str(e.value) == ("job 'job' (2 workers) does not fit the tree: leaf2 has no free "
                            "region of 16 slots (8 of 32 free, fragmented or in use)")


def test_the_root_falls_back_where_the_spine_is_full_and_its_leaves_go_up_there():
    cfg = parse(tree_data(fallback=True))
    full = J.InstalledJob(9, (), 1, 0, wire.SLOTS, 10)
    tp = plan_of(cfg, {0: (host(0, 0), 1), 1: (host(1, 0), 1)}, installed={"spine": [full]})
    assert [(sj.name, sj.place.name) for sj in tp.jobs] == \
        [("spine", "fb"), ("leaf1", "leaf1"), ("leaf2", "leaf2")]
    assert {sj.spec.uplink.ip for sj in tp.jobs[1:]} == {"10.0.0.253"}


def test_a_leaf_goes_up_from_a_port_its_parent_does_not_still_have_it_send_from():
    """leaf1 started again, empty, while the spine still holds a failed job's part whose
    worker is leaf1 at 0xBEE0 (not removed yet): a new job's leaf1 part goes up from 0xBEE1,
    not refused later as 'already sends for job 9'."""
    cfg = parse(tree_data())
    stale = J.InstalledJob(9, (J.Sender(0, "10.0.8.1", 0xBEE0, 0),
                               J.Sender(1, "10.0.8.2", 0xBEE0, 0)), 1, 0, 16, 10)
    tp = plan_of(cfg, {0: (host(0, 0), 1), 1: (host(1, 0), 1)}, installed={"spine": [stale]})
    assert [sj.spec.uplink.src_port for sj in tp.jobs[1:]] == [0xBEE1, 0xBEE1]


def test_a_leaf_with_every_uplink_port_taken_refuses_the_job():
    cfg = parse(tree_data())
    from homagg.netconfig import Uplink

    ups = [J.InstalledJob(20 + k, (), 1, 16 * k, 4, 1, Uplink(20 + k, 0, "10.0.0.254",
                                                               src_port=p))
           for k, p in enumerate(wire.HOMAGG_UDP_PORTS)]
    with pytest.raises(Refusal) as e:
        plan_of(cfg, {0: (host(0, 0), 1), 1: (host(1, 0), 1)}, slots=4,
                installed={"leaf1": ups})
    assert str(e.value) == ("job 'job' (2 workers) does not fit the tree: leaf1 has no free "
                            "uplink port to spine (all 16, 0xbee0-0xbeef, carry its child "
                            "jobs there)")
    # one port free: the job goes up from it
    tp = plan_of(cfg, {0: (host(0, 0), 1), 1: (host(1, 0), 1)}, slots=4,
                 installed={"leaf1": ups[:7] + ups[8:]})
    assert tp.jobs[1].spec.uplink.src_port == tp.jobs[1].send_port == 0xBEE7


@pytest.mark.parametrize("key,where", [("ip", "leaf1"), ("grpc", "leaf1"), ("ip", "spine"),
                                       ("grpc", "fb")])
def test_two_switches_of_a_tree_at_one_address_are_a_config_error(key, where):
    data = tree_data(fallback=True)
    place = {"spine": data["switch"], "fb": data["fallback"]}.get(where) or data["switches"][0]
    place[key] = data["switches"][1][key]  # leaf2's
    with pytest.raises(ConfigError) as e:
        parse(data)
    said = str(e.value)
    assert said.startswith("switches: ") and "leaf2 ([[switches]])" in said, said
    assert f"{where} ([" in said, said
    assert said.endswith(f"are both at {key} {place[key]!r}: each switch of a tree needs "
                         "addresses of its own"), said


def test_an_address_under_no_switch_is_refused():
    cfg = parse(tree_data())
    with pytest.raises(Refusal, match=r"rank 1's address 10.9.9.9 sits under no switch"):
        plan_of(cfg, {0: (host(0, 0), 1), 1: ("10.9.9.9", 1)})


# -- the service ---------------------------------------------------------------------------------

class Service:
    """A JobService on in-process switches, with a clock the test moves."""

    def __init__(self, data: dict, lease: float = 10.0, switches: Switches | None = None):
        self.cfg = parse(data)
        self.sw = switches or Switches(self.cfg)
        self.now = 100.0
        self.down: set[str] = set()  # the places that refuse connections (a probe's view)
        self.svc = JobService(self.cfg, self.sw.connect, ServeOptions(
            token=None, lease=lease, slots=16, key=KEY, max_joins=4096),
            clock=lambda: self.now, answers=lambda pl: pl.name not in self.down)
        self.svc.recover()

    def join_all(self, name: str, addrs: list[tuple[str, int]]) -> dict:
        out: dict = {}

        def one(r):
            try:
                out[r] = self.svc.join(name, r, len(addrs), *addrs[r], wait=30.0, secret=SECRET)
            except Refusal as e:
                out[r] = e

        ts = [threading.Thread(target=one, args=(r,)) for r in range(len(addrs))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert len(out) == len(addrs)
        return out


def test_the_service_places_a_job_across_two_leaves_and_removes_it_from_all():
    s = Service(tree_data())
    addrs = [(host(r % 2, r // 2), 20000) for r in range(16)]
    answers = s.join_all("big", addrs)
    assert not [a for a in answers.values() if isinstance(a, Refusal)], answers
    a3 = answers[3]
    job = a3.job_id
    spine, leaf1, leaf2 = (s.sw.jobs(n) for n in ("spine", "leaf1", "leaf2"))
    assert [len(j) for j in (spine, leaf1, leaf2)] == [1, 1, 1]
    assert {spine[0].id, leaf1[0].id, leaf2[0].id} == {job}
    assert [(x.ip, x.udp_port) for x in leaf2[0].senders] == addrs[1::2]
    assert leaf2[0].uplink.ip == "10.0.0.254" and leaf2[0].uplink.key == spine[0].key
    # what rank 3 is told: its leaf, at its job's port; its id there; the job's size
    assert (a3.send_to, a3.place, a3.leaf_worker, a3.leaf_workers, a3.workers, a3.key) == \
        (("10.0.8.2", leaf2[0].uplink.src_port), "leaf2", 1, 8, 16, leaf2[0].key)
    assert a3.siblings == ("leaf1", "leaf2")
    assert sorted(a.worker for a in answers.values()) == list(range(16))
    assert all(s.sw.mark(n) == 1 << job for n in ("spine", "leaf1", "leaf2"))
    # leases: renewed with each worker's secret; the last to leave removes it everywhere
    for r, a in answers.items():
        s.svc.renew(job, a.worker, *addrs[r], a.secret)
    with pytest.raises(Refusal, match="no lease of this service with this secret"):
        s.svc.renew(job, a3.worker, *addrs[3], answers[4].secret)
    for r, a in sorted(answers.items()):
        assert s.svc.leave(job, a.worker, *addrs[r], a.secret) == (r == 15)
    assert [s.sw.jobs(n) for n in ("spine", "leaf1", "leaf2")] == [[], [], []]
    assert all(s.sw.mark(n) == 0 for n in ("spine", "leaf1", "leaf2"))


def test_a_restarted_service_reads_the_tree_job_back_and_reaps_it_everywhere():
    s = Service(tree_data(leaves=4, middles=2), lease=5.0)
    addrs = [(host(r % 4, r), 20000) for r in range(8)]
    answers = s.join_all("three-level", addrs)
    job = answers[0].job_id
    holding = ["spine", "mid1", "mid2", "leaf1", "leaf2", "leaf3", "leaf4"]
    assert all(len(s.sw.jobs(n)) == 1 for n in holding)
    s.svc.stop()
    again = Service(tree_data(leaves=4, middles=2), lease=5.0, switches=s.sw)
    (h,) = again.svc.held.values()
    assert (h.job_id, h.place.name, sorted(p.name for p in h.everywhere)) == \
        (job, "spine", sorted(holding))
    # the same workers, each known by the worker its answer named, its secret still good
    for r, a in answers.items():
        again.svc.renew(job, a.worker, *addrs[r], a.secret)
    with pytest.raises(Refusal, match="no lease of this service with this secret"):
        again.svc.renew(job, answers[0].worker, *addrs[1], answers[1].secret)
    # all but worker 0 keep renewing; its lease runs out and the job goes from every switch
    again.now += 4.0
    for r, a in answers.items():
        if r:
            again.svc.renew(job, a.worker, *addrs[r], a.secret)
    again.now += 2.0
    assert again.svc.reap() == [job]
    assert all(s.sw.jobs(n) == [] and s.sw.mark(n) == 0 for n in holding)
    with pytest.raises(Refusal, match="its lease ran out"):
        again.svc.renew(job, answers[1].worker, *addrs[1], answers[1].secret)


def test_a_job_the_tree_cannot_hold_is_refused_and_leaves_nothing():
    s = Service(tree_data(slots=16))
    first = s.join_all("first", [(host(0, 0), 20000), (host(1, 0), 20000)])
    assert not isinstance(first[0], Refusal)
    second = s.join_all("second", [(host(0, 1), 20000), (host(1, 1), 20000)])
    assert isinstance(second[0], Refusal) and second[0].code == "RESOURCE_EXHAUSTED"
    assert str(second[0]) == ("job 'second' (2 workers) does not fit the tree: leaf1 has no "
                              "free region of 16 slots (0 of 16 free, fragmented or in use); "
                              "leaf2 has no free region of 16 slots (0 of 16 free, fragmented "
                              "or in use)")
    assert [len(s.sw.jobs(n)) for n in ("spine", "leaf1", "leaf2")] == [1, 1, 1]


def test_a_world_past_the_tree_is_refused_at_the_join():
    s = Service(tree_data())
    with pytest.raises(Refusal, match=r"world size 129: 1 to 128 workers per job on this "
                                      r"tree of switches"):  # (64 under each of 2 leaves)
        s.svc.join("x", 0, 129, host(0, 0), 20000, secret=SECRET)
    with pytest.raises(Refusal, match=r"10.7.0.1 sits under no switch of the tree"):
        s.svc.join("x", 0, 2, "10.7.0.1", 20000, secret=SECRET)


def test_metrics_and_job_remove_cover_every_switch_of_the_tree():
    pytest.importorskip("prometheus_client")
    from homagg.controller.metrics import SwitchCollector
    from homagg.controller.placement import Fabric

    s = Service(tree_data())
    answers = s.join_all("watched", [(host(0, 0), 20000), (host(1, 0), 20000)])
    job = answers[0].job_id
    fams = {f.name: f for f in SwitchCollector(s.svc).collect()}
    up = {smp.labels["switch"]: smp.value for smp in fams["homagg_switch_up"].samples}
    assert up == {"spine": 1, "leaf1": 1, "leaf2": 1}
    held = {(smp.labels["switch"], smp.labels["job"]): smp.value
            for smp in fams["homagg_job_slots"].samples}
    assert held == {("spine", str(job)): 16, ("leaf1", str(job)): 16, ("leaf2", str(job)): 16}
    # homagg-ctl job remove (Fabric.remove) takes a tree's job off every switch
    with Fabric(s.cfg, s.sw.connect) as f:
        assert f.remove(job).place.name == "spine"
    assert [s.sw.jobs(n) for n in ("spine", "leaf1", "leaf2")] == [[], [], []]


def test_a_leaf_back_from_the_dead_still_holding_a_failed_job_is_cleaned_of_it():
    """leaf1 stops answering (its tables kept, as a switch cut off and reconnected): the
    probe fails the job by name and frees the spine and leaf2; a join that needs leaf1 is
    refused, naming it. leaf1 answers again: the job is removed there too, nothing owed."""
    s = Service(tree_data())
    addrs = [(host(0, 0), 20000), (host(1, 0), 20000)]
    answers = s.join_all("across", addrs)
    job = answers[0].job_id
    s.down.add("leaf1")
    s.svc.probe()
    assert [s.sw.jobs(n) for n in ("spine", "leaf2")] == [[], []]
    assert [j.id for j in s.sw.jobs("leaf1")] == [job] and s.svc.owed == {job: ["leaf1"]}
    with pytest.raises(Refusal, match=r"\(across\) was removed: switch leaf1 \(127.0.0.1:9800\) "
                                      r"is unreachable \(nothing answers P4Runtime at "
                                      r"127.0.0.1:9800\): job \d+ failed"):
        s.svc.renew(job, answers[1].worker, *addrs[1], answers[1].secret)
    (refusal,) = s.join_all("needs-leaf1", [(host(0, 1), 20000)]).values()
    assert isinstance(refusal, Refusal) and refusal.code == "UNAVAILABLE"
    assert str(refusal) == ("job 'needs-leaf1' needs leaf1: switch leaf1 unreachable: nothing "
                            "answers P4Runtime at 127.0.0.1:9800 (join again once it is back)")
    under2 = s.join_all("under-leaf2", [(host(1, 1), 20000)])
    assert under2[0].place == "leaf2" and under2[0].job_id != job
    s.down.clear()
    s.svc.probe()
    assert s.sw.jobs("leaf1") == [] and s.sw.mark("leaf1") == 0
    assert s.svc.owed == {} and s.svc.dead == {}


def test_a_switch_that_restarted_empty_fails_the_job_it_lost():
    s = Service(tree_data())
    (a,) = s.join_all("under-leaf2", [(host(1, 0), 20000)]).values()
    s.sw.soft["leaf2"] = SoftSwitch()  # restarted between two probes: empty, no mark
    s.svc.probe()
    assert s.svc.held == {} and s.svc.owed == {}
    with pytest.raises(Refusal, match=r"was removed: switch leaf2 \(127.0.0.1:9801\) no longer "
                                      r"holds job \d+ \(it restarted"):
        s.svc.renew(a.job_id, a.worker, host(1, 0), 20000, a.secret)


def test_scrapes_at_once_share_a_reading_of_the_switches():
    """50 scrapes at once, each switch session slow (50 ms): they share at most three
    readings of the switches (not 50 in turn, each holding the lock a join needs)."""
    pytest.importorskip("prometheus_client")
    import time

    from homagg.controller.metrics import SwitchCollector

    s = Service(tree_data())
    s.join_all("watched", [(host(0, 0), 20000), (host(1, 0), 20000)])
    opened: list[str] = []

    def slow(place):
        opened.append(place.name)
        time.sleep(0.05)
        return s.sw.connect(place)

    s.svc._connect = slow
    collector = SwitchCollector(s.svc)
    got: list = []
    ts = [threading.Thread(target=lambda: got.append(list(collector.collect())))
          for _ in range(50)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert len(got) == 50 and all(g for g in got)
    assert len(opened) <= 3 * 3, len(opened)  # three places a reading, three readings at most


def test_a_hung_leaf_keeps_its_job_and_is_not_read_at_every_probe():
    """leaf1's port answers but no session opens (hung, or slow): its job keeps its lease (the
    data path may still run), and the probes read it again only after HUNG_RETRY, not every
    time (each try holds the lock joins need)."""
    import time

    from homagg.controller.p4client import SwitchError
    from homagg.controller.service_upkeep import HUNG_AFTER, HUNG_RETRY

    s = Service(tree_data())
    (a,) = s.join_all("under-leaf1", [(host(0, 0), 20000)]).values()
    tried: list[str] = []

    def hung(place):
        if place.name == "leaf1":
            tried.append(place.name)
            time.sleep(HUNG_AFTER)  # (what a hung switch takes to fail a session, at least)
            raise SwitchError("switch leaf1 at 127.0.0.1:9800: no P4Runtime session")
        return s.sw.connect(place)

    s.svc._connect = hung
    for _ in range(3):
        s.svc.probe()
        s.now += 1.0
    assert tried == ["leaf1"] and a.job_id in s.svc.held and s.svc.dead == {}
    s.svc.renew(a.job_id, a.worker, host(0, 0), 20000, a.secret)
    s.now += HUNG_RETRY
    s.svc.probe()
    assert tried == ["leaf1", "leaf1"]


def test_a_switch_that_refuses_a_session_at_once_is_read_at_every_probe():
    """A port that answers and a session refused at once ("no pipeline": a switch started
    again, not yet installed) is no hung switch: the next probe reads it again."""
    from homagg.controller.p4client import SwitchError

    s = Service(tree_data())
    s.join_all("under-leaf1", [(host(0, 0), 20000)])
    tried: list[str] = []

    def fresh(place):
        if place.name == "leaf1":
            tried.append(place.name)
            raise SwitchError("switch leaf1 has no pipeline; run homagg-ctl install")
        return s.sw.connect(place)

    s.svc._connect = fresh
    for _ in range(3):
        s.svc.probe()
        s.now += 1.0
    assert tried == ["leaf1"] * 3


class Recorded(Switches):
    """``Switches`` that record every write to any of them, in order, so that what a service
    killed (SIGKILL) at any write leaves behind can be built again: ``upto(k)``."""

    WRITES = ("insert", "modify", "delete", "write_counter", "set_multicast_group",
              "delete_multicast_group")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.cfg = cfg
        self.writes: list[tuple[str, str, tuple, dict]] = []

    def connect(self, place: Place) -> LocalSwitch:
        sw = super().connect(place)
        for name in self.WRITES:
            setattr(sw, name, self._kept(place.name, name, getattr(sw, name)))
        return sw

    def _kept(self, place: str, name: str, write):
        def kept(*a, **kw):
            self.writes.append((place, name, a, kw))
            return write(*a, **kw)
        return kept

    def upto(self, k: int) -> Switches:
        """Fresh switches that got the first ``k`` writes."""
        out = Switches(self.cfg)
        for place, name, a, kw in self.writes[:k]:
            getattr(LocalSwitch(out.soft[place], place), name)(*a, **kw)
        return out


@pytest.mark.parametrize("data, leaves", [(tree_data(leaves=0), 0),
                                          (tree_data(leaves=0, fallback=True), 0),
                                          (tree_data(leaves=2), 2)],
                         ids=["star", "star and fallback", "tree"])
def test_a_service_killed_at_any_write_of_a_placement_leaves_nothing_held_for_good(data, leaves):
    """At whichever write a placement's service dies, the next service reads back whatever
    was written: once the lease runs out, no switch holds a job or a mark (issue 57's soak
    found a job written but not yet marked: held for good)."""
    s = Service(data, lease=5.0, switches=Recorded(parse(data)))
    first = len(s.sw.writes)  # (the service's own: its holder mark)
    addrs = [(host(r % 2, 0) if leaves else f"10.0.0.{r + 1}", 20000) for r in range(2)]
    answers = s.join_all("killed", addrs)
    assert not [a for a in answers.values() if isinstance(a, Refusal)], answers
    names = list(s.sw.soft)
    assert sum(len(s.sw.jobs(n)) for n in names) == 1 + leaves
    assert len(s.sw.writes) - first >= 2 * (1 + leaves)  # (a job and a mark a switch, at least)
    for k in range(first, len(s.sw.writes) + 1):
        after = s.sw.upto(k)
        again = Service(data, lease=5.0, switches=after)
        again.now += 6.0
        again.svc.reap()
        left = {n: ([j.id for j in after.jobs(n)], after.mark(n)) for n in names}
        assert all(v == ([], 0) for v in left.values()), (k, s.sw.writes[k - 1][:2], left)
