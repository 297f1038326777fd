"""The fused round (``Transport.stream_fused``): two rounds of different ops in one window, on
both agent engines, each chunk matched by its part's op."""

from __future__ import annotations

import numpy as np
import pytest

from homagg import native, wire
from homagg.host_agent.engine import native as engine_native
from homagg.host_agent.engine import results
from homagg.host_agent.engine.packets import pack
from tests import test_results as tr
from tests.test_agent import AGENT_ENGINES, Job, closing_factory


@pytest.fixture(params=AGENT_ENGINES, ids=["agent-auto", "agent-python"])
def make_job(request):
    yield from closing_factory(lambda *a, **kw: Job(*a, agent_engine=request.param, **kw))


# -- the matching and the packets ------------------------------------------------------------
@pytest.mark.skipif(results._compiled is None, reason="numba not installed")
@pytest.mark.parametrize("after_odd", [False, True])
def test_a_fused_rounds_results_match_by_their_parts_op(after_odd):
    """Chunks before ``split`` expect the first part's op, the rest the second's: a result of
    the other op is odd (the caller's), in the compiled pass as in the reference."""
    split = 10
    rows = [tr.packet(c, op=wire.OP_ADD if c < split else wire.OP_OR) for c in (1, 2, 9, 10,
                                                                                 12, 30)]
    rows += [tr.packet(4, op=wire.OP_OR), tr.packet(14, op=wire.OP_ADD)]  # each the wrong op
    add = results.head8(version_op=wire.OP_ADD, flags=wire.FLAG_RESULT, job=tr.JOB, gen=tr.GEN)
    orr = results.head8(version_op=wire.OP_OR, flags=wire.FLAG_RESULT, job=tr.JOB, gen=tr.GEN)
    got = {}
    for name, take in (("ref", results.take_ref), ("jit", results.take_jit)):
        st = tr.state()
        new, odd = np.full(len(rows), -1, np.int64), np.full(len(rows), -1, np.int64)
        t = take(tr.run_of(rows), len(rows), tr.PS, tr.K, tr.SEQ0, tr.NCHUNKS, add, tr.AUTH,
                 st["done"], st["out"], st["sent_at"], st["resent"], new, odd, after_odd,
                 split, orr)
        got[name] = (t._replace(fresh_sum=0.0), sorted(new[:t.added].tolist()),
                     odd[:t.odd].tolist(), st["out"].copy())
        assert t.odd == 2 and odd[:2].tolist() == [6, 7]
        if after_odd:
            assert sorted(new[:t.added].tolist()) == [1, 2, 9, 10, 12, 30]
    assert got["ref"][:3] == got["jit"][:3]
    np.testing.assert_array_equal(got["ref"][3], got["jit"][3])


@pytest.mark.parametrize("engine", ["python", "native"])
def test_packets_built_into_a_batch_are_the_same_bytes(engine):
    """A fused round packs each part into its place in one batch (``out``): the bytes of
    packing it alone, whatever was there before."""
    if engine == "native" and native.load() is None:
        pytest.skip(f"the native data path is off: {native.why()}")
    rng = np.random.default_rng(0)
    k, slots, g0 = 64, 5, 77
    flat = rng.integers(-(1 << 31), 1 << 31, 64 * 3 + 7, dtype=np.int64).astype(np.int32)
    head = wire.header(op=wire.OP_OR, job=3, worker=1, slot=0, seq=0, gen=9, auth=5)
    want = pack(flat, k, 4, g0, slots, head)
    batch = np.frombuffer(rng.bytes(6 * want.itemsize), want.dtype).copy()  # (not zeros)
    if engine == "native":
        link = engine_native.NativeLink.__new__(engine_native.NativeLink)
        link.lib = native.load()
        link.pack(flat, k, 4, g0, slots, head, out=batch[1:5])
    else:
        pack(flat, k, 4, g0, slots, head, out=batch[1:5])
    assert batch[1:5].tobytes() == want.tobytes()


# -- the fused round, on both engines --------------------------------------------------------
def test_a_fused_round_sums_each_part_by_its_op(make_job):
    """An ADD part then an OR part in one window (4 slots, K = 64: chunks of both parts share
    slots), then one whose ADD part overflows: the flag comes back, the OR part stands."""
    job = make_job(3, slots=4, switch_words=64)
    adds = [np.arange(300, dtype=np.int32) * (w + 1) - 7 for w in range(3)]
    ors = [(np.uint32(1) << (np.arange(130, dtype=np.uint32) + w) % 32) for w in range(3)]
    before = [a.counters.rounds for a in job.agents]
    res, err = job.run(lambda a, w: a.transport.stream_fused(wire.OP_ADD, adds[w], wire.OP_OR,
                                                             ors[w]))
    assert not any(err), err
    for out, ored, overflow in res:
        np.testing.assert_array_equal(out, np.sum(adds, axis=0))
        np.testing.assert_array_equal(ored.view(np.uint32), ors[0] | ors[1] | ors[2])
        assert not overflow
    assert [a.counters.rounds for a in job.agents] == [b + 1 for b in before]
    big = np.full(100, 2 ** 30, np.int32)
    res, err = job.run(lambda a, w: a.transport.stream_fused(wire.OP_ADD, big, wire.OP_OR,
                                                             ors[w][:3]))
    assert not any(err), err
    for _, ored, overflow in res:
        assert overflow
        np.testing.assert_array_equal(ored.view(np.uint32), (ors[0] | ors[1] | ors[2])[:3])
