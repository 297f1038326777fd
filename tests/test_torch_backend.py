"""The "homagg" torch.distributed backend (``import homagg.torch``;
``dist.init_process_group("homagg")``), on two processes and a software aggregator, against
gloo in the same processes (``dist.new_group(backend="gloo")``, the same inputs).

Every torch.distributed collective runs on both: integers and everything that goes to gloo
must be identical; floats through the switch must be, bit for bit, the codec's exact sum of
the quantized values (and close to gloo's). DDP without a hook, a hand-written all_reduce
loop and an int64 metric: losses within 1e-6 of gloo's, every rank bit-identical.
"""

from __future__ import annotations

import gc
import inspect
import os
import warnings
import zlib
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (optional extra)")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed import ReduceOp  # noqa: E402

from bench.torch_ranks import WORLD, batch, loss_of, make_model, run_job, switch_address  # noqa: E402,F401
from homagg.controller.local import install  # noqa: E402
from homagg.host_agent import codec  # noqa: E402
from homagg.targets.soft import SoftSwitch, SoftSwitchServer  # noqa: E402
from tests.staging import agent_address, agent_addresses  # noqa: E402

pytestmark = pytest.mark.slow  # (conftest.py) torch ranks in processes

# -- every collective --------------------------------------------------------------------------


