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

Two locks, never held together in the other order: ``_switch`` serializes switch I/O
(placements, removals, scrapes, the holder mark), ``_cond`` guards the service's own state and
is never held across a switch call. A renewal takes only ``_cond``, for microseconds, so no
join, scrape or hung switch can make a healthy job's lease run out; and a lease counts from
when its renewal was *received* (the gRPC handler's first line), not processed.

Each job's workers get a secret in their join's answer (an HMAC of the service's key, the job
id, the worker and its address); Renew and Leave must present it, so another token holder can
neither end a job nor renew a dead one. A join by the name of a job still running waits for
that job to end (its leases to run out, or its workers to leave) and is refused, naming it,
if it does not within the join's wait: a name is no credential. With ``--key-file`` the key,
and so the secrets, outlive a restart; without it, jobs read back after a restart are checked
by address only until they end.

One service holds a switch at a time: it keeps a mark in STATS cell ``HOLDER_CELL`` (a random
id as the packet count, the service's gRPC address as the byte count). A second service that
finds another's mark asks that address; while a service answers there, it refuses to start
(two services would reap each other's jobs), and once none does it takes the switch over.
Every placement and removal reads the mark first, so a service that was only paused sees it
was replaced and stops, instead of fighting.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import logging
import math
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
from homagg.errors import ConfigError, HomaggError, JobError
from homagg.netconfig import Config, Worker, validate_job
from homagg.regions import NoFreeRegion, allocate_region

log = logging.getLogger("homagg.service")

#: The STATS counter cell that marks the jobs the service placed on a place: a bitmask of job
#: ids, ids 0-62 in its packet count and 63 on in its byte count (P4Runtime's counts are
#: int64: bit 63 of one does not fit). The data plane counts nothing there (its STAT_* and
#: DROP_* end at 21; EPOCH_STORE is 31); p4/include/constants.p4 notes the reservation.
SERVICE_JOBS_CELL = 30
#: The STATS cell where the service that holds the switch keeps its mark: a random id
#: (packets) and its gRPC address, IPv4 << 16 | port (bytes). Never counted by the data plane.
HOLDER_CELL = 29
_MASK_BITS = 63
NO_MAC = "00:00:00:00:00:00"
#: How long a starting service waits for the holder's answer before it takes the switch over.
PROBE_TIMEOUT = 2.0
#: Joins waiting at once, at most, by default: each holds a server thread (serve.py keeps
#: threads beyond these for renewals and leaves).
MAX_JOINS = 1024
#: Jobs placed, kept for ``placements`` (the launcher's summary), the most recent.
PLACEMENTS_KEPT = 1024


class Refusal(HomaggError):
    """A request the service will not carry out: ``code`` is a gRPC status code name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def positive_seconds(value: float, option: str) -> float:
    """``value`` if it is a finite number of seconds above zero; else a ConfigError naming
    ``option`` (NaN, infinities, zero and negatives would spin, never expire, or expire at
    once)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{option} {value!r}: a finite number of seconds above 0") from None
    if not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{option} {value!r}: a finite number of seconds above 0")
    return v


@dataclass(frozen=True)
class ServeOptions:
    token: str | None = None      # None: no token asked for (the operator said --no-token)
    lease: float = 15.0           # seconds a worker's lease lasts without a renewal
    slots: int = 64               # a job's slot region unless its join asks for another
    wait: float = 120.0           # how long a join waits for the other ranks, at most
    trust_claimed_address: bool = False  # NAT: take the address a request claims
    max_joins: int = MAX_JOINS    # joins waiting at once; more are refused (RESOURCE_EXHAUSTED)
    key: bytes | None = None      # the job secrets' key (--key-file); None: this process's own
    metrics_job_names: bool = False  # publish job names on /metrics (they are credentials' cue)

    def __post_init__(self):
        positive_seconds(self.lease, "--lease")
        positive_seconds(self.wait, "--join-wait")
        if not 1 <= self.slots <= wire.SLOTS:
            raise ConfigError(f"--slots {self.slots}: 1 to {wire.SLOTS}")
        if self.max_joins < 1:
            raise ConfigError(f"--max-joins {self.max_joins}: at least 1")


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
    secret: str = ""


@dataclass
class _Pending:
    """One attempt's join, while ranks arrive."""

    name: str
    world: int
    slots: int
    ranks: dict[int, tuple[str, int]] = field(default_factory=dict)
    deadlines: dict[int, float] = field(default_factory=dict)  # rank -> when it stops waiting
    complete: bool = False        # every rank joined: one thread places it
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
    checks_secret: bool = True    # False: read back without the key its secrets came from
    removing: str | None = None   # why a removal is under way (leases are no longer served)


def _addr(a: tuple[str, int]) -> str:
    return f"{a[0]}:{a[1]}"


def _label(h: Held) -> str:
    return f"job {h.job_id}" + (f" ({h.name})" if h.name else "")


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class JobService:
    """Joins, leases and leaves, against the places of ``cfg`` (``connect`` opens a session:
    ``P4RuntimeSwitch``, or ``LocalSwitch`` in tests). Thread-safe: ``_cond`` guards the
    state and is never held across switch I/O; ``_switch`` serializes the switch sessions."""

    def __init__(self, cfg: Config, connect: Callable[[P.Place], Switch],
                 opts: ServeOptions = ServeOptions(), clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.opts = opts
        self._connect = connect
        self._clock = clock
        self._cond = threading.Condition()
        self._switch = threading.RLock()
        self._key = opts.key or secrets.token_bytes(32)
        self._pending: dict[str, _Pending] = {}
        self.held: dict[int, Held] = {}
        self._gone: dict[int, str] = {}   # job id -> why it was removed (renewals are told)
        self._removed = 0                 # removals so far: a waiting join watches it move
        self._waiting = 0                 # joins waiting now
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.holder_id = secrets.randbelow(2**62 - 1) + 1  # this service's mark on the switch
        self._address: tuple[str, int] | None = None        # where it serves (in the mark)
        self.deposed: str | None = None   # another service took the switch over: why
        self.removals: dict[str, int] = {}  # why -> jobs removed (metrics)
        self.refusals: dict[str, int] = {}  # gRPC code -> requests refused (metrics)
        self.joined = 0                     # jobs placed
        #: (job id, name, place) of the latest PLACEMENTS_KEPT jobs placed, in order
        self.placements: collections.deque[tuple[int, str, str]] = \
            collections.deque(maxlen=PLACEMENTS_KEPT)
        self.renewed = 0                    # leases renewed

    # -- the switch --------------------------------------------------------------------------
    def fabric(self) -> P.Fabric:
        return P.Fabric(self.cfg, self._connect)

    @staticmethod
    def _mask(sw: Switch) -> int:
        cell = sw.read_counter(P4.COUNTER_STATS).get(SERVICE_JOBS_CELL, CounterValue())
        return cell.packets | cell.bytes << _MASK_BITS

    @staticmethod
    def _set_mask(sw: Switch, mask: int) -> None:
        low = (1 << _MASK_BITS) - 1
        sw.write_counter(P4.COUNTER_STATS,
                         {SERVICE_JOBS_CELL: CounterValue(mask & low, mask >> _MASK_BITS)})

    def _secret(self, job_id: int, worker: int, sender: tuple[str, int]) -> str:
        msg = f"homagg job secret/{job_id}/{worker}/{sender[0]}:{sender[1]}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()[:32]

    def recover(self, address: tuple[str, int] | None = None) -> list[Held]:
        """Take the switch (refused while another service holds it; ``address``: where this
        one serves, for the next to ask), then read back the jobs this service placed before
        it (re)started: each gets a fresh lease, which its workers' renewals keep. A mark
        whose job is gone is cleared."""
        now = self._clock()
        found = []
        with self._switch, self.fabric() as f:
            self._take(f.session(f.switch), address)
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
                                 [now + self.opts.lease] * j.workers, j.size,
                                 checks_secret=self.opts.key is not None)
                        found.append(h)
                if keep != mask:
                    self._set_mask(sw, keep)
        with self._cond:
            for h in found:
                self.held[h.job_id] = h
        for h in found:
            log.info("read back job %d on %s: %d workers, leases served again%s", h.job_id,
                     h.place.name, len(h.senders), "" if h.checks_secret else
                     " (checked by address only: no --key-file, so their secrets are unknown)")
        return found

    # -- the holder mark -----------------------------------------------------------------------
    @staticmethod
    def _read_mark(sw: Switch) -> CounterValue:
        return sw.read_counter(P4.COUNTER_STATS).get(HOLDER_CELL, CounterValue())

    def _take(self, sw: Switch, address: tuple[str, int] | None) -> None:
        """Put this service's mark on the switch; refused while the service whose mark is
        there answers at the address it left."""
        mark = self._read_mark(sw)
        if mark.packets not in (0, self.holder_id):
            where = None
            if mark.bytes:
                where = f"{ipaddress.IPv4Address(mark.bytes >> 16)}:{mark.bytes & 0xFFFF}"
            mine = address is not None and where == f"{address[0]}:{address[1]}"
            # (at this service's own address, bound already: a predecessor that died)
            if where is not None and not mine and _answers(where):
                raise ConfigError(
                    f"switch {self.cfg.switch.name} is held by another homagg-ctl serve, which "
                    f"answers at {where}: two services on one switch would reap each other's "
                    "jobs; stop that one first")
            log.warning("switch %s: taking it over from a service that no longer answers%s",
                        self.cfg.switch.name, f" at {where}" if where else "")
        self._address = address
        self._mark(sw)

    def _mark(self, sw: Switch) -> None:
        code = 0
        if self._address is not None:
            code = int(ipaddress.IPv4Address(self._address[0])) << 16 | self._address[1]
        sw.write_counter(P4.COUNTER_STATS, {HOLDER_CELL: CounterValue(self.holder_id, code)})

    def _check_holder(self, sw: Switch) -> None:
        """Refuse (and stop reaping) once another service has taken the switch over: this one
        was paused, or lost its connection, while it was replaced. No mark at all (the switch
        restarted, and its counters with it) is this service's to set again."""
        holder = self._read_mark(sw).packets
        if holder == 0 and not self.deposed:
            self._mark(sw)
        elif holder != self.holder_id:
            self.deposed = (f"another homagg-ctl serve took switch {self.cfg.switch.name} over "
                            f"(STATS cell {HOLDER_CELL} holds its mark)")
            log.error("%s: this service no longer places or removes jobs", self.deposed)
        if self.deposed:
            raise Refusal("UNAVAILABLE", self.deposed)

    def release(self) -> None:
        """Clear this service's mark (a clean stop), so the next one starts at once."""
        try:
            with self._switch, self.fabric() as f:
                sw = f.session(f.switch)
                if self._read_mark(sw).packets == self.holder_id:
                    sw.write_counter(P4.COUNTER_STATS, {HOLDER_CELL: CounterValue(0, 0)})
        except HomaggError as e:
            log.warning("could not clear the holder mark: %s", e)

    # -- joins -------------------------------------------------------------------------------
    def _worker(self, ip: str, port: int) -> Worker:
        try:
            addr = ipaddress.IPv4Address(ip)
        except ValueError:
            raise Refusal("INVALID_ARGUMENT", f"worker address {ip!r}: not an IPv4 address")\
                from None
        fb = P.fallback_place(self.cfg)
        own = {P.switch_place(self.cfg).ip} | ({fb.ip} if fb else set())
        if addr.is_unspecified or addr.is_multicast or \
                addr == ipaddress.IPv4Address("255.255.255.255") or ip in own:
            raise Refusal("INVALID_ARGUMENT", f"worker address {ip}: not a worker's (the "
                                              "unspecified, broadcast or multicast address, or "
                                              "the switch's own)")
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
        if not name or len(name) > 512 or not name.isprintable():
            raise Refusal("INVALID_ARGUMENT", "a job name is required (at most 512 printable "
                                              "characters)")
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
        if not math.isfinite(wait) or wait < 0:
            raise Refusal("INVALID_ARGUMENT", f"job {name!r}: wait_seconds {wait}: a finite "
                                              "number of seconds, at least 0 (0: the service's)")
        wait = min(wait or self.opts.wait, self.opts.wait)
        me = (ip, udp_port)
        self._worker(ip, udp_port)  # refused now, not once every rank waited for it
        if self.deposed:
            raise Refusal("UNAVAILABLE", f"job {name!r}: {self.deposed}")
        with self._cond:
            if self._waiting >= self.opts.max_joins:
                raise Refusal("RESOURCE_EXHAUSTED",
                              f"job {name!r}: {self._waiting} joins are waiting, this service's "
                              f"limit (homagg-ctl serve --max-joins); join again later")
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
            deadline = self._clock() + wait
            p.deadlines[rank] = deadline
            place_it = len(p.ranks) == p.world
            if place_it:
                del self._pending[name]
                p.complete = True
            self._waiting += 1
        try:
            if place_it:
                self._complete(p, active)
            with self._cond:
                while p.answers is None and p.error is None:
                    left = deadline - self._clock()
                    if not p.complete and (left <= 0 or not active() or self._stop.is_set()):
                        missing = sorted(set(range(p.world)) - set(p.ranks))
                        joined = ", ".join(f"{r} from {_addr(a)}"
                                           for r, a in sorted(p.ranks.items()))
                        if p.ranks.get(rank) == me:  # withdrawn: a retry is not "taken"
                            del p.ranks[rank]
                            p.deadlines.pop(rank, None)
                        if not p.ranks and self._pending.get(name) is p:
                            del self._pending[name]
                        if self._stop.is_set():
                            raise Refusal("UNAVAILABLE", f"job {name!r}: the service is "
                                                         f"stopping; join again ({_ranks(missing)}"
                                                         " had not joined)")
                        raise Refusal("DEADLINE_EXCEEDED",
                                      f"job {name!r}: {_ranks(missing)} of world size {p.world} "
                                      f"did not join within {wait:g} s (joined: {joined})")
                    # a complete job is answered by its placer before the earliest deadline
                    self._cond.wait(0.25 if left > 0 else 0.05)
                if p.error is not None:
                    raise p.error
                assert p.answers is not None
                return p.answers[rank]
        finally:
            with self._cond:
                self._waiting -= 1

    def _stale(self, now: float) -> list[Held]:
        """Jobs likely to be removed soon: a worker that missed a renewal (agents renew every
        third of a lease), not yet left (the lock is held)."""
        return [h for h in self.held.values()
                if any(w not in h.left and h.expires[w] - now < self.opts.lease / 2
                       for w in range(len(h.senders)))]

    def _complete(self, p: _Pending, active: Callable[[], bool]) -> None:
        """Place the completed join ``p`` (every rank waits for this): after a running job of
        the same name has ended, and, where no place has room but a job's leases are
        lapsing, once they have; all within the ranks' earliest deadline."""
        until = min(p.deadlines.values())
        answers: dict[int, Answer] | None = None
        error: Refusal | None = None
        while True:
            with self._cond:
                seen = self._removed
                now = self._clock()
                running = [h for h in self.held.values() if h.name == p.name]
            if self._stop.is_set():
                error = Refusal("UNAVAILABLE", f"job {p.name!r}: the service is stopping; join "
                                               "again")
                break
            if running:
                h = running[0]
                if now >= until or not active():
                    error = Refusal(
                        "ALREADY_EXISTS",
                        f"job {p.name!r} is still running (job {h.job_id} on {h.place.name}, "
                        f"its workers {', '.join(map(_addr, h.senders))} renew their leases): "
                        f"a join cannot replace it; a new attempt is placed once it ends (its "
                        f"workers leave, or stop renewing for {self.opts.lease:g} s)")
                    break
                self._wait_for_removal(seen, until)
                continue
            try:
                with self._switch:
                    answers = self._place(p)
                break
            except Refusal as e:
                with self._cond:
                    lapsing = self._stale(self._clock())
                if e.code == "RESOURCE_EXHAUSTED" and lapsing and self._clock() < until \
                        and active():
                    log.info("job %r waits for room: %s (jobs %s are lapsing)", p.name, e,
                             ", ".join(str(h.job_id) for h in lapsing))
                    self._wait_for_removal(seen, until)
                    continue
                error = e
            except HomaggError as e:  # the switch went away, refused a write, ...
                error = Refusal("UNAVAILABLE", f"job {p.name!r}: {e}")
            except Exception as e:  # a bug: said as such, never an UNKNOWN without a word
                log.exception("job %r: placing it failed", p.name)
                error = Refusal("INTERNAL", f"job {p.name!r}: placing it failed: "
                                            f"{type(e).__name__}: {e}")
            break
        with self._cond:
            p.answers, p.error = answers, error
            self._cond.notify_all()

    def _wait_for_removal(self, seen: int, until: float) -> None:
        with self._cond:
            left = until - self._clock()
            if self._removed == seen and left > 0 and not self._stop.is_set():
                self._cond.wait(min(left, 0.25))

    def _free_text(self, f: P.Fabric) -> str:
        jobs = f.list()
        used = {pl.name: sum(pj.job.size for pj in jobs if pj.place == pl) for pl in f.places()}
        return "; ".join(f"{pl.name} ({pl.role}) has {pl.pool - used[pl.name]} of {pl.pool} "
                         "slots free" for pl in f.places())

    def _place(self, p: _Pending) -> dict[int, Answer]:
        """Write the completed join's job (``_switch`` is held, ``_cond`` is not). Every check
        comes before the first write; a write that fails part-way is undone."""
        with self.fabric() as f:
            self._check_holder(f.session(f.switch))
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
            spec = validate_job(free[0], workers, p.slots, "auto")
            try:
                pj = f.add(spec)
            except NoFreeRegion:
                raise Refusal("RESOURCE_EXHAUSTED",
                              f"job {p.name!r} ({p.world} workers, {p.slots} slots) fits "
                              f"nowhere: {self._free_text(f)}") from None
            except JobError as e:  # a sender another job has: say so, write nothing
                raise Refusal("FAILED_PRECONDITION", f"job {p.name!r}: {e}") from None
            except BaseException:
                self._undo(f, spec.id)
                raise
            try:
                sw = f.session(pj.place)
                self._set_mask(sw, self._mask(sw) | 1 << pj.job.id)
            except BaseException:
                self._undo(f, pj.job.id)
                raise
        run = secrets.randbits(32) or 1  # the attempt: every rank of it carries the same one
        senders = tuple(p.ranks[r] for r in range(p.world))
        with self._cond:
            now = self._clock()
            h = Held(pj.job.id, p.name, pj.place, senders, [now + self.opts.lease] * p.world,
                     p.slots, run)
            self.held[h.job_id] = h
            self._gone.pop(h.job_id, None)
            self.joined += 1
            self.placements.append((h.job_id, p.name, pj.place.name))
        log.info("job %d (%r): %d workers placed on %s, slots %d-%d, run %d", h.job_id, p.name,
                 p.world, pj.place.name, pj.job.base, pj.job.base + pj.job.size - 1, run)
        send_to = (pj.place.ip, wire.HOMAGG_UDP_PORT_MIN)
        return {r: Answer(send_to, h.job_id, r, p.world, p.slots, pj.place.name, pj.place.role,
                          run, self.opts.lease, p.ranks[r][0],
                          self._secret(h.job_id, r, senders[r])) for r in range(p.world)}

    @staticmethod
    def _undo(f: P.Fabric, job_id: int) -> None:
        """Remove what a failed placement wrote (best effort: it is logged if it cannot)."""
        try:
            f.remove(job_id)
        except (HomaggError, JobError) as e:
            log.warning("job %d: undoing a failed placement: %s", job_id, e)

    # -- leases ------------------------------------------------------------------------------
    def _holder(self, job_id: int, worker: int, ip: str, udp_port: int, secret: str) -> Held:
        h = self.held.get(job_id)
        if h is None:
            raise Refusal("NOT_FOUND", self._gone.get(job_id, f"job {job_id} is not one this "
                                                              "service placed"))
        if h.removing:
            raise Refusal("NOT_FOUND", f"{_label(h)} is being removed: {h.removing}")
        if not 0 <= worker < len(h.senders) or h.senders[worker] != (ip, udp_port):
            raise Refusal("PERMISSION_DENIED", f"job {job_id}: {ip}:{udp_port} is not its "
                                               f"worker {worker}")
        if h.checks_secret and not hmac.compare_digest(
                secret.encode(), self._secret(job_id, worker, (ip, udp_port)).encode()):
            raise Refusal("PERMISSION_DENIED", f"job {job_id}: worker {worker}'s secret is "
                                               "wrong (only the job's own workers, with the "
                                               "secret their join returned, renew or leave it)")
        return h

    def renew(self, job_id: int, worker: int, ip: str, udp_port: int, secret: str = "",
              received: float | None = None) -> float:
        """Extend the lease from ``received`` (when the request arrived; now if None)."""
        if self.deposed:  # (the agent tries again: its job's holder is another service now)
            raise Refusal("UNAVAILABLE", self.deposed)
        with self._cond:
            h = self._holder(job_id, worker, ip, udp_port, secret)
            at = self._clock() if received is None else received
            h.expires[worker] = max(h.expires[worker], at + self.opts.lease)
            self.renewed += 1
            return self.opts.lease

    def leave(self, job_id: int, worker: int, ip: str, udp_port: int, secret: str = "") -> bool:
        """This worker is done; True if it was the last (the job is removed)."""
        with self._cond:
            h = self._holder(job_id, worker, ip, udp_port, secret)
            h.left.add(worker)
            if len(h.left) < len(h.senders):
                return False
            h.removing = "every worker left"
        with self._switch:
            removed = self._remove(h, "every worker left", "every worker left")
        if not removed and self.deposed:
            raise Refusal("UNAVAILABLE", self.deposed)
        return removed

    def _remove(self, h: Held, why: str, kind: str) -> bool:
        """Remove ``h`` from its place (``_switch`` is held); False if the switch could not be
        reached (the lease stays, and the reaper tries again). ``kind``: ``why`` without
        names, for the metrics' label (a small, fixed set)."""
        try:
            with self.fabric() as f:
                self._check_holder(f.session(f.switch))
                sw = f.session(h.place)
                try:
                    J.remove_job(sw, h.job_id)
                except JobError:
                    pass  # removed by hand already: the mark goes all the same
                self._set_mask(sw, self._mask(sw) & ~(1 << h.job_id))
        except (SwitchError, Refusal) as e:
            log.warning("job %d: cannot remove it (%s): %s", h.job_id, why, e)
            with self._cond:
                h.removing = None
            return False
        label = _label(h)
        with self._cond:
            if self.held.get(h.job_id) is h:
                del self.held[h.job_id]
            self._gone[h.job_id] = f"{label} was removed: {why}"
            if len(self._gone) > PLACEMENTS_KEPT:
                del self._gone[next(iter(self._gone))]
            self.removals[kind] = self.removals.get(kind, 0) + 1
            self._removed += 1
            self._cond.notify_all()
        log.info("%s removed from %s: %s", label, h.place.name, why)
        return True

    def reap(self) -> list[int]:
        """Remove the jobs with a worker whose lease ran out; the ids removed."""
        out: list[int] = []
        if self.deposed:
            return out
        with self._switch:
            with self._cond:
                now = self._clock()
                late = []
                for h in self.held.values():
                    ws = [w for w in range(len(h.senders))
                          if w not in h.left and h.expires[w] < now]
                    if ws and not h.removing:
                        who = ", ".join(f"{w} ({_addr(h.senders[w])})" for w in ws)
                        h.removing = (f"its lease ran out: worker{'s' if len(ws) > 1 else ''} "
                                      f"{who} stopped renewing within {self.opts.lease:g} s")
                        late.append(h)
            for h in late:
                assert h.removing is not None
                if self._remove(h, h.removing, "lease expired"):
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
            self._reaper = None
            self.release()

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
            try:
                ipaddress.IPv4Address(claimed)
            except ValueError:
                raise Refusal("INVALID_ARGUMENT", f"the claimed worker address {claimed!r} is "
                                                  "not an IPv4 address") from None
            return claimed
        raise Refusal("PERMISSION_DENIED", f"a worker registers only the address it speaks "
                                           f"from: it claims {claimed}, and speaks from {seen}")


def _answers(address: str) -> bool:
    """Whether something (with the mark: the service that left it) listens at ``address``."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), PROBE_TIMEOUT):
            return True
    except OSError:
        return False


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
