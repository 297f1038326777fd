"""The switch model one TNA pass at a time (homagg.switch_model.tna), and the reader and
replay of P4Testgen's PTF tests (homagg.controller.tna_testgen). Runs everywhere: no compiler.

The passes compose back into the model: a round's packets, pass by pass from the register
cells the model's own state gives, end in the datagrams the model sends for the whole round,
bit for bit. And a PTF test in P4Testgen's Tofino format replays as agreed, or disagreed
where its expected frame is not the model's."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from homagg import wire
from homagg.controller import tna_testgen as tg
from homagg.switch_model import JobEntry, SwitchModel, tna
from homagg.switch_model.tna import Tables, TnaPass
from homagg.switch_model.tna_frame import ipv4_checksum, parse_bridge

C = tna.tna_constants()
K = C["WORDS"]
SWITCH = "10.0.0.254"
RECIRC = C["RECIRC_PORT"]
PORT0 = 10  # the first worker's switch port (not a recirculation port)


def ipn(s: str) -> int:
    return int.from_bytes(bytes(map(int, s.split("."))), "big")


def frame(src_ip: str, payload: bytes, sport: int = 50000,
          dport: int = wire.HOMAGG_UDP_PORT_MIN) -> bytes:
    udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0)
    ip = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(payload), 0, 0, 64, 17, 0,
                               ipn(src_ip).to_bytes(4, "big"), ipn(SWITCH).to_bytes(4, "big")))
    ip[10:12] = ipv4_checksum(ip).to_bytes(2, "big")
    return bytes.fromhex("00000a0000fe00000a0000010800") + bytes(ip) + udp + payload


def job_tables(workers: int, job: int = 3, epoch: int = 1) -> tuple[Tables, JobEntry]:
    t = Tables()
    t.entries["local_ip"] = [((ipn(SWITCH),), "to_switch", {})]
    addrs = [(f"10.0.0.{w + 1}", 50000) for w in range(workers)]
    for w, (ip, port) in enumerate(addrs):
        t.entries.setdefault("job_workers", []).append(((ipn(ip), port), "set_worker", dict(
            job=job, worker=w, workers=workers, epoch=epoch, region_base=4, region_size=8,
            mcast_group=job, port=w + PORT0, auth=7)))
        t.entries.setdefault("result_dst", []).append(((job, w + wire.RID_WORKER_OFFSET),
                                                       "set_result_dst",
                                                       dict(mac=w + 1, ip=ipn(ip), port=port)))
    entry = JobEntry(job, addrs, epoch, 4, 8, ports=[w + PORT0 for w in range(workers)], auth=7)
    return t, entry


def registers(model: SwitchModel, idx: int, job: JobEntry) -> dict:
    """The TNA program's cells for slot copy ``idx`` as the model's state says them."""
    m = model.mem
    w = m.words[idx].view(np.uint32)
    k = len(w)
    regs = {"slot_round.slot_owner": {idx: {"owner": m.epoch[idx] << 8 | m.gen[idx],
                                            "tag": m.tag[idx]}},
            "slot_round.slot_round": {idx: {"seen": m.seen[idx], "tag": m.tag[idx]}}}
    for i in range(k // 2):
        regs[f"p{i:02d}.lanes"] = {idx: {"lo": int(w[i]), "hi": int(w[k // 2 + i])}}
    return regs


def payload(f: bytes) -> bytes:
    return f[42:]


@pytest.mark.parametrize("tofino2", [False, True], ids=["tofino", "tofino2"])
@pytest.mark.parametrize("workers", [1, 2, 5, 32])
def test_a_rounds_passes_end_in_the_models_multicast(workers, tofino2):
    """On Tofino 1's recirculation port and on Tofino 2's."""
    K = C["WORDS_T2" if tofino2 else "WORDS"]
    RECIRC = C["RECIRC_PORT_T2" if tofino2 else "RECIRC_PORT"]
    rng = np.random.default_rng(workers)
    t, job = job_tables(workers)
    model = SwitchModel(words=K)
    model.install(job)
    slot, seq, gen = 3, 9, 2
    idx = 2 * (job.base + slot) + 1
    order = rng.permutation(workers)
    for n, w in enumerate(order):
        words = rng.integers(-2**20, 2**20, K).astype(np.int32)
        data = wire.pack(wire.OP_ADD, job.id, int(w), slot, seq, words, gen=gen, k=K, auth=7,
                         flags=wire.FLAG_PHASE)
        p = TnaPass(t, registers(model, idx, job), tofino2)
        e = p.expect(int(w) + PORT0, frame(job.workers[w][0], data))
        out = model.process(data, job.workers[w], int(w) + PORT0)
        if n < workers - 1:
            assert e.frame is None and not out.replies, e.rule
            continue
        assert e.port == RECIRC and e.frame is not None, e.rule
        kind, jid, mcast, port, bidx = parse_bridge(e.frame)
        assert (kind, jid, mcast, port, bidx) == (C["BRIDGE_HARVEST_MCAST"], job.id, job.id,
                                                   int(w) + PORT0, idx)
        # pass 2: the registers hold the sums now (the model's state after the round)
        p2 = TnaPass(t, registers(model, idx, job), tofino2)
        e2 = p2.expect(RECIRC, e.frame)
        reps = p2.replicas(job.id, e2)
        assert len(reps) == workers == len(out.replies)
        for r, (want, dst) in zip(reps, out.replies):
            assert payload(r.frame) == want
            assert r.frame[30:34] == ipn(dst[0]).to_bytes(4, "big")
            assert ipv4_checksum(r.frame[14:34]) == int.from_bytes(r.frame[24:26], "big")


def test_a_retransmission_of_a_finished_round_takes_three_passes_to_the_models_reply():
    t, job = job_tables(2)
    model = SwitchModel(words=K)
    model.install(job)
    datas = [wire.pack(wire.OP_ADD, job.id, w, 0, 5, np.full(K, w + 1, np.int32), k=K, auth=7)
             for w in range(2)]
    for w, d in enumerate(datas):
        model.process(d, job.workers[w], w + PORT0)
    idx = 2 * job.base
    p = TnaPass(t, registers(model, idx, job))
    e1 = p.expect(PORT0, frame("10.0.0.1", datas[0]))
    assert e1.port == RECIRC and parse_bridge(e1.frame)[0] == C["BRIDGE_RETRANS_HI"]
    e2 = p.expect(RECIRC, e1.frame)
    assert e2.port == RECIRC and parse_bridge(e2.frame)[0] == C["BRIDGE_HARVEST_UNICAST"]
    e3 = p.expect(RECIRC, e2.frame)
    want = model.process(datas[0], job.workers[0], PORT0).replies
    assert e3.port == PORT0 and [(payload(e3.frame), job.workers[0])] == want


def test_plain_forwarding_routes_and_drops_homagg_results_from_hosts():
    t = Tables()
    t.entries["ipv4_route"] = [(((ipn("10.0.0.0"), 24),), "route",
                                dict(port=9, src_mac=0xAA, dst_mac=0xBB))]
    f = frame("10.0.0.1", b"x" * 20, sport=1234, dport=80)
    e = TnaPass(t, {}).expect(1, f)
    assert e.port == 9 and e.frame is not None and e.frame[22] == 63
    assert e.frame[:12] == bytes.fromhex("0000000000bb0000000000aa")
    e = TnaPass(t, {}).expect(1, frame("10.0.0.1", b"x" * 20, sport=wire.HOMAGG_UDP_PORT_MIN,
                                       dport=80))
    assert e.frame is None and "from a host" in e.rule


def test_a_job_entry_homagg_ctl_never_writes_is_outside():
    t, _ = job_tables(2)
    t.entries["job_workers"][0][2]["workers"] = 0
    data = wire.pack(wire.OP_ADD, 3, 0, 0, 1, np.zeros(K, np.int32), k=K, auth=7)
    with pytest.raises(tna.Outside, match="worker 0 of 0"):   # admitted: no bookkeeping
        TnaPass(t, {}).expect(PORT0, frame("10.0.0.1", data))
    e = TnaPass(t, {}).expect(PORT0 + 1, frame("10.0.0.1", data))  # admission's drop: answered
    assert e.frame is None and "DROP_SPOOFED" in e.rule


def test_join_registers_keep_the_run_with_the_jobs_epoch():
    """md.join_run: the join registers keep the run with the job's epoch in its high half. A
    job added again under its id (epoch 2, two workers), whose workers join the run (0) its
    last incarnation (epoch 1, four workers) completed, starts afresh: its first join waits
    for the other worker, where members {0-3} of run 0 would leave it waiting for good."""
    t, _ = job_tables(2, epoch=2)
    data = wire.pack(wire.OP_JOIN, 3, 0, 0, 5, [0], auth=7)   # worker 0, run 0, nonce 5

    def join(key: int, seen: int, gen: int = 9) -> tna.Expect:
        regs = {"join_state.join_members": {3: {"seen": seen, "run": key}},
                "join_state.join_generation": {3: {"gen": gen, "run": key}}}
        return TnaPass(t, regs).expect(PORT0, frame("10.0.0.1", data))

    fresh = join(0 ^ 1 << 16, 0b1111)                # the last incarnation's: afresh, absorbed
    assert fresh.frame is None and "STAT_ACCEPTED" in fresh.rule, fresh.rule
    done = join(0 ^ 2 << 16, 0b10)                   # this one's: worker 1 joined, this completes
    assert done.frame is not None and "join completes" in done.rule, done.rule
    with pytest.raises(tna.Outside, match="members 0xf outside"):   # no incarnation leaves it
        join(0 ^ 2 << 16, 0b1111)


PTF = '''
class Test1(AbstractTest):
    # Current statement coverage: 0.12
    \'\'\'
    [Parser] HomaggIngressParser
    \'\'\'

    def setupCtrlPlane(self):
        self.setRegisterValue('pipe.HomaggIngress.slot_round.slot_owner', [('pipe.HomaggIngress.slot_round.slot_owner.owner', 0x102), ('pipe.HomaggIngress.slot_round.slot_owner.tag', 0x5)], 8)
        self.setRegisterValue('pipe.HomaggIngress.slot_round.slot_round', [('pipe.HomaggIngress.slot_round.slot_round.seen', 0x1), ('pipe.HomaggIngress.slot_round.slot_round.tag', 0x5)], 8)
        # Table pipe.HomaggIngress.local_ip
        self.insertTableEntry(
            'pipe.HomaggIngress.local_ip',
            [
                gc.KeyTuple('dst_addr', 0x0a0000fe),
            ],
            'HomaggIngress.to_switch',
            [
            ]
        )
        # Table pipe.HomaggIngress.admission.job_workers
        self.insertTableEntry(
            'pipe.HomaggIngress.admission.job_workers',
            [
                gc.KeyTuple('src_addr', 0x0a000001),
                gc.KeyTuple('src_port', 0xc350),
            ],
            'HomaggIngress.admission.set_worker',
            [
                gc.DataTuple('job', 0x3),
                gc.DataTuple('worker', 0x0),
                gc.DataTuple('workers', 0x2),
                gc.DataTuple('epoch', 0x1),
                gc.DataTuple('region_base', 0x4),
                gc.DataTuple('region_size', 0x8),
                gc.DataTuple('mcast_group', 0x3),
                gc.DataTuple('port', 0x1),
                gc.DataTuple('auth', 0x7),
            ]
        )

    def sendPacket(self):
        ig_port = 1
        pkt = b'SEND'
        send_packet(self, ig_port, pkt)

    def verifyPackets(self):
        VERIFY

    def runTest(self):
        self.runTestImpl()
'''  # noqa: E501


def _ptf(tmp_path, send: bytes, expect: tuple[int, bytes] | None, care=()) -> list:
    verify = "pass"
    if expect is not None:
        verify = (f"eg_port = {expect[0]}\n        exp_pkt = {expect[1]!r}\n"
                  f"        exp_pkt = Mask(exp_pkt)\n")
        verify += "".join(f"        exp_pkt.set_do_not_care({a}, {b})\n" for a, b in care)
        verify += "        verify_packet(self, exp_pkt, eg_port)"
    text = PTF.replace("b'SEND'", repr(send)).replace("VERIFY", verify)
    p = tmp_path / "t.py"
    p.write_text(text)
    return tg.parse_ptf(p)


def test_a_ptf_test_replays_agreed_and_a_wrong_frame_disagrees(tmp_path):
    # worker 0's duplicate of an open round (seen 1, round 5): a status back to it
    data = wire.pack(wire.OP_ADD, 3, 0, 0, 5, np.arange(K, dtype=np.int32), gen=2, k=K,
                     auth=7)
    sent = frame("10.0.0.1", data)
    (probe,) = _ptf(tmp_path, sent, None)
    assert probe.tables.entries["job_workers"][0][0] == (ipn("10.0.0.1"), 50000)
    assert probe.registers["slot_round.slot_owner"][8] == {"owner": 0x102, "tag": 5}
    want = TnaPass(probe.tables, probe.registers, declared=frozenset({tna.NO_COUNT}))
    e = want.expect(1, sent)
    assert e.port == 1 and e.frame is not None
    (t,) = _ptf(tmp_path, sent, (1, e.frame))
    r = tg.replay(t)
    assert (r.outcome, r.declared) == ("declared", (tna.NO_COUNT,))   # status: count word 0
    bad = bytearray(e.frame)
    bad[-5] ^= 1                                                    # the bitmap's last bit
    (t,) = _ptf(tmp_path, sent, (1, bytes(bad)))
    assert tg.replay(t).outcome == "disagreed"
    (t,) = _ptf(tmp_path, sent, (1, bytes(bad)), care=[(8 * (len(bad) - 5), 8)])
    assert tg.replay(t).outcome == "declared"                       # that byte left undecided
    (t,) = _ptf(tmp_path, sent, None)
    assert tg.replay(t).outcome == "disagreed"                      # a drop where it replies
