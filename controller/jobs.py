"""What the controller writes to a switch: base forwarding, jobs, and their reset.

The switch is the source of truth: ``list_jobs`` reads the job table back, so the CLI keeps no
state of its own. Slot regions are allocated first-fit (``homagg.regions``) against the regions
already installed; a job that does not fit is refused with the free space named. Every P4 name
comes from the generated P4Info constants. ``sw`` is a ``controller.switch.Switch``: bmv2 or the
software aggregator over P4Runtime, or the software aggregator in process
(``controller.local``). This is homagg's one job logic: no target has a copy of its own.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from homagg import _p4consts as P4
from homagg import wire
from homagg.controller.p4client import (
    CounterValue,
    SwitchError,
    TableEntry,
)
from homagg.controller.switch import Switch
from homagg.errors import JobError
from homagg.netconfig import (  # noqa: F401 (the address converters: callers use jobs.ip_int)
    Config,
    JobSpec,
    Uplink,
    int_ip,
    int_mac,
    ip_int,
    mac_int,
    uplink_clash,
)
from homagg.programs import V1MODEL, Program, program_of
from homagg.regions import allocate_region, mcast_group

__all__ = ["InstalledJob", "JobCounters", "JobError", "ResetResult", "SwitchStats",
           "add_job", "find_job", "install_base", "list_jobs", "read_stats", "remove_job",
           "reset_job"]


@dataclass(frozen=True)
class Sender:
    worker: int
    ip: str
    udp_port: int
    switch_port: int


@dataclass(frozen=True)
class InstalledJob:
    """A job as the switch's job table holds it."""

    id: int
    senders: tuple[Sender, ...]   # by worker id
    epoch: int
    base: int
    size: int
    group: int
    uplink: Uplink | None = None  # a tree's child job: its parent (uplink table)
    key: int = 0                  # the job's key (the auth its packets carry)

    @property
    def region(self) -> range:
        return range(self.base, self.base + self.size)

    @property
    def workers(self) -> int:
        return len(self.senders)

    def to_json(self) -> dict:
        out = {"id": self.id, "workers": [{"worker": s.worker, "ip": s.ip,
                                           "udp_port": s.udp_port} for s in self.senders],
               "epoch": self.epoch, "slot_base": self.base, "slots": self.size,
               "group": self.group, "keyed": self.key != 0}
        if self.uplink is not None:
            u = self.uplink
            out["uplink"] = {"job": u.job, "worker": u.worker, "ip": u.ip,
                             "udp_port": u.udp_port, "src_port": u.src_port}
        return out


@dataclass(frozen=True)
class ResetResult:
    job: int
    epoch: int
    registers: str  # what happened to the region's registers


@dataclass(frozen=True)
class JobCounters:
    """A job's counters, by JOB_STATS name (packets, bytes)."""

    cells: dict[str, CounterValue]

    def packets(self, name: str) -> int:
        return self.cells[name].packets


@dataclass(frozen=True)
class SwitchStats:
    switch: dict[str, int]                       # STATS name -> packets
    forwarding: dict[str, int]                   # FWD_STATS name -> packets
    jobs: dict[int, JobCounters] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"switch": self.switch, "forwarding": self.forwarding,
                "jobs": {j: {n: {"packets": v.packets, "bytes": v.bytes}
                             for n, v in c.cells.items()} for j, c in self.jobs.items()}}


# -- base forwarding -----------------------------------------------------------------------


def install_base(sw: Switch, cfg: Config) -> None:
    """The switch's own address, proxy ARP for it and every host, and /32 routes to hosts
    (and to the fallback aggregator, where it hangs off this switch)."""
    s, n = cfg.switch, program_of(sw)
    sw.insert(TableEntry(n.table_local_ip, {"dst_addr": ip_int(s.ip)}, n.action_to_switch),
              or_modify=True)
    sw.insert(TableEntry(n.table_arp_proxy, {"tpa": ip_int(s.ip)}, n.action_arp_reply,
                         {"mac": mac_int(s.mac)}), or_modify=True)
    routed = [(h.ip, h.mac, h.port) for h in cfg.hosts]
    fb = cfg.fallback
    if fb is not None and fb.port is not None:  # the fallback aggregator hangs off this switch:
        routed.append((fb.ip, fb.mac, fb.port))  # route to it, and its results to the workers
        trust_aggregator(sw, fb.ip, fb.port)
    for ip, mac, port in routed:
        add_route(sw, cfg, ip, mac, port, proxy_arp=ip != s.ip)


