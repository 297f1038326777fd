"""Agents on loopback through the software aggregator, with loss, duplication and reordering
injected: every sum is compared bit for bit with the integer sum of the quantized inputs."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import socket
import threading
import time

import numpy as np
import pytest

from homagg import wire
from homagg.controller.local import install
from homagg.faults import FaultSpec, ImpairedSocket
from homagg.host_agent import (
    Agent,
    AgentConfig,
    AgentError,
    AggregationTimeout,
    codec,
    simulate_allreduce,
    simulate_ints,
)
from homagg.host_agent.engine import native as engine_native
from homagg.host_agent.engine.loss import PROBE_SAMPLES
from homagg.host_agent.engine.round_cost import RoundCost
from homagg.targets.soft import SoftSwitch, SoftSwitchServer
from tests.staging import agent_address, agent_addresses, wait_for

_switch_ips = itertools.count(2)


class Job:
    """A soft switch on its own loopback address and W agents, one thread each. ``engine``:
    the soft switch's (its server's: ``SoftSwitchServer``); ``agent_engine``: the agents'
    (``AgentConfig.engine``; "auto" is held to run the native one where it can)."""

    def __init__(self, workers, slots=16, faults=None, per_worker=None,
                 switch_words=wire.WORDS_PER_PACKET, key=0, engine="auto",
                 agent_engine="auto", **agent_kw):
        self.switch_ip = f"127.0.1.{next(_switch_ips)}"
        self.server = SoftSwitchServer(SoftSwitch(words=switch_words),
                                       (self.switch_ip, wire.HOMAGG_UDP_PORT_MIN),
                                       faults, engine=engine).start()
        self.addrs = addrs = agent_addresses(workers)
        install(self.server.switch, 1, addrs, slots, key=key)  # key: the job's (auth)
        kw = dict(timeout=0.01, deadline=5.0, key=key, engine=agent_engine)
        kw.update(agent_kw)
        per_worker = per_worker or (lambda w: {})
        self.configs = [AgentConfig(**{
            "job": 1, "worker": w, "workers": workers,
            "switch": (self.switch_ip, wire.HOMAGG_UDP_PORT_MIN), "bind": addrs[w],
            "slots": slots, **kw, **per_worker(w)}) for w in range(workers)]
        self.agents = [Agent(c) for c in self.configs]
        for a in self.agents:  # (a test of both engines must not run one twice)
            want = ("python" if agent_engine == "python"
                    or engine_native.unavailable(a.cfg, a.transport.sock) else "native")
            assert a.transport.engine == want, (a.transport.engine, want)

    def new_run(self, **changes):
        """Every agent stops and a new one starts on the same address (a script run again),
        with no reset of the switch; ``changes`` to its config (say, the new ``run``)."""
        for a in self.agents:
            a.close()
        self.configs = [dataclasses.replace(c, **changes) for c in self.configs]
        self.agents = [Agent(c) for c in self.configs]

    def stat(self, name):
        return int(self.server.switch.model.stats[wire.STAT_INDEX[name]])

    def run(self, fn_per_worker):
        """Run fn(agent, w) on every worker at once: (results, errors), by worker."""
        return run_agents(self.agents, fn_per_worker)

    def close(self):
        for a in self.agents:
            a.close()
        self.server.stop()


def run_agents(agents, fn, skip=()):
    """Run fn(agent, i) on every agent at once, each in its own thread (except those in
    ``skip``): (results, errors), by agent; an agent still running after 60 s fails."""
    results, errors = [None] * len(agents), [None] * len(agents)

    def work(i):
        try:
            results[i] = fn(agents[i], i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(agents))
               if i not in skip]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an agent hung"
    return results, errors


def closing_factory(cls):
    """A fixture body: make(*a, **kw) builds ``cls`` instances, all closed at teardown."""
    made = []

    def make(*a, **kw):
        made.append(cls(*a, **kw))
        return made[-1]

    yield make
    for m in made:
        m.close()


#: the agents' engines every test of a ``make_job`` runs on: the native one (where it can run,
#: "auto") and the Python reference
AGENT_ENGINES = ["auto", "python"]


@pytest.fixture(params=AGENT_ENGINES, ids=["agent-auto", "agent-python"])
def make_job(request):
    yield from closing_factory(functools.partial(Job, agent_engine=request.param))


class FrozenCost(RoundCost):
    """A round cost that measures nothing: ``words`` as given (None: no estimate), so the
    index choice does not follow the loaded host's timing."""

    def __init__(self, words=None):
        super().__init__()
        self.fixed_words = words

    def sample(self, packets, k, seconds):
        pass

    @property
    def words(self):
        return self.fixed_words


def freeze_round_cost(job, words=None):
    """Every agent of ``job`` reports ``words`` (a list: per worker) as its round cost."""
    per = words if isinstance(words, list) else [words] * len(job.agents)
    for a, w in zip(job.agents, per):
        a.transport.round_cost = FrozenCost(w)


