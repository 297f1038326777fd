"""A 128-rank job placed by the service on a two-leaf tree, summed exactly (issue 49, item 2).

16 hosts of 8 ranks: each host's ranks reduce locally (``hostreduce.ThreadHost``), and its
leader, the host's one switch worker, joins the job through the service over gRPC (world size
16). The service places it by itself on a spine and two leaves, every switch a software
aggregator on a loopback address of its own (8 hosts under each leaf's network) with its
P4Runtime server, which the service drives as ``homagg-ctl serve`` does; each leader's agent is
configured from its JoinReply alone, as an agent joined through the service is. Every rank's
sum is compared bit for bit with the integer sum of all 128 ranks' quantized inputs; then
``homagg-ctl job list`` shows the job on each switch, a restarted service reads it back, and
the leaders' leaves take it off every switch."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

pytest.importorskip("p4runtime_sh")

from homagg import wire  # noqa: E402
from homagg.controller.cli import main as ctl  # noqa: E402
from homagg.controller.serve import start  # noqa: E402
from homagg.controller.service import JobService, ServeOptions  # noqa: E402
from homagg.host_agent import Agent, AgentConfig  # noqa: E402
from homagg.host_agent.engine import Transport  # noqa: E402
from homagg.host_agent.hostreduce import ThreadHost  # noqa: E402
from homagg.membership import pb2, rpc  # noqa: E402
from homagg.netconfig import Config, SwitchSpec, parse, render  # noqa: E402
from homagg.targets.p4runtime_server import P4RuntimeServer  # noqa: E402
from homagg.targets.soft import SoftSwitch, SoftSwitchServer  # noqa: E402
from tests.test_agent import assert_exact, sparse_tensors  # noqa: E402
from tests.test_service import connect  # noqa: E402

pytestmark = pytest.mark.slow  # (conftest.py) 128 agents and three aggregators

HOSTS, PER_HOST, LEAVES = 16, 8, 2
PORT = wire.HOMAGG_UDP_PORT_MIN
SPINE = "127.210.0.254"
SECRET = "a join secret of the 128-rank job"


def leaf_ip(i: int) -> str:
    return f"127.210.{i + 1}.254"


def host_addr(h: int) -> tuple[str, int]:
    """Host h sits under leaf h % LEAVES (the hosts alternate leaves, as ranks need not
    follow racks)."""
    return f"127.211.{h % LEAVES}.{h // LEAVES + 1}", 20000


def config(grpc: dict[str, str]):
    return parse({
        "switch": {"name": "spine", "target": "soft", "grpc": grpc["spine"], "ip": SPINE},
        "switches": [{"name": f"leaf{i + 1}", "parent": "spine", "ip": leaf_ip(i),
                      "grpc": grpc[f"leaf{i + 1}"], "under": [f"127.211.{i}.0/24"]}
                     for i in range(LEAVES)]})


def ctl_json(path, *args) -> list:
    """``homagg-ctl -c path ARGS``'s JSON."""
    import contextlib
    import io
    import json

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ctl(["-c", str(path), *args]) == 0
    return json.loads(out.getvalue())


def agent_config(reply, bind: tuple[str, int], ranks: int, **kw) -> AgentConfig:
    """A leader's config from its JoinReply alone: what the agent side does with a tree's
    answer (``leaf_workers`` > 0): its id and its job's size at its leaf, every rank of the
    job as the sum's contributors."""
    tree = reply.leaf_workers > 0
    return AgentConfig(job=reply.job_id, worker=reply.leaf_worker if tree else reply.worker,
                       workers=ranks, local_workers=reply.leaf_workers if tree else
                       reply.workers, switch=(reply.send_to_ip, reply.send_to_port),
                       bind=bind, slots=reply.slots, run=reply.run, key=reply.key,
                       siblings=tuple(reply.siblings), **kw)


