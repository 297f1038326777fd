"""Packets per second per core: the host agent and the software aggregator (issue 12, item 5c).

    python -m bench.pps                     # K = 256 (the default build) and 64, ~1 min
    python -m bench.pps --words 256 --workers 4 --size 4000000

On loopback, no root: one ``homagg-softswitch`` (its own process) and W ``homagg-agent bench
--mode dense`` processes (every value through the aggregator: the most packets per element),
for each K. A process's datagrams are what it sent and received (the agent's packets, join,
results and ignored datagrams from its summary; the aggregator's STAT_RX and the replies it
multicast, from its counters), its CPU time is user + system from the kernel (wait4 for the
agents, /proc/<pid>/stat for the aggregator), so datagrams / CPU second is the rate one core
sustains, whatever else the machine runs. The agents' rate comes twice: per CPU second of the
whole process (wait4: its start, imports, numba's JIT and the join included), and in steady
state (``steady``): each agent (``homagg-agent bench``) counts its datagrams and its own CPU
(``time.process_time``) around each all-reduce call after the first iteration, so start-up,
imports, JIT and the join (before or in the first call) are out, and so is the bench drawing
its tensors between calls; the agent's codec (quantize, scan, decode) is in. ``path``: the
same datagrams per CPU second of the transport's rounds alone (``Transport.stream``, timed
the same way): the packet path without the codec.

The baseline, measured in the same run: a Python UDP echo server (recvfrom_into + sendto per
datagram, nothing else) fed by a client that keeps a window of datagrams of the same size
outstanding: what one datagram per system call allows any Python loop, to compare the
agent's and the aggregator's per-packet work with. The agents and the aggregator batch
datagrams through UDP GSO and GRO (``homagg.udpio``); the table says how many datagrams each
system call carried (``dg/call``), from their sockets' own counters.

    python -m bench.pps --shards 1,2 --repeat 8       # the aggregator on 1 core against 2

``--shards``: what cores buy the aggregator (``homagg-softswitch --shards N``), in datagrams per
wall-clock second: J jobs (``--jobs``), each fed by one ``bench.loadgen`` process that plays
all its workers with prebuilt rounds (every result checked against the integer sum), so the
load costs less per datagram than the aggregator (it still shares the cores: the table says
how much). Runs of each N alternate, so a shared machine's noise falls on both; the table has,
per run, the cores the aggregator's processes, the load and everything else on the machine
took (/proc/stat), and the ratio run by run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from homagg import wire

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
SWITCH_IP = "127.0.0.254"
KEY = 0x5EC00000  # the jobs' keys: KEY + job id (a config job needs one)
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a running process (/proc/<pid>/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def free_port(ip: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def wait_cpu(p: subprocess.Popen) -> tuple[int, float]:
    """Exit status and user + system CPU seconds of a child, from wait4."""
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, ru.ru_utime + ru.ru_stime


def run_homagg(k: int, workers: int, size: int, iterations: int, tmp: Path) -> dict:
    hosts = [(f"127.0.0.{w + 1}", free_port(f"127.0.0.{w + 1}")) for w in range(workers)]
    cfg = tmp / f"k{k}.toml"
    cfg.write_text(
        f'[switch]\nname = "s1"\ntarget = "soft"\nip = "{SWITCH_IP}"\n\n'
        + "".join(f'[[hosts]]\nname = "h{w}"\nip = "{ip}"\nmac = "00:00:0a:00:00:{w + 1:02x}"\n'
                  f"port = {w + 1}\n\n" for w, (ip, _) in enumerate(hosts))
        + f"[[jobs]]\nid = 1\nslots = 64\nkey = {KEY + 1}\nworkers = [ "
        + ", ".join(f'{{ host = "h{w}", udp_port = {port} }}' for w, (_, port) in enumerate(hosts))
        + " ]\n")
    stats = tmp / f"k{k}-stats.json"
    agg = subprocess.Popen([sys.executable, "-m", "homagg.targets.soft", "-c", str(cfg),
                            "--grpc", "none", "--words", str(k), "--stats-file", str(stats),
                            "--log-level", "warning"])
    try:
        for _ in range(100):  # listening once the stats file appears (written every 0.2 s)
            if stats.exists():
                break
            time.sleep(0.1)
        cpu0 = cpu_seconds(agg.pid)
        agents = [subprocess.Popen(
            [sys.executable, "-m", "homagg.host_agent", "--job", "1", "--worker", str(w),
             "--workers", str(workers), "--switch", SWITCH_IP, "--bind", f"{ip}:{port}",
             "--slots", "64", "--mode", "dense", "--key", str(KEY + 1),
             "--summary-json", str(tmp / f"k{k}-w{w}.json"),
             "bench", "--size", str(size), "--density", "1", "--iterations", str(iterations)],
            stdout=subprocess.DEVNULL) for w, (ip, port) in enumerate(hosts)]
        done = [wait_cpu(p) for p in agents]
        time.sleep(0.5)  # the stats file catches up (0.2 s)
        agg_cpu = cpu_seconds(agg.pid) - cpu0
    finally:
        agg.terminate()
        agg.wait(5)
    if any(rc for rc, _ in done):
        raise RuntimeError(f"K={k}: an agent failed: exit statuses {[rc for rc, _ in done]}")
    sums = [json.loads((tmp / f"k{k}-w{w}.json").read_text()) for w in range(workers)]
    agent_dgrams = [s["packets"] + s["join_packets"] + s["results"] + s["ignored"] for s in sums]
    full = json.loads(stats.read_text())
    st, agg_io = full["switch"], full["io"]
    agent_io = [s["io"] for s in sums]
    calls = sum(i["send_calls"] + i["recv_calls"] for i in agent_io)
    # replies: one per worker per completed round (multicast), plus the unicast replies
    agg_out = (st["STAT_COMPLETED"] * workers + st["STAT_RETRANS_REPLY"]
               + st["STAT_DUP_PENDING"])
    agg_dgrams = st["STAT_RX"] + agg_out
    steady = [s["steady"] for s in sums]
    return {"k": k, "agent_pps_core": sum(agent_dgrams) / sum(c for _, c in done),
            # iterations after the first, the all-reduce calls only (homagg-agent bench)
            "agent_steady_pps_core": sum(s["datagrams"] for s in steady)
            / max(sum(s["cpu"] for s in steady), 1e-9),
            "agent_steady_cpu": sum(s["cpu"] for s in steady),
            # of those, the transport's rounds only (Transport.stream: no codec)
            "agent_path_pps_core": sum(s["datagrams"] for s in steady)
            / max(sum(s["stream_cpu"] for s in steady), 1e-9),
            "agg_pps_core": agg_dgrams / agg_cpu,
            "agent_el_s_core": size * iterations * workers / sum(c for _, c in done),
            "agg_el_s_core": size * iterations / agg_cpu,
            "agg_cpu": agg_cpu, "agent_cpu": sum(c for _, c in done),
            "agg_dgrams": agg_dgrams, "agent_dgrams": sum(agent_dgrams),
            # datagrams per system call (udpio's counters: GSO sends, GRO receives)
            "agent_per_call": sum(i["sent"] + i["received"] for i in agent_io) / max(calls, 1),
            "agg_per_call": (agg_io["sent"] + agg_io["received"])
            / max(agg_io["send_calls"] + agg_io["recv_calls"], 1),
            "seconds": max(s["seconds"] for s in sums)}


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy, all cores (/proc/stat: all but idle and
    iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


def wait_quiet(limit: float, probe: float = 1.0) -> float | None:
    """Wait until the machine is quiet: everything on it took at most QUIET cores over a
    ``probe``-second window (/proc/stat). Seconds waited, or None after ``limit``."""
    t0 = time.monotonic()
    while True:
        b0 = busy_seconds()
        time.sleep(probe)
        if (busy_seconds() - b0) / probe <= QUIET:
            return time.monotonic() - t0
        if time.monotonic() - t0 >= limit:
            return None


def shard_pids(pid: int) -> list[int]:
    """The child processes of ``pid`` (an aggregator's shards)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def run_shards(shards: int, jobs: int, workers: int, slots: int, k: int, seconds: float,
               tmp: Path) -> dict:
    """``homagg-softswitch --shards N`` fed by ``bench.loadgen``, one process per job (every
    worker of a job in it): the rounds' datagrams per wall-clock second, and the CPU the
    aggregator (its processes) and the generators took in that time."""
    hosts = [[(f"127.0.{j + 1}.{w + 1}", free_port(f"127.0.{j + 1}.{w + 1}"))
              for w in range(workers)] for j in range(jobs)]
    cfg = tmp / f"shards{shards}.toml"
    text = f'[switch]\nname = "s1"\ntarget = "soft"\nip = "{SWITCH_IP}"\n\n'
    for j, hs in enumerate(hosts):
        for w, (ip, _) in enumerate(hs):
            n = j * workers + w + 1
            text += (f'[[hosts]]\nname = "h{j}x{w}"\nip = "{ip}"\n'
                     f'mac = "00:00:0a:00:{n >> 8:02x}:{n & 255:02x}"\nport = {n}\n\n')
    for j, hs in enumerate(hosts):
        text += (f"[[jobs]]\nid = {j + 1}\nslots = {slots}\nkey = {KEY + j + 1}\nworkers = [ "
                 + ", ".join(f'{{ host = "h{j}x{w}", udp_port = {port} }}'
                             for w, (_, port) in enumerate(hs)) + " ]\n\n")
    cfg.write_text(text)
    stats = tmp / f"shards{shards}-stats.json"
    stats.unlink(missing_ok=True)
    agg = subprocess.Popen([sys.executable, "-m", "homagg.targets.soft", "-c", str(cfg),
                            "--grpc", "none", "--words", str(k), "--stats-file", str(stats),
                            "--shards", str(shards), "--log-level", "warning"])
    gens = []
    try:
        for _ in range(200):  # listening once the stats file appears (written every 0.2 s)
            if stats.exists():
                break
            time.sleep(0.1)
        pids = [agg.pid] + (shard_pids(agg.pid) if shards > 1 else [])
        cpu0 = sum(cpu_seconds(p) for p in pids)
        rx0 = json.loads(stats.read_text())["switch"]["STAT_RX"]
        start = time.time() + 2.0  # the generators' imports done
        gens = [subprocess.Popen(
            [sys.executable, "-m", "bench.loadgen", "--job", str(j + 1),
             "--switch", f"{SWITCH_IP}:{wire.HOMAGG_UDP_PORT_MIN}",
             *[f"--bind={ip}:{port}" for ip, port in hs], "--slots", str(slots),
             "--words", str(k), "--seconds", str(seconds), "--start-at", str(start),
             "--key", str(KEY + j + 1),
             "--out", str(tmp / f"gen{j}.json")]) for j, hs in enumerate(hosts)]
        while time.time() < start:
            time.sleep(0.01)
        busy0 = busy_seconds()
        if any(p.wait() for p in gens):
            raise RuntimeError(f"--shards {shards}: a load generator failed")
        busy = busy_seconds() - busy0
        agg_cpu = sum(cpu_seconds(p) for p in pids) - cpu0
        time.sleep(0.5)  # the stats file catches up (0.2 s)
        rx = json.loads(stats.read_text())["switch"]["STAT_RX"] - rx0
    finally:
        for p in gens:
            if p.poll() is None:
                p.kill()
        agg.terminate()
        agg.wait(10)
    out = [json.loads((tmp / f"gen{j}.json").read_text()) for j in range(jobs)]
    wall = max(o["seconds"] for o in out)
    return {"shards": shards, "jobs": jobs, "workers": workers, "slots": slots, "k": k,
            "dgram_s": sum(o["datagrams"] / o["seconds"] for o in out),
            "wall": wall, "agg_cpu": agg_cpu, "gen_cpu": sum(o["cpu"] for o in out),
            "other_cpu": max(0.0, busy - agg_cpu - sum(o["cpu"] for o in out)),
            "rx": rx, "resends": sum(o["resends"] for o in out),
            # results checked: whole runs by memcmp with a run checked in full, and by numpy
            "fast_checks": sum(o["fast_checks"] for o in out),
            "slow_checks": sum(o["slow_checks"] for o in out)}


