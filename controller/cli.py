"""homagg-ctl: the operator's CLI over P4Runtime.

    homagg-ctl build                              compile p4/ (p4c-bm2-ss)
    homagg-ctl -c net.toml install                load the pipeline, base forwarding, the jobs
    homagg-ctl -c net.toml job add 1              install job 1 from the config
    homagg-ctl -c net.toml job add 2 --slots 32 --worker h1:50001 --worker h2:50001
    homagg-ctl -c net.toml job list [--json]
    homagg-ctl -c net.toml job remove 1
    homagg-ctl -c net.toml stats [--json]
    homagg-ctl -c net.toml reset 1                new epoch, zeroed counters (and registers)

The same commands drive bmv2 and the software aggregator (``homagg-softswitch``, which serves
P4Runtime): the config's ``[switch] target`` says which. On "soft", install needs no p4c: it
loads homagg's pipeline by its P4Info alone (shipped in the package; the aggregator checks it
and starts afresh, as bmv2 does on a new pipeline), and reset leaves registers to the epoch.

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
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from homagg import paths, wire
from homagg.controller import jobs as J
from homagg.controller.build import DEFAULT_OUT, Pipeline, build
from homagg.controller.p4client import P4RuntimeSwitch, SwitchError
from homagg.errors import HomaggError
from homagg.netconfig import (
    TARGETS,
    Config,
    ConfigError,
    SwitchSpec,
    Worker,
    load,
    validate_job,
)


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

    i = sub.add_parser("install", help="push pipeline, base forwarding and the config's jobs")
    i.add_argument("--no-jobs", action="store_true", help="do not install the config's jobs")

    job = sub.add_parser("job", help="add, list or remove jobs").add_subparsers(dest="job_cmd",
                                                                             required=True)
    ja = job.add_parser("add", help="install a job (from the config, or --worker ...)")
    ja.add_argument("id", type=int)
    ja.add_argument("--slots", type=int, help="slot region size")
    ja.add_argument("--worker", action="append", default=[], metavar="HOST[:UDP_PORT]",
                    help="a worker: a host of the config and its UDP port (default "
                         f"{wire.DEFAULT_AGENT_PORT})")
    jl = job.add_parser("list", help="jobs installed on the switch")
    jl.add_argument("--json", action="store_true")
    jr = job.add_parser("remove", help="remove a job")
    jr.add_argument("id", type=int)

    s = sub.add_parser("stats", help="counters per drop reason and per job")
    s.add_argument("--json", action="store_true")

    r = sub.add_parser("reset", help="start a job afresh: new epoch, zeroed counters")
    r.add_argument("id", type=int)
    return p


def _switch_spec(a, cfg: Config | None) -> SwitchSpec:
    spec = cfg.switch if cfg else SwitchSpec()
    return dataclasses.replace(spec, grpc=a.grpc or spec.grpc,
                               device_id=a.device_id if a.device_id is not None
                               else spec.device_id, target=a.target or spec.target)


#: What reset says of registers on the software aggregator.
SOFT_REGISTERS = "skipped (software aggregator: the new epoch empties the region)"


@contextlib.contextmanager
def _soft_pipeline() -> Iterator[Pipeline]:
    """homagg's pipeline for the software aggregator: the P4Info shipped in the package and no
    device config (it runs the pipeline natively). No p4c needed."""
    from homagg.targets.soft import P4INFO_FILE

    if not P4INFO_FILE.is_file():
        raise SwitchError(f"homagg's P4Info is missing ({P4INFO_FILE}); reinstall homagg")
    with tempfile.TemporaryDirectory(prefix="homagg-soft-") as d:
        none = Path(d) / "no-device-config"
        none.write_bytes(b"")
        yield Pipeline(none, P4INFO_FILE)


def _connect(a, cfg: Config | None, pipeline: Pipeline | None = None) -> P4RuntimeSwitch:
    spec = _switch_spec(a, cfg)
    try:
        high, low = (int(x) for x in a.election_id.split(","))
    except ValueError:
        raise ConfigError(f"--election-id {a.election_id!r}: expected HIGH,LOW") from None
    logf = a.request_log or paths.log_dir(f"{spec.name}-p4runtime.log")
    logf.parent.mkdir(parents=True, exist_ok=True)
    return P4RuntimeSwitch(spec.grpc, spec.device_id, (high, low), logf, spec.name).open(pipeline)


def _need_config(a) -> Config:
    if not a.config:
        raise ConfigError("this command needs --config FILE (see controller/config.py)")
    return load(a.config)


def _job_spec(a, cfg: Config):
    if not a.worker:
        spec = cfg.job(a.id)
        if a.slots:
            spec = validate_job(spec.id, list(spec.workers), a.slots)
        return spec
    workers = []
    for w in a.worker:
        name, _, port = w.partition(":")
        h = cfg.host(name)
        try:
            udp = int(port) if port else wire.DEFAULT_AGENT_PORT
        except ValueError:
            raise ConfigError(f"--worker {w!r}: port must be an integer") from None
        workers.append(Worker(h.ip, udp, h.mac, h.port, h.name))
    return validate_job(a.id, workers, a.slots or 64)


def _added(j: J.InstalledJob) -> str:
    return (f"job {j.id}: {j.workers} workers, slots {j.base}-{j.base + j.size - 1}, "
            f"epoch {j.epoch}, group {j.group}")


def _table(rows: list[list], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*(str(x) for x in r)) for r in rows]
    return "\n".join(lines)


def run(a) -> int:
    if a.cmd == "build":
        p = build(a.build_dir, a.force)
        print(f"built {p.bmv2_json} and {p.p4info}")
        return 0

    cfg = load(a.config) if a.config else None
    if a.cmd == "install":
        cfg = _need_config(a)
        if _switch_spec(a, cfg).target == "soft":
            with _soft_pipeline() as pipeline:
                sw = _connect(a, cfg, pipeline)
        else:
            sw = _connect(a, cfg, build(a.build_dir))
        with sw:
            J.install_base(sw, cfg)
            print(f"pipeline installed on {cfg.switch.name} ({cfg.switch.grpc}); "
                  f"{len(cfg.hosts)} hosts routed")
            if not a.no_jobs:
                for job in cfg.jobs:
                    j = J.add_job(sw, job)
                    print(_added(j))
        return 0

    with _connect(a, cfg) as sw:
        if a.cmd == "job" and a.job_cmd == "add":
            spec = _job_spec(a, _need_config(a))
            print(_added(J.add_job(sw, spec)))
        elif a.cmd == "job" and a.job_cmd == "list":
            installed = J.list_jobs(sw)
            if a.json:
                print(json.dumps([j.to_json() for j in installed], indent=2))
            elif not installed:
                print("no jobs installed")
            else:
                print(_table([[j.id, j.workers, f"{j.base}-{j.base + j.size - 1}", j.epoch,
                               j.group, " ".join(f"{s.ip}:{s.udp_port}" for s in j.senders)]
                              for j in installed],
                             ["job", "workers", "slots", "epoch", "group", "senders"]))
        elif a.cmd == "job" and a.job_cmd == "remove":
            j = J.remove_job(sw, a.id)
            print(f"job {j.id} removed (slots {j.base}-{j.base + j.size - 1} free)")
        elif a.cmd == "stats":
            st = J.read_stats(sw)
            if a.json:
                print(json.dumps(st.to_json(), indent=2))
            else:
                print(_table([[k, v] for k, v in st.switch.items()]
                             + [[k, v] for k, v in st.forwarding.items()],
                             ["counter", "packets"]))
                if st.jobs:
                    print()
                    names = list(wire.JOB_STATS.values())
                    print(_table([[j] + [c.packets(n) for n in names]
                                  for j, c in st.jobs.items()],
                                 ["job"] + [n.replace("JOB_STAT_", "").lower() for n in names]))
        elif a.cmd == "reset":
            spec = _switch_spec(a, cfg)
            if spec.target == "soft":
                res = dataclasses.replace(J.reset_job(sw, a.id, None), registers=SOFT_REGISTERS)
            else:
                res = J.reset_job(sw, a.id, spec.thrift_port)
            print(f"job {res.job} reset: epoch {res.epoch}, counters zeroed, registers "
                  f"{res.registers}")
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
