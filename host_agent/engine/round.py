"""One round of the streaming engine (``Transport.stream``): its chunks sent, lost ones found
and resent, and their results matched, until every chunk's result is in.

Lost chunks are found and resent by ``homagg.host_agent.engine.loss`` (timeouts, RACK, tail-loss
probes), which ``Round`` builds on.

Datagrams go out and come in by the run where the kernel allows (``homagg.udpio``: UDP GSO
and GRO): the chunks a window opens leave in one system call, and the results a peer sent
together come up in one, matched to their chunks with numpy a run at a time. Packets off the
common path (status replies, refusals, joins, strays) are taken one by one. The header is
``homagg.wire``'s (its struct, field list and status words): nothing of it is spelt out here.
"""

from __future__ import annotations

import select
import time
from typing import TYPE_CHECKING

import numpy as np

from homagg import udpio, wire
from homagg.host_agent.config import AgentError, AggregationTimeout
from homagg.host_agent.engine import deadline, results
from homagg.host_agent.engine.loss import PROBES, LossRecovery
from homagg.host_agent.engine.packets import pack

if TYPE_CHECKING:
    from homagg.host_agent.engine.transport import Transport

_WORDS_AT = wire.OFFSETS["words"]
#: Positions of the header fields a result is matched by, in ``wire.HEADER``'s tuple.
_FIELD_NAMES = [name for name, _, _ in wire.BYTE_FIELDS]
_FLAGS, _JOB, _SEQ, _GEN, _SLOT, _AUTH = (_FIELD_NAMES.index(f) for f in (
    "flags", "job", "seq", "gen", "slot", "auth"))
_VERSION_OP = _FIELD_NAMES.index("version_op")  # version (high nibble) and op (low)
_UNICAST = wire.FLAG_RETRANS | wire.FLAG_STATUS | wire.FLAG_REFUSED  # replies to one sender
#: Refusals (FLAG_REFUSED) that mean this agent's settings disagree with the switch's job.
_CONFIG_ERRORS = {
    "DROP_WRONG_IDENTITY": "the job table has this address for another job or worker id than "
                           "this agent's (job {job}, worker {worker}): check the agent's job "
                           "and worker against the controller's job list",
    "DROP_BAD_SLOT": "a slot outside the job's region: this agent uses {slots} slots, more "
                     "than the switch gave the job",
}


def _flat(words: np.ndarray) -> np.ndarray:
    """A round's words as int32 (bit sets come as uint32)."""
    return words.view(np.int32) if words.dtype == np.uint32 else words


class SwitchOverflow(Exception):
    """The switch flagged an int32 overflow in a round (raised after the round completed)."""



