"""Local reduction for torch.distributed's ranks: the ranks of one host combine their words over a
gloo group of their own, and one rank per host (the leader) is the switch's worker
(``homagg.host_agent.hostreduce`` says how a round goes, and why the sums are the same bits).

Which ranks share a host: torchrun's node (GROUP_RANK, of which LOCAL_RANK and
LOCAL_WORLD_SIZE are the parts); outside torchrun, the ranks that bind the same address
(HOMAGG_BIND's host, else the address they speak to the controller service from). The ranks
learn each other's in one all_gather, so they all agree; a host's leader is its lowest rank and
hosts are numbered by their leaders.

It is on by default where the ranks join through the controller service (HOMAGG_CONTROLLER): the
leader alone joins, as the host's worker (rank: the host's number; world size: the hosts), and
tells its host's other ranks the job it was placed in. ``HOMAGG_LOCAL_REDUCE=0`` turns it off
(a worker per rank, as before). A static job (HOMAGG_JOB, ...) keeps a worker per rank: its
switch's job table names its workers. Nor does a job whose every host has one rank change.

Words cross between a host's ranks in host memory through gloo (over loopback), CUDA tensors'
too: the words the switch takes are in host memory already (the codec's output on the GPU is
copied down to be sent), so an inner NCCL group would add a copy each way, not save one.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import zlib
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from homagg.host_agent.allreduce import Agent
from homagg.host_agent.config import AgentConfig, AgentError
from homagg.host_agent.engine import Transport
from homagg.host_agent.hostreduce import HostLink, Shared, as_int32

#: Bytes of a failed round's reason that reach a host's other ranks.
WHY_BYTES = 256
_names = itertools.count()


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """HOMAGG_LOCAL_REDUCE: on (1, the default) or off (0)."""
    env = os.environ if environ is None else environ
    value = (env.get("HOMAGG_LOCAL_REDUCE") or "1").strip().lower()
    if value not in ("0", "1", "on", "off", "true", "false", "yes", "no"):
        raise AgentError(f"$HOMAGG_LOCAL_REDUCE={value!r}: 1 (the ranks of a host reduce "
                         "locally first, the default) or 0 (a switch worker per rank)")
    return value in ("1", "on", "true", "yes")


def host_key(environ: Mapping[str, str] | None = None) -> int:
    """What this rank's host is called, as a number every rank of the host has alike."""
    env = os.environ if environ is None else environ
    if env.get("GROUP_RANK"):
        try:
            return int(env["GROUP_RANK"])
        except ValueError:
            raise AgentError(f"$GROUP_RANK={env['GROUP_RANK']!r}: torchrun's node rank, an "
                             "integer") from None
    address = (env.get("HOMAGG_BIND") or "").partition(":")[0] or \
        _speaks_from(env.get("HOMAGG_CONTROLLER") or "") or socket.gethostname()
    return (1 << 32) | zlib.crc32(address.encode())  # (never a node rank)


def _speaks_from(controller: str) -> str | None:
    """The address this host speaks to the controller service from (the one its agent binds,
    ``AgentConfig.from_env``), or None where that cannot be told. A host's name is not enough:
    hosts that share a kernel's name (Mininet's) are distinct hosts."""
    host, _, port = controller.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host.strip("[]"), int(port)))  # (a route, no datagram)
            return str(s.getsockname()[0])
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class Layout:
    """The ranks' hosts: ``hosts[h]`` is host h's global ranks, its leader first."""
    hosts: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def host(self) -> int:
        return next(h for h, ranks in enumerate(self.hosts) if self.rank in ranks)

    @property
    def local_rank(self) -> int:
        return self.hosts[self.host].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.hosts[self.host])

    @property
    def reduces(self) -> bool:
        """Whether any host has more than one rank (else nothing changes)."""
        return any(len(r) > 1 for r in self.hosts)


def layout_of(keys: list[int], rank: int) -> Layout:
    """The hosts from every rank's ``host_key``, in rank order."""
    hosts: dict[int, list[int]] = {}
    for r, k in enumerate(keys):
        hosts.setdefault(k, []).append(r)
    return Layout(tuple(sorted((tuple(v) for v in hosts.values()), key=lambda r: r[0])), rank)


