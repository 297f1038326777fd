"""A torch.distributed backend named "homagg": ``dist.init_process_group("homagg")``.

    import homagg.torch  # registers the backend (for the cpu device)
    dist.init_process_group("homagg")   # or "cpu:homagg"; then DDP, dist.all_reduce, ... as usual

The process group builds its agent itself, from ``AgentConfig.from_env()`` (HOMAGG_JOB,
HOMAGG_SWITCH, HOMAGG_BIND, ...; the worker and the number of workers default to the process
group's own rank and world size); the ranks agree that every agent started (a rank that cannot
bind its address fails ``init_process_group`` on every rank at once). What goes where:

* ``all_reduce`` SUM and AVG of float32, float64, bfloat16 and float16 tensors: through the
  switch, with the agent's codec (block floating point, an exact sum of the quantized values;
  a NaN or an Inf anywhere makes the whole tensor NaN on every rank, as the DDP hook does).
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

Subgroups (``new_group``, a device mesh's dimensions) each need a homagg job of their own: the
job id, the worker ids and the switch's job table for that subset of ranks come from whoever
configures the switch (the controller service), which this module cannot ask yet. So a
subgroup is an all-gloo group (a one-time warning says so), unless
``set_subgroup_config(provider)`` says which job it is: then it has an agent (and a thread) of
its own, independent of the default group's, as a separate communicator is. A device mesh dimension
that spans every rank in order is the default group itself (torch reuses it): HSDP's replicas'
all_reduce over 2 x 1 goes through the switch.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllgatherOptions

from homagg import wire
from homagg.host_agent.allreduce import Agent
from homagg.host_agent.config import AgentConfig, AgentError
from homagg.host_agent.transport import SwitchOverflow

log = logging.getLogger("homagg.torch")

#: The backend's name, for ``dist.init_process_group``.
BACKEND = "homagg"

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: Integer dtypes whose sum is exact in one int32 round (widened, then wrapped back).
SMALL_INTS = (torch.int8, torch.int16, torch.uint8)
#: The int32 limbs an integer is split into for an exact sum (16 bits each: a limb's sum
#: stays in int32 for up to 32767 workers).
LIMB_BITS = 16

_options: dict[str, Any] = {}
#: (global ranks of a subgroup, this rank's rank in it) -> its agent's config, or None: gloo
SubgroupConfig = Callable[[list[int], int], "AgentConfig | None"]
_subgroup_config: SubgroupConfig | None = None
_said: set[str] = set()
_said_lock = threading.Lock()


def set_agent_options(**options) -> None:
    """``AgentConfig`` fields (timeout, deadline, mode, index, ...) for the agents of process
    groups created from now on, on top of what ``AgentConfig.from_env`` reads."""
    _options.clear()
    _options.update(options)


def set_subgroup_config(provider: SubgroupConfig | None) -> None:
    """How a subgroup (``new_group``, a device mesh's dimension) gets a homagg job of its own:
    ``provider(global_ranks, group_rank)`` returns the config of this rank's agent in the
    subgroup's job (a job id, worker id and bind address of its own; the switch's job table
    must hold that job), or None for gloo. With no provider (the default, until the controller
    service hands out jobs), every subgroup goes to gloo."""
    global _subgroup_config
    _subgroup_config = provider


def say_once(what: str, message: str) -> None:
    """A warning, once per process for each ``what``."""
    with _said_lock:
        if what in _said:
            return
        _said.add(what)
    log.info("%s", message)
    warnings.warn(f"homagg: {message}", RuntimeWarning, stacklevel=3)


class HomaggWork(dist.Work):
    """A collective's handle: its future (value: the output tensors) is completed by the
    group's agent thread. ``wait`` raises the collective's error, if any."""

    def __init__(self, fut: torch.futures.Future):
        super().__init__()
        self._fut = fut
        # What get_future hands out: the same value, and an error as one raised in a callback,
        # which torch keeps as a C++ error (the message, with the original type's name). The
        # original Python exception in a future, reached from DDP's reducer in C++ (no comm
        # hook, no GIL), crashes the process (seen with torch 2.13: SIGSEGV in backward).
        self._public = fut.then(_value)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the collective; raise its error. (``timeout`` is not used: the agent's
        deadline bounds a switch collective, the group's timeout a gloo one.)"""
        self._fut.wait()  # raises what the agent thread set
        return True

    def get_future(self) -> torch.futures.Future:
        return self._public

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001 - that is the answer
            return False
        return True

    def exception(self):
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as err:  # noqa: BLE001
            return err
        return None

    def result(self) -> list[torch.Tensor]:
        return self._fut.value()


