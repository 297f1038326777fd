"""The leaf/spine Mininet topology: ``--topo leafspine --leaves L --workers-per-leaf N
[--jobs J]``.

J jobs (default 1) over L x N workers, each aggregated in a tree (p4/include/control/uplink.p4):
each leaf switch aggregates its workers of a job and sends one partial sum per round to the
spine, whose result comes back down through the leaves. Each job takes an equal share of every
leaf's workers (N / J per leaf: the first N / J workers of each leaf are job 1's, the next job
2's, ...), so every job is a tree of the same shape over all the leaves. The spine's job k has
the leaves as its workers; each leaf's job k is a child job with an uplink to it, sending from
port 0xBEE0 + k - 1: the spine knows a leaf's job by the leaf's address and that source port
(up to 16 jobs, one per homagg port). Job ids are the same on every switch. One controller
process (this one) installs every switch over P4Runtime.

On bmv2 every switch is its own simple_switch_grpc: the spine at the usual switch address,
leaf i at 10.0.0.(200 + i), each leaf's port N + 1 cabled to the spine's port i + 1 (the
uplink and the spine's job address the leaves by port, so no routes are needed for homagg
traffic; each switch routes to what hangs off it). On the soft target every switch is a Linux
bridge with a software aggregator on its own host (``agg`` for the spine, ``aggN`` for leaf
N) at the same addresses, all bridges in one L2 segment. Worker k sits under leaf k // N; its
agent sends to its leaf at its job's port, with its id in the leaf's child job, the job's size
(L x N / J) and its rank in the whole job, so it trains on the same share of data as that
worker of an (L x N / J)-worker star, and ends with the same model.
"""

from __future__ import annotations

import dataclasses
import sys

from homagg import wire
from homagg.launcher.net import (
    AGENT_PORT,
    FALLBACK_IP,
    FALLBACK_MAC,
    SWITCH_IP,
    SWITCH_MAC,
    HomaggNet,
    NetError,
    NetOptions,
    _bmv2_switch_class,
    preflight,
)
from homagg.netconfig import (
    Config,
    FallbackSpec,
    Host,
    JobSpec,
    SwitchSpec,
    Uplink,
    Worker,
    host_ip,
    host_mac,
    render,
)

PORT = wire.HOMAGG_UDP_PORT_MIN
#: A leaf's source port for job k (0-based): the spine knows the leaf's job by it.
PORTS = wire.HOMAGG_UDP_PORTS  # job k of a tree: its leaves' port PORTS[k]


def leaf_ip(i: int) -> str:
    """Leaf i's aggregator address (0-based): 10.0.0.(200 + i), clear of the workers'."""
    return f"10.0.0.{200 + i}"


def leaf_mac(i: int) -> str:
    return f"00:00:0a:00:00:{200 + i:02x}"