def fresh_bytes(agent):
    """Bytes an agent sent, less its retransmissions (timing-dependent on a loaded host)."""
    return agent.counters.bytes_sent - agent.counters.retransmissions * wire.PACKET_BYTES


def sparse_tensors(rng, workers, n, density):
    xs = []
    for _ in range(workers):
        x = np.zeros(n, np.float32)
        idx = rng.choice(n, max(1, int(n * density)), replace=False)
        x[idx] = rng.standard_normal(idx.size).astype(np.float32) * 10
        xs.append(x)
    return xs


def block_offsets(xs, block=codec.DEFAULT_BLOCK):
    """The per-block offsets the job's negotiation must agree on (codec.blocks)."""
    ored = np.zeros(codec.block_count(xs[0].size, block), np.uint32)
    for x in xs:
        s = codec.Scan.of(x)
        ored |= codec.block_words(s.idx, s.raw, s.n, block, s.max_exponent())
    return codec.block_offsets(ored)


def assert_exact(results, xs):
    """Every worker's sum is, bit for bit, the integer sum of the inputs quantized at the
    agreed per-block shifts (the tensor shift plus the negotiated block offsets)."""
    shift = results[0].shift
    assert shift.shape == (xs[0].size,)
    np.testing.assert_array_equal(results[0].block_shifts - results[0].tensor_shift,
                                  block_offsets(xs))
    expect = np.sum([codec.quantize(x, shift).astype(np.int64) for x in xs], axis=0)
    for r in results:
        assert r.tensor_shift == results[0].tensor_shift
        np.testing.assert_array_equal(r.shift, shift)
        np.testing.assert_array_equal(r.ints(), expect)
        np.testing.assert_array_equal(r.out, np.ldexp(expect.astype(np.float64), -shift)
                                      .astype(np.float32))


@pytest.mark.parametrize("mode", ["auto", "dense", "union", "sketch"])
def test_allreduce_is_exact_in_every_mode(make_job, mode):
    job = make_job(4, mode=mode)
    xs = sparse_tensors(np.random.default_rng(1), 4, 20_000, 0.01)
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err), err
    assert_exact(res, xs)
    assert res[0].mode == ("union" if mode == "auto" else mode)


def test_allreduce_int_is_the_integer_sum(make_job):
    job = make_job(3)
    rng = np.random.default_rng(2)
    qs = [rng.integers(-(2**29), 2**29, 1000).astype(np.int32) for _ in range(3)]
    res, err = job.run(lambda a, w: a.allreduce_int(qs[w]))
    assert not any(err)
    for r in res:
        np.testing.assert_array_equal(r, np.sum(qs, axis=0, dtype=np.int64))


def test_lossy_duplicating_reordering_network_stays_exact(make_job):
    job = make_job(4, faults=FaultSpec(loss=0.05, dup=0.05, reorder=0.1, seed=3))
    rng = np.random.default_rng(3)
    for _ in range(3):
        xs = sparse_tensors(rng, 4, 50_000, 0.01)
        res, err = job.run(lambda a, w, xs=xs: a.allreduce_detailed(xs[w]))
        assert not any(err), err
        assert_exact(res, xs)
    assert sum(a.counters.retransmissions for a in job.agents) > 0


def test_a_loss_with_results_after_it_is_resent_before_the_timeout(make_job):
    """RACK: worker 1 loses 5% of its datagrams each way, and the timeout is 0.5 s (hundreds
    of round trips). A chunk whose later neighbours' results came back is resent on that
    evidence, not after the timeout; every sum stays exact."""
    job = make_job(3, timeout=0.5, min_timeout=0.5, max_timeout=0.5, deadline=30.0,
                   per_worker=lambda w: {"faults": FaultSpec(loss=0.05, seed=5)} if w == 1
                   else {})
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(60_000).astype(np.float32) for _ in range(3)]
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err), err
    assert_exact(res, xs)
    lossy = job.agents[1].counters
    assert job.agents[1].sock.dropped_out + job.agents[1].sock.dropped_in > 0
    assert lossy.early_resends > 0
    assert lossy.early_resends <= lossy.retransmissions


