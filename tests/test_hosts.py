"""Which ranks share a host, and when local reduction applies
(``homagg.host_agent.distributed.hosts``): the layout every rank agrees on, and ranks that
disagree failing together, never some of them left in a collective the others skipped."""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from homagg.host_agent.config import AgentError  # noqa: E402
from homagg.host_agent.distributed import hosts  # noqa: E402


def test_hosts_are_numbered_by_their_leaders_and_a_leader_is_the_lowest_rank():
    lay = hosts.layout_of([7, 3, 7, 3, 9], rank=2)
    assert lay.hosts == ((0, 2), (1, 3), (4,))
    assert (lay.host, lay.local_rank, lay.local_size, lay.reduces) == (0, 1, 2, True)
    assert not hosts.layout_of([1, 2, 3], 0).reduces  # a host per rank: nothing changes


def test_a_host_is_torchruns_node_else_the_address_the_ranks_bind():
    assert hosts.host_key({"GROUP_RANK": "3", "HOMAGG_BIND": "10.0.0.2"}) == 3
    a = hosts.host_key({"HOMAGG_BIND": "10.0.0.2:5000"})
    assert a == hosts.host_key({"HOMAGG_BIND": "10.0.0.2"}) != hosts.host_key(
        {"HOMAGG_BIND": "10.0.0.3"})
    assert a >= 1 << 32  # never a node's rank
    # without either: the address this host speaks to the service from (not the host's name,
    # which Mininet's hosts share)
    here = hosts.host_key({"HOMAGG_CONTROLLER": "127.0.0.7:9600"})
    assert here == hosts.host_key({"HOMAGG_BIND": "127.0.0.1"})
    with pytest.raises(AgentError, match="GROUP_RANK"):
        hosts.host_key({"GROUP_RANK": "x"})


def test_homagg_local_reduce_is_on_unless_turned_off():
    assert hosts.enabled({}) and hosts.enabled({"HOMAGG_LOCAL_REDUCE": "1"})
    assert not hosts.enabled({"HOMAGG_LOCAL_REDUCE": "0"})
    with pytest.raises(AgentError, match="HOMAGG_LOCAL_REDUCE='maybe'"):
        hosts.enabled({"HOMAGG_LOCAL_REDUCE": "maybe"})


def _gather(envs: list[dict]) -> list:
    """``gather_layout`` on len(envs) ranks (threads, one gloo group each on one store)."""
    store = dist.HashStore()
    out: list = [None] * len(envs)

    def rank(r: int) -> None:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("t/", store), r, len(envs),
                                   timedelta(seconds=30))
        try:
            out[r] = hosts.gather_layout(pg, r, len(envs), envs[r])
        except AgentError as e:
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(envs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)  # nobody left waiting
    return out


SERVICE = {"HOMAGG_CONTROLLER": "ctl:9600"}


def test_the_ranks_agree_on_the_layout():
    got = _gather([SERVICE | {"GROUP_RANK": str(r // 2)} for r in range(4)])
    assert [g.hosts for g in got] == [((0, 1), (2, 3))] * 4
    assert [g.local_rank for g in got] == [0, 1, 0, 1]


@pytest.mark.parametrize("envs,why", [
    ([SERVICE, SERVICE | {"HOMAGG_LOCAL_REDUCE": "0"}, SERVICE], "set HOMAGG_LOCAL_REDUCE "
     "differently"),
    ([SERVICE, {}, SERVICE], "some ranks join through the controller service"),
    ([SERVICE, SERVICE | {"HOMAGG_LOCAL_REDUCE": "perhaps"}, SERVICE], r"rank\(s\) \[1\] could "
     "not read"),
])
def test_ranks_that_disagree_fail_together(envs, why):
    got = _gather(envs)
    assert all(isinstance(g, AgentError) for g in got), got
    for r, g in enumerate(got):
        if r == 1 and "perhaps" in envs[1].get("HOMAGG_LOCAL_REDUCE", ""):
            assert "HOMAGG_LOCAL_REDUCE='perhaps'" in str(g)  # its own error
        else:
            assert re.search(why, str(g)), g


def test_off_or_without_a_service_no_layout():
    assert _gather([{}, {}]) == [None, None]
    off = SERVICE | {"HOMAGG_LOCAL_REDUCE": "0"}
    assert _gather([off, off]) == [None, None]
