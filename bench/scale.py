"""A 4096-rank job, simulated: 512 hosts of 8 ranks on a three-level tree of switches, placed by
the controller service's join logic and summed through the switch model, exactly.

    python -m bench.scale                                  # 512 hosts x 8 ranks, 1024 elements
    python -m bench.scale --hosts 16 --ranks-per-host 4 --hosts-per-leaf 4 --ranks-per-leaf 8

Two layouts of the same ranks and the same inputs:
- per host (local reduction): each host's ranks add their quantized integers first (the int32
  lane add ``hostreduce.combine`` does), and the host is one switch worker: 512 joins, on a tree
  of racks of ``--hosts-per-leaf`` hosts (32: a rack's top-of-rack switch), the leaves grouped
  under middle switches (the square root of the leaves: 4 of 4) under one spine;
- per rank: every rank its own switch worker: 4096 joins. The racks' tree cannot hold it (a
  switch job takes 64 workers, a rack has 256 ranks): the service's refusal is printed. It runs
  on a tree with leaves of ``--ranks-per-leaf`` ranks (64: 8 hosts), 8 middles of 8, one spine.

Each switch is a software aggregator's tables and its switch model (``homagg.switch_model``) in
this process, no sockets; the service (``controller.service.JobService``) takes every join, each
from a thread of its own as its gRPC server would, and writes each job to the switches of its
tree. Packets go from worker to leaf, up the tree as partial sums, and the final sum down to
every worker, as datagrams between the models. Printed per layout: the switch workers each
switch's job holds, per level; the joins' time and the peak memory they added (the process's
peak RSS, VmHWM, reset first); the packets each level took per chunk; and ``exact`` when every
rank's sum equals the integer sum of all ranks' quantized inputs, bit for bit (Python's int64
sum, computed apart), at the codec's scale for all ranks (``shift_for(max_exp, ranks)``, room
for ranks x 16 terms), with the int32 headroom left; a round the switch flags as overflowed
(which the agents would redo at a smaller scale: a rescale) fails the run. Exit status 1 if any
sum differs, a round overflows, or a layout that should fit is refused.
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from homagg import wire
from homagg.controller.local import LocalSwitch
from homagg.controller.placement import Place
from homagg.controller.service import JobService, Refusal, ServeOptions
from homagg.host_agent.codec.quantization import max_exponent, quantize, shift_for
from homagg.host_agent.hostreduce import combine
from homagg.netconfig import Config, parse
from homagg.targets.soft import SoftSwitch

SECRET = "bench.scale's join secret"
SLOTS = 16
AGENT_PORT = 20000


@dataclass
class Layout:
    """A tree: ``leaves`` leaves of ``per_leaf`` switch workers, under ``middles`` middle
    switches, under a spine; switch worker w sits under leaf w // per_leaf."""

    name: str
    workers: int
    per_leaf: int

    @property
    def leaves(self) -> int:
        return math.ceil(self.workers / self.per_leaf)

    @property
    def middles(self) -> int:
        return max(1, round(math.sqrt(self.leaves)))

    def leaf_of(self, w: int) -> int:
        return w // self.per_leaf

    def addr(self, w: int) -> tuple[str, int]:
        """Switch worker w's address: leaf i's hosts in 10.(64 + i // 256).(i % 256).0/24
        (past 254 workers a leaf, a second port on each address)."""
        i, k = divmod(w, self.per_leaf)
        return f"10.{64 + i // 256}.{i % 256}.{k % 254 + 1}", AGENT_PORT + k // 254

    def config(self) -> Config:
        sw = [{"name": f"mid{m + 1}", "parent": "spine", "ip": f"10.1.0.{m + 1}",
               "grpc": "in-process"} for m in range(self.middles)]
        per_mid = math.ceil(self.leaves / self.middles)
        sw += [{"name": f"leaf{i + 1}", "parent": f"mid{i // per_mid + 1}",
                "ip": f"10.2.{i // 256}.{i % 256}", "grpc": "in-process",
                "under": [f"10.{64 + i // 256}.{i % 256}.0/24"]} for i in range(self.leaves)]
        return parse({"switch": {"name": "spine", "target": "soft", "grpc": "in-process",
                                 "ip": "10.0.0.254"}, "switches": sw})

    def describe(self) -> str:
        return (f"{self.leaves} leaves of {self.per_leaf} switch workers, {self.middles} middle "
                f"switches, 1 spine")