class DropFirstCopy:
    """An agent's socket that drops the first copy of every chunk it sends (by round tag) but
    the join's: each round's only chunk is lost with nothing sent after it (a tail loss)."""

    def __init__(self, sock):
        self.sock = sock
        self.seen: set[int] = set()
        self.dropped = 0

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def sendto(self, data, addr):
        head = wire.fields(bytes(data[:wire.HOMAGG_HDR_BYTES]))
        if head["op"] != wire.OP_JOIN and head["seq"] not in self.seen:
            self.seen.add(head["seq"])
            self.dropped += 1
            return len(data)
        return self.sock.sendto(data, addr)

    def send_many(self, data, size, addr):
        view = memoryview(data).cast("B")
        for at in range(0, len(view), size):
            self.sendto(view[at:at + size], addr)
        return -(-len(view) // size)


def test_a_tail_loss_is_probed_before_the_timeout(make_job):
    """A round's last chunk lost has no later result for RACK: a tail-loss probe resends it
    after a probe timeout of silence, long before the 5 s timeout. After ten clean rounds (the
    probe timeout's samples), worker 1 loses the first copy of every chunk, and every round is
    one chunk: each loss is found by a probe (none waits for the timeout), while its peers'
    probes of those rounds are answered by a status (the switch held their chunk: no loss),
    which stops them until a result comes."""
    job = make_job(3, timeout=5.0, min_timeout=5.0, max_timeout=5.0, deadline=60.0)
    rng = np.random.default_rng(7)

    def rounds(n):
        for _ in range(n):  # a round at a time, one chunk each
            q = [rng.integers(-1000, 1000, 200).astype(np.int32) for _ in range(3)]
            res, err = job.run(lambda a, w, q=q: a.allreduce_int(q[w]))
            assert not any(err), err
            for r in res:
                np.testing.assert_array_equal(r, np.sum(q, axis=0, dtype=np.int64))

    rounds(10)
    lossy = job.agents[1].transport
    assert lossy.rtt.samples >= PROBE_SAMPLES
    c = job.agents[1].counters
    before = (c.rounds, c.retransmissions, c.early_resends, c.probes)
    lossy.sock = DropFirstCopy(lossy.sock)
    rounds(8)
    assert lossy.sock.dropped == c.rounds - before[0] == 8
    # every loss found by a probe; nothing else resent (no timeout fired, no RACK evidence)
    assert c.probes - before[3] == 8
    assert c.retransmissions - before[1] == 8
    assert c.early_resends == before[2]
    for w in (0, 2):
        cw = job.agents[w].counters
        # at most one probe per result: bounded; a held one proves the peer was missing
        assert cw.probes <= cw.results
        assert cw.probes_held <= cw.probes


def test_many_tensors_of_odd_sizes_in_sequence(make_job):
    job = make_job(2, slots=4)
    rng = np.random.default_rng(4)
    for n in (1, 63, 64, 65, 1000, 4097):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        res, err = job.run(lambda a, w, xs=xs: a.allreduce_detailed(xs[w]))
        assert not any(err), err
        assert_exact(res, xs)


def test_dense_tensors_go_dense_and_remember_it(make_job):
    job = make_job(2)
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(5000).astype(np.float32) for _ in range(2)]
    res, _ = job.run(lambda a, w: a.allreduce_detailed(xs[w], key="w1"))
    assert res[0].mode == "dense"
    sent = [fresh_bytes(a) for a in job.agents]
    res, _ = job.run(lambda a, w: a.allreduce_detailed(xs[w], key="w1"))
    assert_exact(res, xs)
    # second time: no bitmap round (one exponent packet + dense values)
    dense_packets = -(-5000 // wire.WORDS_PER_PACKET) + 1
    assert fresh_bytes(job.agents[0]) - sent[0] == dense_packets * wire.PACKET_BYTES


def test_all_zero_tensors(make_job):
    job = make_job(3)
    res, err = job.run(lambda a, w: a.allreduce_detailed(np.zeros(777, np.float32)))
    assert not any(err)
    assert all(not r.out.any() for r in res)


@pytest.mark.parametrize("mode", ["dense", "union"])
def test_overflow_is_rescaled_never_wrapped(make_job, monkeypatch, mode):
    # A scale 7 bits too fine (headroom 16 and 4 workers leave 6): 1.5 * 2**30 overflows once
    # two workers are added, the switch flags it, and every worker rescales the same way.
    real = codec.shift_for
    monkeypatch.setattr("homagg.host_agent.allreduce.codec.shift_for", lambda *a: real(*a) + 7)
    job = make_job(4, mode=mode)
    x = np.zeros(1000, np.float32)
    x[::10] = 1.5
    res, err = job.run(lambda a, w: a.allreduce_detailed(x))
    assert not any(err), err
    assert all(a.counters.rescales == 1 for a in job.agents)
    assert res[0].tensor_shift == real(codec.max_exponent(x), 4) + 7 - 4
    assert (res[0].shift == res[0].tensor_shift).all()  # one binade: every block's offset 0
    assert_exact(res, [x] * 4)
    np.testing.assert_array_equal(res[0].out, 4 * x)


def test_dead_peer_is_named_within_the_deadline(make_job):
    job = make_job(3, deadline=1.0)
    x = np.ones(1000, np.float32)
    t0 = time.monotonic()
    res, err = job.run(lambda a, w: None if w == 2 else a.allreduce(x))
    elapsed = time.monotonic() - t0
    # the errors in each message: a failure here once under load left no trace of why
    assert isinstance(err[0], AggregationTimeout) and isinstance(err[1], AggregationTimeout), err
    assert "worker(s) 2" in str(err[0]) and "job 1 worker 0" in str(err[0]), err
    assert elapsed < 5.0, (elapsed, err)
    with pytest.raises(AgentError, match="unusable"):
        job.agents[0].allreduce(x)


def test_missing_switch_is_a_clear_error(make_job):
    a = Agent(AgentConfig(1, 0, 2, ("127.0.1.250", wire.HOMAGG_UDP_PORT_MIN), agent_address(),
                          deadline=0.5, timeout=0.05))
    try:
        with pytest.raises(AggregationTimeout, match="did not answer at all"):
            a.allreduce(np.ones(10, np.float32))
    finally:
        a.close()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("mode,index", [("auto", "flat"), ("auto", "hier"), ("dense", "auto"),
                                        ("union", "hier"), ("sketch", "flat")])
def test_non_finite_on_one_worker_is_nan_on_every_worker_in_one_round(make_job, mode, index,
                                                                       bad):
    # deadline 5 s: a worker that stopped would make its peers time out; none may
    job = make_job(3, mode=mode, index=index)
    xs = sparse_tensors(np.random.default_rng(7), 3, 9_000, 0.01)
    xs[1][4321] = bad
    t0 = time.monotonic()
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err), err
    assert time.monotonic() - t0 < 2.0
    for r in res:
        assert r.nonfinite and r.out.shape == (9_000,) and np.isnan(r.out).all()
    assert all(a.counters.rounds == 1 for a in job.agents)  # round 1 only, no value round
    with pytest.raises(codec.CodecError, match="non-finite"):
        res[0].ints()
    # the agents stay usable: the next tensor is exact again
    ys = sparse_tensors(np.random.default_rng(8), 3, 9_000, 0.01)
    res, err = job.run(lambda a, w: a.allreduce_detailed(ys[w]))
    assert not any(err), err
    assert_exact(res, ys)


