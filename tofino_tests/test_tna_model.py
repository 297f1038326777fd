"""The TNA program's design against the reference rules: the conformance table of
bmv2_tests/test_conformance.py (the switch model's, bmv2's and the software aggregator's) run
on tofino_tests/tna_model.py, the TNA program written out register by register, with K = 64.

Where the TNA program is meant to differ (docs/switch.md, "Tofino": no overflow flag, no op
or count kept, no release of a slot copy's other half, runs told apart by their number only,
one counter per pass, no trees), the row's expectation is replaced here, with the reason:
those rows hold the difference to what the docs say, not to nothing. Tree rows are left out
(the TNA program has no uplink). Runs everywhere: no compiler needed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bmv2_tests import test_conformance as C
from homagg import wire
from tofino_tests.tna_model import Job, K, TnaModel

R, S, T, P = wire.FLAG_RESULT, wire.FLAG_STATUS, wire.FLAG_RETRANS, wire.FLAG_PHASE
ALL = C.ALL


def _case(name: str) -> C.Case:
    return next(c for c in C.CASES if c.name == name)


#: row -> (why the TNA program differs, the row as the TNA program answers it)
DIFFERS: dict[str, tuple[str, C.Case]] = {}


def differs(name: str, why: str, **changes) -> None:
    DIFFERS[name] = (why, replace(_case(name), **changes))


NO_OVERFLOW = "adds wrap: no overflow flag (the codec's headroom keeps sums in int32)"
differs("positive int32 overflow is flagged in the result", NO_OVERFLOW,
        replies=tuple(C.Reply(h, R, -(2**31)) for h in ALL), also=("STAT_COMPLETED",))
differs("overflow flag survives into a retransmitted result", NO_OVERFLOW,
        replies=(C.Reply(0, R | T, -(2**31)),))
differs("a contribution flagged as overflowed (a child switch's partial) flags its round",
        NO_OVERFLOW + "; no trees, so no child's flag",
        replies=tuple(C.Reply(h, R, 3) for h in ALL), also=("STAT_COMPLETED",))
differs("another op in the same round is a mismatch",
        "no op is kept per round: a worker that sends another op sends wrong words",
        counter="STAT_ACCEPTED", replies=())
differs("a finished round is stale for a worker that moved on",
        "no release of the other copy: the finished round's result again, still correct",
        counter="STAT_RETRANS_REPLY", replies=(C.Reply(0, R | T, 3),))
differs("a packet of an earlier run is stale",
        "a copy's owner is compared for equality: another run's packet makes it fresh",
        counter="STAT_ACCEPTED", replies=())
RUNS = "runs are told apart by their run number only: a new nonce of the same run rejoins it"
differs("a new run's join after a complete one starts the next join", RUNS,
        counter="STAT_RETRANS_REPLY", replies=(C.Reply(0, R | T, 0),))
differs("a join that a newer run's join replaced is stale", RUNS,
        counter="STAT_RETRANS_REPLY", replies=(C.Reply(0, R | T, 0),))
differs("a retransmission of the join that never completed is stale once another run's "
        "started afresh", "a join of another run than the last starts afresh, older or not",
        counter="STAT_ACCEPTED", replies=())
ONE_COUNT = "one STATS cell per pass: a completing join counts STAT_COMPLETED alone"
for _name in ("a join is absorbed until the last worker's, then multicast",
              "a worker restarting during a pending join is counted once",
              "after a join that never completed, a restarted run's joins complete in any order",
              "joins of one run count toward one join (replies carry no run)"):
    differs(_name, ONE_COUNT, counter="STAT_COMPLETED", also=())
differs("a join of another run finds a join that never completed, and starts afresh",
        "one STATS cell per pass: STAT_JOIN_AFRESH is not counted", also=())
differs("a truncated packet", "K = 64: truncated at 64 words",
        probe=C.Pkt(0, size=wire.packet_bytes(K) - 4))
differs("a packet of another K (64 words) is truncated for this switch",
        "K = 64 here: a packet of 256 words is the one of another K, and too long",
        probe=C.Pkt(0, size=wire.packet_bytes(256)), counter="DROP_BAD_LENGTH")

CASES = [DIFFERS.get(c.name, (None, c))[1] for c in C.CASES if not c.tree]


@pytest.fixture(autouse=True)
def _k64(monkeypatch):
    monkeypatch.setattr(C, "K", K)  # the table's packets carry this program's K words


def _payload(p: C.Pkt, job: int) -> bytes:
    """The row's packet with K words (wire.pack pads to the default K: cut it back)."""
    data = p.payload(job)
    return data[:wire.packet_bytes(K)] if p.size is None and p.op != wire.OP_JOIN else data