def floats(rank: int, seed: int, n: int = 700, dyadic: bool = False) -> torch.Tensor:
    """A rank's float64 input: dyadic (k/8: exact through the codec) or with magnitudes
    spread over six decades (exercises the block scales)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dyadic:
        return torch.randint(-1000, 1000, (n,), generator=g).double() / 8
    return torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, n,
                                                                             dtype=torch.float64)


def ints(rank: int, seed: int, lo: int, hi: int, dtype, n: int = 300) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)


CASES: list = []  # (name, check, fn(group, rank) -> list of outputs); check: how to compare


def case(name, check="exact"):
    def add(fn):
        CASES.append((name, check, fn))
        return fn
    return add


def _seed(name: str) -> int:
    return zlib.crc32(name.encode()) % 10_000


FLOAT_CASES = [(dt, op) for dt in ("float32", "float64", "bfloat16", "float16")
               for op in ("SUM", "AVG")]


def _float_input(name: str, dtype: str, rank: int) -> torch.Tensor:
    x = floats(rank, _seed(name))
    if dtype == "float16":
        x = x / 16  # in float16's range, with its subnormals below
    return x.to(getattr(torch, dtype)).reshape(20, 35)


for _dt, _op in FLOAT_CASES:
    def _f(g, rank, _dt=_dt, _op=_op, _name=f"all_reduce[{_dt} {_op}]"):
        t = _float_input(_name, _dt, rank)
        dist.all_reduce(t, op=getattr(ReduceOp, _op), group=g)
        return [t]
    case(f"all_reduce[{_dt} {_op}]", ("codec", _dt, _op))(_f)


@case("all_reduce[float32 SUM dyadic]")
def _dyadic(g, rank):
    t = floats(rank, 1, dyadic=True).float()
    dist.all_reduce(t, group=g)
    return [t]


def _int_input(name, dtype, lo, hi, extra, rank):
    t = ints(rank, _seed(name), lo, hi, torch.int64)
    t[:len(extra)] = torch.tensor([e(rank) for e in extra], dtype=torch.int64)
    return t.to(dtype)


def _int_case(name, dtype, lo, hi, extra=()):
    def fn(g, rank):
        t = _int_input(name, dtype, lo, hi, extra, rank)
        dist.all_reduce(t, group=g)
        return [t]

    def want() -> torch.Tensor:  # the sum modulo 2**bits, as gloo's
        total = sum(_int_input(name, torch.int64, lo, hi, extra, r).numpy().view(np.uint64)
                    for r in range(WORLD))
        return torch.from_numpy(total.view(np.int64).astype(_np(dtype)))
    case(name, ("int", want))(fn)


def _np(dtype):
    return torch.empty(0, dtype=dtype).numpy().dtype


_int_case("all_reduce[int64 SUM]", torch.int64, -2**50, 2**50,
          (lambda r: 2**62 + r, lambda r: -2**63 + r, lambda r: 2**63 - 1, lambda r: -1))
_int_case("all_reduce[int32 SUM]", torch.int32, -2**20, 2**20)
_int_case("all_reduce[int32 SUM overflowing]", torch.int32, -2**20, 2**20,
          (lambda r: 2**31 - 1 - r, lambda r: -2**31 + r))
_int_case("all_reduce[int16 SUM]", torch.int16, -2**15, 2**15)
_int_case("all_reduce[int8 SUM]", torch.int8, -128, 128)
_int_case("all_reduce[uint8 SUM]", torch.uint8, 0, 256)


@case("all_reduce[bool SUM]")
def _bool(g, rank):
    t = ints(rank, 3, 0, 2, torch.bool)
    dist.all_reduce(t, group=g)
    return [t]


@case("all_reduce[complex64 SUM]")
def _complex(g, rank):  # torch views it as float32 pairs: through the switch
    t = torch.complex(floats(rank, 4, 50, True), floats(rank, 5, 50, True)).to(torch.complex64)
    dist.all_reduce(t, group=g)
    return [t]


for _op in ("MAX", "MIN", "PRODUCT"):
    def _m(g, rank, _op=_op):
        outs = []
        for t in (floats(rank, 6, 100).float(), ints(rank, 7, -9, 9, torch.int64)):
            dist.all_reduce(t, op=getattr(ReduceOp, _op), group=g)
            outs.append(t)
        return outs
    case(f"all_reduce[{_op}]")(_m)


@case("all_reduce[int64 AVG]", "raises")
def _int_avg(g, rank):
    t = ints(rank, 8, 0, 9, torch.int64)
    dist.all_reduce(t, op=ReduceOp.AVG, group=g)
    return [t]


@case("all_reduce[requires_grad]")
def _requires_grad(g, rank):  # a parameter, written in place as gloo does
    t = torch.nn.Parameter(floats(rank, 9, 64, dyadic=True).float())
    dist.all_reduce(t, group=g)
    return [t.detach()]


@case("new_group")
def _new_group(g, rank):  # a subgroup of homagg's: gloo (said once); of gloo's: gloo
    sub = dist.new_group([0, 1]) if g is None else dist.new_group([0, 1], backend="gloo")
    t = floats(rank, 2, 100).float()
    dist.all_reduce(t, group=sub)
    if g is None:  # a homagg group with no agent of its own
        assert type(sub).__name__ == "HomaggProcessGroup" and sub.agent is None
    dist.destroy_process_group(sub)
    return [t]


@case("all_reduce[empty]")
def _empty(g, rank):
    ts = [torch.zeros(0), torch.zeros(0, 3, dtype=torch.int64)]
    for t in ts:
        dist.all_reduce(t, group=g)
    return ts


@case("all_reduce[sparse COO]", "sparse")
def _sparse(g, rank):
    gen = torch.Generator().manual_seed(rank)
    rows = torch.unique(torch.randint(0, 400, (40,), generator=gen) * 2 + rank)
    t = torch.sparse_coo_tensor(rows[None], torch.randint(-64, 64, (rows.numel(), 3),
                                                          generator=gen).float() / 4, (801, 3))
    dist.all_reduce(t, group=g)
    return [t]


@case("all_reduce[async_op]")
def _async(g, rank):
    ts = [floats(rank, 10 + k, 300, dyadic=True).float() for k in range(4)]
    works = [dist.all_reduce(t, async_op=True, group=g) for t in ts]
    works[-1].wait()
    if g is None:  # homagg: completed in issue order, so the first three are done too
        assert all(w.is_completed() for w in works), [w.is_completed() for w in works]
    for w in works:
        w.wait()
    futs = [dist.all_reduce(t, async_op=True, group=g).get_future() for t in ts]
    # switch and gloo collectives mixed: completed in issue order all the same
    m, b = floats(rank, 14, 50).float(), floats(rank, 15, 50).float()
    works = [dist.all_reduce(ts[0], async_op=True, group=g),
             dist.all_reduce(m, op=ReduceOp.MAX, async_op=True, group=g),
             dist.all_reduce(ts[1], async_op=True, group=g),
             dist.broadcast(b, src=0, async_op=True, group=g)]
    works[-1].wait()
    if g is None:
        assert all(w.is_completed() for w in works), [w.is_completed() for w in works]
    for w in works:
        w.wait()
    return ts + [f.wait()[0] for f in futs] + [m, b]


@case("all_reduce_coalesced")
def _coalesced(g, rank):
    ts = [floats(rank, 20, 100, dyadic=True).float(), floats(rank, 21, 30, dyadic=True).float()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_reduce_coalesced(ts, group=g)
    return ts


@case("all_reduce_coalesced[MAX]")
def _coalesced_max(g, rank):  # to gloo's all_reduce_coalesced: each tensor its own maximum
    ts = [floats(rank, 22, 100).float(), floats(rank, 23, 30).float()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_reduce_coalesced(ts, op=ReduceOp.MAX, group=g)
    return ts


@case("reduce")
def _reduce(g, rank):
    t = floats(rank, 30, 100).float()
    dist.reduce(t, dst=0, group=g)
    return [t] if rank == 0 else []


@case("broadcast")
def _broadcast(g, rank):
    t = floats(rank, 31, 100).float()
    dist.broadcast(t, src=1, group=g)
    return [t]


@case("broadcast_object_list")
def _broadcast_objects(g, rank):
    objs = [{"rank": rank}, [rank] * 3]
    dist.broadcast_object_list(objs, src=1, group=g)
    return objs


@case("all_gather")
def _all_gather(g, rank):
    outs = [torch.zeros(50) for _ in range(WORLD)]
    dist.all_gather(outs, floats(rank, 32, 50).float(), group=g)
    return outs


@case("all_gather_into_tensor")
def _all_gather_into(g, rank):
    out = torch.zeros(WORLD * 50, dtype=torch.int64)
    dist.all_gather_into_tensor(out, ints(rank, 33, -5, 5, torch.int64, 50), group=g)
    return [out]


@case("all_gather_single")
def _all_gather_single(g, rank):
    out = torch.zeros(WORLD * 40)
    dist.all_gather_single(out, floats(rank, 34, 40).float(), group=g)
    return [out]


@case("all_gather_coalesced")
def _all_gather_coalesced(g, rank):
    ins = [floats(rank, 35, 20).float(), floats(rank, 36, 7).float()]
    outs = [[torch.zeros(20), torch.zeros(7)] for _ in range(WORLD)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_coalesced(outs, ins, group=g)
    return [t for ts in outs for t in ts]


@case("all_gather_object")
def _all_gather_object(g, rank):
    objs: list = [None] * WORLD
    dist.all_gather_object(objs, {"rank": rank, "x": [rank] * rank}, group=g)
    return objs


@case("gather")
def _gather(g, rank):
    outs = [torch.zeros(30) for _ in range(WORLD)] if rank == 0 else None
    dist.gather(floats(rank, 37, 30).float(), outs, dst=0, group=g)
    return outs or []


@case("gather_object")
def _gather_object(g, rank):
    objs = [None] * WORLD if rank == 0 else None
    dist.gather_object(("rank", rank), objs, dst=0, group=g)
    return objs or []


@case("scatter")
def _scatter(g, rank):
    out = torch.zeros(30)
    ins = [floats(k, 38, 30).float() for k in range(WORLD)] if rank == 0 else None
    dist.scatter(out, ins, src=0, group=g)
    return [out]


@case("scatter_object_list")
def _scatter_objects(g, rank):
    out: list = [None]
    dist.scatter_object_list(out, [{"to": k} for k in range(WORLD)] if rank == 0 else None,
                             src=0, group=g)
    return out


@case("reduce_scatter")
def _reduce_scatter(g, rank):
    out = torch.zeros(25)
    dist.reduce_scatter(out, [floats(rank, 40 + k, 25).float() for k in range(WORLD)], group=g)
    return [out]


@case("reduce_scatter_tensor")
def _reduce_scatter_tensor(g, rank):
    out = torch.zeros(25)
    dist.reduce_scatter_tensor(out, floats(rank, 42, 25 * WORLD).float(), group=g)
    return [out]


@case("reduce_scatter_single")
def _reduce_scatter_single(g, rank):
    out = torch.zeros(25, dtype=torch.int64)
    dist.reduce_scatter_single(out, ints(rank, 43, -9, 9, torch.int64, 25 * WORLD), group=g)
    return [out]


@case("all_to_all")
def _all_to_all(g, rank):
    outs = [torch.zeros(10) for _ in range(WORLD)]
    dist.all_to_all(outs, [floats(rank, 44 + k, 10).float() for k in range(WORLD)], group=g)
    return outs


@case("all_to_all_single")
def _all_to_all_single(g, rank):
    # uneven splits: rank r sends r + 1 + k elements to rank k
    ins = [r + 1 + k for r in [rank] for k in range(WORLD)]
    outs = [r + 1 + rank for r in range(WORLD)]
    out = torch.zeros(sum(outs))
    dist.all_to_all_single(out, floats(rank, 46, sum(ins)).float(), outs, ins, group=g)
    return [out]


@case("barrier")
def _barrier(g, rank):
    dist.barrier(group=g)
    return []


@case("monitored_barrier", "gloo only")
def _monitored_barrier(g, rank):
    dist.monitored_barrier(group=g)
    return []


@case("send/recv")
def _send_recv(g, rank):
    t = floats(rank, 47, 20).float()
    if rank == 0:
        dist.send(t, dst=1, group=g)
    else:
        dist.recv(t, src=0, group=g)
    return [t]


@case("isend/irecv")
def _isend_irecv(g, rank):
    mine, theirs = floats(rank, 48, 20).float(), torch.zeros(20)
    works = [dist.isend(mine, dst=1 - rank, group=g), dist.irecv(theirs, src=1 - rank, group=g)]
    for w in works:
        w.wait()
    return [theirs]


@case("batch_isend_irecv")
def _batch(g, rank):
    mine, theirs = floats(rank, 49, 20).float(), torch.zeros(20)
    ops = [dist.P2POp(dist.isend, mine, 1 - rank, group=g),
           dist.P2POp(dist.irecv, theirs, 1 - rank, group=g)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return [theirs]


@case("send_object_list/recv_object_list")
def _objects_p2p(g, rank):
    objs: list = [None, None]
    if rank == 0:
        objs = [{"from": 0}, "x"]
        dist.send_object_list(objs, dst=1, group=g)
    else:
        dist.recv_object_list(objs, src=0, group=g)
    return objs


def _funcol(name, fn):
    """A functional collective (torch.distributed._functional_collectives: DTensor's and
    torch.compile's), on the homagg group itself where the others get None."""
    def run(g, rank):
        from torch.distributed import _functional_collectives as funcol
        return [fn(funcol, dist.group.WORLD if g is None else g, rank)]
    case(f"functional.{name}")(run)


_funcol("all_reduce", lambda f, g, rank: f.all_reduce(
    floats(rank, 50, 64, dyadic=True).float(), "sum", g).wait())
_funcol("all_gather_tensor", lambda f, g, rank: f.all_gather_tensor(
    floats(rank, 51, 16).float(), 0, g).wait())
_funcol("reduce_scatter_tensor", lambda f, g, rank: f.reduce_scatter_tensor(
    floats(rank, 52, 32).float(), "sum", 0, g).wait())
_funcol("all_to_all_single", lambda f, g, rank: f.all_to_all_single(
    floats(rank, 53, 16).float(), None, None, g).wait())


#: torch.distributed functions with a ``group`` that are not collectives.
NOT_COLLECTIVES = {"destroy_process_group", "get_backend", "get_backend_config",
                   "get_global_rank", "get_group_rank", "get_process_group_ranks", "get_rank",
                   "get_world_size", "new_subgroups", "shrink_group"}


def collectives_worker(rank, world, ref):
    pg = dist.group.WORLD
    assert dist.get_backend() == "homagg" and pg.name() == "homagg" and pg.size() == world
    results = {}
    for name, _check, fn in CASES:
        got = []
        for g in (None, ref):
            before, cpp = Counter(pg.counts), pg.cpp_collectives
            try:
                got.append(("ok", fn(g, rank)))
            except Exception as err:  # noqa: BLE001 - compared with gloo's
                got.append(("raised", type(err).__name__))
            if g is None:
                path = sorted((Counter(pg.counts) - before).keys())
                path += ["cpp backend"] * (pg.cpp_collectives > cpp)
        results[name] = (got[0], got[1], path)
    return results


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.to_dense(), b.to_dense()))
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    return a == b