def _value(fut: torch.futures.Future) -> list[torch.Tensor]:
    return fut.value()


def _reduce_op(opts) -> Any:
    op = getattr(opts, "reduceOp", ReduceOp.SUM)
    return getattr(op, "op", op)  # a ReduceOp's RedOpType (SUM, AVG, ...)


class HomaggProcessGroup(dist.ProcessGroup):
    """The "homagg" process group: all_reduce through the switch (``Agent``), the rest
    through gloo. ``make_agent`` returns the group's agent, or None: every collective goes to
    gloo (a subgroup without a job). Every rank learns whether every other's agent started
    (one gloo all_reduce): if one could not, all raise at once, instead of the others waiting
    for it at their first collective."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 make_agent: Callable[[], Agent | None]):
        super().__init__(rank, size)  # type: ignore[call-arg]  # (the stub knows the 3-arg form)
        self.agent: Agent | None = None
        # The registered cpu backend: what C++ reaches without going through Python.
        self._cpp: Any = dist.ProcessGroupGloo(dist.PrefixStore("homagg-cpp/", store), rank,
                                               size, timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM,
                               self._cpp)
        # What this group's own thread issues; a gloo context of its own (see the module doc)
        self._gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore("homagg-py/", store), rank,
                                                size, timeout)
        self._thread: ThreadPoolExecutor | None = ThreadPoolExecutor(
            1, thread_name_prefix="homagg-agent")
        self._lock = threading.Lock()
        # reduce_scatter SUM/AVG of floats and integers: gloo (the default), or "switch": an
        # all_reduce through the switch of which each rank keeps its part (FSDP's gradients)
        self.scatter_via = os.environ.get("HOMAGG_TORCH_REDUCE_SCATTER") or "gloo"
        if self.scatter_via not in ("gloo", "switch"):
            raise AgentError(f"$HOMAGG_TORCH_REDUCE_SCATTER={self.scatter_via!r}: gloo or "
                             "switch")
        # collectives this group served, "switch:allreduce", "gloo:<gloo's method>" (what C++
        # sends straight to the registered backend is not seen here)
        self.counts: Counter[str] = Counter()
        self._start(make_agent)

    def _start(self, make_agent: Callable[[], Agent | None]) -> None:
        failure: BaseException | None = None
        try:
            self.agent = make_agent()
        except Exception as err:  # noqa: BLE001 - every rank hears of it, then it is raised
            failure = err
        state = torch.zeros(3, dtype=torch.int64)  # ranks with an agent, without, failed
        state[2 if failure is not None else 0 if self.agent is not None else 1] = 1
        self._gloo.allreduce([state]).wait()
        with_agent, without, failed = (int(v) for v in state)
        if failed or (with_agent and without):
            self.shutdown()
            if failure is not None:
                raise failure
            raise AgentError(f"homagg: {failed} rank(s) of this process group could not start "
                             "an agent (their own error says why)" if failed else
                             f"homagg: {with_agent} rank(s) have a homagg job for this group, "
                             f"{without} not: every rank must agree")

    # -- the thread ------------------------------------------------------------------------------
    def _submit(self, run: Callable[[], list[torch.Tensor]]) -> HomaggWork:
        fut: torch.futures.Future = torch.futures.Future()

        def job() -> None:
            try:
                with torch.no_grad():  # outputs are written as gloo's C++ does: no autograd
                    result = run()
                fut.set_result(result)
            except BaseException as err:  # noqa: BLE001 - raised where the work is waited on
                fut.set_exception(err)

        with self._lock:
            if self._thread is None:
                raise RuntimeError("homagg: the process group is shut down")
            self._thread.submit(job)
        return HomaggWork(fut)

    def _gloo_call(self, name: str, outputs: list[torch.Tensor], *args) -> HomaggWork:
        def run() -> list[torch.Tensor]:
            self.counts[f"gloo:{name}"] += 1
            getattr(self._gloo, name)(*args).wait()
            return outputs

        return self._submit(run)

    @property
    def cpp_collectives(self) -> int:
        """How many collectives C++ sent straight to the registered gloo backend (its
        sequence number), around this group's Python methods."""
        return int(self._cpp._get_sequence_number_for_group())

    def shutdown(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True)
        if self.agent is not None:
            self.agent.close()
        for g in (self._gloo, self._cpp):
            try:
                g.shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass

    def abort(self) -> None:
        self.shutdown()

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    # -- all_reduce ------------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.AllreduceOptions()
        if len(tensors) != 1:  # several: one sum over all of them (gloo's multi-device rule)
            say_once("several", "all_reduce of a list of several tensors goes to gloo (one "
                     "sum over all of them and every rank's)")
            return self._gloo_call("allreduce", tensors, tensors, opts)
        return self._allreduce_each("allreduce", tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._allreduce_each("allreduce_coalesced", list(tensors), opts)

    def _allreduce_each(self, name: str, tensors, opts) -> HomaggWork:
        """Each tensor's own sum, through the switch, or all of them through gloo's ``name``."""
        op = _reduce_op(opts)
        why = self._switch_refuses(tensors, op)
        if why is not None:
            if self.agent is not None:  # (a subgroup said so when it was made)
                say_once(why, why)
            return self._gloo_call(name, tensors, tensors, opts)

        def run() -> list[torch.Tensor]:
            self.counts["switch:allreduce"] += 1
            for t in tensors:
                self._switch_allreduce(t, op)
            return tensors

        return self._submit(run)

    def _switch_refuses(self, tensors, op) -> str | None:
        """Why these tensors cannot go through the switch with ``op`` (None: they can)."""
        if self.agent is None:
            return ("a subgroup has no homagg job of its own (the switch's job table for a "
                    "subset of ranks needs the controller service): its collectives go to gloo")
        sum_like = op in (ReduceOp.SUM, ReduceOp.AVG)
        for t in tensors:
            if t.device.type != "cpu":
                return f"all_reduce of a {t.device.type} tensor goes to gloo (cpu only)"
            if not sum_like:
                return (f"all_reduce {_op_name(op)} goes to gloo: the switch only adds (SUM "
                        "and AVG go through it)")
            if t.is_sparse:
                if t.dtype not in FLOATS:
                    return f"sparse all_reduce of {t.dtype} goes to gloo: floats only"
                continue
            if t.layout != torch.strided:
                return f"all_reduce of a {t.layout} tensor goes to gloo"
            if t.dtype in FLOATS:
                continue
            if op == ReduceOp.AVG:
                return (f"all_reduce AVG of {t.dtype} goes to gloo: an integer mean is not "
                        "an integer (gloo's answer, or its error, is gloo's)")
            if t.dtype in SMALL_INTS or t.dtype in (torch.int32, torch.int64):
                continue
            return (f"all_reduce SUM of {t.dtype} goes to gloo: the switch sums int32 words "
                    "(floats through the codec, int8/16/32/64 and uint8 exactly)")
        return None

    def _switch_allreduce(self, t: torch.Tensor, op) -> None:
        """One tensor's SUM or AVG through the switch, in place (the agent's thread)."""
        agent = self.agent
        assert agent is not None
        if t.numel() == 0:
            return
        if t.is_sparse:
            t.copy_(self._sparse(t, op))
            return
        src = t.detach().contiguous()
        key = ("torch", str(t.dtype), t.numel())
        if t.dtype in FLOATS:
            if t.dtype == torch.float64:
                say_once("float64", "float64 all_reduce goes through the switch quantized to "
                         "the codec's int32 grid (exact sum of the quantized values, about 31 "
                         "bits below each block's largest value, not float64's 53)")
            if t.dtype == torch.float32 and op == ReduceOp.SUM:  # the hook's path
                out = agent.allreduce(src.numpy().reshape(-1), key=key)
                t.copy_(torch.from_numpy(out).view(t.shape))
                return
            x = src.to(torch.float64).numpy().reshape(-1)  # exact for every float dtype
            s = agent.allreduce(x, key=key)  # float64: exact (int sums times 2**-shift)
            if op == ReduceOp.AVG:
                s = s / agent.cfg.workers
            t.copy_(torch.from_numpy(s).view(t.shape))  # rounded once to t's dtype
            return
        if t.dtype in SMALL_INTS:
            q = src.to(torch.int32).numpy().reshape(-1)
            s = agent.allreduce_int(q)
            t.copy_(torch.from_numpy(s.astype(_np_dtype(t.dtype))).view(t.shape))  # wraps
            return
        x64 = src.numpy().reshape(-1).astype(np.int64)
        if t.dtype == torch.int32:
            try:
                s = agent.transport.stream(wire.OP_ADD, x64.astype(np.int32))
            except SwitchOverflow:  # every rank sees the flag: all take the limbs
                s = _limb_sum(agent, x64, 2).astype(np.int32)
            t.copy_(torch.from_numpy(np.ascontiguousarray(s, np.int32)).view(t.shape))
            return
        t.copy_(torch.from_numpy(_limb_sum(agent, x64, 4)).view(t.shape))

    def _sparse(self, t: torch.Tensor, op) -> torch.Tensor:
        agent = self.agent
        assert agent is not None
        g = t.detach().coalesce()
        sparse_shape = tuple(g.shape[:g.sparse_dim()])
        n_rows = int(np.prod(sparse_shape, dtype=np.int64))
        idx = g.indices().numpy()
        rows = (np.ravel_multi_index(tuple(idx), sparse_shape) if idx.size
                else np.zeros(0, np.int64))
        values = g.values().to(torch.float64).numpy()
        r = agent.allreduce_rows(n_rows, rows, values, key=("torch-sparse", g.shape))
        indices = torch.from_numpy(np.stack(np.unravel_index(r.rows, sparse_shape))
                                   if r.rows.size
                                   else np.zeros((len(sparse_shape), 0), np.int64))
        vals = r.values / agent.cfg.workers if op == ReduceOp.AVG else r.values
        return torch.sparse_coo_tensor(indices, torch.from_numpy(np.ascontiguousarray(vals))
                                       .to(t.dtype), g.shape).coalesce()

    # -- everything else: gloo, from the same thread -------------------------------------------
    def broadcast(self, tensors, opts=None):  # type: ignore[override]
        return self._gloo_call("broadcast", tensors, tensors,
                               opts if opts is not None else dist.BroadcastOptions())

    def reduce(self, tensors, opts=None):  # type: ignore[override]
        return self._gloo_call("reduce", tensors, tensors,
                               opts if opts is not None else dist.ReduceOptions())

    def allgather(self, outputs, inputs, opts=None):
        return self._gloo_call("allgather", outputs, outputs, inputs,
                               opts if opts is not None else AllgatherOptions())

    def allgather_coalesced(self, outputs, inputs, opts=None):
        return self._gloo_call("allgather_coalesced", outputs, outputs, inputs,
                               opts if opts is not None else AllgatherOptions())

    def all_gather_single(self, output, input, opts=None):
        return self._gloo_call("_allgather_base", [output], output, input,
                               opts if opts is not None else AllgatherOptions())

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else AllgatherOptions()

        def run() -> list[torch.Tensor]:
            self.counts["gloo:_allgather_base"] += len(outputs)
            for o, i in zip(outputs, inputs):
                self._gloo._allgather_base(o, i, opts).wait()
            return outputs

        return self._submit(run)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, outputs, inputs, opts=None):  # type: ignore[override]
        flat = [t for ts in outputs for t in ts]
        return self._gloo_call("gather", flat, outputs, inputs,
                               opts if opts is not None else dist.GatherOptions())

    def scatter(self, outputs, inputs, opts=None):  # type: ignore[override]
        return self._gloo_call("scatter", outputs, outputs, inputs,
                               opts if opts is not None else dist.ScatterOptions())

    def reduce_scatter(self, outputs, inputs, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        work = self._switch_scatter(
            lambda: [(o, torch.cat([t.reshape(-1) for t in ins]))
                     for o, ins in zip(outputs, inputs)],
            [t for ins in inputs for t in ins], opts)
        if work is not None:
            return work
        return self._gloo_call("reduce_scatter", outputs, outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        work = self._switch_scatter(lambda: [(output, input.reshape(-1).clone())], [input],
                                    opts)
        if work is not None:
            return work
        return self._gloo_call("_reduce_scatter_base", [output], output, input, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs,
                                        opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        work = self._switch_scatter(
            lambda: [(o, i.reshape(-1).clone()) for o, i in zip(outputs, inputs)], inputs, opts)
        if work is not None:
            return work

        def run() -> list[torch.Tensor]:
            self.counts["gloo:_reduce_scatter_base"] += len(outputs)
            for o, i in zip(outputs, inputs):
                self._gloo._reduce_scatter_base(o, i, opts).wait()
            return outputs

        return self._submit(run)

    def _switch_scatter(self, pairs: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]],
                        inputs: list[torch.Tensor], opts) -> HomaggWork | None:
        """A reduce_scatter through the switch, with HOMAGG_TORCH_REDUCE_SCATTER=switch: an
        all_reduce of the whole input (every rank's part, in rank order, flat), of which this
        rank keeps its part; ``pairs()`` gives (output, flat input copy) pairs. None: it goes
        to gloo (the default, or what the switch cannot serve: said once)."""
        if self.scatter_via != "switch" or self.agent is None:
            return None
        op = _reduce_op(opts)
        why = self._switch_refuses(inputs, op)
        if why is None and any(t.is_sparse for t in inputs):
            why = "a sparse reduce_scatter goes to gloo"
        if why is not None:
            say_once(why, why.replace("all_reduce", "reduce_scatter", 1))
            return None
        todo = pairs()

        def run() -> list[torch.Tensor]:
            self.counts["switch:reduce_scatter"] += 1
            for out, full in todo:
                self._switch_allreduce(full, op)
                out.copy_(full.reshape(self.size(), -1)[self.rank()].view_as(out))
            return [out for out, _ in todo]

        return self._submit(run)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, outputs, inputs, opts=None):
        return self._gloo_call("alltoall", outputs, outputs, inputs,
                               opts if opts is not None else dist.AllToAllOptions())

    def all_to_all_single(self, output, input, output_splits, input_splits,
                          opts=None):
        return self._gloo_call("alltoall_base", [output], output, input, output_splits,
                               input_splits,
                               opts if opts is not None else dist.AllToAllOptions())

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        return self._gloo_call("barrier", [], opts if opts is not None
                               else dist.BarrierOptions())

    # Point-to-point: straight to gloo, on the caller's thread. gloo matches a send with its
    # receive by peer and tag, not by issue order, and the agent's thread, which waits for each
    # collective in turn, would deadlock the usual exchange (both ranks isend, then irecv).
    def send(self, tensors, dst, tag=0):
        self.counts["gloo:send"] += 1
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag=0):
        self.counts["gloo:recv"] += 1
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag=0):
        self.counts["gloo:recv_anysource"] += 1
        return self._gloo.recv_anysource(tensors, tag)