def test_a_value_out_of_range_names_its_index(make_job):
    job = make_job(1, mode="union", shift_bias=6)  # 6 bits finer than the headroom allows
    x = np.zeros(1000, np.float32)
    x[[10, 100, 200]] = [0.25, 3.0, 1.0]  # one scale block: 3.0 alone leaves int32
    with pytest.raises(AgentError, match="index 100") as info:
        job.agents[0].allreduce(x)
    assert info.value.index == 100


def test_foreign_datagrams_are_ignored(make_job):
    job = make_job(2)
    xs = [np.arange(300, dtype=np.float32), np.ones(300, np.float32)]
    junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for a in job.agents:
        junk.sendto(b"\x00" * 10, a.cfg.bind)
        junk.sendto(wire.pack(wire.OP_ADD, 1, 0, 0, 1, np.ones(64), flags=wire.FLAG_RESULT),
                    a.cfg.bind)
    junk.close()
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err)
    assert_exact(res, xs)
    assert all(a.counters.ignored >= 2 for a in job.agents)


def test_bad_config_is_refused():
    with pytest.raises(AgentError, match="worker 4 of 4"):
        AgentConfig(1, 4, 4)


def test_faults_injected_at_every_agent_socket_stay_exact(make_job):
    job = make_job(4, deadline=10,
                   per_worker=lambda w: {"faults": FaultSpec(0.10, 0.05, 0.10, seed=w)})
    rng = np.random.default_rng(11)
    # enough packets at K = 256 for every kind of fault on every socket: three calls gave a
    # socket as few as 3 received datagrams lost and 5 duplicates, and CI once saw a socket
    # with none of a kind; six calls double every count
    for _ in range(6):
        xs = sparse_tensors(rng, 4, 120_000, 0.01)
        res, err = job.run(lambda a, w, xs=xs: a.allreduce_detailed(xs[w]))
        assert not any(err), err
        assert_exact(res, xs)
    socks = [a.sock for a in job.agents]
    assert all(s.dropped_out and s.dropped_in and s.duplicated and s.reordered for s in socks)


def test_fault_spec_refuses_impossible_probabilities():
    with pytest.raises(ValueError, match="loss"):
        FaultSpec(loss=1.0)


def test_shift_bias_forces_the_overflow_path(make_job):
    job = make_job(2, mode="dense", shift_bias=6)
    x = np.full(500, -3.0, np.float32)
    res, err = job.run(lambda a, w: a.allreduce_detailed(x))
    assert not any(err), err
    assert all(a.counters.rescales >= 1 for a in job.agents)
    assert_exact(res, [x, x])


# --- the index: flat or hierarchical (codec.index) --------------------------------------------