class Round(LossRecovery):
    """One ``Transport.stream`` call: its chunks in flight, and the loop that completes them.

    Chunk c of the call is global chunk g0 + c. Per chunk: its result (``out``), whether it is
    ``done``, when it was last sent, its timeout, and whether it was ever ``resent`` (then its
    round trip is no RTT sample).

    A fused round (``second``: an op and its words) is two rounds' words in one window: the
    first part's chunks, then the second's from chunk ``split`` on, each with its own op
    (``Transport.stream_fused``); one round trip for both. ``run`` returns the first part's
    result, ``second_out`` the second's.
    """

    def __init__(self, t: Transport, op: int, words: np.ndarray, join_nonce: int | None = None,
                 second: tuple[int, np.ndarray] | None = None, flagged: bool = False):
        cfg = t.cfg
        self.t, self.cfg, self.counters = t, cfg, t.counters
        self.join = join_nonce is not None  # the join: one packet, its seq the nonce
        assert second is None or not self.join
        # K words per chunk; a join has JOIN_WORDS (K is what its reply tells)
        self.k = K = wire.JOIN_WORDS if self.join else t.k
        self.n = n = words.size
        self.split = split = 1 if self.join else max(1, -(-n // K))  # the first part's chunks
        self.n2 = n2 = 0 if second is None else second[1].size
        self.nchunks = nchunks = split + (0 if second is None else max(1, -(-n2 // K)))
        self.psize = wire.JOIN_BYTES if self.join else t.packet_bytes
        self.g0 = g0 = 0 if self.join else t.chunk
        self.gen: int | None = None if self.join else t.gen
        S = cfg.slots
        flags = wire.FLAG_OVERFLOW if flagged else 0  # (a partial sum that overflowed)
        head, self.h8_plain = t.headers(op, self.gen or 0, flags)
        parts = [(head, words, 0, split)]
        self.h8_second = self.h8_plain
        if second is not None:
            head2, self.h8_second = t.headers(second[0], self.gen or 0, flags)
            parts.append((head2, second[1], split, nchunks - split))
        # (a round's packets and results are kept by the transport for its next rounds: not
        # faulted in afresh each round, engine.scratch)
        alloc = np.empty if self.join else t.scratch.empty
        batch = alloc(nchunks, wire.packet_dtype(K))
        for h, w, at, m in parts:  # each part's packets in their place
            if t.native is not None and not self.join:  # the same bytes, in one pass in C
                t.native.pack(_flat(w), K, m, g0 + at, S, h, out=batch[at:at + m])
            else:
                pack(_flat(w), K, m, g0 + at, S, h, join_nonce, out=batch[at:at + m])
        self.batch = batch  # (the native engine sends from its memory)
        self.buf = batch.view(np.uint8).data
        assert len(self.buf) == nchunks * self.psize

        self.out = alloc(nchunks * K, np.int32)  # (every chunk's result is written in it)
        self.done = np.zeros(nchunks, bool)
        self.sent_at = np.full(nchunks, np.inf)
        self.rto = np.full(nchunks, t.rtt.rto)
        self.resent = np.zeros(nchunks, bool)
        self.held = np.zeros(nchunks, bool)  # the switch said it holds our contribution
        self.held_count = np.zeros(nchunks, np.int32)  # the most contributors a status named
        # RACK: the latest-sent chunk whose result came back (its send time, its number) and
        # that result's round trip
        self.rack_ts, self.rack_c, self.rack_rtt = -np.inf, -1, 0.0
        self.overflow = False
        self.ndone = 0
        self.next_c = 0
        self.interval = 1.0 / cfg.rate_pps if cfg.rate_pps else 0.0
        # the transport's congestion window and pacing (a fixed rate_pps paces instead; a join
        # is one packet)
        self.cc = None if self.join or cfg.rate_pps else t.cc
        self.cc_done = 0  # results the window has been told of
        self.next_send = time.monotonic()
        self.last_progress = time.monotonic()  # the last result (or the round's start)
        self.last_new = -np.inf  # the last send of new chunks (or of RACK's resends)
        self.nprobes = 0         # tail-loss probes since the last result (PROBES at most)
        self.held_probes = 0     # and past those, while lossy (HELD_PROBES at most)
        self.probe_c = -1        # the chunk probed
        self.last_status = -np.inf  # when the latest status reply came (held_back)
        self.status: dict[int, tuple[int, int]] = {}
        self.upstream: set[int] = set()  # chunks whose status came from a parent switch
        self.refused: dict[int, str] = {}  # chunk -> the DROP_* reason the switch gave
        # chunk -> (configuration refusals counted, the send each answered): one that is not
        # repeated for a later send of the chunk may be a forgery, and is not fatal
        self.config_refusals: dict[int, tuple[int, float]] = {}
        self.t_start = time.monotonic()
        self.seq0 = (g0 + 1) & 0xFFFFFFFF if join_nonce is None else join_nonce
        # (h8_plain, above: a plain result's first 8 header bytes under results.MASK, for
        # take_run) the matching's scratch: the chunks a run completed, and its rows off the
        # common path
        most = len(t.rbuf) // self.psize + 1
        self.new_chunks, self.odd_rows = np.empty(most, np.int64), np.empty(most, np.int64)

    def run(self) -> np.ndarray:
        t, end = self.t, self.g0 + self.nchunks
        if t.native is not None and not self.join and t.native.serves(t.sock):
            t.native.drive(self)  # (the same loop, in C: engine.native)
        while self.ndone < self.nchunks:
            now = time.monotonic()
            self.send_new(now)
            pending = self.in_flight()
            self.receive(self.wake_at(pending, now))
            now = time.monotonic()
            if self.cc is not None:
                self.congestion(pending, now)
            pending = self.retransmit(pending, now)
            self.give_up_if_silent(pending, now)
        if self.join:
            return self.out[:self.n]
        t.chunk = end
        self.counters.rounds += 1
        self.counters.seconds += time.monotonic() - self.t_start
        if self.overflow:
            raise SwitchOverflow()
        return self.out[:self.n]

    def second_out(self) -> np.ndarray:
        """A fused round's second part's result (once ``run`` is through)."""
        at = self.split * self.k
        return self.out[at:at + self.n2]


    def give_up_if_silent(self, pending: np.ndarray, now: float) -> None:
        """Fail the round (``timeout``) after ``deadline`` seconds without a result, or soon
        once the controller says the job is gone."""
        t = self.t
        silent = now - self.last_progress
        gone = self.cfg.membership is not None and self.cfg.membership.lost is not None
        # (the controller says the job is gone: fail without the whole deadline)
        if silent > self.cfg.deadline or (gone and silent > max(1.0, 4 * t.rtt.rto)):
            t.chunk = t.chunk if self.join else self.g0 + self.nchunks
            t.broken = "timeout"
            raise self.timeout(pending)

    # -- sending -------------------------------------------------------------------------------
    def send(self, c: int) -> None:
        t = self.t
        try:
            t.sock.sendto(self.buf[c * self.psize:(c + 1) * self.psize], t.switch)
        except BlockingIOError:
            return  # socket buffer full: the timeout resends it
        except OSError as e:
            t.broken = str(e)
            raise AgentError(f"{t.who}: cannot send to the switch {t.switch[0]}:{t.switch[1]}: "
                             f"{e}") from None
        if self.join:
            self.counters.join_packets += 1
        else:
            self.counters.packets_sent += 1
            self.counters.bytes_sent += self.psize
        if self.interval:
            self.next_send = max(self.next_send + self.interval,
                                 time.monotonic() - 4 * self.interval)

    def congestion(self, pending: np.ndarray, now: float) -> None:
        """Tell the congestion window what came back since the last call, and whether the
        round has gone silent: chunks out, and no result for a timeout's length since this
        round's last (TCP's timer runs from the last acknowledgement). Silence is what every
        worker of the job sees alike (a chunk's result comes back to all of them), so their
        windows are cut together and stay alike: a worker whose window were cut alone would
        hold back chunks its peers have sent, whose timeouts would then resend them. Not
        before the round's first result: until then the round waits for its peers to start
        it (a DDP step's workers reach a bucket apart), which no window changes."""
        cc = self.cc
        assert cc is not None
        cc.on_time(self.ndone - self.cc_done, now)
        self.cc_done = self.ndone
        if pending.size and self.ndone and now - self.last_progress >= self.t.rtt.rto:
            cc.timeout(now)

    def send_new(self, now: float) -> None:
        """New chunks, as the window (slot reuse, and the congestion window if on) and pacing
        allow: unpaced, every chunk the window opens, in one run (their bytes are consecutive
        in ``buf``)."""
        S, c0 = self.cfg.slots, self.next_c
        window = self.cc.window if self.cc is not None else S
        room = window - (c0 - self.ndone)  # every chunk before next_c was sent, done or not
        if self.interval and self.cc is None:  # a fixed rate (rate_pps), a chunk at a time
            if (c0 < self.nchunks and (c0 < S or self.done[c0 - S]) and room > 0
                    and now >= self.next_send):
                self.send(c0)
                self.sent_at[c0] = now
                self.next_c += 1
                self.last_new = now
            return
        # chunk c may go once chunk c - S (same slot) is done: the run ends at the first that
        # may not
        end = min(self.nchunks, max(c0, S))
        if end < self.nchunks:
            waiting = np.flatnonzero(~self.done[end - S:self.nchunks - S])
            end = self.nchunks if not waiting.size else end + int(waiting[0])
        if self.cc is not None:
            end = self.paced_end(c0, min(end, c0 + room), now)
        if end <= c0:
            return
        self.send_run(c0, end)
        if end == self.nchunks and not self.join and self.lossy():
            self.tail_copy(end - 1)
        self.sent_at[c0:end] = now
        self.next_c = end
        self.last_new = now

    def tail_copy(self, c: int) -> None:
        """While RACK has found losses lately (``lossy``), a round's last chunk goes out twice:
        nothing is sent after it, so its loss (or a peer's) is found only by a probe timeout of
        silence, the round's slowest recovery; a second copy makes that rare, for one datagram
        a round (``Counters.tail_copies``). Fault-free on the software target RACK finds
        nothing, so there is none."""
        self.send(c)
        self.counters.tail_copies += 1

    def paced_end(self, c0: int, end: int, now: float) -> int:
        """``end`` cut to what the congestion control's pacing allows now; sets when to wake
        for the next (``next_send``, which ``wake_at`` reads while ``interval`` is set)."""
        cc = self.cc
        assert cc is not None
        self.interval, self.next_send = 0.0, np.inf
        if end <= c0:  # the window (or a slot) is closed: a result opens it
            return end
        paced = min(end, c0 + cc.allowance(now))
        cc.spend(paced - c0)
        if paced < end:
            self.next_send = cc.ready_at(now)
            self.interval = 1.0 / cc.rate()
        return paced

    def send_run(self, c0: int, end: int) -> None:
        """Chunks c0 .. end - 1, as few system calls as the socket allows. What a full socket
        buffer stops is left to the timeout, as in ``send``."""
        t = self.t
        try:
            n = t.sock.send_many(self.buf[c0 * self.psize:end * self.psize], self.psize,
                                 t.switch)
        except OSError as e:
            t.broken = str(e)
            raise AgentError(f"{t.who}: cannot send to the switch {t.switch[0]}:{t.switch[1]}: "
                             f"{e}") from None
        if self.join:
            self.counters.join_packets += n
        else:
            self.counters.packets_sent += n
            self.counters.bytes_sent += n * self.psize

    def receive(self, wake: float) -> None:
        """Wait until ``wake`` for datagrams, then take every one queued. Datagrams of the
        round's size from the switch are gathered end to end in the transport's buffer (each
        receive appends its run, or its one datagram) and matched together by ``take_run``
        once the socket is empty (or the buffer full): one set of array operations for every
        datagram a wake-up finds, whatever runs they came in. Others are taken at once."""
        t = self.t
        sock, view, psize = t.sock, t.rview, self.psize
        r, _, _ = select.select([sock], [], [], max(0.0, wake - time.monotonic()))
        if not r:
            return
        switch_ip, join = t.switch[0], self.join
        fill = 0  # bytes of whole datagrams of psize gathered in view[:fill]
        room = len(view) - udpio.RECV_BYTES  # past this, match what is gathered first
        while True:
            try:
                nb, seg, src = sock.recv_many(view[fill:fill + udpio.RECV_BYTES])
            except BlockingIOError:
                break
            if (src[0] != switch_ip
                    or not wire.HOMAGG_UDP_PORT_MIN <= src[1] <= wire.HOMAGG_UDP_PORT_MAX):
                self.counters.ignored += -(-nb // seg) if seg else 1
                continue
            if seg == psize and not join:
                full = nb - nb % psize
                at, fill = fill + full, fill + full
                if full < nb:  # a shorter last datagram: now, before the next receive's bytes
                    self.take(view[at:fill + nb - full])
                if fill > room:
                    self.take_run(view[:fill], fill // psize)
                    fill = 0
                continue
            for at in range(fill, fill + nb, seg or 1):
                self.take(view[at:min(at + seg, fill + nb)])
        if fill:
            self.take_run(view[:fill], fill // psize)

    def take_run(self, run: memoryview, count: int) -> None:
        """``count`` datagrams of a round's size from the switch, end to end: results on the
        common path (this job, run and op, no status or refusal, a chunk of this round) are
        matched and written in one pass (``results.take``: compiled, or numpy's); every
        other datagram goes through ``take`` first, which decides as for any single one."""
        ps = self.psize
        args = (run, count, ps, self.k, self.seq0, self.nchunks, self.h8_plain, self.cfg.key,
                self.done, self.out, self.sent_at, self.resent, self.new_chunks, self.odd_rows)
        fused = (self.split, self.h8_second)
        got = results.take(*args, False, *fused)
        if got.odd:
            for row in self.odd_rows[:got.odd].tolist():
                self.take(run[row * ps:(row + 1) * ps])
            got = results.take(*args, True, *fused)
        self.counters.ignored += got.plain - got.added
        if not got.added:
            return
        self.ndone += got.added
        now = time.monotonic()
        self.delivered(got.last, now)
        if got.fresh:  # one sample per run (its mean), as TCP takes one per window
            self.t.rtt.sample(now - got.fresh_sum / got.fresh)
            self.rto[self.next_c:] = self.t.rtt.rto
        self.counters.results += got.added
        self.overflow |= got.overflow
        self.last_progress = now
        self.nprobes = self.held_probes = 0
        if self.status:
            for cc in self.new_chunks[:got.added].tolist():
                self.status.pop(cc, None)

    def take(self, pkt: memoryview) -> None:
        """One datagram from the switch's address: a result, a status reply, or something to
        ignore."""
        t, cfg, nb = self.t, self.cfg, len(pkt)
        if nb != (wire.JOIN_BYTES if self.join else t.packet_bytes):
            self.counters.ignored += 1
            return
        head = wire.HEADER.unpack_from(pkt)
        if head[_AUTH] != cfg.key:  # not from the switch: without the job's key
            self.counters.spoofed += 1
            return
        flags, job, seq = head[_FLAGS], head[_JOB], head[_SEQ]
        is_join = head[_VERSION_OP] & 0xF == wire.OP_JOIN
        if self.join:
            # The join's multicast echoes the header of the packet that completed it (another
            # worker's nonce): any join result is ours while we wait for one. A reply to the
            # sender alone (a retransmitted result, a status, a refusal) echoes its nonce: one
            # for another nonce is to this address's previous agent (a restarted worker).
            unicast = flags & _UNICAST and not flags & wire.FLAG_UPSTREAM
            c = 0 if is_join and not (unicast and seq != self.seq0) else self.nchunks
        else:
            c = (seq - self.seq0) & 0xFFFFFFFF
            if is_join or head[_GEN] != self.gen:  # a late join reply; another run's result
                c = self.nchunks
        if job != cfg.job or not flags & wire.FLAG_RESULT or c >= self.nchunks:
            self.counters.ignored += 1
            return
        if self.join and not t.k:  # the join's first reply: the switch's K, in its slot field
            t.learn_words(head[_SLOT])
        K = self.k
        if flags & wire.FLAG_REFUSED:
            self.refused_by_switch(c, int.from_bytes(pkt[_WORDS_AT + 4 * (K - 1):
                                                         _WORDS_AT + 4 * K], "big"),
                                   bool(flags & wire.FLAG_UPSTREAM))
            return
        if self.join and not flags & wire.FLAG_STATUS:
            self.gen = head[_GEN]
        if flags & wire.FLAG_STATUS:
            # The switch holds our contribution; the round waits for peers, so only a lost
            # result could need us again: resend on the timeout, and no probe. Not progress:
            # the deadline still runs.
            st = wire.parse_status(np.frombuffer(pkt, ">i4", K, _WORDS_AT))
            if flags & wire.FLAG_UPSTREAM:
                # a tree's parent: our switch holds every local contribution; the parent
                # waits for another child switch
                self.status[c] = st
                self.upstream.add(c)
            elif not (c in self.upstream and st[1] >= (cfg.local_workers or cfg.workers)):
                # (our leaf's "every worker here has sent", which its other workers get while
                # the designated one's resends go up, says less than the parent's status)
                self.status[c] = st
                self.upstream.discard(c)
            if self.nprobes and c == self.probe_c and self.nprobes < PROBES:
                # (an estimate: the status may answer an earlier copy)
                self.counters.probes_held += 1
                self.nprobes = PROBES  # answered: no second probe
            self.sent_at[c] = self.last_status = time.monotonic()
            if self.join:  # a join waits for peers to start, which may take seconds
                self.rto[c] = cfg.max_timeout
            elif st[1] > self.held_count[c]:
                # more contributors than any status of this chunk said before: the round
                # moves (a peer recovered), so its result is near; the backoff starts over
                # (at most once per contributor). Not the probe timeout: a peer may lag that
                # long with no loss anywhere (under load, a chunk re-asked every probe timeout
                # cost 2.6% more datagrams fault-free)
                self.rto[c] = t.rtt.rto
            self.held_count[c] = max(self.held_count[c], st[1])
            self.held[c] = True
            return
        if self.done[c]:
            self.counters.ignored += 1
            return
        self.out[c * K:(c + 1) * K] = np.frombuffer(pkt, ">i4", K, _WORDS_AT)
        self.done[c] = True
        self.ndone += 1
        self.delivered(c, time.monotonic())
        if not self.resent[c]:
            t.rtt.sample(time.monotonic() - self.sent_at[c])
            self.rto[self.next_c:] = t.rtt.rto
        self.counters.results += 1
        self.overflow |= bool(flags & wire.FLAG_OVERFLOW)
        self.last_progress = time.monotonic()
        self.nprobes = self.held_probes = 0
        self.status.pop(c, None)

    def refused_by_switch(self, c: int, reason: int, upstream: bool = False) -> None:
        """The switch dropped our chunk ``c`` and said why (FLAG_REFUSED). A wrong identity or
        slot is this agent's configuration: fail once a resend of the chunk is refused again
        (one refusal could be forged: the chunk is resent soon, and gets its result if so). A
        stale or mismatched round is kept for the timeout's message. ``upstream``: a tree's
        parent switch refused our switch's partial sum (the tree's configuration)."""
        t, cfg = self.t, self.cfg
        name = wire.STATS.get(reason, f"drop reason {reason}")
        if name in _CONFIG_ERRORS:
            n, answered = self.config_refusals.get(c, (0, -1.0))
            sent = float(self.sent_at[c])
            if sent != answered:  # a refusal of a send not refused before
                n += 1
            self.config_refusals[c] = (n, sent)
            self.counters.refusals += 1
            if n < 2:
                self.refused[c] = name
                self.rto[c] = min(self.rto[c], t.rtt.rto)  # a real refusal comes again soon
                return
        if upstream and name in _CONFIG_ERRORS:
            t.broken = name
            raise AgentError(f"{t.who}: the parent switch of {t.switch[0]}:{t.switch[1]} drops "
                             f"its partial sums of job {cfg.job} as {name}: the tree's jobs "
                             "disagree (`homagg-ctl` installs a tree's jobs together)")
        if name in _CONFIG_ERRORS:
            t.broken = name
            why = _CONFIG_ERRORS[name].format(job=cfg.job, worker=cfg.worker, slots=cfg.slots)
            raise AgentError(f"{t.who}: the switch {t.switch[0]}:{t.switch[1]} drops this "
                             f"worker's packets as {name}: {why}")
        self.refused[c] = name

    # -- giving up -----------------------------------------------------------------------------
    def timeout(self, pending: np.ndarray) -> AggregationTimeout:
        """The deadline's error: what the switch said of the round, and whom it waits for."""
        return deadline.timeout_error(self, pending)
