"""Compile the agent's numba kernels before any round needs them (``./run.sh setup`` runs
``homagg.host_agent.warm.main``).

numba compiles a kernel at its first call for each type signature and caches the machine code
beside the source (``cache=True``). Compiled inside a round, that first call stalled the round
for seconds while the peers' timeouts ran: on a fresh clone the first demo took 24.6 s with 89
retransmissions, four agents compiling at once on two cores, and the second 4.6 s with none.
So ``./run.sh setup`` runs this module once (the kernels are built at install), and every
``Agent`` calls ``before_join`` before its first round: with the cache filled that loads the
kernels (a few hundred milliseconds, once per process), and without it the compiling happens
before the job's join, where no peer waits on a timeout.

Only what the agent's rounds will call: where the C library is loaded, a float32 tensor's
codec runs there in every mode (dense, union, sketch; ``codec._compiled``), so an agent warms
no codec kernel and numba is not imported (its import and machine code cost a worker about
100 MB of peak memory). Such an agent handed another dtype, float64 from numpy, loads numba's
kernels at that tensor's first round, from the cache ``./run.sh setup`` filled.

It runs the codec's real paths (every mode and index, the dtypes the agents decode to) through
the in-memory simulator on small tensors, and the receive path's matching kernel on an empty
run: the signatures the data path calls, nothing else.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from homagg import wire

log = logging.getLogger("homagg.warm")

_lock = threading.Lock()
_done: set[str] = set()   # "codec", "results": warmed in this process

#: The float dtypes the agents decode to (the torch backend hands them float32; numpy users
#: float64 or float16 too).
DTYPES = (np.float32, np.float64, np.float16)


def _codec() -> None:
    from homagg.host_agent.simulate import simulate_allreduce

    rng = np.random.default_rng(0)
    n = 4096
    for dt in DTYPES:
        xs = []
        for _ in range(2):
            x = np.zeros(n, dt)
            idx = rng.choice(n, 40, replace=False)
            x[idx] = rng.standard_normal(idx.size).astype(dt)
            xs.append(x)
        for mode, index in (("auto", "hier"), ("auto", "flat"), ("union", "hier"),
                            ("sketch", "hier"), ("sketch", "flat"), ("dense", "flat")):
            simulate_allreduce(xs, mode=mode, index=index)
    # a tensor with a run of small values in a block (split blocks) and a NaN (the flag)
    a = rng.standard_normal(n).astype(np.float32)
    a[:512] = rng.standard_normal(512) * 1e-6  # (a run of small values: split blocks)
    simulate_allreduce([a, a.copy()], mode="auto")
    b = a.copy()
    b[3] = np.nan
    simulate_allreduce([a, b], mode="auto")


def _results() -> None:
    from homagg.host_agent.engine import results

    if not results.HAVE_NUMBA:
        return
    n, k = 4, 64
    psize = wire.packet_bytes(k)
    run = bytearray(psize * n)
    done = np.zeros(n, bool)
    out = np.zeros(n * k, np.int32)
    sent_at = np.full(n, np.inf)
    resent = np.zeros(n, bool)
    new, odd = np.empty(n + 1, np.int64), np.empty(n + 1, np.int64)
    results.take_jit(memoryview(run), 0, psize, k, 1, n, np.uint64(0), 0, done, out,
                     sent_at, resent, new, odd, False)


def warm(codec: bool = True, results: bool = True) -> float:
    """Compile (or load from numba's cache) the kernels the data path calls, once per process:
    the codec's (``codec``) and the Python engine's matching (``results``); the seconds it
    took (0 where it was done before, or without numba)."""
    from homagg.host_agent.codec import kernels

    with _lock:
        want = {name for name, on in (("codec", codec), ("results", results)) if on}
        if kernels.JIT is None or want <= _done:
            return 0.0
        t0 = time.monotonic()
        if "codec" in want - _done:
            _codec()
        if "results" in want - _done:
            _results()
        _done.update(want)
        took = time.monotonic() - t0
    log.debug("kernels ready in %.2f s", took)
    return took


def before_join(cfg, engine: str) -> float:
    """What an agent warms before its join: the codec's kernels unless the C library runs
    them (a float32 tensor's, in every mode), and the matching of results where its rounds
    run in the Python engine (``engine``). ``cfg``: the agent's config (kept for callers; the
    mode no longer decides)."""
    from homagg import native

    return warm(codec=native.load() is None, results=engine == "python")


def main() -> int:
    took = warm()
    print(f"homagg: the agent's kernels are compiled ({took:.1f} s)")
    return 0
