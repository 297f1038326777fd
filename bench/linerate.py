"""Payload Gbit/s per CPU core of the software aggregator and of an agent, each engine against
C UDP loops measured in the same run.

    python -m bench.linerate                    # K = 256 and 2239, 4 workers, ~2 min
    python -m bench.linerate --words 2239 --seconds 5 --repeat 3

On loopback, no root. One load, bench/linerate_loop.c's ``blast`` (C, built here with cc):
every worker of one job in one process, round after round, each worker's packets for the S
slots sent as one GSO run, then every slot's answer awaited (a round unanswered for 0.2 s is
sent again). Worker w puts w + 1 in every word: every answer from the aggregator is checked
(its first and last word against the sum, its result flag), and a wrong one fails the run.
The targets, each on its own in turn, fed the same load:

- ``c-plain``: a C reflector, recvfrom + sendto per datagram (what one datagram per system
  call allows any loop);
- ``c-gso``: a C reflector with UDP GRO and GSO (recvmmsg; each coalesced run sent back as one
  send): what the kernel allows a core on this loopback, the issue's yardstick;
- ``python`` and ``native``: ``homagg-softswitch --engine python|native``, the job installed
  from a config file.

A target's rate is the gradient payload (the K words of every worker's packet, headers not
counted) it took in per CPU second of its own process (user + system, /proc/<pid>/stat), so
the load's share of the 2 cores does not count against it. The reflectors do no aggregation
and send W datagrams per W received, as the aggregator does (W results per slot). K = 2239 is
the software aggregator's largest K at a 9000-byte MTU (bmv2's is 2176); loopback's MTU is
64 KiB, so nothing is fragmented.

The agents, ``agent-python`` and ``agent-native`` (``AgentConfig.engine``):
``bench.linerate_agent``, one agent streaming rounds of ``--agent-words`` int32 words
(``Transport.stream``: the packet path, no codec) through the native aggregator, in a job of
one worker, so every result is its own words and every round is checked bit for bit. Its rate
is the payload it sent per CPU second of its rounds (``time.process_time`` around each
``stream``). Writes bench/out/linerate.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import plots
from bench.pps import OUT, SWITCH_IP, cpu_seconds, free_port, wait_quiet
from homagg import wire

ROOT = Path(__file__).resolve().parents[1]
LOOP_C = ROOT / "bench" / "linerate_loop.c"
KEY = 0x11AE5A7E
TARGETS = ("c-plain", "c-gso", "python", "native", "agent-python", "agent-native")


def build_loop(tmp: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("bench.linerate: no C compiler (cc) for its load and baseline loops")
    exe = tmp / "linerate_loop"
    subprocess.run([cc, "-O2", "-std=c11", "-o", str(exe), str(LOOP_C)], check=True)
    return exe


def config(tmp: Path, hosts: list[tuple[str, int]], slots: int) -> Path:
    text = f'[switch]\nname = "s1"\ntarget = "soft"\nip = "{SWITCH_IP}"\n\n'
    for w, (ip, _) in enumerate(hosts):
        text += (f'[[hosts]]\nname = "h{w}"\nip = "{ip}"\n'
                 f'mac = "00:00:0a:00:00:{w + 1:02x}"\nport = {w + 1}\n\n')
    text += (f"[[jobs]]\nid = 1\nslots = {slots}\nkey = {KEY}\nworkers = [ "
             + ", ".join(f'{{ host = "h{w}", udp_port = {port} }}'
                         for w, (_, port) in enumerate(hosts)) + " ]\n")
    cfg = tmp / "linerate.toml"
    cfg.write_text(text)
    return cfg


def start_aggregator(engine: str, tmp: Path, hosts: list[tuple[str, int]], k: int,
                     slots: int) -> subprocess.Popen:
    """``homagg-softswitch --engine ENGINE`` serving one job of ``hosts``, once listening."""
    stats = tmp / "stats.json"
    stats.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "homagg.targets.soft", "-c",
         str(config(tmp, hosts, slots)), "--grpc", "none", "--words", str(k),
         "--single-port", "--engine", engine, "--stats-file", str(stats),
         "--mtu", str(wire.JUMBO_MTU if k > wire.mtu_words() else wire.DEFAULT_MTU),
         "--log-level", "warning"])
    for _ in range(200):  # listening once the stats file appears
        if stats.exists() or proc.poll() is not None:
            break
        time.sleep(0.05)
    if not stats.exists():
        proc.kill()
        raise RuntimeError(f"{engine}: the aggregator did not start")
    return proc


def run_agent(target: str, k: int, slots: int, seconds: float, words: int, tmp: Path) -> dict:
    """An agent's rounds (``bench.linerate_agent``) through the native aggregator, one worker:
    payload per CPU second of the agent's rounds."""
    host = ("127.0.0.1", free_port("127.0.0.1"))
    proc = start_aggregator("native", tmp, [host], k, slots)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "bench.linerate_agent",
             f"{SWITCH_IP}:{wire.HOMAGG_UDP_PORT_MIN}", f"{host[0]}:{host[1]}",
             target.split("-", 1)[1], str(slots), str(words), str(seconds), str(KEY)],
            capture_output=True, text=True, cwd=ROOT)
    finally:
        proc.terminate()
        proc.wait(10)
    if out.returncode:
        raise RuntimeError(f"{target}: the agent failed: {out.stderr.strip()[-2000:]}")
    res = json.loads(out.stdout.splitlines()[-1])
    if res["wrong"]:
        raise RuntimeError(f"{target}: {res['wrong']} of {res['rounds']} rounds were wrong")
    payload = res["rounds"] * words * 4
    c = res["counters"]
    return {"target": target, "k": k, "workers": 1, "slots": slots, "rounds": res["rounds"],
            "resends": c["retransmissions"], "answers": c["results"], "wall": res["wall"],
            "cpu": res["cpu"],
            "gbit_core": payload * 8 / res["cpu"] / 1e9 if res["cpu"] else float("nan"),
            "gbit_wall": payload * 8 / res["wall"] / 1e9,
            "dgram_core": c["packets_sent"] / res["cpu"] if res["cpu"] else float("nan")}


