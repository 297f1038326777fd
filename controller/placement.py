"""Where a job runs: on the switch while its slot pool lasts, else on the fallback aggregator.

ATP falls back to a parameter server and SwitchML to a software path when the switch is full;
homagg's fallback is a software aggregator (``homagg-softswitch``) that speaks the same wire
protocol and serves the same P4Runtime subset, so one code path (``controller.jobs``) installs,
lists, resets and counts jobs in both places. Its agents only send to another address.

Nothing here is remembered: each place's job table says which jobs it holds, so a job's place
is found by reading both. A job id is unique across the two, and so is a sender.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from homagg import _p4consts as P4
from homagg import wire
from homagg.controller import jobs as J
from homagg.controller.p4client import SwitchError, TableEntry
from homagg.controller.switch import Switch
from homagg.errors import JobError
from homagg.netconfig import Config, GrpcTls, JobSpec
from homagg.regions import NoFreeRegion

log = logging.getLogger("homagg.placement")

# What reset says of registers on a software aggregator: the new epoch empties the region.
SOFT_REGISTERS = "skipped (software aggregator: the new epoch empties the region)"


@dataclass(frozen=True)
class Place:
    """A switch or the fallback aggregator, as the controller and the agents see it."""

    name: str     # the config's switch or fallback name ("s1", "fb")
    role: str     # "switch" or "fallback"
    target: str   # "bmv2", "soft" or "tofino"
    ip: str       # where this place's agents send
    pool: int     # the slots homagg may use here
    grpc: str     # its P4Runtime address
    device_id: int
    thrift_port: int | None = None  # bmv2's Thrift CLI, for register resets
    tls: GrpcTls | None = None      # its P4Runtime over TLS

    @property
    def address(self) -> str:
        return f"{self.ip}:{wire.HOMAGG_UDP_PORT_MIN}"

    def describe(self) -> str:
        what = "software aggregator" if self.target == "soft" else self.target
        return f"{self.name} ({what}, {self.ip})"


@dataclass(frozen=True)
class PlacedJob:
    job: J.InstalledJob
    place: Place
    why: str = ""  # set by add(): why the job is where it is

    def to_json(self) -> dict:
        return {**self.job.to_json(), "place": self.place.role, "on": self.place.name,
                "send_to": self.place.address}


def switch_place(cfg: Config) -> Place:
    s = cfg.switch
    pool = s.slots or wire.SLOTS
    return Place(s.name, "switch", s.target, s.ip, pool, s.grpc, s.device_id,
                 s.thrift_port if s.target == "bmv2" else None, s.tls)


def tree_places(cfg: Config) -> list[Place]:
    """The switches of a tree below ``[switch]`` (``[[switches]]``: homagg.treeconfig), in the
    config's order; none for one switch."""
    return [Place(s.name, "switch", s.target, s.ip, s.slots or wire.SLOTS, s.grpc, s.device_id,
                  s.thrift_port if s.target == "bmv2" else None, s.tls) for s in cfg.switches]


def fallback_place(cfg: Config) -> Place | None:
    fb = cfg.fallback
    return None if fb is None else Place(fb.name, "fallback", "soft", fb.ip, wire.SLOTS,
                                         fb.grpc, fb.device_id, None, fb.tls)