def trust_aggregator(sw: Switch, ip: str, port: int) -> None:
    """Let homagg packets from the aggregator at ``ip`` (behind switch port ``port``) through
    as routed traffic: forwarding.p4 drops a packet from homagg's source ports otherwise, so
    that a host cannot forge a result for another."""
    n = program_of(sw)
    sw.insert(TableEntry(n.table_aggregators, {"src_addr": ip_int(ip), "port": port},
                         n.action_trusted), or_modify=True)


def add_route(sw: Switch, cfg: Config, ip: str, mac: str, port: int,
              proxy_arp: bool = True) -> None:
    """A /32 route to ``ip`` out of switch port ``port``, to next hop ``mac`` (the host, or
    the switch in front of it), and (``proxy_arp``) this switch answering ARP for it."""
    s, n = cfg.switch, program_of(sw)
    if proxy_arp:
        sw.insert(TableEntry(n.table_arp_proxy, {"tpa": ip_int(ip)}, n.action_arp_reply,
                             {"mac": mac_int(s.mac)}), or_modify=True)
    sw.insert(TableEntry(n.table_ipv4_route, {"dst_addr": (ip_int(ip), 32)},
                         n.action_route, {"port": port, "src_mac": mac_int(s.mac),
                                           "dst_mac": mac_int(mac)}), or_modify=True)


# -- jobs ----------------------------------------------------------------------------------


def list_jobs(sw: Switch) -> list[InstalledJob]:
    n = program_of(sw)
    by_job: dict[int, dict] = {}
    for e in sw.read(n.table_job_workers):
        if e.action != n.action_set_worker:  # e.g. a NoAction entry another client wrote:
            continue                          # it admits nobody, so it is no job's sender
        p = e.params
        j = by_job.setdefault(p["job"], {"senders": [], **p})
        j["senders"].append(Sender(p["worker"], int_ip(e.match["src_addr"]),
                                   e.match["src_port"], p["port"]))
    ups = {} if n.table_uplink is None else \
        {e.match["job"]: e.params for e in sw.read(n.table_uplink)
         if e.action == n.action_set_uplink}
    return [InstalledJob(j, tuple(sorted(v["senders"], key=lambda s: s.worker)), v["epoch"],
                         v["region_base"], v["region_size"], v["mcast_group"],
                         _uplink_of(ups[j]) if j in ups else None, v["auth"])
            for j, v in sorted(by_job.items())]


def _uplink_of(p: Mapping[str, int]) -> Uplink:
    return Uplink(p["job"], p["worker"], int_ip(p["ip"]), p["udp_port"], int_mac(p["mac"]),
                  p["src_port"], p["port"], p["auth"])


def _uplink_entry(job_id: int, u: Uplink, n: Program = V1MODEL) -> TableEntry:
    assert n.table_uplink is not None and n.action_set_uplink is not None
    return TableEntry(n.table_uplink, {"job": job_id}, n.action_set_uplink,
                      {"job": u.job, "worker": u.worker, "mac": mac_int(u.mac),
                       "ip": ip_int(u.ip), "udp_port": u.udp_port, "src_port": u.src_port,
                       "port": u.switch_port, "auth": u.key})


def _parent_match(u: Uplink) -> dict:
    return {"src_addr": ip_int(u.ip), "src_port": u.udp_port, "parent_job": u.job,
            "parent_auth": u.key}


def _parent_entry(job_id: int, u: Uplink, workers: int, epoch: int, base: int, size: int,
                  group: int, key: int, n: Program = V1MODEL) -> TableEntry:
    """Admission's parents table: the parent's answers carry this job (uplink.p4), and its
    key on the way down."""
    assert n.table_parents is not None and n.action_set_parent is not None
    return TableEntry(n.table_parents, _parent_match(u), n.action_set_parent,
                      {"job": job_id, "workers": workers, "epoch": epoch, "region_base": base,
                       "region_size": size, "mcast_group": group, "port": u.switch_port,
                       "auth": key})