@pytest.mark.parametrize("index", ["hier", "auto"])
@pytest.mark.parametrize("mode", ["auto", "union", "sketch"])
def test_hierarchical_index_is_exact_in_every_value_mode(make_job, mode, index):
    job = make_job(4, mode=mode, index=index)
    xs = sparse_tensors(np.random.default_rng(12), 4, 20_011, 0.005)
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err), err
    assert_exact(res, xs)
    assert all(r.index == "hier" for r in res)  # auto without history: n >= 4096
    assert res[0].mode == ("union" if mode == "auto" else mode)
    # the words each round carried are the simulator's (values: same union, same seed)
    sim = simulate_ints([codec.quantize(x, res[0].shift) for x in xs], job.agents[0].seed,
                         mode=mode, index="hier")
    assert {k: 4 * v for k, v in res[0].rounds.items()} == sim.bytes_per_worker


@pytest.mark.parametrize("index", ["hier", "auto"])
def test_hierarchical_index_on_a_lossy_duplicating_reordering_network(make_job, index):
    job = make_job(4, index=index, faults=FaultSpec(loss=0.05, dup=0.05, reorder=0.1, seed=13))
    freeze_round_cost(job)  # auto by the union's size alone (test_round_cost: by round cost)
    rng = np.random.default_rng(13)
    for density in (0.01, 0.001, 0.0001):
        xs = sparse_tensors(rng, 4, 100_003, density)
        res, err = job.run(lambda a, w, xs=xs: a.allreduce_detailed(xs[w], key="t"))
        assert not any(err), err
        assert_exact(res, xs)
        assert res[0].index == "hier"  # the unions stay under 20%: auto keeps the hierarchy
    assert sum(a.counters.retransmissions for a in job.agents) > 0


def test_faults_at_every_agent_socket_with_the_hierarchy(make_job):
    job = make_job(4, deadline=10, index="hier",
                   per_worker=lambda w: {"faults": FaultSpec(0.10, 0.05, 0.10, seed=20 + w)})
    rng = np.random.default_rng(14)
    for _ in range(2):
        xs = sparse_tensors(rng, 4, 30_000, 0.002)
        res, err = job.run(lambda a, w, xs=xs: a.allreduce_detailed(xs[w]))
        assert not any(err), err
        assert_exact(res, xs)


@pytest.mark.parametrize("index", ["flat", "hier", "auto"])
@pytest.mark.parametrize("mode", ["auto", "union", "sketch"])
def test_a_worker_with_an_all_zero_tensor(make_job, mode, index):
    job = make_job(3, mode=mode, index=index)
    xs = sparse_tensors(np.random.default_rng(15), 3, 9_000, 0.003)
    xs[1][:] = 0
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err), err
    assert_exact(res, xs)
    assert res[1].index == ("flat" if index == "flat" else "hier")


@pytest.mark.parametrize("index", ["hier", "auto"])
def test_all_zero_everywhere_sends_only_the_top_level(make_job, index):
    job = make_job(3, index=index)
    n = 50_000
    res, err = job.run(lambda a, w: a.allreduce_detailed(np.zeros(n, np.float32)))
    assert not any(err), err
    assert all(not r.out.any() and r.ints().size == n for r in res)
    # c1 = 0 on every worker: no mid, no leaf, no value round; one packet (exponents + top)
    top = codec.level_words(n, 0, 0)[0]
    assert all(r.rounds == {codec.ROUND_TOP: top} for r in res)
    assert (wire.EXP_WORDS + top) <= wire.WORDS_PER_PACKET
    # one packet each (its retransmissions, if the loaded host made the 10 ms timeout fire,
    # are the same packet again)
    assert all(fresh_bytes(a) == wire.PACKET_BYTES for a in job.agents)
    assert all(r.wire_bytes == fresh_bytes(a) + a.counters.retransmissions * wire.PACKET_BYTES
               for r, a in zip(res, job.agents))
    assert all(a.counters.rounds == 1 for a in job.agents)


def test_auto_index_learns_from_the_previous_union(make_job):
    job = make_job(2)
    freeze_round_cost(job)  # no round cost known: the union-size rule
    rng = np.random.default_rng(16)
    sparse = sparse_tensors(rng, 2, 10_000, 0.01)
    busy = sparse_tensors(rng, 2, 10_000, 0.4)  # union ~64%: flat from the second call on
    small = sparse_tensors(rng, 2, 4000, 0.01)  # below 4096 elements, no history: flat
    seen = []
    for key, xs in (("a", sparse), ("b", busy), ("c", small), ("a", sparse), ("b", busy),
                    ("c", small)):
        res, err = job.run(lambda a, w, xs=xs, key=key: a.allreduce_detailed(xs[w], key=key))
        assert not any(err), err
        assert_exact(res, xs)
        assert res[0].index == res[1].index
        seen.append((key, res[0].index, res[0].mode))
    assert seen == [("a", "hier", "union"), ("b", "hier", "union"), ("c", "flat", "union"),
                    ("a", "hier", "union"), ("b", "flat", "union"), ("c", "hier", "union")]


