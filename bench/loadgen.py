"""A light load for the software aggregator: every worker of one job in one process, sending
prebuilt rounds (bench/pps.py's ``--shards`` measurement).

    python -m bench.loadgen --job 1 --switch 127.0.0.254:48864 --bind 127.0.1.1:5000 \\
        --bind 127.0.1.2:5000 --slots 63 --words 256 --seconds 5 --out load.json

Round r: each worker sends one packet to each of the job's S slots (seq r + 1, phase r mod 2,
op add, gen 0: no join, the job's slots are fresh), as one GSO run, then waits for every
slot's result (one round in ``CHECK_EVERY`` compared in full with the integer sum of the
workers' words; every round's count and first and last seq checked); a round not complete
after 0.2 s is sent again (the aggregator answers repeats from its slot memory). No codec, no
agent state: the generator's work per datagram is a fraction of the aggregator's, so the
aggregator, not its load, sets the rate. Writes JSON: rounds completed, seconds, resends, the
datagrams the rounds moved (2 x workers x S per round: contributions in, results out) and the
process's CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import time
from pathlib import Path

import numpy as np

from homagg import udpio, wire

#: Rounds whose results are compared in full with the sum: one in CHECK_EVERY (the others:
#: their count, and the seq and flags of the first and the last), so the load stays light.
CHECK_EVERY = 8


def _addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--switch", type=_addr, required=True, help="IP:PORT")
    ap.add_argument("--bind", type=_addr, action="append", required=True,
                    help="IP:PORT of worker 0, 1, ... (once per worker)")
    ap.add_argument("--slots", type=int, default=63)
    ap.add_argument("--words", type=int, default=wire.WORDS_PER_PACKET)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--start-at", type=float, default=0.0,
                    help="time.time() to start at (the generators of a run start together)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    k, n, workers = a.words, a.slots, len(a.bind)
    size = wire.packet_bytes(k)
    socks = []
    for addr in a.bind:
        raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        raw.bind(addr)
        raw.settimeout(0.2)
        socks.append(udpio.BatchSocket(raw))
    dt = wire.packet_dtype(k)
    rng = np.random.default_rng(a.job)
    runs = [np.zeros(n * size, np.uint8) for _ in range(workers)]  # sent as they are
    rec = [r.view(dt) for r in runs]  # the same bytes as records: seq and flags set in place
    for w, r in enumerate(rec):
        r["version_op"] = (wire.HOMAGG_VERSION << 4) | wire.OP_ADD
        r["job"], r["worker"], r["slot"] = a.job, w, np.arange(n)
        r["words"] = rng.integers(-(2**20), 2**20, (n, k))
    expect = np.sum([r["words"].astype(np.int64) for r in rec], axis=0).astype(np.int32)
    want = expect.astype(">i4").view(np.uint8).reshape(n, 4 * k)  # the results' words, as sent
    slots = np.arange(n)
    words_at, seq_at, slot_at = wire.OFFSETS["words"], wire.OFFSETS["seq"], wire.OFFSETS["slot"]
    # each worker's run per phase, and its seq column (4-byte words: size is a multiple of 4)
    for r in rec:
        r["flags"] = 0
    phased = [[r.copy(), r.copy()] for r in runs]
    for w in range(workers):
        phased[w][1].view(dt)["flags"] = wire.FLAG_PHASE
    seqs = [[x.view(">u4").reshape(n, size // 4)[:, seq_at // 4] for x in ph] for ph in phased]
    buf = bytearray(udpio.RECV_BYTES)
    while time.time() < a.start_at:
        time.sleep(0.001)
    rounds = resends = 0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    end = t0 + a.seconds
    while time.monotonic() < end:
        seq, phase = rounds + 1, rounds & 1
        for w, sock in enumerate(socks):
            seqs[w][phase][:] = seq
            sock.send_many(phased[w][phase], size, a.switch)
        for w, sock in enumerate(socks):
            got = np.zeros(n, bool)
            while not got.all():
                try:
                    nb, seg, _ = sock.recv_many(buf)
                except TimeoutError:  # a round lost: send this worker's again
                    resends += 1
                    sock.send_many(phased[w][phase], size, a.switch)
                    continue
                if seg != size or nb % size:
                    continue
                if (nb == n * size and buf[1] & buf[nb - size + 1] & wire.FLAG_RESULT
                        and int.from_bytes(buf[seq_at:seq_at + 4], "big") == seq
                        and int.from_bytes(buf[nb - size + seq_at:nb - size + seq_at + 4],
                                           "big") == seq):
                    # the common case: the round's results in one run (the first and the last
                    # are this round's results); in full every CHECK_EVERY rounds
                    if rounds % CHECK_EVERY == 0:
                        rows = np.frombuffer(buf, np.uint8, nb).reshape(n, size)
                        if not ((rows[:, slot_at:slot_at + 2].view(">u2")[:, 0] == slots).all()
                                and (rows[:, seq_at:seq_at + 4].view(">u4")[:, 0] == seq).all()
                                and np.array_equal(rows[:, words_at:], want)):
                            raise SystemExit(f"job {a.job}: round {seq}: a result is not the "
                                             "sum")
                    break
                res = np.frombuffer(buf, dt, nb // size)
                mine = res[(res["seq"] == seq) & (res["flags"] & wire.FLAG_RESULT != 0)]
                if mine.size and not (mine["words"] == expect[mine["slot"]]).all():
                    raise SystemExit(f"job {a.job}: round {seq}: a result is not the sum")
                got[mine["slot"]] = True
        rounds += 1
    seconds = time.monotonic() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    a.out.write_text(json.dumps({
        "job": a.job, "rounds": rounds, "seconds": seconds, "resends": resends,
        "datagrams": 2 * workers * n * rounds,
        "cpu": ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime,
        "user": ru.ru_utime - ru0.ru_utime}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