def shards_main(a) -> int:
    """--shards: 1 shard against N, alternating runs."""
    counts = [int(x) for x in a.shards.split(",")]
    k = int(a.words.split(",")[0])
    rows = []
    with tempfile.TemporaryDirectory(prefix="homagg-pps-") as d:
        for rep in range(a.repeat):
            if a.wait_quiet:
                waited = wait_quiet(a.wait_quiet)
                print(f"run {rep}: " + (f"quiet after {waited:.0f} s" if waited is not None
                                        else f"not quiet within {a.wait_quiet:g} s"),
                      flush=True)
            for n in counts:
                rows.append(run_shards(n, a.jobs, a.workers, a.slots, k, a.seconds, Path(d)))
                rows[-1]["rep"] = rep
                r = rows[-1]
                print(f"run {rep} --shards {n}: {r['dgram_s']:.0f} dgram/s", flush=True)
    print(f"the software aggregator on N cores: datagrams per wall-clock second (the rounds' "
          f"contributions in and results out), loopback, {a.jobs} jobs x {a.workers} workers "
          f"x {a.slots} slots, K = {k}, bench.loadgen (one process per job), {a.seconds:g} s "
          f"per run, {os.cpu_count()} CPUs, runs alternating")
    hdr = (f"{'rep':>3} {'shards':>6} {'dgram/s':>9} {'agg cores':>9} {'load cores':>10} "
           f"{'other cores':>11} {'load/agg':>8} {'dgram/agg CPU s':>15} {'resends':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['rep']:>3} {r['shards']:>6} {r['dgram_s']:>9.0f} "
              f"{r['agg_cpu'] / r['wall']:>9.2f} {r['gen_cpu'] / r['wall']:>10.2f} "
              f"{r['other_cpu'] / r['wall']:>11.2f} {r['gen_cpu'] / max(r['agg_cpu'], 1e-9):>8.2f} "
              f"{r['dgram_s'] * r['wall'] / max(r['agg_cpu'], 1e-9):>15.0f} {r['resends']:>7}")
    base = counts[0]
    for n in counts[1:]:
        pairs = list(zip([r for r in rows if r["shards"] == base],
                         [r for r in rows if r["shards"] == n]))
        ratios = [b["dgram_s"] / a_["dgram_s"] for a_, b in pairs]
        print(f"{n} shards / {base}: " + ", ".join(f"{x:.2f}x" for x in ratios)
              + f" (run by run); median {_median(ratios):.2f}x")
        # Another process's CPU biases a pair: it takes the idle core from the 1-shard run
        # but only a share of the busy ones from the N-shard run. Quiet pairs: both runs
        # with at most QUIET cores of everything else.
        quiet = [x for x, (a_, b) in zip(ratios, pairs)
                 if max(a_["other_cpu"] / a_["wall"], b["other_cpu"] / b["wall"]) <= QUIET]
        print(f"  quiet pairs (other cores <= {QUIET:g} in both runs): {len(quiet)}"
              + (f", median {_median(quiet):.2f}x" if quiet else ""))
        # What the pair's CPU per datagram allows a machine with nothing else on it: one
        # shard bound by its core (1 / a1), N shards and the load by the N cores
        # (N / (aN + lN)); a, l: CPU seconds per datagram of the aggregator, of the load
        bound = [n * (a_["agg_cpu"] / _moved(a_)) / ((b["agg_cpu"] + b["gen_cpu"]) / _moved(b))
                 for a_, b in pairs]
        print("  bound by the cores, from the pairs' CPU per datagram (N x a1 / (aN + lN)): "
              + ", ".join(f"{x:.2f}x" for x in bound) + f"; median {_median(bound):.2f}x")
        eff = [b["dgram_s"] * b["wall"] / b["agg_cpu"] / (a_["dgram_s"] * a_["wall"]
                                                            / a_["agg_cpu"]) for a_, b in pairs]
        print(f"  datagrams per aggregator CPU second, {n} shards / {base}: median "
              f"{_median(eff):.2f}x (the cost of sharding per datagram)")
    print("(agg cores, load cores, other cores: CPU seconds per wall second of the "
          "aggregator's processes, of the load generators, and of everything else on the "
          "machine (/proc/stat), in the load's window; they share the machine's cores. "
          "load/agg: the load's CPU per datagram over the aggregator's: with the load on the "
          "machine, N shards on N cores can give at most N / (1 + load/agg) of one shard)")
    print(f"every result checked against the integer sum: "
          f"{sum(r['fast_checks'] for r in rows)} runs by memcmp with a run checked in full, "
          f"{sum(r['slow_checks'] for r in rows)} result by result (bench.loadgen)")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "pps-shards.json").write_text(json.dumps(rows, indent=1))
    return 0


