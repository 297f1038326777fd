"""homagg-ctl: the operator's CLI over P4Runtime.

    homagg-ctl build [--words K]                  compile p4/ (p4c-bm2-ss); K words per packet
    homagg-ctl build --target tofino [--json]     compile p4/tofino (bf-p4c); its resources
    homagg-ctl build --target tofino --testgen N  tests from p4testgen, through the model
    homagg-ctl -c net.toml install                load the pipeline, base forwarding, the jobs
    homagg-ctl -c net.toml job add 1              install job 1 from the config
    homagg-ctl -c net.toml job add 2 --slots 32 --worker h1:50001 --worker h2:50001
    homagg-ctl -c net.toml job add 3 --place fallback   (auto: the switch, else the fallback)
    homagg-ctl -c net.toml job list [--json]
    homagg-ctl -c net.toml job remove 1
    homagg-ctl -c net.toml stats [--json]
    homagg-ctl -c net.toml reset 1                new epoch, zeroed counters (and registers)
    homagg-ctl -c net.toml serve --token-file T   workers join by themselves (gRPC; see serve.py)

The same commands drive bmv2 and the software aggregator (``homagg-softswitch``, which serves
P4Runtime): the config's ``[switch] target`` says which. On "soft", install needs no p4c: it
loads homagg's pipeline by its P4Info alone (shipped in the package; the aggregator checks it
and starts afresh, as bmv2 does on a new pipeline), and reset leaves registers to the epoch.

With a ``[fallback]`` in the config (a software aggregator), a job the switch has no free slot
region for is placed there instead, and said so; ``job list`` shows where each job lives and
where its agents send, ``stats`` covers both, and remove and reset find the job where it is.

Every P4Runtime request goes to a log (``--request-log``, default
<state dir>/logs/<switch>-p4runtime.log).
Errors are one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import secrets
import sys
import tempfile
from pathlib import Path

from homagg import paths, wire
from homagg.controller import jobs as J
from homagg.controller import placement as P
from homagg.controller.build import DEFAULT_OUT, Pipeline, build, soft_pipeline
from homagg.controller.p4client import P4RuntimeSwitch, SwitchError
from homagg.errors import HomaggError
from homagg.netconfig import (
    PLACES,
    TARGETS,
    Config,
    ConfigError,
    SwitchSpec,
    Worker,
    load,
    validate_job,
)
from homagg.programs import PROGRAMS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="homagg-ctl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", type=Path, help="TOML file: switch, hosts, jobs")
    p.add_argument("--grpc", help="P4Runtime address (overrides the config)")
    p.add_argument("--device-id", type=int, help="P4Runtime device id (overrides the config)")
    p.add_argument("--target", choices=TARGETS,
                   help="what runs the switch (overrides the config's; default bmv2)")
    p.add_argument("--election-id", default="0,1", help="high,low (default 0,1)")
    p.add_argument("--request-log", type=Path, help="file that logs every P4Runtime request")
    p.add_argument("--build-dir", type=Path, default=DEFAULT_OUT, help="compiled pipeline")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="compile the P4 program")
    b.add_argument("--force", action="store_true")
    b.add_argument("--words", type=int, metavar="K",
                   help="words per packet: 64, 128, 192, 256 (default) or 320; 64 as on "
                        "Tofino and in SwitchML. Agents learn it from the switch")
    b.add_argument("--target", dest="build_target", default="bmv2",
                   choices=("bmv2", "tofino", "tofino2"),
                   help="bmv2 (default: p4/homagg.p4 with p4c-bm2-ss), or tofino / tofino2 "
                        "(p4/tofino/homagg_tna.p4 with bf-p4c, then its resource table)")
    b.add_argument("--json", action="store_true", help="tofino: the resource table as JSON")
    b.add_argument("--testgen", type=int, metavar="N",
                   help="tofino: instead of compiling, generate at most N tests from the TNA "
                        "program (p4testgen) and replay each through the switch model")
    b.add_argument("--seed", type=int, default=1, help="--testgen: p4testgen's seed")

    i = sub.add_parser("install", help="push pipeline, base forwarding and the config's jobs")
    i.add_argument("--no-jobs", action="store_true", help="do not install the config's jobs")
    i.add_argument("--words", type=int, metavar="K", help="bmv2: the build for K words per packet")

    job = sub.add_parser("job", help="add, list or remove jobs").add_subparsers(dest="job_cmd",
                                                                             required=True)
    ja = job.add_parser("add", help="install a job (from the config, or --worker ...)")
    ja.add_argument("id", type=int)
    ja.add_argument("--slots", type=int, help="slot region size")
    ja.add_argument("--worker", action="append", default=[], metavar="HOST[:UDP_PORT]",
                    help="a worker: a host of the config and its UDP port (default "
                         f"{wire.DEFAULT_AGENT_PORT})")
    ja.add_argument("--place", choices=PLACES,
                    help="auto (default): the switch while its slots last, else the config's "
                         "[fallback]; switch; fallback")
    ja.add_argument("--key", type=lambda s: int(s, 0), metavar="N",
                    help="the job's key, 1 to 2**32 - 1 (default: the config's; with --worker, "
                         "one drawn at random and printed once): its agents need it too "
                         "(HOMAGG_JOB_KEY)")
    jl = job.add_parser("list", help="jobs installed on the switch (and the fallback)")
    jl.add_argument("--json", action="store_true")
    jr = job.add_parser("remove", help="remove a job")
    jr.add_argument("id", type=int)

    s = sub.add_parser("stats", help="counters per drop reason and per job")
    s.add_argument("--json", action="store_true")

    r = sub.add_parser("reset", help="start a job afresh: new epoch, zeroed counters")
    r.add_argument("id", type=int)

    sv = sub.add_parser("serve", help="the controller as a service: workers join by themselves "
                                      "(gRPC), hold leases, and are counted (Prometheus)")
    sv.add_argument("--listen", default="127.0.0.1:9600", metavar="HOST:PORT",
                    help="gRPC address (default %(default)s: this host only; workers on other "
                         "hosts need an address of theirs, best with --tls-cert; port 0: any, "
                         "printed)")
    sv.add_argument("--token-file", type=Path, help="the workers' shared token (first line); "
                                                     "default: $HOMAGG_TOKEN")
    sv.add_argument("--no-token", action="store_true", help="serve without a token (explicitly)")
    sv.add_argument("--tls-cert", type=Path, help="PEM certificate: serve gRPC over TLS")
    sv.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    sv.add_argument("--metrics-port", type=int, help="Prometheus metrics on this port (0: any)")
    sv.add_argument("--metrics-addr", default=None, help="metrics address (default: the "
                                                         "--listen address's)")
    sv.add_argument("--metrics-job-names", action="store_true",
                    help="label the metrics with job names too (off: ids only; a name is what "
                         "a join asks for)")
    sv.add_argument("--lease", type=float, default=15.0, metavar="SECONDS",
                    help="a worker's lease; a job with a worker that stops renewing it is "
                         "removed (default %(default)s)")
    sv.add_argument("--slots", type=int, default=64,
                    help="a job's slot region unless its workers ask (default %(default)s)")
    sv.add_argument("--join-wait", type=float, default=120.0, metavar="SECONDS",
                    help="the longest a join waits for the job's other ranks (default "
                         "%(default)s)")
    sv.add_argument("--max-joins", type=int, default=1024, metavar="N",
                    help="joins waiting at once, at most; more are refused until some are "
                         "answered (default %(default)s)")
    sv.add_argument("--key-file", type=Path, metavar="FILE",
                    help="the key of the jobs' secrets (created, 0600, if missing): with it, a "
                         "restarted service checks the secrets of the jobs it reads back")
    sv.add_argument("--trust-worker-address", action="store_true",
                    help="NAT: register the address a worker claims, not the one it speaks "
                         "from (off: a worker registers only its own)")
    sv.add_argument("--service-election-id", default="0,2", metavar="HIGH,LOW",
                    help="the service's P4Runtime election id (default %(default)s: above the "
                         "CLI's, so a join's write wins a race with a CLI command)")
    return p


def _switch_spec(a, cfg: Config | None) -> SwitchSpec:
    spec = cfg.switch if cfg else SwitchSpec()
    return dataclasses.replace(spec, grpc=a.grpc or spec.grpc,
                               device_id=a.device_id if a.device_id is not None
                               else spec.device_id, target=a.target or spec.target)


def _connect(a, place: P.Place, pipeline: Pipeline | None = None) -> P4RuntimeSwitch:
    name = place.name
    try:
        high, low = (int(x) for x in a.election_id.split(","))
    except ValueError:
        raise ConfigError(f"--election-id {a.election_id!r}: expected HIGH,LOW") from None
    logf = paths.log_dir(f"{name}-p4runtime.log")
    if a.request_log:  # the switch's log where asked; the fallback's next to it
        logf = a.request_log if place.role == "switch" else \
            a.request_log.with_name(f"{name}-p4runtime.log")
    logf.parent.mkdir(parents=True, exist_ok=True)
    return P4RuntimeSwitch(place.grpc, place.device_id, (high, low), logf, name,
                           place.tls, PROGRAMS[place.target]).open(pipeline)


def _need_config(a) -> Config:
    if not a.config:
        raise ConfigError("this command needs --config FILE (see docs/controller.md)")
    return load(a.config)


def _job_spec(a, cfg: Config):
    """The job ``job add`` installs, and whether its key was drawn here (then printed)."""
    if a.key is not None and not 1 <= a.key <= 2**32 - 1:
        raise ConfigError(f"--key {a.key}: 1 to 2**32 - 1 (0 is no key: any sender that "
                          "guesses it would pass for the job's worker; leave --key out to have "
                          "one drawn)")
    if not a.worker:
        spec = cfg.job(a.id)
        if a.slots or a.place or a.key is not None:
            spec = dataclasses.replace(
                validate_job(spec.id, list(spec.workers), a.slots or spec.slots,
                             a.place or spec.place, spec.key if a.key is None else a.key),
                uplink=spec.uplink)
        return spec, False
    workers = []
    for w in a.worker:
        name, _, port = w.partition(":")
        h = cfg.host(name)
        try:
            udp = int(port) if port else wire.DEFAULT_AGENT_PORT
        except ValueError:
            raise ConfigError(f"--worker {w!r}: port must be an integer") from None
        workers.append(Worker(h.ip, udp, h.mac, h.port, h.name))
    drawn = a.key is None
    key = secrets.randbits(32) or 1 if drawn else a.key
    return validate_job(a.id, workers, a.slots or 64, a.place or "auto", key), drawn


def _added(pj: P.PlacedJob) -> str:
    j = pj.job
    text = (f"job {j.id}: {j.workers} workers, slots {j.base}-{j.base + j.size - 1}, "
            f"epoch {j.epoch}, group {j.group}")
    if pj.place.role == "fallback":
        text += f"; on {pj.place.describe()}: {pj.why}; agents send to {pj.place.address}"
    return text


def _table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*(str(x) for x in r)) for r in rows]
    return "\n".join(lines)


def _place_label(pj: P.PlacedJob) -> str:
    return pj.place.name + ("" if pj.place.role == "switch" else " (fallback)")


def _print_stats(fabric: P.Fabric, as_json: bool) -> None:
    stats = fabric.stats()
    if as_json:
        if len(fabric.places()) == 1:
            print(json.dumps(stats[fabric.switch.name][1].to_json(), indent=2))
        else:
            print(json.dumps({name: {"role": p.role, "target": p.target, **st.to_json()}
                              for name, (p, st) in stats.items()}
                             | {name: {"unreachable": why}
                                for name, why in fabric.unreachable.items()}, indent=2))
        return
    several = len(fabric.places()) > 1
    for k, (place, st) in enumerate(stats.values()):
        if several:
            print(("\n" if k else "") + f"== {place.role} {place.describe()}")
        print(_table([[k, v] for k, v in st.switch.items()]
                     + [[k, v] for k, v in st.forwarding.items()], ["counter", "packets"]))
        if st.jobs:
            print()
            names = list(wire.JOB_STATS.values())
            print(_table([[j] + [c.packets(n) for n in names] for j, c in st.jobs.items()],
                         ["job"] + [n.replace("JOB_STAT_", "").lower() for n in names]))
    for name, why in fabric.unreachable.items():
        print(f"\n== fallback {name}: unreachable ({why})")


def run(a) -> int:
    if a.cmd == "build" and a.build_target != "bmv2":
        from homagg.controller import build_tofino

        words = build_tofino.WORDS_BY_TARGET[a.build_target]
        if a.words not in (None, words):
            raise ConfigError(f"--words {a.words}: the TNA program adds {words} values per "
                              f"pass on {a.build_target}")
        if a.testgen is not None:
            from homagg.controller import tna_testgen

            summary = tna_testgen.run(a.testgen, a.seed, a.build_target)
            print(summary.render())
            return 0 if summary.count("disagreed") == 0 else 1
        out, table = build_tofino.build(a.build_target)
        if a.json:
            print(json.dumps(table.to_json(), indent=2))
        else:
            print(f"built {out} (context, bfrt.json, P4Info)\n{table.render()}")
        return 0
    if a.cmd == "build":
        p = build(a.build_dir, a.force, words=a.words)
        print(f"built {p.bmv2_json} and {p.p4info} ({p.words()} words per packet)")
        return 0

    if a.cmd == "serve":
        from homagg.controller import serve

        cfg = load(a.config) if a.config else Config(SwitchSpec())
        cfg = dataclasses.replace(cfg, switch=_switch_spec(a, cfg))
        if cfg.switch.target == "tofino":
            raise ConfigError("serve places jobs on bmv2 and the software aggregator; on a "
                              "Tofino switch, install jobs with homagg-ctl job add "
                              "(docs/deploy.md, 'Tofino')")
        a.election_id = a.service_election_id
        return serve.run(a, cfg, lambda place: _connect(a, place))

    install = a.cmd == "install"
    cfg = _need_config(a) if install else load(a.config) if a.config else Config(SwitchSpec())
    cfg = dataclasses.replace(cfg, switch=_switch_spec(a, cfg))
    with contextlib.ExitStack() as stack:
        pipelines: dict[str, Pipeline] = {}
        if install:  # a fresh pipeline on every place: bmv2's compiled one, or homagg's P4Info
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="homagg-soft-"))
            soft = soft_pipeline(Path(tmp))
            pipelines = {"fallback": soft}
            if cfg.switch.target == "soft":
                pipelines["switch"] = soft
            elif cfg.switch.target == "bmv2":
                pipelines["switch"] = build(a.build_dir, words=a.words)
            # (tofino: bf_switchd loads the compiled program; install checks its P4Info)

        def connect(place: P.Place) -> P4RuntimeSwitch:
            # install's fresh pipeline goes to [switch] and the fallback, never to a tree's
            # other switches (a pipeline load empties a switch: their running jobs would go)
            fresh = place.role == "fallback" or place.name == cfg.switch.name
            return _connect(a, place, pipelines.get(place.role) if fresh else None)

        fabric = stack.enter_context(P.Fabric(cfg, connect))
        if install:
            J.install_base(fabric.session(fabric.switch), cfg)
            print(f"pipeline installed on {cfg.switch.name} ({cfg.switch.grpc}); "
                  f"{len(cfg.hosts)} hosts routed")
            if fabric.fallback is not None and cfg.fallback is not None:
                fabric.install_fallback_base()
                print(f"fallback {fabric.fallback.describe()} installed ({cfg.fallback.grpc})")
            if not a.no_jobs:
                for job in cfg.jobs:
                    print(_added(fabric.add(job)))
        elif a.cmd == "job" and a.job_cmd == "add":
            spec, drawn = _job_spec(a, _need_config(a))
            print(_added(fabric.add(spec)))
            if drawn:  # said once: the switch never tells it again
                print(f"job {spec.id}: key {spec.key:#010x}, drawn at random: give its agents "
                      f"HOMAGG_JOB_KEY={spec.key:#010x}")
        elif a.cmd == "job" and a.job_cmd == "list":
            placed = fabric.list()
            several = len(fabric.places()) > 1
            if a.json:
                print(json.dumps([pj.to_json() for pj in placed], indent=2))
            elif not placed:
                print("no jobs installed")
            else:
                print(_table([[pj.job.id] + ([_place_label(pj), pj.place.ip] if several else [])
                              + [pj.job.workers, f"{pj.job.base}-{pj.job.base + pj.job.size - 1}",
                                 pj.job.epoch, pj.job.group,
                                 " ".join(f"{s.ip}:{s.udp_port}" for s in pj.job.senders)]
                              for pj in placed],
                             ["job"] + (["on", "send to"] if several else [])
                             + ["workers", "slots", "epoch", "group", "senders"]))
            for name, why in fabric.unreachable.items():
                print(f"homagg-ctl: warning: fallback {name} unreachable, its jobs not shown: "
                      f"{why}", file=sys.stderr)
        elif a.cmd == "job" and a.job_cmd == "remove":
            pj = fabric.remove(a.id)
            j = pj.job
            print(f"job {j.id} removed (slots {j.base}-{j.base + j.size - 1} free"
                  + ("" if pj.place.role == "switch" else f" on {pj.place.name}") + ")")
        elif a.cmd == "stats":
            _print_stats(fabric, a.json)
        elif a.cmd == "reset":
            res, place = fabric.reset(a.id)
            print(f"job {res.job} reset: epoch {res.epoch}, counters zeroed, registers "
                  f"{res.registers}" + ("" if place.role == "switch" else f" (on {place.name})"))
    return 0


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(a)
    except SwitchError as e:  # P4Runtime's per-update errors come on several lines
        print(f"homagg-ctl: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except HomaggError as e:
        print(f"homagg-ctl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
