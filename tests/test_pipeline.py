"""Pipelined tensors (host_agent/pipeline.py): a tensor's round 1 riding with the one before's
values in one fused round (``Transport.stream_fused``), on both agent engines; the sums bit for
bit those of one tensor at a time, the rounds fewer; the hold that keeps every worker on the
same chunks when one has no next tensor ready; and the DDP hook's thread pipelining the
buckets queued behind the one on the wire."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from homagg import native, wire
from homagg.faults import FaultSpec
from homagg.host_agent import AgentError, MemoryJob, codec
from homagg.host_agent.engine import native as engine_native
from homagg.host_agent.engine import results
from homagg.host_agent.engine.packets import pack
from homagg.host_agent.pipeline import Listed
from tests import test_results as tr
from tests.test_agent import AGENT_ENGINES, Job, assert_exact, closing_factory, run_agents


@pytest.fixture(params=AGENT_ENGINES, ids=["agent-auto", "agent-python"])
def make_job(request):
    yield from closing_factory(lambda *a, **kw: Job(*a, agent_engine=request.param, **kw))


def tensors(w: int) -> list[np.ndarray]:
    """Worker w's tensors: sparse (flat and hierarchical index), dense, a NaN on worker 1 in
    the third (it ends after round 1: the fourth starts alone), one element, and none."""
    rng = np.random.default_rng(w)
    xs = [(rng.standard_normal(n) * (rng.random(n) < d)).astype(np.float32)
          for n, d in [(10_000, 0.01), (5_000, 1.0), (300, 0.2), (70_000, 0.05), (1, 1.0),
                       (0, 1.0)]]
    if w == 1:
        xs[2][5] = np.nan
    return xs


def assert_same(got, want) -> None:
    """Two lists of one worker's ``Result``s: the same sums and integers, bit for bit."""
    for a, b in zip(got, want, strict=True):
        assert a.nonfinite == b.nonfinite
        np.testing.assert_array_equal(a.out, b.out)
        if not a.nonfinite:
            np.testing.assert_array_equal(a.ints(), b.ints())
            np.testing.assert_array_equal(a.shift, b.shift)


# -- the matching and the packets ------------------------------------------------------------
@pytest.mark.skipif(not results.HAVE_NUMBA, reason="numba not installed")
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


# -- the agent ---------------------------------------------------------------------------------
@pytest.mark.parametrize("index", ["auto", "hier", "flat"])
def test_allreduce_many_is_one_at_a_times_sums_in_fewer_rounds(make_job, index):
    """Each tensor's round 1 rides with the one before's values, except after the NaN (its
    round 1 ends it: the next starts alone) and the empty one's: bit for bit the sums of one
    call per tensor on a job of its own, three rounds fewer."""
    many, one = make_job(3, index=index), make_job(3, index=index)
    keys = list(range(6))
    got, err = many.run(lambda a, w: a.allreduce_many(tensors(w), keys))
    assert not any(err), err
    want, err = one.run(lambda a, w: [a.allreduce_detailed(x, k)
                                      for k, x in enumerate(tensors(w))])
    assert not any(err), err
    for w in range(3):
        assert_same(got[w], want[w])
        assert many.agents[w].counters.pipelined == 4  # 0->1, 1->2, 3->4, 4->5
        assert many.agents[w].counters.rounds == one.agents[w].counters.rounds - 4
        # every byte sent is some tensor's (a fused round's, split between its two)
        assert sum(r.wire_bytes for r in got[w]) == many.agents[w].counters.bytes_sent
    assert_exact([got[w][0] for w in range(3)], [tensors(w)[0] for w in range(3)])
    assert all(got[w][2].nonfinite and np.isnan(got[w][2].out).all() for w in range(3))


@pytest.mark.skipif(native.load() is None, reason="the native data path is off")
def test_both_engines_pipeline_alike_and_the_c_loop_takes_every_fused_result():
    """allreduce_many on a job of each agent engine: the same sums bit for bit and the same
    rounds, new packets, bytes, results and fused tensors; the native loop matched every
    result itself (a fused round's second part by its own op, never handed to Python)."""
    outs, counts = {}, {}
    for engine in ("native", "python"):
        job = Job(3, slots=8, switch_words=64, agent_engine=engine)
        try:
            got, err = job.run(lambda a, w: a.allreduce_many(tensors(w)))
            assert not any(err), err
            outs[engine] = [[r.out.tobytes() for r in g] for g in got]
            counts[engine] = [(c.rounds, c.packets_sent - c.retransmissions, c.results,
                               c.pipelined) for c in (a.counters for a in job.agents)]
            if engine == "native":
                for a in job.agents:  # every result but the join's, in C
                    assert a.transport.native.results == a.counters.results - 1
        finally:
            job.close()
    assert outs["native"] == outs["python"]
    assert counts["native"] == counts["python"]
    assert all(c[3] == 4 for c in counts["native"])


def test_pipelined_rounds_stay_exact_on_a_lossy_network(make_job):
    """Loss, duplicates and reordering on every worker (the Python engine: faults are
    injected at its socket): fused rounds recover as any, the sums exact."""
    job = make_job(3, faults=FaultSpec(loss=0.05, dup=0.05, reorder=0.1, seed=11))
    xs = [[x for i, x in enumerate(tensors(w)) if i not in (2, 5)] for w in range(3)]  # finite
    got, err = job.run(lambda a, w: a.allreduce_many(xs[w]))
    assert not any(err), err
    for i in range(len(xs[0])):
        assert_exact([got[w][i] for w in range(3)], [xs[w][i] for w in range(3)])
    assert all(a.counters.pipelined == len(xs[0]) - 1 for a in job.agents)
    assert sum(a.counters.retransmissions for a in job.agents) > 0