def next_epoch(sw: Switch) -> int:
    """A job epoch never handed out before on this switch (kept in a counter cell: bmv2's
    P4Runtime cannot write registers, and counters survive controller restarts)."""
    stats = program_of(sw).counter_stats
    cells = sw.read_counter(stats)
    last = cells.get(wire.EPOCH_STORE, CounterValue()).packets
    epoch = last % 0xFFFF + 1  # 1..65535; 0 is what fresh registers hold
    sw.write_counter(stats, {wire.EPOCH_STORE: CounterValue(epoch, 0)})
    return epoch


def _worker_entry(job_id: int, s: Sender, workers: int, epoch: int, base: int, size: int,
                  group: int, key: int, n: Program = V1MODEL) -> TableEntry:
    return TableEntry(n.table_job_workers, {"src_addr": ip_int(s.ip), "src_port": s.udp_port},
                      n.action_set_worker,
                      {"job": job_id, "worker": s.worker, "workers": workers, "epoch": epoch,
                       "region_base": base, "region_size": size, "mcast_group": group,
                       "port": s.switch_port, "auth": key})


def _result_key(job_id: int, worker: int) -> dict:
    return {"job": job_id, "rid": worker + wire.RID_WORKER_OFFSET}


def add_job(sw: Switch, job: JobSpec, pool: int = wire.SLOTS) -> InstalledJob:
    """Install ``job`` in the first free region of the switch's first ``pool`` slots."""
    n = program_of(sw)
    if len(job.workers) > n.max_workers:
        raise JobError(f"job {job.id} has {len(job.workers)} workers; a {n.name} switch takes "
                       f"at most {n.max_workers} per job")
    if job.uplink is not None and not n.supports_trees:
        raise JobError(f"job {job.id} has an uplink (a tree); the {n.name} program has no "
                       "uplink: its jobs' workers all hang off the switch")
    installed = list_jobs(sw)
    if any(j.id == job.id for j in installed):
        raise JobError(f"job {job.id} is already installed (remove it first)")
    senders = {(s.ip, s.udp_port): j.id for j in installed for s in j.senders}
    for w in job.workers:
        if (w.ip, w.udp_port) in senders:
            raise JobError(f"{w.ip}:{w.udp_port} already sends for job "
                           f"{senders[(w.ip, w.udp_port)]}")
    if job.uplink is not None:  # several child jobs of one switch: a source port each
        for j in installed:
            why = None if j.uplink is None else uplink_clash(j.id, j.uplink, job.id, job.uplink)
            if why:
                raise JobError(why)
    base = allocate_region(job.slots, [j.region for j in installed], pool)
    epoch = next_epoch(sw)
    group = mcast_group(job.id)
    # Egress addressing and the group first: once the job table matches, results can flow.
    for wid, w in enumerate(job.workers):
        sw.insert(TableEntry(n.table_result_dst, _result_key(job.id, wid),
                             n.action_set_result_dst,
                             {"mac": mac_int(w.mac), "ip": ip_int(w.ip), "port": w.udp_port}),
                  or_modify=True)
    sw.set_multicast_group(group, [(w.switch_port, wid + wire.RID_WORKER_OFFSET)
                                   for wid, w in enumerate(job.workers)])
    new = tuple(Sender(wid, w.ip, w.udp_port, w.switch_port) for wid, w in enumerate(job.workers))
    if job.uplink is not None:  # a tree's child job: the parent's answers, then where to go
        sw.insert(_parent_entry(job.id, job.uplink, len(new), epoch, base, job.slots, group,
                                job.key, n), or_modify=True)
        sw.insert(_uplink_entry(job.id, job.uplink, n), or_modify=True)
    for s in new:
        sw.insert(_worker_entry(job.id, s, len(new), epoch, base, job.slots, group, job.key, n))
    reset_job_counters(sw, job.id)
    return InstalledJob(job.id, new, epoch, base, job.slots, group, job.uplink, job.key)


