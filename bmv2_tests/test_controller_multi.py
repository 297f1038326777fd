"""One controller process drives several switches at once (a leaf/spine tree needs it): two
bmv2 switches, one P4RuntimeSwitch each, open together; each gets its own job and aggregates
exactly, and neither sees the other's entries."""

from __future__ import annotations

import numpy as np
import pytest

from bmv2_tests.conftest import LOG_DIR
from homagg import wire
from homagg.controller import jobs
from homagg.controller.p4client import P4RuntimeSwitch
from homagg.targets.testbed import homagg_frame, is_homagg, result_of, start_testbed, stop_testbed


@pytest.fixture
def two_switches(pipeline):
    beds = []
    try:
        for name in ("s1", "s2"):
            beds.append(start_testbed(3, LOG_DIR / "multi", name))
        yield beds
    finally:
        for b in beds:
            stop_testbed(b)


def test_one_process_drives_two_switches(pipeline, two_switches):
    conns = []
    for b in two_switches:
        name = b.config.switch.name
        conns.append(P4RuntimeSwitch(b.switch.grpc_addr, name=name,
                                     request_log=LOG_DIR / f"multi-{name}-p4runtime.log")
                     .open(pipeline))
    try:
        installed = []
        for k, (bed, sw) in enumerate(zip(two_switches, conns)):
            jobs.install_base(sw, bed.config)
            installed.append(jobs.add_job(sw, bed.job(k + 1, [0, 1], slots=4)))
        # each switch holds only its own job
        assert [[j.id for j in jobs.list_jobs(sw)] for sw in conns] == [[1], [2]]
        for k, bed in enumerate(two_switches):
            for w in (0, 1):
                words = np.full(wire.WORDS_PER_PACKET, 10 * (k + 1) + w, np.int32)
                bed.ports[w].send(homagg_frame(w, wire.pack(wire.OP_ADD, k + 1, w, 0, 1, words)))
            for w in (0, 1):
                got = [result_of(p) for p in bed.ports[w].recv(2.0, is_homagg, 1)]
                assert len(got) == 1 and got[0].job == k + 1
                assert (got[0].words == 2 * 10 * (k + 1) + 1).all()
        stats = [jobs.read_stats(sw) for sw in conns]
        assert [s.jobs[k + 1].packets("JOB_STAT_COMPLETED") for k, s in enumerate(stats)] == [1, 1]
    finally:
        for sw in conns:
            sw.close()
