"""The controller service's vocabulary: its options, its refusals, what a join answers, the
jobs it holds, and the STATS cells it keeps on a switch. ``service`` (the logic) and ``serve``
(gRPC) import it; it imports neither.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import urllib.parse
from dataclasses import dataclass, field

from homagg import _p4consts as P4
from homagg import wire
from homagg.controller import placement as P
from homagg.controller.p4client import CounterValue
from homagg.controller.switch import Switch
from homagg.errors import ConfigError, HomaggError, JobError
from homagg.membership import MIN_JOIN_SECRET, secret_too_plain
from homagg.netconfig import Config, Worker
from homagg.treeconfig import Tree

log = logging.getLogger("homagg.service")

#: The STATS counter cell that marks the jobs the service placed on a place: a bitmask of job
#: ids, ids 0-62 in its packet count and 63 on in its byte count (P4Runtime's counts are
#: int64: bit 63 of one does not fit). The data plane counts nothing there (its STAT_* and
#: DROP_* end at 21; EPOCH_STORE is 31); p4/include/constants.p4 notes the reservation.
SERVICE_JOBS_CELL = 30
#: The STATS cell where the service that holds the switch keeps its mark: a random id
#: (packets) and its gRPC address, IPv4 << 16 | port (bytes). Never counted by the data plane.
HOLDER_CELL = 29
_MASK_BITS = 63
NO_MAC = "00:00:00:00:00:00"
#: Joins waiting at once, at most, by default: each holds a server thread (serve.py keeps
#: threads beyond these for renewals and leaves).
MAX_JOINS = 1024
#: Jobs placed, kept for ``placements`` (the launcher's summary), the most recent.
PLACEMENTS_KEPT = 1024


class Refusal(HomaggError):
    """A request the service will not carry out: ``code`` is a gRPC status code name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def positive_seconds(value: float, option: str) -> float:
    """``value`` if it is a finite number of seconds above zero; else a ConfigError naming
    ``option`` (NaN, infinities, zero and negatives would spin, never expire, or expire at
    once)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{option} {value!r}: a finite number of seconds above 0") from None
    if not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{option} {value!r}: a finite number of seconds above 0")
    return v


@dataclass(frozen=True)
class ServeOptions:
    token: str | None = None      # None: no token asked for (the operator said --no-token)
    lease: float = 15.0           # seconds a worker's lease lasts without a renewal
    slots: int = 64               # a job's slot region unless its join asks for another
    wait: float = 120.0           # how long a join waits for the other ranks, at most
    trust_claimed_address: bool = False  # NAT: take the address a request claims
    max_joins: int = MAX_JOINS    # joins waiting at once; more are refused (RESOURCE_EXHAUSTED)
    key: bytes | None = None      # the job secrets' key (--key-file); None: this process's own
    metrics_job_names: bool = False  # publish job names on /metrics (they are credentials' cue)

    def __post_init__(self):
        positive_seconds(self.lease, "--lease")
        positive_seconds(self.wait, "--join-wait")
        if not 1 <= self.slots <= wire.SLOTS:
            raise ConfigError(f"--slots {self.slots}: 1 to {wire.SLOTS}")
        if self.max_joins < 1:
            raise ConfigError(f"--max-joins {self.max_joins}: at least 1")


@dataclass(frozen=True)
class Answer:
    """What a rank is told once its job is placed."""

    send_to: tuple[str, int]
    job_id: int
    worker: int
    workers: int
    slots: int
    place: str
    role: str
    run: int
    lease: float
    ip: str
    secret: str = ""
    key: int = 0      # the job's key (the auth word of its packets)
    # a job over a tree of switches (controller.treeplace): this worker's id in its switch's
    # job, that job's size, and the workers of that switch's parent (names); 0, 0, () for a
    # job on one switch, where ``worker`` and ``workers`` say it all
    leaf_worker: int = 0
    leaf_workers: int = 0
    siblings: tuple[str, ...] = ()


@dataclass
class Pending:
    """One attempt's join, while ranks arrive."""

    name: str
    world: int
    slots: int
    secret: str = field(default="", repr=False)  # the join secret its first rank gave
    ranks: dict[int, tuple[str, int]] = field(default_factory=dict)
    deadlines: dict[int, float] = field(default_factory=dict)  # rank -> when it stops waiting
    complete: bool = False        # every rank joined: one thread places it
    answers: dict[int, Answer] | None = None
    error: Refusal | None = None