class TreeNet(HomaggNet):
    """HomaggNet's lifecycle and host commands over a leaf/spine tree (module docstring)."""

    def __init__(self, opts: NetOptions):
        n, jobs = opts.workers_per_leaf, opts.jobs
        if not (2 <= opts.leaves <= 50 and 1 <= n <= wire.MAX_WORKERS and opts.leaves * n < 200):
            raise NetError(f"--leaves {opts.leaves} --workers-per-leaf {n}: need 2 to 50 "
                           f"leaves of 1 to {wire.MAX_WORKERS} workers, under 200 in all "
                           "(worker hosts are 10.0.0.1-199, leaves 10.0.0.200 and up)")
        if not 1 <= jobs <= len(PORTS) or n % jobs:
            raise NetError(f"--topo leafspine --jobs {jobs}: each job takes an equal share of "
                           f"every leaf's workers, so --workers-per-leaf ({n}) must split into "
                           f"--jobs equal parts, and a leaf's jobs go up from a port each: 1 "
                           f"to {len(PORTS)} jobs")
        opts.workers = opts.leaves * opts.workers_per_leaf
        super().__init__(opts)
        if jobs * self.slots > wire.SLOTS:
            raise NetError(f"--jobs {jobs} of --slots {self.slots}: every switch of the tree "
                           f"holds a region per job, {jobs * self.slots} slots of its "
                           f"{wire.SLOTS}")
        self.leaf_aggregators: list = []  # the soft target's leaf aggregator processes
        self.why = f"{self.why}; leaf/spine tree: {opts.leaves} leaves of " \
                   f"{opts.workers_per_leaf} workers" + (f", {jobs} jobs" if jobs > 1 else "")

    # -- the topology and its configs -----------------------------------------------------------
    @property
    def per_leaf(self) -> int:
        return self.opts.workers_per_leaf

    @property
    def per_job(self) -> int:
        """Workers of one job under each leaf."""
        return self.per_leaf // self.opts.jobs

    def leaf_of(self, worker: int) -> int:
        return worker // self.per_leaf

    def job_of(self, worker: int) -> tuple[int, int, int]:
        """(job id, worker id in its leaf's child job, workers in the whole job) of worker host
        ``worker``: each leaf's workers are split into the jobs in order."""
        k, index = divmod(worker % self.per_leaf, self.per_job)
        return self.opts.job + k, index, self.opts.leaves * self.per_job

    def rank_of(self, worker: int) -> int:
        """Worker host ``worker``'s rank in its whole job (its share of the data): its leaf's
        workers of the job come after the earlier leaves'."""
        return self.leaf_of(worker) * self.per_job + self.job_of(worker)[1]

    def _config(self) -> Config:
        """The spine's config: the leaves are its hosts and each job's workers, job k's leaf
        known by its source port for that job (PORTS[k])."""
        o = self.opts
        leaves = tuple(Host(f"leaf{i + 1}", leaf_ip(i), leaf_mac(i), i + 1)
                       for i in range(o.leaves))
        jobs = tuple(JobSpec(o.job + k, tuple(Worker(h.ip, PORTS[k], h.mac, h.port, h.name)
                                              for h in leaves), self.slots,
                             key=self.job_key(o.job + k, "spine"))
                     for k in range(o.jobs))
        fb = None
        if o.fallback:
            # the root's fallback (a job the spine has no slots for), hanging off the spine
            # after the leaves (and after the soft target's aggregator)
            fb = FallbackSpec("fb", FALLBACK_IP, FALLBACK_MAC, self._socket("fb"), 1,
                              o.leaves + (2 if self.target == "soft" else 1))
        spine = self._spec("spine", "s1", "agg", SWITCH_IP, SWITCH_MAC)
        spine = dataclasses.replace(spine, slots=o.switch_slots)  # --switch-slots: the spine's
        return Config(spine, leaves, jobs, fb)

    def _spec(self, name: str, node: str, agg: str, ip: str, mac: str) -> SwitchSpec:
        """A switch of the tree: bmv2 node ``node`` (its ports are known once it runs), or
        the software aggregator on host ``agg``."""
        if self.target == "bmv2" and self.net is not None:
            b = self.net.get(node).bmv2
            return SwitchSpec(name, b.grpc_addr, 1, b.thrift_port, ip, mac)
        if self.target == "bmv2":
            return SwitchSpec(name, "127.0.0.1:9559", 1, 9090, ip, mac)
        return SwitchSpec(name, self._socket(agg), 1, 9090, ip, mac, target="soft")

    def leaf_config(self, i: int) -> Config:
        """Leaf i's config: its workers, and a child job per job, each with its uplink to the
        spine's job of the same id, from a source port of its own (PORTS[k])."""
        n, per = self.per_leaf, self.per_job
        hosts = tuple(Host(f"h{k + 1}", host_ip(k), host_mac(k), k - i * n + 1)
                      for k in range(i * n, (i + 1) * n))
        jobs = tuple(JobSpec(self.opts.job + k,
                             tuple(Worker(h.ip, AGENT_PORT, h.mac, h.port, h.name)
                                   for h in hosts[k * per:(k + 1) * per]), self.slots,
                             uplink=Uplink(self.opts.job + k, i, self.root_ip(self.opts.job + k),
                                           PORT, SWITCH_MAC, PORTS[k], n + 1,
                                           self.job_key(self.opts.job + k, "spine")),
                             key=self.job_key(self.opts.job + k, i))
                     for k in range(self.opts.jobs))
        sw = self._spec(f"leaf{i + 1}", f"s{i + 2}", f"agg{i + 1}", leaf_ip(i), leaf_mac(i))
        return Config(sw, hosts, jobs)

    def root_ip(self, job: int) -> str:
        """Where job ``job``'s root aggregates: the spine, or the fallback the controller
        placed it on (the leaves' uplinks go there; on bmv2 through the spine, which routes
        to the fallback like any host, hence the spine's MAC as the next hop)."""
        pj = self.placed.get(job)
        return pj.place.ip if pj is not None else SWITCH_IP

    def configs(self) -> list[Config]:
        return [self.config] + [self.leaf_config(i) for i in range(self.opts.leaves)]

    def start(self) -> TreeNet:
        preflight()
        from mininet.link import Link
        from mininet.log import setLogLevel
        from mininet.net import Mininet
        from mininet.nodelib import LinuxBridge

        setLogLevel("error")
        o = self.opts
        o.log_dir.mkdir(parents=True, exist_ok=True)
        net = Mininet(topo=None, controller=None, link=Link, build=False, autoSetMacs=False,
                      waitConnected=False)
        self.net = net
        soft = self.target == "soft"
        kw = {"cls": LinuxBridge} if soft else {"cls": _bmv2_switch_class(),
                                                "log_dir": o.log_dir}
        try:
            spine = net.addSwitch("s1", **kw)
            if soft:
                agg = net.addHost("agg", ip=f"{SWITCH_IP}/24", mac=SWITCH_MAC)
                net.addLink(agg, spine, port2=o.leaves + 1)
            fb = self.config.fallback
            if fb is not None:
                net.addLink(net.addHost(fb.name, ip=f"{fb.ip}/24", mac=fb.mac), spine,
                            port2=fb.port)
            for i in range(o.leaves):
                leaf = net.addSwitch(f"s{i + 2}", **kw)
                net.addLink(leaf, spine, port1=self.per_leaf + 1, port2=i + 1)
                if soft:
                    a = net.addHost(f"agg{i + 1}", ip=f"{leaf_ip(i)}/24", mac=leaf_mac(i))
                    net.addLink(a, leaf, port2=self.per_leaf + 2)
                for k in range(i * self.per_leaf, (i + 1) * self.per_leaf):
                    h = net.addHost(f"h{k + 1}", ip=f"{host_ip(k)}/24", mac=host_mac(k))
                    net.addLink(h, leaf, port2=k - i * self.per_leaf + 1)
            net.build()
            net.start()
            self._set_mtu()
            for h in net.hosts:
                h.cmd("sysctl -q -w net.ipv6.conf.all.disable_ipv6=1")
                if not soft:  # bmv2 reads and writes whole frames (net.py says why)
                    h.cmd(f"ethtool -K {h.defaultIntf()} tx off rx off >/dev/null 2>&1")
            self._shape(self.worker_hosts())
            if soft:
                self.aggregator = self._start_aggregator("agg", self.config.switch.grpc)
                self.leaf_aggregators = [
                    self._start_aggregator(f"agg{i + 1}", self.leaf_config(i).switch.grpc)
                    for i in range(o.leaves)]
            else:
                self.config = self._config()  # now with each bmv2's P4Runtime address
            if self.config.fallback is not None:
                self._start_aggregator(self.config.fallback.name, self.config.fallback.grpc)
            self._install_tree()
        except BaseException:
            self.stop()
            raise
        return self

    def _install_tree(self) -> None:
        """Every switch's pipeline and job, from this one process: the spine first, so the
        leaves' partial sums find their parent's job in place. The spine's jobs go where the
        controller places them (``controller.placement``): on the spine while its slots
        last, else on its fallback, and the leaves' uplinks then point there (``root_ip``).
        A leaf's child job stays on its leaf, where its workers and its parent's answers
        arrive."""
        from homagg.controller import jobs
        from homagg.controller.p4client import P4RuntimeSwitch

        o = self.opts
        pipelines = self._pipelines()
        (o.log_dir / "spine.toml").write_text(render(self.config))
        with self._fabric(pipelines) as fabric:
            spine = fabric.session(fabric.switch)  # opened now: the pipeline goes in first
            if fabric.fallback is not None:
                fabric.session(fabric.fallback)
            if self.target == "bmv2":  # its address, proxy ARP, routes to what hangs off it
                jobs.install_base(spine, self.config)
                self._route_workers(spine, self.config)
                if self.config.fallback is not None:
                    # a leaf's partial sums to a root on the fallback cross the spine as
                    # routed traffic from homagg's ports: the leaves are aggregators
                    for i in range(o.leaves):
                        jobs.trust_aggregator(spine, leaf_ip(i), i + 1)
            fabric.install_fallback_base()
            for j in self.config.jobs:
                self.placed[j.id] = fabric.add(j)
        for cfg in self.configs()[1:]:
            (o.log_dir / f"{cfg.switch.name}.toml").write_text(render(cfg))
            s = cfg.switch
            with P4RuntimeSwitch(s.grpc, s.device_id, name=s.name,
                                 request_log=o.log_dir / f"{s.name}-p4runtime.log"
                                 ).open(pipelines["switch"]) as sw:
                if self.target == "bmv2":
                    jobs.install_base(sw, cfg)
                    self._route_workers(sw, cfg)
                for j in cfg.jobs:
                    jobs.add_job(sw, j)

    def _route_workers(self, sw, cfg: Config) -> None:
        """bmv2: routes between worker hosts under different leaves (homagg traffic needs
        none; a user's own traffic under exec does, such as the gloo process group DDP sets
        up): the spine routes each worker to its leaf, a leaf the other leaves' workers up
        to the spine. (On the soft target the bridges are one L2 segment.)"""
        from homagg.controller import jobs

        n = self.per_leaf
        for k in range(self.opts.workers):
            i = self.leaf_of(k)
            if cfg.switch.name == "spine":
                jobs.add_route(sw, cfg, host_ip(k), leaf_mac(i), i + 1)
            elif cfg.switch.name != f"leaf{i + 1}":
                jobs.add_route(sw, cfg, host_ip(k), SWITCH_MAC, n + 1)

    # -- what the CLI asks of a network ---------------------------------------------------------
    def placement(self) -> str:
        o = self.opts
        names = ", ".join(f"leaf{i + 1} ({leaf_ip(i)})" for i in range(o.leaves))
        lines = []
        for k in range(o.jobs):
            pj = self.placed.get(o.job + k)
            root = (f"the spine ({SWITCH_IP})" if pj is None or pj.place.role == "switch"
                    else f"the spine's fallback, {pj.place.describe()} [{pj.why}]")
            lines.append(f"job {o.job + k}: a tree: {o.leaves} leaves of {self.per_job} "
                         f"workers ({names}) under {root}, the leaves' port {PORTS[k]}")
        return "\n".join(lines) + f"\nconfigs {o.log_dir}/{{spine,leaf1,...}}.toml"

    def job_address(self, job: int) -> str:
        raise NetError("in a tree each worker sends to its own leaf: see agent_command")

    def stats_all(self) -> dict[str, dict]:
        """Counters of every switch of the tree, by name (spine, leaf1, ...), and of the
        spine's fallback (fb) where there is one."""
        from homagg.controller import jobs
        from homagg.controller.p4client import P4RuntimeSwitch

        out = {}
        places = [(c.switch.name, c.switch.grpc, c.switch.device_id) for c in self.configs()]
        fb = self.config.fallback
        if fb is not None:
            places.append((fb.name, fb.grpc, fb.device_id))
        for name, grpc, device_id in places:
            with P4RuntimeSwitch(grpc, device_id, name=name).open() as sw:
                out[name] = jobs.read_stats(sw).to_json()
        return out

    def siblings(self) -> str:
        """The spine's children, in worker id order: what a timeout names."""
        return ",".join(f"leaf{i + 1}" for i in range(self.opts.leaves))

    def switch_of(self, worker: int) -> str:
        """Where worker host ``worker`` sends: its leaf at its job's port, where every answer
        then comes from (a switch answers from the port asked; the spine's finals come down
        to that port)."""
        job = self.job_of(worker)[0]
        return f"{leaf_ip(self.leaf_of(worker))}:{PORTS[job - self.opts.job]}"

    def agent_command(self, worker: int, *args: str) -> list[str]:
        o = self.opts
        job, index, workers = self.job_of(worker)
        return [sys.executable, "-m", "homagg.host_agent", "--job", str(job),
                "--worker", str(index), "--workers", str(workers),
                "--local-workers", str(self.per_job), "--rank", str(self.rank_of(worker)),
                "--siblings", self.siblings(), "--switch", self.switch_of(worker),
                "--bind", f"{host_ip(worker)}:{AGENT_PORT}",
                "--slots", str(o.slots), "--run", str(self.run),
                "--key", str(self.job_key(job, self.leaf_of(worker))), *o.agent_args, *args]

    def worker_env(self, worker: int) -> dict[str, str]:
        """As the star's (``HomaggNet.worker_env``), for a worker under its leaf: its id in
        its leaf's child job, its job's size over the tree, its leaf's workers of the job and
        the spine's children (the leaves, for a timeout's message), its leaf at its job's
        port; torch.distributed's rank is its rank in the whole job (``rank_of``), so it
        takes the share of data of the star's worker of that rank."""
        o = self.opts
        job, index, workers = self.job_of(worker)
        k = job - o.job
        host = self.net.get(f"h{worker + 1}")
        return {
            "HOMAGG_JOB": str(job), "HOMAGG_WORKER": str(index),
            "HOMAGG_WORKERS": str(workers), "HOMAGG_LOCAL_WORKERS": str(self.per_job),
            "HOMAGG_SIBLINGS": self.siblings(), "HOMAGG_SWITCH": self.switch_of(worker),
            "HOMAGG_BIND": f"{host_ip(worker)}:{AGENT_PORT}", "HOMAGG_SLOTS": str(self.slots),
            "HOMAGG_RUN": str(self.run),
            "HOMAGG_JOB_KEY": str(self.job_key(job, self.leaf_of(worker))),
            "RANK": str(self.rank_of(worker)), "WORLD_SIZE": str(workers), "LOCAL_RANK": "0",
            # rank 0: the job's first worker under the first leaf
            "MASTER_ADDR": host_ip(k * self.per_job), "MASTER_PORT": str(29500 + job),
            "GLOO_SOCKET_IFNAME": host.defaultIntf().name,
        }

    def reset_jobs(self) -> None:
        raise NetError("reset on a tree: homagg-ctl -c <log dir>/<switch>.toml reset <job>, "
                       "on every switch")

    def restart_switch(self) -> None:
        raise NetError("restart_switch is for the star topology")

    def kill_leaf(self, i: int) -> None:
        """Leaf i (0-based) dies with all its state: a failure to test against."""
        if self.target == "bmv2":
            self.net.get(f"s{i + 2}").bmv2.stop()
        else:
            p = self.leaf_aggregators[i]
            p.kill()
            p.wait()


def make_net(opts: NetOptions) -> HomaggNet:
    """The topology ``opts.topo`` asks for."""
    if opts.topo == "leafspine":
        return TreeNet(opts)
    if opts.topo != "star":
        raise NetError(f"--topo {opts.topo}: star or leafspine")
    return HomaggNet(opts)


__all__ = ["TreeNet", "leaf_ip", "make_net"]
