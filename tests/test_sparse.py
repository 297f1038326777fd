"""Row-sparse all-reduce (``Agent.allreduce_rows``: torch sparse COO gradients, e.g. of an
embedding table): the union of the workers' rows, then the exact sum of the values on it,
with nothing as large as the table ever made dense. In memory (``MemoryJob``: the agents'
full logic on the switch's arithmetic)."""

from __future__ import annotations

import threading
import tracemalloc

import numpy as np
import pytest

from homagg.host_agent import AgentError, codec
from homagg.host_agent.simulate import MemoryJob


def run_rows(job: MemoryJob, n_rows, per_worker, key=None):
    """allreduce_rows on every worker at once; returns the RowsResults."""
    out: list = [None] * len(job.agents)
    err: list = [None] * len(job.agents)

    def work(w):
        try:
            rows, values = per_worker[w]
            out[w] = job.agents[w].allreduce_rows(n_rows, rows, values, key)
        except BaseException as e:  # noqa: BLE001 - asserted below
            err[w] = e
            job.switch.barrier.abort()

    threads = [threading.Thread(target=work, args=(w,)) for w in range(len(job.agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out, err


def row_sparse(rng, workers, n_rows, nnz, dim):
    xs = []
    for _ in range(workers):
        rows = np.sort(rng.choice(n_rows, nnz, replace=False)).astype(np.int64)
        xs.append((rows, rng.standard_normal((nnz, dim)).astype(np.float32)))
    return xs


def assert_exact(res, xs, n_rows):
    """Every worker: the union is every worker's rows, and the sums are, bit for bit, the
    integer sums of each worker's rows (zero where it has none) at the agreed shifts."""
    union = np.unique(np.concatenate([r for r, _ in xs]))
    dim = xs[0][1].shape[1:]
    on_union = []
    for rows, vals in xs:
        m = np.zeros((union.size,) + dim, np.float32)
        m[np.searchsorted(union, rows)] = vals
        on_union.append(m.reshape(-1))
    r0 = res[0].result
    np.testing.assert_array_equal(r0.block_shifts, codec.agreed_shifts(on_union,
                                                                       block=r0.block))
    np.testing.assert_array_equal(r0.shift, codec.agreed_shifts(on_union, block=r0.block,
                                                                split=True))
    exact = np.sum([codec.quantize(m, r0.shift).astype(np.int64) for m in on_union], axis=0)
    for r in res:
        np.testing.assert_array_equal(r.rows, union)
        np.testing.assert_array_equal(r.result.ints(), exact)
        np.testing.assert_array_equal(r.values.reshape(-1),
                                      codec.scale_blocks(exact, r.result.shift, 1))
    # and it is the dense sum, to float rounding
    dense = np.zeros((n_rows,) + dim, np.float64)
    for rows, vals in xs:
        dense[rows] += vals
    np.testing.assert_allclose(res[0].values, dense[union], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("index", ["flat", "hier"])
def test_rows_union_and_exact_sums(index):
    xs = row_sparse(np.random.default_rng(1), 4, 5_000, 300, 8)
    job = MemoryJob(4, index=index)
    res, err = run_rows(job, 5_000, xs)
    assert not any(err), err
    assert_exact(res, xs, 5_000)


def test_a_worker_with_no_rows_and_repeated_calls():
    rng = np.random.default_rng(2)
    job = MemoryJob(3)
    for _step in range(3):  # key: the index choice remembers the union size
        xs = row_sparse(rng, 3, 2_000, 50, 4)
        xs[1] = (np.zeros(0, np.int64), np.zeros((0, 4), np.float32))
        res, err = run_rows(job, 2_000, xs, key="emb")
        assert not any(err), err
        assert_exact(res, xs, 2_000)


def test_no_worker_has_rows():
    job = MemoryJob(2)
    empty = (np.zeros(0, np.int64), np.zeros((0, 8), np.float32))
    res, err = run_rows(job, 1_000, [empty, empty])
    assert not any(err), err
    assert all(r.rows.size == 0 and r.values.shape == (0, 8) for r in res)


def test_a_table_is_never_made_dense():
    # 4M rows x 32 floats: 512 MB dense; each worker touches 1000 rows
    n_rows, dim = 4_000_000, 32
    xs = row_sparse(np.random.default_rng(3), 2, n_rows, 1_000, dim)
    job = MemoryJob(2, index="hier")
    tracemalloc.start()
    try:
        res, err = run_rows(job, n_rows, xs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not any(err), err
    np.testing.assert_array_equal(res[0].rows, np.unique(np.concatenate([r for r, _ in xs])))
    # the row bitmap (1 byte a row while built) and the union's rows; not 512 MB
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.0f} MiB"


def test_rows_must_be_sorted_and_in_range():
    job = MemoryJob(1)
    with pytest.raises(AgentError, match="sorted, unique"):
        job.agents[0].allreduce_rows(10, np.array([3, 1]), np.zeros((2, 2), np.float32))
    with pytest.raises(AgentError, match="sorted, unique"):
        job.agents[0].allreduce_rows(10, np.array([3, 10]), np.zeros((2, 2), np.float32))
    with pytest.raises(AgentError, match="value rows"):
        job.agents[0].allreduce_rows(10, np.array([3]), np.zeros((2, 2), np.float32))
