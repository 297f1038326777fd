"""homagg-ctl serve: the controller as a service, where workers join their jobs by themselves.

A worker asks to join a job by name (what torchrun gives all its ranks alike), with its rank,
the world size and its UDP port; its address is the one the service sees the request come
from. When every rank has joined, the job is placed as ``homagg-ctl job add`` would place it
(``placement.Fabric``: the switch while its slots last, else the fallback), written to the
switch, and every rank is answered at once. Workers then renew a lease; a job with a worker
whose lease ran out is removed and its slots freed, as is a job whose workers have all left.

The switch stays the source of truth. The jobs this service placed are marked on each place
in a spare cell of the STATS counter (``SERVICE_JOBS_CELL``: a bitmask of job ids, as its
packet count; P4Runtime can write counters, and they outlive this process), so a restarted
service reads them back from the switch's tables and serves their leases again, while jobs
the operator installed with the CLI are never touched. The data path never needs the
service: running jobs keep running while it is down.

Switch sessions are opened per operation (with the service's own election id, above the
CLI's default), so ``homagg-ctl`` keeps working against the same switch.

``JobService`` is the logic, with plain arguments and ``Refusal`` errors (tests drive it
directly); ``serve`` puts it behind gRPC (``homagg/membership/membership.proto``).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

from homagg import _p4consts as P4
from homagg import wire
from homagg.controller import jobs as J
from homagg.controller import placement as P
from homagg.controller.p4client import CounterValue, SwitchError
from homagg.controller.switch import Switch
from homagg.errors import HomaggError, JobError
from homagg.netconfig import Config, Worker, validate_job
from homagg.regions import NoFreeRegion, allocate_region

log = logging.getLogger("homagg.service")

#: The STATS counter cell that marks the jobs the service placed on a place: a bitmask of job
#: ids in its packet count. The data plane counts nothing there (its STAT_* and DROP_* end at
#: 20; EPOCH_STORE is 31); p4/include/constants.p4 notes the reservation.
SERVICE_JOBS_CELL = 30
NO_MAC = "00:00:00:00:00:00"


class Refusal(HomaggError):
    """A request the service will not carry out: ``code`` is a gRPC status code name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ServeOptions:
    token: str | None = None      # None: no token asked for (the operator said --no-token)
    lease: float = 15.0           # seconds a worker's lease lasts without a renewal
    slots: int = 64               # a job's slot region unless its join asks for another
    wait: float = 120.0           # how long a join waits for the other ranks, at most
    trust_claimed_address: bool = False  # NAT: take the address a request claims


@dataclass(frozen=True)
class Answer:
    """What a rank is told once its job is placed."""

    send_to: tuple[str, int]
    job_id: int
    worker: int
    workers: int
    slots: int
    place: str
    role: str
    run: int
    lease: float
    ip: str


@dataclass
class _Pending:
    """One attempt's join, while ranks arrive."""

    name: str
    world: int
    slots: int
    ranks: dict[int, tuple[str, int]] = field(default_factory=dict)
    answers: dict[int, Answer] | None = None
    error: Refusal | None = None


@dataclass
class Held:
    """A job this service placed (or read back from a switch after a restart: no name)."""

    job_id: int
    name: str | None
    place: P.Place
    senders: tuple[tuple[str, int], ...]
    expires: list[float]
    slots: int
    run: int = 0
    left: set[int] = field(default_factory=set)