def gather_layout(gloo: Any, rank: int, size: int,
                  environ: Mapping[str, str] | None = None) -> Layout | None:
    """Every rank's host, through one all_gather on ``gloo`` (a gloo group of every rank),
    which every rank takes part in whatever its settings; None where local reduction does not
    apply: no controller service (HOMAGG_CONTROLLER), or HOMAGG_LOCAL_REDUCE=0. Ranks that
    disagree on either, or that cannot read them, are an error on every rank at once (never
    some ranks in a collective the others skipped)."""
    env = os.environ if environ is None else environ
    failure: AgentError | None = None
    try:
        mine = [host_key(env), int(enabled(env)), int(bool(env.get("HOMAGG_CONTROLLER")))]
    except AgentError as e:
        failure, mine = e, [0, -1, -1]
    every = [torch.zeros(3, dtype=torch.int64) for _ in range(size)]
    gloo.allgather([every], [torch.tensor(mine, dtype=torch.int64)]).wait()
    if failure is not None:
        raise failure
    rows = [[int(v) for v in t] for t in every]
    bad = [r for r, row in enumerate(rows) if row[1] < 0]
    if bad:
        raise AgentError(f"homagg: rank(s) {bad} could not read their local reduction's "
                         "settings (their own error says why)")
    if len({row[2] for row in rows}) > 1:
        raise AgentError("homagg: some ranks join through the controller service "
                         "(HOMAGG_CONTROLLER) and some not: every rank must agree")
    if len({row[1] for row in rows}) > 1:
        raise AgentError("homagg: the ranks set HOMAGG_LOCAL_REDUCE differently: every rank "
                         "must agree")
    if not rows[0][1] or not rows[0][2]:
        return None
    return layout_of([row[0] for row in rows], rank)