#: --shards: a pair of runs is quiet when everything else on the machine took at most this many
#: cores in each
QUIET = 0.1


def _moved(r: dict) -> float:
    """The datagrams a --shards run moved."""
    return r["dgram_s"] * r["wall"]


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.253", 0))
print(s.getsockname()[1], flush=True)
buf = bytearray(2048)
while True:
    n, a = s.recvfrom_into(buf)
    if n == 1:
        break
    s.sendto(buf[:n], a)
"""


def run_echo(k: int, count: int, window: int = 64) -> dict:
    """A Python echo server, fed by a windowed client: datagrams / CPU second of each."""
    srv = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    assert srv.stdout is not None
    port = int(srv.stdout.readline())
    cli = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    cli.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    cli.settimeout(1.0)
    payload = bytes(wire.packet_bytes(k))
    t0 = time.process_time()
    sent = got = 0
    while got < count:
        while sent - got < window and sent < count:
            cli.sendto(payload, ("127.0.0.253", port))
            sent += 1
        try:
            cli.recv(2048)
            got += 1
        except TimeoutError:  # loopback does not drop, but never hang
            break
    client_cpu = time.process_time() - t0
    cli.sendto(b"x", ("127.0.0.253", port))
    _, srv_cpu = wait_cpu(srv)
    cli.close()
    return {"k": k, "echo_pps_core": 2 * got / srv_cpu, "client_pps_core": 2 * got / client_cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--words", default=f"{wire.WORDS_PER_PACKET},64",
                    help="K values, comma-separated")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--size", type=int, default=2_000_000, help="elements per tensor")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--shards", metavar="1,N",
                    help="instead: the aggregator on 1 core against N (homagg-softswitch "
                         "--shards), fed by bench.loadgen, runs alternating; with --jobs, "
                         "--workers, --slots, --seconds, --repeat and the first --words")
    ap.add_argument("--jobs", type=int, default=4, help="--shards: jobs (one load process "
                                                        "each)")
    ap.add_argument("--slots", type=int, default=63,
                    help="--shards: slots per job (63: a round is one GSO run of K = 256)")
    ap.add_argument("--seconds", type=float, default=5.0, help="--shards: seconds per run")
    ap.add_argument("--repeat", type=int, default=3, help="--shards: runs of each")
    ap.add_argument("--wait-quiet", type=float, metavar="S", default=0.0,
                    help="--shards: before each pair, wait up to S seconds for a second in "
                         f"which the machine's other work takes at most {QUIET:g} cores (a "
                         "shared machine)")
    a = ap.parse_args(argv)
    if a.shards:
        return shards_main(a)
    rows = []
    with tempfile.TemporaryDirectory(prefix="homagg-pps-") as d:
        for k in (int(x) for x in a.words.split(",")):
            row = run_homagg(k, a.workers, a.size, a.iterations, Path(d))
            row.update(run_echo(k, 40_000))
            rows.append(row)
    print(f"datagrams per CPU second (one core), loopback, {a.workers} agents --mode dense, "
          f"{a.size} elements x {a.iterations} iterations, {os.cpu_count()} CPUs; baseline: a "
          "Python echo server (recvfrom_into + sendto, nothing else), same datagram size")
    hdr = (f"{'K':>4} {'agent dgram/s':>14} {'steady':>8} {'path':>8} "
           f"{'aggregator dgram/s':>19} {'echo dgram/s':>13} {'agent/echo':>10} "
           f"{'steady/echo':>11} {'path/echo':>9} {'agg/echo':>9} "
           f"{'agg el/s':>10} {'agent el/s':>11} {'agent dg/call':>13} {'agg dg/call':>11}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['k']:>4} {r['agent_pps_core']:>14.0f} {r['agent_steady_pps_core']:>8.0f} "
              f"{r['agent_path_pps_core']:>8.0f} "
              f"{r['agg_pps_core']:>19.0f} {r['echo_pps_core']:>13.0f} "
              f"{r['agent_pps_core'] / r['echo_pps_core']:>10.0%} "
              f"{r['agent_steady_pps_core'] / r['echo_pps_core']:>11.0%} "
              f"{r['agent_path_pps_core'] / r['echo_pps_core']:>9.0%} "
              f"{r['agg_pps_core'] / r['echo_pps_core']:>9.0%} {r['agg_el_s_core']:>10.3g} "
              f"{r['agent_el_s_core']:>11.3g} {r['agent_per_call']:>13.1f} "
              f"{r['agg_per_call']:>11.1f}")
    print("(agent dgram/s: per CPU second of the whole agent process (wait4), its start, "
          "imports, JIT and join included; steady: the all-reduce calls after the first "
          "iteration only (the agent's own process_time around each call, so no start-up and "
          "no drawing of the bench's tensors; the codec's work is in); path: the same datagrams "
          "per CPU second in the transport's rounds alone (Transport.stream, no codec); "
          "el/s: elements "
          "all-reduced per CPU second of the aggregator, and of a whole agent; dg/call: "
          "datagrams per system call, sends and receives, with UDP GSO/GRO (homagg.udpio); "
          "the echo is at 1)")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "pps.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
