"""The "homagg" process group: ``HomaggProcessGroup``, what ``dist.init_process_group("homagg")``
makes (``backend`` creates it). Its one agent thread issues every collective in order:
an all_reduce (or, when asked, a reduce_scatter) through the switch (``switch``), the
rest through a gloo group of its own; the rules are in ``backend``'s module doc.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllgatherOptions

from homagg.host_agent.allreduce import Agent
from homagg.host_agent.config import AgentError
from homagg.host_agent.distributed import inner
from homagg.host_agent.distributed.events import (
    profiler_event,
    ready_events,
    wait_inner,
    wait_ready,
)
from homagg.host_agent.distributed.serial import Behind, Serial
from homagg.host_agent.distributed.startup import told
from homagg.host_agent.distributed.switch import (
    CudaStager,
    say_once,
    switch_allreduce,
    switch_refuses,
)
from homagg.host_agent.distributed.untraced import untraced
from homagg.host_agent.distributed.work import HomaggWork
from homagg.host_agent.parts import Parted

#: The backend's name, for ``dist.init_process_group``.
BACKEND = "homagg"


#: The profiler's name of each collective (torch's public names, as gloo's events have them),
#: by the gloo method that serves it.
_OPS = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
        "allgather": "all_gather", "allgather_coalesced": "all_gather_coalesced",
        "_allgather_base": "all_gather_into_tensor", "_reduce_scatter_base":
        "reduce_scatter_tensor", "alltoall": "all_to_all", "alltoall_base": "all_to_all_single"}


def _reduce_op(opts) -> Any:
    op = getattr(opts, "reduceOp", ReduceOp.SUM)
    return getattr(op, "op", op)  # a ReduceOp's RedOpType (SUM, AVG, ...)


@untraced(dist.ProcessGroup)
class HomaggProcessGroup(dist.ProcessGroup):
    """The "homagg" process group: all_reduce through the switch (``Agent``), the rest
    through gloo. ``make_agent`` returns the group's agent; a ``Joining``, which makes it at
    the group's first collective through the switch (a subgroup's join through the
    service); or None: every collective goes to gloo (a subgroup without a job). Every rank
    learns whether every other's agent started (through the store): if one could not, all
    raise at once, instead of the others waiting for it at their first collective."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 make_agent: Callable[[Any], Agent | Joining | None]):
        super().__init__(rank, size)  # type: ignore[call-arg]  # (the stub knows the 3-arg form)
        self.agent: Agent | None = None
        self._joining: Joining | None = None
        self._cpp: Any = None
        self._thread: Serial | None = None
        self._lock = threading.Lock()
        # What this group's own thread issues; a gloo context of its own (``backend``'s doc).
        # The agent's start-up collectives use it too, so it comes first: a group that fails
        # to start has made nothing else to tear down.
        self._gloo: Any = dist.ProcessGroupGloo(dist.PrefixStore("homagg-py/", store), rank,
                                                size, timeout)
        # reduce_scatter SUM/AVG of floats and integers: gloo (the default), or "switch": an
        # all_reduce through the switch of which each rank keeps its part (FSDP's gradients)
        self.scatter_via = os.environ.get("HOMAGG_TORCH_REDUCE_SCATTER") or "gloo"
        if self.scatter_via not in ("gloo", "switch"):
            raise AgentError(f"$HOMAGG_TORCH_REDUCE_SCATTER={self.scatter_via!r}: gloo or "
                             "switch")
        # collectives this group served, "switch:allreduce", "gloo:<gloo's method>" (what C++
        # sends straight to the registered backend is not seen here)
        self.counts: Counter[str] = Counter()
        self._stager = CudaStager()  # CUDA tensors through the switch (their codec on the GPU)
        self._nccl: Any = None
        self._start(make_agent, store)
        # What serves CUDA tensors the switch does not: NCCL where every rank has a GPU of
        # its own, else gloo (``inner``); the ranks decide together
        self.cuda_inner = inner.agree(self._gloo, size)
        if self.cuda_inner == "nccl":
            self._nccl = inner.nccl_group(store, rank, size, timeout)
        # The registered cpu backend: what C++ reaches without going through Python.
        self._cpp = dist.ProcessGroupGloo(dist.PrefixStore("homagg-cpp/", store), rank, size,
                                          timeout)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM,
                               self._cpp)
        if torch.cuda.is_available():  # (gloo serves CUDA tensors too, through the host)
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.CUSTOM,
                                   self._cpp)
        self._thread = Serial("homagg-agent")

    def _start(self, make_agent: Callable[[Any], Agent | Joining | None],
               store: dist.Store) -> None:
        failure: BaseException | None = None
        try:
            got = make_agent(self._gloo)  # (the group's gloo: start-up collectives)
            if isinstance(got, Joining):
                self._joining = got
            else:
                self.agent = got
        except Exception as err:  # noqa: BLE001 - every rank hears of it, then it is raised
            failure = err
        states = told(store, self.rank(), self.size(),
                      2 if failure is not None else 0 if self._has_job() else 1)
        with_agent, without, failed = (states[k] for k in range(3))
        if failed or (with_agent and without):
            self.shutdown()
            self._gloo = None  # torn down now, not when the interpreter exits
            if failure is not None:
                raise failure
            raise AgentError(f"homagg: {failed} rank(s) of this process group could not start "
                             "an agent (their own error says why)" if failed else
                             f"homagg: {with_agent} rank(s) have a homagg job for this group, "
                             f"{without} not: every rank must agree")

    def _has_job(self) -> bool:
        """Whether this group sends through the switch: it has an agent, or makes one."""
        return self.agent is not None or self._joining is not None

    def _switch_agent(self) -> Agent:
        """The group's agent, made now if it is still to be (on the group's thread, at its
        first collective through the switch: every member calls the same one, so their joins
        meet). A join that failed fails every later collective through the switch too."""
        if self.agent is not None:
            return self.agent
        j = self._joining
        assert j is not None  # (``switch_refuses`` sends a group without a job to gloo)
        if j.failed is not None:
            raise AgentError(f"homagg: this group's join failed at its first collective "
                             f"through the switch: {j.failed}")
        try:
            self.agent = j.join()
        except Exception as err:
            j.failed = err
            raise
        return self.agent

    def _part(self) -> int:
        """``AgentConfig.part`` of the group's agent (made or to be)."""
        if self.agent is not None:
            return self.agent.cfg.part
        assert self._joining is not None
        return self._joining.part

    # -- the thread ------------------------------------------------------------------------------
    def _submit(self, run: Callable[..., list[torch.Tensor]], op: str,
                devices: Iterable[torch.device] = (), offer=None,
                inputs: Iterable[Any] = ()) -> HomaggWork:
        """``run`` on the group's thread, in issue order; a profiler event ``homagg:<op>``
        spans it from this call to its completion, as gloo's and NCCL's events do, with
        ``inputs`` (the collective's input tensors, as gloo's events have them) as its inputs:
        their shapes and dtypes where the profiler records shapes. The event ends on the
        group's thread before the future completes, so a waiter never goes on (and stops a
        profiler) under it. With CUDA ``devices``, the future is CUDA-aware: it records an
        event on the thread's current stream when ``run`` is done, and whoever waits on it has
        its own stream wait for that event (NCCL's semantics). ``offer``: the host tensor and
        key of a one-tensor all-reduce, which the job in front may send ahead (``serial``);
        ``run`` then takes the jobs behind it as its pipeline."""
        cuda: list[Any] = sorted(devices, key=str)
        fut: torch.futures.Future = torch.futures.Future(devices=cuda) if cuda \
            else torch.futures.Future()
        event = profiler_event(op, inputs)

        def job(behind: Behind | None = None) -> None:
            try:
                try:
                    with torch.no_grad():  # outputs are written as gloo's C++ does: no autograd
                        result = run() if offer is None else run(behind)
                finally:
                    event.__exit__(None, None, None)
            except BaseException as err:  # noqa: BLE001 - raised where the work is waited on
                fut.set_exception(err)
                return
            fut.set_result(result)

        event.__enter__()
        try:
            with self._lock:
                if self._thread is None:
                    raise RuntimeError("homagg: the process group is shut down")
                self._thread.submit(job if offer is None else _Offered(job, offer))
        except BaseException:
            event.__exit__(None, None, None)
            raise
        return HomaggWork(fut)

    def _gloo_call(self, name: str, outputs: list[torch.Tensor], inputs: Any,
                   *args) -> HomaggWork:
        """gloo's (or NCCL's: ``_inner``) ``name`` with ``args``, on the group's thread;
        ``inputs``: the collective's input tensors, for its profiler event."""
        ready = ready_events(outputs, args)

        group, which = self._inner(ready)

        def run() -> list[torch.Tensor]:
            wait_ready(ready)
            self.counts[f"{which}:{name}"] += 1
            wait_inner(getattr(group, name)(*args), ready)  # (CUDA: this thread's stream waits)
            return outputs

        return self._submit(run, _OPS.get(name, name), ready, inputs=inputs)

    def _inner(self, ready: dict) -> tuple[Any, str]:
        """The group that serves a collective the switch does not, and its name: NCCL for
        CUDA tensors where the ranks chose it (``inner``), else gloo."""
        if ready and self._nccl is not None:
            return self._nccl, "nccl"
        return self._gloo, "gloo"

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
        for g in (self._gloo, self._nccl, self._cpp):
            if g is None:
                continue
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
            return self._gloo_call("allreduce", tensors, tensors, tensors, opts)
        return self._allreduce_each("allreduce", tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._allreduce_each("allreduce_coalesced", list(tensors), opts)

    def _allreduce_each(self, name: str, tensors, opts) -> HomaggWork:
        """Each tensor's own sum, through the switch, or all of them through gloo's ``name``."""
        op = _reduce_op(opts)
        why = switch_refuses(self._has_job(), tensors, op)
        if why is not None:
            if self._has_job():  # (a subgroup without a job said so when it was made)
                say_once(why, why)
            return self._gloo_call(name, tensors, tensors, tensors, opts)
        if len(tensors) == 1 and _pipelines(tensors[0], op):
            return self._allreduce_pipelined(name, tensors)
        # CUDA tensors: the collective waits for the stream that produced them (an event
        # recorded now, on the caller's current stream), as NCCL's does
        ready = {d: self._stager.ready(d) for d in {t.device for t in tensors
                                                    if t.device.type == "cuda"}}

        def run() -> list[torch.Tensor]:
            agent = self._switch_agent()
            self.counts["switch:allreduce"] += 1
            for t in tensors:
                if t.device.type == "cuda":
                    self.counts["switch:allreduce cuda"] += 1
                    self._stager.allreduce(agent, t, op, ready[t.device])
                else:
                    switch_allreduce(agent, t, op)
            return tensors

        return self._submit(run, _OPS[name], ready, inputs=tensors)

    def _allreduce_pipelined(self, name: str, tensors) -> HomaggWork:
        """A contiguous CPU float32 tensor's SUM, in place (``switch_allreduce``'s path), as
        a job that may go ahead of its turn: its round 1 with the values of the all-reduce
        in front of it (``host_agent.pipeline``), and the one behind it likewise. A long
        tensor goes part by part (``host_agent.parts``: the memory of one part)."""
        t = tensors[0]
        arr = t.detach().numpy().reshape(-1)  # (t's own memory: the sum is written there)
        parted = Parted(arr, ("torch", str(t.dtype), t.numel()), self._part())

        def run(behind: Behind | None) -> list[torch.Tensor]:
            agent = self._switch_agent()
            self.counts["switch:allreduce"] += 1
            parted.allreduce(agent, behind, pipelined=behind is not None)
            return tensors

        return self._submit(run, _OPS[name], (), offer=parted.first(), inputs=tensors)

    # -- everything else: gloo, from the same thread -------------------------------------------
    def broadcast(self, tensors, opts=None):  # type: ignore[override]
        return self._gloo_call("broadcast", tensors, tensors, tensors,
                               opts if opts is not None else dist.BroadcastOptions())

    def reduce(self, tensors, opts=None):  # type: ignore[override]
        return self._gloo_call("reduce", tensors, tensors, tensors,
                               opts if opts is not None else dist.ReduceOptions())

    def allgather(self, outputs, inputs, opts=None):
        return self._gloo_call("allgather", outputs, inputs, outputs, inputs,
                               opts if opts is not None else AllgatherOptions())

    def allgather_coalesced(self, outputs, inputs, opts=None):
        return self._gloo_call("allgather_coalesced", outputs, inputs, outputs, inputs,
                               opts if opts is not None else AllgatherOptions())

    def all_gather_single(self, output, input, opts=None):
        return self._gloo_call("_allgather_base", [output], [input], output, input,
                               opts if opts is not None else AllgatherOptions())

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else AllgatherOptions()
        ready = ready_events(outputs, inputs)

        group, which = self._inner(ready)

        def run() -> list[torch.Tensor]:
            wait_ready(ready)
            self.counts[f"{which}:_allgather_base"] += len(outputs)
            for o, i in zip(outputs, inputs):
                wait_inner(group._allgather_base(o, i, opts), ready)
            return outputs

        return self._submit(run, "all_gather_into_tensor_coalesced", ready, inputs=inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, outputs, inputs, opts=None):  # type: ignore[override]
        flat = [t for ts in outputs for t in ts]
        return self._gloo_call("gather", flat, inputs, outputs, inputs,
                               opts if opts is not None else dist.GatherOptions())

    def scatter(self, outputs, inputs, opts=None):  # type: ignore[override]
        return self._gloo_call("scatter", outputs, inputs, outputs, inputs,
                               opts if opts is not None else dist.ScatterOptions())

    def reduce_scatter(self, outputs, inputs, opts=None):  # type: ignore[override]
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        work = self._switch_scatter(
            lambda: [(o, torch.cat([t.reshape(-1) for t in ins]))
                     for o, ins in zip(outputs, inputs)],
            [t for ins in inputs for t in ins], opts)
        if work is not None:
            return work
        return self._gloo_call("reduce_scatter", outputs, inputs, outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        work = self._switch_scatter(lambda: [(output, input.reshape(-1).clone())], [input],
                                    opts)
        if work is not None:
            return work
        return self._gloo_call("_reduce_scatter_base", [output], [input], output, input,
                               opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs,
                                        opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        work = self._switch_scatter(
            lambda: [(o, i.reshape(-1).clone()) for o, i in zip(outputs, inputs)], inputs, opts)
        if work is not None:
            return work

        ready = ready_events(outputs, inputs)

        group, which = self._inner(ready)

        def run() -> list[torch.Tensor]:
            wait_ready(ready)
            self.counts[f"{which}:_reduce_scatter_base"] += len(outputs)
            for o, i in zip(outputs, inputs):
                wait_inner(group._reduce_scatter_base(o, i, opts), ready)
            return outputs

        return self._submit(run, "reduce_scatter_tensor_coalesced", ready, inputs=inputs)

    def _switch_scatter(self, pairs: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]],
                        inputs: list[torch.Tensor], opts) -> HomaggWork | None:
        """A reduce_scatter through the switch, with HOMAGG_TORCH_REDUCE_SCATTER=switch: an
        all_reduce of the whole input (every rank's part, in rank order, flat), of which this
        rank keeps its part; ``pairs()`` gives (output, flat input copy) pairs. None: it goes
        to gloo (the default, or what the switch cannot serve: said once)."""
        if self.scatter_via != "switch" or not self._has_job():
            return None
        op = _reduce_op(opts)
        why = switch_refuses(True, inputs, op)  # (a group without a job returned above)
        if why is None and any(t.is_sparse for t in inputs):
            why = "a sparse reduce_scatter goes to gloo"
        if why is not None:
            say_once(why, why.replace("all_reduce", "reduce_scatter", 1))
            return None
        todo = pairs()
        ready = ready_events([full for _, full in todo], [out for out, _ in todo])

        def run() -> list[torch.Tensor]:
            agent = self._switch_agent()
            self.counts["switch:reduce_scatter"] += 1
            for out, full in todo:
                if full.device.type == "cuda":
                    self._stager.allreduce(agent, full, op, ready[full.device])
                else:
                    switch_allreduce(agent, full, op)
                out.copy_(full.reshape(self.size(), -1)[self.rank()].view_as(out))
            return [out for out, _ in todo]

        return self._submit(run, "reduce_scatter", ready, inputs=inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, outputs, inputs, opts=None):
        return self._gloo_call("alltoall", outputs, inputs, outputs, inputs,
                               opts if opts is not None else dist.AllToAllOptions())

    def all_to_all_single(self, output, input, output_splits, input_splits,
                          opts=None):
        return self._gloo_call("alltoall_base", [output], [input], output, input,
                               output_splits,
                               input_splits,
                               opts if opts is not None else dist.AllToAllOptions())

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        return self._gloo_call("barrier", [], [], opts if opts is not None
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


class Joining:
    """A group's agent to be made at its first collective through the switch: ``join()``
    makes it (a subgroup's join through the controller service, which waits for the
    subgroup's other members). ``part``: its ``AgentConfig.part``, known before (a tensor is
    cut when its collective is called)."""

    def __init__(self, join: Callable[[], Agent], part: int):
        self.join, self.part = join, part
        self.failed: BaseException | None = None


class _Offered:
    """A job of the group's thread that offers its tensor to the job in front
    (``serial.Offering``)."""

    def __init__(self, job: Callable[[Behind | None], None], offer: tuple):
        self.job, self._offer = job, offer

    def offer(self) -> tuple:
        return self._offer

    def run(self, behind: Behind | None) -> None:
        self.job(behind)


def _pipelines(t: torch.Tensor, op) -> bool:
    """A tensor whose all-reduce pipelines: a non-empty, contiguous, dense CPU float32 SUM."""
    return (op == ReduceOp.SUM and t.device.type == "cpu" and t.dtype == torch.float32
            and t.layout == torch.strided and t.is_contiguous() and t.numel() > 0)