def _addr(host: int) -> tuple[str, int]:
    return (f"10.0.0.{host + 1}", wire.DEFAULT_AGENT_PORT)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule_on_the_tna_design(case):
    job_id = 3
    m = TnaModel()
    m.install(Job(job_id, C.WORKERS, 1, 0, C.SLOTS, job_id + 1, C.key_of(job_id)),
              [_addr(h) for h in ALL])
    for p in case.setup:
        m.process(_payload(p, job_id), _addr(p.host))
    before = m.stats.copy()
    out = m.process(_payload(case.probe, job_id), _addr(case.probe.host))
    moved = {wire.STATS[i]: int(d) for i, d in enumerate(m.stats - before) if d}
    assert moved == {n: 1 for n in (case.counter, *case.also)}, f"counters moved: {moved}"

    by_host = {_addr(h): h for h in range(C.WORKERS + 1)}
    got: dict[int, list[wire.Packet]] = {}
    for data, dst in out:
        got.setdefault(by_host[dst], []).append(wire.unpack(data))
    expect = {r.host: r for r in case.replies}
    assert set(got) == set(expect), f"replies to {sorted(got)}, expected {sorted(expect)}"
    for host, r in expect.items():
        assert len(got[host]) == 1
        pkt = got[host][0]
        assert pkt.flags == r.flags, f"host {host}: flags {pkt.flags:#x}, expected {r.flags:#x}"
        join = case.probe.op == wire.OP_JOIN
        assert (pkt.job, pkt.slot) == (job_id, K if join else case.probe.slot)
        assert pkt.auth == C.key_of(job_id) and pkt.seq == case.probe.seq
        if r.value is not None:
            n = wire.JOIN_WORDS if join else K
            np.testing.assert_array_equal(
                pkt.words, np.full(n, r.value, np.int64).astype(np.uint32).view(np.int32))
        if r.refused is not None:
            assert pkt.words[-1] == wire.STAT_INDEX[r.refused] and not pkt.words[:-1].any()
        if r.status is not None:
            assert pkt.status == r.status and not pkt.words[:-3].any()


def test_every_difference_names_a_row_of_the_table():
    names = {c.name for c in C.CASES}
    assert set(DIFFERS) <= names and all(why for why, _ in DIFFERS.values())


# -- rounds under loss, duplication and reordering ----------------------------------------------

def _exchange(seed: int, workers: int = 4, slots: int = 3, rounds: int = 60, loss: float = 0.15,
              dup: float = 0.1) -> None:
    """Workers run ``rounds`` rounds over ``slots`` slots (round r: slot r % slots, its copy
    (r // slots) % 2, tag r + 1), each sending round r only once it holds round r - slots's
    result (the agents' window), resending what is unanswered; the network loses,
    duplicates and reorders every packet both ways. Every worker must end with every round's
    exact int32 sum, and no refusal of a round it still waits for."""
    rng = np.random.default_rng(seed)
    job = 3
    m = TnaModel()
    m.install(Job(job, workers, 1, 0, slots, job + 1, C.key_of(job)), [_addr(h) for h in
                                                                       range(workers)])
    bound = 2**31 // workers
    values = rng.integers(-bound, bound, size=(rounds, workers, K), dtype=np.int64)
    ops = rng.choice([wire.OP_ADD, wire.OP_OR], size=rounds, p=[0.7, 0.3])
    values[ops == wire.OP_OR] &= 0x7FFFFFFF
    exact = np.where((ops == wire.OP_ADD)[:, None],
                     values.sum(axis=1),
                     np.bitwise_or.reduce(values, axis=1))
    got: list[dict[int, np.ndarray]] = [{} for _ in range(workers)]
    to_switch: list[tuple[bytes, tuple[str, int]]] = []
    to_hosts: list[tuple[bytes, tuple[str, int]]] = []
    by_addr = {_addr(h): h for h in range(workers)}

    def lossy(queue, item):
        if rng.random() < loss:
            return
        queue.append(item)
        if rng.random() < dup:
            queue.append(item)

    for _tick in range(100_000):
        if all(len(g) == rounds for g in got):
            break
        for w in range(workers):
            for r in range(rounds):
                if r in got[w] or (r >= slots and r - slots not in got[w]):
                    continue
                if rng.random() < 0.3:  # not sent yet, or its timeout came: (re)send
                    words = values[r, w].astype(np.uint32).view(np.int32)
                    pkt = wire.pack(int(ops[r]), job, w, r % slots, r + 1, words,
                                    flags=wire.FLAG_PHASE if (r // slots) % 2 else 0, k=K,
                                    auth=C.key_of(job))
                    lossy(to_switch, (pkt, _addr(w)))
        rng.shuffle(to_switch)
        for data, src in to_switch:
            for out, dst in m.process(data, src):
                lossy(to_hosts, (out, dst))
        to_switch.clear()
        rng.shuffle(to_hosts)
        for data, dst in to_hosts:
            p = wire.unpack(data, K)
            w, r = by_addr[dst], p.seq - 1
            if p.flags & wire.FLAG_STATUS:
                continue
            assert not p.flags & wire.FLAG_REFUSED or r in got[w], \
                f"worker {w}: round {r} refused ({p.words[-1]}) while it waits for it"
            if p.flags & wire.FLAG_REFUSED:
                continue
            if r not in got[w]:
                got[w][r] = p.words.copy()
        to_hosts.clear()
    for w in range(workers):
        assert len(got[w]) == rounds, f"worker {w} has {len(got[w])} of {rounds} rounds"
        for r in range(rounds):
            np.testing.assert_array_equal(got[w][r], exact[r].astype(np.int32),
                                          err_msg=f"worker {w}, round {r}")


@pytest.mark.parametrize("seed", range(4))
def test_rounds_under_loss_duplication_and_reordering_are_exact(seed):
    _exchange(seed)


def test_a_single_worker_job_completes_each_round_with_its_own_words():
    _exchange(7, workers=1, rounds=10, loss=0.0, dup=0.0)
