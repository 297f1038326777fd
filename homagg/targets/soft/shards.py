"""The software aggregator on several cores: ``ShardedSwitch``, its data plane in N processes.

Python threads would share one core (the GIL: the per-packet path holds it), so each shard is a
process with a switch model of its own, serving every port of the aggregator on sockets of its
own: shard k's socket is the k-th of each port's SO_REUSEPORT group. A slot's state must see
every worker's packet for that slot, so the kernel must not pick the shard by sender (the
reuseport hash of the 4-tuple); nor can it pick by slot: a worker sends a round as one GSO run
(``homagg.udpio``) and the kernel steers a run whole, by its first datagram. A run carries one
job (each sender is one job's worker, or a child job's uplink port), so the kernel steers by
job: a classic-BPF reuseport program (SO_ATTACH_REUSEPORT_CBPF), which sees the datagram from
the UDP payload's first byte, loads the header's job field and returns the index of the shard
that owns that job.

The main process keeps the authoritative tables (``SoftSwitch``: P4Runtime and the controller
in process write there) and, on every write, gives each shard its jobs, whole, over a pipe, and
steers the jobs anew; a write returns once every shard has it. A job keeps its shard for the
life of the pipeline (its slots, join state and counters stay there); a new one goes to the
shard with the fewest jobs. A tree's child job shares a shard with the parent's job id (the
parent's answers carry it). Counters read back are the sum over the shards; a counter write
sets shard 0's cell and zeroes the others'; a pipeline load empties every shard.

    sw = ShardedSwitch(shards=2)
    with SoftSwitchServer(sw, ("127.0.0.1", 0)) as server:   # starts the shard processes
        install(sw, 1, workers, slots=16)                       # reaches shard 0 or 1
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import signal
import socket
import struct
import threading
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from homagg import _p4consts as P4
from homagg import wire
from homagg.faults import FaultSpec
from homagg.targets.soft.server import SoftSwitchError, SoftSwitchServer
from homagg.targets.soft.tables import SoftSwitch

log = logging.getLogger("homagg.softswitch")

#: linux/socket.h (asm-generic): not in Python's socket module
SO_ATTACH_REUSEPORT_CBPF = 51
# linux/filter.h: classic BPF opcodes
_LDH_ABS = 0x00 | 0x08 | 0x20  # BPF_LD | BPF_H | BPF_ABS: A = 16 bits at k (network order)
_JEQ_K = 0x05 | 0x10  # BPF_JMP | BPF_JEQ | BPF_K
_MOD_K = 0x04 | 0x90  # BPF_ALU | BPF_MOD | BPF_K
_RET_K, _RET_A = 0x06, 0x06 | 0x10
_MAX_INSNS = 4096  # BPF_MAXINSNS
_JOB_AT = wire.OFFSETS["job"]
#: How long the main process waits for a shard to answer a write or a read (s).
_ANSWER_WAIT = 10.0
MAX_SHARDS = 64


def steering_program(owner: dict[int, int], shards: int) -> list[tuple[int, int, int, int]]:
    """The classic-BPF reuseport program: (code, jt, jf, k) instructions that return the shard
    of a datagram's job field, ``owner``'s, else the job id modulo ``shards`` (a job not here:
    any shard drops it and counts it). A datagram too short for the field goes to shard 0."""
    code = [(_LDH_ABS, 0, 0, _JOB_AT)]
    for job, shard in sorted(owner.items()):
        if job % shards != shard:
            code += [(_JEQ_K, 0, 1, job), (_RET_K, 0, 0, shard)]
    code += [(_MOD_K, 0, 0, shards), (_RET_A, 0, 0, 0)]
    if len(code) > _MAX_INSNS:
        raise SoftSwitchError(f"{len(owner)} job ids to steer: beyond a classic BPF program "
                              f"({_MAX_INSNS} instructions)")
    return code


def attach_program(sock: socket.socket, code: list[tuple[int, int, int, int]]) -> None:
    """Make ``code`` the reuseport program of ``sock``'s group (replacing any)."""
    import ctypes

    insns = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in code))
    fprog = struct.pack("HL", len(code), ctypes.addressof(insns))  # struct sock_fprog
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)


