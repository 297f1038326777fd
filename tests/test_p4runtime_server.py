"""The software aggregator over P4Runtime, driven by the real controller.

The aggregator (``homagg.targets.soft``: UDP on 127.0.0.254, P4Runtime on 127.0.0.1) runs in
this process or as ``homagg-softswitch``; hosts h0..h3 are UDP sockets on 127.0.0.1-4 (all
loopback: no root). The controller is the one bmv2 gets: ``P4RuntimeSwitch``,
``controller.jobs`` and ``homagg-ctl``. The conformance table (bmv2_tests/test_conformance.py)
runs here once more, with its jobs installed over P4Runtime.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("grpc")
pytest.importorskip("p4runtime_sh")

import grpc  # noqa: E402
from google.protobuf import text_format  # noqa: E402
from google.rpc import code_pb2, status_pb2  # noqa: E402
from p4.v1 import p4runtime_pb2 as pb  # noqa: E402

from bmv2_tests import test_conformance as conformance  # noqa: E402
from bmv2_tests.targets import SoftUdpTarget  # noqa: E402
from homagg import _p4consts as P4  # noqa: E402
from homagg import paths, wire  # noqa: E402
from homagg.controller import genconsts  # noqa: E402
from homagg.controller import jobs as J  # noqa: E402
from homagg.controller.build import Pipeline  # noqa: E402
from homagg.controller.cli import main as ctl  # noqa: E402
from homagg.controller.p4client import (  # noqa: E402
    CounterValue,
    P4RuntimeSwitch,
    SwitchError,
    TableEntry,
)
from homagg.netconfig import Config, Host, JobSpec, SwitchSpec, Worker  # noqa: E402
from homagg.p4schema import pipeline_differences  # noqa: E402
from homagg.paths import P4INFO_FILE  # noqa: E402
from homagg.targets.p4runtime_server import (  # noqa: E402
    P4RuntimeServer,
    load_p4info,
)
from homagg.targets.soft import SoftSwitch, SoftSwitchServer  # noqa: E402
from homagg.targets.toolchain import missing  # noqa: E402
from tests.staging import job_key, wait_for  # noqa: E402

pytestmark = pytest.mark.slow  # (conftest.py) the conformance table again over P4Runtime, and p4c

SWITCH_IP = "127.0.0.254"
HOSTS = 4  # h0..h2 work, h3 is registered nowhere


class LoopbackHosts:
    """Hosts h0..h{n-1}: a UDP socket each, on 127.0.0.(i+1), sending to the aggregator."""

    sw: SoftSwitch | None = None  # the aggregator, when it runs in this process
    grpc = ""                     # its P4Runtime address

    def __init__(self, switch: tuple[str, int], n: int = HOSTS):
        self.switch = switch
        self.socks = []
        for i in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((f"127.0.0.{i + 1}", 0))
            self.socks.append(s)

    def addr(self, i: int) -> tuple[str, int]:
        return self.socks[i].getsockname()

    def send(self, i: int, payload: bytes) -> None:
        self.socks[i].sendto(payload, self.switch)

    def recv(self, i: int, timeout: float = 1.0, count: int | None = None) -> list[wire.Packet]:
        """Results for host i until ``count`` arrived or ``timeout`` passed."""
        out: list[wire.Packet] = []
        deadline = time.monotonic() + timeout
        s = self.socks[i]
        while count is None or len(out) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            s.settimeout(left)
            try:
                out.append(wire.unpack(s.recv(4096)))
            except TimeoutError:
                break
        return out

    def drain(self) -> None:
        for i in range(len(self.socks)):
            self.recv(i, 0.05)

    def toml(self, grpc_addr: str, jobs: str = "", target: str = "soft") -> str:
        """A homagg-ctl config: the switch, these hosts, and ``jobs`` ([[jobs]] tables)."""
        hosts = "".join(f'[[hosts]]\nname = "h{i}"\nip = "{ip}"\nmac = "00:00:0a:00:00:0{i + 1}"\n'
                        f"port = {i + 1}\n\n" for i, (ip, _) in enumerate(map(self.addr,
                                                                            range(len(self.socks)))))
        return (f'[switch]\nname = "s1"\ntarget = "{target}"\ngrpc = "{grpc_addr}"\n'
                f'ip = "{self.switch[0]}"\nmac = "00:00:0a:00:00:fe"\n\n{hosts}{jobs}')

    def job_toml(self, job: int, workers: range, slots: int = 8) -> str:
        ws = ", ".join(f'{{ host = "h{i}", udp_port = {self.addr(i)[1]} }}' for i in workers)
        return f"[[jobs]]\nid = {job}\nslots = {slots}\nkey = {job_key(job)}\nworkers = [ {ws} ]\n"

    def close(self) -> None:
        for s in self.socks:
            s.close()


def start_softswitch(*args: str, ready: Path, log: Path | None = None):
    """``homagg-softswitch`` on 127.0.0.254 and P4Runtime on 127.0.0.1, each on a port the
    kernel gives at bind time; returns (process, P4Runtime address, UDP address) once it
    serves both (its ``--ready-file``, written at ``ready``)."""
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "homagg.targets.soft", "--grpc",
                             "127.0.0.1:0", "--bind", SWITCH_IP, "--port", "0",
                             "--ready-file", str(ready), *args],
                            stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 20,
                 "homagg-softswitch to serve")
    except AssertionError:
        proc.kill()
        raise
    if proc.poll() is not None:
        raise RuntimeError(f"homagg-softswitch did not start (exit {proc.poll()})"
                           + (f": {log.read_text()}" if log else ""))
    served = json.loads(ready.read_text())
    return proc, served["grpc"], tuple(served["udp"])


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def agg():
    """A fresh software aggregator in this process (UDP + P4Runtime) and hosts h0..h3."""
    sw = SoftSwitch()
    udp = SoftSwitchServer(sw, (SWITCH_IP, 0)).start()
    p4rt = P4RuntimeServer(sw, "127.0.0.1:0").start()
    hosts = LoopbackHosts(udp.address)
    hosts.sw, hosts.grpc = sw, p4rt.address
    yield hosts
    hosts.close()
    p4rt.stop()
    udp.stop()


def connect(agg, election_id=(0, 1), log: Path | None = None) -> P4RuntimeSwitch:
    return P4RuntimeSwitch(agg.grpc, election_id=election_id, request_log=log).open()


def job_spec(agg, job_id: int = 7, workers=range(3), slots: int = 8) -> JobSpec:
    return JobSpec(job_id, tuple(Worker(*agg.addr(i), f"00:00:0a:00:00:0{i + 1}", i + 1,
                                        f"h{i}") for i in workers), slots)


def base_config(agg) -> Config:
    return Config(SwitchSpec(ip=SWITCH_IP, target="soft"),
                  tuple(Host(f"h{i}", agg.addr(i)[0], f"00:00:0a:00:00:0{i + 1}", i + 1)
                        for i in range(HOSTS)))


def words_of(seed: int, n: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(-(2**29), 2**29, (n, wire.WORDS_PER_PACKET),
                                                dtype=np.int64).astype(np.int32)


def aggregate(agg, job: int, words: np.ndarray, seq: int = 1, slot: int = 0,
              key: int = 0) -> None:
    """Workers 0..n-1 send one ADD each, with the job's key; every one must get the exact
    sum."""
    for w in range(len(words)):
        agg.send(w, wire.pack(wire.OP_ADD, job, w, slot, seq, words[w], auth=key))
    expect = words.astype(np.int64).sum(0)
    for w in range(len(words)):
        got = agg.recv(w, 2.0, 1)
        assert len(got) == 1, f"worker {w}: no result"
        assert got[0].flags & wire.FLAG_RESULT and got[0].seq == seq
        np.testing.assert_array_equal(got[0].words.astype(np.int64), expect)


# -- the P4Info --------------------------------------------------------------------------------


def test_shipped_p4info_has_the_generated_names_and_ids():
    """homagg/_p4info.txtpb and homagg/_p4consts.py come from the same compilation."""
    assert pipeline_differences(load_p4info(), P4.SCHEMA) == []
    fresh = genconsts.render(paths.p4_dir(), genconsts.parse_p4info(P4INFO_FILE))
    assert fresh == genconsts.OUT.read_text(), (
        "homagg/_p4info.txtpb and homagg/_p4consts.py disagree: run `homagg-ctl build`")


@pytest.mark.skipif(bool(missing("p4c-bm2-ss")), reason=f"compiling: {missing('p4c-bm2-ss')}")
def test_shipped_p4info_is_the_compilers_output(tmp_path):
    from homagg.controller.build import build, portable_p4info

    p = build(tmp_path, force=True, regenerate=False)
    # (p4c after 1.2.4.8 adds each table's initial_default_action: build.portable_p4info)
    assert portable_p4info(p.p4info.read_text()) == P4INFO_FILE.read_text(), (
        "homagg/_p4info.txtpb is stale: run `homagg-ctl build` and commit it")


def test_the_aggregator_runs_homaggs_pipeline_from_the_start(agg):
    with connect(agg) as c:  # open() checks the switch's P4Info against the generated ids
        assert c.client.get_p4info() == load_p4info()
        assert c.read(P4.TABLE_JOB_WORKERS) == []


def test_a_foreign_p4info_is_refused_and_homaggs_loads_afresh(agg, tmp_path):
    info = load_p4info()
    info.tables[0].preamble.id += 1
    foreign = tmp_path / "other.p4info.txtpb"
    foreign.write_text(text_format.MessageToString(info))
    none = tmp_path / "none.json"
    none.write_bytes(b"")
    with connect(agg) as c:
        c.insert(TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": J.ip_int(SWITCH_IP)},
                            P4.ACTION_TO_SWITCH))
        with pytest.raises(SwitchError, match="INVALID_ARGUMENT.*homagg's pipeline only.*"
                                              + info.tables[0].preamble.name):
            c.push_pipeline(Pipeline(none, foreign))
        assert len(c.read(P4.TABLE_LOCAL_IP)) == 1  # refused: nothing changed
        c.push_pipeline(Pipeline(none, P4INFO_FILE))  # loading the pipeline empties the switch
        assert c.read(P4.TABLE_LOCAL_IP) == []


# -- the controller ----------------------------------------------------------------------------


def test_controller_installs_aggregates_counts_resets_and_removes(agg):
    with connect(agg) as c:
        cfg = base_config(agg)
        J.install_base(c, cfg)
        assert len(c.read(P4.TABLE_ARP_PROXY)) == HOSTS + 1
        assert len(c.read(P4.TABLE_IPV4_ROUTE)) == HOSTS
        job = J.add_job(c, job_spec(agg))
        assert (job.base, job.size, job.epoch, job.workers) == (0, 8, 1, 3)
        assert J.list_jobs(c) == [job]
        assert c.read_multicast_groups() == {job.group: [(1, 1), (2, 2), (3, 3)]}
        assert {e.params["port"] for e in c.read(P4.TABLE_RESULT_DST)} == \
            {agg.addr(i)[1] for i in range(3)}
        assert agg.sw.jobs[7].results == [agg.addr(i) for i in range(3)]

        words = words_of(0)
        agg.send(3, wire.pack(wire.OP_ADD, 7, 2, 0, 1, words[2]))  # h3 posing as worker 2
        aggregate(agg, 7, words)
        assert agg.recv(3, 0.2) == []
        st = J.read_stats(c)
        moved = {k: v for k, v in st.switch.items() if v}
        assert moved == {"STAT_RX": 4, "STAT_ACCEPTED": 3, "STAT_COMPLETED": 1,
                         "DROP_UNKNOWN_SENDER": 1}
        assert st.jobs[7].packets("JOB_STAT_ACCEPTED") == 3
        assert st.jobs[7].packets("JOB_STAT_COMPLETED") == 1
        assert c.read_counter(P4.COUNTER_STATS)[wire.EPOCH_STORE] == CounterValue(1, 0)

        res = J.reset_job(c, 7)
        assert res.epoch == 2 and J.find_job(c, 7).epoch == 2
        assert c.read_counter(P4.COUNTER_STATS)[wire.EPOCH_STORE].packets == 2
        assert J.read_stats(c).jobs[7].packets("JOB_STAT_ACCEPTED") == 0
        aggregate(agg, 7, words_of(1))  # seq 1 again: the new epoch made the slot empty

        J.remove_job(c, 7)
        assert J.list_jobs(c) == [] and c.read_multicast_groups() == {}
        assert c.read(P4.TABLE_RESULT_DST) == [] and agg.sw.jobs == {}
        before = J.read_stats(c).switch["DROP_UNKNOWN_SENDER"]
        agg.send(0, wire.pack(wire.OP_ADD, 7, 0, 0, 1, words[0]))
        assert agg.recv(0, 0.2) == []
        assert J.read_stats(c).switch["DROP_UNKNOWN_SENDER"] == before + 1


def test_results_go_where_the_group_and_result_dst_say(agg):
    """As bmv2's egress: a replica without a result_dst entry is dropped; one that names
    another address is sent there."""
    with connect(agg) as c:
        J.add_job(c, job_spec(agg))
        c.delete(TableEntry(P4.TABLE_RESULT_DST, J._result_key(7, 1)))
        ip, port = agg.addr(3)
        c.modify(TableEntry(P4.TABLE_RESULT_DST, J._result_key(7, 2), P4.ACTION_SET_RESULT_DST,
                            {"mac": 0, "ip": J.ip_int(ip), "port": port}))
        words = words_of(2)
        for w in range(3):
            agg.send(w, wire.pack(wire.OP_ADD, 7, w, 0, 1, words[w]))
        got = {h: agg.recv(h, 0.5) for h in range(HOSTS)}
        assert [len(got[h]) for h in range(HOSTS)] == [1, 0, 0, 1]
        np.testing.assert_array_equal(got[3][0].words, words.astype(np.int64).sum(0))


def test_a_half_written_job_is_not_active(agg):
    with connect(agg) as c:
        s0, s1 = (J.Sender(w, *agg.addr(w), w + 1) for w in range(2))
        c.insert(J._worker_entry(7, s0, 2, 5, 0, 8, 8, 0))
        agg.send(0, wire.pack(wire.OP_ADD, 7, 0, 0, 1, words_of(3)[0]))
        time.sleep(0.1)
        assert J.read_stats(c).switch["DROP_UNKNOWN_SENDER"] == 1 and agg.sw.jobs == {}
        c.insert(J._worker_entry(7, s1, 2, 5, 0, 8, 8, 0))
        assert agg.sw.jobs[7].workers == [agg.addr(0), agg.addr(1)]
        assert agg.sw.jobs[7].epoch == 5


# -- errors, as bmv2 reports them ------------------------------------------------------------


def test_write_errors_are_p4runtimes(agg):
    with connect(agg) as c:
        entry = TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": J.ip_int(SWITCH_IP)},
                           P4.ACTION_TO_SWITCH)
        c.insert(entry)
        with pytest.raises(SwitchError, match=r"ALREADY_EXISTS, 'entry exists in "
                                              r"HomaggIngress.local_ip \(dst_addr=127.0.0.254\)"):
            c.insert(entry)
        c.insert(entry, or_modify=True)  # ALREADY_EXISTS turns into MODIFY
        missing_entry = TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 5}, P4.ACTION_TO_SWITCH)
        with pytest.raises(SwitchError, match="NOT_FOUND"):
            c.modify(missing_entry)
        with pytest.raises(SwitchError, match="NOT_FOUND"):
            c.delete(missing_entry)
        c.set_multicast_group(9, [(1, 1)])
        c.set_multicast_group(9, [(2, 1)])  # or_modify inside
        assert c.read_multicast_groups() == {9: [(2, 1)]}
        c.delete_multicast_group(9)
        with pytest.raises(SwitchError, match="NOT_FOUND"):
            c.delete_multicast_group(9)
        with pytest.raises(SwitchError, match="OUT_OF_RANGE"):
            c.write_counter(P4.COUNTER_FWD_STATS, {wire.FWD_STATS_SIZE: CounterValue()})


def raw_write(c: P4RuntimeSwitch, *updates):
    """One WriteRequest through the session's stub; the per-update canonical codes it got."""
    req = pb.WriteRequest(device_id=c.device_id, updates=list(updates))
    req.election_id.high, req.election_id.low = c.election_id
    try:
        c.client.stub.Write(req)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNKNOWN, e
        status = status_pb2.Status()
        status.ParseFromString(dict(e.trailing_metadata())["grpc-status-details-bin"])
        assert status.code == code_pb2.UNKNOWN
        errors = []
        for d in status.details:
            err = pb.Error()
            assert d.Unpack(err)
            errors.append(err.canonical_code)
        return errors
    return [code_pb2.OK] * len(updates)