def test_a_128_rank_job_is_placed_on_two_leaves_and_is_exact(tmp_path):
    servers = {"spine": SoftSwitchServer(SoftSwitch(), (SPINE, PORT)).start()}
    servers |= {f"leaf{i + 1}": SoftSwitchServer(SoftSwitch(), (leaf_ip(i), PORT)).start()
                for i in range(LEAVES)}
    p4rt = {n: P4RuntimeServer(s.switch, "127.0.0.1:0").start() for n, s in servers.items()}
    cfg = config({n: p.address for n, p in p4rt.items()})
    path = tmp_path / "tree.toml"
    path.write_text(render(cfg))
    ips = {"spine": SPINE} | {f"leaf{i + 1}": leaf_ip(i) for i in range(LEAVES)}
    for n, p in p4rt.items():  # each switch installed as one is, with a config naming it
        one = tmp_path / f"{n}.toml"
        one.write_text(render(Config(SwitchSpec(n, p.address, ip=ips[n], target="soft"))))
        assert ctl(["-c", str(one), "install", "--no-jobs"]) == 0
    svc = JobService(cfg, connect, ServeOptions(token=None, slots=16, key=b"k" * 16,
                                                trust_claimed_address=True))
    srv = start(svc, "127.0.0.1:0")
    channel = grpc.insecure_channel(srv.address)
    stub = rpc.MembershipStub(channel)
    replies: dict[int, object] = {}
    agents: list[Agent] = []
    try:
        def join(h):
            ip, port = host_addr(h)
            replies[h] = stub.Join(pb2.JoinRequest(job="big", rank=h, world_size=HOSTS,
                                                   udp_port=port, ip=ip, join_secret=SECRET),
                                   timeout=60)

        ts = [threading.Thread(target=join, args=(h,)) for h in range(HOSTS)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(90)
        assert len(replies) == HOSTS
        # placed by the service: the spine's job has the two leaves, each leaf's its 8 hosts
        listed = ctl_json(path, "job", "list", "--json")  # homagg-ctl, as an operator runs it
        assert sorted((j["on"], j["id"], len(j["workers"])) for j in listed) == \
            [("leaf1", replies[0].job_id, 8), ("leaf2", replies[0].job_id, 8),
             ("spine", replies[0].job_id, 2)]
        for h, r in replies.items():
            assert (r.send_to_ip, r.place, r.leaf_workers, r.workers) == \
                (leaf_ip(h % LEAVES), f"leaf{h % LEAVES + 1}", 8, HOSTS)
            assert r.leaf_worker == h // LEAVES and list(r.siblings) == ["leaf1", "leaf2"]
        ranks = HOSTS * PER_HOST
        xs = sparse_tensors(np.random.default_rng(49), ranks, 20_000, 0.02)
        for h in range(HOSTS):
            host = ThreadHost(PER_HOST)
            leader = agent_config(replies[h], host_addr(h), ranks, timeout=0.02,
                                  deadline=30.0)
            for r in range(PER_HOST):
                agents.append(Agent(leader, transport=host.link(r, Transport if r == 0
                                                                else None)))
        results: list = [None] * ranks
        errors: list = [None] * ranks

        def work(i):
            try:
                results[i] = agents[i].allreduce_detailed(xs[i])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors[i] = e

        ts = [threading.Thread(target=work, args=(i,)) for i in range(ranks)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(errors), [e for e in errors if e][:3]
        assert_exact(results, xs)
        # the spine took the leaves' partial sums: one worker each, not 64 ranks' packets
        spine = servers["spine"].switch.model
        assert int(spine.stats[wire.STAT_INDEX["STAT_COMPLETED"]]) > 0
        # a restarted service reads the job back from the three switches, and serves it
        channel.close()
        srv.stop()
        svc = JobService(cfg, connect, ServeOptions(token=None, slots=16, key=b"k" * 16,
                                                    trust_claimed_address=True))
        srv = start(svc, "127.0.0.1:0")
        channel = grpc.insecure_channel(srv.address)
        stub = rpc.MembershipStub(channel)
        (held,) = svc.held.values()
        assert sorted(p.name for p in held.everywhere) == ["leaf1", "leaf2", "spine"]
        for h, r in replies.items():
            left = stub.Leave(pb2.LeaseRequest(job_id=r.job_id, worker=r.worker, udp_port=20000,
                                               ip=host_addr(h)[0], secret=r.secret), timeout=30)
            assert left.removed == (len(svc.held) == 0)
        assert svc.held == {} and ctl_json(path, "job", "list", "--json") == []
    finally:
        for a in agents:
            a.close()
        channel.close()
        srv.stop()
        for p in p4rt.values():
            p.stop()
        for s in servers.values():
            s.stop()
