"""Jumbo frames: packets of K = 2176 words (the largest multiple of 64 a 9000-byte MTU holds),
exact against the integer sum on the three targets: the model (homagg.switch_model), the
software aggregator's tables and bmv2 running p4/homagg.p4 built for that K (34 chunks of 64
words: the first, a middle and the last chunk all carry data, so a chunk the layout left out
would show). The default K's behaviour is the conformance and aggregation tests' business;
this file is about the size.

The bmv2 half needs p4c-bm2-ss, simple_switch_grpc and root (the testbed's veths run at MTU
9000), and skips with the reason otherwise.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from bmv2_tests.conftest import LOG_DIR, bmv2_skip_reason
from bmv2_tests.targets import Bmv2Target, ModelTarget, SoftTarget, SoftUdpTarget, soft_engine
from homagg import wire

K = wire.MAX_WORDS_PER_PACKET // wire.CHUNK_WORDS * wire.CHUNK_WORDS  # 2176: 34 chunks
WORKERS = 4
_job_ids = itertools.count(1)


@pytest.fixture(scope="module")
def jumbo_testbed():
    """A 4-port bmv2 switch running homagg built for K words."""
    reason = bmv2_skip_reason()
    if reason:
        pytest.skip(reason)
    from homagg.controller import jobs
    from homagg.controller.build import build
    from homagg.controller.p4client import P4RuntimeSwitch
    from homagg.targets.testbed import start_testbed, stop_testbed

    pipeline = build(words=K)
    assert pipeline.words() == K
    bed = start_testbed(WORKERS, LOG_DIR, name="s9")
    try:
        conn = P4RuntimeSwitch(bed.switch.grpc_addr, request_log=LOG_DIR / "s9-p4runtime.log")
        conn.open(pipeline)
        jobs.install_base(conn, bed.config)
        bed.conn = conn
        yield bed
    finally:
        if getattr(bed, "conn", None):
            bed.conn.close()
        stop_testbed(bed)


@pytest.fixture(scope="module", params=["model", "soft", "soft-native", "soft-python", "bmv2"])
def target(request):
    """``soft``: the software aggregator's switch in process; ``soft-*``: behind its UDP
    server, with each of its engines (jumbo datagrams on loopback)."""
    if request.param == "model":
        yield ModelTarget(K)
        return
    if request.param == "soft":
        yield SoftTarget(words=K)
        return
    if request.param.startswith("soft-"):
        t = SoftUdpTarget(WORKERS, engine=soft_engine(request.param), words=K)
        yield t
        t.close()
        return
    yield Bmv2Target(request.getfixturevalue("jumbo_testbed"))


@pytest.fixture
def job(target):
    jid = next(_job_ids)
    target.add_job(jid, list(range(WORKERS)))
    target.drain()
    yield jid
    target.remove_job(jid)


def send(target, job, w, slot, seq, words, op=wire.OP_ADD, phase=0):
    flags = wire.FLAG_PHASE if phase else 0
    target.send(w, wire.pack(op, job, w, slot, seq, words, flags=flags, k=K))


def results(target, workers=range(WORKERS), count=1, timeout=2.0):
    out = {}
    for w in workers:
        got: list[wire.Packet] = []
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            got += target.recv(w, max(0.0, deadline - time.monotonic()), count - len(got))
            if target.synchronous:  # in process: nothing more will come
                break
        out[w] = got
    return out


def test_sums_of_k_words_are_exact_round_after_round(target, job):
    """Six rounds over two slots, both copies of each (phase), K random int32 words per
    worker: every worker gets every round's sum, exact, K words, unflagged."""
    rng = np.random.default_rng(K)
    for r in range(6):
        slot, phase, seq = r % 2, (r // 2) & 1, r + 1
        words = rng.integers(-(2**29), 2**29, (WORKERS, K)).astype(np.int32)
        for w in range(WORKERS):
            send(target, job, w, slot, seq, words[w], phase=phase)
        expect = words.astype(np.int64).sum(0)
        for w, rs in results(target).items():
            assert len(rs) == 1, f"round {r}: worker {w} got {len(rs)} results"
            p = rs[0]
            assert p.is_result and not p.overflow and (p.slot, p.seq, p.phase) == (slot, seq,
                                                                                    phase)
            assert p.words.size == K
            np.testing.assert_array_equal(p.words.astype(np.int64), expect)


def test_or_of_k_words(target, job):
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, (WORKERS, K), dtype=np.uint64).astype(np.uint32)
    bits &= rng.integers(0, 2**32, (WORKERS, K), dtype=np.uint64).astype(np.uint32)
    for w in range(WORKERS):
        send(target, job, w, 0, 1, bits[w], op=wire.OP_OR)
    expect = np.bitwise_or.reduce(bits, axis=0)
    for w, rs in results(target).items():
        assert len(rs) == 1, f"worker {w} got {len(rs)} results"
        np.testing.assert_array_equal(rs[0].words.view(np.uint32), expect)


@pytest.mark.parametrize("lane", [0, 64 * 17 + 5, K - 1])
def test_an_overflow_in_any_chunk_is_flagged(target, job, lane):
    """int32 overflow in one lane of the first, a middle or the last chunk: the result is
    flagged, and the other lanes are still exact."""
    words = np.ones((WORKERS, K), np.int32)
    words[:, lane] = 2**30  # 4 x 2^30 = 2^32: wraps
    for w in range(WORKERS):
        send(target, job, w, 0, 1, words[w])
    for w, rs in results(target).items():
        assert len(rs) == 1, f"worker {w} got {len(rs)} results"
        p = rs[0]
        assert p.overflow, f"lane {lane}: overflow not flagged"
        rest = np.delete(p.words, lane)
        assert (rest == WORKERS).all()


def test_a_status_reply_names_the_contributors_in_the_last_words(target, job):
    """A duplicate of an unfinished round: the status reply's last three words (word K - 3
    on) hold the contributors and their count, at any K."""
    for w in (0, 2):
        send(target, job, w, 0, 1, np.full(K, w + 1, np.int32))
    assert not any(results(target, timeout=0.3).values()), "result before completion"
    send(target, job, 0, 0, 1, np.full(K, 1, np.int32))  # worker 0 again: a retransmission
    rs = results(target, [0])[0]
    assert len(rs) == 1 and rs[0].flags & wire.FLAG_STATUS
    assert rs[0].words.size == K
    assert wire.parse_status(rs[0].words) == (0b101, 2)