def update(kind: str, te) -> pb.Update:
    u = pb.Update(type=getattr(pb.Update, kind))
    u.entity.table_entry.CopyFrom(te)
    return u


def test_a_batch_reports_one_error_per_update_as_pi_does(agg):
    with connect(agg) as c:
        ok = c._entry_pb(TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 1}, P4.ACTION_TO_SWITCH))
        unknown_table = pb.TableEntry()
        unknown_table.CopyFrom(ok)
        unknown_table.table_id = 12345
        wrong_action = c._entry_pb(TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 2},
                                              P4.ACTION_TO_SWITCH))
        wrong_action.action.action.action_id = P4.SCHEMA.action(P4.ACTION_ROUTE).id
        too_wide = c._entry_pb(TableEntry(P4.TABLE_JOB_WORKERS, {"src_addr": 1, "src_port": 2},
                                          P4.ACTION_SET_WORKER,
                                          {p.name: 0 for p in
                                           P4.SCHEMA.action(P4.ACTION_SET_WORKER).params}))
        too_wide.match[1].exact.value = (1 << 16).to_bytes(3, "big")
        no_param = c._entry_pb(TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 3},
                                          P4.ACTION_TO_SWITCH))
        no_param.action.action.action_id = P4.SCHEMA.action(P4.ACTION_NOACTION).id
        codes = raw_write(c, update("INSERT", ok), update("INSERT", ok),
                          update("INSERT", unknown_table), update("INSERT", wrong_action),
                          update("INSERT", too_wide), update("DELETE", wrong_action),
                          update("INSERT", no_param))
        assert codes == [code_pb2.OK, code_pb2.ALREADY_EXISTS, code_pb2.INVALID_ARGUMENT,
                         code_pb2.INVALID_ARGUMENT, code_pb2.INVALID_ARGUMENT,
                         code_pb2.NOT_FOUND, code_pb2.OK]
        assert {e.match["dst_addr"]: e.action for e in c.read(P4.TABLE_LOCAL_IP)} == \
            {1: P4.ACTION_TO_SWITCH, 3: P4.ACTION_NOACTION}


