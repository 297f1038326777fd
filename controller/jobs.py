"""What the controller writes to the switch: base forwarding, jobs, and their reset.

The switch is the source of truth: ``list_jobs`` reads the job table back, so the CLI keeps no
state of its own. Slot regions are allocated first-fit in [0, SLOTS) against the regions already
installed; a job that does not fit is refused with the free space named.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

from homagg import wire
from homagg.controller.p4client import SwitchConnection, SwitchError
from homagg.errors import JobError
from homagg.netconfig import Config, JobSpec, SwitchSpec
from homagg.regions import allocate_region, mcast_group

# P4Info names (p4/homagg.p4 instance names)
AGG = "HomaggIngress.aggregation"
FWD = "HomaggIngress.forwarding"
T_LOCAL_IP = "HomaggIngress.local_ip"
T_ARP = f"{FWD}.arp_proxy"
T_ROUTE = f"{FWD}.ipv4_route"
T_JOB = f"{AGG}.job_workers"
T_RESULT = "HomaggEgress.result_addressing.result_dst"
C_STATS = f"{AGG}.stats"
C_JOB_STATS = f"{AGG}.job_stats"
C_FWD_STATS = f"{FWD}.fwd_stats"


@dataclass(frozen=True)
class InstalledJob:
    id: int
    workers: tuple[tuple[int, str, int], ...]  # (worker id, ip, udp port)
    epoch: int
    base: int
    size: int
    group: int
    ports: dict = field(default_factory=dict)  # worker id -> switch port

    @property
    def region(self) -> range:
        return range(self.base, self.base + self.size)


def ip_int(ip: str) -> int:
    a, b, c, d = (int(x) for x in ip.split("."))
    return (a << 24) | (b << 16) | (c << 8) | d


def int_ip(v: int) -> str:
    return ".".join(str((v >> s) & 0xFF) for s in (24, 16, 8, 0))


# -- base forwarding -----------------------------------------------------------------------


def install_base(sw: SwitchConnection, cfg: Config) -> None:
    """The switch's own address, proxy ARP for it and every host, and /32 routes to hosts."""
    s: SwitchSpec = cfg.switch
    sw.insert(T_LOCAL_IP, {"hdr.ipv4.dst_addr": s.ip}, "HomaggIngress.to_switch", replace=True)
    for ip in [s.ip] + [h.ip for h in cfg.hosts]:
        sw.insert(T_ARP, {"hdr.arp.tpa": ip}, f"{FWD}.arp_reply", {"mac": s.mac}, replace=True)
    for h in cfg.hosts:
        sw.insert(T_ROUTE, {"hdr.ipv4.dst_addr": f"{h.ip}/32"}, f"{FWD}.route",
                  {"port": h.port, "src_mac": s.mac, "dst_mac": h.mac}, replace=True)


# -- jobs ----------------------------------------------------------------------------------


def list_jobs(sw: SwitchConnection) -> list[InstalledJob]:
    by_job: dict[int, dict] = {}
    for match, _action, p in sw.read_table(T_JOB):
        j = by_job.setdefault(p["job"], {"senders": [], "ports": {}, **p})
        j["senders"].append((p["worker"], int_ip(match["hdr.ipv4.src_addr"]),
                             match["hdr.udp.src_port"]))
        j["ports"][p["worker"]] = p["port"]
    return [InstalledJob(j, tuple(sorted(v["senders"])), v["epoch"], v["region_base"],
                         v["region_size"], v["mcast_group"], v["ports"])
            for j, v in sorted(by_job.items())]


def next_epoch(sw: SwitchConnection) -> int:
    """A job epoch never handed out before on this switch (kept in a counter cell: bmv2's
    P4Runtime cannot write registers, and counters survive controller restarts)."""
    cells = sw.read_counter(C_STATS)
    last = cells.get(wire.EPOCH_STORE, (0, 0))[0]
    epoch = last % 0xFFFF + 1  # 1..65535; 0 is what fresh registers hold
    sw.write_counter(C_STATS, {wire.EPOCH_STORE: (epoch, 0)})
    return epoch


def _worker_entries(job: JobSpec, epoch: int, base: int):
    for wid, w in enumerate(job.workers):
        yield ({"hdr.ipv4.src_addr": w.ip, "hdr.udp.src_port": w.udp_port},
               {"job": job.id, "worker": wid, "workers": len(job.workers), "epoch": epoch,
                "region_base": base, "region_size": job.slots,
                "mcast_group": mcast_group(job.id), "port": w.switch_port})