def codec_expectation(name: str, dtype: str, op: str) -> torch.Tensor:
    """The backend's result, from the codec: the exact integer sum of every rank's values
    quantized at the job's agreed shifts (split blocks included), times 2**-shift (exact in
    float64), AVG divided by the world size in float64, rounded once to the dtype."""
    xs = [_float_input(name, dtype, r).double().reshape(-1).numpy() for r in range(WORLD)]
    shift = codec.agreed_shifts(xs, split=True)
    exact = sum(codec.quantize(x, shift).astype(np.int64) for x in xs)
    total = np.ldexp(exact.astype(np.float64), -shift)
    if op == "AVG":
        total = total / WORLD
    return torch.from_numpy(total).to(getattr(torch, dtype)).reshape(20, 35)


def test_every_collective_on_homagg_matches_gloo(tmp_path):
    ranks = run_job(collectives_worker, tmp_path, 1)
    named = {name.split("[")[0] for name, _, _ in CASES} | {"send", "recv", "isend", "irecv",
                                                             "send_object_list",
                                                             "recv_object_list"}
    with_group = {n for n in dir(dist) if not n.startswith("_") and n != "reduce_op"
                  and inspect.isfunction(getattr(dist, n, None))
                  and "group" in inspect.signature(getattr(dist, n)).parameters}
    assert with_group - NOT_COLLECTIVES <= named, "collectives not tested"
    through_switch, failed = [], []
    for name, check, _ in CASES:
        for rank, r in enumerate(ranks):
            (hstatus, hout), (gstatus, gout), path = r["out"][name]
            where = f"{name} on rank {rank}"
            if rank == 0 and "switch:allreduce" in path:
                through_switch.append(name)
            if check == "raises":
                if not (hstatus == gstatus == "raised" and hout == gout):
                    failed.append((where, hout, gout))
                continue
            if check == "gloo only":  # torch refuses it on any backend but gloo
                if not ((hstatus, hout) == ("raised", "ValueError") and gstatus == "ok"):
                    failed.append((where, hout, gout))
                continue
            if hstatus != "ok":
                failed.append((where, hout, gout))
                continue
            if check[0] == "int":  # exact; gloo has no SUM of some of them (int16)
                if not (torch.equal(hout[0], check[1]())
                        and (gstatus != "ok" or _same(hout, gout))):
                    failed.append((where, hout, gout))
                continue
            if gstatus != "ok":
                failed.append((where, hout, gout))
            elif check == "exact":
                if not _same(hout, gout):
                    failed.append((where, hout, gout))
            elif check == "sparse":
                if not (hout[0].is_sparse and torch.equal(hout[0].to_dense(),
                                                          gout[0].to_dense())):
                    failed.append((where, hout, gout))
            else:
                _, dtype, op = check
                if not torch.equal(hout[0], codec_expectation(name, dtype, op)):
                    failed.append((where, "not the codec's sum", hout))
                tol = {"bfloat16": 1e-2, "float16": 1e-3}.get(dtype, 1e-5)
                scale = float(gout[0].double().abs().max())
                torch.testing.assert_close(hout[0].double(), gout[0].double(), rtol=tol,
                                           atol=tol * scale)
        # every rank holds the same (where the collective gives every rank the same)
        if name.startswith("all_reduce") and check not in ("raises", "gloo only"):
            assert _same(ranks[0]["out"][name][0], ranks[1]["out"][name][0]), name
    for name, _, _ in CASES:
        print(f"{name:40s} {' '.join(ranks[0]['out'][name][2]) or '-'}")
    assert not failed, "\n".join(map(str, failed))
    expect = {f"all_reduce[{dt} {op}]" for dt, op in FLOAT_CASES} | {
        "all_reduce[float32 SUM dyadic]", "all_reduce[int64 SUM]", "all_reduce[int32 SUM]",
        "all_reduce[int32 SUM overflowing]", "all_reduce[int16 SUM]", "all_reduce[int8 SUM]",
        "all_reduce[uint8 SUM]", "all_reduce[sparse COO]", "all_reduce[async_op]",
        "all_reduce_coalesced", "all_reduce[empty]", "all_reduce[complex64 SUM]",
        "functional.all_reduce", "all_reduce[requires_grad]"}
    assert set(through_switch) == expect
    # every collective went through the group's Python methods, none around them to the
    # registered gloo backend
    assert all("cpp backend" not in r["out"][name][2] for r in ranks for name, _, _ in CASES)
    # what the switch cannot serve is said once, with the op or the dtype and why
    said = ranks[0]["warnings"]
    for what in ("MAX", "MIN", "PRODUCT", "torch.bool", "AVG of torch.int64",
                 "float64", "is a subgroup"):
        hits = [w for w in said if what in w]
        assert len(hits) == 1, (what, said)