@dataclass
class Held:
    """A job this service placed (or read back from a switch after a restart: no name)."""

    job_id: int
    name: str | None
    place: P.Place
    senders: tuple[tuple[str, int], ...]
    expires: list[float]
    slots: int
    run: int = 0
    left: set[int] = field(default_factory=set)
    checks_secret: bool = True    # False: read back without the key its secrets came from
    removing: str | None = None   # why a removal is under way (leases are no longer served)
    places: tuple[P.Place, ...] = ()  # a tree's: every place holding the job, the root first

    @property
    def everywhere(self) -> tuple[P.Place, ...]:
        """Every place that holds the job: its tree's switches, or its one place."""
        return self.places or (self.place,)


@dataclass
class Owed:
    """A removal not done everywhere yet (a switch down, or refusing): the job is no longer
    served (its name is free, its workers told why), but its id stays taken until every place
    that may still hold it is rid of it; the reaper tries again, backing off."""

    job_id: int
    text: str                     # the job as the log names it (``label``)
    why: str                      # why it was removed
    places: list[P.Place]         # where it may still be
    tries: int = 1
    retry_at: float = 0.0

    def backoff(self) -> float:
        """Seconds until the next try: 0.5 s doubling, at most 30 s."""
        return min(0.5 * 2 ** (self.tries - 1), 30.0)


def addr_text(a: tuple[str, int]) -> str:
    return f"{a[0]}:{a[1]}"


def label(h: Held) -> str:
    return f"job {h.job_id}" + (f" ({h.name})" if h.name else "")


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def peer_ip(peer: str) -> str:
    """The IP of a gRPC peer string: ``ipv4:10.0.0.1:5000``, ``ipv6:[::1]:5000`` (an
    IPv4-mapped IPv6 address is given as IPv4)."""
    peer = urllib.parse.unquote(peer)
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]")
        return host.removeprefix("::ffff:") if host.startswith("::ffff:") and "." in host \
            else host
    raise Refusal("INVALID_ARGUMENT", f"cannot tell a worker's address from {peer!r} "
                                      "(serve on TCP, not a unix socket)")

# -- the checks of a request's fields ------------------------------------------------------------

def check_join(opts: ServeOptions, name: str, rank: int, world: int, udp_port: int,
               slots: int, wait: float, secret: str = "",
               max_world: int = wire.MAX_WORKERS) -> tuple[int, float]:
    """A join's fields checked (a Refusal, INVALID_ARGUMENT, names the first that is wrong);
    the job's slots and the join's wait, defaults applied."""
    if not name or len(name) > 512 or not name.isprintable():
        raise Refusal("INVALID_ARGUMENT", "a job name is required (at most 512 printable "
                                          "characters)")
    if len(secret) < MIN_JOIN_SECRET or len(secret) > 512:
        raise Refusal("INVALID_ARGUMENT",
                      f"job {name!r}: a join secret of {MIN_JOIN_SECRET} to 512 characters is "
                      "required, the same on every rank of the job (torch.distributed's homagg "
                      "backend draws one and shares it through torchrun's store; otherwise set "
                      "HOMAGG_JOIN_SECRET alike for every rank)")
    plain = secret_too_plain(secret)
    if plain is not None:
        raise Refusal("INVALID_ARGUMENT", f"job {name!r}: {plain} (the same on every rank of "
                                          "the job)")
    if not 1 <= world <= max_world:
        raise Refusal("INVALID_ARGUMENT", f"job {name!r}: world size {world}: 1 to "
                                          f"{max_world} workers per job" + (
                                              "" if max_world == wire.MAX_WORKERS else
                                              f" on this tree of switches ({wire.MAX_WORKERS}"
                                              f" under each of its {max_world // 64} "
                                              "switches with hosts)"))
    if not 0 <= rank < world:
        raise Refusal("INVALID_ARGUMENT", f"job {name!r}: rank {rank} is out of range for "
                                          f"world size {world} (ranks 0 to {world - 1})")
    if not 1 <= udp_port <= 65535:
        raise Refusal("INVALID_ARGUMENT", f"job {name!r}: UDP port {udp_port}: 1 to 65535")
    slots = slots or opts.slots
    if not 1 <= slots <= wire.SLOTS:
        raise Refusal("INVALID_ARGUMENT", f"job {name!r}: {slots} slots: 1 to {wire.SLOTS}")
    if not math.isfinite(wait) or wait < 0:
        raise Refusal("INVALID_ARGUMENT", f"job {name!r}: wait_seconds {wait}: a finite "
                                          "number of seconds, at least 0 (0: the service's)")
    return slots, min(wait or opts.wait, opts.wait)


