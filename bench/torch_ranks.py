"""Torch ranks on the ``homagg`` backend, as the benches and the tests run them:

* ``run_job``: ``fn(rank, world, gloo_group, *args)`` in ``world`` processes whose default
  group is "homagg", over a software aggregator in this process (a job of its own, agents on
  loopback addresses of their own), and what each rank returned;
* ``launch``, ``two_nodes``: ``examples/ddp_train.py`` under ``homagg-net local``, as a user
  runs it (one torchrun node, or two of 2 ranks each), and the output's figures (``losses``,
  ``digests``, ``packets``, ``rounds``, ``accepted``);
* ``make_model``, ``batch``, ``loss_of``: a small embedding model and its data, seeded per
  (rank, step).

A run that fails raises ``RuntimeError`` with its output's tail.
"""

from __future__ import annotations

import gc
import itertools
import os
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from homagg import wire
from homagg.controller.local import install
from homagg.targets.soft import SoftSwitch, SoftSwitchServer

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
#: ``examples/ddp_train.py``'s steps in ``torchrun`` and ``two_nodes``
STEPS = 8
AGENT_PORT = 20_000  # below /proc/sys/net/ipv4/ip_local_port_range
# Agents' addresses: 127.(128 + pid % 64).x.y, apart from tests.staging's 127.(64..127).x.y,
# so ranks started here never meet the tests' own agents in one session
_subnet = 128 + os.getpid() % 64
_agents = itertools.count(1)
_switch_hosts = itertools.count(1)


def agent_addresses(n: int) -> list[tuple[str, int]]:
    """``n`` fresh (ip, port) pairs for agents, distinct within this process."""
    out = []
    for _ in range(n):
        k = next(_agents)
        if k >= 254 * 256:
            raise RuntimeError("bench.torch_ranks: out of agent addresses")
        out.append((f"127.{_subnet}.{k // 254}.{1 + k % 254}", AGENT_PORT))
    return out


def switch_address() -> tuple[str, int]:
    """A software aggregator's address of its own (127.0.9.X) for each job."""
    return f"127.0.9.{next(_switch_hosts)}", wire.HOMAGG_UDP_PORT_MIN


def run_job(fn, tmp_path, job: int, *args, options=None, env=None, world: int = WORLD,
            table_job: int | None = None, backend: str = "homagg", tables=None):
    """``fn(rank, world, gloo_group, *args)`` on ``world`` processes whose default group is
    "homagg" (a soft aggregator with job ``job``; ``options``: AgentConfig fields, ``env``:
    more environment; ``table_job``: the job the aggregator knows instead; ``backend``: the
    name given to init_process_group; ``tables``: more jobs for the aggregator, job ->
    addresses); what each returns, by rank, and whether the group
    closed its agent and thread at destroy_process_group."""
    switch = switch_address()
    addrs = agent_addresses(world)
    server = SoftSwitchServer(SoftSwitch(), switch).start()
    install(server.switch, job if table_job is None else table_job, addrs, 16)
    for other, other_addrs in (tables or {}).items():
        install(server.switch, other, other_addrs, 16)
    try:
        mp.spawn(_entry, args=(fn, world, addrs, switch, job, str(tmp_path), options or {},
                               env or {}, backend, args), nprocs=world, join=True)
    finally:
        server.stop()
    ranks = [torch.load(Path(tmp_path) / f"rank{r}.pt", weights_only=False)
             for r in range(world)]
    for r in range(world):
        ranks[r]["closed"] = (Path(tmp_path) / f"closed{r}").read_text()
    return ranks


def _entry(rank, fn, world, addrs, switch, job, out_dir, options, env, backend, args):
    import homagg.torch

    homagg.torch.set_agent_options(**{"timeout": 0.01, "deadline": 30, **options})
    os.environ.update(HOMAGG_JOB=str(job), HOMAGG_SWITCH=f"{switch[0]}:{switch[1]}",
                      HOMAGG_BIND=f"{addrs[rank][0]}:{addrs[rank][1]}", HOMAGG_SLOTS="16",
                      **env)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group(backend, init_method=f"file://{out_dir}/store", rank=rank,
                                world_size=world)
        ref = dist.new_group(backend="gloo")
        out = fn(rank, world, ref, *args)
    said = [str(w.message) for w in caught if str(w.message).startswith("homagg:")]
    pg = dist.group.WORLD
    torch.save({"out": out, "warnings": said, "counts": dict(pg.counts),
                "cpp backend": pg.cpp_collectives},
               f"{out_dir}/rank{rank}.pt")
    gc.collect()  # no DDP/FSDP module alive when the groups go (an abort at exit otherwise)
    dist.destroy_process_group()
    with open(f"{out_dir}/closed{rank}", "w") as f:  # destroy shut the group down
        f.write(f"thread {pg._thread is None}, socket {pg.agent.sock.fileno() == -1}")