class ShardedSwitch(SoftSwitch):
    """A ``SoftSwitch`` whose data plane runs in ``shards`` processes (module docstring),
    started and stopped by the ``SoftSwitchServer`` that serves it. Until then, and after,
    the tables are here alone (the counters, after: the shards' last)."""

    def __init__(self, slots: int = wire.SLOTS, words: int = wire.WORDS_PER_PACKET,
                 shards: int = 2):
        if not 1 <= shards <= MAX_SHARDS:
            raise SoftSwitchError(f"{shards} shards: 1 to {MAX_SHARDS}")
        self.shards = shards
        self._conns: list[Connection] = []
        self._steer_socks: list[socket.socket] = []
        #: job id (the header's job field) -> its shard, for the life of the pipeline
        self.owner: dict[int, int] = {}
        #: the steering program the reuseport groups run (None: none attached yet)
        self._steering: list[tuple[int, int, int, int]] | None = None
        self._last_io: dict[str, int] = {}
        super().__init__(slots, words)
        self.lock = threading.RLock()  # type: ignore[assignment]  # (hooks run under it)

    # -- the shards, from the server ----------------------------------------------------------
    def attach(self, conns: list[Connection], steer: list[socket.socket]) -> None:
        """The shards are up (``conns``: their pipes, in shard order; ``steer``: a socket of
        each port's reuseport group): give them the jobs and the counters written so far."""
        with self.lock:
            self._conns, self._steer_socks, self._steering = conns, steer, None
            m = self.model
            self._call([("counts_set", m.stats, m.job_stats) if k == 0 else ("fresh",)
                        for k in range(self.shards)])
            self._push_jobs()

    def detach(self) -> None:
        """The shards stop: keep their last counters here, then tell them to end."""
        with self.lock:
            if not self._conns:
                return
            try:
                self.model.stats[:], self.model.job_stats[:], self._last_io = self._counts_io()
            except SoftSwitchError as e:
                log.warning("the shards' last counters are lost: %s", e)
            for conn in self._conns:
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
            self._conns, self._steer_socks, self._steering = [], [], None

    def _call(self, msgs: list[tuple]) -> list[Any]:
        """msgs[k] to shard k, all at once; their answers, in shard order."""
        try:
            for conn, msg in zip(self._conns, msgs):
                conn.send(msg)
            out = []
            for k, conn in enumerate(self._conns):
                if not conn.poll(_ANSWER_WAIT):
                    raise SoftSwitchError(f"aggregator shard {k} does not answer "
                                          f"({_ANSWER_WAIT:.0f} s)")
                ok, value = conn.recv()
                if not ok:
                    raise SoftSwitchError(f"aggregator shard {k}: {value}")
                out.append(value)
            return out
        except (OSError, EOFError) as e:
            raise SoftSwitchError(f"an aggregator shard is gone ({e or type(e).__name__})"
                                  ) from None

    # -- jobs: placed, pushed, steered -----------------------------------------------------------
    def _sync_jobs(self) -> None:
        super()._sync_jobs()
        self._place()
        if self._conns:
            self._push_jobs()

    def _place(self) -> None:
        """Give every job (and every parent job id a child job here answers to) its shard:
        a job's is the one it had; a child job's is its parent job id's; new ones, together,
        go to the shard with the fewest jobs."""
        m = self.model
        up: dict[int, int] = {}  # union-find over job ids

        def root(v: int) -> int:
            while up.get(v, v) != v:
                v = up[v]
            return v

        for v in m.jobs:
            up.setdefault(v, v)
        for (_, parent_job, _), child in m.children_of.items():
            up.setdefault(parent_job, parent_job)
            a, b = root(parent_job), root(child.id)
            if a != b:
                up[max(a, b)] = min(a, b)
        groups: dict[int, list[int]] = {}
        for v in sorted(up):
            groups.setdefault(root(v), []).append(v)
        load = [0] * self.shards
        for v in m.jobs:
            if v in self.owner:
                load[self.owner[v]] += 1
        for members in groups.values():
            had = sorted({self.owner[v] for v in members if v in self.owner})
            shard = had[0] if had else min(range(self.shards), key=lambda k: (load[k], k))
            load[shard] += sum(1 for v in members if v in m.jobs and v not in self.owner)
            if len(had) > 1:  # two placed jobs now share a parent job id: one moves
                log.warning("jobs %s move to aggregator shard %d (a child job answers to a "
                            "parent job id of another's shard): rounds in flight there start "
                            "over", members, shard)
            for v in members:
                self.owner[v] = shard

    def _push_jobs(self) -> None:
        m = self.model
        jobs: list[list] = [[] for _ in range(self.shards)]
        children: list[dict] = [{} for _ in range(self.shards)]
        for job in m.jobs.values():
            jobs[self.owner[job.id]].append(job)
        for key, job in m.children_of.items():
            children[self.owner[job.id]][key] = job.id
        self._call([("jobs", jobs[k], children[k], self.uplink_ports)
                    for k in range(self.shards)])
        code = steering_program(self.owner, self.shards)
        if code != self._steering:  # (a table write seldom moves a job: most keep the program)
            for sock in self._steer_socks:
                attach_program(sock, code)
            self._steering = code

    def reset_pipeline(self) -> None:
        with self.lock:
            self._fresh()
            self.owner = {}
            if self._conns:
                self._call([("fresh",)] * self.shards)
                self._push_jobs()

    # -- counters: the sum over the shards ------------------------------------------------------
    def _counts_io(self) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
        stats, job_stats = np.zeros_like(self.model.stats), np.zeros_like(self.model.job_stats)
        io: dict[str, int] = {}
        for s, j, i in self._call([("counts",)] * self.shards):
            stats += s
            job_stats += j
            for name, n in i.items():
                io[name] = io.get(name, 0) + n
        return stats, job_stats, io

    def _counts(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._conns:
            return super()._counts()
        return self._counts_io()[:2]

    def _counter_written(self, name: str, index: int | None, packets: int) -> None:
        if self._conns and name in (P4.COUNTER_STATS, P4.COUNTER_JOB_STATS):
            self._call([("counter", name, index, packets if k == 0 else 0)
                        for k in range(self.shards)])

    def io_counts(self) -> dict[str, int]:
        """The shards' sockets' system calls and datagrams, summed (``udpio.io_counts``)."""
        with self.lock:
            return self._counts_io()[2] if self._conns else dict(self._last_io)

    def start_processes(self, socks: list[dict[int, socket.socket]],
                        faults: FaultSpec | None = None, engine: str = "auto") -> list:
        """``start``: what the ``SoftSwitchServer`` serving this switch calls."""
        return start(self, socks, faults, engine)

    def stop_processes(self, procs: list) -> None:
        """``stop``: what the ``SoftSwitchServer`` serving this switch calls."""
        stop(self, procs)


# -- the shard processes ---------------------------------------------------------------------
def start(switch: ShardedSwitch, socks: list[dict[int, socket.socket]],
          faults: FaultSpec | None = None, engine: str = "auto") -> list:
    """One process per shard, serving ``socks[k]`` (port -> its socket of the port's
    reuseport group); returns the processes once ``switch`` has given them its state."""
    ctx = multiprocessing.get_context("spawn")  # (forking a process with threads is unsafe)
    level = logging.getLogger().getEffectiveLevel()
    procs, conns = [], []
    try:
        for k, mine in enumerate(socks):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_shard_main, name=f"homagg-softswitch-shard{k}",
                            args=(k, mine, there, switch.slots, switch.words, faults, level,
                                  engine),
                            daemon=True)
            p.start()
            there.close()
            procs.append(p)
            conns.append(here)
        switch.attach(conns, [socks[0][port] for port in socks[0]])
    except BaseException:
        stop(switch, procs)
        for conn in conns:
            conn.close()
        raise
    return procs


