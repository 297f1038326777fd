"""A chaos soak of the controller service (issue 57): jobs on a tree and on a star while a
leaf, the aggregator and the service itself are killed (SIGKILL) and started again at random.

    python -m bench.chaos_soak --minutes 30 --seed 1

Loopback only (127.0.0.0/8, nothing else): a star (one ``homagg-softswitch``) and a tree (a
spine and two leaves, each a ``homagg-softswitch``), each behind a ``homagg-ctl serve``
process of its own (``--key-file``, so a restarted service still knows its jobs' secrets).
Job lanes run one job after another: 2 to 4 ranks, threads of this process, each joining
through the service (``membership.join``) and all-reducing small integer tensors, every sum
checked bit for bit against the integer sum; a tree job's ranks sit under one leaf or across
both. A fault thread kills one of leaf1, leaf2, the star's aggregator, or one of the two
services every few seconds (seeded), and starts it again a moment later. Every 20 s each
service also gets a malformed 1 MB Join (not UTF-8, no token), for the log's sake.

A job ends exact (every rank, every round), failed with a named reason (each failing rank
raised the agent's own JoinError or AgentError, whose message names the cause), or failed
WITHOUT one: any other exception, a rank still running 60 s after its deadline, or a sum
that is not exact. At the end every process is up again, the leases run out, and what the
switches still hold (job ids, slots), with what the services hold or owe, is counted: it
must be nothing. The exit status is 0 when that is so and no job failed without a reason.
"""

from __future__ import annotations

import argparse
import logging
import queue
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.softprocs import ROOT, SoftProcess, free_port, loopback

LEASE = 3.0          # the services' lease (s): what a dead rank or switch costs, at most
ROUNDS = 4           # all-reduces a job makes
SIZE = 3000          # int32 elements an all-reduce sums
DEADLINE = 6.0       # the agents' deadline without progress (s)
MALFORMED_EVERY = 20.0
NET = "127.62"       # the soak's loopback network: switches in .0-.2, hosts in .10-.12


def _ip(c: int, d: int) -> str:
    return loopback(f"{NET}.{c}.{d}")


@dataclass
class Serve:
    """One ``homagg-ctl serve`` process (and its log), at a fixed 127.0.0.1 address."""

    name: str
    config: Path
    workdir: Path
    listen: str = ""
    metrics: str = ""
    proc: subprocess.Popen | None = field(default=None, repr=False)
    starts: int = 0

    def __post_init__(self) -> None:
        self.listen = self.listen or f"127.0.0.1:{free_port()}"
        self.log = self.workdir / f"serve-{self.name}.log"

    def start(self, timeout: float = 90.0) -> None:
        """Start it (again), retrying while it cannot (a switch of its tree down: it reads its
        jobs back from every switch first)."""
        until = time.monotonic() + timeout
        while True:
            if self._try():
                self.starts += 1
                return
            if time.monotonic() > until:
                raise RuntimeError(f"serve {self.name} did not start: {self.log}")
            time.sleep(0.5)

    def _try(self) -> bool:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "homagg.controller.cli", "-c", str(self.config),
                 "--log-level", "info", "serve", "--listen", self.listen, "--no-token",
                 "--lease", str(LEASE), "--slots", "8", "--join-wait", "20",
                 "--key-file", str(self.workdir / f"{self.name}.key"),
                 "--trust-worker-address", "--metrics-port", "0"],
                stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, lines), daemon=True).start()
        try:
            first, second = (lines.get(timeout=30) for _ in range(2))
        except queue.Empty:
            first = second = ""
        if not first.startswith("serving joins at ") or not second.startswith("metrics at "):
            self.kill()
            return False
        self.metrics = second.split()[2]
        return True

    @staticmethod
    def _read(proc: subprocess.Popen, lines: queue.Queue) -> None:
        """Its stdout, line by line, until it exits (the first lines say where it serves)."""
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def gauge(self, metric: str) -> float:
        with urllib.request.urlopen(self.metrics, timeout=30) as r:
            text = r.read().decode()
        found = re.findall(rf"^{metric} (\S+)$", text, re.M)
        return float(found[0]) if found else 0.0


