"""The software aggregator's native engine: ``NativeLoop`` runs a server's datagram loop in C
(homagg/native/soft_loop.c), with the GIL released, on the switch model's own state.

The loop takes the common packets whole: a job's worker adding into a slot, its round's result
sent to the job's workers when it completes (or a tree's child job's partial sum to its
parent), and a parent's final result for a child job, multicast to its workers. Every other
packet (a join, a refusal, a retransmission, a status, an unknown sender, a malformed packet)
it hands back untouched, and the switch model decides it in Python (``SoftSwitch.handle``);
then the loop goes on after it. So the model stays the one authority on the protocol, and
both engines decide the same packets in the same order.

What the loop shares with the model, and how it stays current:
- the slot memory and the counters, in place: the model's registers become numpy arrays
  (``SlotMemory.shared``) when the loop binds to it, and again whenever the pipeline reloads;
- a copy of the job table, pushed whole on every change (``SwitchCore.jobs_changed``);
- one lock: the switch's lock also takes the loop's mutex (``_BothLock``), so a table write,
  a counter read or a Python decision never meets the loop inside a run.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import numpy as np

from homagg import native
from homagg.netconfig import int_ip, ip_int
from homagg.switch_model import SwitchModel
from homagg.switch_model.state import Cells

if TYPE_CHECKING:
    from homagg.targets.soft.tables import SoftSwitch

log = logging.getLogger("homagg.softswitch")

IDLE, SLOW, CONTROL = 0, 1, 2  # soft_loop.c's hx_serve answers
JOB_COLS = 16  # soft_loop.c's HX_JOB_COLS: a job row's columns


def available() -> bool:
    """Whether the native library is built and not turned off."""
    return native.load() is not None


def why() -> str:
    return native.why()


class _BothLock:
    """The switch's lock, then the native loop's mutex (released in the other order): what
    holds the switch's state still for Python holds it still for the loop too."""

    def __init__(self, inner, lib, ctx):
        self.inner, self._lib, self._ctx = inner, lib, ctx

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self.inner.acquire(blocking, timeout):
            return False
        self._lib.hx_lock(self._ctx)  # (ctypes lets the GIL go while it waits)
        return True

    def release(self) -> None:
        self._lib.hx_unlock(self._ctx)
        self.inner.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class NativeLoop:
    """The C loop over ``fds`` (the sockets of ``ports``, in order) for ``switch``;
    ``control``: a descriptor the loop also waits on (a shard's pipe), or None."""

    def __init__(self, switch: SoftSwitch, fds: list[int], ports: list[int],
                 control: int | None = None):
        lib = native.load()
        if lib is None:
            raise RuntimeError(f"the native data path is off: {native.why()}")
        self.lib, self.switch, self.ports = lib, switch, list(ports)
        self._unserved: set[int] = set()  # uplink src_ports warned about
        self.ctx = lib.hx_new()
        if not self.ctx:
            raise MemoryError("hx_new")
        arr = (ctypes.c_int32 * len(fds))(*fds)
        rc = lib.hx_set_sockets(self.ctx, arr, len(fds), -1 if control is None else control)
        if rc < 0:
            lib.hx_free(self.ctx)
            raise OSError(-rc, f"native loop: cannot wait on the sockets: errno {-rc}")
        self._data = ctypes.c_void_p()
        self._ip = ctypes.c_uint32()
        self._port = ctypes.c_uint16()
        with switch.lock:
            self._inner = switch.lock
            switch.lock = _BothLock(self._inner, lib, self.ctx)  # type: ignore[assignment]
            switch.native = self
            self.bind(switch.model)
        self._closed = False

    # -- the model's state ---------------------------------------------------------------------
    def bind(self, model: SwitchModel) -> None:
        """Share ``model``'s state (called with the switch's lock held: at start, and by
        ``SoftSwitch._fresh`` when the pipeline reloads)."""
        lib, ctx = self.lib, self.ctx
        lib.hx_lock(ctx)
        try:
            if not isinstance(model.mem.seen, Cells):
                model.mem = model.mem.shared()
            m = model.mem
            cells = [getattr(m, n).array for n in ("seen", "count", "tag", "op", "epoch", "gen",
                                                   "final", "overflow")]
            arrays = cells + [m.words, model.stats, model.job_stats]
            for a in arrays:
                assert a.flags.c_contiguous
            self._mem = arrays
            lib.hx_set_memory(ctx, 2 * model.slots, model.k,
                              *[a.ctypes.data for a in arrays])
            model.jobs_changed = self.jobs_changed
            self.jobs_changed(model)
        finally:
            lib.hx_unlock(ctx)

    def jobs_changed(self, model) -> None:
        """Push ``model``'s job table to the loop, whole."""
        jobs: list[tuple] = []
        senders: list[tuple] = []
        res: list[tuple[int, int]] = []
        for row, job in enumerate(model.jobs.values()):
            addrs = job.result_addresses
            jobs.append((job.id, job.auth, job.base, job.size, job.epoch, len(job.workers),
                         1, len(res), len(addrs)) + self._uplink(job))
            res += [(ip_int(a[0]), a[1]) for a in addrs]
            senders += [(ip_int(ip), port, row, w) for w, (ip, port) in enumerate(job.workers)]
        j = np.array(jobs or [(0,) * JOB_COLS], np.int64)
        assert j.shape[1] == self.lib.hx_job_cols()
        # admission.p4's parents table: whose results reach which job
        rows = {job.id: row for row, job in enumerate(model.jobs.values())}
        parents = [(ip_int(a[0]), a[1], pjob, pauth, rows[job.id])
                   for (a, pjob, pauth), job in model.children_of.items() if job.id in rows]
        q = np.array(parents or [(0,) * 5], np.int64)
        s = np.array(senders or [(0,) * 4], np.int64)
        r = np.array(res or [(0, 0)], np.int64)
        self.lib.hx_lock(self.ctx)
        try:
            rc = self.lib.hx_set_jobs(self.ctx, j.ctypes.data, len(jobs), s.ctypes.data,
                                      len(senders), r.ctypes.data, len(res))
            if rc == 0:
                rc = self.lib.hx_set_parents(self.ctx, q.ctypes.data, len(parents))
        finally:
            self.lib.hx_unlock(self.ctx)
        if rc < 0:
            raise MemoryError("native loop: cannot copy the job table")

    def _uplink(self, job) -> tuple[int, ...]:
        """A job row's uplink columns (soft_loop.c's hx_job): where its partial sums go, and
        from which port (the server's rule, ``SoftSwitchServer._send_up``)."""
        up = job.uplink
        if up is None:
            return (0, 0, 0, 0, 0, 0, -1)
        src = self.switch.uplink_ports.get(up.parent, {}).get(up.job)
        fdi = self.ports.index(src) if src in self.ports else -1
        if src is not None and fdi < 0 and src not in self._unserved:
            self._unserved.add(src)
            log.warning("an uplink's src_port %d is not served here (ports %s): its partials "
                        "leave from the port their requests came to, where the parent does not "
                        "know them", src, self.ports)
        return (1, up.job, up.worker, up.auth, ip_int(up.parent[0]), up.parent[1], fdi)

    # -- serving -------------------------------------------------------------------------------
    def serve(self, timeout_ms: int) -> int:
        """One wait of the loop (the GIL released): IDLE, SLOW (``slow()`` has the packet), or
        CONTROL."""
        rc = self.lib.hx_serve(self.ctx, timeout_ms)
        if rc < 0:
            raise OSError(-rc, f"native loop: wait failed: errno {-rc}")
        return rc

    def slow(self) -> tuple[bytes, tuple[str, int], int]:
        """The packet the last ``serve`` handed over: (its bytes, its source, the index of the
        port it came to)."""
        n = self.lib.hx_slow(self.ctx, ctypes.byref(self._data), ctypes.byref(self._ip),
                             ctypes.byref(self._port))
        data = ctypes.string_at(self._data.value or 0, n) if n else b""
        src = (int_ip(self._ip.value), self._port.value)
        return data, src, self.lib.hx_slow_port(self.ctx)

    def io_counts(self) -> dict[str, int]:
        """The loop's system calls and datagrams each way (``udpio.io_counts``' names), the
        datagrams it dropped on a full send buffer, the packets it decided itself (``taken``:
        not handed to the model), and the messages it sent (``send_runs``: a GSO run each)."""
        out = (ctypes.c_int64 * 7)()
        self.lib.hx_io_counts(self.ctx, out)
        return dict(zip(("send_calls", "sent", "recv_calls", "received", "send_dropped",
                         "taken", "send_runs"), out))

    @property
    def gso(self) -> bool:
        return bool(self.lib.hx_gso(self.ctx))

    def close(self) -> None:
        """Give the switch its own lock and list registers back; free the loop."""
        if self._closed:
            return
        self._closed = True
        sw = self.switch
        with self._inner:
            sw.lock = self._inner
            sw.native = None
            sw.model.jobs_changed = None
            self.lib.hx_free(self.ctx)
            self.ctx = None