def test_an_unknown_update_type_and_a_negative_count_are_refused_with_a_reason(agg):
    """Both were accepted before (an unknown type raised a traceback in the server; a negative
    counter write was stored)."""
    with connect(agg) as c:
        ok = c._entry_pb(TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 21}, P4.ACTION_TO_SWITCH))
        odd = update("INSERT", ok)
        odd.type = 7
        ce = pb.CounterEntry(counter_id=P4.SCHEMA.counter(P4.COUNTER_STATS).id)
        ce.index.index = 25
        ce.data.packet_count = -5
        neg = pb.Update(type=pb.Update.MODIFY)
        neg.entity.counter_entry.CopyFrom(ce)
        assert raw_write(c, odd, neg, update("INSERT", ok)) == \
            [code_pb2.INVALID_ARGUMENT, code_pb2.INVALID_ARGUMENT, code_pb2.OK]
        assert c.read_counter(P4.COUNTER_STATS)[25] == CounterValue(0, 0)
        with pytest.raises(SwitchError, match=r"update 0: INVALID_ARGUMENT, 'counter "
                                              r"HomaggIngress.aggregation.stats: counts are never "
                                              r"negative "
                                              r"\(-1 packets, 0 bytes\)'"):
            c.write_counter(P4.COUNTER_STATS, {25: CounterValue(-1, 0)})


