"""homagg-agent: run the host agent standalone, next to (or instead of) a training job.

    homagg-agent --job 1 --worker 0 --workers 4 --switch 10.0.0.254 --bind 10.0.0.1:50000 \\
        bench --size 1000000 --density 0.01 --iterations 20 --check
    homagg-agent ... train --iterations 30 --check        # the demo's recommender (NCF-like)

``bench`` all-reduces random sparse tensors; every worker draws every worker's tensor from the
same seeds, so ``--check`` compares the result bit for bit with the exact integer sum. ``train``
does the same with the demo model's gradients. Both end with a one-line summary (bytes on the
wire, rounds, retransmissions, time); worker 0 prints per-iteration lines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

from homagg import udpio, wire
from homagg.faults import FaultSpec
from homagg.host_agent import Agent, AgentConfig, AgentError, codec
from homagg.host_agent.config import key_from_env, run_from_env


def _addr(text: str, default_port: int) -> tuple[str, int]:
    host, _, port = text.partition(":")
    return host, int(port) if port else default_port


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="homagg-agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", type=int, required=True)
    p.add_argument("--worker", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--switch", default=wire.DEFAULT_SWITCH_IP,
                   help="IP[:PORT] of the switch/aggregator")
    p.add_argument("--bind", default=f"0.0.0.0:{wire.DEFAULT_AGENT_PORT}",
                   help="IP[:PORT] this agent sends from")
    p.add_argument("--slots", type=int, default=64, help="the job's slot region size")
    p.add_argument("--key", type=lambda s: int(s, 0), default=None, metavar="N",
                   help="the job's key, where its config sets one (every packet carries it; "
                        "default: $HOMAGG_JOB_KEY, else 0). A process list shows arguments: "
                        "prefer the variable")
    p.add_argument("--run", type=lambda s: int(s, 0), default=None, metavar="N",
                   help="the join's run: a number every worker of this run of the job shares, "
                        "so a join another run left pending is not counted in (default: "
                        "$HOMAGG_RUN, else torchrun's run id and restart count, else 0)")
    tr = p.add_argument_group("trees of switches (a leaf's job: --worker is the id at the leaf, "
                              "--workers the whole tree's)")
    tr.add_argument("--local-workers", type=int, metavar="N",
                    help="workers of this agent's switch (its job's size at the leaf)")
    tr.add_argument("--rank", type=int, metavar="R",
                    help="this worker's index among all --workers, for its share of the data "
                         "(default: --worker)")
    tr.add_argument("--siblings", default="", metavar="NAMES",
                    help="comma-separated names of the parent switch's children, in worker-id "
                         "order, so a timeout names a missing one")
    p.add_argument("--words", type=int, metavar="K",
                   help="words per packet; default: the switch's, learnt at the join (set, a "
                        "switch built otherwise is an error)")
    p.add_argument("--timeout", type=float, default=0.05,
                   help="initial retransmission timeout (s); measured round trips take over")
    p.add_argument("--max-timeout", type=float, default=AgentConfig.max_timeout,
                   help="cap of the retransmission timeout's backoff (s)")
    p.add_argument("--deadline", type=float, default=10.0, help="error after this long stuck")
    p.add_argument("--rate", type=float, help="pace sends to this many packets/s")
    p.add_argument("--congestion", action="store_true",
                   help="congestion control (host_agent.congestion): an AIMD window in slots, "
                        "halved on a timeout, and pacing from the measured round trip; "
                        "default off: the whole slot window, unpaced (or at --rate)")
    p.add_argument("--engine", default=os.environ.get("HOMAGG_AGENT_ENGINE") or "auto",
                   choices=["auto", "native", "python"],
                   help="the rounds' engine: native (C) where it can run, or python "
                        "(default: $HOMAGG_AGENT_ENGINE, else auto)")
    p.add_argument("--mode", default=codec.AUTO, choices=[codec.AUTO, *codec.MODES])
    p.add_argument("--index", default=codec.AUTO, choices=codec.INDEXES,
                   help="the non-zeros' index: flat bitmap (1 round), hierarchical bitmap "
                        "(3 rounds, size follows the union), or auto (per tensor)")
    p.add_argument("--seed", type=int, default=0,
                   help="data seed (same on every worker; bench mixes in the job id, so "
                        "concurrent jobs sum different data)")
    f = p.add_argument_group("fault injection (tests, demos; at this agent's socket)")
    f.add_argument("--inject-loss", type=float, default=0.0, metavar="PCT",
                   help="drop this percent of datagrams, each direction")
    f.add_argument("--inject-dup", type=float, default=0.0, metavar="PCT",
                   help="send this percent of datagrams twice")
    f.add_argument("--inject-reorder", type=float, default=0.0, metavar="PCT",
                   help="hold this percent of datagrams back behind the next one")
    f.add_argument("--shift-bias", type=int, default=0, metavar="BITS",
                   help="quantize this many bits finer than negotiated (forces overflows; "
                        "give every worker the same value)")
    p.add_argument("--summary-json", help="also write the summary as JSON to this file")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="all-reduce random sparse tensors")
    b.add_argument("--size", type=int, default=1_000_000)
    b.add_argument("--density", type=float, default=0.01)
    b.add_argument("--iterations", type=int, default=10)
    b.add_argument("--check", action="store_true", help="verify every sum bit for bit")
    b.add_argument("--same-tensor", action="store_true",
                   help="every worker all-reduces worker 0's tensor (sums of like signs: with "
                        "--shift-bias, a way to make the switch flag overflows)")
    t = sub.add_parser("train", help="train the demo recommender through the switch")
    t.add_argument("--iterations", type=int, default=30)
    t.add_argument("--check", action="store_true", help="verify every aggregate bit for bit")
    t.add_argument("--users", type=int, default=4000)
    t.add_argument("--items", type=int, default=8000)
    t.add_argument("--batch", type=int, default=256)
    return p


def bench_tensor(seed, it, worker, n, density, rows_of: int = 1):
    """Worker ``worker``'s tensor at iteration ``it``: ``density`` of n positions, N(0, 1);
    with ``rows_of`` > 1, ``density`` of the rows of that many elements, whole rows non-zero
    (an embedding table's gradient)."""
    rng = np.random.default_rng([seed, it, worker])
    x = np.zeros(n, np.float32)
    if rows_of > 1:
        rows = rng.choice(n // rows_of, max(1, int(n // rows_of * density)), replace=False)
        idx = (rows[:, None] * rows_of + np.arange(rows_of)).reshape(-1)
    else:
        idx = rng.choice(n, max(1, int(n * density)), replace=False)
    x[idx] = rng.standard_normal(idx.size).astype(np.float32)
    return x


def check_exact(res, tensors, what: str) -> None:
    """AgentError unless ``res`` is, bit for bit, the integer sum of ``tensors`` quantized at
    the scale the job used."""
    expect = np.sum([codec.quantize(t, res.shift).astype(np.int64) for t in tensors], axis=0)
    got = res.ints()
    if not np.array_equal(got, expect):
        bad = np.flatnonzero(got != expect)
        raise AgentError(f"{what}: aggregate differs from the exact integer sum at {bad.size} "
                         f"position(s), first {bad[0]}: {got[bad[0]]} != {expect[bad[0]]}")


def _progress(iterable, enabled: bool, desc: str):
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=desc, file=sys.stderr, leave=False)


def datagrams(c) -> int:
    """The datagrams an agent has sent and received: its packets (resends too), its join
    packets, the results taken and the datagrams ignored."""
    return c.packets_sent + c.join_packets + c.results + c.ignored


def run_bench(agent: Agent, a) -> dict:
    """The bench's iterations. Its ``steady`` entry: the datagrams of every all-reduce after the
    first and the process's CPU seconds in them (user + system, ``time.process_time`` before
    and after each call), so start-up, imports, numba's JIT and the join (all before or in
    the first) are left out, and so is the bench's own work between calls (drawing the
    tensors, ``--check``); the agent's codec is in. ``stream_cpu``: of that CPU, the part in
    the transport's rounds (``Transport.stream``: the packet path, without the codec).
    bench.pps takes its steady-state rates from it. None with one iteration."""
    W = a.workers
    seed = a.seed * 65536 + a.job  # a result that mixed two jobs' data cannot pass --check
    dense = 0
    cpu = 0.0
    mark = 0
    in_stream = [0.0]
    stream = agent.transport.stream

    def timed_stream(op, words, flagged=False):  # the agent looks it up at each round
        t0 = time.process_time()
        try:
            return stream(op, words, flagged)
        finally:
            in_stream[0] += time.process_time() - t0

    agent.transport.stream = timed_stream  # type: ignore[method-assign]
    for it in _progress(range(a.iterations), a.rank == 0 and sys.stderr.isatty(), "all-reduce"):
        src = (lambda w: 0) if a.same_tensor else (lambda w: w)
        x = bench_tensor(seed, it, src(a.rank), a.size, a.density)
        t0 = time.process_time()
        res = agent.allreduce_detailed(x)
        if it:
            cpu += time.process_time() - t0
        else:  # warm: what follows is the steady state
            mark = datagrams(agent.counters)
            in_stream[0] = 0.0
        dense += 4 * a.size
        if a.check:
            check_exact(res, [bench_tensor(seed, it, src(w), a.size, a.density)
                              for w in range(W)], f"iteration {it}")
        if a.rank == 0 and not sys.stderr.isatty():
            print(f"iter {it:4d}  mode {res.mode:6s}  wire {res.wire_bytes / (4 * a.size):7.2%} "
                  f"of dense{'  exact' if a.check else ''}", flush=True)
    steady = None
    if a.iterations > 1:
        steady = {"iterations": a.iterations - 1, "cpu": cpu, "stream_cpu": in_stream[0],
                  "datagrams": datagrams(agent.counters) - mark}
    return {"dense_bytes": dense, "steady": steady}


def run_train(agent: Agent, a) -> dict:
    from homagg.host_agent.workloads import GMF, NCFConfig, SyntheticData

    cfg = NCFConfig(users=a.users, items=a.items, batch=a.batch, seed=a.seed)
    model, data = GMF(cfg), SyntheticData(cfg)
    # Other workers' models for the check: all replicas stay identical, so one copy serves.
    dense_per_iter = 4 * sum(p.size for p in model.params().values())
    dense = 0
    if a.rank == 0:
        print(f"{'iter':>4}  {'loss':>8}  {'homagg B':>10}  {'dense B':>10}  {'ratio':>6}  "
              f"{'modes':<24}  check", flush=True)
    for it in range(a.iterations):
        u, i, y = data.batch(it, a.rank)  # this worker's share: its rank in the whole job
        loss, grads = model.loss_and_grads(u, i, y)
        losses = None
        others: list = []
        if a.check:
            others = [model.loss_and_grads(*data.batch(it, w)) for w in range(a.workers)]
            losses = [o[0] for o in others]
        summed, modes, nbytes = {}, [], 0
        for name, g in grads.items():
            res = agent.allreduce_detailed(g, key=name)
            if a.check:
                check_exact(res, [o[1][name].reshape(-1) for o in others],
                            f"iteration {it} tensor {name}")
            summed[name] = res.out.reshape(g.shape)
            modes.append(f"{name}:{res.mode}")
            nbytes += res.wire_bytes
        model.apply(summed, a.batch * a.workers)
        dense += dense_per_iter
        global_loss = float(np.mean(losses)) if losses else loss
        if a.rank == 0:
            print(f"{it:>4}  {global_loss:8.5f}  {nbytes:>10}  {dense_per_iter:>10}  "
                  f"{nbytes / dense_per_iter:6.1%}  {' '.join(modes):<24}  "
                  f"{'exact' if a.check else '-'}", flush=True)
    return {"dense_bytes": dense, "final_loss": global_loss, "model_digest": model.digest()}


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    a.rank = a.worker if a.rank is None else a.rank
    if not 0 <= a.rank < a.workers:
        print(f"homagg-agent: error: --rank {a.rank}: need 0 <= rank < --workers {a.workers}",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = AgentConfig(a.job, a.worker, a.workers, _addr(a.switch, wire.HOMAGG_UDP_PORT_MIN),
                          _addr(a.bind, wire.DEFAULT_AGENT_PORT), a.slots, timeout=a.timeout,
                          deadline=a.deadline, max_timeout=a.max_timeout,
                          rate_pps=a.rate, congestion=a.congestion, engine=a.engine,
                          mode=a.mode,
                          index=a.index,
                          shift_bias=a.shift_bias, words=a.words,
                          local_workers=a.local_workers,
                          siblings=tuple(s for s in a.siblings.split(",") if s),
                          run=run_from_env() if a.run is None else a.run,
                          key=key_from_env() if a.key is None else a.key,
                          faults=FaultSpec(a.inject_loss / 100, a.inject_dup / 100,
                                           a.inject_reorder / 100, seed=1000 * a.job + a.rank))
        t0 = time.monotonic()
        with Agent(cfg) as agent:
            extra = run_bench(agent, a) if a.cmd == "bench" else run_train(agent, a)
            c = agent.counters
            sk = agent.sock
            engine = getattr(agent.transport, "engine", "python")
            io = udpio.io_counts(sk)  # system calls and the datagrams they carried
            agent_faults = {k: getattr(sk, k, 0) for k in ("dropped_out", "dropped_in",
                                                            "duplicated", "reordered")}
        summary = {"job": a.job, "worker": a.worker, "rank": a.rank,
                   "bytes_on_wire": c.bytes_sent,
                   "dense_fp32_bytes": extra.pop("dense_bytes"), "packets": c.packets_sent,
                   "rounds": c.rounds, "retransmissions": c.retransmissions,
                   "rescales": c.rescales, "ignored": c.ignored, "results": c.results,
                   "join_packets": c.join_packets,
                   "recovery": {"early_resends": c.early_resends, "probes": c.probes,
                                "probes_held": c.probes_held,
                                "held_back": c.held_back, "tail_copies": c.tail_copies,
                                "waited_timeout": round(c.waited_timeout, 3),
                                "waited_rack": round(c.waited_rack, 3),
                                "waited_probe": round(c.waited_probe, 3)},
                   "injected": agent_faults, "io": io, "engine": engine,
                   "seconds": round(time.monotonic() - t0, 3), "checked": a.check, **extra}
    except AgentError as e:
        print(f"homagg-agent: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    ratio = summary["bytes_on_wire"] / max(1, summary["dense_fp32_bytes"])
    print(f"worker {a.worker}: {summary['bytes_on_wire']} B on the wire ({ratio:.1%} of dense "
          f"fp32), {summary['packets']} packets, {summary['rounds']} rounds, "
          f"{summary['retransmissions']} retransmissions, {summary['rescales']} rescales, "
          f"{summary['seconds']:.2f} s"
          + (", every aggregate exact" if a.check else ""), flush=True)
    if a.summary_json:
        with open(a.summary_json, "w") as f:
            json.dump(summary, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