def test_dense_memory_still_skips_the_index_with_the_hierarchy(make_job):
    job = make_job(2, index="hier")
    rng = np.random.default_rng(17)
    xs = [rng.standard_normal(5000).astype(np.float32) for _ in range(2)]
    res, _ = job.run(lambda a, w: a.allreduce_detailed(xs[w], key="w1"))
    assert res[0].mode == "dense" and res[0].index == "hier"
    sent = [fresh_bytes(a) for a in job.agents]
    res, _ = job.run(lambda a, w: a.allreduce_detailed(xs[w], key="w1"))
    assert_exact(res, xs)
    assert res[0].index is None
    dense_packets = -(-5000 // wire.WORDS_PER_PACKET) + 1
    assert fresh_bytes(job.agents[0]) - sent[0] == dense_packets * wire.PACKET_BYTES


def test_bad_index_is_refused():
    with pytest.raises(AgentError, match="index 'tree'"):
        AgentConfig(1, 0, 2, index="tree")


def row_sparse_tensors(rng, workers, n, fraction, row=64):
    xs = []
    for _ in range(workers):
        x = np.zeros(n, np.float32)
        r = rng.choice(n // row, max(1, int(n // row * fraction)), replace=False)
        idx = (r[:, None] * row + np.arange(row)).ravel()
        x[idx] = rng.standard_normal(idx.size).astype(np.float32) * 10
        xs.append(x)
    return xs


@pytest.mark.parametrize("support", ["1%", "0.1%", "0.01%", "rows of 64, 0.1%"])
def test_issue16_supports_are_exact_through_the_software_target(make_job, support):
    # issue 16's cases (8 workers, independent supports) at N = 256K rather than 10M, for time
    # (the Python aggregator); the bytes at 10M are tests/test_index.py's.
    n = 256_000
    rng = np.random.default_rng(18)
    if support.startswith("rows"):
        xs = row_sparse_tensors(rng, 8, n, 0.001)
    else:
        xs = sparse_tensors(rng, 8, n, float(support[:-1]) / 100)
    job = make_job(8, slots=64)
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w], key="t"))
    assert not any(err), err
    assert_exact(res, xs)
    assert all(r.index == "hier" and r.mode == "union" for r in res)
    sim = simulate_ints([codec.quantize(x, res[0].shift) for x in xs], 1, index="hier")
    assert {k: 4 * v for k, v in res[0].rounds.items()} == sim.bytes_per_worker


# --- the in-memory simulator: the same agents, the switch's arithmetic, no sockets ----------


def multi_scale_tensors(rng, workers, n, density):
    xs = sparse_tensors(rng, workers, n, density)
    for x in xs:
        x *= (10.0 ** rng.integers(-9, 2, n)).astype(np.float32)
    return xs


@pytest.mark.parametrize("case", ["union-hier", "sketch-flat", "dense-rescale", "auto-nan"])
def test_simulate_allreduce_is_bit_identical_to_agents_over_sockets(make_job, case):
    rng = np.random.default_rng(19)
    mode, rest = case.split("-")
    kw = {"mode": mode}
    if rest in ("hier", "flat"):
        kw["index"] = rest
    xs = multi_scale_tensors(rng, 4, 30_001, 0.02)
    if rest == "rescale":  # 7 bits too fine: two workers' sum overflows, in both halves
        kw["shift_bias"] = 7
        x = np.full(30_001, -3.0, np.float32)
        x[15_000:] = -3e-5
        xs = [x] * 4
    if rest == "nan":
        xs[2][17] = np.nan
    job = make_job(4, **kw)
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err), err
    sim = simulate_allreduce(xs, **kw)
    for w, (r, s) in enumerate(zip(res, sim.results)):
        np.testing.assert_array_equal(r.out, s.out)  # NaN == NaN here
        assert r.out.tobytes() == s.out.tobytes()
        np.testing.assert_array_equal(r.block_shifts, s.block_shifts)
        assert (r.mode, r.index, r.rounds, r.nonfinite) == (s.mode, s.index, s.rounds,
                                                            s.nonfinite)
        assert fresh_bytes(job.agents[w]) == s.wire_bytes
        assert job.agents[w].counters.rescales == (1 if rest == "rescale" else 0)
    if rest != "nan":
        assert_exact(res, xs)


# -- runs that follow each other (join.p4) --------------------------------------------------