def test_an_empty_datagram_is_counted_as_malformed(agg):
    with connect(agg) as c:
        before = J.read_stats(c).switch["DROP_MALFORMED"]
        agg.send(0, b"")
        assert agg.recv(0, 0.2) == []
        wait_for(lambda: J.read_stats(c).switch["DROP_MALFORMED"] == before + 1, 5,
                 "the empty datagram counted")


def test_a_partly_failing_batch_is_one_clear_error_not_a_hang(agg):
    """p4runtime-shell 0.0.6's error parser loops forever when some updates of a batch
    succeeded; the controller reads the per-update errors itself (p4client._write)."""
    with connect(agg) as c:
        ok = c._entry_pb(TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 11}, P4.ACTION_TO_SWITCH))
        c._write("a batch", [update("INSERT", ok)])
        fresh = c._entry_pb(TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 12},
                                       P4.ACTION_TO_SWITCH))
        done = threading.Event()
        caught: list = []

        def write():
            try:
                c._write("a batch", [update("INSERT", fresh), update("INSERT", ok)])
            except SwitchError as e:
                caught.append(e)
            done.set()

        threading.Thread(target=write, daemon=True).start()
        assert done.wait(10), "the write hung"
        assert len(caught) == 1 and "a batch failed: update 1: ALREADY_EXISTS" in str(caught[0])
        assert {e.match["dst_addr"] for e in c.read(P4.TABLE_LOCAL_IP)} == {11, 12}


