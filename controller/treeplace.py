"""Placing a job over a tree of switches (``[[switches]]``: homagg.treeconfig), as the service
does once every rank of it has joined.

Each rank sits under the switch whose network holds its address. The job's root is the lowest
switch above all of them; every switch on the way from a rank's switch up to the root holds
the job, under the same job id: its workers are its own ranks (in rank order), then the
switches below it that hold the job (in the config's order). Every switch but the root holds a
*child job* (``controller.jobs`` writes its uplink, p4/include/control/uplink.p4): its round,
complete there, goes up to its parent as one worker's contribution, and the parent's result
comes back down, as ``launcher/tree.py``'s static trees do. A job whose ranks all sit under one
switch is a plain job there. Each switch's job has a key of its own; a child job's uplink
carries its parent's.

What can be short, each checked before anything is written and said in one line naming the
switch: a worker id per switch job (64 at most: its ranks and the switches below it), a slot
region on each switch (the root's job may go to the ``[fallback]`` instead, as on one switch),
and an uplink port per child job (a switch's child jobs under one parent go up from ports of
their own, 0xBEE0-0xBEEF, which is how the parent tells them apart).

Which worker a lease names: the job's senders in tree order (the root's workers by id, a switch
below in its place by its own), which ``senders_of`` computes alike from what was written and
from what a restarted service reads back.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from homagg import wire
from homagg.controller import jobs as J
from homagg.controller import placement as P
from homagg.controller.p4client import SwitchError
from homagg.controller.service_state import (
    NO_MAC,
    Answer,
    Refusal,
    mark_job,
    read_jobs_mark,
    write_jobs_mark,
)
from homagg.controller.switch import Switch
from homagg.errors import HomaggError, JobError
from homagg.netconfig import Config, JobSpec, Uplink, Worker, validate_job
from homagg.regions import NoFreeRegion, allocate_region
from homagg.treeconfig import Tree

__all__ = ["SwitchJob", "TreePlan", "answers", "place", "plan", "read_marked", "senders_of",
           "tree_of", "unmark", "write"]

Address = tuple[str, int]
log = logging.getLogger("homagg.service")


def tree_of(cfg: Config) -> Tree:
    return Tree.of(cfg.switch.name, cfg.switch.under, cfg.switches)


@dataclass(frozen=True)
class SwitchJob:
    """The job at one switch of its tree."""

    name: str                        # the tree's switch (the root's, where it fell back)
    place: P.Place                   # where it is written: that switch, or the fallback
    spec: JobSpec
    ranks: tuple[int | None, ...]    # by worker id: the rank, or None for a switch below
    send_port: int                   # where its ranks send: its uplink's src_port, or 0xBEE0


@dataclass(frozen=True)
class TreePlan:
    job_id: int
    jobs: tuple[SwitchJob, ...]      # a parent before its children; the root first
    under: Mapping[int, str]         # rank -> the switch it sits under

    @property
    def tree(self) -> bool:
        """Whether the job spans several switches (else it is a plain job on one)."""
        return len(self.jobs) > 1

    def at(self, rank: int) -> tuple[SwitchJob, int]:
        """The switch job ``rank`` sends to, and its worker id there."""
        sj = next(j for j in self.jobs if j.name == self.under[rank])
        return sj, sj.ranks.index(rank)

    def siblings(self, rank: int) -> tuple[str, ...]:
        """The workers of the parent of ``rank``'s switch, in id order (what a timeout names);
        none at the root."""
        sj, _ = self.at(rank)
        if sj.spec.uplink is None:
            return ()
        parent = next(j for j in self.jobs if j.place.ip == sj.spec.uplink.ip)
        return tuple(w.host or f"{w.ip}:{w.udp_port}" for w in parent.spec.workers)


def _short(shortages: list[str], code: str, name: str, world: int) -> None:
    if shortages:
        raise Refusal(code, f"job {name!r} ({world} workers) does not fit the tree: "
                            + "; ".join(shortages))


def plan(cfg: Config, places: Mapping[str, P.Place], fallback: P.Place | None, job_id: int,
         name: str, ranks: Mapping[int, Address], slots: int,
         installed: Mapping[str, list[J.InstalledJob]],
         key: Callable[[], int] = lambda: secrets.randbits(32) or 1) -> TreePlan:
    """Where job ``name`` (``ranks``: rank -> its address) goes in the tree, every check made:
    a Refusal names each switch where something is short. ``places``: the tree's switches by
    name; ``installed``: the jobs each place (the fallback's included) holds now."""
    tree = tree_of(cfg)
    under: dict[int, str] = {}
    for r, (ip, _) in sorted(ranks.items()):
        s = tree.switch_of(ip)
        if s is None:
            raise Refusal("INVALID_ARGUMENT",
                          f"job {name!r}: rank {r}'s address {ip} sits under no switch of the "
                          "tree (the config's [switch] and [[switches]] 'under')")
        under[r] = s
    top = tree.top(sorted(set(under.values())))
    paths = [tree.path(s) for s in set(under.values())]
    used = {n for path in paths for n in path[:path.index(top) + 1]}
    order = [top]
    for n in order:
        order += [c for c in tree.children[n] if c in used]
    below = {n: [c for c in tree.children[n] if c in used] for n in order}
    mine = {n: sorted(r for r, s in under.items() if s == n) for n in order}
    too_many = [f"{n} would hold {len(mine[n]) + len(below[n])} of its workers ("
                f"{len(mine[n])} ranks under it, {len(below[n])} switches below), at most "
                f"{wire.MAX_WORKERS} per switch" for n in order
                if len(mine[n]) + len(below[n]) > wire.MAX_WORKERS]
    _short(too_many, "FAILED_PRECONDITION", name, len(ranks))
    short: list[str] = []
    where: dict[str, P.Place] = {}
    for n in order:
        pl = places[n]
        try:
            allocate_region(slots, [j.region for j in installed.get(n, [])], pl.pool)
            where[n] = pl
        except NoFreeRegion as e:
            fb = fallback if n == top else None  # (a child job stays where its workers are)
            if fb is not None and _fits(slots, installed.get(fb.name, []), fb.pool):
                where[n] = fb
            else:
                short.append(f"{n} has {e.shortage}")
    port: dict[str, int] = {top: wire.HOMAGG_UDP_PORT_MIN}
    for n in order[1:]:
        up = where.get(tree.parent[n], places[tree.parent[n]])
        taken = {j.uplink.src_port for j in installed.get(n, [])
                 if j.uplink is not None and j.uplink.ip == up.ip}
        # (and the ports the parent still has this switch send from: a job whose part here
        # is gone, the switch started again, while its part there is not removed yet)
        taken |= {w.udp_port for j in installed.get(up.name, []) for w in j.senders
                  if w.ip == places[n].ip}
        free = [p for p in wire.HOMAGG_UDP_PORTS if p not in taken]
        if not free:
            short.append(f"{n} has no free uplink port to {tree.parent[n]} (all "
                         f"{len(wire.HOMAGG_UDP_PORTS)}, {wire.HOMAGG_UDP_PORT_MIN:#x}-"
                         f"{wire.HOMAGG_UDP_PORT_MAX:#x}, carry its child jobs there)")
        else:
            port[n] = free[0]
    _short(short, "RESOURCE_EXHAUSTED", name, len(ranks))
    keys = {n: key() for n in order}
    switch = {s.name: s for s in cfg.switches}
    jobs: list[SwitchJob] = []
    for n in order:
        pl = where[n]
        workers = [_host(cfg, pl, *ranks[r]) for r in mine[n]]
        for c in below[n]:
            sc = switch[c]
            workers.append(Worker(sc.ip, port[c], sc.mac, sc.parent_port, c))
        spec = validate_job(job_id, workers, slots, "switch" if pl.role == "switch" else
                            "fallback", key=keys[n])
        if n != top:
            p = tree.parent[n]
            parent = where[p]
            spec = JobSpec(spec.id, spec.workers, spec.slots, "switch",
                           Uplink(job_id, below[p].index(n) + len(mine[p]), parent.ip,
                                  wire.HOMAGG_UDP_PORT_MIN, _mac_of(cfg, p, parent), port[n],
                                  switch[n].uplink_port, keys[p]), keys[n])
        jobs.append(SwitchJob(n, pl, spec, tuple(mine[n]) + (None,) * len(below[n]), port[n]))
    return TreePlan(job_id, tuple(jobs), under)


def place(f: P.Fabric, cfg: Config, job_id: int, name: str, ranks: Mapping[int, Address],
          slots: int, placed: list[P.PlacedJob], dead: Mapping[str, str] | None = None
          ) -> tuple[TreePlan, P.Place, tuple[Address, ...]]:
    """Job ``name`` planned (``placed``: every place's jobs now) and written: its plan, its
    root's place and its senders in tree order (what its leases name). ``dead``: the switches
    taken for dead (name -> why); a job that needs one is refused (UNAVAILABLE), one that
    does not is placed all the same."""
    installed: dict[str, list[J.InstalledJob]] = {}
    for pj in placed:
        installed.setdefault(pj.place.name, []).append(pj.job)
    tp = plan(cfg, {pl.name: pl for pl in [f.switch, *f.tree]}, f.fallback, job_id, name, ranks,
              slots, installed)
    down = [sj.place.name for sj in tp.jobs if dead and sj.place.name in dead]
    if down:
        assert dead is not None
        raise Refusal("UNAVAILABLE", f"job {name!r} needs {', '.join(down)}: "
                                     + "; ".join(dead[n] for n in down)
                                     + " (join again once it is back)")
    try:
        written = write(f, tp)
    except JobError as e:  # a sender another job has: said, nothing left written
        raise Refusal("FAILED_PRECONDITION", f"job {name!r}: {e}") from None
    root, senders = senders_of({sj.place: written[sj.name] for sj in tp.jobs})
    return tp, root, senders


def answers(tp: TreePlan, senders: tuple[Address, ...], ranks: Mapping[int, Address], run: int,
            lease: float, secret: Callable[[int, Address], str]) -> dict[int, Answer]:
    """Each rank's answer: where it sends (its switch, at its job's port), the worker its
    lease names (its place in ``senders``) with that worker's ``secret``, and in a tree its id
    in its switch's job, that job's size and its switch's parent's workers."""
    out = {}
    order = {a: i for i, a in enumerate(senders)}
    for r in range(len(ranks)):
        sj, w = tp.at(r)
        me = order[ranks[r]]
        out[r] = Answer((sj.place.ip, sj.send_port), tp.job_id, me, len(ranks), sj.spec.slots,
                        sj.place.name, sj.place.role, run, lease, ranks[r][0],
                        secret(me, ranks[r]), sj.spec.key, w if tp.tree else 0,
                        len(sj.spec.workers) if tp.tree else 0, tp.siblings(r))
    return out


def _fits(slots: int, jobs: list[J.InstalledJob], pool: int) -> bool:
    try:
        allocate_region(slots, [j.region for j in jobs], pool)
        return True
    except JobError:
        return False


def _mac_of(cfg: Config, name: str, place: P.Place) -> str:
    """The next hop toward switch ``name``'s job at ``place`` (its MAC; the fallback's)."""
    if place.role == "fallback" and cfg.fallback is not None:
        return cfg.fallback.mac
    if name == cfg.switch.name:
        return cfg.switch.mac
    return next(s.mac for s in cfg.switches if s.name == name)


def _host(cfg: Config, place: P.Place, ip: str, port: int) -> Worker:
    """A rank's worker entry at its switch: bmv2 needs the host's port and MAC there."""
    for h in cfg.hosts:
        if h.ip == ip:
            return Worker(ip, port, h.mac, h.port, h.name)
    if place.target == "soft":
        return Worker(ip, port, NO_MAC, 0)
    raise Refusal("INVALID_ARGUMENT", f"{ip} is not one of the config's hosts: its switch "
                                      f"({place.name}, bmv2) needs each worker's switch port "
                                      "and MAC ([[hosts]])")


def write(f: P.Fabric, tp: TreePlan) -> dict[str, J.InstalledJob]:
    """Every switch job of ``tp``, parents first, each marked as the service's before it is
    written (a service killed between the two leaves a mark without its job, cleared when it
    is read back, never a job nobody marked); what was written is undone if a write fails.
    The jobs written, by switch."""
    done: list[P.Place] = []
    out: dict[str, J.InstalledJob] = {}
    try:
        for sj in tp.jobs:
            sw = f.session(sj.place)
            done.append(sj.place)
            mark_job(sw, tp.job_id, True)
            out[sj.name] = J.add_job(sw, sj.spec, sj.place.pool)
    except BaseException:
        for pl in reversed(done):
            try:
                unmark(f.session(pl), tp.job_id, remove=True)
            except (HomaggError, JobError):
                pass  # (logged by the caller's refusal; the reaper never knew the job)
        raise
    return out


def unmark(sw: Switch, job_id: int, remove: bool) -> None:
    """Remove job ``job_id`` from ``sw`` (if ``remove``; gone already is fine) and clear its
    mark there."""
    if remove:
        try:
            J.remove_job(sw, job_id)
        except JobError:
            pass
    mark_job(sw, job_id, False)


def read_marked(f: P.Fabric) -> dict[int, dict[P.Place, J.InstalledJob]]:
    """The jobs the service marked on each place (a mark whose job is gone is cleared): job id
    -> place -> its job there. A fallback that does not answer is skipped (its jobs run on,
    and stay: job remove), a switch that does not is an error."""
    parts: dict[int, dict[P.Place, J.InstalledJob]] = {}
    for place in f.places():
        try:
            sw = f.session(place)
        except SwitchError as e:
            if place.role == "switch":
                raise
            log.warning("fallback %s unreachable, its jobs not read back: %s", place.name, e)
            continue
        mask = read_jobs_mark(sw)
        if not mask:
            continue
        keep = 0
        for j in J.list_jobs(sw):
            if mask >> j.id & 1:
                keep |= 1 << j.id
                parts.setdefault(j.id, {})[place] = j
        if keep != mask:
            write_jobs_mark(sw, keep)
    return parts


def senders_of(found: Mapping[P.Place, J.InstalledJob]) -> tuple[P.Place, tuple[Address, ...]]:
    """A job's root and its senders in tree order, from its switch jobs (``found``: place ->
    the job there): the root's workers by id, where one is a switch below holding the job (its
    child job goes up to this place from that address and port) that switch's in its place."""
    by_ip = {pl.ip: (pl, j) for pl, j in found.items()}
    root = next((pl for pl, j in found.items() if j.uplink is None or j.uplink.ip not in by_ip),
                next(iter(found)))

    def walk(pl: P.Place, seen: set[str]) -> list[Address]:
        out: list[Address] = []
        for s in found[pl].senders:
            child = by_ip.get(s.ip)
            up = child[1].uplink if child is not None else None
            if child is not None and child[0].name not in seen and up is not None \
                    and up.ip == pl.ip and up.src_port == s.udp_port:
                out += walk(child[0], seen | {child[0].name})
            else:
                out.append((s.ip, s.udp_port))
        return out

    return root, tuple(walk(root, {root.name}))
