"""homagg-ctl serve: the controller as a service, where workers join their jobs by themselves.

A worker asks to join a job by name (what torchrun gives all its ranks alike), with its rank, the
world size and its UDP port; its address is the one the service sees the request come from. When
every rank has joined, the job is placed as ``homagg-ctl job add`` would place it
(``placement.Fabric``: the switch while its slots last, else the fallback), written to the switch,
and every rank is answered at once. Workers then renew a lease; a job with a worker whose lease ran
out is removed and its slots freed, as is a job whose workers have all left.

The switch stays the source of truth. The jobs this service placed are marked on each place in a
spare cell of the STATS counter (``SERVICE_JOBS_CELL``: a bitmask of job ids, as its packet count;
P4Runtime can write counters, and they outlive this process), so a restarted service reads them
back from the switch's tables and serves their leases again, while jobs the operator installed with
the CLI are never touched. The data path never needs the service: running jobs keep running while
it is down. Switch sessions are opened per operation, with an election id above the CLI's default;
where another controller is primary, the switch refuses the service's writes, and it says so. Two
locks, never held together in the other order: ``_switch`` serializes switch I/O (placements,
removals, scrapes, the holder mark), ``_cond`` guards the service's own state and is never held
across a switch call. A renewal takes only ``_cond``, for microseconds, so no join, scrape or hung
switch can make a healthy job's lease run out; and a lease counts from when its renewal was
*received* (the gRPC handler's first line), not processed.

The lease thread also removes what must go and probes every place (``service_upkeep``).

The ranks of one attempt present one join secret, which its first rank fixes. Each worker gets a
secret in its join's answer (``job_secret``), which Renew and Leave must present, and the job's
key, which its packets carry. A join by a running job's name waits for that job to end: a name is
no credential. One service holds a switch at a time (``holder``); the vocabulary is
``service_state``'s."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable

from homagg import wire
from homagg.controller import placement as P
from homagg.controller import treeplace as T
from homagg.controller.holder import HolderMark
from homagg.controller.service_state import (
    HOLDER_CELL,
    MAX_JOINS,
    PLACEMENTS_KEPT,
    SERVICE_JOBS_CELL,
    Answer,
    Held,
    Owed,
    Pending,
    Refusal,
    ServeOptions,
    addr_text,
    address_of,
    check_attempt,
    check_join,
    check_token,
    free_text,
    is_worker,
    job_secret,
    label,
    mark_job,
    not_yours,
    peer_ip,
    positive_seconds,
    ranks_text,
    undo_placement,
    worker_of,
)
from homagg.controller.service_upkeep import Upkeep
from homagg.controller.switch import Switch
from homagg.errors import HomaggError, JobError
from homagg.netconfig import Config, Worker, validate_job
from homagg.regions import NoFreeRegion, allocate_region

__all__ = ["HOLDER_CELL", "MAX_JOINS", "SERVICE_JOBS_CELL", "Answer", "Held", "JobService",
           "Refusal", "ServeOptions", "peer_ip", "positive_seconds"]

log = logging.getLogger("homagg.service")


def _mark(f: P.Fabric, job_id: int, on: bool, but: P.Place | None = None) -> None:
    """Set (or clear) job ``job_id``'s mark on every place of ``f``, ``but`` one."""
    for pl in f.places():
        if pl != but:
            mark_job(f.session(pl), job_id, on)