def rss_peak_kib() -> int | None:
    """The process's peak RSS (VmHWM), in KiB; None where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_rss_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
    except OSError:
        pass


class Network:
    """The switches' models joined by their addresses; a worker's datagrams land in its inbox."""

    def __init__(self, switches: dict[str, SoftSwitch], ips: dict[str, str]):
        self.by_ip = {ips[n]: sw for n, sw in switches.items()}
        self.inbox: dict[tuple[str, int], list[bytes]] = {}

    def send(self, queue: list, data: bytes, src: tuple[str, int], dst: tuple[str, int]):
        queue.append((data, src, dst))

    def run(self, queue: list) -> None:
        """Deliver until nothing is in flight: a switch answers from the port asked, and
        sends a child job's partial sums up from its uplink's port."""
        i = 0
        while i < len(queue):
            data, src, dst = queue[i]
            i += 1
            sw = self.by_ip.get(dst[0])
            if sw is None:
                self.inbox.setdefault(dst, []).append(data)
                continue
            for out, to in sw.handle(data, src):
                ups = sw.uplink_ports.get(to)
                port = ups.get(wire.fields(out)["job"], dst[1]) if ups else dst[1]
                queue.append((out, (dst[0], port), to))


def join_all(svc: JobService, name: str, addrs: list[tuple[str, int]]) -> dict:
    """Every switch worker's join, each from a thread, as the gRPC server runs them."""
    out: dict = {}

    def one(r):
        try:
            out[r] = svc.join(name, r, len(addrs), *addrs[r], wait=600.0, secret=SECRET)
        except Refusal as e:
            out[r] = e

    threading.stack_size(256 * 1024)
    ts = [threading.Thread(target=one, args=(r,)) for r in range(len(addrs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def join_run(net: Network, answers: dict, addrs: list, k: int) -> int:
    """Every switch worker's join of the run (join.p4, up the tree and back): its generation."""
    n = len(addrs)
    queue: list = []
    for w in range(n):
        a = answers[w]
        me = a.leaf_worker if a.leaf_workers else a.worker
        join = np.zeros(wire.JOIN_WORDS, np.int32)
        join[wire.JOIN_RUN_WORD] = np.uint32(a.run).view(np.int32)
        net.send(queue, wire.pack(wire.OP_JOIN, a.job_id, me, 0, 1 + w, join, auth=a.key),
                 addrs[w], a.send_to)
    net.run(queue)
    gens = set()
    for w in range(n):
        reply = net.inbox.pop(addrs[w])
        f = wire.fields(reply[-1])
        assert f["flags"] & wire.FLAG_RESULT and f["slot"] == k, f"worker {w}: no join answer"
        gens.add(f["gen"])
    (gen,) = gens
    return gen


def allreduce(net: Network, answers: dict, addrs: list, words: np.ndarray, k: int, gen: int
              ) -> tuple[np.ndarray, bool]:
    """Every switch worker's int32 ``words`` through the tree, in chunks of K, a window of
    SLOTS at a time: each worker's sums, and whether the switch flagged an overflow."""
    n = len(addrs)
    chunks = math.ceil(words.shape[1] / k)
    padded = np.zeros((n, chunks * k), np.int32)
    padded[:, :words.shape[1]] = words
    sums = np.zeros((n, chunks * k), np.int32)
    overflow = False
    for first in range(0, chunks, SLOTS):
        queue = []
        for g in range(first, min(first + SLOTS, chunks)):
            phase = wire.FLAG_PHASE if (g // SLOTS) % 2 else 0
            for w in range(n):
                a = answers[w]
                me = a.leaf_worker if a.leaf_workers else a.worker
                net.send(queue, wire.pack(wire.OP_ADD, a.job_id, me, g % SLOTS, g + 1,
                                          padded[w, g * k:(g + 1) * k], flags=phase, gen=gen,
                                          k=k, auth=a.key), addrs[w], a.send_to)
        net.run(queue)
        for w in range(n):
            for pkt in net.inbox.pop(addrs[w]):
                p = wire.unpack(pkt, k)
                assert p.flags & wire.FLAG_RESULT and not p.flags & wire.FLAG_STATUS, p.flags
                overflow |= bool(p.flags & wire.FLAG_OVERFLOW)
                sums[w, (p.seq - 1) * k:p.seq * k] = p.words
    return sums[:, :words.shape[1]], overflow


def run_layout(lay: Layout, q: np.ndarray, ranks_per_worker: int, exact: np.ndarray) -> bool:
    """Place ``lay``'s job through the service, sum ``q`` (every rank's int32, by rank) through
    it, and print its figures; False if a sum differs (or the job was refused)."""
    cfg = lay.config()
    switches = {p: SoftSwitch(words=wire.WORDS_PER_PACKET) for p in
                ["spine", *(s.name for s in cfg.switches)]}
    svc = JobService(cfg, lambda pl: LocalSwitch(switches[pl.name], pl.name),
                     ServeOptions(token=None, slots=SLOTS, max_joins=lay.workers, wait=600.0))
    svc.recover()
    addrs = [lay.addr(w) for w in range(lay.workers)]
    reset_rss_peak()
    before = rss_peak_kib()
    t0 = time.perf_counter()
    answers = join_all(svc, lay.name, addrs)
    took = time.perf_counter() - t0
    after = rss_peak_kib()
    print(f"{lay.name}: {lay.workers} switch workers ({ranks_per_worker} rank"
          f"{'s' if ranks_per_worker > 1 else ''} each) on {lay.describe()}")
    refused = {str(a) for a in answers.values() if isinstance(a, Refusal)}
    if refused:
        print(f"  refused by the service: {sorted(refused)[0]}")
        return False
    mem = "" if before is None or after is None else \
        f", peak memory +{(after - before) / 1024:.1f} MiB RSS"
    print(f"  joins: {lay.workers} in {took:.2f} s ({1000 * took / lay.workers:.2f} ms each)"
          f"{mem}")
    (h,) = svc.held.values()
    levels: dict[str, list[int]] = {}
    for pl in h.everywhere:
        (job,) = switches[pl.name].model.jobs.values()
        levels.setdefault(_level(pl), []).append(len(job.workers))
    print("  switch workers per switch: " + ", ".join(
        f"{lvl} {_span(ws)} (x{len(ws)})" for lvl, ws in levels.items()))
    # each switch worker sends the sum of its ranks (local reduction: the switch's int32 add)
    local = [combine(wire.OP_ADD, list(q[w * ranks_per_worker:(w + 1) * ranks_per_worker]))
             for w in range(lay.workers)]
    words = np.stack([s for s, _ in local])
    if any(over for _, over in local):
        print("  a host's own sum overflowed int32: its leader would flag the round")
    net = Network(switches, {"spine": cfg.switch.ip} | {s.name: s.ip for s in cfg.switches})
    gen = join_run(net, answers, addrs, wire.WORDS_PER_PACKET)
    rx0 = {n: int(sw.model.stats[wire.STAT_RX]) for n, sw in switches.items()}
    t0 = time.perf_counter()
    sums, overflow = allreduce(net, answers, addrs, words, wire.WORDS_PER_PACKET, gen)
    took = time.perf_counter() - t0
    chunks = math.ceil(q.shape[1] / wire.WORDS_PER_PACKET)
    rx = {_level_of(n): 0 for n in switches}
    for n, sw in switches.items():
        rx[_level_of(n)] += int(sw.model.stats[wire.STAT_RX]) - rx0[n]
    print("  packets each level took per chunk: " + ", ".join(
        f"{lvl} {rx[lvl] / chunks:g}" for lvl in rx) + " (a leaf: its workers' and the final"
        f" from its parent; {chunks} chunks of {wire.WORDS_PER_PACKET} words, {took:.2f} s)")
    # every rank's sum: its switch worker's (a host's leader hands its sum to its ranks)
    bad = [r for r in range(q.shape[0])
           if not np.array_equal(sums[r // ranks_per_worker].astype(np.int64), exact)]
    if overflow:  # (the agents would redo the round at a smaller scale: not done here)
        print("  the switch flagged an int32 overflow: the codec's headroom was short")
        return False
    if bad:
        print(f"  MISMATCH: {len(bad)} of {q.shape[0]} ranks' sums differ from the integer "
              f"sum (first: rank {bad[0]})")
        return False
    print(f"  exact: all {q.shape[0]} ranks' sums equal the integer sum bit for bit, "
          "0 rescales (no round flagged an int32 overflow)")
    svc.stop()
    return True


def _level_of(name: str) -> str:
    return "spine" if name == "spine" else "middle" if name.startswith("mid") else "leaf"


def _level(pl: Place) -> str:
    return _level_of(pl.name)


def _span(ws: list[int]) -> str:
    return str(ws[0]) if min(ws) == max(ws) else f"{min(ws)}-{max(ws)}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=512)
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--hosts-per-leaf", type=int, default=32, help="a rack, per host layout")
    ap.add_argument("--ranks-per-leaf", type=int, default=64, help="per rank layout")
    ap.add_argument("--elements", type=int, default=1024, help="the tensor, per rank")
    ap.add_argument("--seed", type=int, default=49)
    a = ap.parse_args(argv)
    if a.ranks_per_leaf % a.ranks_per_host:
        ap.error("--ranks-per-leaf must be a multiple of --ranks-per-host (a host's ranks "
                 "sit under one leaf)")
    ranks = a.hosts * a.ranks_per_host
    rng = np.random.default_rng(a.seed)
    # the inputs: N(0, 1) with a quarter of the elements all positive near the top of the
    # range (their sum is the largest a tensor of this scale can have)
    x = rng.standard_normal((ranks, a.elements)).astype(np.float32)
    top = a.elements // 4
    x[:, :top] = rng.uniform(0.9, 1.0, (ranks, top)) * float(np.abs(x).max())
    max_exp = max_exponent(x)
    shift = shift_for(max_exp, ranks)
    q = np.stack([quantize(row, shift) for row in x])
    exact = np.zeros(a.elements, np.int64)
    for row in q:  # the integer sum, apart from the switches: int64, one rank at a time
        exact += row.astype(np.int64)
    biggest = int(np.abs(exact).max())
    print(f"{ranks} ranks ({a.hosts} hosts x {a.ranks_per_host}), {a.elements} float32 elements "
          f"each, quantized at shift {shift} (max exponent {max_exp}: room for {ranks} x 16 "
          f"terms); the largest |sum| is 2^{math.log2(biggest):.2f}, "
          f"{31 - math.log2(biggest):.2f} bits of int32 headroom left")
    ok = True
    per_host = Layout("per host", a.hosts, a.hosts_per_leaf)
    ok &= run_layout(per_host, q, a.ranks_per_host, exact)
    racks = Layout("per rank on the racks' tree", ranks, a.hosts_per_leaf * a.ranks_per_host)
    if racks.per_leaf > wire.MAX_WORKERS:
        run_layout(racks, q, 1, exact)  # refused: printed as the service says it
    ok &= run_layout(Layout("per rank", ranks, a.ranks_per_leaf), q, 1, exact)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