def run_target(target: str, exe: Path, k: int, workers: int, slots: int, seconds: float,
               tmp: Path) -> dict:
    hosts = [(f"127.0.0.{w + 1}", free_port(f"127.0.0.{w + 1}")) for w in range(workers)]
    port = wire.HOMAGG_UDP_PORT_MIN
    if target.startswith("c-"):
        proc = subprocess.Popen([str(exe), "echo", f"{SWITCH_IP}:{port}", target[2:],
                                 str(seconds + 3)], stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
    else:
        proc = start_aggregator(target, tmp, hosts, k, slots)
    try:
        cpu0 = cpu_seconds(proc.pid)
        t0 = time.monotonic()
        out = subprocess.run([str(exe), "blast", f"{SWITCH_IP}:{port}", "1", str(KEY), str(k),
                              str(slots), str(seconds), "0" if target.startswith("c-") else "1",
                              *[f"{ip}:{p}" for ip, p in hosts]],
                             capture_output=True, text=True, check=True).stdout
        wall = time.monotonic() - t0
        cpu = cpu_seconds(proc.pid) - cpu0
    finally:
        proc.terminate()
        proc.wait(10)
    rounds, resends, wrong, answers = map(int, out.split())
    if wrong:
        raise RuntimeError(f"{target}: {wrong} of {answers} answers were not the exact sum")
    payload = rounds * workers * slots * k * 4
    return {"target": target, "k": k, "workers": workers, "slots": slots, "rounds": rounds,
            "resends": resends, "answers": answers, "wall": wall, "cpu": cpu,
            "gbit_core": payload * 8 / cpu / 1e9 if cpu else float("nan"),
            "gbit_wall": payload * 8 / wall / 1e9,
            "dgram_core": rounds * workers * slots / cpu if cpu else float("nan")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--words", default="256,2239", help="K values (comma separated)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=2, help="runs of every target, alternating")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--agent-words", type=int, default=1 << 20,
                    help="the agents' words per round (default %(default)s)")
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="seconds to wait for a quiet machine first (default %(default)s)")
    ap.add_argument("--out", type=Path, default=OUT / "linerate.json")
    a = ap.parse_args(argv)
    targets = a.targets.split(",")
    from homagg.targets.soft import native

    if not native.available():
        print(f"bench.linerate: the native engines are off ({native.why()}): left out",
              file=sys.stderr)
        targets = [t for t in targets if t not in ("native", "agent-native", "agent-python")]
    quiet = wait_quiet(a.quiet_wait)
    print(f"machine: {os.cpu_count()} cores; "
          + ("quiet" if quiet is not None else "busy (another process took a core)"),
          flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        exe = build_loop(tmp)
        for k in (int(x) for x in a.words.split(",")):
            wire.check_words(k)
            for r in range(a.repeat):
                for t in targets:
                    res = (run_agent(t, k, a.slots, a.seconds, a.agent_words, tmp)
                           if t.startswith("agent-") else
                           run_target(t, exe, k, a.workers, a.slots, a.seconds, tmp))
                    res["run"] = r
                    runs.append(res)
                    print(f"K={k:5d} {t:8s} run {r}: {res['gbit_core']:6.2f} Gbit/s per core, "
                          f"{res['gbit_wall']:6.2f} Gbit/s wall, {res['cpu'] / res['wall']:.2f} "
                          f"cores, {res['resends']} resends", flush=True)
    table = []
    for k in sorted({r["k"] for r in runs}):
        med = {t: statistics.median(r["gbit_core"] for r in runs if r["k"] == k
                                    and r["target"] == t) for t in targets}
        base = med.get("c-gso")
        for t in targets:
            table.append({"k": k, "target": t, "gbit_core": med[t],
                          "of_c_gso": med[t] / base if base else None})
    print(f"\npayload Gbit/s per CPU core of the target, median of {a.repeat} "
          f"({a.workers} workers, {a.slots} slots, {a.seconds:.0f} s each)")
    print(f"{'K':>5}  {'target':8s} {'Gbit/s/core':>11} {'of c-gso':>9}")
    for row in table:
        frac = f"{row['of_c_gso']:9.3f}" if row["of_c_gso"] is not None else " " * 9
        print(f"{row['k']:5d}  {row['target']:8s} {row['gbit_core']:11.2f} {frac}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"runs": runs, "table": table}, indent=1))
    print(f"\nwritten: {a.out}")
    plots.write_plot("linerate", plots.linerate, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
