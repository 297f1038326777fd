"""bench.linerate's agent: one worker's rounds streamed through the aggregator for a while,
its CPU per payload measured around the rounds alone.

    python -m bench.linerate_agent SWITCH_IP:PORT BIND_IP:PORT ENGINE SLOTS WORDS SECONDS KEY

The job (one worker, installed by bench.linerate) makes every result the agent's own words, so
each round is checked bit for bit. ``Transport.stream`` is timed (``time.process_time``: the
process's CPU, every thread) and nothing else: the join, imports and the checks are out. Prints
one JSON line: rounds, words per round, CPU and wall seconds of the rounds, the engine that
ran, the results that were wrong, and the agent's counters.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import numpy as np

from homagg import udpio, wire
from homagg.host_agent import AgentConfig
from homagg.host_agent.engine import Counters, Transport


def addr(text: str) -> tuple[str, int]:
    ip, port = text.rsplit(":", 1)
    return ip, int(port)


def main(argv: list[str]) -> int:
    switch, bind, engine, slots, words, seconds, key = argv
    cfg = AgentConfig(job=1, worker=0, workers=1, switch=addr(switch), bind=addr(bind),
                      slots=int(slots), engine=engine, deadline=5.0, key=int(key))
    counters = Counters()
    t = Transport(cfg, counters)
    rng = np.random.default_rng(0)
    x = rng.integers(-(1 << 30), 1 << 30, int(words), dtype=np.int32)
    t.stream(wire.OP_ADD, x)  # the join, and a first round
    rounds = wrong = 0
    cpu = wall = 0.0
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        c0, w0 = time.process_time(), time.monotonic()
        out = t.stream(wire.OP_ADD, x)
        cpu += time.process_time() - c0
        wall += time.monotonic() - w0
        rounds += 1
        wrong += not np.array_equal(out, x)
    io = udpio.io_counts(t.sock)
    t.close()
    print(json.dumps({"rounds": rounds, "words": int(words), "cpu": cpu, "wall": wall,
                      "engine": t.engine, "wrong": wrong, "io": io,
                      "counters": dataclasses.asdict(counters)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