@dataclass
class Tally:
    jobs: Counter = field(default_factory=Counter)   # outcome -> jobs
    reasons: Counter = field(default_factory=Counter)  # a named reason's kind -> ranks
    examples: dict[str, str] = field(default_factory=dict)  # kind -> the first such reason
    unnamed: list[str] = field(default_factory=list)  # what each job without a reason said
    requests: int = 0    # joins, renewals and leaves the agents made, and malformed Joins
    faults: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def reason_kind(text: str) -> str:
    """A named reason in a few words (for the summary's breakdown)."""
    for key, kind in (("is unreachable", "switch unreachable"), ("no longer holds", "switch lost"),
                      ("lease ran out", "a lease ran out"), ("cannot reach the controller",
                                                             "service unreachable"),
                      ("refused the join", "join refused"), ("no result", "no result"),
                      ("got no answer", "a switch did not answer"),
                      ("controller says", "service said")):
        if key in text:
            return kind
    return "other named"


class Soak:
    def __init__(self, a, workdir: Path):
        self.a = a
        self.rng = random.Random(a.seed)
        self.stop = threading.Event()
        self.tally = Tally()
        w = workdir
        self.sw = {"star": SoftProcess("star", _ip(0, 254), w),
                   "spine": SoftProcess("spine", _ip(1, 254), w),
                   "leaf1": SoftProcess("leaf1", _ip(2, 1), w),
                   "leaf2": SoftProcess("leaf2", _ip(2, 2), w)}
        (w / "star.toml").write_text(
            f'[switch]\nname = "star"\ntarget = "soft"\ngrpc = "{self.sw["star"].grpc}"\n'
            f'ip = "{self.sw["star"].ip}"\n')
        tree = (f'[switch]\nname = "spine"\ntarget = "soft"\ngrpc = "{self.sw["spine"].grpc}"\n'
                f'ip = "{self.sw["spine"].ip}"\n')
        for i in (1, 2):
            leaf = self.sw[f"leaf{i}"]
            tree += (f'\n[[switches]]\nname = "leaf{i}"\nparent = "spine"\ntarget = "soft"\n'
                     f'grpc = "{leaf.grpc}"\nip = "{leaf.ip}"\nunder = ["{NET}.1{i}.0/24"]\n')
        (w / "tree.toml").write_text(tree)
        self.serve = {"star": Serve("star", w / "star.toml", w),
                      "tree": Serve("tree", w / "tree.toml", w)}
        self._hosts = 0
        self._hosts_lock = threading.Lock()

    # -- the processes ---------------------------------------------------------------------
    def up(self) -> None:
        for sp in self.sw.values():
            if not sp.alive:
                sp.start()
        for s in self.serve.values():
            if s.proc is None or s.proc.poll() is not None:
                s.start()

    def down(self) -> None:
        for s in self.serve.values():
            s.kill()
        for sp in self.sw.values():
            sp.kill()

    def faults(self) -> None:
        """Kill one of leaf1, leaf2, the star's aggregator or a service; start it again."""
        targets = ["leaf1", "leaf2", "star", "serve-star", "serve-tree"]
        while not self.stop.wait(self.rng.uniform(self.a.fault_min, self.a.fault_max)):
            what = self.rng.choice(targets)
            pause = self.rng.uniform(0.5, 4.0)
            proc = self.serve[what[6:]] if what.startswith("serve-") else self.sw[what]
            proc.kill()
            time.sleep(pause)
            for _attempt in range(5):
                try:
                    proc.start()
                    break
                except Exception as e:  # noqa: BLE001 - said, and tried again
                    print(f"  {what} did not start again ({e}); trying again", flush=True)
                    proc.kill()
                    time.sleep(1.0)
            with self.tally.lock:
                self.tally.faults[what] += 1
            print(f"  fault: {what} killed, back after {pause:.1f} s", flush=True)

    def malformed(self) -> None:
        """A 1 MB Join that is not UTF-8, without a token, to each service now and then."""
        import grpc

        body = b"\x12\x80\x80\x40" + b"\xff" * (1 << 20)  # field 2 (job), 1 MiB long
        while not self.stop.wait(MALFORMED_EVERY):
            for s in self.serve.values():
                with grpc.insecure_channel(s.listen) as ch:
                    call = ch.unary_unary("/homagg.membership.Membership/Join")
                    try:
                        call(body, timeout=10)
                    except grpc.RpcError:
                        pass
                with self.tally.lock:
                    self.tally.requests += 1

    # -- the jobs --------------------------------------------------------------------------
    def host(self, c: int) -> str:
        with self._hosts_lock:
            self._hosts += 1
            return _ip(c, self._hosts % 250 + 1)

    def lane(self, kind: str, lane: int) -> None:
        n = 0
        while not self.stop.is_set() and self.jobs_left():
            n += 1
            outcome, said = self.job(kind, f"soak-{kind}{lane}-{n}", self.rng.randint(2, 4),
                                     self.rng.choice(["across", "leaf1", "leaf2"]))
            with self.tally.lock:
                self.tally.jobs[outcome] += 1
                if outcome == "failed, reason named":
                    for t in said:
                        self.tally.reasons[reason_kind(t)] += 1
                        self.tally.examples.setdefault(reason_kind(t), t)
                elif outcome != "exact":
                    self.tally.unnamed.append(f"{kind}: {outcome}: {said[:3]}")
                    print(f"  UNNAMED {kind}: {outcome}: {said[:3]}", flush=True)

    def jobs_left(self) -> bool:
        with self.tally.lock:
            return sum(self.tally.jobs.values()) < self.a.max_jobs

    def job(self, kind: str, name: str, world: int, spread: str) -> tuple[str, list[str]]:
        """One job's ranks, as threads; its outcome and what its failing ranks said."""
        if kind == "star":
            ips = [self.host(10) for _ in range(world)]
        else:
            leaf = {"leaf1": [11], "leaf2": [12], "across": [11, 12]}[spread]
            ips = [self.host(leaf[r % len(leaf)]) for r in range(world)]
        secret = secrets.token_hex(16)
        inputs = [np.random.default_rng([hash(name) & 0xFFFF, r]).integers(
            -50_000, 50_000, (ROUNDS, SIZE)).astype(np.int32) for r in range(world)]
        want = np.sum(inputs, axis=0, dtype=np.int64)
        results: dict[int, tuple[str, str]] = {}
        ts = [threading.Thread(target=self.rank, args=(kind, name, r, world, ips[r], secret,
                                                        inputs[r], want, results), daemon=True)
              for r in range(world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20 + 10 + ROUNDS * DEADLINE + 60)
        hung = [r for r, t in enumerate(ts) if t.is_alive()]
        if hung:
            return "failed, no reason (hung)", [f"ranks {hung} still running"]
        kinds = {k for k, _ in results.values()}
        said = [t for k, t in results.values() if k != "exact"]
        if "inexact" in kinds:
            return "failed, no reason (inexact sum)", said
        if "unnamed" in kinds:
            return "failed, no reason (raw exception)", said
        if "named" in kinds:
            return "failed, reason named", said
        return "exact", []

    def rank(self, kind: str, name: str, rank: int, world: int, ip: str, secret: str,
             xs: np.ndarray, want: np.ndarray, results: dict) -> None:
        from homagg.host_agent import Agent, AgentConfig, AgentError
        from homagg.host_agent.membership import JoinError, join

        m = None
        try:
            m = join(self.serve[kind if kind == "star" else "tree"].listen, "", name, rank,
                     world, bind=(ip, 0), slots=8, wait=20.0, claim_ip=ip, retry=20.0,
                     join_secret=secret)
            tree = m.leaf_workers > 0
            opts = {"local_workers": m.leaf_workers, "siblings": m.siblings} if tree else {}
            cfg = AgentConfig(m.job_id, m.leaf_worker if tree else m.worker, m.workers,
                              m.send_to, (m.ip, m.udp_port), m.slots, run=m.run, key=m.key,
                              membership=m, deadline=DEADLINE, **opts)
            with Agent(cfg) as agent:
                for it in range(ROUNDS):
                    got = agent.allreduce_int(xs[it])
                    if not np.array_equal(got, want[it]):
                        results[rank] = ("inexact", f"rank {rank} round {it}: not the sum")
                        return
            results[rank] = ("exact", "")
        except (JoinError, AgentError) as e:
            results[rank] = ("named" if str(e).strip() else "unnamed", str(e)[:300])
        except Exception as e:  # noqa: BLE001 - counted: a failure without a named reason
            results[rank] = ("unnamed", f"{type(e).__name__}: {e}"[:300])
        finally:
            if m is not None:
                with self.tally.lock:
                    self.tally.requests += 2 + m.renewals  # its join, renewals and leave
                m.leave()
            else:
                with self.tally.lock:
                    self.tally.requests += 1

    # -- the end ---------------------------------------------------------------------------
    def held(self) -> dict[str, float]:
        """What is held now: job ids and slots on every switch, and what the services hold
        or owe."""
        from homagg.controller import jobs as J
        from homagg.controller.p4client import P4RuntimeSwitch

        ids = slots = 0
        for sp in self.sw.values():
            with P4RuntimeSwitch(sp.grpc, 1, (0, 9), None, sp.name).open() as s:
                found = J.list_jobs(s)
            ids += len(found)
            slots += sum(j.size for j in found)
        held = sum(s.gauge("homagg_service_jobs_held") for s in self.serve.values())
        owed = sum(s.gauge("homagg_service_removals_owed") for s in self.serve.values())
        return {"job ids": ids, "slots": slots, "service held": held, "service owed": owed}

    def run(self) -> int:
        a = self.a
        t0 = time.monotonic()
        self.up()
        lanes = [threading.Thread(target=self.lane, args=(k, i), daemon=True)
                 for k, n in (("star", a.star_lanes), ("tree", a.tree_lanes))
                 for i in range(n)]
        side = [threading.Thread(target=f, daemon=True) for f in (self.faults, self.malformed)]
        for t in lanes + side:
            t.start()
        end = t0 + a.minutes * 60
        while time.monotonic() < end and any(t.is_alive() for t in lanes):
            time.sleep(0.5)
        self.stop.set()
        for t in side:
            t.join(120)
        self.up()
        for t in lanes:
            t.join(300)
        ran = time.monotonic() - t0
        # every lease out, and what was owed settled
        until = time.monotonic() + 3 * LEASE + 30
        left = self.held()
        while any(left.values()) and time.monotonic() < until:
            time.sleep(1.0)
            left = self.held()
        log_bytes = sum(s.log.stat().st_size for s in self.serve.values() if s.log.exists())
        tl = self.tally
        jobs = sum(tl.jobs.values())
        unnamed = sum(n for k, n in tl.jobs.items() if k.startswith("failed, no reason"))
        print(f"chaos soak, seed {a.seed}: {ran / 60:.1f} minutes")
        print(f"jobs run: {jobs}")
        print(f"faults injected: {sum(tl.faults.values())} ("
              + ", ".join(f"{k} {n}" for k, n in sorted(tl.faults.items())) + ")")
        print(f"jobs exact: {tl.jobs['exact']}")
        print(f"jobs failed with a named reason: {tl.jobs['failed, reason named']} (ranks: "
              + ", ".join(f"{k} {n}" for k, n in tl.reasons.most_common()) + ")")
        for kind, text in sorted(tl.examples.items()):
            print(f"  e.g. {kind}: {text[:240]}")
        print(f"jobs failed WITHOUT a named reason: {unnamed}"
              + "".join(f"\n  {u}" for u in tl.unnamed[:10]))
        print(f"left held at the end: {left['job ids']:.0f} job ids, {left['slots']:.0f} "
              f"slots on the switches; services hold {left['service held']:.0f} jobs, owe "
              f"{left['service owed']:.0f} removals")
        print(f"service log: {log_bytes} bytes for {tl.requests} requests, "
              f"{log_bytes / max(tl.requests, 1):.0f} bytes per request")
        ok = unnamed == 0 and not any(left.values()) and jobs > 0
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.chaos_soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long jobs are started")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-jobs", type=int, default=100_000, help="stop after this many jobs")
    ap.add_argument("--star-lanes", type=int, default=1, help="star jobs running at once")
    ap.add_argument("--tree-lanes", type=int, default=2, help="tree jobs running at once")
    ap.add_argument("--fault-min", type=float, default=4.0, help="seconds between faults, least")
    ap.add_argument("--fault-max", type=float, default=10.0, help="seconds between faults, most")
    ap.add_argument("--workdir", type=Path, help="keep the logs here (default: a temp dir)")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    logging.getLogger("homagg").setLevel(logging.ERROR)  # (each rank's failure is counted)
    if a.minutes <= 0 or a.max_jobs < 1 or not 0 < a.fault_min <= a.fault_max:
        parser().error("--minutes > 0, --max-jobs >= 1, 0 < --fault-min <= --fault-max")
    # (SIGTERM ends it as Ctrl-C does: every process it started is killed on the way out)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    with tempfile.TemporaryDirectory(prefix="homagg-soak-") as tmp:
        soak = Soak(a, a.workdir or Path(tmp))
        try:
            return soak.run()
        finally:
            soak.down()


if __name__ == "__main__":
    sys.exit(main())