def add_job(sw: SwitchConnection, job: JobSpec) -> InstalledJob:
    installed = list_jobs(sw)
    if any(j.id == job.id for j in installed):
        raise JobError(f"job {job.id} is already installed (remove it first)")
    senders = {(ip, port): j.id for j in installed for _, ip, port in j.workers}
    for w in job.workers:
        if (w.ip, w.udp_port) in senders:
            raise JobError(f"{w.ip}:{w.udp_port} already sends for job "
                           f"{senders[(w.ip, w.udp_port)]}")
    base = allocate_region(job.slots, [j.region for j in installed])
    epoch = next_epoch(sw)
    # Egress addressing and the group first: once the job table matches, results can flow.
    for wid, w in enumerate(job.workers):
        sw.insert(T_RESULT, {"meta.job": job.id,
                             "standard_metadata.egress_rid": wid + wire.RID_WORKER_OFFSET},
                  "HomaggEgress.result_addressing.set_result_dst",
                  {"mac": w.mac, "ip": w.ip, "port": w.udp_port}, replace=True)
    sw.set_multicast_group(mcast_group(job.id),
                           [(w.switch_port, wid + wire.RID_WORKER_OFFSET)
                            for wid, w in enumerate(job.workers)])
    for match, params in _worker_entries(job, epoch, base):
        sw.insert(T_JOB, match, f"{AGG}.set_worker", params)
    reset_job_counters(sw, job.id)
    return InstalledJob(job.id, tuple((wid, w.ip, w.udp_port) for wid, w in enumerate(job.workers)),
                        epoch, base, job.slots, mcast_group(job.id))


def find_job(sw: SwitchConnection, job_id: int) -> InstalledJob:
    for j in list_jobs(sw):
        if j.id == job_id:
            return j
    raise JobError(f"job {job_id} is not installed")


def remove_job(sw: SwitchConnection, job_id: int) -> InstalledJob:
    job = find_job(sw, job_id)
    for _, ip, port in job.workers:
        sw.delete(T_JOB, {"hdr.ipv4.src_addr": ip, "hdr.udp.src_port": port})
    for wid, _, _ in job.workers:
        try:
            sw.delete(T_RESULT, {"meta.job": job.id,
                                 "standard_metadata.egress_rid": wid + wire.RID_WORKER_OFFSET})
        except SwitchError:
            pass  # already gone: removal is best effort past the job table
    try:
        sw.delete_multicast_group(job.group)
    except SwitchError:
        pass
    return job


def reset_job_counters(sw: SwitchConnection, job_id: int) -> None:
    base = job_id * wire.JOB_STATS_PER_JOB
    sw.write_counter(C_JOB_STATS, {base + k: (0, 0) for k in range(wire.JOB_STATS_PER_JOB)})


def reset_job(sw: SwitchConnection, job_id: int, thrift_port: int | None = None) -> dict:
    """Start the job afresh: a new epoch makes every slot of its region empty to the data plane
    (agents restart their sequence numbers), its counters go to zero, and where bmv2's Thrift
    CLI is installed the region's registers are zeroed too."""
    job = find_job(sw, job_id)
    epoch = next_epoch(sw)
    for _, ip, port in job.workers:
        match = {"hdr.ipv4.src_addr": ip, "hdr.udp.src_port": port}
        wid = [w for w, i, p in job.workers if (i, p) == (ip, port)][0]
        params = {"job": job.id, "worker": wid, "workers": len(job.workers), "epoch": epoch,
                  "region_base": job.base, "region_size": job.size, "mcast_group": job.group,
                  "port": job.ports[wid]}
        sw.modify(T_JOB, match, f"{AGG}.set_worker", params)
    reset_job_counters(sw, job.id)
    registers = "skipped (simple_switch_CLI not found)"
    if thrift_port is not None:
        registers = clear_region_registers(job, thrift_port)
    return {"job": job.id, "epoch": epoch, "registers": registers}


def clear_region_registers(job: InstalledJob, thrift_port: int) -> str:
    from homagg.targets.toolchain import find

    cli = find("simple_switch_CLI")
    if not cli.found:
        return f"skipped ({cli.how})"
    lines = []
    for slot in job.region:
        for phase in (0, 1):
            idx = 2 * slot + phase
            for reg in ("slot_seen", "slot_count", "slot_seq", "slot_epoch", "slot_overflow"):
                lines.append(f"register_write {AGG}.{reg} {idx} 0")
    proc = subprocess.run([str(cli.path), "--thrift-port", str(thrift_port)],
                          input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0 or "Error" in proc.stdout:
        return f"failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
    return f"zeroed {len(lines)} register cells"


# -- stats ---------------------------------------------------------------------------------


def read_stats(sw: SwitchConnection) -> dict:
    stats = sw.read_counter(C_STATS)
    fwd = sw.read_counter(C_FWD_STATS)
    jobs = sw.read_counter(C_JOB_STATS)
    out = {
        "switch": {name: stats.get(i, (0, 0))[0] for i, name in wire.STATS.items()},
        "forwarding": {name: fwd.get(i, (0, 0))[0] for i, name in wire.FWD_STATS.items()},
        "jobs": {},
    }
    for j in list_jobs(sw):
        base = j.id * wire.JOB_STATS_PER_JOB
        out["jobs"][j.id] = {name: {"packets": jobs.get(base + k, (0, 0))[0],
                                    "bytes": jobs.get(base + k, (0, 0))[1]}
                             for k, name in wire.JOB_STATS.items()}
    return out
