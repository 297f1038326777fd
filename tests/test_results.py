"""host_agent/engine/results.py: the compiled matching of a run of results against the numpy
reference, row for row (what each takes, ignores and leaves to the caller), and the round it
feeds."""

from __future__ import annotations

import numpy as np
import pytest

from homagg import wire
from homagg.host_agent.engine import results

K = 64
PS = wire.packet_bytes(K)
JOB, GEN, SEQ0, NCHUNKS = 7, 3, 1000, 40
AUTH = 0x9E3779B9  # the job's key (its top bit set: the byte order shows)


def packet(c: int, *, flags: int = wire.FLAG_RESULT, job: int = JOB, gen: int = GEN,
           op: int = wire.OP_ADD, seq: int | None = None, fill: int | None = None,
           auth: int = AUTH) -> bytes:
    head = wire.header(op=op, job=job, worker=1, slot=c % 8, gen=gen,
                       seq=(SEQ0 + c) & 0xFFFFFFFF if seq is None else seq, auth=auth)
    head = bytearray(head)
    head[wire.OFFSETS["flags"]] = flags
    words = np.full(K, c * 1000 - 77 if fill is None else fill, ">i4")
    words[1] = -(2 ** 31) + c  # the sign bit survives
    return bytes(head) + words.tobytes()


def state():
    rng = np.random.default_rng(5)
    done = np.zeros(NCHUNKS, bool)
    done[[3, 11]] = True
    return {"done": done, "out": np.zeros(NCHUNKS * K, np.int32),
            "sent_at": np.round(rng.uniform(0, 1, NCHUNKS), 2),
            "resent": rng.uniform(0, 1, NCHUNKS) < 0.3}


def run_of(rows: list[bytes]) -> memoryview:
    assert all(len(r) == PS for r in rows)
    return memoryview(bytearray(b"".join(rows)))


CASES = {
    "plain in order": [packet(c) for c in range(12, 30)],
    "plain, shuffled, one done before": [packet(c) for c in (5, 2, 9, 3, 0, 7, 8, 1)],
    "a chunk twice, different words": [packet(4), packet(6), packet(4, fill=5), packet(6)],
    "odd rows among plain": [
        packet(1), packet(2, flags=wire.FLAG_RESULT | wire.FLAG_STATUS), packet(3, job=JOB + 1),
        packet(4, gen=GEN + 1), packet(5, op=wire.OP_JOIN), packet(6, seq=SEQ0 + NCHUNKS),
        packet(7, flags=wire.FLAG_RESULT | wire.FLAG_REFUSED), packet(8, flags=0),
        packet(9, op=wire.OP_OR), packet(10)],
    "another key (a forged result)": [
        packet(1), packet(2, auth=AUTH ^ 1), packet(3, auth=0), packet(4, auth=AUTH ^ 1 << 31),
        packet(5)],
    "overflow and retransmitted flags": [
        packet(20, flags=wire.FLAG_RESULT | wire.FLAG_OVERFLOW),
        packet(21, flags=wire.FLAG_RESULT | wire.FLAG_RETRANS | wire.FLAG_PHASE)],
    "a round tag before the round's (mod 2**32: far past it)": [
        packet(30), packet(31, seq=SEQ0 - 1), packet(32, seq=0)],
    "nothing plain": [packet(1, job=JOB + 1), packet(2, gen=0)],
}


@pytest.mark.skipif(not results.HAVE_NUMBA, reason="numba not installed")
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("after_odd", [False, True])
def test_compiled_matches_the_reference(case, after_odd):
    rows = CASES[case]
    got = {}
    for name, take in (("ref", results.take_ref), ("jit", results.take_jit)):
        st = state()
        new, odd = np.full(len(rows), -1, np.int64), np.full(len(rows), -1, np.int64)
        expect = results.head8(version_op=wire.OP_ADD, flags=wire.FLAG_RESULT, job=JOB,
                               gen=GEN)
        t = take(run_of(rows), len(rows), PS, K, SEQ0, NCHUNKS, expect, AUTH, st["done"],
                 st["out"], st["sent_at"], st["resent"], new, odd, after_odd)
        got[name] = (t, st, sorted(new[:t.added].tolist()), odd[:t.odd].tolist())
    (tr, sr, nr, orr), (tj, sj, nj, oj) = got["ref"], got["jit"]
    assert tj._replace(fresh_sum=0.0) == tr._replace(fresh_sum=0.0)
    assert tj.fresh_sum == pytest.approx(tr.fresh_sum)
    assert (nj, oj) == (nr, orr)
    for key in ("done", "out"):
        assert np.array_equal(sj[key], sr[key]), key


def test_the_reference_takes_first_copies_and_leaves_odd_rows():
    rows = CASES["a chunk twice, different words"] + [packet(3), packet(8, gen=0)]
    st = state()
    new, odd = np.empty(len(rows), np.int64), np.empty(len(rows), np.int64)
    expect = results.head8(version_op=wire.OP_ADD, flags=wire.FLAG_RESULT, job=JOB, gen=GEN)
    args = (run_of(rows), len(rows), PS, K, SEQ0, NCHUNKS, expect, AUTH, st["done"],
            st["out"], st["sent_at"], st["resent"], new, odd)
    first = results.take_ref(*args, False)
    assert (first.odd, first.added) == (1, 0) and odd[0] == 5 and not st["done"][[4, 6]].any()
    t = results.take_ref(*args, True)
    assert (t.odd, t.plain, t.added) == (1, 5, 2)  # chunk 3 was done before; 4 and 6 twice
    out = st["out"].reshape(-1, K)
    assert out[4, 0] == 4 * 1000 - 77 and out[4, 1] == -(2 ** 31) + 4  # the first copy
    assert st["done"][[4, 6]].all() and not st["done"][8]
    sent = st["sent_at"][[4, 6]]
    assert t.last == [4, 6][int(np.lexsort(([4, 6], sent))[-1])]


@pytest.mark.parametrize("take", [results.take_ref, results.take_jit] if results.HAVE_NUMBA
                         else [results.take_ref])
def test_a_result_without_the_jobs_key_is_left_to_the_caller(take):
    """A forged result (another key) is never written: it is an odd row, which ``Round.take``
    counts as spoofed."""
    rows = CASES["another key (a forged result)"]
    st = state()
    new, odd = np.empty(len(rows), np.int64), np.empty(len(rows), np.int64)
    expect = results.head8(version_op=wire.OP_ADD, flags=wire.FLAG_RESULT, job=JOB, gen=GEN)
    t = take(run_of(rows), len(rows), PS, K, SEQ0, NCHUNKS, expect, AUTH, st["done"], st["out"],
             st["sent_at"], st["resent"], new, odd, True)
    assert odd[:t.odd].tolist() == [1, 2, 3]
    assert sorted(new[:t.added].tolist()) == [1, 5]
    # (chunk 3 was done before: state())
    assert not st["done"][[2, 4]].any() and not st["out"].reshape(-1, K)[[2, 3, 4]].any()