def stop(switch: ShardedSwitch, procs: list) -> None:
    switch.detach()
    for p in procs:
        p.join(2)
        if p.is_alive():
            p.terminate()
            p.join(1)


def _shard_main(index: int, socks: dict[int, socket.socket], conn: Connection, slots: int,
                words: int, faults: FaultSpec | None, level: int, engine: str = "auto") -> None:
    """A shard: its switch model on its sockets, told its jobs over ``conn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process stops the shards
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logging.basicConfig(level=level, format=f"%(asctime)s %(name)s[{index}]: %(message)s")
    sw = SoftSwitch(slots, words)
    if faults is not None:  # each shard its own draw
        faults = dataclasses.replace(faults, seed=faults.seed + 7919 * index)
    server = SoftSwitchServer.on_sockets(sw, socks, faults, engine)

    def control() -> None:
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "stop":
                    server.request_stop()
                    return
                try:
                    conn.send((True, _apply(sw, server, msg)))
                except Exception as e:  # noqa: BLE001 - the main process raises it
                    conn.send((False, f"{type(e).__name__}: {e}"))
        except (EOFError, OSError):  # the main process is gone
            server.request_stop()

    try:
        server.serve((conn.fileno(), control))
    finally:
        for s in server.socks.values():
            s.close()


def _apply(sw: SoftSwitch, server: SoftSwitchServer, msg: tuple) -> Any:
    """A message from the main process, in a shard; what to answer."""
    op, m = msg[0], sw.model
    if op == "jobs":  # what SoftSwitch._sync_jobs does, with this shard's jobs
        _, jobs, children, uplink_ports = msg
        for old in list(m.jobs):
            m.uninstall(old)
        for job in jobs:
            m.install(job)
        m.children_of = {key: m.jobs[j] for key, j in children.items()}
        sw.uplink_ports = uplink_ports
        if sw.native is not None:  # (its uplinks' ports too)
            sw.native.jobs_changed(m)
    elif op == "counts":
        return m.stats.copy(), m.job_stats.copy(), server.io_counts()
    elif op == "counts_set":
        m.stats[:], m.job_stats[:] = msg[1], msg[2]
    elif op == "counter":
        _, name, index, packets = msg
        cells = m.stats if name == P4.COUNTER_STATS else m.job_stats
        cells[slice(None) if index is None else index] = packets
    elif op == "fresh":
        sw.reset_pipeline()
    else:
        raise ValueError(f"unknown message {op!r}")
    return None
