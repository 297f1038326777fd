"""Fairness: two jobs whose traffic shares one 100 Mbit/s link, with the agents' congestion
control (host_agent.congestion) on and off, measured in the same run.

    sudo python -m bench.fairness               # soft target, off/on twice, ~3 min
    sudo python -m bench.fairness --rounds 1    # off and on once
    sudo python -m bench.fairness --slots2 16   # job 2's agents use 16 slots: unequal windows
    sudo python -m bench.fairness --queue 64    # the shared link's queue: 64 packets

How: launcher.net.HomaggNet starts the star topology with 4 worker hosts in two jobs of 2
(h1, h2: job 1; h3, h4: job 2) and the software aggregator on host ``agg``, whose link (both
its ends, HTB as ``homagg-net --bw`` shapes a worker's) runs at 100 Mbit/s: every packet of
both jobs crosses it, their contributions one way and their results the other. Every worker runs
the same dense all-reduce loop (``Agent.allreduce_int`` of N int32 words, each sum checked
against the exact integer sum): job 1 starts alone; job 2 starts ``--alone`` seconds later;
both run for ``--both`` seconds; job 2 stops first. Each iteration's start and end are logged
(the hosts share the clock), so a job's goodput in a time window is the words of the iterations
inside it (prorated at its edges) x 4 bytes / the window's length.

Reported per phase (congestion control off, then on; ``--rounds`` times, alternating): each
job's goodput over the window where both run (from job 2's first iteration to job 1's last
before job 2 stopped), its share of their sum (target: 40-60% each), Jain's index
(sum^2 / (2 x sum of squares): 1 is fair, 0.5 one job has it all); job 1's goodput alone
before job 2 started, and each job's lowest goodput over a second of the window, against its
mean (a job that collapses when the other starts shows it there).

bmv2: not run. Its switch is the aggregator (no link both jobs' packets cross but the switch's
own ports), and it forwards 13.6-16.3k packets/s here at K = 256 (docs/performance.md,
"Switch cost (bmv2)"), about what one 100 Mbit/s link carries: the shared link would not be
the bottleneck. Needs root and Mininet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LOG_DIR = ROOT / "build" / "logs" / "bench" / "fairness"
MBIT = 100


# -- one worker, on a Mininet host -----------------------------------------------------------
def tensor(job: int, worker: int, n: int) -> np.ndarray:
    """Worker ``worker`` of job ``job``'s int32 words (small enough that no sum overflows)."""
    return np.random.default_rng([job, worker]).integers(-(1 << 20), 1 << 20, n,
                                                         dtype=np.int32)


def worker(a) -> int:
    from homagg import wire
    from homagg.host_agent import Agent, AgentConfig, AgentError

    ip, _, port = a.bind.partition(":")
    cfg = AgentConfig(a.job, a.worker, a.workers, (a.switch, wire.HOMAGG_UDP_PORT_MIN),
                      (ip, int(port)), a.slots, mode="dense", deadline=30.0,
                      congestion=a.congestion, run=a.run)
    x = tensor(a.job, a.worker, a.size)
    expect = np.sum([tensor(a.job, w, a.size).astype(np.int64) for w in range(a.workers)],
                    axis=0)
    log = []
    time.sleep(max(0.0, a.start_at - time.time()))
    with Agent(cfg) as agent:
        go = np.ones(1, np.int32)
        while True:
            # every worker of the job stops at the same iteration: the first to pass the stop
            # time says so in a one-word round
            go[0] = time.time() < a.stop_at
            if int(agent.allreduce_int(go)[0]) < a.workers:
                break
            t0 = time.time()
            got = agent.allreduce_int(x)
            t1 = time.time()
            if not np.array_equal(got, expect):
                raise AgentError(f"job {a.job} worker {a.worker}: iteration {len(log)} is not "
                                 "the exact integer sum")
            log.append((t0, t1))
        cc = agent.transport.cc
        out = {"job": a.job, "worker": a.worker, "words": a.size, "iterations": log,
               "retransmissions": agent.counters.retransmissions,
               "packets": agent.counters.packets_sent,
               "cuts": cc.cuts if cc is not None else None,
               "srtt": agent.transport.rtt.srtt,
               "window": cc.window if cc is not None else None}
    Path(a.out).write_text(json.dumps(out))
    return 0


