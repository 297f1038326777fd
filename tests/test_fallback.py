"""Automatic fallback, driven through homagg-ctl: a switch whose slot pool holds 4 jobs, a
software aggregator behind it, and 8 jobs running at once, each one exact.

Both places are software aggregators in this process (the "switch" one capped by the config's
``[switch] slots``), on loopback: P4Runtime on TCP for the switch and on a unix socket for the
fallback (the launcher's way), UDP on 127.0.0.254 and 127.0.0.253. Workers are real agents on
127.0.0.1-16. The same placement runs on bmv2 under Mininet in bmv2_tests/test_mininet.py.
"""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest

pytest.importorskip("grpc")
pytest.importorskip("p4runtime_sh")

from homagg import wire  # noqa: E402
from homagg.controller.cli import main as ctl  # noqa: E402
from homagg.host_agent import Agent, AgentConfig  # noqa: E402
from homagg.host_agent.cli import check_exact  # noqa: E402
from homagg.targets.p4runtime_server import P4RuntimeServer  # noqa: E402
from homagg.targets.soft import SoftSwitch, SoftSwitchServer  # noqa: E402
from tests.staging import agent_addresses, job_key  # noqa: E402

pytestmark = pytest.mark.slow  # (conftest.py) several aggregators and jobs per test

SWITCH_IP, FALLBACK_IP = "127.0.0.254", "127.0.0.253"
JOBS, PER_JOB, SLOTS = 8, 2, 8     # 8 jobs of 2 workers, 8 slots each
POOL = 4 * SLOTS                   # the switch's pool: room for jobs 1-4 only


class Fabric:
    """The two aggregators and a homagg-ctl config that names them."""

    def __init__(self, tmp_path):
        self.sw, self.fb = SoftSwitch(), SoftSwitch()
        # homagg's own port: agents take results only from the aggregation port range
        self.port = wire.HOMAGG_UDP_PORT_MIN
        self.udp_sw = SoftSwitchServer(self.sw, (SWITCH_IP, self.port)).start()
        self.udp_fb = SoftSwitchServer(self.fb, (FALLBACK_IP, self.port)).start()
        self.rt_sw = P4RuntimeServer(self.sw, "127.0.0.1:0").start()
        self.rt_fb = P4RuntimeServer(self.fb, f"unix:{tmp_path / 'fb.sock'}").start()
        self.hosts = agent_addresses(JOBS * PER_JOB)
        hosts = "".join(f'[[hosts]]\nname = "h{i}"\nip = "{ip}"\nmac = "00:00:0a:00:00:{i + 1:02x}"'
                        f"\nport = {i + 1}\n\n" for i, (ip, _) in enumerate(self.hosts))
        jobs = "".join(
            f"[[jobs]]\nid = {j + 1}\nslots = {SLOTS}\nkey = {job_key(j + 1)}\nworkers = [ "
            + ", ".join(f'{{ host = "h{h}", udp_port = {self.hosts[h][1]} }}'
                        for h in range(j * PER_JOB, (j + 1) * PER_JOB)) + " ]\n\n"
            for j in range(JOBS))
        self.config = tmp_path / "net.toml"
        self.config.write_text(
            f'[switch]\nname = "s1"\ntarget = "soft"\ngrpc = "{self.rt_sw.address}"\n'
            f'ip = "{SWITCH_IP}"\nslots = {POOL}\n\n'
            f'[fallback]\nname = "fb"\nip = "{FALLBACK_IP}"\ngrpc = "{self.rt_fb.address}"\n'
            f"port = {JOBS * PER_JOB + 1}\n\n{hosts}{jobs}")
        self.ctl = ["-c", str(self.config), "--request-log", str(tmp_path / "s1.log")]

    def close(self):
        for s in (self.rt_sw, self.rt_fb, self.udp_sw, self.udp_fb):
            s.stop()


@pytest.fixture
def fabric(tmp_path):
    f = Fabric(tmp_path)
    yield f
    f.close()