class JobService(Upkeep):
    """Joins, leases and leaves, against the places of ``cfg`` (``connect`` opens a session:
    ``P4RuntimeSwitch``, or ``LocalSwitch`` in tests). Thread-safe: ``_cond`` guards the
    state and is never held across switch I/O; ``_switch`` serializes the switch sessions."""

    def __init__(self, cfg: Config, connect: Callable[[P.Place], Switch],
                 opts: ServeOptions | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 answers: Callable[[P.Place], bool] | None = None):
        self.cfg = cfg
        #: whether something accepts connections at a place's P4Runtime address (``serve``:
        #: a TCP connect); one that refuses is taken for dead, its jobs failed. None: a place
        #: is dead when no session to it opens
        self.answers = answers
        self.opts = opts if opts is not None else ServeOptions()
        self._connect = connect
        self._clock = clock
        self._cond = threading.Condition()
        self._switch = threading.RLock()
        self._key = self.opts.key or secrets.token_bytes(32)
        self._pending: dict[str, Pending] = {}
        self.held: dict[int, Held] = {}
        # job id -> why it was removed, its senders and whether their secrets are checked
        # (its own workers' renewals are told why; anyone else, nothing of it)
        self._gone: dict[int, tuple[str, tuple[tuple[str, int], ...], bool]] = {}
        self._removed = 0                 # removals so far: a waiting join watches it move
        #: job id -> its removal, not done everywhere yet: the id stays taken (``_cond``)
        self._owed: dict[int, Owed] = {}
        #: place name -> why it is taken for dead: not waited on, probed until it answers
        #: again (``_switch`` guards it)
        self.dead: dict[str, str] = {}
        self._probed = float("-inf")      # when the places were last probed
        #: place name -> when to read it in a session again, after a session that did not
        #: open though its port answers (hung, or slow: each try holds ``_switch`` a while)
        self._hung: dict[str, float] = {}
        self._waiting = 0                 # joins waiting now
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.holder = HolderMark(cfg.switch.name)  # this service's mark on the switch
        self.removals: dict[str, int] = {}  # why -> jobs removed (metrics)
        self.refusals: dict[str, int] = {}  # gRPC code -> requests refused (metrics)
        self.joined = 0                     # jobs placed
        #: (job id, name, place) of the latest PLACEMENTS_KEPT jobs placed, in order
        self.placements: deque[tuple[int, str, str]] = deque(maxlen=PLACEMENTS_KEPT)
        self.renewed = 0                    # leases renewed
        #: the most workers a job may have: 64 a switch with hosts under it, on a tree
        self.max_world = wire.MAX_WORKERS * max(1, bool(cfg.switch.under) + sum(
            bool(s.under) for s in cfg.switches))

    def fabric(self) -> P.Fabric:
        return P.Fabric(self.cfg, self._connect, self.dead)

    def recover(self, address: tuple[str, int] | None = None) -> list[Held]:
        """Take the switch (refused while another service holds it; ``address``: where this
        one serves, for the next to ask), then read back the jobs this service placed before
        it (re)started: each gets a fresh lease, which its workers' renewals keep. A mark
        whose job is gone is cleared."""
        now = self._clock()
        found: list[Held] = []
        with self._switch, self.fabric() as f:
            self.holder.take(f.session(f.switch), address)
            parts = T.read_marked(f)
        for job_id, part in sorted(parts.items()):
            root, senders = T.senders_of(part)  # (a tree's: its senders in tree order)
            found.append(Held(job_id, None, root, senders, [now + self.opts.lease] * len(senders),
                              part[root].size, checks_secret=self.opts.key is not None,
                              places=(root, *(pl for pl in part if pl != root))
                              if len(part) > 1 else ()))
        with self._cond:
            for h in found:
                self.held[h.job_id] = h
        for h in found:
            log.info("read back job %d on %s: %d workers, leases served again%s", h.job_id,
                     h.place.name, len(h.senders), "" if h.checks_secret else
                     " (checked by address only: no --key-file, so their secrets are unknown)")
        return found

    @property
    def deposed(self) -> str | None:
        """Why this service no longer holds its switch (another took it over), or None."""
        return self.holder.deposed

    def release(self) -> None:
        """Clear this service's mark (a clean stop), so the next one starts at once."""
        try:
            with self._switch, self.fabric() as f:
                self.holder.release(f.session(f.switch))
        except HomaggError as e:
            log.warning("could not clear the holder mark: %s", e)

    def _worker(self, ip: str, port: int) -> Worker:
        return worker_of(self.cfg, ip, port)

    def join(self, name: str, rank: int, world: int, ip: str, udp_port: int, slots: int = 0,
             wait: float = 0.0, active: Callable[[], bool] = lambda: True,
             secret: str = "") -> Answer:
        """Block until every rank of job ``name`` has joined (then answer with the job's
        place) or ``wait`` seconds (then refuse, naming the missing ranks). ``secret``: the
        join secret, which the attempt's first rank fixes and every other must present, before
        anything of the attempt (its ranks, their addresses) is told."""
        slots, wait = check_join(self.opts, name, rank, world, udp_port, slots, wait, secret,
                                 self.max_world)
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
            if p is None:
                p = self._pending[name] = Pending(name, world, slots, secret)
            else:
                check_attempt(p, rank, world, slots, secret, me)
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
                        joined = ", ".join(f"{r} from {addr_text(a)}"
                                           for r, a in sorted(p.ranks.items()))
                        if p.ranks.get(rank) == me:  # withdrawn: a retry is not "taken"
                            del p.ranks[rank]
                            p.deadlines.pop(rank, None)
                        if not p.ranks and self._pending.get(name) is p:
                            del self._pending[name]
                        if self._stop.is_set():
                            raise Refusal("UNAVAILABLE",
                                          f"job {name!r}: the service is stopping; join again "
                                          f"({ranks_text(missing)} had not joined)")
                        raise Refusal("DEADLINE_EXCEEDED",
                                      f"job {name!r}: {ranks_text(missing)} of world size "
                                      f"{p.world} did not join within {wait:g} s (joined: "
                                      f"{joined})")
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

    def _complete(self, p: Pending, active: Callable[[], bool]) -> None:
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
                    log.info("job %r: a new attempt waited for job %d on %s (workers %s) to "
                             "end, in vain", p.name, h.job_id, h.place.name,
                             ", ".join(map(addr_text, h.senders)))
                    error = Refusal(
                        "ALREADY_EXISTS",
                        f"job {p.name!r} is still running (its workers renew their leases): "
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

    def _place(self, p: Pending) -> dict[int, Answer]:
        """Write the completed join's job (``_switch`` is held, ``_cond`` is not). Every check
        comes before the first write; a write that fails part-way is undone."""
        self._revive()
        self._settle()  # (the removals owed that are due: a sender they hold is freed first)
        with self.fabric() as f:
            self.holder.check(f.session(f.switch))
            placed = f.list()
            if f.unreachable:
                raise Refusal("UNAVAILABLE", f"job {p.name!r}: " + "; ".join(
                    f"{n} unreachable: {why}" for n, why in f.unreachable.items()))
            with self._cond:  # (a dead switch's jobs are not listed: these are taken too)
                used = {pj.job.id for pj in placed} | set(self.held) | set(self._owed)
            free = [i for i in range(1, wire.MAX_JOBS) if i not in used]
            if not free:
                raise Refusal("RESOURCE_EXHAUSTED", f"job {p.name!r}: no free job id (all "
                                                    f"{wire.MAX_JOBS - 1} in use)")
            if self.cfg.switches:
                return self._place_tree(f, p, placed, free[0])
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
                              f"nowhere: {free_text(f)}")
            workers = [self._worker(*p.ranks[r]) for r in range(p.world)]
            # the job's key, in every packet: a sender off the job's path cannot guess it
            spec = validate_job(free[0], workers, p.slots, "auto",
                                key=secrets.randbits(32) or 1)
            # The mark first, on every place the job may land: a service killed between the
            # writes leaves a mark without its job (cleared when it is read back), never a
            # job nobody marked (held for good).
            _mark(f, spec.id, True)
            try:
                pj = f.add(spec)
            except NoFreeRegion:
                _mark(f, spec.id, False)
                raise Refusal("RESOURCE_EXHAUSTED",
                              f"job {p.name!r} ({p.world} workers, {p.slots} slots) fits "
                              f"nowhere: {free_text(f)}") from None
            except JobError as e:  # a sender another job has: say so, write nothing
                _mark(f, spec.id, False)
                raise Refusal("FAILED_PRECONDITION", f"job {p.name!r}: {e}") from None
            except BaseException:
                undo_placement(f, spec.id)
                _mark(f, spec.id, False)
                raise
            _mark(f, spec.id, False, but=pj.place)
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
                          job_secret(self._key, h.job_id, r, senders[r]), spec.key)
                for r in range(p.world)}

    def _place_tree(self, f: P.Fabric, p: Pending, placed: list[P.PlacedJob], job_id: int
                    ) -> dict[int, Answer]:
        """``_place`` on a tree of switches (``treeplace``): all of the job's tree, or none."""
        tp, root, senders = T.place(f, self.cfg, job_id, p.name, p.ranks, p.slots, placed,
                                    self.dead)
        run = secrets.randbits(32) or 1
        with self._cond:
            h = Held(job_id, p.name, root, senders, [self._clock() + self.opts.lease] * p.world,
                     p.slots, run, places=tuple(sj.place for sj in tp.jobs) if tp.tree else ())
            self.held[job_id] = h
            self._gone.pop(job_id, None)
            self.joined += 1
            self.placements.append((job_id, p.name, root.name))
        log.info("job %d (%r): %d workers placed on %s, run %d", job_id, p.name, p.world,
                 " > ".join(f"{sj.place.name} ({len(sj.spec.workers)})" for sj in tp.jobs), run)
        return T.answers(tp, senders, p.ranks, run, self.opts.lease,
                         lambda w, a: job_secret(self._key, job_id, w, a))

    def _holder(self, job_id: int, worker: int, ip: str, udp_port: int, secret: str) -> Held:
        """The job a lease request is for, once the request proved it comes from one of its
        workers (its address and its secret); until then, nothing of the job is told, not
        even whether it exists: an unknown job, another worker's address and a wrong secret
        are refused alike (``not_yours``)."""
        h = self.held.get(job_id)
        if h is None:
            gone = self._gone.get(job_id)
            if gone is not None and is_worker(self._key, gone[1], gone[2], job_id, worker,
                                              (ip, udp_port), secret):
                raise Refusal("NOT_FOUND", gone[0])
            raise not_yours(job_id, worker, ip, udp_port)
        if not is_worker(self._key, h.senders, h.checks_secret, job_id, worker, (ip, udp_port),
                         secret):
            raise not_yours(job_id, worker, ip, udp_port)
        if h.removing:
            raise Refusal("NOT_FOUND", f"{label(h)} is being removed: {h.removing}")
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

    def start(self) -> JobService:
        def loop():
            while not self._stop.wait(min(1.0, self.opts.lease / 4)):
                for step in (self.reap, self.tend):
                    try:
                        step()
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
        check_token(self.opts, token)

    def address_of(self, peer: str, claimed: str) -> str:
        return address_of(self.opts, peer, claimed)