def test_reads_one_entry_one_cell_or_everything(agg):
    with connect(agg) as c:
        J.install_base(c, base_config(agg))
        J.add_job(c, job_spec(agg))
        everything = pb.Entity()
        everything.table_entry.table_id = 0
        got = [e for r in c.client.read_one(everything) for e in r.entities]
        assert len(got) == 1 + (HOSTS + 1) + HOSTS + 3 + 3
        one = pb.Entity()
        one.table_entry.CopyFrom(c._entry_pb(TableEntry(
            P4.TABLE_JOB_WORKERS, {"src_addr": J.ip_int(agg.addr(1)[0]),
                                   "src_port": agg.addr(1)[1]})))
        got = [e.table_entry for r in c.client.read_one(one) for e in r.entities]
        assert len(got) == 1 and got[0].action.action.params[1].value == b"\x01"  # worker 1
        cell = pb.Entity()
        cell.counter_entry.counter_id = P4.SCHEMA.counter(P4.COUNTER_STATS).id
        cell.counter_entry.index.index = wire.EPOCH_STORE
        got = [e.counter_entry for r in c.client.read_one(cell) for e in r.entities]
        assert [(e.index.index, e.data.packet_count) for e in got] == [(wire.EPOCH_STORE, 1)]
        assert len(c.read_counter(P4.COUNTER_JOB_STATS)) == wire.JOB_STATS_SIZE