# -- the measurement ---------------------------------------------------------------------------
def goodput(log: list, words: int, lo: float, hi: float) -> float:
    """Bytes/s of the iterations in [lo, hi], each prorated by its part inside."""
    if hi <= lo:
        return 0.0
    done = 0.0
    for t0, t1 in log:
        inside = min(t1, hi) - max(t0, lo)
        if inside > 0:
            done += inside / (t1 - t0)
    return done * words * 4 / (hi - lo)


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 0.0


def shape(net, mbit: float, queue: int | None = None) -> None:
    """Both ends of the aggregator's link at ``mbit`` Mbit/s, as ``homagg-net --bw`` shapes a
    worker's link (HTB, its default queue: the device's 1000 packets); ``queue``: a FIFO of
    that many packets instead (a switch port's shallow buffer)."""
    from homagg.launcher.net import NetError

    agg = net.net.get("agg")
    for intf in (agg.defaultIntf(), agg.defaultIntf().link.intf2):
        fifo = ([f"tc qdisc add dev {intf.name} parent 1:1 handle 10: pfifo limit {queue}"]
                if queue else [])
        for c in (f"tc qdisc replace dev {intf.name} root handle 1: htb default 1",
                  f"tc class add dev {intf.name} parent 1: classid 1:1 htb rate {mbit}mbit "
                  f"ceil {mbit}mbit quantum {net.opts.mtu + 14}", *fifo):
            out = intf.node.cmd(c).strip()
            if "rror" in out or "nknown" in out:
                raise NetError(f"{c}: {out}")