# -- training --------------------------------------------------------------------------------


def training_worker(rank, world, ref, steps):
    pg = dist.group.WORLD
    out: dict = {}
    for which, group in (("homagg", None), ("gloo", ref)):
        before = Counter(pg.counts)
        # DDP, unmodified (no hook); a sparse embedding's gradient too; gradients as views
        # of the buckets and a static graph
        for variant in ("dense", "sparse", "views"):
            model = make_model(variant == "sparse")
            # small buckets: several all_reduces in flight while autograd goes on
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, process_group=group, bucket_cap_mb=0.0004,
                gradient_as_bucket_view=variant == "views", static_graph=variant == "views")
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            losses = []
            for step in range(steps):
                opt.zero_grad()
                loss = loss_of(ddp, rank, step)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            out[which, "ddp", variant] = (losses, [p.detach().clone()
                                                   for p in model.parameters()])
            del ddp, model, opt
            gc.collect()
        # a hand-written loop: all_reduce AVG of each gradient; an int64 metric
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses, metrics = [], []
        for step in range(steps):
            opt.zero_grad()
            loss = loss_of(model, rank, step)
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, op=ReduceOp.AVG, group=group)
            opt.step()
            idx, y = batch(rank, step)
            with torch.no_grad():
                correct = ((model(idx) > 0).float() == y).sum().to(torch.int64)
            metric = torch.stack([correct, torch.tensor(2**40 + 7 * rank)])  # exact past 2**31
            dist.all_reduce(metric, group=group)
            losses.append(loss.item())
            metrics.append(metric)
        out[which, "loop"] = (losses, [p.detach().clone() for p in model.parameters()],
                              metrics)
        out[which, "counts"] = Counter(pg.counts) - before
    return out


def test_ddp_and_a_hand_written_loop_on_homagg_track_gloo(tmp_path):
    steps = 6
    run = run_job(training_worker, tmp_path, 2, steps)
    assert [r["closed"] for r in run] == ["thread True, socket True"] * WORLD
    ranks = [r["out"] for r in run]
    for key in [("ddp", "dense"), ("ddp", "sparse"), ("ddp", "views"), ("loop",)]:
        h = [r[("homagg", *key)] for r in ranks]
        g = [r[("gloo", *key)] for r in ranks]
        for rank in range(WORLD):
            np.testing.assert_allclose(h[rank][0], g[rank][0], rtol=0, atol=1e-6,
                                       err_msg=f"{key} rank {rank}: losses")
        for p0, p1 in zip(h[0][1], h[1][1]):  # every rank bit-identical
            assert torch.equal(p0, p1), key
    # the int64 metric: exact, on every rank, as gloo's
    for r in ranks:
        for mh, mg in zip(r["homagg", "loop"][2], r["gloo", "loop"][2]):
            assert torch.equal(mh, mg) and mh[1] == 2 * 2**40 + 7
    # DDP's gradients and the loop's went through the switch; its start-up checks to gloo
    print("training: served", dict(ranks[0]["homagg", "counts"]), "registered backend",
          [r["cpp backend"] for r in run])
    counts = ranks[0]["homagg", "counts"]
    # the loop: 6 a step; DDP: 1 + 2 + 1 a step with one dense bucket, more with two in flight
    assert counts["switch:allreduce"] > 10 * steps
    assert ranks[0]["gloo", "counts"]["switch:allreduce"] == 0


