"""The round cost (host_agent.round_cost) and the index choice that weighs it: each worker's
estimate, the job's agreement through round 1's OR, and auto choosing the flat bitmap when
round trips are dear and the hierarchy when words are, the same on every worker."""

from __future__ import annotations

import numpy as np
import pytest

from homagg.host_agent import codec
from homagg.host_agent.engine.round_cost import MIN_PACKETS, RoundCost, agreed_words
from tests.test_agent import assert_exact, freeze_round_cost, make_job, sparse_tensors

__all__ = ["make_job"]  # the fixture


def test_an_estimate_needs_a_short_round_and_a_long_one():
    c = RoundCost()
    assert c.words is None and c.word() == 0  # says nothing yet
    c.sample(MIN_PACKETS, 256, 0.004)  # no fixed cost known: not a per-packet sample
    assert c.per_packet is None
    c.sample(1, 256, 0.001)
    assert c.words is None
    c.sample(101, 256, 0.011)  # 10 ms for 100 more packets: 0.1 ms each
    assert c.fixed == pytest.approx(0.001) and c.per_packet == pytest.approx(1e-4)
    assert c.words == pytest.approx(10 * 256)  # a round trip is worth 10 packets
    assert c.word() == 1 << (31 - 11)  # log2(2560) = 11.3
    c.sample(3, 256, 0.0012)  # a short round: its fixed part, less its 2 further packets
    assert c.fixed == pytest.approx(0.875 * 0.001 + 0.125 * 0.001)


def test_a_tensors_first_round_is_no_sample():
    c = RoundCost()
    c.tensor_starts()
    c.sample(1, 256, 0.050)  # waited for the slowest worker's backward pass
    assert c.fixed is None
    c.sample(1, 256, 0.001)
    assert c.fixed == pytest.approx(0.001)


def test_samples_are_smoothed():
    c = RoundCost()
    c.sample(1, 256, 0.001)
    c.sample(1, 256, 0.009)
    assert c.fixed == pytest.approx(0.001 + 0.125 * 0.008)


def test_the_job_takes_the_largest_cost_any_worker_set():
    a, b = RoundCost(), RoundCost()
    for c, per in ((a, 1e-4), (b, 1e-6)):
        c.sample(1, 256, 0.001)
        c.sample(101, 256, 0.001 + 100 * per)
    assert agreed_words(a.word() | b.word()) == 2 ** round(np.log2(b.words))
    assert agreed_words(a.word()) == 2 ** round(np.log2(a.words))
    assert agreed_words(0) is None


def test_choose_index_weighs_two_round_trips_against_the_words_saved():
    n = 100_000
    assert codec.choose_index("auto", n, 1000, saves=5000, round_words=2500) == "flat"
    assert codec.choose_index("auto", n, 1000, saves=5001, round_words=2500) == "hier"
    assert codec.choose_index("auto", n, 1000, saves=-3, round_words=0) == "flat"
    assert codec.choose_index("hier", n, 1000, saves=0, round_words=10**6) == "hier"
    assert codec.choose_index("flat", n, 1000, saves=10**6, round_words=0) == "flat"
    # without the round cost, the union-size rule
    assert codec.choose_index("auto", n, 1000, saves=5001) == "hier"
    assert codec.choose_index("auto", n, 30_000, round_words=1) == "flat"


def test_hier_saving_is_what_the_hierarchy_sent_fewer(make_job):
    job = make_job(2, index="hier")
    rng = np.random.default_rng(31)
    xs = sparse_tensors(rng, 2, 100_003, 0.002)
    res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w]))
    assert not any(err), err
    sent = sum(res[0].rounds[r] for r in (codec.ROUND_TOP, codec.ROUND_MID, codec.ROUND_LEAF))
    assert codec.hier_saving(res[0].union_words, 100_003) == \
        codec.bitmap_words(100_003) - sent


@pytest.mark.parametrize("costs,expect", [
    ([None, None], ["hier", "hier"]),            # no estimate: the union-size rule
    ([100, 2**20], ["hier", "flat"]),            # one worker's round trips are dear: flat
    ([100, 200], ["hier", "hier"]),              # words are dear on both: the hierarchy
])
def test_every_worker_makes_the_same_choice_from_the_agreed_cost(make_job, costs, expect):
    job = make_job(2)
    freeze_round_cost(job, costs)
    rng = np.random.default_rng(32)
    xs = sparse_tensors(rng, 2, 200_000, 0.002)  # a 0.4% union: the hierarchy saves ~5k words
    got = []
    for _ in range(2):
        res, err = job.run(lambda a, w: a.allreduce_detailed(xs[w], key="t"))
        assert not any(err), err
        assert_exact(res, xs)
        assert res[0].index == res[1].index
        got.append(res[0].index)
    saving = codec.hier_saving(res[0].union_words, 200_000)
    assert 400 < saving < 2**20  # (the cases above sit either side of 2 x cost)
    assert got == expect
