"""A light load for the software aggregator: every worker of one job in one process, sending
prebuilt rounds (bench/pps.py's ``--shards`` measurement).

    python -m bench.loadgen --job 1 --switch 127.0.0.254:48864 --bind 127.0.1.1:5000 \\
        --bind 127.0.1.2:5000 --slots 63 --words 256 --seconds 5 --out load.json

Round r: each worker sends one packet to each of the job's S slots (seq r + 1, phase r mod 2,
op add, gen 0: no join, the job's slots are fresh), prebuilt, as one GSO run (one system
call), then waits for every slot's result; a round not complete after 0.2 s is sent again (the
aggregator answers repeats from its slot memory). Every result is checked against the integer
sum of the workers' words: a worker's results come up in one receive (GRO), and the first
complete run of each worker and phase is checked field by field with numpy (slot, seq, result
and phase flags, job, and every word against the sum) and kept; every later run must then
equal it byte for byte but for its seq, which the kept copy takes before one memcmp
(``bytearray.startswith``). A run that is not whole, or differs, is checked result by result
with numpy instead (counted: ``slow_checks``). No codec, no agent state, blocking sockets with
a kernel receive timeout (no poll per call): the generator's work per datagram is a fraction of
the aggregator's, so the aggregator, not its load, sets the rate. Writes JSON: rounds completed,
seconds, resends, the datagrams the rounds moved (2 x workers x S per round: contributions in,
results out), runs checked by memcmp and by numpy, and the process's CPU seconds (user, and
user + system).
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import struct
import time
from pathlib import Path

import numpy as np

from homagg import udpio, wire

#: How long a worker waits for its round's results before sending its run again (s).
RESEND_AFTER = 0.2


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
    ap.add_argument("--key", type=lambda s: int(s, 0), default=0,
                    help="the job's key (its config's): every packet carries it")
    a = ap.parse_args(argv)
    k, n, workers = a.words, a.slots, len(a.bind)
    size = wire.packet_bytes(k)
    socks = [_socket(addr, a.switch) for addr in a.bind]
    dt = wire.packet_dtype(k)
    rng = np.random.default_rng(a.job)
    runs = [np.zeros(n * size, np.uint8) for _ in range(workers)]  # sent as they are
    rec = [r.view(dt) for r in runs]  # the same bytes as records: seq and flags set in place
    for w, r in enumerate(rec):
        r["version_op"] = (wire.HOMAGG_VERSION << 4) | wire.OP_ADD
        r["job"], r["worker"], r["slot"], r["flags"] = a.job, w, np.arange(n), 0
        r["auth"] = a.key
        r["words"] = rng.integers(-(2**20), 2**20, (n, k))
    expect = np.sum([r["words"].astype(np.int64) for r in rec], axis=0).astype(np.int32)
    seq_at, flags_at = wire.OFFSETS["seq"], wire.OFFSETS["flags"]
    # each worker's run, sent as it is: its seq and flags columns set in place each round
    # (one run per worker, not one per phase: the less memory the rounds touch, the less
    # the sends' copies cost); seq: 4-byte words (size is a multiple of 4)
    seqs = [_column(r, size, seq_at) for r in runs]
    flags = [r.reshape(n, size)[:, flags_at] for r in runs]
    # a run's GSO sends: (bytes, cmsg) per system call, at most udpio's segments and bytes
    per_call = max(1, min(udpio.MAX_SEGMENTS, udpio.MAX_GSO_BYTES // size)) * size
    gso = [(socket.SOL_UDP, udpio.UDP_SEGMENT, struct.pack("=H", size))]
    calls = [[(v, gso if len(v) > size else []) for v in
              (memoryview(r)[at:at + per_call] for at in range(0, n * size, per_call))]
             for r in runs]
    #: (worker, phase) -> the first complete run of results, checked in full; its seq column
    kept: dict[tuple[int, int], tuple[bytearray, np.ndarray]] = {}
    buf = bytearray(udpio.RECV_BYTES)
    anc_space, whole = socket.CMSG_SPACE(4), n * size
    while time.time() < a.start_at:
        time.sleep(0.001)
    rounds = resends = fast = slow = 0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    end = t0 + a.seconds
    while time.monotonic() < end:
        seq, phase = rounds + 1, rounds & 1
        for w, sock in enumerate(socks):
            seqs[w].fill(seq)  # (fill: a fifth of a slice assignment's cost)
            flags[w].fill(wire.FLAG_PHASE if phase else 0)
            for data, cmsg in calls[w]:
                sock.sendmsg([data], cmsg)
        # the last worker's results first: the aggregator sends a round's results worker by
        # worker, in order, so once the last worker's are here the others' are too, and
        # the round costs one wakeup, not one per worker
        for w in reversed(range(workers)):
            sock, got = socks[w], None
            while True:
                try:
                    nb, anc, _, _ = sock.recvmsg_into([buf], anc_space)
                except BlockingIOError:  # a round lost (the receive timeout): send it again
                    resends += 1
                    for data, cmsg in calls[w]:
                        sock.sendmsg([data], cmsg)
                    continue
                seg = (struct.unpack("=i", anc[0][2])[0] if anc else 0) or nb
                mine = kept.get((w, phase))
                if nb == whole and seg == size and mine is not None:
                    # the common case: the round's results in one run, equal to the run
                    # checked in full but for seq
                    mine[1].fill(seq)
                    if buf.startswith(mine[0]):
                        fast += 1
                        break
                # any other run: each result in it checked against the sum
                slow += 1
                if seg != size or nb % size:
                    continue
                res = np.frombuffer(buf, dt, nb // size)
                ok = ((res["seq"] == seq) & (res["flags"] & wire.FLAG_RESULT != 0)
                      & (res["job"] == a.job)
                      & ((res["flags"] & wire.FLAG_PHASE != 0) == bool(phase)))
                res = res[ok]
                if res.size and not (res["words"] == expect[res["slot"]]).all():
                    raise SystemExit(f"job {a.job}: round {seq}: a result is not the sum")
                if got is None:
                    got = np.zeros(n, bool)
                got[res["slot"]] = True
                if (mine is None and nb == whole and res.size == n
                        and (res["slot"] == np.arange(n)).all()):
                    # all checked, in slot order: kept (shared with another worker's where
                    # the bytes are the same: the aggregator multicasts one result)
                    mine = None
                    for (_, p), other in kept.items():
                        other[1].fill(seq)
                        if p == phase and buf.startswith(other[0]):
                            mine = other
                            break
                    if mine is None:
                        copy = bytearray(buf[:nb])
                        mine = copy, _column(np.frombuffer(copy, np.uint8), size, seq_at)
                    kept[w, phase] = mine
                if got.all():
                    break
        rounds += 1
    seconds = time.monotonic() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    a.out.write_text(json.dumps({
        "job": a.job, "rounds": rounds, "seconds": seconds, "resends": resends,
        "datagrams": 2 * workers * n * rounds,
        "fast_checks": fast, "slow_checks": slow,
        "cpu": ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime,
        "user": ru.ru_utime - ru0.ru_utime}))
    return 0


def _socket(addr: tuple[str, int], switch: tuple[str, int]) -> socket.socket:
    """A worker's socket: blocking, with a kernel receive timeout (a receive raises
    BlockingIOError after RESEND_AFTER s; Python's own timeout would poll before every call),
    UDP GRO (a run of results in one receive), connected to the aggregator (a send parses no
    address and looks up no route; the aggregator answers from the port it was sent to)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    usec = int(RESEND_AFTER * 1e6)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", usec // 10**6,
                                                                    usec % 10**6))
    try:
        s.setsockopt(socket.SOL_UDP, udpio.UDP_GRO, 1)
    except OSError as e:
        raise SystemExit(f"bench.loadgen needs UDP GRO (Linux 5.0): {e}") from None
    s.bind(addr)
    s.connect(switch)
    return s


def _column(run: np.ndarray, size: int, at: int) -> np.ndarray:
    """The 4-byte field at byte ``at`` of every datagram of a run of ``size``-byte datagrams,
    as a writable big-endian view (size and at: multiples of 4)."""
    return run.view(">u4").reshape(-1, size // 4)[:, at // 4]


if __name__ == "__main__":
    raise SystemExit(main())