def scaler_worker(rank, world, ref):
    """DDP on homagg with AMP's GradScaler: an inf in one rank's loss at step 1."""
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    log = []
    for step in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        scale = scaler.get_scale()
        opt.zero_grad()
        idx, y = batch(rank, step)
        if step == 1 and rank == 1:
            y[3] = float("inf")  # an overflowed loss on one rank only
        out = ddp(idx)
        scaler.scale(torch.nn.functional.mse_loss(out, y)).backward()
        scaler.step(opt)
        scaler.update()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        log.append((scale, scaler.get_scale(), changed,
                    [p.detach().clone() for p in model.parameters()]))
    del ddp
    return log


def test_ddp_grad_scaler_on_homagg_skips_the_step_on_every_rank(tmp_path):
    """A non-finite gradient on one rank makes the whole bucket NaN on every rank (the
    switch's rule), so GradScaler skips the step everywhere, as over gloo."""
    logs = [r["out"] for r in run_job(scaler_worker, tmp_path, 6)]
    for step in range(3):
        for r in range(WORLD):
            before, after, changed, _ = logs[r][step]
            if step == 1:
                assert not changed and after == before / 2, (r, step)
            else:
                assert changed and after == before, (r, step)
        for p0, p1 in zip(logs[0][step][3], logs[1][step][3]):
            assert torch.equal(p0, p1)


# -- FSDP2 -----------------------------------------------------------------------------------


def fsdp_worker(rank, world, ref, steps, which):
    """FSDP2 (``fully_shard``) on a mesh of the "homagg" group (1-D, or HSDP: 2 replicas of 1
    shard), and on gloo's: the losses, what each path served, the full parameters."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    pg = dist.group.WORLD
    meshes = {"homagg": lambda: init_device_mesh("cpu", (world,)),
              "hsdp": lambda: init_device_mesh("cpu", (world, 1),
                                               mesh_dim_names=("replicate", "shard")),
              "gloo": lambda: DeviceMesh.from_group(ref, "cpu")}
    out = {}
    for name in (*which, "gloo"):
        mesh = meshes[name]()
        model = make_model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        before, cpp = Counter(pg.counts), pg.cpp_collectives
        losses = []
        for step in range(steps):
            opt.zero_grad()
            loss = loss_of(model, rank, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        served = dict(Counter(pg.counts) - before)
        served["cpp backend"] = pg.cpp_collectives - cpp
        params = [p.full_tensor().detach().clone() for p in model.parameters()]
        out[name] = (losses, served, params)
        del model, opt
        gc.collect()
    return out


@pytest.mark.parametrize("scatter", ["gloo", "switch"])
def test_fsdp2_on_homagg(tmp_path, scatter):
    """FSDP2 on a 1-D mesh of the homagg group: its all_gather goes to gloo, its
    reduce_scatter too by default, or through the switch with HOMAGG_TORCH_REDUCE_SCATTER=switch;
    losses and parameters within 1e-6 of FSDP2's on gloo. HSDP with 2 replicas of one shard:
    the replicate dimension spans the world, so the mesh uses the default group and the
    gradients' all_reduce goes through the switch; the shard dimension's groups are subgroups
    (gloo, said once)."""
    steps = 4
    which = ("homagg", "hsdp") if scatter == "gloo" else ("homagg",)
    ranks = run_job(fsdp_worker, tmp_path, 3, steps, which,
                    env={"HOMAGG_TORCH_REDUCE_SCATTER": scatter})
    for name in which:
        served = ranks[0]["out"][name][1]
        print(f"FSDP2 {name}, reduce_scatter via {scatter}: {served}")
        for rank, r in enumerate(ranks):
            losses, _, params = r["out"][name]
            ref_losses, _, ref_params = r["out"]["gloo"]
            np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-6,
                                       err_msg=f"{name} rank {rank}")
            for p, q in zip(params, ref_params):
                torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        for p0, p1 in zip(ranks[0]["out"][name][2], ranks[1]["out"][name][2]):
            assert torch.equal(p0, p1)
    served = ranks[0]["out"]["homagg"][1]
    assert served.get("gloo:_allgather_base", 0) > 0
    if scatter == "switch":
        assert served.get("switch:reduce_scatter", 0) >= steps
        assert "gloo:_reduce_scatter_base" not in served
    else:
        assert served.get("gloo:_reduce_scatter_base", 0) >= steps
        assert "switch:allreduce" not in served and "switch:reduce_scatter" not in served
        # HSDP: the replicas' all_reduce through the switch; the shards' subgroups said why
        hsdp = ranks[0]["out"]["hsdp"][1]
        assert hsdp.get("switch:allreduce", 0) >= steps and hsdp["cpp backend"] == 0
        assert sum("is a subgroup" in w for w in ranks[0]["warnings"]) == 1


# -- subgroups with a job of their own ---------------------------------------------------------


def subgroup_worker(rank, world, ref, sub_addrs, job):
    import homagg.torch
    from homagg.host_agent import AgentConfig

    host, port = os.environ["HOMAGG_SWITCH"].split(":")

    def provider(ranks, group_rank):  # what the controller service would hand out
        if ranks != [0, 1]:
            return None
        return AgentConfig(job, group_rank, len(ranks), (host, int(port)),
                           sub_addrs[ranks[group_rank]], slots=16, timeout=0.01, deadline=30)

    homagg.torch.set_subgroup_config(provider)
    sub = dist.new_group([0, 1])
    gloo_sub = dist.new_group([0, 1], backend="gloo")
    a, b = floats(rank, 60, 500).float(), floats(rank, 61, 500, dyadic=True).float()
    b_ref = b.clone()
    works = [dist.all_reduce(a, async_op=True),  # the default group's job, meanwhile
             dist.all_reduce(b, group=sub, async_op=True)]
    for w in reversed(works):
        w.wait()
    dist.all_reduce(b_ref, group=gloo_sub)
    c = ints(rank, 62, -2**40, 2**40, torch.int64)
    c_ref = c.clone()
    dist.all_reduce(c, group=sub)
    dist.all_reduce(c_ref, group=gloo_sub)
    out = {"a": a, "b": (b, b_ref), "c": (c, c_ref), "sub": dict(sub.counts),
           "job": sub.agent.cfg.job}
    dist.destroy_process_group(sub)
    return out


def test_a_subgroup_with_a_job_of_its_own_goes_through_the_switch(tmp_path):
    """``set_subgroup_config``: new_group's subgroup gets an agent in its own job (here both
    ranks again: a second job on the same aggregator), next to the default group's."""
    sub_addrs = agent_addresses(WORLD)
    ranks = run_job(subgroup_worker, tmp_path, 8, sub_addrs, 9, tables={9: sub_addrs})
    for r in ranks:
        out = r["out"]
        assert out["job"] == 9 and out["sub"] == {"switch:allreduce": 2}
        assert torch.equal(*out["b"]) and torch.equal(*out["c"])
        assert not any("is a subgroup" in w for w in r["warnings"])
    assert torch.equal(ranks[0]["out"]["a"], ranks[1]["out"]["a"])


