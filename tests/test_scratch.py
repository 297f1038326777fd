"""The memory a transport keeps from round to round (``host_agent.engine.scratch``): a buffer
is handed out again only once no view of it is alive, so a result a caller keeps is never
written over; an agent's rounds of a tensor it sends again and again make no new buffers, and
every sum stays exact, with the results of earlier calls kept and intact."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from homagg import wire
from homagg.host_agent.engine.scratch import Scratch
from tests.test_agent import AGENT_ENGINES, Job, assert_exact, closing_factory


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_buffer_no_view_holds_is_handed_out_again():
    s = Scratch()
    a = s.empty(1000, np.int32)
    at = address(a)
    del a
    b = s.empty(1000, np.int32)
    assert address(b) == at and b.dtype == np.int32 and b.shape == (1000,)
    assert (s.made, s.reused) == (1, 1)


def holder(how: str, a: np.ndarray):
    if how == "view of a view":
        return a[10:][::2].view(np.uint32)
    if how == "reshaped":
        return a.reshape(32, 32).T
    if how == "torch":
        return torch.from_numpy(a[5:])
    if how == "memoryview":
        return memoryview(a[3:9])
    dt = wire.packet_dtype(16)  # (packets: a round's batch)
    return a[:dt.itemsize // 4 * 8].view(dt)


@pytest.mark.parametrize("hold", ["view of a view", "reshaped", "torch", "memoryview",
                                  "structured"])
def test_a_buffer_something_still_holds_is_not_handed_out(hold):
    s = Scratch()
    a = s.empty(1024, np.int32)
    a[:] = np.arange(1024)
    held = holder(hold, a)
    del a
    b = s.empty(1024, np.int32)
    b[:] = -1  # written over: the held view must not see it
    assert s.made == 2 and s.reused == 0
    got = np.asarray(held).view(np.int32).reshape(-1) if hold != "torch" else held.numpy()
    assert (got != -1).all()
    del held, got, b
    assert s.empty(1024, np.int32) is not None and s.reused == 1


def test_the_smallest_idle_buffer_that_fits_and_a_bound_on_what_is_kept():
    s = Scratch(keep=2)
    big, small = s.empty(1 << 16, np.uint8), s.empty(100, np.uint8)
    at_big, at_small = address(big), address(small)
    del big, small
    x = s.empty(50, np.uint8)
    assert address(x) == at_small  # (not the big one)
    y = s.empty(60_000, np.uint8)
    assert address(y) == at_big
    z = s.empty(10, np.uint8)  # both kept ones in use: a new one, not kept (keep=2)
    assert s.made == 3 and s.nbytes == (1 << 16) + 100
    del x, z
    w = s.empty(1000, np.uint8)  # larger than the idle one: it takes that one's place
    assert s.nbytes == (1 << 16) + 1000 and w.size == 1000
    s.clear()
    assert s.nbytes == 0 and y[0] == y[0]  # (what is in use lives on in its views)


def test_a_buffer_above_the_largest_is_never_kept():
    s = Scratch(largest=1 << 20)
    a = s.empty((1 << 20) // 4 + 1, np.int32)
    assert s.nbytes == 0 and a.size == (1 << 18) + 1
    del a
    s.empty(1 << 18, np.int32)  # (exactly the largest: kept)
    assert s.nbytes == 1 << 20 and s.made == 2


@pytest.fixture(params=AGENT_ENGINES, ids=["agent-auto", "agent-python"])
def make_job(request):
    yield from closing_factory(functools.partial(Job, agent_engine=request.param))


@pytest.mark.parametrize("mode", ["dense", "union", "auto"])
def test_rounds_reuse_their_memory_and_kept_results_stay_exact(make_job, mode):
    """Six calls on one tensor's key whose ``Result``s the caller keeps: each still exact,
    bit for bit, after all six ran (no kept result was written over). Then six whose results
    the caller lets go: each exact, and from the second on, no new buffer made."""
    job = make_job(3, mode=mode)
    rng = np.random.default_rng(3)
    n = 20_000
    inputs = [[np.where(rng.random(n) < 0.3, rng.standard_normal(n), 0).astype(np.float32)
               for _ in range(3)] for _ in range(12)]

    def call(c):
        res, err = job.run(lambda a, w: a.allreduce_detailed(inputs[c][w], key="t"))
        assert err == [None] * 3
        return res

    kept = [call(c) for c in range(6)]
    for c, res in enumerate(kept):
        assert_exact(res, inputs[c])
    del kept, res
    scratch = job.agents[0].transport.scratch
    made = []
    for c in range(6, 12):
        assert_exact(call(c), inputs[c])
        made.append(scratch.made)
    assert made[1:] == [made[0]] * 5, made
    assert scratch.reused > 0
