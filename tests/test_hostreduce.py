"""Local reduction per host (``homagg.host_agent.hostreduce``): the ranks of a host combine
their words, one leader per host goes through the switch, and every rank decodes the same bits
as with a worker per rank."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from homagg import wire
from homagg.host_agent import codec
from homagg.host_agent.allreduce import Agent
from homagg.host_agent.config import AgentConfig, AgentError
from homagg.host_agent.engine import SwitchOverflow
from homagg.host_agent.hostreduce import HostLink, ThreadHost, combine
from homagg.host_agent.simulate import MemoryJob, simulate_allreduce
from homagg.switch_model import INT32_MAX


def _tensors(ranks: int, n: int, density: float, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(ranks):
        x = (rng.standard_normal(n) * np.exp(rng.uniform(-6, 6, n))).astype(np.float32)
        x[rng.random(n) > density] = 0
        out.append(x)
    return out


@pytest.mark.parametrize("mode", ["dense", "union", "sketch", "auto"])
@pytest.mark.parametrize("hosts", [[4, 4], [3, 1, 2, 2], [8]])
def test_hosts_decode_the_same_bits_as_a_worker_per_rank(mode, hosts):
    xs = _tensors(sum(hosts), 5000, 0.05 if mode != "dense" else 1.0, seed=len(hosts))
    flat = simulate_allreduce(xs, mode=mode)
    local = simulate_allreduce(xs, hosts=hosts, mode=mode)
    for out in local.out:
        assert out.dtype == flat.out[0].dtype
        assert np.array_equal(out.view(np.uint32), flat.out[0].view(np.uint32))
    # and that sum is the exact sum of the quantized values (the codec's promise)
    res = local.results[0]
    q = [codec.quantize(x, res.shift) for x in xs]
    exact = np.sum(np.stack(q).astype(np.int64), axis=0)
    assert np.array_equal(np.ldexp(exact.astype(np.float64), -res.shift).astype(np.float32)
                          .view(np.uint32), local.out[0].view(np.uint32))


def test_the_switch_sees_one_worker_per_host_and_a_host_share_of_the_packets():
    xs = _tensors(8, 20000, 1.0, seed=3)
    flat = MemoryJob(8, mode="dense")
    flat.allreduce(xs)
    local = MemoryJob(8, hosts=[4, 4], mode="dense")
    local.allreduce(xs)
    assert local.switch.workers == 2
    sent = [a.counters.packets_sent for a in local.agents]
    assert sent[1:4] == [0, 0, 0] and sent[5:8] == [0, 0, 0]  # only leaders send
    assert sum(sent) * 4 == sum(a.counters.packets_sent for a in flat.agents)


def test_the_mean_and_the_headroom_count_every_rank():
    """``workers`` is every rank (the codec's headroom is for 16 ranks' terms, not the
    switch's 2 workers): the scale is the flat job's, and a value at the top of the scale's
    range does not overflow."""
    xs = [np.full(64, 1.0 - 2.0 ** -20, np.float32) for _ in range(16)]
    flat = MemoryJob(16, mode="dense")
    fr = flat.allreduce(xs)
    local = MemoryJob(16, hosts=[8, 8], mode="dense")
    lr = local.allreduce(xs)
    assert np.array_equal(lr.results[0].shift, fr.results[0].shift)
    assert [a.counters.rescales for a in local.agents + flat.agents] == [0] * 32
    assert np.array_equal(lr.out[5], fr.out[0])


def test_an_overflowed_host_sum_is_flagged_to_every_host():
    """A host's own partial sum that overflows int32 flags the round at the switch, so every
    host (not only the one whose sum overflowed) rescales and all agree bit for bit. Host 0's
    sum is about 0 and host 1's overflows, so the switch's own add of the two (host 1's
    wrapped) need not overflow: only the leader's flag tells host 0."""
    up, down = np.full(32, 0.9, np.float32), np.full(32, -0.9, np.float32)
    xs = [up, down, up, down, up, up, up, up]
    job = MemoryJob(8, hosts=[4, 4], mode="dense", shift_bias=7)  # a scale 7 bits too fine
    sim = job.allreduce(xs)
    assert [a.counters.rescales for a in job.agents] == [1] * 8
    for out in sim.out:
        assert np.array_equal(out, sim.out[0])
    q = codec.quantize(up, sim.results[0].shift)
    assert np.array_equal(sim.out[0], np.ldexp(4 * q.astype(np.float64),
                                               -sim.results[0].shift).astype(np.float32))


def test_combine_is_the_switch_lane_add_and_or():
    a = np.array([INT32_MAX, 5, -3], np.int32)
    b = np.array([1, 6, 3], np.int32)
    s, over = combine(wire.OP_ADD, [a, b])
    assert over and s.tolist() == [-2 ** 31, 11, 0]
    s, over = combine(wire.OP_ADD, [b, b])
    assert not over and s.tolist() == [2, 12, 6]
    o, _ = combine(wire.OP_OR, [np.array([1, 2], np.uint32), np.array([4, 2], np.uint32)])
    assert o.view(np.uint32).tolist() == [5, 2]
    with pytest.raises(AgentError, match="disagree on a round's size"):
        combine(wire.OP_ADD, [a, b[:2]])


class _Failing:
    """A leader's link whose round fails (as a dead switch's would)."""

    switch = ("nowhere", 0)
    sock = None
    broken = None

    def __init__(self, cfg, counters):
        pass

    def stream(self, op, words, flagged=False):
        raise AgentError("the switch is gone")

    def close(self):
        pass


def test_a_failed_leader_round_fails_every_rank_of_its_host_at_once():
    host = ThreadHost(3, deadline=30.0)
    errors: list = [None] * 3

    def rank(r: int) -> None:
        cfg = AgentConfig(1, 0, 3, local_workers=1, mode="dense")
        agent = Agent(cfg, transport=host.link(r, _Failing if r == 0 else None))
        try:
            agent.allreduce(np.ones(10, np.float32))
        except Exception as e:  # noqa: BLE001 - checked below
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)  # no rank waits for the deadline
    assert "the switch is gone" in str(errors[0])
    for e in errors[1:]:
        assert isinstance(e, AgentError) and "leader failed the round" in str(e)
        assert "the switch is gone" in str(e)


def test_only_the_leader_has_a_link():
    host = ThreadHost(2)
    cfg = AgentConfig(1, 0, 2, local_workers=1)
    with pytest.raises(AgentError, match="leader"):
        HostLink(_member(host, 1), _Failing(cfg, None), cfg)
    with pytest.raises(AgentError, match="leader"):
        HostLink(_member(host, 0), None, cfg)


def _member(host: ThreadHost, r: int):
    from homagg.host_agent.hostreduce import _ThreadMember
    return _ThreadMember(host, r)


def test_overflow_of_the_switch_reaches_every_rank():
    """The switch's own flag (no local overflow) reaches the host's other ranks as
    SwitchOverflow, as it reaches the leader."""
    host = ThreadHost(2)
    cfg = AgentConfig(1, 0, 2, local_workers=1)

    class Flagging(_Failing):
        def stream(self, op, words, flagged=False):
            raise SwitchOverflow()

    got: list = [None, None]

    def rank(r):
        link = host.link(r, Flagging if r == 0 else None)(cfg, None)
        try:
            link.stream(wire.OP_ADD, np.ones(4, np.int32))
        except SwitchOverflow:
            got[r] = "overflow"

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == ["overflow", "overflow"]