def find_job(sw: Switch, job_id: int) -> InstalledJob:
    for j in list_jobs(sw):
        if j.id == job_id:
            return j
    raise JobError(f"job {job_id} is not installed")


def remove_job(sw: Switch, job_id: int) -> InstalledJob:
    n = program_of(sw)
    job = find_job(sw, job_id)
    for s in job.senders:
        sw.delete(TableEntry(n.table_job_workers, {"src_addr": ip_int(s.ip),
                                                   "src_port": s.udp_port}))
    for s in job.senders:
        try:
            sw.delete(TableEntry(n.table_result_dst, _result_key(job.id, s.worker)))
        except SwitchError:
            pass  # already gone: removal is best effort past the job table
    try:
        sw.delete_multicast_group(job.group)
    except SwitchError:
        pass
    if job.uplink is not None and n.table_uplink is not None and n.table_parents is not None:
        for table, match in ((n.table_uplink, {"job": job.id}),
                             (n.table_parents, _parent_match(job.uplink))):
            try:
                sw.delete(TableEntry(table, match))
            except SwitchError:
                pass
    return job


def reset_job_counters(sw: Switch, job_id: int) -> None:
    base = job_id * wire.JOB_STATS_PER_JOB
    sw.write_counter(program_of(sw).counter_job_stats,
                     {base + k: CounterValue() for k in range(wire.JOB_STATS_PER_JOB)})


def reset_job(sw: Switch, job_id: int, thrift_port: int | None = None) -> ResetResult:
    """Start the job afresh: a new epoch makes every slot of its region empty to the data plane
    (agents restart their sequence numbers), its counters go to zero, and where bmv2's Thrift
    CLI is installed the region's registers are zeroed too."""
    n = program_of(sw)
    job = find_job(sw, job_id)
    epoch = next_epoch(sw)
    if job.uplink is not None:
        sw.modify(_parent_entry(job.id, job.uplink, job.workers, epoch, job.base, job.size,
                                job.group, job.key, n))
    for s in job.senders:
        sw.modify(_worker_entry(job.id, s, job.workers, epoch, job.base, job.size, job.group,
                                job.key, n))
    reset_job_counters(sw, job.id)
    registers = "skipped (no Thrift port)"
    if thrift_port is not None:
        registers = clear_region_registers(job, thrift_port)
    return ResetResult(job.id, epoch, registers)


def clear_region_registers(job: InstalledJob, thrift_port: int) -> str:
    from homagg.targets.toolchain import find

    cli = find("simple_switch_CLI")
    if cli.path is None:
        return f"skipped ({cli.how})"
    lines = []
    for r in P4.SCHEMA.registers:
        if r.size == wire.SLOT_STATE_SIZE:  # one cell per slot copy: 2 * slot + phase
            cells = [2 * s + p for s in job.region for p in (0, 1)]
        elif r.size == wire.SLOTS:          # one cell per slot (both copies packed)
            cells = list(job.region)
        else:
            continue
        lines += [f"register_write {r.name} {i} 0" for i in cells]
    proc = subprocess.run([str(cli.path), "--thrift-port", str(thrift_port)],
                          input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0 or "Error" in proc.stdout:
        return f"failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
    return f"zeroed {len(lines)} register cells"


# -- stats ---------------------------------------------------------------------------------


def read_stats(sw: Switch) -> SwitchStats:
    n = program_of(sw)
    stats = sw.read_counter(n.counter_stats)
    fwd = sw.read_counter(n.counter_fwd_stats)
    cells = sw.read_counter(n.counter_job_stats)
    zero = CounterValue()
    out = SwitchStats({name: stats.get(i, zero).packets for i, name in wire.STATS.items()},
                      {name: fwd.get(i, zero).packets for i, name in wire.FWD_STATS.items()})
    for j in list_jobs(sw):
        base = j.id * wire.JOB_STATS_PER_JOB
        out.jobs[j.id] = JobCounters({name: cells.get(base + k, zero)
                                      for k, name in wire.JOB_STATS.items()})
    return out