def check_attempt(p: Pending, rank: int, world: int, slots: int, secret: str,
                  me: tuple[str, int]) -> None:
    """A join (of ``rank`` from ``me``) checked against the attempt its job's earlier ranks
    started: the join secret first, so that nothing of the attempt is told to anyone else;
    then the world size, the slots, and the rank's place."""
    name = p.name
    if not hmac.compare_digest(p.secret.encode(), secret.encode()):
        raise Refusal("PERMISSION_DENIED",
                      f"job {name!r}: this join's secret is not the one the job's first rank "
                      "gave: another attempt, with a different join secret, holds this name "
                      "now (a competing join by the same name, e.g. a stale or foreign one; or "
                      "ranks of one attempt whose secrets differ: HOMAGG_JOIN_SECRET must be "
                      "alike on every rank); only a rank of that attempt joins it, and the "
                      "name is free again once it is placed or its ranks stop waiting")
    if p.world != world:
        raise Refusal("INVALID_ARGUMENT",
                      f"job {name!r}: rank {rank} joins with world size {world}, but "
                      f"{ranks_text(p.ranks)} joined with world size {p.world}")
    if p.slots != slots:
        raise Refusal("INVALID_ARGUMENT", f"job {name!r}: rank {rank} asks for {slots} slots, "
                                          f"but {ranks_text(p.ranks)} asked for {p.slots}")
    held = p.ranks.get(rank)
    if held is not None and held != me:
        raise Refusal("ALREADY_EXISTS", f"job {name!r}: rank {rank} is taken by "
                                        f"{addr_text(held)} (this join: {addr_text(me)})")
    twin = [r for r, a in p.ranks.items() if a == me and r != rank]
    if twin:
        raise Refusal("ALREADY_EXISTS", f"job {name!r}: {addr_text(me)} already joined as "
                                        f"rank {twin[0]} (this join: rank {rank})")


def worker_of(cfg: Config, ip: str, port: int) -> Worker:
    """The job's worker at (``ip``, ``port``): refused if results could not be sent there,
    and, on bmv2, unless the config knows the host (its switch port and MAC)."""
    try:
        addr = ipaddress.IPv4Address(ip)
    except ValueError:
        raise Refusal("INVALID_ARGUMENT", f"worker address {ip!r}: not an IPv4 address") \
            from None
    fb = P.fallback_place(cfg)
    own = {P.switch_place(cfg).ip} | ({fb.ip} if fb else set()) | {s.ip for s in cfg.switches}
    if addr.is_unspecified or addr.is_multicast or \
            addr == ipaddress.IPv4Address("255.255.255.255") or ip in own:
        raise Refusal("INVALID_ARGUMENT", f"worker address {ip}: not a worker's (the "
                                          "unspecified, broadcast or multicast address, or "
                                          "the switch's own)")
    if cfg.switches:  # a tree: the switch it sits under, for now (its entry: treeplace)
        if Tree.of(cfg.switch.name, cfg.switch.under, cfg.switches).switch_of(ip) is None:
            raise Refusal("INVALID_ARGUMENT", f"worker address {ip} sits under no switch of "
                                              "the tree (the config's [switch] and "
                                              "[[switches]] 'under')")
        return Worker(ip, port, NO_MAC, 0)
    for h in cfg.hosts:
        if h.ip == ip:
            return Worker(ip, port, h.mac, h.port, h.name)
    if cfg.switch.target == "soft":  # it answers by address: no port or MAC needed
        return Worker(ip, port, NO_MAC, 0)
    raise Refusal("INVALID_ARGUMENT",
                  f"{ip} is not one of the config's hosts: the switch ({cfg.switch.name},"
                  f" bmv2) needs each worker's switch port and MAC ([[hosts]])")


