"""homagg-ctl against both targets, one session: install, add a job, aggregate through it, see
an unregistered sender's drop in the stats, reset, remove.

- soft: ``homagg-softswitch`` serving P4Runtime on loopback, hosts are UDP sockets on
  127.0.0.1-4 (runs everywhere, no root);
- bmv2: simple_switch_grpc on veth pairs; needs bmv2, p4c and root, and skips otherwise.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from bmv2_tests.conftest import LOG_DIR, bmv2_skip_reason
from homagg import wire
from homagg.controller.cli import main as ctl
from tests.staging import job_key


class SoftSide:
    """The software aggregator as a command, and hosts h0..h3 on loopback."""

    name = "soft"

    def __init__(self):
        pytest.importorskip("grpc")
        from tests.test_p4runtime_server import LoopbackHosts, start_softswitch

        LOG_DIR.mkdir(parents=True, exist_ok=True)
        ready = LOG_DIR / "cli-softswitch.ready.json"
        ready.unlink(missing_ok=True)
        self.proc, self.grpc, udp = start_softswitch("--log-level", "warning", ready=ready,
                                                     log=LOG_DIR / "cli-softswitch.out")
        self.hosts = LoopbackHosts(udp)

    def config(self, path):
        path.write_text(self.hosts.toml(self.grpc, self.hosts.job_toml(7, range(3))))
        return path

    def send(self, host, payload):
        self.hosts.send(host, payload)

    def recv(self, host, timeout, count=None):
        return self.hosts.recv(host, timeout, count)

    def drain(self):
        self.hosts.drain()

    def close(self):
        from tests.test_p4runtime_server import stop

        self.hosts.close()
        stop(self.proc)


class Bmv2Side:
    """simple_switch_grpc on veth pairs; host i is port i."""

    name = "bmv2"

    def __init__(self):
        from homagg.targets.testbed import start_testbed

        self.bed = start_testbed(4, LOG_DIR / "cli")

    def config(self, path):
        from homagg.targets.testbed import host_ip, host_mac

        bed = self.bed
        hosts = "".join(f'[[hosts]]\nname = "h{i}"\nip = "{host_ip(i)}"\n'
                        f'mac = "{host_mac(i)}"\nport = {i + 1}\n\n' for i in range(4))
        path.write_text(f'[switch]\nname = "s1"\ngrpc = "{bed.switch.grpc_addr}"\n'
                        f"thrift_port = {bed.switch.thrift_port}\n"
                        f'ip = "10.0.0.254"\nmac = "00:00:0a:00:00:fe"\n\n{hosts}'
                        f"[[jobs]]\nid = 7\nslots = 8\nkey = {job_key(7)}\n"
                        "workers = [ { host = \"h0\" }, "
                        "{ host = \"h1\" }, { host = \"h2\" } ]\n")
        return path

    def send(self, host, payload):
        from homagg.targets.testbed import homagg_frame

        self.bed.ports[host].send(homagg_frame(host, payload))

    def recv(self, host, timeout, count=None):
        from homagg.targets.testbed import is_homagg, result_of

        return [result_of(p) for p in self.bed.ports[host].recv(timeout, is_homagg, count)]

    def drain(self):
        for p in self.bed.ports:
            p.drain()

    def close(self):
        from homagg.targets.testbed import stop_testbed

        stop_testbed(self.bed)


@pytest.fixture(scope="module", params=["soft", "bmv2"])
def switch(request):
    if request.param == "bmv2":
        reason = bmv2_skip_reason()
        if reason:
            pytest.skip(reason)
    side = SoftSide() if request.param == "soft" else Bmv2Side()
    yield side
    side.close()


def contribute(switch, words, seq=1):
    """h0..h2 send job 7's workers' words for slot 0."""
    for w in range(3):
        switch.send(w, wire.pack(wire.OP_ADD, 7, w, 0, seq, words[w], auth=job_key(7)))


def expect_sum(switch, words):
    """Each of h0..h2 gets the exact sum, once."""
    expect = words.astype(np.int64).sum(0)
    for w in range(3):
        got = switch.recv(w, 2.0, 1)
        assert len(got) == 1, f"worker {w}: no result"
        np.testing.assert_array_equal(got[0].words.astype(np.int64), expect)


def test_install_add_aggregate_stats_reset_remove(switch, tmp_path, capsys):
    cfg = switch.config(tmp_path / "net.toml")
    reqlog = tmp_path / "p4rt.log"
    base = ["-c", str(cfg), "--request-log", str(reqlog)]

    assert ctl(base + ["install", "--no-jobs"]) == 0
    assert "pipeline installed on s1" in capsys.readouterr().out
    assert ctl(base + ["job", "list"]) == 0
    assert "no jobs installed" in capsys.readouterr().out
    assert ctl(base + ["job", "add", "7"]) == 0
    out = capsys.readouterr().out
    assert "job 7: 3 workers, slots 0-7" in out
    epoch = int(re.search(r"epoch (\d+)", out).group(1))

    assert ctl(base + ["job", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [j["id"] for j in listed] == [7] and len(listed[0]["workers"]) == 3

    rng = np.random.default_rng(0)
    words = rng.integers(-(2**29), 2**29, (3, wire.WORDS_PER_PACKET)).astype(np.int32)
    switch.drain()
    contribute(switch, words)
    switch.send(3, wire.pack(wire.OP_ADD, 7, 2, 0, 1, words[2]))  # intruder
    expect_sum(switch, words)
    assert not switch.recv(3, 0.3)

    assert ctl(base + ["stats", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["switch"]["DROP_UNKNOWN_SENDER"] == 1
    assert st["jobs"]["7"]["JOB_STAT_ACCEPTED"]["packets"] == 3
    assert st["jobs"]["7"]["JOB_STAT_COMPLETED"]["packets"] == 1
    assert ctl(base + ["stats"]) == 0
    table = capsys.readouterr().out
    assert "DROP_UNKNOWN_SENDER  1" in table

    assert ctl(base + ["reset", "7"]) == 0
    out = capsys.readouterr().out
    assert "job 7 reset: epoch" in out
    new_epoch = int(re.search(r"epoch (\d+)", out).group(1))
    assert new_epoch != epoch
    if switch.name == "soft":
        assert "registers skipped (software aggregator: the new epoch empties the region)" in out
    assert ctl(base + ["job", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["epoch"] == new_epoch
    words = rng.integers(-(2**29), 2**29, (3, wire.WORDS_PER_PACKET)).astype(np.int32)
    contribute(switch, words)  # seq 1 again: the new epoch made the slot empty
    expect_sum(switch, words)

    assert ctl(base + ["job", "remove", "7"]) == 0
    assert ctl(base + ["job", "list"]) == 0
    assert "no jobs installed" in capsys.readouterr().out
    assert ctl(base + ["job", "remove", "7"]) == 1
    assert "job 7 is not installed" in capsys.readouterr().err
    assert "Write" in reqlog.read_text() and "SetForwardingPipelineConfig" in reqlog.read_text()


def test_install_again_converges_to_the_config(switch, tmp_path, capsys):
    """An operator re-running ``install`` (the config's job 7 already there) leaves one job
    with one replica per worker: every worker gets each result exactly once."""
    cfg = switch.config(tmp_path / "net.toml")
    base = ["-c", str(cfg), "--request-log", str(tmp_path / "p4rt.log")]
    for _ in range(2):
        assert ctl(base + ["install"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert ctl(base + ["job", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [j["id"] for j in listed] == [7] and len(listed[0]["workers"]) == 3
    words = np.random.default_rng(1).integers(-(2**29), 2**29,
                                              (3, wire.WORDS_PER_PACKET)).astype(np.int32)
    switch.drain()
    contribute(switch, words)
    expect_sum(switch, words)
    for w in range(3):
        assert not switch.recv(w, 0.5), f"worker {w} got a result twice"
    assert ctl(base + ["job", "remove", "7"]) == 0