def test_runs_that_follow_each_other_need_no_reset(make_job):
    """Each run joins first and gets a new generation: the switch treats an earlier run's slot
    state as empty, so new agents on the same job (round tags from 1 again) are exact, whatever
    the earlier run left (finished rounds on some copies, a few chunks on others)."""
    job = make_job(4, slots=8)
    rng = np.random.default_rng(7)
    stats = job.server.switch.model.stats
    for run, sizes in enumerate([(20_000, 300), (50,), (3_000, 20_000, 7)]):
        if run:
            job.new_run()
        for n in sizes:
            xs = sparse_tensors(rng, 4, n, 0.05)
            res, err = job.run(lambda a, w, xs=xs: a.allreduce_detailed(xs[w]))
            assert not any(err), err
            assert_exact(res, xs)
        assert all(a.transport.gen == run + 1 for a in job.agents)
    assert stats[wire.STAT_INDEX["DROP_STALE"]] == 0
    assert stats[wire.STAT_INDEX["DROP_SEQ_MISMATCH"]] == 0


def test_a_worker_that_never_starts_is_named_by_the_join(make_job):
    job = make_job(4, deadline=1.0)
    x = np.ones(100, np.float32)
    res, err = job.run(lambda a, w: a.allreduce(x) if w != 2 else None)
    for w in (0, 1, 3):
        assert isinstance(err[w], AggregationTimeout)
        assert "join" in str(err[w]) and "3 of 4 workers joined" in str(err[w])
        assert "waiting for worker(s) 2 to start" in str(err[w])


def test_a_wrong_worker_id_fails_at_once_and_says_why(make_job):
    # worker 1's address, but the agent claims worker 0: the switch refuses, and says why
    job = make_job(2, deadline=1.0, per_worker=lambda w: {"worker": 0})
    t0 = time.monotonic()
    res, err = job.run(lambda a, w: a.allreduce(np.ones(10, np.float32)) if w == 1 else None)
    assert isinstance(err[1], AgentError) and not isinstance(err[1], AggregationTimeout)
    assert "DROP_WRONG_IDENTITY" in str(err[1]) and "job 1, worker 0" in str(err[1])
    assert time.monotonic() - t0 < 0.9  # no waiting out the deadline


class ForgingSocket(ImpairedSocket):
    """An agent's socket that hands it, before each of the first ``n`` results it receives, a
    forged refusal of the same chunk (the result's own header, FLAG_REFUSED, and a
    configuration drop reason): what an off-path sender who guessed the header exactly could
    send, from the switch's address, on a network that lets it spoof."""

    def __init__(self, sock, n: int, reason: str):
        super().__init__(sock, FaultSpec())
        self.left = n
        self.reason = wire.STAT_INDEX[reason]
        self.forged = 0

    def recv_many(self, buf):
        nb, seg, src = super().recv_many(buf)
        flags = buf[wire.OFFSETS["flags"]]
        if (self.left and seg and nb + seg <= len(buf) and flags & wire.FLAG_RESULT
                and not flags & (wire.FLAG_REFUSED | wire.FLAG_STATUS)):
            first = bytearray(buf[:seg])
            first[wire.OFFSETS["flags"]] = wire.FLAG_RESULT | wire.FLAG_REFUSED
            first[seg - 4:seg] = self.reason.to_bytes(4, "big")
            buf[seg:nb + seg] = bytes(buf[:nb])
            buf[:seg] = first
            self.left -= 1
            self.forged += 1
            return nb + seg, seg, src
        return nb, seg, src


@pytest.mark.parametrize("reason", ["DROP_WRONG_IDENTITY", "DROP_BAD_SLOT"])
def test_a_forged_refusal_does_not_kill_a_worker(make_job, reason):
    """A refusal means this agent's settings are wrong only if it comes again for a resend:
    one alone (here, before each of 20 results of worker 0) is counted, and the sums stay
    exact."""
    job = make_job(2)
    a0 = job.agents[0]
    a0.transport.sock = forger = ForgingSocket(a0.transport.sock, 20, reason)
    rng = np.random.default_rng(3)
    xs = [rng.integers(-1000, 1000, 200 * wire.WORDS_PER_PACKET).astype(np.int32)
          for _ in range(2)]
    res, err = job.run(lambda a, w: a.allreduce_int(xs[w]))
    assert not any(err), err
    for r in res:
        assert np.array_equal(r, np.sum(xs, axis=0, dtype=np.int64))
    assert forger.forged >= 10  # (results that come one datagram at a time are not forged)
    # (a forgery of a late duplicate's header falls outside the round: ignored, not counted)
    assert forger.forged - 5 <= a0.counters.refusals <= forger.forged
    assert job.agents[1].counters.refusals == 0


def test_more_slots_than_the_job_has_fails_and_says_why(make_job):
    job = make_job(2, slots=4, deadline=1.0, per_worker=lambda w: {"slots": 8})
    x = np.ones(8 * wire.WORDS_PER_PACKET, np.int32)
    res, err = job.run(lambda a, w: a.transport.stream(wire.OP_ADD, x))
    assert all(isinstance(e, AgentError) and "DROP_BAD_SLOT" in str(e) for e in err), err
    assert all("uses 8 slots" in str(e) for e in err)