class Fabric:
    """The switch, a tree's switches below it, and, where the config names one, its fallback:
    open sessions to each.

    ``connect(place)`` opens a session to ``place.grpc`` (``homagg-ctl`` passes one that logs
    requests, and pushes a pipeline on install); each is opened on first use, so a config
    without a fallback, or a command that never needs it, does not wait for it."""

    def __init__(self, cfg: Config, connect: Callable[[Place], Switch],
                 dead: Mapping[str, str] | None = None):
        self.cfg = cfg
        #: places taken for dead (the service's probes: place name -> why), never waited on:
        #: a session to one fails at once, and a tree's switch among them is left out of
        #: ``list`` (the service knows what it placed there); None: every place is tried
        self.dead = dead
        self.switch = switch_place(cfg)
        self.fallback = fallback_place(cfg)
        self.tree = tree_places(cfg)
        self._connect = connect
        self._sessions: dict[str, Switch] = {}
        self.unreachable: dict[str, str] = {}  # place name -> why, for list and stats

    def session(self, place: Place) -> Switch:
        if place.name not in self._sessions:
            if self.dead is not None and place.name in self.dead:
                raise SwitchError(self.dead[place.name])
            self._sessions[place.name] = self._connect(place)
        return self._sessions[place.name]

    def places(self) -> list[Place]:
        return [self.switch, *self.tree] + ([self.fallback] if self.fallback else [])

    def _reachable_sessions(self) -> Iterator[tuple[Place, Switch]]:
        """Every place that answers; a fallback that does not is noted, not fatal: the
        switch's jobs are still worth listing."""
        for p in self.places():
            if self.dead is not None and p.name in self.dead and p in self.tree:
                continue
            try:
                yield p, self.session(p)
            except SwitchError as e:
                if p.role == "switch":
                    raise
                self.unreachable[p.name] = str(e)

    def close(self) -> None:
        for sw in self._sessions.values():
            sw.close()
        self._sessions.clear()

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- jobs ------------------------------------------------------------------------------
    def list(self) -> list[PlacedJob]:
        out = [PlacedJob(j, p) for p, sw in self._reachable_sessions() for j in J.list_jobs(sw)]
        return sorted(out, key=lambda pj: pj.job.id)

    def find(self, job_id: int) -> PlacedJob:
        for pj in self.list():
            if pj.job.id == job_id:
                return pj
        gone = f" ({', '.join(self.unreachable)} unreachable)" if self.unreachable else ""
        raise JobError(f"job {job_id} is not installed{gone}")

    def add(self, spec: JobSpec) -> PlacedJob:
        """Install ``spec`` where its ``place`` says: ``auto`` tries the switch, and a job the
        switch has no room for goes to the fallback. Raises JobError with both reasons if
        neither can take it."""
        fb = self.fallback
        if spec.place == "fallback" and fb is None:
            raise JobError(f"job {spec.id}: place 'fallback', but the config has no [fallback]")
        placed = {pj.job.id: pj for pj in self.list()}
        if spec.id in placed:
            raise JobError(f"job {spec.id} is already installed on "
                           f"{placed[spec.id].place.name} (remove it first)")
        if self.unreachable and spec.place != "switch":
            # An unreachable fallback might hold this id or these senders: do not guess.
            raise JobError(f"fallback {', '.join(self.unreachable)} unreachable: "
                           f"{'; '.join(self.unreachable.values())}")
        senders = {(s.ip, s.udp_port): pj for pj in placed.values() for s in pj.job.senders}
        for w in spec.workers:
            if (w.ip, w.udp_port) in senders:
                other = senders[(w.ip, w.udp_port)]
                raise JobError(f"{w.ip}:{w.udp_port} already sends for job {other.job.id} "
                               f"(on {other.place.name})")
        if spec.uplink is not None and spec.place == "fallback":
            raise JobError(f"job {spec.id}: a tree's child job stays on its switch, where its "
                           "parent answers (uplink): not place 'fallback'")
        if spec.place == "fallback":
            assert fb is not None
            return PlacedJob(J.add_job(self.session(fb), spec, fb.pool), fb,
                             "placed on the fallback, as asked")
        try:
            return PlacedJob(J.add_job(self.session(self.switch), spec, self.switch.pool),
                             self.switch)
        except NoFreeRegion as full:
            if spec.place == "switch" or fb is None or spec.uplink is not None:
                raise  # (a child job cannot fall back: its parent answers this switch)
            try:
                job = J.add_job(self.session(fb), spec, fb.pool)
            except JobError as e:
                raise JobError(f"job {spec.id} fits neither on {self.switch.name} ({full}) "
                               f"nor on {fb.name} ({e})") from None
            log.info("job %d fell back to %s: %s", spec.id, fb.name, full.shortage)
            return PlacedJob(job, fb, f"fell back: {self.switch.name} has {full.shortage}")

    def remove(self, job_id: int) -> PlacedJob:
        """Remove job ``job_id`` from every place that holds it (a tree's job is on each of its
        switches, under one id); the first place's (the root's) job."""
        found = [pj for pj in self.list() if pj.job.id == job_id] or [self.find(job_id)]
        out = [PlacedJob(J.remove_job(self.session(pj.place), job_id), pj.place)
               for pj in found]
        return out[0]

    def reset(self, job_id: int) -> tuple[J.ResetResult, Place]:
        pj = self.find(job_id)
        res = J.reset_job(self.session(pj.place), job_id, pj.place.thrift_port)
        if pj.place.target == "soft":
            res = J.ResetResult(res.job, res.epoch, SOFT_REGISTERS)
        return res, pj.place

    def stats(self) -> dict[str, tuple[Place, J.SwitchStats]]:
        return {p.name: (p, J.read_stats(sw)) for p, sw in self._reachable_sessions()}

    # -- installation ----------------------------------------------------------------------
    def install_fallback_base(self) -> None:
        """The fallback aggregates what is sent to its own address (its local_ip entry);
        it forwards nothing, so it needs no routes."""
        fb = self.fallback
        if fb is None:
            return
        self.session(fb).insert(TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": J.ip_int(fb.ip)},
                                           P4.ACTION_TO_SWITCH), or_modify=True)