class GlooExchange:
    """A host's ranks over a gloo group of their own (``hostreduce.Exchange``): the words to
    the leader with one gather, its outcome back with one broadcast."""

    def __init__(self, store: Any, layout: Layout, timeout: timedelta):
        self.local_rank, self.size = layout.local_rank, layout.local_size
        prefix = f"homagg-host/{layout.hosts[layout.host][0]}/{next(_names)}/"
        self.pg: Any = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store),
                                             self.local_rank, self.size, timeout)

    def gather(self, parts):
        flat = torch.from_numpy(np.concatenate([as_int32(p) for p in parts]))
        sizes = [p.size for p in parts]
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.local_rank:
            self.pg.gather([], [flat], opts).wait()
            return None
        every = [torch.empty_like(flat) for _ in range(self.size)]
        self.pg.gather([every], [flat], opts).wait()
        cuts = np.cumsum(sizes)[:-1]
        return [tuple(np.split(t.numpy(), cuts)) for t in every]

    def share(self, shared, sizes):
        n = 2 + sum(sizes) + WHY_BYTES // 4
        buf = torch.zeros(n, dtype=torch.int32)
        if shared is not None:  # the leader
            buf[0] = shared.status
            at = 2
            for out in shared.outs:
                buf[at:at + out.size] = torch.from_numpy(as_int32(out))
                at += out.size
            why = shared.why.encode()[:WHY_BYTES]
            buf[1] = len(why)
            tail = np.zeros(WHY_BYTES, np.uint8)
            tail[:len(why)] = np.frombuffer(why, np.uint8)
            buf[n - WHY_BYTES // 4:] = torch.from_numpy(tail.view(np.int32))
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([buf], opts).wait()
        if shared is not None:
            return shared
        words = buf.numpy()
        outs, at = [], 2
        for m in sizes:
            outs.append(words[at:at + m].copy())
            at += m
        why = words[n - WHY_BYTES // 4:].view(np.uint8)[:int(words[1])].tobytes()
        return Shared(int(words[0]), tuple(outs), why.decode(errors="replace"))


def host_agent(make_config: Callable[[int, int], AgentConfig], layout: Layout, size: int,
               store: Any, timeout: timedelta, options: Mapping[str, Any]) -> Agent:
    """This rank's agent, its host reducing locally. The leader's config comes from
    ``make_config(host, hosts)`` (its join, as the host's worker); the others' from what the
    leader tells them: the job, the host's worker id and the switch's workers. ``workers``
    becomes every rank of the group (the codec's headroom and the mean count them), and
    ``local_workers`` the switch's (the hosts, or a leaf's in a tree)."""
    ex = GlooExchange(store, layout, timeout)
    told = torch.zeros(5, dtype=torch.int64)  # failed, job, worker, local workers, slots
    cfg: AgentConfig | None = None
    failure: Exception | None = None
    if ex.local_rank == 0:
        try:
            joined = make_config(layout.host, len(layout.hosts))
            cfg = dataclasses.replace(joined, workers=size,
                                      local_workers=joined.local_workers or joined.workers)
            told[:] = torch.tensor([0, cfg.job, cfg.worker, cfg.local_workers or 0, cfg.slots])
        except Exception as e:  # noqa: BLE001 - the host hears of it, then it is raised
            failure = e
            told[0] = 1
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    ex.pg.broadcast([told], opts).wait()
    if failure is not None:
        raise failure
    if int(told[0]):
        raise AgentError(f"rank {layout.rank}: the leader of its host (rank "
                         f"{layout.hosts[layout.host][0]}) could not start its agent (its own "
                         "error says why)")
    if cfg is None:
        job, worker, local, slots = (int(v) for v in told[1:])
        cfg = AgentConfig(job, worker, size, local_workers=local, slots=slots, **options)
    leader = ex.local_rank == 0

    def link(c: AgentConfig, counters) -> HostLink:
        return HostLink(ex, Transport(c, counters) if leader else None, c, counters)

    return Agent(cfg, transport=link)


def group_agent(gloo: Any, store: Any, rank: int, size: int, timeout: timedelta,
                make_config: Callable[[int, int], AgentConfig], options: Mapping[str, Any],
                environ: Mapping[str, str] | None = None) -> Agent | None:
    """The agent of a group of every rank with its hosts reducing locally, or None where that
    does not apply (no controller service, HOMAGG_LOCAL_REDUCE=0, or a host per rank): the
    caller then makes a worker per rank, as before. ``gloo``: a gloo group of the ranks (the
    layout's all_gather, which every rank takes part in); ``make_config(host, hosts)``: the
    leader's join as its host's worker."""
    layout = gather_layout(gloo, rank, size, environ)
    if layout is None or not layout.reduces:
        return None
    return host_agent(make_config, layout, size, store, timeout, options)


def joined_config(host: int, hosts: int, options: Mapping[str, Any],
                  environ: Mapping[str, str] | None = None,
                  join_secret: str | None = None) -> AgentConfig:
    """A host leader's join through the controller service: as its host's worker (RANK: the
    host's number, WORLD_SIZE: the hosts), with the job's name and secret every rank has."""
    env = dict(os.environ if environ is None else environ)
    if join_secret is not None:
        env["HOMAGG_JOIN_SECRET"] = join_secret
    env["RANK"], env["WORLD_SIZE"] = str(host), str(hosts)
    return AgentConfig.from_env(env, **options)


def hook_agent(**options: Any) -> Agent:
    """The DDP hook's agent for this rank (after ``dist.init_process_group``, on any backend),
    its host reducing locally where the ranks join through the controller service (this
    module's doc); ``options``: ``AgentConfig`` fields, as ``AgentConfig.from_env``'s. Every
    rank calls it, in the same order as its other collectives.

        agent = homagg.torch.hook_agent()
        ddp.register_comm_hook(HookState.of(agent, ddp), homagg_hook)
    """
    if not dist.is_initialized():
        raise AgentError("hook_agent: call dist.init_process_group first (the ranks find "
                         "their hosts through it)")
    rank, size = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    timeout = timedelta(minutes=30)
    prefix = f"homagg-hook/{next(_names)}/"
    gloo = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)
    agent = group_agent(gloo, dist.PrefixStore(prefix, store), rank, size, timeout,
                        lambda h, n: joined_config(h, n, options), options)
    return agent if agent is not None else Agent(AgentConfig.from_env(**options))
