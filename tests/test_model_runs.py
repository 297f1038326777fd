"""The software aggregator's run path (``SwitchModel.process_run``, for coalesced receives) is
``process`` packet by packet: the same slot state, words, overflow bits, counters and replies,
on random traffic with retransmissions, stale and mismatched rounds, overflow, OR rounds,
joins, strays and wrong identities mixed into the bursts."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from homagg import wire
from homagg.switch_model import JobEntry, SwitchModel

K = 64
S = 8
W = 3
ADDRS = [(f"10.0.0.{w + 1}", 50000) for w in range(W)]
STRAY = ("10.0.0.99", 50000)


def _packet(rng, w, g, op, big=False, **kw) -> bytes:
    hi = 2**31 - 1 if big else 1000
    words = rng.integers(-hi, hi, K, dtype=np.int64).astype(np.int32)
    fields = dict(op=op, job=1, worker=w, slot=g % S, seq=g + 1, gen=0,
                  flags=wire.FLAG_PHASE if (g // S) % 2 else 0)
    fields.update(kw)
    return wire.header(**fields) + words.astype(">i4").tobytes()


def _traffic(seed: int) -> list[tuple[tuple[str, int], list[bytes]]]:
    """Bursts (sender, datagrams) as a coalesced receive would give them."""
    rng = np.random.default_rng(seed)
    op = wire.OP_OR if seed % 4 == 3 else wire.OP_ADD
    per_worker: list[list[bytes]] = [[] for _ in range(W)]
    for g in range(6 * S):
        for w in range(W):
            p = _packet(rng, w, g, op, big=rng.random() < 0.05)
            per_worker[w].append(p)
            r = rng.random()
            if r < 0.10:  # a retransmission, soon after
                per_worker[w].append(p)
            elif r < 0.13:  # an older round's packet, late
                per_worker[w].append(per_worker[w][int(rng.integers(0, len(per_worker[w])))])
            elif r < 0.15:  # wrong identity, a bad slot, a bad length, a join
                per_worker[w].append(rng.choice([
                    _packet(rng, (w + 1) % W, g, op),
                    _packet(rng, w, g, op, slot=S + 5),
                    _packet(rng, w, g, op)[:-4],
                    wire.header(op=wire.OP_JOIN, job=1, worker=w, slot=0, seq=77, gen=0)
                    + bytes(4 * wire.JOIN_WORDS)]))
            elif r < 0.17:  # the other op in the same slot: a mismatch
                per_worker[w].append(_packet(rng, w, g, wire.OP_OR + wire.OP_ADD - op))
    bursts: list[tuple[tuple[str, int], list[bytes]]] = [(STRAY, [_packet(rng, 0, 0, op)] * 3)]
    cursor = [0] * W
    while any(c < len(p) for c, p in zip(cursor, per_worker)):
        w = int(rng.integers(0, W))
        n = int(rng.integers(1, 2 * S))
        chunk = per_worker[w][cursor[w]:cursor[w] + n]
        cursor[w] += len(chunk)
        if chunk:
            bursts.append((ADDRS[w], chunk))
        if rng.random() < 0.05:
            bursts.append((STRAY, [_packet(rng, 0, 0, op)] * 3))
    return bursts


def _model() -> SwitchModel:
    m = SwitchModel(slots=S + 4, words=K)
    m.install(JobEntry(1, ADDRS, 1, 2, S, ports=[1, 2, 3]))
    return m


@pytest.mark.parametrize("seed", range(8))
def test_run_path_is_the_per_packet_path(seed):
    one, runs = _model(), _model()
    fast = [0]
    accept_run = runs._accept_run

    def counted(*a):
        fast[0] += 1
        return accept_run(*a)

    runs._accept_run = counted  # type: ignore[method-assign]
    want: Counter = Counter()
    got: Counter = Counter()
    for src, pkts in _traffic(seed):
        for p in pkts:
            want.update(one.process(p, src).replies)
        size = len(pkts[0])
        if all(len(p) == size for p in pkts[:-1]) and len(pkts[-1]) <= size:
            # as GRO coalesces: equal sizes, the last one may be shorter
            got.update(runs.process_run(b"".join(pkts), size, src))
        else:  # a receive never coalesces those
            for p in pkts:
                got.update(runs.process_run(p, len(p), src))
    assert got == want
    assert np.array_equal(one.stats, runs.stats)
    assert np.array_equal(one.job_stats, runs.job_stats)
    for name in ("seen", "count", "tag", "op", "epoch", "gen", "overflow"):
        assert getattr(one.mem, name) == getattr(runs.mem, name), name
    assert np.array_equal(one.mem.words, runs.mem.words)
    # the traffic did reach the interesting cases
    st = {name: int(one.stats[i]) for i, name in wire.STATS.items()}
    assert st["STAT_COMPLETED"] > 0 and st["STAT_ACCEPTED"] > st["STAT_COMPLETED"]
    assert st["STAT_RETRANS_REPLY"] + st["STAT_DUP_PENDING"] > 0
    assert st["DROP_UNKNOWN_SENDER"] > 0
    assert fast[0] > 0  # and the array path took bursts (not only the fallback)


def test_overflow_in_a_run_is_flagged_as_one_by_one():
    """Every worker adds 2**30 in every lane of every slot: the third add overflows each
    round, in a run as packet by packet."""
    one, runs = _model(), _model()
    big = np.full(K, 2**30, np.int32).astype(">i4").tobytes()
    for w in range(W):
        pkts = [wire.header(op=wire.OP_ADD, job=1, worker=w, slot=g, seq=g + 1, gen=0) + big
                for g in range(S)]
        want = [r for p in pkts for r in one.process(p, ADDRS[w]).replies]
        got = runs.process_run(b"".join(pkts), len(pkts[0]), ADDRS[w])
        assert Counter(got) == Counter(want)
    assert len(got) == S * W and all(d[wire.OFFSETS["flags"]] & wire.FLAG_OVERFLOW
                                     for d, _ in got)
    assert runs.mem.overflow == one.mem.overflow and any(one.mem.overflow)