def phase(net, a, cc: bool, tag: str) -> dict:
    """Job 1 alone, then both, then job 1 alone again; returns the figures."""
    from homagg.launcher.net import AGENT_PORT, host_ip

    log_dir = net.opts.log_dir
    net.reset_jobs()
    run = net.new_run()
    t = time.time() + 3.0  # the agents' start-up (imports) before job 1's clock starts
    windows = {1: (t, t + 2 * a.alone + a.both), 2: (t + a.alone, t + a.alone + a.both)}
    procs = []
    for w, h in enumerate(net.worker_hosts()):
        job, index, workers = net.job_of(w)
        out = log_dir / f"{tag}-w{w}.json"
        out.unlink(missing_ok=True)
        start, stop = windows[job]
        cmd = [sys.executable, "-m", "bench.fairness", "worker", "--job", str(job),
               "--worker", str(index), "--workers", str(workers),
               "--bind", f"{host_ip(w)}:{AGENT_PORT}",
               "--slots", str(a.slots2 if job == 2 and a.slots2 else net.opts.slots),
               "--size", str(a.size), "--start-at", str(start), "--stop-at", str(stop),
               "--run", str(run), "--out", str(out)] + (["--congestion"] if cc else [])
        procs.append(net.popen(h, cmd, log_dir / f"{tag}-w{w}.out", cwd=str(ROOT)))
    failed = [w for w, p in enumerate(procs) if p.wait() != 0]
    if failed:
        tail = (log_dir / f"{tag}-w{failed[0]}.out").read_text().strip().splitlines()[-1:]
        raise RuntimeError(f"workers {failed} failed: {' '.join(tail)}")
    res = [json.loads((log_dir / f"{tag}-w{w}.json").read_text()) for w in range(4)]
    logs = {1: res[0]["iterations"], 2: res[2]["iterations"]}
    lo, hi = logs[2][0][0], logs[2][-1][1]  # job 2's first and last iteration: both run
    both = [goodput(logs[j], a.size, lo, hi) for j in (1, 2)]
    alone = goodput(logs[1], a.size, logs[1][0][0], lo)
    secs = [(s, s + 1.0) for s in np.arange(lo, hi - 1.0, 1.0)]
    low = [min(goodput(logs[j], a.size, s0, s1) for s0, s1 in secs) if secs else 0.0
           for j in (1, 2)]
    return {"cc": cc, "both": both, "share": [b / sum(both) for b in both],
            "jain": jain(both), "alone": alone, "low": low, "seconds": hi - lo,
            "retx": [r["retransmissions"] for r in res],
            "cuts": [r["cuts"] for r in res], "exact": True}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    w = sub.add_parser("worker", help="(internal) one worker's all-reduce loop")
    for name in ("--job", "--worker", "--workers", "--slots", "--size", "--run"):
        w.add_argument(name, type=int, required=True)
    w.add_argument("--switch", default="10.0.0.254")
    w.add_argument("--bind", required=True)
    w.add_argument("--start-at", type=float, required=True)
    w.add_argument("--stop-at", type=float, required=True)
    w.add_argument("--congestion", action="store_true")
    w.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    ap.add_argument("--size", type=int, default=1 << 18, help="words per all-reduce")
    ap.add_argument("--alone", type=float, default=4.0, help="seconds job 1 runs alone first")
    ap.add_argument("--both", type=float, default=12.0, help="seconds both jobs run")
    ap.add_argument("--queue", type=int, metavar="PACKETS",
                    help="the shared link's queue (default: HTB's, the device's 1000 packets)")
    ap.add_argument("--slots2", type=int,
                    help="job 2's agents use this many of its slots (default: all, as job 1)")
    a = ap.parse_args(argv)
    if a.cmd == "worker":
        return worker(a)
    if os.geteuid() != 0:
        print("fairness: skipped, needs root (Mininet)")
        return 0
    from homagg.launcher.net import SWITCH_IP, HomaggNet, NetOptions

    assert SWITCH_IP == "10.0.0.254", SWITCH_IP  # the workers' default --switch
    rows = []
    t_start = time.monotonic()
    load = os.getloadavg()[0]
    opts = NetOptions(workers=4, jobs=2, target="soft", log_dir=LOG_DIR, fallback=False)
    with HomaggNet(opts) as net:
        shape(net, MBIT, a.queue)
        for r in range(a.rounds):
            for cc in (False, True):
                row = phase(net, a, cc, f"r{r}-{'on' if cc else 'off'}")
                rows.append(row)
                print(f"[{time.monotonic() - t_start:4.0f} s] cc {'on ' if cc else 'off'}: "
                      f"shares {row['share'][0]:.1%} / {row['share'][1]:.1%}",
                      file=sys.stderr, flush=True)
    print(f"homagg fairness: two jobs of 2 workers (soft target, {opts.slots} slots each, "
          f"dense all-reduce of {a.size} int32 words in a loop, every sum exact) sharing the "
          f"aggregator's {MBIT} Mbit/s link (HTB, queue "
          f"{f'{a.queue} packets' if a.queue else 'its default'}); "
          f"{f'job 2 uses {a.slots2} slots; ' if a.slots2 else ''}job 2 runs {a.both:.0f} s "
          f"inside job 1's run; {os.cpu_count()} CPUs, load {load:.1f} at the start")
    hdr = (f"{'cc':>3} {'job 1 Mbit/s':>12} {'job 2 Mbit/s':>12} {'share 1':>7} {'share 2':>7} "
           f"{'Jain':>5} {'job 1 alone':>11} {'low 1 s: 1':>10} {'2':>5} {'retx':>6} "
           f"{'cuts':>5}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        cuts = sum(c for c in r["cuts"] if c is not None) if r["cc"] else "-"
        print(f"{'on' if r['cc'] else 'off':>3} {r['both'][0] * 8e-6:>12.1f} "
              f"{r['both'][1] * 8e-6:>12.1f} {r['share'][0]:>7.1%} {r['share'][1]:>7.1%} "
              f"{r['jain']:>5.3f} {r['alone'] * 8e-6:>11.1f} {r['low'][0] * 8e-6:>10.1f} "
              f"{r['low'][1] * 8e-6:>5.1f} {sum(r['retx']):>6} {cuts:>5}")
    for cc in (False, True):
        sh = [s for r in rows if r["cc"] == cc for s in r["share"]]
        ok = all(0.4 <= s <= 0.6 for s in sh)
        print(f"target check (cc {'on' if cc else 'off'}): shares {min(sh):.1%} to "
              f"{max(sh):.1%} ({'meets' if ok else 'misses'} 40-60% each)")
    print("Mbit/s: all-reduced payload (words x 4 bytes) per second; 'low 1 s': the job's "
          "lowest goodput over one second while both run; bmv2: not run (see the module's "
          f"docstring); total {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
