"""A torch.distributed backend named "homagg": ``dist.init_process_group("homagg")``.

    import homagg.torch  # registers the backend (for the cpu and cuda devices)
    dist.init_process_group("homagg")   # or "cpu:homagg"; then DDP, dist.all_reduce, ... as usual

The process group builds its agent itself, from ``AgentConfig.from_env()`` (HOMAGG_JOB,
HOMAGG_SWITCH, HOMAGG_BIND, ...; the worker and the number of workers default to the process
group's own rank and world size); the ranks agree that every agent started (a rank that cannot
bind its address fails ``init_process_group`` on every rank at once). What goes where:

* ``all_reduce`` SUM and AVG of float32, float64, bfloat16 and float16 tensors: through the
  switch, with the agent's codec (block floating point, an exact sum of the quantized values;
  a NaN or an Inf anywhere makes the whole tensor NaN on every rank, as the DDP hook does; a
  float32 SUM longer than ``AgentConfig.part`` goes in parts, ``host_agent.parts``: the whole
  part).
  float32 SUM is the hook's path (the sum rounded once to float32). The other dtypes and AVG
  are converted to float64 first (exact: every bfloat16/float16/float32 is a float64), so the
  integers on the wire are the float32 path's, and the float64 sum (exact: the integer sums
  times a power of two) is rounded once to the tensor's dtype (AVG: divided by the world size
  in float64 first). float64 is quantized to the codec's int32 grid like float32 (about 31
  bits below each block's largest value, not float64's 53): said once in a warning.
  (torch itself hands a complex tensor's SUM over as its float pairs: through the switch too.)
* ``all_reduce`` SUM of integer tensors: exact, as gloo's. int8/int16/uint8 are summed in
  int32 and wrapped back to their dtype (gloo has no int16 SUM; this has); int32 is summed in
  int32 and, if the switch flags an overflow (every rank sees the flag), again in two 16-bit
  limbs; int64 always in four 16-bit limbs (one round of 4x the words): the sum modulo 2**64,
  bit for bit gloo's.
* Sparse COO tensors (SUM, AVG): ``Agent.allreduce_rows``, as the DDP hook does.
* CUDA tensors: as CPU tensors' (the same integers, bit for bit), by ``switch.CudaStager``,
  with NCCL's stream promises: the collective waits for the stream that produced the tensor,
  and its Work's CUDA-aware future makes the waiting stream wait for the result. A float
  tensor's codec runs on its GPU (``device.DeviceTensor``): only the words cross PCIe
  (HOMAGG_CUDA_CODEC=host: staged whole to the CPU codec); integer tensors are staged through
  pinned host memory. What the switch does not serve goes to NCCL where every rank has a GPU
  of its own, else to gloo (``inner``; HOMAGG_TORCH_CUDA_INNER).
* ``reduce_scatter`` (all three forms) SUM/AVG: gloo by default; with
  HOMAGG_TORCH_REDUCE_SCATTER=switch, an all_reduce through the switch of which each rank keeps
  its part (FSDP2's gradients then reach the switch; every rank sends the whole tensor).
* Everything else (MAX, MIN, PRODUCT, AVG of integers, bool and other dtypes, broadcast,
  all_gather, all_to_all, gather, scatter, reduce, barrier, send/recv): an inner gloo group,
  whose result is gloo's by construction. A reduction the switch cannot serve says so once per
  process (which op or dtype, and why). ``monitored_barrier`` is gloo's only (torch checks the
  backend's name), as with NCCL.

Every collective called through this group returns a ``HomaggWork`` whose future is completed
by the group's one agent thread, in issue order, with the list of output tensors; ``wait()``
re-raises an error (torch's own future-backed Work loses it). The switch's rounds and the gloo
fallbacks are issued by that one thread, so every rank issues them in the same order even when
DDP calls from autograd's thread. Point-to-point send and recv are the exception: gloo's own
Work, issued at once (gloo matches them by peer and tag, and a thread that waits for each in
turn would deadlock two ranks that both isend, then irecv). The group also registers a gloo
group of its own as its cpu backend, which torch needs for any method a Python group does not
override; C++ code going around the Python methods would reach it (``cpp_collectives`` counts
them), apart from the one the agent's thread uses, so the two orders never mix on one gloo
context. With torch 2.13 nothing does: DDP's start-up checks, FSDP2 and the functional
collectives all come through the Python methods (tests/test_torch_backend.py shows which path
served each).

Subgroups (``new_group``, a device mesh's dimensions) each need a homagg job of their own, with
an agent (and a thread) of their own, independent of the default group's, as a separate
communicator is. Where the controller service is configured (HOMAGG_CONTROLLER), each subgroup
joins its own job by itself, at its first collective through the switch (every member calls
it, so their joins meet; a subgroup that never sends one holds no job): named from the default
group's job name and torch's name for the group (the same on every member: torch names groups
alike on every rank), with the member's rank in the group and the group's size, so its members
agree on it with no extra code. A join that fails fails that collective, and every later one
through the switch, on the rank it failed on (the others' joins time out). Without
a service, ``set_subgroup_config(provider)`` says which static job a subgroup is (and it takes
precedence where given); a subgroup with neither is an all-gloo group (a one-time warning says
so). A device mesh dimension that spans every rank in order is the default group itself (torch
reuses it): HSDP's replicas' all_reduce over 2 x 1 goes through the switch, and over 2 x 2 its
replicate dimension's groups join jobs of their own.

Every collective called through the group is a ``torch.profiler`` event named after it, as
gloo's and NCCL's are (``homagg:all_reduce``, ``homagg:broadcast``, ...), from the call until its
work completes, so a profile shows where a step's time went.

The modules: this one registers the backend and configures its agents (``create``,
``set_agent_options``, ``set_subgroup_config``, the environment); the process group, its
thread and its gloo fallbacks are ``group``'s; what goes through the switch and how,
``switch``'s; the Work handle, ``work``'s. Their names are importable from here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from homagg.host_agent.allreduce import Agent
from homagg.host_agent.config import AgentConfig, AgentError, store_secret
from homagg.host_agent.distributed import hosts
from homagg.host_agent.distributed.group import BACKEND, HomaggProcessGroup, Joining
from homagg.host_agent.distributed.switch import FLOATS, LIMB_BITS, SMALL_INTS, say_once
from homagg.host_agent.distributed.work import HomaggWork
from homagg.host_agent.parts import DEFAULT_PART

__all__ = ["BACKEND", "FLOATS", "LIMB_BITS", "SMALL_INTS", "HomaggProcessGroup", "HomaggWork",
           "SubgroupConfig", "create", "register", "say_once", "set_agent_options",
           "set_subgroup_config", "subgroup_job_name"]

_options: dict[str, Any] = {}
#: (global ranks of a subgroup, this rank's rank in it) -> its agent's config, or None: gloo
SubgroupConfig = Callable[[list[int], int], "AgentConfig | None"]
_subgroup_config: SubgroupConfig | None = None


def set_agent_options(**options) -> None:
    """``AgentConfig`` fields (timeout, deadline, mode, index, ...) for the agents of process
    groups created from now on, on top of what ``AgentConfig.from_env`` reads."""
    _options.clear()
    _options.update(options)


def set_subgroup_config(provider: SubgroupConfig | None) -> None:
    """How a subgroup (``new_group``, a device mesh's dimension) gets a homagg job of its own
    in a static setup: ``provider(global_ranks, group_rank)`` returns the config of this
    rank's agent in the subgroup's job (a job id, worker id and bind address of its own; the
    switch's job table must hold that job), or None for gloo. With no provider (the default),
    a subgroup joins a job of its own through the controller service where HOMAGG_CONTROLLER
    is set, and goes to gloo otherwise."""
    global _subgroup_config
    _subgroup_config = provider


#: The store key under which the ranks of a group share their join secret.
JOIN_SECRET_KEY = "homagg/join-secret"


def shared_join_secret(store: Any) -> str:
    """The group's join secret for the controller service, through the group's store (under
    a prefix of this group: each subgroup has its own; ``config.store_secret``)."""
    return store_secret(store, JOIN_SECRET_KEY)


def _agent_config(rank: int, size: int, environ: Mapping[str, str] | None = None,
                  join_secret: str | None = None) -> AgentConfig:
    """``AgentConfig.from_env`` on the environment with the process group's own rank and
    world size where they matter: RANK and WORLD_SIZE are the group's (what a join through a
    controller service names this member by, whatever the rendezvous was), and they are the
    defaults of HOMAGG_WORKER and HOMAGG_WORKERS (``homagg-net exec`` sets those to the
    switch's job table's numbering, which stands). A job of another size than the group is an
    error (the mean and the scale's headroom divide by it). ``join_secret``: the group's
    (``shared_join_secret``), in place of HOMAGG_JOIN_SECRET."""
    env = dict(os.environ if environ is None else environ)
    if join_secret is not None:
        env["HOMAGG_JOIN_SECRET"] = join_secret
    env["RANK"], env["WORLD_SIZE"] = str(rank), str(size)
    env.setdefault("HOMAGG_WORKER", str(rank))
    env.setdefault("HOMAGG_WORKERS", str(size))
    cfg = AgentConfig.from_env(env, **_options)
    if cfg.workers != size:
        raise AgentError(f"the homagg job has {cfg.workers} workers (HOMAGG_WORKERS) but the "
                         f"process group has {size} ranks: every rank must be a worker of "
                         "the job")
    return cfg


def subgroup_job_name(environ: Mapping[str, str], group: str, ranks: list[int]) -> str:
    """The job a subgroup joins through the service: the default group's job name (what
    ``AgentConfig.from_env`` names it), then torch's name of the group and its global ranks."""
    base = environ.get("HOMAGG_JOB_NAME") or (
        f"{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}/"
        f"{environ.get('TORCHELASTIC_RUN_ID') or 'none'}")
    return f"{base}/group {group or '?'} ranks {','.join(map(str, ranks))}"


def _joined_subgroup(group: str, ranks: list[int], rank: int, size: int,
                     environ: Mapping[str, str] | None = None,
                     join_secret: str | None = None) -> AgentConfig | None:
    """This member's config in the subgroup's own job, joined through the controller service
    (None without HOMAGG_CONTROLLER): the join waits for the subgroup's other members, as the
    default group's does for every rank. Its agent binds an address of its own on the host of
    HOMAGG_BIND, if any (its port is the default group's)."""
    env = dict(os.environ if environ is None else environ)
    if not env.get("HOMAGG_CONTROLLER"):
        return None
    env["HOMAGG_JOB_NAME"] = subgroup_job_name(env, group, ranks)
    env["RANK"], env["WORLD_SIZE"] = str(rank), str(size)
    if join_secret is not None:
        env["HOMAGG_JOIN_SECRET"] = join_secret
    if env.get("HOMAGG_BIND"):
        env["HOMAGG_BIND"] = env["HOMAGG_BIND"].partition(":")[0]
    return AgentConfig.from_env(env, **_options)


def create(opts, backend_options=None) -> HomaggProcessGroup:
    """The backend's creator (torch's extended API): the default group gets an agent; a
    subgroup is all gloo (see the module doc)."""
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    timeout = opts.timeout
    # where the ranks join through the service, they prove it to it with one secret
    secret = shared_join_secret(store) if os.environ.get("HOMAGG_CONTROLLER") else None
    world = list(getattr(opts, "global_ranks_in_group", []) or [])
    subgroup = dist.is_initialized() or (world and world != list(range(len(world))))
    if not subgroup:
        def default_agent(gloo: Any) -> Agent:
            # the ranks of a host reduce locally first where they join through the service
            # (``hosts``); else a worker per rank
            agent = hosts.group_agent(
                gloo, store, rank, size, timeout,
                lambda h, n: hosts.joined_config(h, n, _options, join_secret=secret), _options)
            return agent or Agent(_agent_config(rank, size, join_secret=secret))

        return HomaggProcessGroup(store, rank, size, timeout, default_agent)

    def checked(cfg: AgentConfig) -> Agent:
        if cfg.workers != size:
            raise AgentError(f"subgroup of ranks {world}: its job has {cfg.workers} workers, "
                             f"the group {size} ranks")
        return Agent(cfg)

    def subgroup_agent(_gloo: Any) -> Agent | Joining | None:
        cfg = _subgroup_config(world, rank) if _subgroup_config is not None else None
        if cfg is not None:
            return checked(cfg)
        if _subgroup_config is None and os.environ.get("HOMAGG_CONTROLLER"):
            # joined at the group's first collective through the switch: a subgroup that
            # never sends one holds no job
            def join() -> Agent:
                got = _joined_subgroup(str(getattr(opts, "group_id", "") or ""), world, rank,
                                       size, join_secret=secret)
                assert got is not None  # (HOMAGG_CONTROLLER is set)
                return checked(got)

            return Joining(join, int(_options.get("part", DEFAULT_PART)))
        say_once("subgroup", f"process group {getattr(opts, 'group_id', '?')} (ranks "
                 f"{world or '?'}) is a subgroup: it has no homagg job of its own (that "
                 "needs the controller service, HOMAGG_CONTROLLER, or "
                 "homagg.torch.set_subgroup_config), so all its collectives go to gloo")
        return None

    return HomaggProcessGroup(store, rank, size, timeout, subgroup_agent)


def register() -> None:
    """Register the "homagg" backend for the cpu and cuda devices (again: nothing)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])