def _addr(a: tuple[str, int]) -> str:
    return f"{a[0]}:{a[1]}"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class JobService:
    """Joins, leases and leaves, against the places of ``cfg`` (``connect`` opens a session:
    ``P4RuntimeSwitch``, or ``LocalSwitch`` in tests). Thread-safe: one lock serializes the
    state and every switch session."""

    def __init__(self, cfg: Config, connect: Callable[[P.Place], Switch],
                 opts: ServeOptions = ServeOptions(), clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.opts = opts
        self._connect = connect
        self._clock = clock
        self._cond = threading.Condition()
        self._pending: dict[str, _Pending] = {}
        self.held: dict[int, Held] = {}
        self._gone: dict[int, str] = {}   # job id -> why it was removed (renewals are told)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.removals: dict[str, int] = {}  # why -> jobs removed (metrics)
        self.refusals: dict[str, int] = {}  # gRPC code -> requests refused (metrics)
        self.joined = 0                     # jobs placed
        self.placements: list[tuple[int, str, str]] = []  # (job id, name, place), in order
        self.renewed = 0                    # leases renewed

    # -- the switch --------------------------------------------------------------------------
    def fabric(self) -> P.Fabric:
        return P.Fabric(self.cfg, self._connect)

    @staticmethod
    def _mask(sw: Switch) -> int:
        cell = sw.read_counter(P4.COUNTER_STATS).get(SERVICE_JOBS_CELL, CounterValue())
        return cell.packets

    @staticmethod
    def _set_mask(sw: Switch, mask: int) -> None:
        sw.write_counter(P4.COUNTER_STATS, {SERVICE_JOBS_CELL: CounterValue(mask, 0)})

    def recover(self) -> list[Held]:
        """Read back the jobs this service placed before it (re)started: each gets a fresh
        lease, which its workers' renewals keep. A mark whose job is gone is cleared."""
        now = self._clock()
        found = []
        with self._cond, self.fabric() as f:
            for place in f.places():
                try:
                    sw = f.session(place)
                except SwitchError as e:
                    if place.role == "switch":
                        raise
                    # its jobs' renewals will be refused: they run on, and stay (job remove)
                    log.warning("fallback %s unreachable, its jobs not read back: %s",
                                place.name, e)
                    continue
                mask = self._mask(sw)
                if not mask:
                    continue
                keep = 0
                for j in J.list_jobs(sw):
                    if mask >> j.id & 1:
                        keep |= 1 << j.id
                        h = Held(j.id, None, place, tuple((s.ip, s.udp_port) for s in j.senders),
                                 [now + self.opts.lease] * j.workers, j.size)
                        self.held[j.id] = h
                        found.append(h)
                if keep != mask:
                    self._set_mask(sw, keep)
        for h in found:
            log.info("read back job %d on %s: %d workers, leases served again", h.job_id,
                     h.place.name, len(h.senders))
        return found

    # -- joins -------------------------------------------------------------------------------
    def _worker(self, ip: str, port: int) -> Worker:
        for h in self.cfg.hosts:
            if h.ip == ip:
                return Worker(ip, port, h.mac, h.port, h.name)
        if self.cfg.switch.target == "soft":  # it answers by address: no port or MAC needed
            return Worker(ip, port, NO_MAC, 0)
        raise Refusal("INVALID_ARGUMENT",
                      f"{ip} is not one of the config's hosts: the switch ({self.cfg.switch.name},"
                      f" bmv2) needs each worker's switch port and MAC ([[hosts]])")

    def join(self, name: str, rank: int, world: int, ip: str, udp_port: int, slots: int = 0,
             wait: float = 0.0, active: Callable[[], bool] = lambda: True) -> Answer:
        """Block until every rank of job ``name`` has joined (then answer with the job's
        place) or ``wait`` seconds (then refuse, naming the missing ranks)."""
        if not name or len(name) > 512:
            raise Refusal("INVALID_ARGUMENT", "a job name is required (at most 512 characters)")
        if not 1 <= world <= wire.MAX_WORKERS:
            raise Refusal("INVALID_ARGUMENT", f"job {name!r}: world size {world}: 1 to "
                                              f"{wire.MAX_WORKERS} workers per job")
        if not 0 <= rank < world:
            raise Refusal("INVALID_ARGUMENT", f"job {name!r}: rank {rank} is out of range for "
                                              f"world size {world} (ranks 0 to {world - 1})")
        if not 1 <= udp_port <= 65535:
            raise Refusal("INVALID_ARGUMENT", f"job {name!r}: UDP port {udp_port}: 1 to 65535")
        slots = slots or self.opts.slots
        if not 1 <= slots <= wire.SLOTS:
            raise Refusal("INVALID_ARGUMENT", f"job {name!r}: {slots} slots: 1 to {wire.SLOTS}")
        wait = min(wait or self.opts.wait, self.opts.wait)
        me = (ip, udp_port)
        self._worker(ip, udp_port)  # refused now, not once every rank waited for it
        with self._cond:
            p = self._pending.get(name)
            if p is not None and p.world != world:
                raise Refusal("INVALID_ARGUMENT",
                              f"job {name!r}: rank {rank} joins with world size {world}, but "
                              f"{_ranks(p.ranks)} joined with world size {p.world}")
            if p is not None and p.slots != slots:
                raise Refusal("INVALID_ARGUMENT",
                              f"job {name!r}: rank {rank} asks for {slots} slots, but "
                              f"{_ranks(p.ranks)} asked for {p.slots}")
            if p is None:
                p = self._pending[name] = _Pending(name, world, slots)
            held = p.ranks.get(rank)
            if held is not None and held != me:
                raise Refusal("ALREADY_EXISTS", f"job {name!r}: rank {rank} is taken by "
                                                f"{_addr(held)} (this join: {_addr(me)})")
            twin = [r for r, a in p.ranks.items() if a == me and r != rank]
            if twin:
                raise Refusal("ALREADY_EXISTS", f"job {name!r}: {_addr(me)} already joined as "
                                                f"rank {twin[0]} (this join: rank {rank})")
            p.ranks[rank] = me
            if len(p.ranks) == p.world:
                del self._pending[name]
                try:
                    p.answers = self._place(p)
                except Refusal as e:
                    p.error = e
                except HomaggError as e:  # the switch went away, refused a write, ...
                    p.error = Refusal("UNAVAILABLE", f"job {name!r}: {e}")
                self._cond.notify_all()
            deadline = self._clock() + wait
            while p.answers is None and p.error is None:
                left = deadline - self._clock()
                if left <= 0 or not active() or self._stop.is_set():
                    missing = sorted(set(range(p.world)) - set(p.ranks))
                    joined = ", ".join(f"{r} from {_addr(a)}" for r, a in sorted(p.ranks.items()))
                    if p.ranks.get(rank) == me:  # withdrawn: a retry is not "taken"
                        del p.ranks[rank]
                    if not p.ranks and self._pending.get(name) is p:
                        del self._pending[name]
                    if self._stop.is_set():
                        raise Refusal("UNAVAILABLE", f"job {name!r}: the service is stopping; "
                                                     f"join again ({_ranks(missing)} had not "
                                                     "joined)")
                    raise Refusal("DEADLINE_EXCEEDED",
                                  f"job {name!r}: {_ranks(missing)} of world size {p.world} "
                                  f"did not join within {wait:g} s (joined: {joined})")
                self._cond.wait(min(left, 0.25))
            if p.error is not None:
                raise p.error
            assert p.answers is not None
            return p.answers[rank]

    def _free_text(self, f: P.Fabric) -> str:
        jobs = f.list()
        used = {pl.name: sum(pj.job.size for pj in jobs if pj.place == pl) for pl in f.places()}
        return "; ".join(f"{pl.name} ({pl.role}) has {pl.pool - used[pl.name]} of {pl.pool} "
                         "slots free" for pl in f.places())

    def _place(self, p: _Pending) -> dict[int, Answer]:
        """Write the completed join's job (the lock is held). An earlier attempt of the same
        job (an elastic restart: same name, all ranks joined again) is removed first."""
        for h in [h for h in self.held.values() if h.name == p.name]:
            self._remove(h, f"replaced by a new attempt of job {p.name!r}",
                         "replaced by a new attempt")
        with self.fabric() as f:
            placed = f.list()
            if f.unreachable:
                raise Refusal("UNAVAILABLE", f"job {p.name!r}: " + "; ".join(
                    f"{n} unreachable: {why}" for n, why in f.unreachable.items()))
            used = {pj.job.id for pj in placed}
            free = [i for i in range(1, wire.MAX_JOBS) if i not in used]
            if not free:
                raise Refusal("RESOURCE_EXHAUSTED", f"job {p.name!r}: no free job id (all "
                                                    f"{wire.MAX_JOBS - 1} in use)")
            fits = False
            for pl in f.places():
                try:
                    allocate_region(p.slots, [pj.job.region for pj in placed if pj.place == pl],
                                    pl.pool)
                    fits = True
                except (NoFreeRegion, JobError):
                    pass
            if not fits:
                raise Refusal("RESOURCE_EXHAUSTED",
                              f"job {p.name!r} ({p.world} workers, {p.slots} slots) fits "
                              f"nowhere: {self._free_text(f)}")
            workers = [self._worker(*p.ranks[r]) for r in range(p.world)]
            try:
                pj = f.add(validate_job(free[0], workers, p.slots, "auto"))
            except NoFreeRegion:
                raise Refusal("RESOURCE_EXHAUSTED",
                              f"job {p.name!r} ({p.world} workers, {p.slots} slots) fits "
                              f"nowhere: {self._free_text(f)}") from None
            except JobError as e:  # a sender another job has: say so, write nothing
                raise Refusal("FAILED_PRECONDITION", f"job {p.name!r}: {e}") from None
            sw = f.session(pj.place)
            self._set_mask(sw, self._mask(sw) | 1 << pj.job.id)
        run = secrets.randbits(32) or 1  # the attempt: every rank of it carries the same one
        now = self._clock()
        h = Held(pj.job.id, p.name, pj.place, tuple(p.ranks[r] for r in range(p.world)),
                 [now + self.opts.lease] * p.world, p.slots, run)
        self.held[h.job_id] = h
        self._gone.pop(h.job_id, None)
        self.joined += 1
        self.placements.append((h.job_id, p.name, pj.place.name))
        log.info("job %d (%s): %d workers placed on %s, slots %d-%d, run %d", h.job_id, p.name,
                 p.world, pj.place.name, pj.job.base, pj.job.base + pj.job.size - 1, run)
        send_to = (pj.place.ip, wire.HOMAGG_UDP_PORT_MIN)
        return {r: Answer(send_to, h.job_id, r, p.world, p.slots, pj.place.name, pj.place.role,
                          run, self.opts.lease, p.ranks[r][0]) for r in range(p.world)}

    # -- leases ------------------------------------------------------------------------------
    def _holder(self, job_id: int, worker: int, ip: str, udp_port: int) -> Held:
        h = self.held.get(job_id)
        if h is None:
            raise Refusal("NOT_FOUND", self._gone.get(job_id, f"job {job_id} is not one this "
                                                              "service placed"))
        if not 0 <= worker < len(h.senders) or h.senders[worker] != (ip, udp_port):
            raise Refusal("PERMISSION_DENIED", f"job {job_id}: {ip}:{udp_port} is not its "
                                               f"worker {worker}")
        return h

    def renew(self, job_id: int, worker: int, ip: str, udp_port: int) -> float:
        with self._cond:
            h = self._holder(job_id, worker, ip, udp_port)
            h.expires[worker] = self._clock() + self.opts.lease
            self.renewed += 1
            return self.opts.lease

    def leave(self, job_id: int, worker: int, ip: str, udp_port: int) -> bool:
        """This worker is done; True if it was the last (the job is removed)."""
        with self._cond:
            h = self._holder(job_id, worker, ip, udp_port)
            h.left.add(worker)
            if len(h.left) < len(h.senders):
                return False
            return self._remove(h, "every worker left", "every worker left")

    def _remove(self, h: Held, why: str, kind: str) -> bool:
        """Remove ``h`` from its place (the lock is held); False if the switch could not be
        reached (the lease stays, and the reaper tries again). ``kind``: ``why`` without
        names, for the metrics' label (a small, fixed set)."""
        try:
            with self.fabric() as f:
                sw = f.session(h.place)
                try:
                    J.remove_job(sw, h.job_id)
                except JobError:
                    pass  # removed by hand already: the mark goes all the same
                self._set_mask(sw, self._mask(sw) & ~(1 << h.job_id))
        except SwitchError as e:
            log.warning("job %d: cannot remove it yet (%s): %s", h.job_id, why, e)
            return False
        del self.held[h.job_id]
        label = f"job {h.job_id}" + (f" ({h.name})" if h.name else "")
        self._gone[h.job_id] = f"{label} was removed: {why}"
        self.removals[kind] = self.removals.get(kind, 0) + 1
        log.info("%s removed from %s: %s", label, h.place.name, why)
        return True

    def reap(self) -> list[int]:
        """Remove the jobs with a worker whose lease ran out; the ids removed."""
        out = []
        with self._cond:
            now = self._clock()
            for h in list(self.held.values()):
                late = [w for w in range(len(h.senders))
                        if w not in h.left and h.expires[w] < now]
                if late:
                    who = ", ".join(f"{w} ({_addr(h.senders[w])})" for w in late)
                    if self._remove(h, f"its lease ran out: worker{'s' if len(late) > 1 else ''}"
                                       f" {who} stopped renewing within {self.opts.lease:g} s",
                                    "lease expired"):
                        out.append(h.job_id)
        return out

    def start(self) -> JobService:
        def loop():
            while not self._stop.wait(min(1.0, self.opts.lease / 4)):
                try:
                    self.reap()
                except Exception:  # a switch hiccup must not end the leases
                    log.exception("lease check failed")

        self._reaper = threading.Thread(target=loop, name="homagg-leases", daemon=True)
        self._reaper.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._reaper is not None:
            self._reaper.join(5)

    def check_token(self, token: str) -> None:
        want = self.opts.token
        if want is not None and not hmac.compare_digest(token.encode(), want.encode()):
            raise Refusal("UNAUTHENTICATED", "wrong token (HOMAGG_TOKEN must be the one "
                                             "homagg-ctl serve was given)")

    def address_of(self, peer: str, claimed: str) -> str:
        """The worker's address: the one gRPC sees (``peer``); a claimed one only with
        ``trust_claimed_address`` (NAT), else it must match."""
        seen = peer_ip(peer)
        if not claimed or claimed == seen:
            return seen
        if self.opts.trust_claimed_address:
            return claimed
        raise Refusal("PERMISSION_DENIED", f"a worker registers only the address it speaks "
                                           f"from: it claims {claimed}, and speaks from {seen}")


def peer_ip(peer: str) -> str:
    """The IP of a gRPC peer string: ``ipv4:10.0.0.1:5000``, ``ipv6:[::1]:5000`` (an
    IPv4-mapped IPv6 address is given as IPv4)."""
    peer = urllib.parse.unquote(peer)
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]")
        return host.removeprefix("::ffff:") if host.startswith("::ffff:") and "." in host \
            else host
    raise Refusal("INVALID_ARGUMENT", f"cannot tell a worker's address from {peer!r} "
                                      "(serve on TCP, not a unix socket)")
