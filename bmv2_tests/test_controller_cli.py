"""homagg-ctl against a real simple_switch_grpc: install, add a job, aggregate through it,
see an unregistered sender's drop in the stats, reset, remove. Needs bmv2, p4c and root."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bmv2_tests.conftest import LOG_DIR, bmv2_skip_reason
from homagg import wire
from homagg.controller.cli import main as ctl
from homagg.targets.testbed import (
    homagg_frame,
    host_ip,
    host_mac,
    is_homagg,
    result_of,
    start_testbed,
    stop_testbed,
)


@pytest.fixture(scope="module")
def bare_switch():
    reason = bmv2_skip_reason()
    if reason:
        pytest.skip(reason)
    bed = start_testbed(4, LOG_DIR / "cli")
    yield bed
    stop_testbed(bed)


def config(bed, path):
    hosts = "".join(f'[[hosts]]\nname = "h{i}"\nip = "{host_ip(i)}"\nmac = "{host_mac(i)}"\n'
                    f"port = {i + 1}\n\n" for i in range(4))
    path.write_text(f'[switch]\nname = "s1"\ngrpc = "{bed.switch.grpc_addr}"\n'
                    f"thrift_port = {bed.switch.thrift_port}\n"
                    f'ip = "10.0.0.254"\nmac = "00:00:0a:00:00:fe"\n\n{hosts}'
                    "[[jobs]]\nid = 7\nslots = 8\nworkers = [ { host = \"h0\" }, "
                    "{ host = \"h1\" }, { host = \"h2\" } ]\n")
    return path


def test_install_add_aggregate_stats_reset_remove(bare_switch, tmp_path, capsys):
    bed = bare_switch
    cfg = config(bed, tmp_path / "net.toml")
    reqlog = tmp_path / "p4rt.log"
    base = ["-c", str(cfg), "--request-log", str(reqlog)]

    assert ctl(base + ["install", "--no-jobs"]) == 0
    assert ctl(base + ["job", "add", "7"]) == 0
    out = capsys.readouterr().out
    assert "job 7: 3 workers, slots 0-7" in out

    assert ctl(base + ["job", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [j["id"] for j in listed] == [7] and len(listed[0]["workers"]) == 3

    rng = np.random.default_rng(0)
    words = rng.integers(-(2**29), 2**29, (3, 64)).astype(np.int32)
    for p in bed.ports:
        p.drain()
    for w in range(3):
        bed.ports[w].send(homagg_frame(w, wire.pack(wire.OP_ADD, 7, w, 0, 1, words[w])))
    bed.ports[3].send(homagg_frame(3, wire.pack(wire.OP_ADD, 7, 2, 0, 1, words[2])))  # intruder
    expect = words.astype(np.int64).sum(0)
    for w in range(3):
        got = [result_of(p) for p in bed.ports[w].recv(2.0, is_homagg, 1)]
        assert len(got) == 1, f"worker {w}: no result"
        np.testing.assert_array_equal(got[0].words.astype(np.int64), expect)
    assert not bed.ports[3].recv(0.3, is_homagg)

    assert ctl(base + ["stats", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["switch"]["DROP_UNKNOWN_SENDER"] == 1
    assert st["jobs"]["7"]["JOB_STAT_ACCEPTED"]["packets"] == 3
    assert st["jobs"]["7"]["JOB_STAT_COMPLETED"]["packets"] == 1
    assert ctl(base + ["stats"]) == 0
    table = capsys.readouterr().out
    assert "DROP_UNKNOWN_SENDER  1" in table

    assert ctl(base + ["reset", "7"]) == 0
    assert "job 7 reset: epoch" in capsys.readouterr().out
    assert ctl(base + ["job", "remove", "7"]) == 0
    assert ctl(base + ["job", "list"]) == 0
    assert "no jobs installed" in capsys.readouterr().out
    assert ctl(base + ["job", "remove", "7"]) == 1
    assert "job 7 is not installed" in capsys.readouterr().err
    assert "Write" in reqlog.read_text() and "SetForwardingPipelineConfig" in reqlog.read_text()