def pipelined_worker(rank, world, ref):
    """Five all_reduce calls queued (the agent's thread held until all are issued) with a
    gloo MAX among them: each switch all-reduce's round 1 rides with the one before's values,
    except the one after the MAX (a gloo job offers nothing: the pipeline stops at it)."""
    import threading

    pg = dist.group.WORLD
    gate, real = threading.Event(), pg.agent.allreduce_detailed

    def gated(*a, **kw):
        gate.wait(10)
        return real(*a, **kw)

    pg.agent.allreduce_detailed = gated
    ts = [floats(rank, 40 + k, 300 + 50 * k, dyadic=True).float() for k in range(5)]
    sums = [t.clone() for t in ts]
    m = floats(rank, 46, 20).float()
    works = [dist.all_reduce(t, async_op=True) for t in ts[:3]]
    works.append(dist.all_reduce(m, op=ReduceOp.MAX, async_op=True))
    works += [dist.all_reduce(t, async_op=True) for t in ts[3:]]
    gate.set()
    for w in works:
        w.wait()
    for t in sums:
        dist.all_reduce(t, group=ref)  # gloo's sums (dyadic: the switch's are exact)
    return {"ts": ts, "gloo": sums, "pipelined": pg.agent.counters.pipelined}


def test_queued_all_reduces_pipeline_through_the_switch(tmp_path):
    ranks = run_job(pipelined_worker, tmp_path, 30)
    for r in ranks:
        out = r["out"]
        assert out["pipelined"] == 3  # 0 -> 1, 1 -> 2, 3 -> 4
        for got, want in zip(out["ts"], out["gloo"], strict=True):
            assert torch.equal(got, want)
        assert r["counts"]["switch:allreduce"] == 5


def _profiled_collectives(rank, world, group):
    """A few collectives on ``group``: their outputs."""
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x, group=group)
    dist.broadcast(torch.zeros(2, 4, dtype=torch.float64), src=0, group=group)
    dist.all_reduce(torch.tensor([float(rank)]), op=ReduceOp.MAX, group=group)
    gathered = [torch.empty(3, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(gathered, torch.full((3,), rank, dtype=torch.int32), group=group)
    work = dist.all_reduce(torch.ones(10, dtype=torch.float16), async_op=True, group=group)
    work.wait()
    return {"x": x, "gathered": gathered}


def profiled_worker(rank, world, ref):
    """A profile around a few collectives, on the homagg group and on gloo, each recording
    shapes: each homagg collective is an event named after it, with the inputs' shapes and
    dtypes gloo's event has."""
    from torch.profiler import ProfilerActivity, profile

    seen = {}
    for prefix, group in (("homagg:", None), ("gloo:", ref)):
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = _profiled_collectives(rank, world, group)
        # (this profile's gloo events on the homagg group are its inner gloo's)
        seen[prefix] = sorted(
            ((e.start_ns(), e.name().removeprefix(prefix), e.shapes(), e.dtypes(),
              e.duration_ns()) for e in prof.profiler.kineto_results.events()
             if e.name().startswith(prefix)), key=lambda e: e[0])
    return {"homagg": [e[1:] for e in seen["homagg:"]], "gloo": [e[1:] for e in seen["gloo:"]],
            "x": out["x"]}


def test_every_collective_is_a_profiler_event_with_gloos_shapes_and_dtypes(tmp_path):
    ranks = run_job(profiled_worker, tmp_path, 12)
    for r in ranks:
        out = r["out"]
        names = [e[0] for e in out["homagg"]]
        assert names == ["all_reduce", "broadcast", "all_reduce", "all_gather", "all_reduce"], \
            names
        assert all(e[3] > 0 for e in out["homagg"]), out["homagg"]  # each spans its work
        # the inputs as gloo's events have them: shapes and dtypes, collective by collective
        assert [e[:3] for e in out["homagg"]] == [e[:3] for e in out["gloo"]], out
        assert out["homagg"][1][1:3] == ([[2, 4]], ["double"]), out["homagg"][1]
        assert torch.equal(out["x"], torch.arange(1000, dtype=torch.float32) * 3)


# -- errors, configuration -------------------------------------------------------------------


def _raised(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - what the test looks at
        return type(err).__name__, str(err)
    return None


def failing_worker(rank, world, ref):
    """The aggregator does not know this job: every switch collective fails, and says so;
    DDP's backward (no hook) raises it too (a future holding the Python exception itself
    crashed the process there)."""
    out = {"sync": _raised(lambda: dist.all_reduce(torch.ones(100))),
           "async": _raised(lambda: dist.all_reduce(torch.ones(10), async_op=True).wait()),
           "future": _raised(lambda: dist.all_reduce(torch.ones(10), async_op=True)
                             .get_future().wait())}
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, op=ReduceOp.MAX)  # gloo's collectives are unaffected
    out["max"] = x
    def backward():
        ddp = torch.nn.parallel.DistributedDataParallel(make_model())
        loss_of(ddp, rank, 0).backward()

    out["ddp"] = _raised(backward)
    return out


def test_a_failing_switch_collective_raises_on_every_rank_and_gloo_goes_on(tmp_path):
    """(Named "cpu:homagg" here: the device-qualified form works too.)"""
    run = run_job(failing_worker, tmp_path, 4, table_job=5, options={"deadline": 1.0},
                  backend="cpu:homagg")
    ranks = [r["out"] for r in run]
    assert [r["closed"] for r in run] == ["thread True, socket True"] * WORLD
    for out in ranks:
        assert out["sync"][0] == "AgentError" and "DROP_WRONG_IDENTITY" in out["sync"][1], out
        for how in ("async", "future", "ddp"):  # the agent stays broken: raised at once
            assert out[how] is not None and "unusable after an earlier failure" in out[how][1], (
                how, out[how])
        assert out["max"].item() == 1.0


def _bad_bind_entry(rank, world, addr, out_dir):
    import homagg.torch  # noqa: F401 - registers the backend

    os.environ.update(HOMAGG_JOB="1", HOMAGG_SWITCH="127.0.9.254",
                      # rank 1: an address no interface has (TEST-NET-1): its bind fails
                      HOMAGG_BIND=f"{addr[0]}:{addr[1]}" if rank == 0 else "192.0.2.1:20000")
    try:
        dist.init_process_group("homagg", init_method=f"file://{out_dir}/store", rank=rank,
                                world_size=world)
        result = None
    except Exception as err:  # noqa: BLE001 - what the test looks at
        result = (type(err).__name__, str(err))
    torch.save(result, f"{out_dir}/rank{rank}.pt")


def test_an_agent_that_cannot_start_fails_init_on_every_rank(tmp_path):
    mp.spawn(_bad_bind_entry, args=(WORLD, agent_address(), str(tmp_path)), nprocs=WORLD,
             join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    assert r1[0] == "AgentError" and "cannot bind 192.0.2.1:20000" in r1[1], r1
    assert r0 == ("AgentError", "homagg: 1 rank(s) of this process group could not start an "
                  "agent (their own error says why)"), r0


def test_the_start_up_agreement_goes_through_the_store_not_gloo():
    # A rank that fails to start raises at once and its process may exit: a gloo collective
    # just before it would leave a gloo thread holding its tensor while the interpreter
    # exits (SIGABRT, "terminate called without an active exception"). The agreement needs
    # only the store; each rank hears every rank's state, whatever the order they tell it.
    import threading

    from homagg.host_agent.distributed.startup import told

    store, got = dist.HashStore(), {}
    ranks = [threading.Thread(target=lambda r=r, m=m: got.__setitem__(r, told(store, r, 3, m)))
             for r, m in ((2, 0), (0, 2), (1, 0))]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout=30)
    assert got == {r: Counter({0: 2, 2: 1}) for r in range(3)}, got


def test_work_reraises_and_reports_a_failed_future():
    from homagg.host_agent.distributed.backend import HomaggWork

    fut = torch.futures.Future()
    work = HomaggWork(fut)
    assert not work.is_completed() and not work.is_success() and work.exception() is None
    fut.set_exception(ValueError("no switch"))
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), ValueError)
    with pytest.raises(ValueError, match="no switch"):
        work.wait()
    # its future: the error as a callback's (a C++ error, which DDP's reducer survives)
    with pytest.raises(RuntimeError, match="ValueError: no switch"):
        work.get_future().wait()
    ok = torch.futures.Future()
    ok.set_result([torch.ones(2)])
    assert HomaggWork(ok).wait() and HomaggWork(ok).result()[0].sum() == 2


