"""What a host agent is told (``AgentConfig``), and what it raises when it cannot do it.

Defaults for the addresses come from ``homagg.wire`` (the switch's address and UDP port, the
agent's port); ``mode`` is a ``codec.Mode`` name or "auto"; ``index`` is "flat", "hier" or
"auto" (``codec.choose_index``). Every worker of a job must use the same mode and index.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from homagg import wire
from homagg.faults import FaultSpec
from homagg.host_agent.codec import (
    AUTO,
    DEFAULT_BLOCK,
    DEFAULT_HEADROOM,
    DEFAULT_RATIO,
    INDEXES,
    CodecError,
    as_index,
    as_mode,
)
from homagg.host_agent.errors import AgentError, AggregationTimeout  # noqa: F401 (re-exported)
from homagg.host_agent.parts import DEFAULT_PART

if TYPE_CHECKING:
    from homagg.host_agent.membership import Membership


@dataclass(frozen=True)
class AgentConfig:
    job: int
    worker: int
    workers: int
    switch: tuple[str, int] = (wire.DEFAULT_SWITCH_IP, wire.HOMAGG_UDP_PORT_MIN)
    bind: tuple[str, int] = ("0.0.0.0", wire.DEFAULT_AGENT_PORT)
    slots: int = 64              # the job's slot region (controller: job 'slots')
    seed: int | None = None      # sketch hash seed; default: the job id
    timeout: float = 0.05        # initial retransmission timeout (s); then measured RTTs
    min_timeout: float = 0.02    # floor of the measured timeout: a window's last chunks queue
                                 # behind its first, so one RTT sample understates the rest
    max_timeout: float = 0.1     # backoff cap: losses here are random, not congestion, and a
                                 # round waits for its slowest chunk (10% loss: 37 s -> 9 s)
    backoff: float = 2.0
    deadline: float = 10.0       # no progress for this long: AggregationTimeout
    rate_pps: float | None = None  # pacing (bmv2 drops bursts); None: window-limited only
    congestion: bool = False     # AIMD window in slots and pacing (host_agent.congestion);
                                 # off: the whole slot window, unpaced (or at rate_pps). Off
                                 # by default: measured no fairer, and more resends (see
                                 # docs/performance.md, "Aggregation throughput")
    mode: str = AUTO             # auto | dense | union | sketch (a codec.Mode or its name)
    index: str = AUTO            # auto | flat | hier: the non-zeros' index (codec.index)
    ratio: float = DEFAULT_RATIO  # sketch counters per union element (codec.sketch_size) and
                                 # the byte count's (codec.choose_mode); same on every worker
    headroom: int = DEFAULT_HEADROOM
    block: int = DEFAULT_BLOCK   # elements per scale block (codec.blocks); same on every worker
    part: int = DEFAULT_PART     # elements per part of a long tensor the torch layer sums in
                                 # place (host_agent.parts); same on every worker
    split: bool = True           # split blocks that hold a run far below their peak (a small
                                 # layer next to a large one: codec.blocks); same on every worker
    max_rescales: int = 6
    engine: str = "auto"         # the rounds' engine: auto (native where it can run), native
                                 # or python (host_agent.engine.native)
    words: int | None = None     # K, words per packet: None learns the switch's at the join;
                                 # a number is checked against it (a mismatch fails at once)
    # In a tree of switches, ``workers`` is every worker of the tree (the sum's contributors:
    # the scale's headroom and the mean divide by it), ``worker`` this agent's id at its own
    # switch and ``local_workers`` how many that switch's job has (None: not a tree). The
    # parent switch's children (its workers, in id order) are named in ``siblings``, so that a
    # timeout names the missing one; empty: they are named by number.
    local_workers: int | None = None
    siblings: tuple[str, ...] = ()
    # Fault injection, for tests and demos: loss/duplication/reordering at this agent's socket
    # (where the kernel has no netem), and a scale finer than negotiated by this many bits
    # (forces the switch's overflow flag; every worker of the job must use the same value).
    faults: FaultSpec | None = None
    shift_bias: int = 0
    # The join's attempt: every worker of one run of the job carries the same number in its
    # join, and a pending join of another attempt is started afresh (join.p4), so a run whose
    # join never completed cannot complete a later run's. 0 where nothing hands one out.
    run: int = 0
    # The job's key: every packet carries it (the header's auth word), the switch drops a
    # packet of this agent's address without it as spoofed, and this agent ignores results
    # without it (Counters.spoofed). The service hands it out at the join; a static job's is
    # its config's ``key`` (0 where none is set).
    key: int = field(default=0, repr=False)
    # Where the controller service placed this worker (``from_env`` with HOMAGG_CONTROLLER):
    # the bound socket the agent takes, and the lease it holds until the agent closes.
    membership: Membership | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if not 0 <= self.worker < self.workers <= wire.MAX_WORKERS * wire.MAX_WORKERS:
            raise AgentError(f"worker {self.worker} of {self.workers}: need 0 <= worker < "
                             f"workers")
        here = self.workers if self.local_workers is None else self.local_workers
        if not 0 <= self.worker < here <= min(self.workers, wire.MAX_WORKERS):
            raise AgentError(f"worker {self.worker} of {here} at its switch: need 0 <= worker "
                             f"< {here} <= {wire.MAX_WORKERS}, and no more than the "
                             f"{self.workers} workers in all")
        if not 1 <= self.slots <= wire.SLOTS:
            raise AgentError(f"slots {self.slots}: 1 to {wire.SLOTS}")
        if self.words is not None and not (wire.MIN_WORDS_PER_PACKET <= self.words
                                           <= wire.MAX_WORDS_PER_PACKET):
            raise AgentError(f"words {self.words}: {wire.MIN_WORDS_PER_PACKET} to "
                             f"{wire.MAX_WORDS_PER_PACKET} per packet")
        if self.engine not in ("auto", "native", "python"):
            raise AgentError(f"engine {self.engine!r}: auto, native or python")
        try:
            as_mode(self.mode, auto=True)
        except CodecError:
            raise AgentError(f"mode {self.mode!r}: auto, dense, union or sketch") from None
        if not 0 <= self.run <= 0xFFFFFFFF:
            raise AgentError(f"run {self.run}: the join's attempt, 0 to 2**32 - 1")
        if not 0 <= self.key <= 0xFFFFFFFF:
            raise AgentError("key: the job's key is 0 to 2**32 - 1")
        if self.block < 1:
            raise AgentError(f"block {self.block}: elements per scale block, >= 1")
        if self.part < 1:
            raise AgentError(f"part {self.part}: elements per part of a long tensor, >= 1")
        try:
            as_index(self.index)
        except CodecError:
            raise AgentError(f"index {self.index!r}: {', '.join(INDEXES)}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **options) -> AgentConfig:
        """The config a program finds in its environment.

        With HOMAGG_CONTROLLER (host:port of ``homagg-ctl serve``), it joins through the
        service (``_joined``): torchrun's variables say the rest. Otherwise, as
        ``homagg-net exec`` sets them: HOMAGG_JOB, HOMAGG_WORKER, HOMAGG_WORKERS,
        HOMAGG_SWITCH (host[:port]), HOMAGG_BIND (host[:port]), HOMAGG_SLOTS and
        HOMAGG_JOB_KEY (the job's key, where its config sets one) (both optional);
        under a tree's leaf also HOMAGG_LOCAL_WORKERS (the leaf's workers) and HOMAGG_SIBLINGS
        (the parent switch's children, comma-separated); the join's run from
        ``run_from_env``; either way HOMAGG_AGENT_ENGINE (``engine``: auto, native or python)
        where set. ``options`` set any other field."""
        env = os.environ if environ is None else environ
        if env.get("HOMAGG_AGENT_ENGINE"):
            options.setdefault("engine", env["HOMAGG_AGENT_ENGINE"])
        if env.get("HOMAGG_CONTROLLER"):
            return cls._joined(env, options)

        def need(name: str) -> str:
            value = env.get(name)
            if not value:
                raise AgentError(f"${name} is not set: start the program with homagg-net exec, "
                                 "or set HOMAGG_JOB, HOMAGG_WORKER, HOMAGG_WORKERS, "
                                 "HOMAGG_SWITCH and HOMAGG_BIND")
            return value

        def addr(name: str, port: int) -> tuple[str, int]:
            host, _, p = need(name).partition(":")
            try:
                return host, int(p) if p else port
            except ValueError:
                raise AgentError(f"${name}={need(name)!r}: expected HOST[:PORT]") from None

        try:
            job, worker, workers = (int(need(n)) for n in ("HOMAGG_JOB", "HOMAGG_WORKER",
                                                            "HOMAGG_WORKERS"))
            slots = int(env.get("HOMAGG_SLOTS") or options.pop("slots", 64))
            if env.get("HOMAGG_LOCAL_WORKERS"):
                options.setdefault("local_workers", int(env["HOMAGG_LOCAL_WORKERS"]))
        except ValueError as e:
            raise AgentError(f"HOMAGG_* settings must be integers: {e}") from None
        options.setdefault("run", run_from_env(env))
        options.setdefault("key", key_from_env(env))
        if env.get("HOMAGG_SIBLINGS"):
            options.setdefault("siblings", tuple(s for s in env["HOMAGG_SIBLINGS"].split(",")
                                                 if s))
        return cls(job, worker, workers, addr("HOMAGG_SWITCH", wire.HOMAGG_UDP_PORT_MIN),
                   addr("HOMAGG_BIND", wire.DEFAULT_AGENT_PORT), slots, **options)

    @classmethod
    def _joined(cls, env: Mapping[str, str], options: dict) -> AgentConfig:
        """Join through the service at HOMAGG_CONTROLLER with HOMAGG_TOKEN (HOMAGG_CA: the
        service's TLS CA). Rank and world size are torch's RANK and WORLD_SIZE; the job's name
        is what every rank of one torchrun has alike, MASTER_ADDR:MASTER_PORT with
        TORCHELASTIC_RUN_ID (torchrun's default run id is the same for every job, so it
        cannot be the name alone), or HOMAGG_JOB_NAME. The agent binds an ephemeral port on
        the address it speaks to the service from (HOMAGG_BIND: another host[:port]).
        Every rank presents the job's join secret, HOMAGG_JOIN_SECRET, alike (at least
        16 characters): torch.distributed's homagg backend draws one per attempt and shares it
        through torchrun's store; ``homagg-net`` gives the commands it runs one.
        Optional: HOMAGG_SLOTS (the job's slots), HOMAGG_JOIN_TIMEOUT (seconds to wait for
        the other ranks, default 120), HOMAGG_JOIN_RETRY (seconds to keep trying a service
        that cannot be reached, default 10)."""
        from homagg.host_agent.membership import join
        from homagg.membership import MIN_JOIN_SECRET, secret_too_plain

        def need(name: str, why: str) -> str:
            value = env.get(name)
            if not value:
                raise AgentError(f"${name} is not set: with HOMAGG_CONTROLLER, {why}")
            return value

        torch = "start the program with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, " \
                "MASTER_PORT and TORCHELASTIC_RUN_ID)"
        try:
            rank, world = int(need("RANK", torch)), int(need("WORLD_SIZE", torch))
            slots = int(env.get("HOMAGG_SLOTS") or 0)
            wait = float(env.get("HOMAGG_JOIN_TIMEOUT") or 120.0)
            retry = float(env.get("HOMAGG_JOIN_RETRY") or 10.0)
            bind_port = 0
            bind_host = None
            if env.get("HOMAGG_BIND"):
                bind_host, _, p = env["HOMAGG_BIND"].partition(":")
                bind_port = int(p) if p else 0
        except ValueError as e:
            raise AgentError(f"RANK, WORLD_SIZE, HOMAGG_SLOTS, HOMAGG_JOIN_TIMEOUT, "
                             f"HOMAGG_JOIN_RETRY and HOMAGG_BIND's port must be numbers: {e}"
                             ) from None
        # NaN, infinities and negatives would wait forever or not at all, and then read as
        # the service's refusal: said here, naming the variable
        for var, v, least in (("HOMAGG_JOIN_TIMEOUT", wait, "above 0"),
                              ("HOMAGG_JOIN_RETRY", retry, "0 or more")):
            if not math.isfinite(v) or v < 0 or (v == 0 and var == "HOMAGG_JOIN_TIMEOUT"):
                raise AgentError(f"{var}={env.get(var)!r}: a finite number of seconds, {least}")
        name = env.get("HOMAGG_JOB_NAME") or (
            f"{need('MASTER_ADDR', torch)}:{need('MASTER_PORT', torch)}/"
            f"{env.get('TORCHELASTIC_RUN_ID') or 'none'}")
        token = env.get("HOMAGG_TOKEN", "")
        secret = env.get("HOMAGG_JOIN_SECRET", "") or torch_join_secret(name)
        if len(secret) < MIN_JOIN_SECRET:
            raise AgentError(
                f"$HOMAGG_JOIN_SECRET {'is not set' if not secret else 'is too short'}: with "
                f"HOMAGG_CONTROLLER, every rank of a job presents the same join secret of at "
                f"least {MIN_JOIN_SECRET} characters, so that no one else can take a rank that "
                "has not joined yet (torch.distributed's homagg backend draws one and shares it "
                "through torchrun's store; homagg-net gives one to what it runs; otherwise "
                "draw one, e.g. python -c 'import secrets; print(secrets.token_hex(16))', and "
                "give it to every rank)")
        plain = secret_too_plain(secret)
        if plain is not None:
            raise AgentError(f"$HOMAGG_JOIN_SECRET: {plain}")
        ca = Path(env["HOMAGG_CA"]) if env.get("HOMAGG_CA") else None
        # an address of its own (HOMAGG_BIND) is claimed: the service takes it only where
        # the operator allows (NAT), and otherwise refuses it unless it is the one seen
        m = join(env["HOMAGG_CONTROLLER"], token, name, rank, world, (bind_host, bind_port),
                 slots, wait, ca, claim_ip=bind_host or "", retry=retry, join_secret=secret)
        tree = m.leaf_workers > 0  # placed in a tree: the leaf's numbering at the leaf
        if tree:
            options.setdefault("local_workers", m.leaf_workers)
            options.setdefault("siblings", m.siblings)
        try:
            return cls(m.job_id, m.leaf_worker if tree else m.worker, m.workers, m.send_to,
                       (m.ip, m.udp_port), m.slots, run=m.run, key=m.key, membership=m,
                       **options)
        except BaseException:
            m.leave()
            raise

    @property
    def who(self) -> str:
        """This agent in messages: "job J worker W"."""
        return f"job {self.job} worker {self.worker}"


def store_secret(store: Any, key: str) -> str:
    """A join secret shared through a torch.distributed store (torchrun's, under a prefix of
    this attempt): drawn by whichever rank asks first, read by the others. Whoever reaches
    the store is inside the job already; a token holder elsewhere never sees it."""
    import secrets

    got = store.compare_set(key, "", secrets.token_hex(16))
    return got.decode() if isinstance(got, bytes) else str(got)


def torch_join_secret(name: str) -> str:
    """Job ``name``'s join secret through torch.distributed's default store, where the
    program has initialized it already (the DDP hook on a gloo group); "" where
    torch.distributed is not in use."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return ""
    return store_secret(dist.distributed_c10d._get_default_store(), f"homagg/join-secret/{name}")


def key_from_env(environ: Mapping[str, str] | None = None) -> int:
    """A static job's key (``AgentConfig.key``) from $HOMAGG_JOB_KEY, 0 where it is unset."""
    env = os.environ if environ is None else environ
    if not env.get("HOMAGG_JOB_KEY"):
        return 0
    try:
        return int(env["HOMAGG_JOB_KEY"], 0)
    except ValueError:
        raise AgentError("$HOMAGG_JOB_KEY: expected an integer (the job's key in its config), "
                         "0 to 2**32 - 1") from None


def run_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The join's run (``AgentConfig.run``) that every worker of one run of a job finds alike
    in its environment: $HOMAGG_RUN where a launcher hands one out (``homagg-net``); else,
    under torchrun, a checksum of what names this attempt of the job on every rank alike
    (MASTER_ADDR:MASTER_PORT, TORCHELASTIC_RUN_ID and TORCHELASTIC_RESTART_COUNT, which an
    elastic restart increments); else 0, which tells no attempt from another."""
    env = os.environ if environ is None else environ
    if env.get("HOMAGG_RUN"):
        try:
            run = int(env["HOMAGG_RUN"], 0)
        except ValueError:
            raise AgentError(f"$HOMAGG_RUN={env['HOMAGG_RUN']!r}: expected an integer") from None
        if not 0 <= run <= 0xFFFFFFFF:
            raise AgentError(f"$HOMAGG_RUN={run}: 0 to 2**32 - 1")
        return run
    if env.get("TORCHELASTIC_RUN_ID") is None:
        return 0
    attempt = "/".join(env.get(n, "") for n in ("MASTER_ADDR", "MASTER_PORT",
                                                 "TORCHELASTIC_RUN_ID",
                                                 "TORCHELASTIC_RESTART_COUNT"))
    return zlib.crc32(attempt.encode())
