"""What the service's lease thread does beside the leases: removals, and the places' health.

A job is removed (``_remove``) when its lease runs out (``reap``), when every worker left, or
when a place it needs fails; its workers are told why at once. A removal a place could not take
is owed (``_owed``), retried with backoff until the place is rid of the job (``_settle``); its
id stays taken meanwhile, its name does not. Every place is probed (``probe``, from ``tend``):
one whose P4Runtime port refuses connections is taken for dead (``dead``), its jobs failed with
a reason that names it and taken off the rest of their trees, and no placement waits on it until
it answers again; one that answers without a job it should hold (it restarted) fails that job.

``Upkeep`` is ``service.JobService``'s part that does this, on the state the service keeps
(declared here, made by the service); the locks are the service's: ``_switch`` serializes
switch I/O, ``_cond`` guards the state and is never held across a switch call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from homagg.controller import placement as P
from homagg.controller import treeplace as T
from homagg.controller.holder import HolderMark
from homagg.controller.service_state import (
    PLACEMENTS_KEPT,
    Held,
    Owed,
    Refusal,
    ServeOptions,
    addr_text,
    label,
    read_jobs_mark,
)
from homagg.controller.switch import Switch
from homagg.errors import HomaggError

log = logging.getLogger("homagg.service")

#: Seconds before a place whose port answers but whose session did not open, and took
#: HUNG_AFTER seconds or more to say so, is read again (a refusal at once, "no pipeline" from
#: a switch restarting, is read again at the next probe).
HUNG_RETRY = 30.0
HUNG_AFTER = 1.0


class Upkeep:
    """Removals, owed removals, the places' probes and the reaper's rounds of ``JobService``
    (which makes the state declared here)."""

    opts: ServeOptions
    answers: Callable[[P.Place], bool] | None
    holder: HolderMark
    held: dict[int, Held]
    dead: dict[str, str]
    removals: dict[str, int]
    _cond: threading.Condition
    _switch: threading.RLock
    _connect: Callable[[P.Place], Switch]
    _clock: Callable[[], float]
    _gone: dict[int, tuple[str, tuple[tuple[str, int], ...], bool]]
    _owed: dict[int, Owed]
    _hung: dict[str, float]
    _probed: float
    _removed: int

    def fabric(self) -> P.Fabric:
        raise NotImplementedError

    @property
    def deposed(self) -> str | None:
        raise NotImplementedError

    def _remove(self, h: Held, why: str, kind: str) -> bool:
        """Release ``h`` and remove it from its places (``_switch`` is held): True if it is
        gone from every one. Where a place does not answer, the removal is owed (``_owed``:
        its id stays taken, the reaper tries again); its name is free and its workers are
        told ``why`` at once. False too, with nothing done, if another service took the switch
        over. ``kind``: ``why`` without names, for the metrics' label (a small, fixed set)."""
        with self._cond:
            if self.held.get(h.job_id) is not h:
                return True  # (another thread removed it)
        try:
            left = self._take_off(h.job_id, h.everywhere)
        except Refusal as e:  # deposed: this service removes nothing now
            log.warning("job %d: cannot remove it (%s): %s", h.job_id, why, e)
            with self._cond:
                h.removing = None
            return False
        text = label(h)
        with self._cond:
            if self.held.get(h.job_id) is h:
                del self.held[h.job_id]
            self._gone[h.job_id] = (f"{text} was removed: {why}", h.senders, h.checks_secret)
            if len(self._gone) > PLACEMENTS_KEPT:
                del self._gone[next(iter(self._gone))]
            if left:
                o = self._owed[h.job_id] = Owed(h.job_id, text, why, [pl for pl, _ in left])
                o.retry_at = self._clock() + o.backoff()
            self.removals[kind] = self.removals.get(kind, 0) + 1
            self._removed += 1
            self._cond.notify_all()
        if left:
            log.warning("%s released (%s), but not removed yet from %s: %s; tried again until "
                        "it is", text, why, ", ".join(pl.name for pl, _ in left),
                        "; ".join(e for _, e in left))
            return False
        log.info("%s removed from %s: %s", text, h.place.name, why)
        return True

    def _take_off(self, job_id: int, places: Sequence[P.Place]) -> list[tuple[P.Place, str]]:
        """Remove job ``job_id`` and its mark from each of ``places`` that answers (``_switch``
        is held; a tree's leaves first); the places it is not removed from, with why. Raises
        the holder's Refusal where another service took the switch over."""
        with self.fabric() as f:
            try:
                self.holder.check(f.session(f.switch))
            except Refusal:
                raise
            except HomaggError as e:  # the holder's switch down: nothing is removed, for now
                return [(pl, str(e)) for pl in places]
            left: list[tuple[P.Place, str]] = []
            for pl in reversed(places):
                try:
                    # (removed by hand already, or a switch that came back empty: the mark
                    # goes all the same)
                    T.unmark(f.session(pl), job_id, remove=True)
                except Refusal:
                    raise
                except HomaggError as e:
                    left.append((pl, str(e)))
            return left[::-1]

    def _settle(self, force: bool = False) -> list[int]:
        """Try the removals owed (``_switch`` is held) whose time has come (``force``: all),
        on the places not taken for dead; the ids now gone from every place."""
        now = self._clock()
        with self._cond:
            due = [o for o in self._owed.values()
                   if (force or o.retry_at <= now) and any(pl.name not in self.dead
                                                           for pl in o.places)]
        done: list[int] = []
        for o in due:
            try:
                left = dict((pl.name, e) for pl, e in self._take_off(
                    o.job_id, [pl for pl in o.places if pl.name not in self.dead]))
            except Refusal:
                return done
            with self._cond:
                o.places = [pl for pl in o.places if pl.name in self.dead or pl.name in left]
                if o.places:
                    o.tries += 1
                    o.retry_at = self._clock() + o.backoff()
                else:
                    del self._owed[o.job_id]
                    done.append(o.job_id)
            if o.places:
                log.info("%s: still not removed from %s (try %d): %s", o.text,
                         ", ".join(pl.name for pl in o.places), o.tries, "; ".join(left.values()))
            else:
                log.info("%s removed at last (%s), its id free again", o.text, o.why)
        return done

    @property
    def owed(self) -> dict[int, list[str]]:
        """The removals owed: job id -> the places that may still hold it."""
        with self._cond:
            return {i: [pl.name for pl in o.places] for i, o in self._owed.items()}

    # -- the places' health ----------------------------------------------------------------
    def _answers(self, pl: P.Place) -> bool:
        return self.answers is None or self.answers(pl)

    def _session_probe(self, pl: P.Place) -> int | str:
        """The jobs mark of ``pl`` read in a session of its own (``_switch`` is held), or why
        no session opens."""
        try:
            sw = self._connect(pl)
            try:
                return read_jobs_mark(sw)
            finally:
                sw.close()
        except HomaggError as e:
            return str(e)

    def _revive(self) -> list[str]:
        """Probe the places taken for dead (``_switch`` is held): each that answers again is
        taken back, and what is owed there removed; their names."""
        back: list[str] = []
        for pl in [pl for pl in self.fabric().places() if pl.name in self.dead]:
            if not self._answers(pl) or isinstance(self._session_probe(pl), str):
                continue
            del self.dead[pl.name]
            log.warning("switch %s (%s) answers again: taken back into placement", pl.name,
                        pl.grpc)
            back.append(pl.name)
        if back:
            self._settle(force=True)
        return back

    def probe(self) -> None:
        """Probe every place: one that refuses connections is taken for dead (so no join
        waits on it) and its jobs failed, each with a reason that names it; one that holds a
        job of this service (or owes a removal) is read in a session too, and if it answers
        without a job it should hold (it restarted), that job fails. One taken for dead that
        answers again is taken back, and what is owed there removed."""
        with self._cond:
            names = {pl.name for h in self.held.values() for pl in h.everywhere}
            names |= {pl.name for o in self._owed.values() for pl in o.places}
        with self._switch:
            self._revive()
            for pl in self.fabric().places():
                if pl.name in self.dead:
                    continue
                if self.answers is not None and not self.answers(pl):
                    self._down(pl, f"nothing answers P4Runtime at {pl.grpc}")
                    continue
                if pl.name not in names or self._hung.get(pl.name, 0.0) > self._clock():
                    continue
                began = time.monotonic()
                got = self._session_probe(pl)
                if isinstance(got, str):
                    if self.answers is None:  # (no cheaper sign: a failed session it is)
                        self._down(pl, got)
                    elif time.monotonic() - began >= HUNG_AFTER:  # (slow or hung: its jobs
                        self._hung[pl.name] = self._clock() + HUNG_RETRY  # kept, tried later)
                    continue
                self._hung.pop(pl.name, None)
                self._lost_on(pl, got)

    def _down(self, pl: P.Place, why: str) -> None:
        """Take ``pl`` for dead (``_switch`` is held) and fail its jobs."""
        self.dead[pl.name] = f"switch {pl.name} unreachable: {why}"
        log.error("switch %s (%s) taken for dead (%s): its jobs fail, and placement avoids it "
                  "until it answers again", pl.name, pl.grpc, why)
        self._fail(self._holding(pl),
                   lambda h: f"switch {pl.name} ({pl.grpc}) is unreachable ({why}): job "
                             f"{h.job_id} failed", "switch unreachable")

    def _lost_on(self, pl: P.Place, mask: int) -> None:
        """Fail the jobs ``pl`` should hold and no longer marks (it restarted, or an operator
        removed them)."""
        lost = [h for h in self._holding(pl) if not mask >> h.job_id & 1]
        self._fail(lost, lambda h: f"switch {pl.name} ({pl.grpc}) no longer holds job "
                                   f"{h.job_id} (it restarted, or it was removed there): the "
                                   "job failed", "switch lost the job")

    def _holding(self, pl: P.Place) -> list[Held]:
        with self._cond:
            return [h for h in self.held.values()
                    if not h.removing and any(x.name == pl.name for x in h.everywhere)]

    def _fail(self, jobs: list[Held], why: Callable[[Held], str], kind: str) -> None:
        """Remove ``jobs`` (``_switch`` is held), each telling its workers ``why(job)``."""
        marked = []
        with self._cond:
            for h in jobs:
                if self.held.get(h.job_id) is h and not h.removing:
                    h.removing = why(h)
                    marked.append(h)
        for h in marked:
            assert h.removing is not None
            self._remove(h, h.removing, kind)

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
                        who = ", ".join(f"{w} ({addr_text(h.senders[w])})" for w in ws)
                        h.removing = (f"its lease ran out: worker{'s' if len(ws) > 1 else ''} "
                                      f"{who} stopped renewing within {self.opts.lease:g} s")
                        late.append(h)
            for h in late:
                assert h.removing is not None
                if self._remove(h, h.removing, "lease expired"):
                    out.append(h.job_id)
        return out

    def tend(self) -> None:
        """The reaper's rounds beside the leases: every place probed (``probe``; every third
        of a lease, at most 2 s apart), and the removals owed tried again when due."""
        if self.deposed:
            return
        now = self._clock()
        if now - self._probed >= min(self.opts.lease / 3, 2.0):
            self._probed = now
            self.probe()
        with self._switch:
            self._settle()
