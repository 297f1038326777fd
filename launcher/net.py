"""The Mininet topology: N worker hosts around one aggregation switch.

Target ``bmv2``: the switch is simple_switch_grpc running p4/homagg.p4. Target ``soft``: the
switch is a Linux bridge and the software aggregator runs on host ``agg`` at the switch's
address, so workers use the very same address, port and wire protocol either way. Either way
the controller installs it over P4Runtime (the aggregator serves it on a unix socket, which
the root namespace reaches across Mininet's network namespaces).

Host ``fb`` runs a second software aggregator, the fallback: jobs the switch has no slots for
(``--switch-slots`` caps its pool) are placed there by the controller, and their agents are
told to send to it (``--switch`` / $HOMAGG_SWITCH). The switch routes their packets to it.

Every link runs at one MTU: 1500 bytes, or jumbo frames (``--mtu 9000``, both ends of every
link, the bridges and bmv2's ports), which hold packets of up to 2239 words (``--words``; 2176
on bmv2). Each worker link can be shaped with netem on both of its ends: rate (Mbit/s), delay,
jitter, loss, duplication and reordering. Workers may be split into several concurrent jobs.
Everything is torn down on exit or Ctrl-C: processes, bmv2, veths, namespaces.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from homagg import wire
from homagg.launcher.options import NetError, NetOptions, choose_target, preflight
from homagg.netconfig import (
    Config,
    FallbackSpec,
    Host,
    JobSpec,
    SwitchSpec,
    Worker,
    host_ip,
    host_mac,
    render,
)

__all__ = ["AGENT_PORT", "FALLBACK_IP", "SWITCH_IP", "HomaggNet", "NetError", "NetOptions",
           "choose_target", "host_ip", "host_mac", "preflight"]

log = logging.getLogger("homagg.net")

SWITCH_IP = wire.DEFAULT_SWITCH_IP
SWITCH_MAC = wire.DEFAULT_SWITCH_MAC
FALLBACK_IP = wire.DEFAULT_FALLBACK_IP
FALLBACK_MAC = wire.DEFAULT_FALLBACK_MAC
AGENT_PORT = wire.DEFAULT_AGENT_PORT
# With --service: host ctl, a node in the root namespace cabled to the switch, where
# homagg-ctl serve's service listens for the workers' joins (it reaches the switch's and the
# aggregators' P4Runtime from there, and sees each worker's own address as its peer).
CTL_IP, CTL_MAC = "10.0.0.252", "00:00:0a:00:00:fc"


def _bmv2_switch_class():
    from mininet.node import Switch

    from homagg.targets.bmv2 import Bmv2Switch

    class Bmv2Node(Switch):
        """A Mininet switch that is one simple_switch_grpc (root namespace)."""

        def __init__(self, name, log_dir: Path, **kw):
            kw.setdefault("inNamespace", False)
            super().__init__(name, **kw)
            self.log_dir = log_dir
            self.bmv2: Bmv2Switch | None = None

        def start(self, controllers):
            ports = {self.ports[i]: i.name for i in self.intfList() if i.name != "lo"}
            for name in ports.values():
                subprocess.run(["sysctl", "-q", "-w", f"net.ipv6.conf.{name}.disable_ipv6=1"],
                               capture_output=True)
            self.bmv2 = Bmv2Switch(ports, self.log_dir, self.name).start()

        def stop(self, deleteIntfs=True):
            if self.bmv2:
                self.bmv2.stop()
                self.bmv2 = None
            super().stop(deleteIntfs)

    return Bmv2Node


class HomaggNet:
    def __init__(self, opts: NetOptions):
        self.opts = opts
        self.target, self.why = choose_target(opts.target)
        if opts.slots is None:
            # bmv2's queues drop bursts, and it takes longer per packet the larger the packet:
            # about 16 x 256 words in flight, at least 8 packets, resend least (measured with
            # bench, 4 workers: window 64 resent ~30% of the packets, 16 under 1%)
            k = opts.words or wire.WORDS_PER_PACKET
            opts.slots = max(8, min(16, 16 * 256 // k)) if self.target == "bmv2" else 64
        if opts.workers % opts.jobs:
            raise NetError(f"{opts.workers} workers do not split into {opts.jobs} equal jobs")
        if not 576 <= opts.mtu <= wire.JUMBO_MTU:
            raise NetError(f"--mtu {opts.mtu}: an MTU from 576 to {wire.JUMBO_MTU} bytes")
        k = opts.words or wire.WORDS_PER_PACKET
        try:
            wire.check_words(k, opts.mtu)
        except wire.WireError as e:
            raise NetError(f"--words {k} with --mtu {opts.mtu}: {e}") from None
        self.slots: int = opts.slots
        self.net: Any = None  # mininet.net.Mininet once started
        self.procs: list[subprocess.Popen] = []
        self.keys: dict[tuple, int] = {}  # (where, job) -> the job's key (job_key)
        self.secrets: dict[int, str] = {}  # job -> its join secret (with --service)
        self.config: Config = self._config()
        self.aggregator: Any = None  # the software aggregator's process (soft target)
        self.placed: dict[int, Any] = {}  # job id -> controller.placement.PlacedJob
        self.service: Any = None  # controller.serve.Server, with --service
        self.token = secrets.token_hex(16)
        self.new_run()

    def job_key(self, job: int, where: object = None) -> int:
        """Job ``job``'s key (on switch ``where``, in a tree): random, drawn once per
        testbed, as the service draws one per job; its config and its workers have it."""
        return self.keys.setdefault((where, job), secrets.randbits(32) or 1)

    def new_run(self) -> int:
        """A new run number for the workers started from here on (``AgentConfig.run``): each
        start of a job's workers is its own attempt, so a join that an earlier start left
        pending is not counted in (join.p4)."""
        self.run = secrets.randbits(32)
        return self.run

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> HomaggNet:
        preflight()
        from mininet.link import Link
        from mininet.log import setLogLevel
        from mininet.net import Mininet
        from mininet.nodelib import LinuxBridge

        setLogLevel("error")  # its bridge-netfilter warning does not apply: no iptables rules here
        o = self.opts
        o.log_dir.mkdir(parents=True, exist_ok=True)
        net = Mininet(topo=None, controller=None, link=Link, build=False, autoSetMacs=False,
                      waitConnected=False)
        self.net = net
        try:
            if self.target == "bmv2":
                s1 = net.addSwitch("s1", cls=_bmv2_switch_class(), log_dir=o.log_dir)
            else:
                s1 = net.addSwitch("s1", cls=LinuxBridge)
            hosts = []
            for i in range(o.workers):
                h = net.addHost(f"h{i + 1}", ip=f"{host_ip(i)}/24", mac=host_mac(i))
                net.addLink(h, s1, port2=i + 1)
                hosts.append(h)
            if self.target == "soft":
                agg = net.addHost("agg", ip=f"{SWITCH_IP}/24", mac=SWITCH_MAC)
                net.addLink(agg, s1, port2=o.workers + 1)
            fb = self.config.fallback
            if fb is not None:
                h = net.addHost(fb.name, ip=f"{fb.ip}/24", mac=fb.mac)
                net.addLink(h, s1, port2=fb.port)
            if o.service:
                ctl = self._ctl_host()
                h = net.addHost(ctl.name, ip=f"{ctl.ip}/24", mac=ctl.mac, inNamespace=False)
                net.addLink(h, s1, port2=ctl.port)
            net.build()
            net.start()
            self._set_mtu()
            for h in net.hosts:
                if h.inNamespace:  # (not ctl's: the root namespace is the machine's)
                    h.cmd("sysctl -q -w net.ipv6.conf.all.disable_ipv6=1")
                else:
                    h.cmd(f"sysctl -q -w net.ipv6.conf.{h.defaultIntf()}.disable_ipv6=1")
                if self.target == "bmv2":
                    # bmv2 reads and writes whole frames: a checksum left to offload would
                    # reach it unfinished. On the soft target (a Linux bridge) the offloads
                    # stay on: UDP GSO needs them, and the agents and the aggregator send
                    # runs of datagrams per system call through it (homagg.udpio).
                    h.cmd(f"ethtool -K {h.defaultIntf()} tx off rx off >/dev/null 2>&1")
            self._shape(hosts)
            if self.target == "soft":
                self.aggregator = self._start_aggregator("agg", self.config.switch.grpc)
            if self.config.fallback is not None:
                self._start_aggregator(self.config.fallback.name, self.config.fallback.grpc)
            self._install()
            if o.service:
                self._start_service()
        except BaseException:
            self.stop()
            raise
        return self

    def _set_mtu(self) -> None:
        """Both ends of every link at the MTU (a Linux bridge follows its ports; bmv2 reads
        whole frames from its ports, whatever their size)."""
        if self.opts.mtu == wire.DEFAULT_MTU:
            return
        for link in self.net.links:
            for intf in (link.intf1, link.intf2):
                out = intf.node.cmd(f"ip link set dev {intf.name} mtu {self.opts.mtu}").strip()
                if out:
                    raise NetError(f"{intf.name}: MTU {self.opts.mtu}: {out}")

    def _ctl_host(self) -> Host:
        """Host ctl (--service): cabled after the workers, the aggregator and the fallback."""
        o = self.opts
        return Host("ctl", CTL_IP, CTL_MAC,
                    o.workers + 1 + (self.target == "soft") + bool(o.fallback))

    def _start_service(self) -> None:
        """homagg-ctl serve's service at host ctl: workers join their jobs by themselves
        (exec gives them HOMAGG_CONTROLLER and HOMAGG_TOKEN, not job and worker ids)."""
        from homagg.controller.p4client import P4RuntimeSwitch
        from homagg.controller.serve import start
        from homagg.controller.service import JobService, ServeOptions

        def connect(place):  # election id above the launcher's own sessions', as serve's
            return P4RuntimeSwitch(place.grpc, place.device_id, (0, 2), None,
                                   place.name).open()

        svc = JobService(self.config, connect, ServeOptions(token=self.token, slots=self.slots))
        self.service = start(svc, f"{CTL_IP}:0")
        log.info("controller service at %s", self.service.address)

    def service_placement(self) -> str:
        """With --service: one line per job the service placed, in order."""
        if self.service is None:
            return ""
        svc = self.service.svc
        held = ", ".join(str(j) for j in sorted(svc.held)) or "none"
        return "\n".join([*(f"job {j} ({name}): placed on {place}"
                            for j, name, place in svc.placements),
                          f"jobs the service still holds: {held}"])

    def _config(self) -> Config:
        o = self.opts
        hosts = tuple(Host(f"h{i + 1}", host_ip(i), host_mac(i), i + 1) for i in range(o.workers))
        if self.target == "bmv2":  # its gRPC and Thrift ports are known once it runs
            sw = SwitchSpec("s1", "127.0.0.1:9559", 1, 9090, SWITCH_IP, SWITCH_MAC,
                            slots=o.switch_slots)
        else:
            sw = SwitchSpec("s1", self._socket("agg"), 1, 9090, SWITCH_IP, SWITCH_MAC,
                            target="soft", slots=o.switch_slots)
        fb = None
        if o.fallback:
            # its own port: after the workers, and after the soft target's aggregator
            fb = FallbackSpec("fb", FALLBACK_IP, FALLBACK_MAC, self._socket("fb"), 1,
                              o.workers + (2 if self.target == "soft" else 1))
        if o.service:  # no jobs up front: the workers join, and the service places them
            return Config(sw, (*hosts, self._ctl_host()), (), fb)
        per = o.workers // o.jobs
        jobs = tuple(JobSpec(o.job + k, tuple(Worker(h.ip, AGENT_PORT, h.mac, h.port, h.name)
                                              for h in hosts[k * per:(k + 1) * per]), self.slots,
                             key=self.job_key(o.job + k))
                     for k in range(o.jobs))
        return Config(sw, hosts, jobs, fb)

    def _socket(self, name: str) -> str:
        """The P4Runtime address of the aggregator on host ``name``: a unix socket in the log
        directory (a TCP port in its namespace would be out of the controller's reach)."""
        return f"unix:{self.opts.log_dir.resolve() / f'{name}-p4runtime.sock'}"

    def netem_args(self) -> list[str]:
        o = self.opts
        args = []
        if o.delay:
            args += ["delay", o.delay] + ([o.jitter] if o.jitter else [])
        if o.loss:
            args += ["loss", f"{o.loss}%"]
        if o.dup:
            args += ["duplicate", f"{o.dup}%"]
        if o.reorder:
            if not o.delay:
                raise NetError("--reorder needs --delay (netem reorders by sending some "
                               "packets without the delay)")
            args += ["reorder", f"{o.reorder}%"]
        return args

    def _shape(self, hosts) -> None:
        """Both ends of every worker link: HTB for the rate, netem under it for the rest."""
        netem = self.netem_args()
        if not netem and not self.opts.bw:
            return
        for h in hosts:
            for intf in (h.defaultIntf(), h.defaultIntf().link.intf2):
                node, dev = intf.node, intf.name
                cmds = []
                parent = "root"
                if self.opts.bw:
                    rate = f"{self.opts.bw}mbit"
                    cmds += [f"tc qdisc replace dev {dev} root handle 1: htb default 1",
                             f"tc class add dev {dev} parent 1: classid 1:1 htb rate {rate} "
                             f"ceil {rate} quantum {self.opts.mtu + 14}"]
                    parent = "parent 1:1 handle 10:"
                if netem:
                    cmds.append(f"tc qdisc replace dev {dev} {parent} netem limit 10000 "
                                + " ".join(netem))
                for c in cmds:
                    out = node.cmd(c).strip()
                    if "rror" in out or "nknown" in out:
                        hint = (" (this kernel has no netem: use --inject-loss/--inject-dup/"
                                "--inject-reorder, which the agents apply at their sockets)"
                                if "netem" in c and "unknown" in out else "")
                        raise NetError(f"{c}: {out}{hint}")

    def job_of(self, worker: int) -> tuple[int, int, int]:
        """(job id, worker index in the job, workers in the job) of worker host ``worker``."""
        per = self.opts.workers // self.opts.jobs
        return self.opts.job + worker // per, worker % per, per

    def _fabric(self, pipelines: dict[str, Any] | None = None):
        """The controller's view of the switch and the fallback; with ``pipelines`` (by
        place role), each session pushes its pipeline first, as ``homagg-ctl install`` does."""
        from homagg.controller.p4client import P4RuntimeSwitch
        from homagg.controller.placement import Fabric

        def connect(place):
            log_file = self.opts.log_dir / f"{place.name}-p4runtime.log"
            pipeline = (pipelines or {}).get(place.role)
            return P4RuntimeSwitch(place.grpc, place.device_id, request_log=log_file,
                                   name=place.name).open(pipeline)

        return Fabric(self.config, connect)

    def _pipelines(self, roles=("switch", "fallback")) -> dict[str, Any]:
        from homagg.controller.build import build, soft_pipeline

        soft = soft_pipeline(self.opts.log_dir)
        out = {"fallback": soft,
               "switch": build(words=self.opts.words) if self.target == "bmv2" else soft}
        return {r: out[r] for r in roles}

    def _install(self, roles=("switch", "fallback")) -> None:
        """Pipelines, base forwarding and the jobs, each where the controller places it (the
        switch while its slots last, then the fallback). ``roles``: the places to install
        afresh; the jobs of the others stay as they are."""
        from homagg.controller import jobs

        if self.target == "bmv2":
            b = self.net.get("s1").bmv2
            self.config = Config(SwitchSpec("s1", b.grpc_addr, 1, b.thrift_port, SWITCH_IP,
                                            SWITCH_MAC, slots=self.opts.switch_slots),
                                 self.config.hosts, self.config.jobs, self.config.fallback)
        # homagg-ctl's config for this topology: an operator drives the running network with
        # `homagg-ctl -c <log dir>/net.toml job list` (stats, reset, job add ...)
        (self.opts.log_dir / "net.toml").write_text(render(self.config))
        with self._fabric(self._pipelines(roles)) as fabric:
            for role in roles:
                place = fabric.switch if role == "switch" else fabric.fallback
                if place is not None:
                    fabric.session(place)  # opened now: the pipeline goes in first
            if "switch" in roles:
                jobs.install_base(fabric.session(fabric.switch), self.config)
            if "fallback" in roles:
                fabric.install_fallback_base()
            for j in self.config.jobs:
                before = self.placed.get(j.id)
                if before is not None and before.place.role not in roles:
                    continue  # still installed where it was
                if before is not None:  # back where it was: its agents know that address
                    j = dataclasses.replace(j, place=before.place.role)
                self.placed[j.id] = fabric.add(j)
                if self.placed[j.id].why:
                    log.info("job %d: %s", j.id, self.placed[j.id].why)

    def placement(self) -> str:
        """One line per job: where the controller put it, and why if not on the switch."""
        return "\n".join(f"job {j}: on {pj.place.describe()}"
                         + (f" [{pj.why}]" if pj.why else "")
                         for j, pj in sorted(self.placed.items()))

    def job_address(self, job: int) -> str:
        """Where job ``job``'s agents send: the switch, or the fallback it was placed on."""
        pj = self.placed.get(job)
        return pj.place.ip if pj is not None else SWITCH_IP

    def _start_aggregator(self, host: str, grpc: str):
        """homagg-softswitch on Mininet host ``host``, at that host's address, serving
        P4Runtime at ``grpc``; returns its process once P4Runtime answers."""
        import time

        from homagg.controller.p4client import reachable

        node = self.net.get(host)
        sock = Path(grpc.removeprefix("unix:"))
        sock.unlink(missing_ok=True)
        out = open(self.opts.log_dir / f"{host}-aggregator.out", "w")
        words = ["--words", str(self.opts.words)] if self.opts.words else []
        words += ["--mtu", str(self.opts.mtu)] + (
            ["--shards", str(self.opts.shards)] if self.opts.shards > 1 else [])
        p = node.popen([sys.executable, "-m", "homagg.targets.soft", "--bind", node.IP(),
                        "--grpc", grpc, "--log-level", "warning", *words],
                       stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(p)
        for _ in range(150):
            if p.poll() is not None:
                raise NetError(f"software aggregator on {host} exited ({p.returncode}); see "
                               f"{self.opts.log_dir / f'{host}-aggregator.out'}")
            if reachable(grpc, 0.2) and str(wire.HOMAGG_UDP_PORT_MIN) in node.cmd("ss -uln"):
                return p
            time.sleep(0.1)
        raise NetError(f"software aggregator on {host} did not start listening")

    # -- operating the running network --------------------------------------------------------
    def stats(self) -> dict:
        """The switch's counters (as ``homagg-ctl stats --json`` prints them, jobs by int)."""
        return self.stats_all()[self.config.switch.name]

    def stats_all(self) -> dict[str, dict]:
        """Counters of every place, by name: the switch's and the fallback's."""
        with self._fabric() as fabric:
            return {name: st.to_json() for name, (_, st) in fabric.stats().items()}

    def reset_jobs(self) -> None:
        """Every job starts afresh (new epoch): what an operator does after a worker died."""
        with self._fabric() as fabric:
            for j in self.config.jobs:
                fabric.reset(j.id)

    def restart_switch(self) -> None:
        """Kill the switch (all its state) and bring it back; the controller re-installs it
        and puts its jobs back (the fallback's are left running)."""
        if self.target == "bmv2":
            s1 = self.net.get("s1")
            s1.bmv2.stop()
            s1.bmv2.start()
        else:
            self.aggregator.kill()
            self.aggregator.wait()
            self.procs.remove(self.aggregator)
            self.aggregator = self._start_aggregator("agg", self.config.switch.grpc)
        self._install(("switch",))

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(3)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.procs = []
        if self.net is not None:
            try:
                self.net.stop()
            finally:
                self.net = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- running things on hosts ---------------------------------------------------------------
    def worker_hosts(self):
        return [self.net.get(f"h{i + 1}") for i in range(self.opts.workers)]

    def agent_command(self, worker: int, *args: str) -> list[str]:
        job, index, workers = self.job_of(worker)
        return [sys.executable, "-m", "homagg.host_agent", "--job", str(job),
                "--worker", str(index),
                "--workers", str(workers), "--switch", self.job_address(job),
                "--bind", f"{host_ip(worker)}:{AGENT_PORT}", "--slots", str(self.opts.slots),
                "--run", str(self.run), "--key", str(self.job_key(job)), *self.opts.agent_args,
                *args]

    def worker_env(self, worker: int) -> dict[str, str]:
        """What a user's program on worker host ``worker`` needs to join its job: homagg's
        settings (``AgentConfig.from_env`` reads them) and torch.distributed's, for a gloo
        process group over the same topology (rank within the job, its first host as master).
        With --service, homagg's are only the service's address and token: the worker joins
        its job by name (MASTER_ADDR:MASTER_PORT), as under torchrun on real hosts."""
        job, index, workers = self.job_of(worker)
        host = self.net.get(f"h{worker + 1}")
        torch = {"RANK": str(index), "WORLD_SIZE": str(workers), "LOCAL_RANK": "0",
                 "MASTER_ADDR": host_ip(worker - index), "MASTER_PORT": str(29500 + job),
                 "GLOO_SOCKET_IFNAME": host.defaultIntf().name}
        if self.service is not None:  # the job's name is MASTER_ADDR:MASTER_PORT, alike
            return {"HOMAGG_CONTROLLER": self.service.address, "HOMAGG_TOKEN": self.token,
                    "HOMAGG_SLOTS": str(self.slots),
                    "HOMAGG_JOIN_SECRET": self.secrets.setdefault(job, secrets.token_hex(16)),
                    **torch}
        return {
            "HOMAGG_JOB": str(job), "HOMAGG_WORKER": str(index), "HOMAGG_WORKERS": str(workers),
            "HOMAGG_SWITCH": f"{self.job_address(job)}:{wire.HOMAGG_UDP_PORT_MIN}",
            "HOMAGG_BIND": f"{host_ip(worker)}:{AGENT_PORT}", "HOMAGG_SLOTS": str(self.slots),
            "HOMAGG_RUN": str(self.run), "HOMAGG_JOB_KEY": str(self.job_key(job)), **torch,
        }

    def popen(self, host, cmd: list[str], out_path: Path | None = None, **kw):
        out = open(out_path, "w") if out_path else subprocess.PIPE
        p = host.popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, **kw)
        self.procs.append(p)
        return p
