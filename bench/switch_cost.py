"""Switch cost: packets per second the homagg program sustains on bmv2, against bmv2 forwarding
with a minimal L2 program (bench/p4/l2fwd.p4), same bmv2 build, same machine, same run.

    sudo python -m bench.switch_cost            # 3 alternating rounds, ~1.5 min
    sudo python -m bench.switch_cost --quick    # 1 round, ~30 s
    sudo python -m bench.switch_cost --words 256,2176   # K = 256 against jumbo frames (~3 min)

How: one simple_switch_grpc on two veth pairs (homagg/targets/testbed.py), whose pipeline is swapped
over P4Runtime between the two programs, alternately (l2fwd, homagg, l2fwd, homagg, ...) so both
see the same machine state. The frames are identical homagg ADD packets (Ethernet / IPv4 / UDP /
16-byte header / K int32 words: 1082 bytes at the default K = 256, 314 at ``--words 64``,
8746 at ``--words 2176``, the largest K on bmv2, whose frames need a 9000-byte MTU: the
testbed's veths run at 9000), written from Python to an AF_PACKET socket. Several K
(``--words 256,2176``) are
measured in the same run, each against l2fwd at its own frames, rounds alternating over them,
and the elements/s of the W-worker job at each K is compared with the first K's.

- homagg: a W-worker job (default 4; installed with homagg.controller.jobs.add_job)
  whose workers all sit on port 1 (UDP ports 50000 + w). Packets cycle through the workers, so
  a slot round gets its first contribution (overwrite), W-2 middle ones (read-add-write) and
  the completing one (add + result), which is multicast to the W workers: W packets in, W out.
  Round r uses slot r mod S with the slot's phase alternating and seq r+1, as an agent's
  rounds do: the full per-packet path (job table, slot state, K lane adds, multicast, egress
  addressing). The first results are checked (result flag set, words equal to those sent).
- l2fwd (the baseline): parse Ethernet, one exact-match table on the ingress port, forward
  port 1 -> port 2.

Two ways of offering load, each for --seconds after a warm-up:
- window: at most --window packets outstanding (sent, no output yet); the rate at which outputs
  arrive is the sustained rate with (almost) no drops. A stall of 50 ms counts the outstanding
  packets as lost.
- blast: send as fast as Python can (far above what bmv2 forwards), draining outputs as they
  come; the output rate is the saturated rate and the loss is what bmv2's input dropped.

Reported: output packets/s of each program, the ratio homagg/l2fwd per round (the figure that
travels; at one frame size it is also the ratio of elements/s: homagg aggregates K elements
per packet, and l2fwd's frames carry the same K words of payload; absolute pps depend on the
machine and on the Python sender sharing its 2 cores with bmv2), and losses. For homagg, the
switch's own counters (STAT_RX, STAT_COMPLETED) say whether losses were before the pipeline
(the interface) or in it. Needs root, p4c-bm2-ss and
simple_switch_grpc (PATH, or HOMAGG_P4C / HOMAGG_BMV2); without them it says why and exits 0.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from homagg import wire

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
LOG_DIR = ROOT / "build" / "logs" / "bench"
L2_SRC = ROOT / "bench" / "p4" / "l2fwd.p4"

SOL_PACKET = 263  # linux/socket.h
PACKET_IGNORE_OUTGOING = 23  # linux/if_packet.h, Linux >= 4.20
STALL = 0.05
RECV_BYTES = 16384  # a jumbo frame (8746 bytes at K = 2176) and then some
_MIN_FRAME = 14 + 20 + 8 + wire.packet_bytes(wire.MIN_WORDS_PER_PACKET)


def skip_reason() -> str | None:
    from homagg.targets.toolchain import bmv2_unavailable

    return bmv2_unavailable()


def build_l2fwd():
    from homagg.controller.build import Pipeline
    from homagg.targets.toolchain import require

    OUT.mkdir(parents=True, exist_ok=True)
    p = Pipeline(OUT / "l2fwd.json", OUT / "l2fwd.p4info.txtpb")
    if p.exists() and min(p.bmv2_json.stat().st_mtime, p.p4info.stat().st_mtime) \
            >= L2_SRC.stat().st_mtime:
        return p
    cmd = [str(require("p4c-bm2-ss")), "--std", "p4-16", "--arch", "v1model",
           "--p4runtime-files", str(p.p4info), "-o", str(p.bmv2_json), str(L2_SRC)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"p4c-bm2-ss failed on {L2_SRC}:\n{proc.stderr}")
    return p


class Frames:
    """Homagg ADD frames from W workers of job 1 on host h0 (UDP ports 50000 + w), patched in
    place per packet: rounds go worker 0, 1, ..., W-1, so one in W packets completes a slot."""

    def __init__(self, slots: int, workers: int, k: int):
        import numpy as np
        from scapy.layers.inet import IP, UDP
        from scapy.layers.l2 import Ether
        from scapy.packet import Raw

        from homagg import wire
        from homagg.targets.testbed import SWITCH_IP, SWITCH_MAC, host_ip, host_mac

        self.words = np.arange(1, k + 1, dtype=np.int32)
        payload = wire.pack(wire.OP_ADD, 1, 0, 0, 1, self.words, k=k)
        frame = (Ether(src=host_mac(0), dst=SWITCH_MAC) / IP(src=host_ip(0), dst=SWITCH_IP, id=1)
                 / UDP(sport=wire.DEFAULT_AGENT_PORT, dport=wire.HOMAGG_UDP_PORT_MIN, chksum=0)
                 / Raw(payload))
        self.buf = bytearray(bytes(frame))
        self.slots = slots
        self.workers = workers
        self.sport = len(frame) - len(payload) - 8   # UDP source port
        self.off = len(frame) - len(payload)         # homagg header
        self.o = {k: self.off + v for k, v in wire.OFFSETS.items()}
        self.phase_flag = wire.FLAG_PHASE
        self.result_flag = wire.FLAG_RESULT

    def __len__(self):
        return len(self.buf)

    def make(self, k: int) -> bytearray:
        """Packet k: worker k mod W; its round r = k // W uses slot r mod S, the slot's phase
        alternating per use, seq r + 1 (as agents number their chunks)."""
        w, r = k % self.workers, k // self.workers
        slot, use = r % self.slots, r // self.slots
        o = self.o
        struct.pack_into("!H", self.buf, self.sport, wire.DEFAULT_AGENT_PORT + w)
        self.buf[o["flags"]] = self.phase_flag if use & 1 else 0
        self.buf[o["worker"]] = w
        struct.pack_into("!H", self.buf, o["slot"], slot)
        struct.pack_into("!I", self.buf, o["seq"], (r + 1) & 0xFFFFFFFF)
        return self.buf

    def check_result(self, data: bytes) -> str | None:
        import numpy as np

        if len(data) != len(self.buf):
            return f"result of {len(data)} bytes, expected {len(self.buf)}"
        if not data[self.o["flags"]] & self.result_flag:
            return "output without the result flag"
        words = np.frombuffer(data, ">i4", len(self.words), self.o["words"])
        if not np.array_equal(words, self.workers * self.words):
            return "result words differ from the workers' sum"
        return None


def open_sockets(tx_iface: str, rx_iface: str):
    tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # send only: receives nothing
    tx.bind((tx_iface, 0))
    rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
    rx.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    rx.bind((rx_iface, 0))
    rx.setblocking(False)
    return tx, rx


def drain(rx, check=None, checked=[0]) -> int:  # noqa: B006 - a deliberate call counter
    n = 0
    while True:
        try:
            data = rx.recv(RECV_BYTES)
        except BlockingIOError:
            return n
        if len(data) < _MIN_FRAME:  # not ours: shorter than any homagg frame
            continue
        if check and checked[0] < 20:
            checked[0] += 1
            err = check(data)
            if err:
                raise RuntimeError(err)
        n += 1


def run_window(tx, rx, make, seconds, warmup, window, check=None) -> dict:
    sent = got = lost = 0
    outstanding = 0
    t0 = time.perf_counter()
    t_start, t_end = t0 + warmup, t0 + warmup + seconds
    m_got0 = m_sent0 = None
    last_rx = t0
    while True:
        now = time.perf_counter()
        if m_got0 is None and now >= t_start:
            m_got0, m_sent0, m_lost0, t_m0 = got, sent, lost, now
        if now >= t_end:
            break
        while outstanding < window:
            tx.send(make(sent))
            sent += 1
            outstanding += 1
        r, _, _ = select.select([rx], [], [], STALL)
        n = drain(rx, check) if r else 0
        if n:
            got += n
            outstanding = max(0, outstanding - n)
            last_rx = time.perf_counter()
        elif time.perf_counter() - last_rx > STALL:
            lost += outstanding
            outstanding = 0
            last_rx = time.perf_counter()
    t_m1 = time.perf_counter()
    time.sleep(0.2)
    drain(rx)
    dt = t_m1 - t_m0
    return {"pps": (got - m_got0) / dt, "offered_pps": (sent - m_sent0) / dt,
            "sent": sent - m_sent0, "out": got - m_got0, "lost": lost - m_lost0,
            "sent_total": sent}


def run_blast(tx, rx, make, seconds, warmup, check=None, start_k=0) -> dict:
    """Send flat out for warmup + seconds; count outputs in the measured part."""
    sent = got = 0
    t0 = time.perf_counter()
    t_start, t_end = t0 + warmup, t0 + warmup + seconds
    m_got0 = None
    k = start_k
    while True:
        for _ in range(32):
            tx.send(make(k))
            k += 1
        sent += 32
        now = time.perf_counter()
        if m_got0 is None and now >= t_start:
            m_got0, m_sent0, t_m0 = got, sent, now
        if now >= t_end:
            break
        got += drain(rx, check)
    t_m1 = time.perf_counter()
    got += drain(rx, check)
    # what arrives after the sender stopped is the switch's backlog: it still counts as output
    # but not inside the measured window; count it for the loss figure only
    tail = 0
    deadline = time.perf_counter() + 0.3
    while time.perf_counter() < deadline:
        r, _, _ = select.select([rx], [], [], 0.1)
        if r:
            tail += drain(rx)
            deadline = time.perf_counter() + 0.3
    dt = t_m1 - t_m0
    return {"pps": (got - m_got0) / dt, "offered_pps": (sent - m_sent0) / dt, "sent": sent,
            "out": got + tail, "lost": sent - got - tail, "sent_total": k}


def measure(bed, program: str, pipelines, frames: Frames, a, window: int | None = None,
            blast: bool = True) -> dict:
    from homagg import wire
    from homagg.controller import jobs
    from homagg.controller.p4client import P4RuntimeSwitch
    from homagg.netconfig import JobSpec, Worker
    from homagg.targets.testbed import host_ip, host_mac

    # A blast leaves bmv2 a backlog of queued frames; let it drain first, or those frames (same
    # addresses, old round tags) land in the next run's slots.
    time.sleep(2.0)
    sw = P4RuntimeSwitch(bed.switch.grpc_addr, request_log=LOG_DIR / "switch-cost-p4runtime.log")
    sw.open(pipelines[program], homagg=program.startswith("homagg"))
    try:
        if program.startswith("homagg"):
            jobs.install_base(sw, bed.config)
            jobs.add_job(sw, JobSpec(1, tuple(Worker(host_ip(0), wire.DEFAULT_AGENT_PORT + w,
                                                     host_mac(0), 1, "h0")
                                              for w in range(frames.workers)), a.slots))
            tx_if = rx_if = bed.pairs[0][1]
            check = frames.check_result
        else:
            tx_if, rx_if = bed.pairs[0][1], bed.pairs[1][1]
            check = None
        tx, rx = open_sockets(tx_if, rx_if)
        try:
            win = run_window(tx, rx, frames.make, a.seconds, a.warmup, window or a.window, check)
            flat = (run_blast(tx, rx, frames.make, a.seconds, a.warmup, check,
                              start_k=win["sent_total"]) if blast else None)
        finally:
            tx.close()
            rx.close()
        stats = None
        if program.startswith("homagg"):
            time.sleep(0.5)  # bmv2 updates counters asynchronously
            s = jobs.read_stats(sw).switch
            stats = {"sent": win["sent_total"] + (flat["sent"] if flat else 0),
                     "STAT_RX": s["STAT_RX"],
                     "STAT_COMPLETED": s["STAT_COMPLETED"],
                     "drops": {k: v for k, v in s.items() if k.startswith("DROP_") and v}}
    finally:
        sw.close()
    return {"window": win, "blast": flat, "switch": stats}


def plot(rows, ks, path: Path) -> None:
    """Median packets/s out of bmv2 per K: l2fwd and homagg's 1-worker job (window, blast)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(ks), figsize=(6 * len(ks), 3.5), squeeze=False)
    modes = ["window", "blast"]
    x = np.arange(len(modes))
    for ax, k in zip(axes[0], ks):
        for i, prog in enumerate(["l2fwd", "homagg"]):
            med = [np.median([r[k][prog][m]["pps"] for r in rows]) / 1e3 for m in modes]
            ax.bar(x + (i - 0.5) * 0.38, med, 0.38, label=prog)
            for xi, v in zip(x, med):
                ax.text(xi + (i - 0.5) * 0.38, v, f"{v:.1f}", ha="center", va="bottom",
                        fontsize=8)
        ratio = {m: np.median([r[k]["homagg"][m]["pps"] / r[k]["l2fwd"][m]["pps"]
                               for r in rows]) for m in modes}
        ax.set_xticks(x, [f"{m} (homagg/l2 {ratio[m]:.0%})" for m in modes])
        ax.set_ylabel("kpackets/s out of bmv2")
        ax.set_title(f"bmv2, K = {k}: homagg.p4 (1-worker job) vs minimal L2 forwarding",
                     fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def words_list(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: K or K,K,... (integers)") from None
    if not ks or len(set(ks)) != len(ks):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct values of K")
    return ks


def report(rows, k: int, frame_bytes: int, a, ver: str) -> tuple[float, float] | None:
    """The table for one K (every round's row[k]); returns the W-worker job's elements/s and
    l2fwd's payload elements/s at the same frames, or None if every round lost frames."""
    import numpy as np

    print(f"bmv2 switch cost: simple_switch_grpc {ver}, {os.cpu_count()} CPUs, {frame_bytes}-byte "
          f"frames (K = {k} words), {a.rounds} round(s) alternating l2fwd/homagg, "
          f"{a.seconds:.0f} s each run; "
          f"window = {a.window} outstanding, blast = Python sends flat out")
    hdr = (f"{'round':>5} {'mode':>6} {'l2fwd pps':>10} {'homagg pps':>11} {'homagg/l2':>9} "
           f"{'l2 lost':>8} {'homagg lost':>11} {'offered pps':>11}")
    print(hdr)
    print("-" * len(hdr))
    for i, row in enumerate(rows):
        for m in ("window", "blast"):
            l2, hg = row[k]["l2fwd"][m], row[k]["homagg"][m]
            print(f"{i + 1:>5} {m:>6} {l2['pps']:>10.0f} {hg['pps']:>11.0f} "
                  f"{hg['pps'] / l2['pps']:>9.1%} "
                  f"{l2['lost'] / max(1, l2['sent']):>8.1%} "
                  f"{hg['lost'] / max(1, hg['sent']):>11.1%} "
                  f"{hg['offered_pps']:>11.0f}")
    for m in ("window", "blast"):
        ratios = [r[k]["homagg"][m]["pps"] / r[k]["l2fwd"][m]["pps"] for r in rows]
        print(f"{'median':>5} {m:>6} "
              f"{np.median([r[k]['l2fwd'][m]['pps'] for r in rows]):>10.0f} "
              f"{np.median([r[k]['homagg'][m]['pps'] for r in rows]):>11.0f} "
              f"{np.median(ratios):>9.1%}   (median of the rounds' ratios; target >= 80%)")
    w_ratio = [r[k]["homagg_w"]["window"]["pps"] / r[k]["l2fwd"]["window"]["pps"] for r in rows]
    w_lost = [r[k]["homagg_w"]["window"]["lost"] / max(1, r[k]["homagg_w"]["window"]["sent"])
              for r in rows]
    clean = [r for r, lost in zip(w_ratio, w_lost) if lost < 0.01]
    print(f"{a.workers}-worker job (window {a.window_multi}, every round: 1 overwrite, "
          f"{a.workers - 2} read-add-write, 1 add + result multicast to {a.workers}): "
          + (f"{np.median(clean):.1%} of l2fwd's window rate (median of the {len(clean)} round(s) "
             f"without loss)" if clean else "no round without loss")
          + f"; per round {', '.join(f'{x:.1%}' for x in w_ratio)}, lost "
          f"{', '.join(f'{x:.1%}' for x in w_lost)} (this sender does not retransmit: one lost "
          f"frame stalls its slot for the rest of the round, so lossy rounds measure little)")
    out = None
    if clean:
        el_w = np.median([r[k]["homagg_w"]["window"]["pps"] for r, lost in zip(rows, w_lost)
                          if lost < 0.01]) * k
        el_l2 = np.median([r[k]["l2fwd"]["window"]["pps"] for r in rows]) * k
        print(f"elements/s: homagg {a.workers}-worker job {el_w:.3g} (pps x K, its rounds without "
              f"loss) against l2fwd's payload elements/s {el_l2:.3g} at the same {frame_bytes}-"
              f"byte frames (median pps x {k} words): {el_w / el_l2:.1%} (target >= 80%)")
        out = (float(el_w), float(el_l2))
    s = rows[-1][k]["homagg"]["switch"]
    print(f"homagg switch counters (last round): {s['sent']} sent, STAT_RX {s['STAT_RX']}, "
          f"STAT_COMPLETED {s['STAT_COMPLETED']} (sent - STAT_RX = dropped before the pipeline), "
          f"pipeline drops: {s['drops'] or 'none'} (a frame lost before the pipeline makes the "
          f"next round of its slot stale: one more drop, as for an agent); results checked: flag "
          f"and words")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round, shorter runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="measured time per run")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--window", type=int, default=256, help="packets outstanding (window mode)")
    ap.add_argument("--slots", type=int, default=256, help="the job's slot region")
    ap.add_argument("--workers", type=int, default=4,
                    help="workers of the second homagg job (all on port 1, UDP ports 50000+w)")
    ap.add_argument("--window-multi", type=int, default=32,
                    help="packets outstanding for the W-worker job: this sender does not "
                         "retransmit, so one frame lost at bmv2's input stalls its slot")
    ap.add_argument("--words", type=words_list, default=[wire.WORDS_PER_PACKET],
                    metavar="K[,K...]",
                    help="words per packet: homagg is built for K, frames carry K words "
                         f"(default {wire.WORDS_PER_PACKET}; up to 2176, jumbo frames). Several: "
                         "each in the same run, the first the reference")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.seconds = 1, 2.0
    for k in a.words:
        if wire.frame_bytes(k) > wire.JUMBO_MTU:
            ap.error(f"--words {k}: {wire.frame_bytes(k)}-byte packets, more than the "
                     f"testbed's {wire.JUMBO_MTU}-byte MTU")
    reason = skip_reason()
    if reason:
        print(f"switch_cost: skipped, {reason}")
        return 0

    from homagg.controller.build import build
    from homagg.targets.testbed import start_testbed, stop_testbed

    pipelines = {"l2fwd": build_l2fwd(), **{f"homagg-k{k}": build(words=k) for k in a.words}}
    frames = {k: Frames(a.slots, 1, k) for k in a.words}
    frames_multi = {k: Frames(a.slots, a.workers, k) for k in a.words}
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    bed = start_testbed(2, LOG_DIR)
    for port in bed.ports:  # the harness's capture sockets: unread copies cost kernel time
        port.close()
    rows: list[dict[int, dict]] = []
    try:
        for r in range(a.rounds):
            row: dict[int, dict] = {}
            for k in a.words:
                hg = f"homagg-k{k}"
                row[k] = {"homagg_w": measure(bed, hg, pipelines, frames_multi[k], a,
                                              window=a.window_multi, blast=False),
                          "l2fwd": measure(bed, "l2fwd", pipelines, frames[k], a),
                          "homagg": measure(bed, hg, pipelines, frames[k], a)}
                print(f"round {r + 1}/{a.rounds}, K = {k}: " + ", ".join(
                    f"{p} {m} {row[k][p][m]['pps']:.0f} pps" for p in ("l2fwd", "homagg")
                    for m in ("window", "blast"))
                    + f", homagg {a.workers}-worker window "
                    f"{row[k]['homagg_w']['window']['pps']:.0f} pps",
                    file=sys.stderr, flush=True)
            rows.append(row)
    finally:
        stop_testbed(bed)

    ver = subprocess.run([str(bed.switch.command()[0]), "--version"], capture_output=True,
                         text=True).stdout.strip()
    elements = {}
    for i, k in enumerate(a.words):
        if i:
            print()
        elements[k] = report(rows, k, len(frames[k]), a, ver)
    if len(a.words) > 1:
        k0 = a.words[0]
        print(f"\nelements/s by K, in this run ({a.workers}-worker job, window, its rounds "
              f"without loss; l2fwd: payload elements/s at the same frames):")
        for k in a.words:
            e = elements[k]
            if e is None:
                print(f"  K = {k:>4} ({len(frames[k])}-byte frames): no round without loss")
                continue
            vs = (f", {e[0] / elements[k0][0]:.2f}x K = {k0}'s"
                  if k != k0 and elements[k0] is not None else "")
            print(f"  K = {k:>4} ({len(frames[k])}-byte frames): homagg {e[0]:.3g}, l2fwd "
                  f"{e[1]:.3g}, homagg/l2fwd {e[0] / e[1]:.1%}{vs}")
    OUT.mkdir(parents=True, exist_ok=True)
    plot(rows, a.words, OUT / "switch_cost.png")
    print(f"plot: {OUT / 'switch_cost.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
