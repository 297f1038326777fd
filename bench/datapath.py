"""The software aggregator's data path in process: datagrams per CPU second, no sockets.

    python -m bench.datapath                 # K = 256, 4 workers, 7 repeats
    python -m bench.datapath --words 64 --workers 8

bench.pps measures the aggregator on loopback, where how many datagrams each system call
carries (GSO/GRO) moves with the machine's load and can swing its rate by 10-20% between runs.
This one feeds ``SoftSwitch.handle_run`` (the server's call per received run) the runs of a
job's workers directly, as the server would (``--run`` datagrams per run, one run per worker
per step, every round completing), and counts CPU seconds of this process only: the per-datagram
cost of the model and its tables, and nothing else. The packets are built before the clock
starts. Every round's result is checked against the integer sum once, after the timing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from homagg import wire
from homagg.controller.local import install
from homagg.targets.soft import SoftSwitch


def runs(k: int, workers: int, slots: int, run: int, step: int, words: np.ndarray):
    """Each worker's run of ``run`` chunks of step ``step`` (chunk g: slot g % slots, copy
    (g // slots) % 2, round tag g + 1, as the agents number them)."""
    out = []
    for w in range(workers):
        gs = range(step * run, (step + 1) * run)
        data = b"".join(wire.pack(wire.OP_ADD, 1, w, g % slots, g + 1, words[w], k=k,
                                  flags=wire.FLAG_PHASE if (g // slots) % 2 else 0)
                        for g in gs)
        out.append((memoryview(data), ("127.0.0.1", 50000 + w)))
    return out


def measure(k: int, workers: int, slots: int, run: int, steps: int, repeats: int) -> dict:
    sw = SoftSwitch(words=k)
    install(sw, 1, [("127.0.0.1", 50000 + w) for w in range(workers)], slots)
    rng = np.random.default_rng(3)
    words = rng.integers(-1000, 1000, (workers, k)).astype(np.int32)
    size = wire.packet_bytes(k)
    rates, last = [], None
    for rep in range(repeats):
        batch = [runs(k, workers, slots, run, rep * steps + s, words) for s in range(steps)]
        t0 = time.process_time()
        for step in batch:
            for view, src in step:
                last = sw.handle_run(view, size, src)
        rates.append(steps * workers * run / (time.process_time() - t0))
    st = sw.read_stats()["switch"]
    rounds = repeats * steps * run
    assert st["STAT_COMPLETED"] == rounds, st  # every round completed
    assert last is not None
    want = words.astype(np.int64).sum(axis=0).astype(np.int32)
    for pkts in last.values():  # the last step's results, to every worker
        for p in pkts:
            assert np.array_equal(wire.unpack(p).words, want)
    return {"k": k, "workers": workers, "median": statistics.median(rates), "best": max(rates),
            "rounds": rounds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--words", type=int, default=wire.WORDS_PER_PACKET, help="K")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--run", type=int, default=32, help="datagrams per run (per worker)")
    ap.add_argument("--steps", type=int, default=40, help="runs per worker per repeat")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    r = measure(a.words, a.workers, a.slots, a.run, a.steps, a.repeats)
    print(f"software aggregator data path, in process: K = {r['k']}, {r['workers']} workers, "
          f"{r['rounds']} rounds, every one exact")
    print(f"datagrams per CPU second: median {r['median']:,.0f}, best {r['best']:,.0f} "
          f"(of {a.repeats} repeats)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