def run_jobs(fabric: Fabric, placed: dict[int, str], iterations: int = 3) -> dict[int, list]:
    """Every worker of every job at once, each sending where ``placed`` says; every
    aggregate is checked bit for bit against its own job's integer sum (data differ per job,
    so a sum that mixed jobs would fail)."""
    errors: dict[tuple[int, int], BaseException] = {}
    results: dict[int, list] = {j: [] for j in placed}

    def worker(job: int, w: int) -> None:
        h = (job - 1) * PER_JOB + w
        cfg = AgentConfig(job, w, PER_JOB, (placed[job], fabric.port), fabric.hosts[h],
                          slots=SLOTS, deadline=20.0, key=job_key(job))
        try:
            with Agent(cfg) as agent:
                for it in range(iterations):
                    xs = [np.random.default_rng([job, it, v]).integers(-2**20, 2**20, 3000)
                          .astype(np.int32) for v in range(PER_JOB)]
                    got = agent.allreduce_int(xs[w])
                    np.testing.assert_array_equal(got, np.sum(xs, axis=0, dtype=np.int64))
                    fs = [np.where(np.random.default_rng([job, it, v, 1]).random(20000) < 0.02,
                                   np.random.default_rng([job, it, v, 2])
                                   .standard_normal(20000), 0).astype(np.float32)
                          for v in range(PER_JOB)]
                    res = agent.allreduce_detailed(fs[w])
                    check_exact(res, fs, f"job {job} iteration {it}")
                    if w == 0:
                        results[job].append(res.mode)
        except BaseException as e:  # reported below, with the job and worker named
            errors[(job, w)] = e

    threads = [threading.Thread(target=worker, args=(j, w)) for j in placed
               for w in range(PER_JOB)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "an agent hung"
    assert not errors, errors
    return results


def test_jobs_past_the_switch_pool_fall_back_and_all_eight_are_exact(fabric, capsys):
    assert ctl(fabric.ctl + ["install"]) == 0
    out = capsys.readouterr().out
    for j in range(1, 5):
        assert f"job {j}: 2 workers, slots {(j - 1) * SLOTS}-{j * SLOTS - 1}, epoch {j}, " \
               f"group {j + 1}\n" in out
    for j in range(5, 9):
        assert (f"job {j}: 2 workers, slots {(j - 5) * SLOTS}-{(j - 4) * SLOTS - 1}, ") in out
        assert (f"on fb (software aggregator, {FALLBACK_IP}): fell back: s1 has no free region "
                f"of {SLOTS} slots (0 of {POOL} free") in out
    assert f"agents send to {FALLBACK_IP}:{wire.HOMAGG_UDP_PORT_MIN}" in out

    assert ctl(fabric.ctl + ["job", "list"]) == 0
    table = capsys.readouterr().out
    rows = {int(r.split()[0]): r.split() for r in table.splitlines()[2:]}
    assert sorted(rows) == list(range(1, 9))
    assert all(rows[j][1] == "s1" and rows[j][2] == SWITCH_IP for j in range(1, 5))
    assert all(rows[j][1:4] == ["fb", "(fallback)", FALLBACK_IP] for j in range(5, 9))
    assert ctl(fabric.ctl + ["job", "list", "--json"]) == 0
    listed = {d["id"]: d for d in json.loads(capsys.readouterr().out)}
    placed = {j: d["send_to"].split(":")[0] for j, d in listed.items()}
    assert {d["place"] for j, d in listed.items() if j > 4} == {"fallback"}

    modes = run_jobs(fabric, placed)
    assert all(len(m) == 3 for m in modes.values())

    assert ctl(fabric.ctl + ["stats", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert set(st) == {"s1", "fb"} and st["fb"]["role"] == "fallback"
    for name, jobs in (("s1", range(1, 5)), ("fb", range(5, 9))):
        assert sorted(map(int, st[name]["jobs"])) == list(jobs)
        for j in jobs:  # every job's traffic reached its own place, and only there
            cells = st[name]["jobs"][str(j)]
            assert cells["JOB_STAT_COMPLETED"]["packets"] > 0
        assert st[name]["switch"]["DROP_UNKNOWN_SENDER"] == 0
        assert st[name]["switch"]["DROP_WRONG_IDENTITY"] == 0
    assert ctl(fabric.ctl + ["stats"]) == 0
    text = capsys.readouterr().out
    assert "== switch s1 (software aggregator, 127.0.0.254)" in text
    assert "== fallback fb (software aggregator, 127.0.0.253)" in text


def test_isolation_holds_across_places(fabric, capsys):
    """A fallen-back job's worker that sends to the switch is an unknown sender there, and
    the reverse; neither disturbs the jobs that run."""
    assert ctl(fabric.ctl + ["install"]) == 0
    capsys.readouterr()
    placed = {j: SWITCH_IP if j <= 4 else FALLBACK_IP for j in range(1, 9)}
    h5 = (5 - 1) * PER_JOB  # job 5 worker 0's host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((fabric.hosts[h5][0], 0))
        s.sendto(wire.pack(wire.OP_ADD, 5, 0, 0, 1, np.ones(wire.WORDS_PER_PACKET, np.int32)),
                 (SWITCH_IP, fabric.port))
        s.sendto(wire.pack(wire.OP_ADD, 1, 0, 0, 1, np.ones(wire.WORDS_PER_PACKET, np.int32)),
                 (FALLBACK_IP, fabric.port))
    run_jobs(fabric, placed, iterations=1)
    assert ctl(fabric.ctl + ["stats", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["s1"]["switch"]["DROP_UNKNOWN_SENDER"] == 1
    assert st["fb"]["switch"]["DROP_UNKNOWN_SENDER"] == 1


def test_placement_by_request_and_its_errors(fabric, capsys):
    cfg = fabric.config
    text = cfg.read_text()
    cfg.write_text(text.replace("[[jobs]]\nid = 1\n", "[[jobs]]\nid = 1\nplace = \"fallback\"\n"))
    assert ctl(fabric.ctl + ["install", "--no-jobs"]) == 0
    assert ctl(fabric.ctl + ["job", "add", "1"]) == 0
    assert "placed on the fallback, as asked" in capsys.readouterr().out
    for j in (2, 3, 4, 5):
        assert ctl(fabric.ctl + ["job", "add", str(j)]) == 0
    capsys.readouterr()
    # The switch is full: a job pinned to it is refused with the free space named ...
    assert ctl(fabric.ctl + ["job", "add", "6", "--place", "switch"]) == 1
    err = capsys.readouterr().err
    assert f"no free region of {SLOTS} slots (0 of {POOL} free" in err
    # ... removing one frees its slots for the next auto placement, and remove/reset find a
    # job wherever it lives.
    assert ctl(fabric.ctl + ["job", "remove", "3"]) == 0
    assert "job 3 removed (slots 8-15 free)" in capsys.readouterr().out
    assert ctl(fabric.ctl + ["job", "add", "6"]) == 0
    out = capsys.readouterr().out
    assert "job 6: 2 workers, slots 8-15" in out and "fb" not in out
    assert ctl(fabric.ctl + ["reset", "1"]) == 0
    assert "job 1 reset: epoch 2, counters zeroed, registers skipped (software aggregator: " \
           "the new epoch empties the region) (on fb)" in capsys.readouterr().out
    # Ids and senders are unique across both places.
    assert ctl(fabric.ctl + ["job", "add", "1", "--place", "switch"]) == 1
    assert "job 1 is already installed on fb" in capsys.readouterr().err
    assert ctl(fabric.ctl + ["job", "add", "5", "--place", "fallback"]) == 1
    assert "job 5 is already installed on s1" in capsys.readouterr().err
    assert ctl(fabric.ctl + ["job", "remove", "1"]) == 0
    assert "job 1 removed (slots 0-7 free on fb)" in capsys.readouterr().out
    ip, port = fabric.hosts[10]  # job 6's worker 0
    assert ctl(fabric.ctl + ["job", "add", "9", "--worker", f"h10:{port}"]) == 1
    assert f"{ip}:{port} already sends for job 6 (on s1)" in capsys.readouterr().err


def test_without_a_fallback_a_full_switch_refuses(fabric, capsys, tmp_path):
    cfg = tmp_path / "nofb.toml"
    text = fabric.config.read_text()
    start = text.index("[fallback]")
    cfg.write_text(text[:start] + text[text.index("[[hosts]]"):])
    base = ["-c", str(cfg), "--request-log", str(tmp_path / "x.log")]
    assert ctl(base + ["install"]) == 1
    assert f"no free region of {SLOTS} slots (0 of {POOL} free" in capsys.readouterr().err
    assert ctl(base + ["job", "list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["job", "workers", "slots", "epoch", "group",
                                          "senders"]


def test_an_unreachable_fallback_is_named(fabric, capsys):
    assert ctl(fabric.ctl + ["install", "--no-jobs"]) == 0
    fabric.rt_fb.stop()
    assert ctl(fabric.ctl + ["job", "list"]) == 0
    assert "fallback fb unreachable" in capsys.readouterr().err
    for j in range(1, 5):
        assert ctl(fabric.ctl + ["job", "add", str(j), "--place", "switch"]) == 0
    assert ctl(fabric.ctl + ["job", "add", "5"]) == 1
    assert "fallback fb unreachable" in capsys.readouterr().err