def check_token(opts: ServeOptions, token: str) -> None:
    want = opts.token
    if want is not None and not hmac.compare_digest(token.encode(), want.encode()):
        raise Refusal("UNAUTHENTICATED", "wrong token (HOMAGG_TOKEN must be the one "
                                         "homagg-ctl serve was given)")


def address_of(opts: ServeOptions, peer: str, claimed: str) -> str:
    """The worker's address: the one gRPC sees (``peer``); a claimed one only with
    ``trust_claimed_address`` (NAT), else it must match."""
    seen = peer_ip(peer)
    if not claimed or claimed == seen:
        return seen
    if opts.trust_claimed_address:
        try:
            ipaddress.IPv4Address(claimed)
        except ValueError:
            raise Refusal("INVALID_ARGUMENT", f"the claimed worker address {claimed!r} is "
                                              "not an IPv4 address") from None
        return claimed
    raise Refusal("PERMISSION_DENIED", f"a worker registers only the address it speaks "
                                       f"from: it claims {claimed!r}, and speaks from {seen}")

# -- what the service writes to, and reads from, a switch -----------------------------------------

def read_jobs_mark(sw: Switch) -> int:
    """The bitmask of the jobs the service placed on ``sw`` (``SERVICE_JOBS_CELL``)."""
    cell = sw.read_counter(P4.COUNTER_STATS).get(SERVICE_JOBS_CELL, CounterValue())
    return cell.packets | cell.bytes << _MASK_BITS


def write_jobs_mark(sw: Switch, mask: int) -> None:
    low = (1 << _MASK_BITS) - 1
    sw.write_counter(P4.COUNTER_STATS,
                     {SERVICE_JOBS_CELL: CounterValue(mask & low, mask >> _MASK_BITS)})


def mark_job(sw: Switch, job_id: int, on: bool) -> None:
    """Set (``on``) or clear job ``job_id``'s bit of the mark on ``sw``."""
    mask = read_jobs_mark(sw)
    if bool(mask >> job_id & 1) != on:
        write_jobs_mark(sw, mask ^ 1 << job_id)


def job_secret(key: bytes, job_id: int, worker: int, sender: tuple[str, int]) -> str:
    """A worker's secret for its job: what Renew and Leave must present."""
    msg = f"homagg job secret/{job_id}/{worker}/{sender[0]}:{sender[1]}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()[:32]


def is_worker(key: bytes, senders: tuple[tuple[str, int], ...], checks_secret: bool,
              job_id: int, worker: int, sender: tuple[str, int], secret: str) -> bool:
    """Whether a lease request comes from ``worker`` of the job, with its secret."""
    if not 0 <= worker < len(senders) or senders[worker] != sender:
        return False
    return not checks_secret or hmac.compare_digest(
        secret.encode(), job_secret(key, job_id, worker, sender).encode())


def not_yours(job_id: int, worker: int, ip: str, udp_port: int) -> Refusal:
    """The one refusal of a lease request that did not prove it is the job's worker: the
    same for a job id nobody holds, another worker's address and a wrong secret, so that
    Renew cannot list the jobs held, nor their workers' ports."""
    return Refusal("PERMISSION_DENIED",
                   f"job {job_id} worker {worker} at {ip}:{udp_port}: no lease of this service "
                   "with this secret (only a job's own workers, from the address and with the "
                   "secret their join returned, renew or leave it; a job that is gone, or "
                   "never was, is refused alike)")


def free_text(f: P.Fabric) -> str:
    """What each place has free, for a refusal's message."""
    jobs = f.list()
    used = {pl.name: sum(pj.job.size for pj in jobs if pj.place == pl) for pl in f.places()}
    return "; ".join(f"{pl.name} ({pl.role}) has {pl.pool - used[pl.name]} of {pl.pool} "
                     "slots free" for pl in f.places())


def undo_placement(f: P.Fabric, job_id: int) -> None:
    """Remove what a failed placement wrote (best effort: it is logged if it cannot)."""
    try:
        f.remove(job_id)
    except (HomaggError, JobError) as e:
        log.warning("job %d: undoing a failed placement: %s", job_id, e)
