"""bench/loadgen.py, the load of ``bench.pps --shards``: it completes rounds through a software
aggregator, checks whole runs of results by memcmp once a run has been checked in full, and
stops on a result that is not the integer sum (a wrong word past the first rounds, when the
fast path is in use)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from bench import loadgen
from homagg import wire
from homagg.controller.local import install
from homagg.targets.soft import SoftSwitch, SoftSwitchServer
from tests.staging import agent_addresses

_ips = itertools.count(2)
K, SLOTS, WORKERS = 64, 16, 3


def _run(tmp_path, sw: SoftSwitch, seconds: float, engine: str = "auto") -> dict:
    ip = f"127.0.4.{next(_ips)}"
    addrs = agent_addresses(WORKERS)
    install(sw, 1, addrs, SLOTS)
    out = tmp_path / "load.json"
    with SoftSwitchServer(sw, (ip, 0), ports=(), engine=engine) as server:
        loadgen.main(["--job", "1", "--switch", f"{ip}:{server.address[1]}",
                      *[f"--bind={a}:{p}" for a, p in addrs], "--slots", str(SLOTS),
                      "--words", str(K), "--seconds", str(seconds), "--out", str(out)])
    return json.loads(out.read_text())


def test_rounds_complete_and_every_result_is_checked(tmp_path):
    r = _run(tmp_path, SoftSwitch(words=K), 0.5)
    assert r["rounds"] > 10 and r["resends"] == 0
    assert r["datagrams"] == 2 * WORKERS * SLOTS * r["rounds"]
    # every worker's results of every round: by memcmp, or result by result
    assert r["fast_checks"] + r["slow_checks"] >= WORKERS * r["rounds"]
    assert r["fast_checks"] > r["slow_checks"]


def test_a_wrong_word_after_the_first_rounds_stops_the_load(tmp_path):
    sw = SoftSwitch(words=K)
    real, runs = sw.handle_run, itertools.count()

    def tamper(run, size, src):
        out = real(run, size, src)
        # round 42 (its last worker's run completes it): one word of one result, off by one
        if next(runs) == 42 * WORKERS - 1:
            for ds in out.values():
                d = bytearray(ds[-1])
                d[wire.OFFSETS["words"] + 3] ^= 1
                ds[-1] = bytes(d)
                break
        return out

    sw.handle_run = tamper  # type: ignore[method-assign]
    with pytest.raises(SystemExit, match="round 42: a result is not the sum"):
        _run(tmp_path, sw, 5.0, engine="python")  # (the native loop calls no handle_run)


def test_the_seq_column_view_writes_every_datagram():
    run = np.zeros(4 * 16, np.uint8)
    loadgen._column(run, 16, 4)[:] = 7
    assert run.view(">u4").reshape(4, 4)[:, 1].tolist() == [7] * 4
    assert run.reshape(4, 16)[:, :4].sum() == 0