def test_agent_config_takes_rank_and_world_size_from_the_process_group(monkeypatch):
    from homagg.host_agent.config import AgentConfig, AgentError
    from homagg.host_agent.distributed.backend import _agent_config

    env = {"HOMAGG_JOB": "7", "HOMAGG_SWITCH": "10.0.0.254", "HOMAGG_BIND": "10.0.0.2:50000"}
    cfg = _agent_config(1, 3, env)
    assert (cfg.job, cfg.worker, cfg.workers, cfg.bind) == (7, 1, 3, ("10.0.0.2", 50000))
    # the environment's worker id wins (a controller may number workers its own way)
    assert _agent_config(1, 3, {**env, "HOMAGG_WORKER": "2"}).worker == 2
    with pytest.raises(AgentError, match=r"job has 4 workers \(HOMAGG_WORKERS\) but the "
                                         "process group has 3"):
        _agent_config(1, 3, {**env, "HOMAGG_WORKERS": "4"})
    with pytest.raises(AgentError, match="HOMAGG_JOB is not set"):
        _agent_config(0, 2, {})
    # what from_env sees: the group's RANK and WORLD_SIZE (a controller join names the
    # member by them), whatever the environment had
    seen: dict = {}

    def from_env(environ, **options):
        seen.update(environ)
        return AgentConfig(7, int(environ["HOMAGG_WORKER"]), int(environ["WORLD_SIZE"]))

    monkeypatch.setattr(AgentConfig, "from_env", from_env)
    _agent_config(2, 3, {**env, "RANK": "0", "WORLD_SIZE": "8"})
    assert (seen["RANK"], seen["WORLD_SIZE"], seen["HOMAGG_WORKER"]) == ("2", "3", "2")


def test_import_homagg_torch_registers_the_backend_and_leaves_torch_alone():
    import homagg.torch

    assert "HOMAGG" in dist.Backend._plugins
    assert dist.Backend.backend_capability["homagg"] == ["cpu", "cuda"]
    assert torch.__name__ == "torch" and homagg.torch.__name__ == "homagg.torch"
    homagg.torch.register()  # again: nothing