def test_a_fused_value_round_that_overflows_is_rescaled(monkeypatch):
    """The switch flags an overflow in the fused round's values: that tensor rescales (every
    worker alike), the next one's round 1 from the same round stands."""
    real = codec.shift_for
    monkeypatch.setattr("homagg.host_agent.allreduce.codec.shift_for", lambda *a: real(*a) + 7)
    x = np.zeros(1000, np.float32)
    x[::10] = 1.5
    y = np.linspace(-1, 1, 500).astype(np.float32)
    job = MemoryJob(4, mode="union")
    got, err = run_agents(job.agents, lambda a, w: a.allreduce_many([x, y]))
    assert not any(err), err
    assert all(a.counters.rescales == 2 and a.counters.pipelined == 1 for a in job.agents)
    assert_exact([g[0] for g in got], [x] * 4)
    assert_exact([g[1] for g in got], [y] * 4)


def test_a_worker_without_its_next_tensor_ready_holds_every_worker_back():
    """Worker 0 pipelines its list; worker 1 calls one tensor at a time (no next one ready):
    its hold in round 1 keeps worker 0 from fusing, so both stay on the same rounds."""
    job = MemoryJob(2)
    xs = [tensors(w)[:2] for w in range(2)]
    got, err = run_agents(job.agents, lambda a, w: a.allreduce_many(xs[w]) if w == 0
                          else [a.allreduce_detailed(x) for x in xs[w]])
    assert not any(err), err
    assert [a.counters.pipelined for a in job.agents] == [0, 0]
    assert_same(got[0], got[1])


def test_the_tensor_after_a_pipelined_one_must_be_the_one_taken():
    agent = MemoryJob(1).agents[0]
    a, b = np.ones(10, np.float32), np.ones(20, np.float32)
    pipe = Listed([(a, None), (b, None)])
    pipe.start(0)
    agent.allreduce_detailed(a, pipeline=pipe)
    assert agent.counters.pipelined == 1
    with pytest.raises(AgentError, match="the tensor after a pipelined one must be the one "
                                         "its pipeline handed over"):
        agent.allreduce_detailed(np.ones(20, np.float32))


def test_a_taken_tensor_goes_on_in_the_pipeline_its_round_1_spoke_for():
    """The tensor taken from a pipeline, all-reduced without naming one: its round 1 said the
    next was ready, so it goes on in that pipeline (its peers fuse the next, so must it)."""
    agent = MemoryJob(1).agents[0]
    xs = [np.full(n, 0.5, np.float32) for n in (10, 20, 30)]
    pipe = Listed([(x, None) for x in xs])
    pipe.start(0)
    got = [agent.allreduce_detailed(xs[0], pipeline=pipe)]
    got += [agent.allreduce_detailed(x) for x in xs[1:]]
    assert agent.counters.pipelined == 2 and agent.counters.rounds == 4
    assert all(np.array_equal(g.out, x) for g, x in zip(got, xs))


def test_allreduce_many_checks_its_arguments_before_any_round():
    agent = MemoryJob(1).agents[0]
    with pytest.raises(AgentError, match="2 tensors, 1 keys and 2 outs"):
        agent.allreduce_many([np.ones(2), np.ones(2)], keys=[1])
    with pytest.raises(AgentError, match="allreduce wants floats, got int64"):
        agent.allreduce_many([np.ones(2), np.arange(3)])
    assert agent.counters.rounds == 0


# -- the DDP hook ------------------------------------------------------------------------------
def test_the_hook_pipelines_the_buckets_queued_behind_the_one_on_the_wire():
    """Four buckets queued on each of two workers before the agent's thread starts the first:
    three ride with the one before; the means are those of one bucket at a time, exactly."""
    torch = pytest.importorskip("torch", reason="torch not installed (optional extra)")
    from homagg.host_agent.distributed.hook import HookState, homagg_hook

    class Bucket:
        def __init__(self, i, grads):
            self.i, self.params = i, [torch.nn.Parameter(torch.zeros(g.numel())) for g in grads]
            for p, g in zip(self.params, grads):
                p.grad = g.clone()

        def index(self):
            return self.i

        def parameters(self):
            return self.params

        def buffer(self):
            return torch.cat([p.grad.reshape(-1) for p in self.params])

    grads = [[[torch.from_numpy(t) for t in tensors(w)[i:i + 2] if t.size]
              for i in (0, 1, 3, 4)] for w in range(2)]
    grads[1][1][1][5] = 2.0  # (no NaN: every bucket goes on)
    means = {}
    for pipelined in (False, True):
        job = MemoryJob(2)
        gate = threading.Event()

        def gated(real, gate=gate):
            def call(*args, **kw):
                gate.wait(10)
                return real(*args, **kw)
            return call

        states = [HookState(a, pipeline=pipelined) for a in job.agents]
        futs = [[None] * 4 for _ in range(2)]
        for w, a in enumerate(job.agents):
            a.allreduce_detailed = gated(a.allreduce_detailed)  # every bucket queues first
            for b in range(4):
                futs[w][b] = homagg_hook(states[w], Bucket(b, grads[w][b]))
        gate.set()
        means[pipelined] = [[f.wait() for f in futs[w]] for w in range(2)]
        for s in states:
            s.close()
        assert [a.counters.pipelined for a in job.agents] == ([3, 3] if pipelined else [0, 0])
    for w in range(2):
        for b in range(4):
            assert torch.equal(means[True][w][b], means[False][w][b])
            assert torch.equal(means[True][w][b], means[True][0][b])
