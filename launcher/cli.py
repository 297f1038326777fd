"""homagg-net: a Mininet topology of workers around one aggregation switch.

    homagg-net demo                       train the demo recommender on 4 workers (main job)
    homagg-net demo --target soft --bw 100 --delay 1ms --loss 1
    homagg-net run -- bench --size 1000000 --density 0.01 --check   agents on every worker
    homagg-net exec -- python train.py    your command on every worker host, with its job's
                                          settings in the environment (HOMAGG_*, RANK, ...)
    homagg-net cli                        the topology with an interactive Mininet CLI
    homagg-net local -- torchrun --nproc-per-node 4 train.py
                                          no root: a software aggregator and the controller
                                          service on loopback, your command joining through it
    homagg-net run --workers 8 --jobs 4 --slots 16 --switch-slots 32 -- bench --check
                                          4 jobs of 16 slots, 2 of them past the switch's 32:
                                          those fall back to the software aggregator on host fb
    homagg-net run --topo leafspine --leaves 2 --workers-per-leaf 4 --jobs 2 -- bench --check
                                          2 jobs in one tree: 2 workers of each under each leaf

``--target auto`` (default) uses bmv2 where simple_switch_grpc and p4c-bm2-ss are installed,
else the software aggregator, and says which. Needs root (but ``local``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from homagg import wire
from homagg.errors import HomaggError
from homagg.launcher.net import HomaggNet, NetError, NetOptions
from homagg.launcher.tree import make_net
from homagg.targets.soft.shards import MAX_SHARDS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="homagg-net", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default="auto", choices=["auto", "soft", "bmv2"])
    common.add_argument("--workers", type=int, default=4)
    common.add_argument("--bw", type=float, help="link bandwidth, Mbit/s")
    common.add_argument("--delay", help="link delay, e.g. 1ms")
    common.add_argument("--loss", type=float, help="link loss, percent (each direction)")
    common.add_argument("--dup", type=float, help="link duplication, percent")
    common.add_argument("--reorder", type=float, help="link reordering, percent (needs --delay)")
    common.add_argument("--jitter", help="delay jitter, e.g. 1ms")
    common.add_argument("--jobs", type=int, default=1,
                        help="split the workers into N jobs (leafspine: each leaf's workers, "
                             "every job a tree over all the leaves)")
    common.add_argument("--inject-loss", type=float, metavar="PCT",
                        help="agents drop this percent of datagrams each way (no netem needed)")
    common.add_argument("--inject-dup", type=float, metavar="PCT")
    common.add_argument("--congestion", action="store_true",
                        help="agents with congestion control (homagg-agent --congestion)")
    common.add_argument("--inject-reorder", type=float, metavar="PCT")
    common.add_argument("--slots", type=int,
                        help="the job's slot region, i.e. each agent's window (default: 16 on "
                             "bmv2, whose queues drop deeper bursts, 8 at K above 256; 64 on "
                             "the soft target)")
    common.add_argument("--switch-slots", type=int, metavar="N",
                        help="the slots homagg may use on the switch (default: all); jobs "
                             "past them fall back to the software aggregator on host fb")
    common.add_argument("--no-fallback", action="store_true",
                        help="no fallback aggregator: a job that does not fit is an error")
    common.add_argument("--words", type=int, metavar="K",
                        help="words per packet the switch is built (bmv2) or started (soft) "
                             "with; default 256; the agents learn it from the switch. Up to "
                             "364 (soft; bmv2: 320, a multiple of 64) at the default MTU, 2239 "
                             "with --mtu 9000")
    common.add_argument("--mtu", type=int, default=wire.DEFAULT_MTU,
                        help="every link's MTU (default %(default)s); 9000: jumbo frames, for "
                             "K above 364 (bench.switch_cost: bmv2's cost is per packet)")
    common.add_argument("--shards", type=int, default=1, metavar="N",
                        help="each software aggregator (the soft target's, the fallback's) on "
                             "N processes, jobs spread over them (homagg-softswitch --shards)")
    common.add_argument("--log-dir", type=Path, help="default build/logs/net")
    common.add_argument("--topo", default="star", choices=["star", "leafspine"],
                        help="one switch, or leaf switches under a spine (a tree)")
    common.add_argument("--leaves", type=int, default=2, help="leafspine: leaf switches")
    common.add_argument("--workers-per-leaf", type=int, default=4,
                        help="leafspine: workers under each leaf (--workers is their product)")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", parents=[common], help="the end-to-end training demo")
    d.add_argument("--iterations", type=int, default=30)
    d.add_argument("--no-check", action="store_true", help="skip the bit-exact check")
    r = sub.add_parser("run", parents=[common], help="run homagg-agent on every worker")
    r.add_argument("agent_args", nargs=argparse.REMAINDER,
                   help="after --: homagg-agent subcommand and options")
    x = sub.add_parser("exec", parents=[common],
                       help="run a command on every worker host at once, its job's settings in "
                            "the environment; exit status: the worst of the workers'")
    x.add_argument("--service", action="store_true",
                   help="workers join through the controller service (homagg-ctl serve, on "
                        "host ctl): their environment has HOMAGG_CONTROLLER and HOMAGG_TOKEN, "
                        "not job and worker ids, and the service places each job when all its "
                        "ranks have joined (star topology)")
    x.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command and its args")
    sub.add_parser("cli", parents=[common], help="start the topology and a Mininet CLI")
    lo = sub.add_parser("local", help="no root, one machine: a software aggregator and the "
                                      "controller service on loopback, then your command with "
                                      "HOMAGG_CONTROLLER and HOMAGG_TOKEN (launcher/local.py)")
    lo.add_argument("--words", type=int, default=wire.WORDS_PER_PACKET, metavar="K",
                    help="words per packet of the aggregator (default %(default)s)")
    lo.add_argument("--slots", type=int, default=64,
                    help="a job's slot region, i.e. each agent's window (default %(default)s), "
                         "as in the other commands")
    lo.add_argument("--switch-slots", type=int, metavar="N",
                    help="the slots homagg may use on the aggregator (default: all)")
    lo.add_argument("--lease", type=float, default=15.0, help="workers' lease, seconds")
    lo.add_argument("--metrics-port", type=int, help="Prometheus metrics here (0: any)")
    lo.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command and its args")
    return p


def _options(a) -> NetOptions:
    o = NetOptions(workers=a.workers, target=a.target, bw=a.bw, delay=a.delay, loss=a.loss,
                   dup=a.dup, reorder=a.reorder, jitter=a.jitter, jobs=a.jobs, slots=a.slots,
                   switch_slots=a.switch_slots, fallback=not a.no_fallback, words=a.words,
                   mtu=a.mtu, topo=a.topo, leaves=a.leaves, workers_per_leaf=a.workers_per_leaf,
                   shards=a.shards)
    if not 1 <= a.shards <= MAX_SHARDS:
        raise NetError(f"--shards {a.shards}: 1 to {MAX_SHARDS}")
    for flag in ("inject_loss", "inject_dup", "inject_reorder"):
        if getattr(a, flag):
            o.agent_args += (f"--{flag.replace('_', '-')}", str(getattr(a, flag)))
    if getattr(a, "congestion", False):
        o.agent_args += ("--congestion",)
    if a.log_dir:
        o.log_dir = a.log_dir
    if getattr(a, "service", False):
        if o.topo != "star":
            raise NetError("--service: the star topology only (the service places a job on "
                           "one switch or the fallback, not across a tree)")
        o.service = True
    return o


def run_agents(net: HomaggNet, agent_args: list[str], echo_worker0: bool = True) -> list[dict]:
    """Run homagg-agent on every worker; worker 0's output is echoed live. Returns the
    summaries; raises NetError naming the workers that failed."""
    log_dir = net.opts.log_dir
    procs = []
    net.new_run()
    for w, h in enumerate(net.worker_hosts()):
        cmd = net.agent_command(w, "--summary-json", str(log_dir / f"worker{w}.json"),
                                *agent_args)
        (log_dir / f"worker{w}.json").unlink(missing_ok=True)
        procs.append(net.popen(h, cmd, None if w == 0 else log_dir / f"worker{w}.out"))
    lines = []
    for line in procs[0].stdout:
        lines.append(line)
        if echo_worker0:
            print(line, end="", flush=True)
    (log_dir / "worker0.out").write_text("".join(lines))
    failed = []
    for w, p in enumerate(procs):
        if p.wait() != 0:
            tail = (log_dir / f"worker{w}.out").read_text().strip().splitlines()[-1:]
            failed.append(f"worker {w} (exit {p.returncode}): {' '.join(tail)}")
    if failed:
        raise NetError("; ".join(failed))
    return [json.loads((log_dir / f"worker{w}.json").read_text()) for w in range(len(procs))]


def run_everywhere(net: HomaggNet, command: list[str]) -> int:
    """``command`` on every worker host at once, each with ``net.worker_env``; every output
    line is echoed with a ``[wN]`` prefix and logged to exec-wN.log; returns the worst exit
    status (a signal counts as 128 + its number)."""
    log_dir = net.opts.log_dir
    lock = threading.Lock()
    procs, readers = [], []
    net.new_run()

    def pump(w: int, stream) -> None:
        with open(log_dir / f"exec-w{w}.log", "w") as log:
            for line in stream:
                log.write(line)
                with lock:
                    print(f"[w{w}] {line}", end="", flush=True)

    for w, h in enumerate(net.worker_hosts()):
        env = {**os.environ, **net.worker_env(w)}
        p = net.popen(h, command, env=env)
        procs.append(p)
        t = threading.Thread(target=pump, args=(w, p.stdout), daemon=True)
        t.start()
        readers.append(t)
    codes = [p.wait() for p in procs]
    for t in readers:
        t.join(5)
    return max(c if c >= 0 else 128 - c for c in codes)


def demo(a) -> int:
    net = make_net(_options(a))
    label = "bmv2 (simple_switch_grpc running p4/homagg.p4)" if net.target == "bmv2" else \
        "software aggregator"
    print(f"homagg demo: {net.opts.workers} workers training an NCF-style recommender through the "
          f"switch\ntarget: {label} [{net.why}]", flush=True)
    t0 = time.monotonic()
    with net:
        print(net.placement(), flush=True)
        args = ["train", "--iterations", str(a.iterations)] + ([] if a.no_check else ["--check"])
        summaries = run_agents(net, args)
    digests = {s["model_digest"] for s in summaries}
    if len(digests) != 1:
        raise NetError(f"workers ended with different models: {sorted(digests)}")
    wire_b = sum(s["bytes_on_wire"] for s in summaries)
    dense_b = sum(s["dense_fp32_bytes"] for s in summaries)
    print(f"done on {net.target}: {a.iterations} iterations, final loss "
          f"{summaries[0]['final_loss']:.5f}, {wire_b / dense_b:.1%} of dense fp32 bytes, "
          f"{sum(s['retransmissions'] for s in summaries)} retransmissions, identical models "
          f"({digests.pop()}), "
          f"{'every aggregate bit-exact' if not a.no_check else 'not checked'}, "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    rec = [s.get("recovery", {}) for s in summaries]

    def total(key: str) -> float:
        return sum(r.get(key, 0) for r in rec)
    resent = sum(s["retransmissions"] for s in summaries)
    timeouts = resent - total("early_resends") - total("probes")
    # what recovery cost: per cause, resends and the seconds their lost copies had been out
    print(f"packets {sum(s['packets'] for s in summaries)}, resent {resent}: "
          f"{timeouts:.0f} on timeouts ({total('waited_timeout'):.1f} s), "
          f"{total('early_resends'):.0f} on RACK ({total('waited_rack'):.1f} s), "
          f"{total('probes'):.0f} probes ({total('probes_held'):.0f} answered held, "
          f"{total('waited_probe'):.1f} s); {total('held_back'):.0f} held back at timeouts, "
          f"{total('tail_copies'):.0f} tail copies", flush=True)
    return 0


def _interrupted(*_):
    raise KeyboardInterrupt  # SIGTERM tears the topology down like Ctrl-C does


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        if a.cmd == "demo":
            return demo(a)
        if a.cmd == "run":
            args = a.agent_args[1:] if a.agent_args[:1] == ["--"] else a.agent_args
            if not args:
                raise NetError("run needs the agent's subcommand after --, e.g. -- bench --check")
            with make_net(_options(a)) as net:
                print(f"target: {net.target} [{net.why}]\n{net.placement()}", flush=True)
                run_agents(net, args)
            return 0
        if a.cmd == "exec":
            command = a.command[1:] if a.command[:1] == ["--"] else a.command
            if not command:
                raise NetError("exec needs a command after --, e.g. -- python train.py")
            with make_net(_options(a)) as net:
                print(f"target: {net.target} [{net.why}]\n{net.placement()}", flush=True)
                rc = run_everywhere(net, command)
                if net.service is not None:
                    print(net.service_placement() or "the service placed no job", flush=True)
            if rc:
                print(f"homagg-net: a worker exited with status {rc}", file=sys.stderr)
            return rc
        if a.cmd == "local":
            from homagg.launcher.local import run_local

            command = a.command[1:] if a.command[:1] == ["--"] else a.command
            if not command:
                raise NetError("local needs a command after --, e.g. -- torchrun "
                               "--nproc-per-node 4 train.py")
            rc = run_local(command, a.words, a.switch_slots, a.slots, a.lease, a.metrics_port)
            return rc if rc >= 0 else 128 - rc  # killed by a signal: as a shell says it
        if a.cmd == "cli":
            from mininet.cli import CLI

            with make_net(_options(a)) as net:
                print(f"target: {net.target} [{net.why}]; agents: "
                      f"{' '.join(net.agent_command(0, 'bench', '--check'))}", flush=True)
                CLI(net.net)
            return 0
    except HomaggError as e:  # NetError, and local's (the aggregator, the service)
        print(f"homagg-net: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("homagg-net: interrupted, topology torn down", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