def _op_name(op) -> str:
    return str(op).rsplit(".", 1)[-1]


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def _limb_sum(agent: Agent, x: np.ndarray, limbs: int) -> np.ndarray:
    """The exact sum over workers of int64 ``x``, modulo 2**64 (gloo's wrapping), from
    ``limbs`` int32 sums of 16-bit limbs (the top one signed) in one round."""
    n = x.size
    parts = np.empty((limbs, n), np.int32)
    u = x.view(np.uint64)
    for k in range(limbs - 1):
        parts[k] = ((u >> np.uint64(LIMB_BITS * k)) & np.uint64(0xFFFF)).astype(np.int32)
    parts[limbs - 1] = (x >> np.int64(LIMB_BITS * (limbs - 1))).astype(np.int32)
    if limbs < 4 and np.any(parts[limbs - 1] != x >> np.int64(LIMB_BITS * (limbs - 1))):
        raise AgentError(f"{agent.cfg.who}: a value does not fit {limbs} limbs")
    sums = agent.allreduce_int(parts.reshape(-1)).reshape(limbs, n)
    total = np.zeros(n, np.uint64)
    for k in range(limbs):  # in uint64: wraps modulo 2**64, as gloo's int64 sum does
        total += sums[k].astype(np.int64).view(np.uint64) << np.uint64(LIMB_BITS * k)
    return total.view(np.int64)