def test_packets_the_switch_holds_stale_are_named_in_the_error(make_job):
    job = make_job(2, deadline=1.0)
    x = np.ones(100, np.float32)
    res, err = job.run(lambda a, w: a.allreduce(x))
    assert not any(err), err
    job.new_run()
    for a in job.agents:
        a.transport.gen = 0  # as if this run skipped the join: older than the switch's state
        a.transport.learn_words(wire.WORDS_PER_PACKET)  # (what the join would have said)
    res, err = job.run(lambda a, w: a.allreduce(x))
    assert all(isinstance(e, AggregationTimeout) for e in err), err
    assert all("DROP_STALE" in str(e) for e in err)


@pytest.mark.parametrize("k", [64, 100, wire.mtu_words(), wire.MAX_WORDS_PER_PACKET])
def test_agents_learn_k_from_the_switch_and_stay_exact(make_job, k):
    """A switch built for another K: the agents learn it from the join's reply (every
    packet after it has K words), and every mode stays exact."""
    job = make_job(3, switch_words=k)
    rng = np.random.default_rng(k)
    for density in (0.01, 0.5):
        xs = sparse_tensors(rng, 3, 20_000, density)
        res, err = job.run(lambda a, w, xs=xs: a.allreduce_detailed(xs[w]))
        assert not any(err), err
        assert_exact(res, xs)
    for a in job.agents:
        assert a.transport.k == k
        c = a.counters
        assert c.bytes_sent == c.packets_sent * wire.packet_bytes(k)


def test_an_agent_whose_mtu_cannot_carry_the_switchs_k_fails_at_the_join(make_job,
                                                                          monkeypatch):
    """A switch built for jumbo frames, an agent on a 1500-byte link: its packets would be
    fragmented (bmv2 drops fragments), so it stops at the join's reply, saying why."""
    from homagg import udpio

    monkeypatch.setattr(udpio, "path_mtu", lambda addr: wire.DEFAULT_MTU)
    job = make_job(2, switch_words=wire.MAX_WORDS_PER_PACKET, deadline=5.0)
    t0 = time.monotonic()
    res, err = job.run(lambda a, w: a.allreduce(np.ones(1000, np.float32)))
    assert all(isinstance(e, AgentError) and not isinstance(e, AggregationTimeout)
               for e in err), err
    assert "more than a 1500-byte MTU holds (364 words at most)" in str(err[0])
    assert time.monotonic() - t0 < 2.0


def test_an_agent_told_another_k_fails_at_the_join_naming_both(make_job):
    job = make_job(2, switch_words=64, words=wire.WORDS_PER_PACKET, deadline=5.0)
    t0 = time.monotonic()
    res, err = job.run(lambda a, w: a.allreduce(np.ones(1000, np.float32)))
    assert all(isinstance(e, AgentError) and not isinstance(e, AggregationTimeout)
               for e in err), err
    assert f"built for 64 words per packet and this agent for {wire.WORDS_PER_PACKET}" \
        in str(err[0])
    assert time.monotonic() - t0 < 2.0  # the first reply, not the deadline
    assert AgentConfig(1, 0, 2, words=64).words == 64
    with pytest.raises(AgentError, match="words 10"):
        AgentConfig(1, 0, 2, words=10)


def test_a_restarted_run_completes_after_a_join_that_never_completed(make_job):
    """A job restarted during its join (torchrun's elastic restart): run 1's join stays at 2
    of 3 (worker 2 never starts). In run 2 worker 2 joins first: its run number differs, so the
    switch starts the join afresh instead of completing it with workers 0 and 1 of run 1 (who
    would then be stranded in the next generation). Workers 0 and 1 then join, and the sum is
    exact."""
    job = make_job(3, deadline=1.0, run=1)
    x = np.ones(1000, np.float32)
    _, err = job.run(lambda a, w: None if w == 2 else a.allreduce(x))
    assert isinstance(err[0], AggregationTimeout) and isinstance(err[1], AggregationTimeout)
    job.new_run(deadline=10.0, run=2)
    xs = sparse_tensors(np.random.default_rng(18), 3, 5_000, 0.05)
    results, errors = [None] * 3, [None] * 3

    def work(w):
        try:
            results[w] = job.agents[w].allreduce_detailed(xs[w])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[w] = e

    threads = [threading.Thread(target=work, args=(w,)) for w in range(3)]
    threads[2].start()
    wait_for(lambda: job.stat("STAT_JOIN_AFRESH") == 1, what="the join to start afresh")
    for t in threads[:2]:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(errors), errors
    assert_exact(results, xs)
    assert len({a.transport.gen for a in job.agents}) == 1