def make_model(sparse: bool = False):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.EmbeddingBag(300, 8, mode="mean", sparse=sparse),
                               torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, 300, (32, 4), generator=g)
    return idx, (idx.float().mean(1, keepdim=True) / 300 > 0.5).float()


def loss_of(model, rank, step):
    idx, y = batch(rank, step)
    return torch.nn.functional.binary_cross_entropy_with_logits(model(idx), y)


# -- examples/ddp_train.py under homagg-net local ----------------------------------------------

def clean_env() -> dict[str, str]:
    """This process's environment without any homagg or torch.distributed setting: the
    launcher and torchrun must provide them all. PYTHONPATH: this checkout's homagg."""
    drop = ("HOMAGG_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC_",
            "GROUP_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = str(ROOT)
    return env


def torchrun(*args: str) -> list[str]:
    # --standalone: a c10d rendezvous on a port the kernel gives; distinct per run
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "4", str(ROOT / "examples" / "ddp_train.py"), "--steps", str(STEPS), *args]


# The ranks share one pipe, and print() writes a line's text and its newline apart: another
# rank's line may come between the two. Hence no anchors, and exact token shapes.
def losses(out: str) -> list[float]:
    by_step = {int(k): float(v) for k, v in re.findall(r"step +(\d+) loss (\d+\.\d{9})", out)}
    return [by_step[k] for k in sorted(by_step)]


def digests(out: str) -> dict[int, str]:
    return {int(r): d for r, d in re.findall(r"rank (\d): parameters ([0-9a-f]{16})", out)}


def packets(out: str) -> dict[int, int]:
    return {int(r): int(n) for r, n in re.findall(r"rank (\d): homagg sent (\d+) packets", out)}


def rounds(out: str) -> dict[int, int]:
    return {int(r): int(n) for r, n in re.findall(
        r"rank (\d): homagg sent \d+ packets \(\d+ B\), \d+ retransmitted, (\d+) rounds", out)}


STATS = f"{sys.executable} -m homagg.controller.cli -c \"$HOMAGG_CTL_CONFIG\" stats"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(tmp, tag: str, *args: str) -> str:
    """Two torchrun invocations of 2 ranks each, as two hosts of one job (``--nnodes 2``),
    then the switch's counters. ``args``: the example's."""
    port = _free_port()
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"lr-{tag}",
            str(ROOT / "examples" / "ddp_train.py"), "--steps", str(STEPS), *args]
    runs = " ".join(f"{' '.join(node)} > {tmp}/node{n}.{tag} 2>&1 & p{n}=$!;" for n in (0, 1))
    return (f"{runs} wait $p0; a=$?; wait $p1; b=$?; cat {tmp}/node0.{tag} {tmp}/node1.{tag};"
            f" test $a = 0 && test $b = 0 && {STATS}")


def launch(script: str, tmp, local_reduce: bool) -> str:
    """``script`` (sh) under ``homagg-net local``; its output."""
    env = clean_env() | ({} if local_reduce else {"HOMAGG_LOCAL_REDUCE": "0"})
    proc = subprocess.run([sys.executable, "-m", "homagg.launcher", "local", "--", "sh", "-c",
                           script], env=env, cwd=tmp, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"homagg-net local exited {proc.returncode}:\n"
                           f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc.stdout


def accepted(out: str) -> int:
    """The switch's STAT_ACCEPTED, from ``homagg-ctl stats`` in ``out``."""
    found = re.findall(r"^STAT_ACCEPTED +(\d+)", out, re.M)
    if len(found) != 1:
        raise RuntimeError(f"no single STAT_ACCEPTED line in:\n{out[-2000:]}")
    return int(found[0])