def _agent_config(rank: int, size: int, environ: Mapping[str, str] | None = None
                  ) -> AgentConfig:
    """``AgentConfig.from_env`` on the environment with the process group's own rank and
    world size where they matter: RANK and WORLD_SIZE are the group's (what a join through a
    controller service names this member by, whatever the rendezvous was), and they are the
    defaults of HOMAGG_WORKER and HOMAGG_WORKERS (``homagg-net exec`` sets those to the
    switch's job table's numbering, which stands). A job of another size than the group is an
    error (the mean and the scale's headroom divide by it)."""
    env = dict(os.environ if environ is None else environ)
    env["RANK"], env["WORLD_SIZE"] = str(rank), str(size)
    env.setdefault("HOMAGG_WORKER", str(rank))
    env.setdefault("HOMAGG_WORKERS", str(size))
    cfg = AgentConfig.from_env(env, **_options)
    if cfg.workers != size:
        raise AgentError(f"the homagg job has {cfg.workers} workers (HOMAGG_WORKERS) but the "
                         f"process group has {size} ranks: every rank must be a worker of "
                         "the job")
    return cfg


def create(opts, backend_options=None) -> HomaggProcessGroup:
    """The backend's creator (torch's extended API): the default group gets an agent; a
    subgroup is all gloo (see the module doc)."""
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    timeout = opts.timeout
    world = list(getattr(opts, "global_ranks_in_group", []) or [])
    subgroup = dist.is_initialized() or (world and world != list(range(len(world))))
    if not subgroup:
        return HomaggProcessGroup(store, rank, size, timeout,
                                  lambda: Agent(_agent_config(rank, size)))

    def subgroup_agent() -> Agent | None:
        cfg = _subgroup_config(world, rank) if _subgroup_config is not None else None
        if cfg is None:
            say_once("subgroup", f"process group {getattr(opts, 'group_id', '?')} (ranks "
                     f"{world or '?'}) is a subgroup: it has no homagg job of its own (that "
                     "needs the controller service, or homagg.torch.set_subgroup_config), so "
                     "all its collectives go to gloo")
            return None
        if cfg.workers != size:
            raise AgentError(f"subgroup of ranks {world}: its job has {cfg.workers} workers, "
                             f"the group {size} ranks")
        return Agent(cfg)

    return HomaggProcessGroup(store, rank, size, timeout, subgroup_agent)


def register() -> None:
    """Register the "homagg" backend for the cpu device (again: nothing)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu"])