def hsdp_worker(rank, world, ref, steps, jobs):
    """HSDP on a 2 x 2 mesh of 4 ranks, each mesh dimension's groups a homagg job of their own
    (``jobs``: global ranks -> (job, addresses)), against FSDP2 on gloo's 4 ranks."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import homagg.torch
    from homagg.host_agent import AgentConfig

    host, port = os.environ["HOMAGG_SWITCH"].split(":")
    groups = []

    def provider(ranks, group_rank):
        job, addrs = jobs[tuple(ranks)]
        return AgentConfig(job, group_rank, len(ranks), (host, int(port)), addrs[group_rank],
                           slots=16, timeout=0.01, deadline=30)

    homagg.torch.set_subgroup_config(provider)
    out = {}
    for name in ("hsdp", "gloo"):
        if name == "hsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            groups = [mesh.get_group(d) for d in ("replicate", "shard")]
        else:
            mesh = DeviceMesh.from_group(ref, "cpu")
        model = make_model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        before = [Counter(g.counts) for g in groups]
        losses = []
        for step in range(steps):
            opt.zero_grad()
            loss = loss_of(model, rank, step)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        served = [dict(Counter(g.counts) - b) for g, b in zip(groups, before)]
        params = [p.full_tensor().detach().clone() for p in model.parameters()]
        out[name] = (losses, served, params)
        del model, opt
        gc.collect()
    out["jobs"] = [g.agent.cfg.job for g in groups]
    return out


def test_hsdp_on_four_ranks_with_a_job_per_mesh_group(tmp_path):
    """HSDP (2 replicas x 2 shards): the replicas' all_reduce and the shards' reduce_scatter
    (HOMAGG_TORCH_REDUCE_SCATTER=switch) go through the switch, each mesh group a homagg job
    of its own (set_subgroup_config); losses and parameters within 1e-6 of FSDP2 on gloo."""
    steps, world = 3, 4
    jobs = {ranks: (job, agent_addresses(2))
            for job, ranks in enumerate([(0, 2), (1, 3), (0, 1), (2, 3)], start=11)}
    ranks = run_job(hsdp_worker, tmp_path, 10, steps, jobs, world=world,
                    tables={job: addrs for job, addrs in jobs.values()},
                    env={"HOMAGG_TORCH_REDUCE_SCATTER": "switch"})
    for rank, r in enumerate(ranks):
        losses, served, params = r["out"]["hsdp"]
        ref_losses, _, ref_params = r["out"]["gloo"]
        np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-6)
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        replicate, shard = served
        print(f"HSDP rank {rank}: jobs {r['out']['jobs']}, replicate group {replicate}, "
              f"shard group {shard}")
        assert replicate.get("switch:allreduce", 0) >= steps
        assert shard.get("switch:reduce_scatter", 0) >= steps
        assert shard.get("gloo:_allgather_base", 0) >= steps
        for p0, p1 in zip(params, ranks[0]["out"]["hsdp"][2]):
            assert torch.equal(p0, p1)


# -- the example -----------------------------------------------------------------------------


def test_the_ddp_example_with_each_backend(tmp_path):
    """examples/ddp_train.py --backend gloo | hook | homagg on 2 processes: homagg's two paths
    end with the same parameters (with 2 workers DDP's division before the sum is exact, so
    the backend's sum is the hook's), on both ranks, and their losses are gloo's to 1e-6."""
    import re
    import subprocess
    import sys

    from homagg import paths

    root = paths.checkout_root()
    if root is None:
        pytest.skip("needs the checkout's examples/")
    runs = {}
    for backend in ("gloo", "hook", "homagg"):
        switch, addrs = switch_address(), agent_addresses(WORLD)
        server = SoftSwitchServer(SoftSwitch(), switch).start()
        install(server.switch, 1, addrs, 16)
        store = tmp_path / f"{backend}-store"
        try:
            procs = [subprocess.Popen(
                [sys.executable, str(root / "examples" / "ddp_train.py"), "--steps", "5",
                 "--rows", "2000", "--backend", backend, "--init-method", f"file://{store}"],
                env={**os.environ, "PYTHONPATH": str(root), "RANK": str(r),
                     "WORLD_SIZE": str(WORLD), "HOMAGG_JOB": "1",
                     "HOMAGG_SWITCH": f"{switch[0]}:{switch[1]}",
                     "HOMAGG_BIND": f"{addrs[r][0]}:{addrs[r][1]}", "HOMAGG_SLOTS": "16",
                     # the hook's from_env needs them; the backend takes the group's rank
                     **({"HOMAGG_WORKER": str(r), "HOMAGG_WORKERS": str(WORLD)}
                        if backend == "hook" else {})},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for r in range(WORLD)]
            outs = [p.communicate(timeout=300)[0] for p in procs]
        finally:
            server.stop()
        assert all(p.returncode == 0 for p in procs), outs
        text = "".join(outs)
        runs[backend] = ([float(x) for x in re.findall(r"step +\d+ loss (\S+)", text)],
                         re.findall(r"rank \d: parameters (\w+)", text))
    gloo_losses = np.array(runs["gloo"][0])
    for backend in ("hook", "homagg"):
        losses, digests = runs[backend]
        assert len(losses) == 5 and np.abs(np.array(losses) - gloo_losses).max() <= 1e-6
        assert len(digests) == WORLD and len(set(digests)) == 1
    assert runs["hook"][1] == runs["homagg"][1]


def test_the_old_module_names_still_import_with_a_deprecation_warning():
    """The torch modules moved to ``homagg.host_agent.distributed``; each old name is the same
    module object for one more release, and says so."""
    import importlib
    import sys

    import homagg.host_agent.distributed.backend as backend
    import homagg.host_agent.distributed.group as group
    import homagg.host_agent.distributed.hook as hook
    import homagg.host_agent.distributed.switch as switch
    import homagg.host_agent.distributed.work as work

    for old, new in (("torch_backend", backend), ("torch_group", group), ("torch_hook", hook),
                     ("torch_switch", switch), ("torch_work", work)):
        name = f"homagg.host_agent.{old}"
        sys.modules.pop(name, None)
        with pytest.warns(DeprecationWarning, match=f"{name} moved to {new.__name__}"):
            mod = importlib.import_module(name)
        assert mod is new
    from homagg.host_agent.torch_hook import HookState, homagg_hook  # noqa: F401 - the old use
    assert HookState is hook.HookState


def test_the_engines_old_module_names_still_import_with_a_deprecation_warning():
    import importlib
    import sys

    for old in ("transport", "round", "loss", "results", "rto", "congestion", "round_cost"):
        name, new = f"homagg.host_agent.{old}", f"homagg.host_agent.engine.{old}"
        sys.modules.pop(name, None)
        with pytest.warns(DeprecationWarning, match=f"{name} moved to {new}"):
            mod = importlib.import_module(name)
        assert mod is importlib.import_module(new)
    from homagg.host_agent.allreduce import Counters, SwitchLink  # the old homes of the two
    from homagg.host_agent.engine import Counters as C
    from homagg.host_agent.engine import SwitchLink as S
    assert (Counters, SwitchLink) == (C, S)