def test_arbitration_one_primary_several_sessions(agg):
    entry = TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 1}, P4.ACTION_TO_SWITCH)
    first = connect(agg, (0, 1))
    try:
        with connect(agg, (0, 2)) as second:  # higher: the primary now
            # the client knows from the switch's arbitration update, and says so
            with pytest.raises(SwitchError, match=r"another controller is primary \(election "
                                                  r"id 0,2, above this one's 0,1\)"):
                first.insert(entry)
            first.client.primary = True  # (past the client's own check: the switch refuses)
            with pytest.raises(SwitchError, match="PERMISSION_DENIED"):
                first.insert(entry)
            second.insert(entry)
            with pytest.raises(SwitchError, match="no P4Runtime session"):
                connect(agg, (0, 2))  # an election id already held
        first.modify(entry)  # the primary left: the first is primary again
    finally:
        first.close()
    with connect(agg, (0, 2)) as again:  # sessions one after the other
        again.delete(entry)
    with pytest.raises(SwitchError, match="no P4Runtime session"):
        P4RuntimeSwitch(agg.grpc, device_id=2).open()


# -- homagg-ctl --------------------------------------------------------------------------------


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("homagg-ctl: error: "), err
    return err


def test_homagg_ctl_drives_the_software_aggregator(agg, tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "net.toml"
    cfg.write_text(agg.toml(agg.grpc, agg.job_toml(7, range(3))))
    reqlog = tmp_path / "p4rt.log"
    base = ["-c", str(cfg), "--request-log", str(reqlog)]

    assert ctl(base + ["install"]) == 0  # no p4c involved: the P4Info ships with homagg
    out = capsys.readouterr().out
    assert f"pipeline installed on s1 ({agg.grpc}); 4 hosts routed" in out
    assert "job 7: 3 workers, slots 0-7, epoch 1, group 8" in out
    assert ctl(base + ["install", "--no-jobs"]) == 0  # a fresh pipeline, as on bmv2
    assert ctl(base + ["job", "list"]) == 0
    assert "no jobs installed" in capsys.readouterr().out
    assert ctl(base + ["job", "add", "7"]) == 0
    assert "job 7: 3 workers, slots 0-7, epoch 1" in capsys.readouterr().out

    aggregate(agg, 7, words_of(4), key=job_key(7))
    assert ctl(base + ["stats", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["switch"]["STAT_COMPLETED"] == 1 and st["jobs"]["7"]["JOB_STAT_ACCEPTED"][
        "packets"] == 3
    assert ctl(base + ["reset", "7"]) == 0
    assert ("job 7 reset: epoch 2, counters zeroed, registers skipped (software aggregator: "
            "the new epoch empties the region)") in capsys.readouterr().out
    aggregate(agg, 7, words_of(5), key=job_key(7))

    assert ctl(base + ["job", "add", "7"]) == 1
    assert "job 7 is already installed" in one_line_error(capsys)
    # Another controller wrote the job between this one's read and its write: the switch
    # refuses the insert itself.
    monkeypatch.setattr(J, "list_jobs", lambda sw: [])
    assert ctl(base + ["job", "add", "7"]) == 1
    assert "ALREADY_EXISTS, 'entry exists in HomaggIngress.aggregation.admission.job_workers " \
           "(src_addr=127.0.0.1" in one_line_error(capsys)
    monkeypatch.undo()

    assert ctl(base + ["job", "remove", "7"]) == 0
    assert "job 7 removed (slots 0-7 free)" in capsys.readouterr().out
    assert ctl(base + ["job", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert ctl(base + ["job", "remove", "7"]) == 1
    assert "job 7 is not installed" in one_line_error(capsys)
    log = reqlog.read_text()
    assert "SetForwardingPipelineConfig" in log and "0 bytes of bmv2 JSON" in log


def test_a_job_added_without_a_key_gets_one_drawn_at_random_and_said_once(agg, tmp_path,
                                                                         capsys):
    """``job add --worker ...`` without --key: a key drawn at random, printed once, that the
    job's packets must carry (key 0, which any sender could guess, is refused)."""

    cfg = tmp_path / "net.toml"
    cfg.write_text(agg.toml(agg.grpc))
    base = ["-c", str(cfg), "--request-log", str(tmp_path / "l")]
    workers = [a for i in range(3) for a in ("--worker", f"h{i}:{agg.addr(i)[1]}")]
    assert ctl(base + ["job", "add", "4", "--key", "0", *workers]) == 1
    assert "--key 0: 1 to 2**32 - 1 (0 is no key" in one_line_error(capsys)
    keys = []
    for job in (4, 5):
        assert ctl(base + ["job", "add", str(job), *workers, "--slots", "8"]) == 0
        out = capsys.readouterr().out
        said = re.findall(rf"^job {job}: key (0x[0-9a-f]{{8}}), drawn at random: give its "
                          rf"agents HOMAGG_JOB_KEY=\1$", out, re.M)
        assert len(said) == 1, out
        keys.append(int(said[0], 16))
        assert keys[-1] != 0
        if job == 4:  # (the same workers: one job at a time)
            assert ctl(base + ["job", "remove", "4"]) == 0
            capsys.readouterr()
    assert keys[0] != keys[1]
    assert ctl(base + ["job", "list", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["keyed"] is True
    for w in range(3):  # a packet with key 0 is dropped as spoofed: no result for anyone
        agg.send(w, wire.pack(wire.OP_ADD, 5, w, 0, 1, words_of(1)[w]))
    assert all(agg.recv(w, 0.3, 1) == [] for w in range(3))
    aggregate(agg, 5, words_of(2), seq=2, key=keys[1])


def test_homagg_softswitch_serves_p4runtime_next_to_udp(tmp_path, capsys):
    """The command: jobs from its config are in the tables homagg-ctl reads, SIGHUP resets
    them, the stats file follows the counters; a P4Runtime address in use is an error."""
    hosts = LoopbackHosts((SWITCH_IP, 0))
    try:
        cfg = tmp_path / "net.toml"
        stats = tmp_path / "stats.json"
        cfg.write_text(hosts.toml("127.0.0.1:9", hosts.job_toml(3, range(3), 16)))
        proc, grpc_addr, udp = start_softswitch("-c", str(cfg), "--stats-file", str(stats),
                                                "--log-level", "warning",
                                                ready=tmp_path / "ready.json",
                                                log=tmp_path / "soft.out")
        try:
            hosts.switch = udp
            base = ["-c", str(cfg), "--grpc", grpc_addr, "--request-log", str(tmp_path / "l")]
            assert ctl(base + ["job", "list", "--json"]) == 0
            (job,) = json.loads(capsys.readouterr().out)
            assert (job["id"], job["epoch"], job["slots"], len(job["workers"])) == (3, 1, 16, 3)
            aggregate(hosts, 3, words_of(6), key=job_key(3))
            os.kill(proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 5
            while True:
                assert ctl(base + ["job", "list", "--json"]) == 0
                if json.loads(capsys.readouterr().out)[0]["epoch"] == 2:
                    break
                assert time.monotonic() < deadline, "SIGHUP did not reset the job"
                time.sleep(0.1)
            aggregate(hosts, 3, words_of(7), key=job_key(3))  # seq 1 again after the reset
            wait_for(lambda: stats.exists()
                     and json.loads(stats.read_text())["switch"]["STAT_COMPLETED"] == 2,
                     what="the stats file to count both rounds")

            clash = subprocess.run([sys.executable, "-m", "homagg.targets.soft", "--grpc",
                                    grpc_addr, "--bind", SWITCH_IP, "--port", "0"],
                                   capture_output=True, text=True, timeout=30)
            assert clash.returncode == 1
            assert f"cannot serve P4Runtime at {grpc_addr}" in clash.stderr
        finally:
            stop(proc)
    finally:
        hosts.close()


# -- the conformance table, jobs installed over P4Runtime ------------------------------------


@pytest.fixture(scope="module")
def p4rt_target():
    """The conformance table's software target with its jobs written, and its counters read,
    by the controller over P4Runtime."""
    t = SoftUdpTarget(conformance.WORKERS + 1, p4runtime=True)
    yield t
    for j in getattr(t, "installed", []):
        t.remove_job(j)
    t.close()


@pytest.mark.parametrize("case", conformance.CASES, ids=[c.name for c in conformance.CASES])
def test_conformance_with_jobs_over_p4runtime(p4rt_target, case):
    conformance.test_rule(p4rt_target, case)
    if case.tree:  # the job table reads back with its uplink, through P4Runtime
        (job,) = J.list_jobs(p4rt_target.conn)
        assert job.uplink == p4rt_target.uplink


def test_the_softswitchs_old_entry_point_still_runs_the_cli_with_a_warning(capsys):
    from homagg.targets import soft

    with pytest.warns(DeprecationWarning, match="use homagg.targets.soft.cli.main"), \
            pytest.raises(SystemExit) as e:
        soft.main(["--help"])
    assert e.value.code == 0 and "homagg-softswitch" in capsys.readouterr().out
