"""The switch model, one pass of the TNA program (p4/tofino/homagg_tna.p4) at a time: what a
frame on a port must come out as, from the model's rules, to check tests generated from the
TNA program (P4Testgen's Tofino target, ``homagg.controller.tna_testgen``) against them.

P4Testgen executes one pass: a frame on an ingress port, the tables and register cells it
chose, and the frame that leaves (on a port, or recirculated) or a drop. The model works on
whole datagrams, so ``expect`` projects its answer onto the pass the TNA design says carries
it (docs/switch.md, "Tofino"): a worker's datagram (pass 1) is ``SwitchModel.process`` from
the state the registers hold (``seed``); a reply to the sender leaves on the ingress port, a
completed round recirculates (``bridge_h`` in front) with the result's high lanes, a finished
round's retransmission with the bridge that asks for them, the join's multicast as the
replica ``result_dst`` addresses; a recirculated pass reads the low lanes (or the high ones)
of the copy ``bridge_h`` names, so that what leaves is the model's result; anything else is
plain forwarding (the v1model program's forwarding.p4).

What the TNA design declares different from the model is taken in only where asked
(``DIFFERENCES``). A test whose tables or registers no run of homagg's control plane and
protocol reaches has no model state to compare with: ``Outside`` says which.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from homagg import paths, wire
from homagg.switch_model.model import SwitchModel
from homagg.switch_model.state import JobEntry
from homagg.switch_model.tna_frame import (
    ETH,
    HB,
    IP4,
    UDP,
    Frame,
    bridge_bytes,
    ipv4_checksum,
    parse,
    parse_bridge,
)

#: Tofino drops what ingress sends to port 511, and (PTF) a packet leaving ingress under 30 B
DROP_PORT, PTF_MIN = 511, 30
#: What the TNA design declares it does otherwise (docs/switch.md, "Tofino"), for ``TnaPass``
NO_OVERFLOW, NO_COUNT, RUNS, JOIN_WORDS = "no overflow flag", "no count kept", \
    "runs told apart by their number", "a join's reply keeps the join's words"
DIFFERENCES = {
    NO_OVERFLOW: "adds wrap: a result never carries FLAG_OVERFLOW",
    NO_COUNT: "a status reply's count word is 0 (the agent counts the bitmap)",
    RUNS: "a copy another run wrote is empty to this packet, older run or not; no join "
          "nonce is kept, so a join that is not a member's of its run is taken (nonce 0 too)",
    JOIN_WORDS: "a join's replies carry its words back (its run word 0), not zeros",
}


@cache
def tna_constants() -> dict[str, int]:
    """The TNA program's own constants (bridge kinds, the words per pass, the recirculation
    port), read from its sources: one source of truth."""
    tofino = paths.p4_dir() / "tofino" / "include"
    out = {m[1]: int(m[2], 0) for m in re.finditer(
        r"const\s+bit<\d+>\s+(\w+)\s*=\s*(\w+);", (tofino / "headers.p4").read_text())}
    size = (tofino / "size.p4").read_text()
    out["WORDS"] = out["WORDS_T2"] = int(re.findall(r"#define WORDS_PER_PACKET (\d+)", size)[0])
    out["MAX_WORKERS"] = int(re.findall(r"#define TNA_MAX_WORKERS (\d+)", size)[0])
    ports = re.findall(r"#define RECIRC_PORT (\d+)", size)
    out["RECIRC_PORT"], out["RECIRC_PORT_T2"] = int(ports[1]), int(ports[0])
    return out


@dataclass
class Tables:
    """The control plane a test installs, by the TNA program's table names (the last part of
    the control-plane name): ``entries[table]`` is a list of (key values, action, params), a
    key value being an int, (value, mask) for ternary or (value, prefix length) for lpm;
    ``defaults[table]`` a default action the test set."""

    entries: dict[str, list[tuple[tuple, str, dict[str, int]]]] = field(default_factory=dict)
    defaults: dict[str, tuple[str, dict[str, int]]] = field(default_factory=dict)

    def exact(self, table: str, *key: int, default: str = "NoAction"
              ) -> tuple[str, dict[str, int]]:
        for k, action, params in self.entries.get(table, []):
            if tuple(k) == key:
                return action, params
        return self.defaults.get(table, (default, {}))

    def lpm(self, table: str, value: int, width: int, default: str
            ) -> tuple[str, dict[str, int]]:
        best: tuple[int, str, dict[str, int]] | None = None
        for (k,), action, params in self.entries.get(table, []):
            v, plen = k
            m = ((1 << plen) - 1) << (width - plen) if plen else 0
            if value & m == v & m and (best is None or plen > best[0]):
                best = (plen, action, params)
        return (best[1], best[2]) if best else self.defaults.get(table, (default, {}))


@dataclass
class Expect:
    """A pass's outcome: ``port`` (None where the pass does not decide it: a multicast
    replica's), the frame and which of its bits are decided (``care``, a byte mask), or a
    drop (``frame`` None). ``rule`` names the model's rule that decided it; ``job``: a
    multicast's, whose replicas ``TnaPass.replicas`` addresses."""

    rule: str
    port: int | None = None
    frame: bytes | None = None
    care: bytes | None = None
    job: int | None = None


class Outside(Exception):
    """The test's tables or registers are no state homagg reaches (the message says why)."""


class TnaPass:
    """The model's answer for one pass of the TNA program, given a test's tables and its
    register cells (``registers[name][index]`` -> the cell's fields, by field name), for
    Tofino 1 or 2 (``tofino2``: its recirculation port and its K). ``declared``: the
    differences (``DIFFERENCES``) to take into the answer."""

    def __init__(self, tables: Tables, registers: dict[str, dict[int, dict[str, int]]],
                 tofino2: bool = False, declared: frozenset[str] = frozenset()):
        unknown = set(declared) - set(DIFFERENCES)
        if unknown:
            raise ValueError(f"not a declared difference: {sorted(unknown)}")
        self.declared = declared
        self.c = c = tna_constants()
        self.k = c["WORDS_T2" if tofino2 else "WORDS"]
        self.half = self.k // 2
        self.recirc = c["RECIRC_PORT_T2" if tofino2 else "RECIRC_PORT"]
        self.t, self.regs = tables, registers
        self.invalid = ""   # why the packet's job entry is none homagg-ctl writes, or ""
    # -- register cells ---------------------------------------------------------------------
    def cell(self, reg: str, index: int) -> dict[str, int] | None:
        return self.regs.get(reg, {}).get(index)

    def hashed_cell(self, reg: str, index: int) -> dict[str, int] | None:
        """The cell of a register indexed through an identity ``Hash`` (the slot copy's
        bookkeeping: one stage sooner than md.idx), at ``index``, or the one cell a P4Testgen
        test names: v1.2.5.16 names it at index 0 whatever its execution read (the hash's
        output, resolved for the execution, is not put into the register's index)."""
        cells = self.regs.get(reg, {})
        return cells.get(index, cells.get(0) if len(cells) == 1 else None)

    def lanes(self, idx: int) -> tuple[np.ndarray, np.ndarray]:
        cells = [self.cell(f"p{i:02d}.lanes", idx) or {} for i in range(self.half)]
        return (np.array([v.get("lo", 0) for v in cells], np.uint32),
                np.array([v.get("hi", 0) for v in cells], np.uint32))

    # -- one pass ---------------------------------------------------------------------------
    def expect(self, port: int, data: bytes) -> Expect:
        if port == self.recirc:
            return self._recirculated(data)
        f = parse(data, 0, self.k)
        to_switch = False
        if f.ipv4 is not None:
            action, _ = self.t.exact("local_ip", f.u(f.ipv4 + 16, 4))
            to_switch = action == "to_switch"
        homagg_port = f.udp is not None and \
            (f.u(f.udp + 2, 2) & 0xFFF0) == wire.HOMAGG_UDP_PORT_MIN
        if to_switch and homagg_port:
            return self._worker(port, f)
        return self._forward(port, f)

    # -- plain forwarding (forwarding.p4) ----------------------------------------------------
    def _forward(self, port: int, f: Frame) -> Expect:
        d = f.data
        if f.arp is not None and f.u(f.arp + 6, 2) == 1:
            action, p = self.t.exact("arp_proxy", f.u(f.arp + 24, 4), default="no_route")
            if action != "arp_reply":
                return Expect("forwarding: ARP for an address not listed")
            a, mac = f.arp, p["mac"]
            asked = f.u(a + 24, 4)
            f.put(a + 6, 2, 2)
            d[a + 18:a + 24] = d[a + 8:a + 14]          # tha = sha
            d[a + 24:a + 28] = d[a + 14:a + 18]         # tpa = spa
            f.put(a + 8, 6, mac)
            f.put(a + 14, 4, asked)
            d[0:6] = d[6:12]
            f.put(6, 6, mac)
            return self._out("forwarding: proxy ARP reply", port, f)
        trusted = False
        if f.ipv4 is not None:
            action, _ = self.t.exact("aggregators", f.u(f.ipv4 + 12, 4), port)
            trusted = action == "trusted"
        if f.udp is not None and (f.u(f.udp, 2) & 0xFFF0) == wire.HOMAGG_UDP_PORT_MIN \
                and not trusted:
            return Expect("forwarding: a homagg result from a host is dropped")
        if f.ipv4 is None or d[f.ipv4 + 8] <= 1:
            return Expect("forwarding: no IPv4, or its TTL ran out")
        action, p = self.t.lpm("ipv4_route", f.u(f.ipv4 + 16, 4), 32, "no_route")
        if action != "route":
            return Expect("forwarding: no route")
        f.put(6, 6, p["src_mac"])
        f.put(0, 6, p["dst_mac"])
        d[f.ipv4 + 8] -= 1
        return self._out("forwarding: routed", p["port"], f)

    def _out(self, rule: str, port: int | None, f: Frame, bridge: bytes = b"",
             care_words: tuple[bool, bool] = (True, True)) -> Expect:
        """The frame that leaves: the IPv4 checksum as both deparsers write it, ``bridge`` in
        front of a recirculated one; ``care_words``: whether the low and high halves of a
        packet's words are decided by this pass."""
        d = f.data
        if f.ipv4 is not None:
            f.put(f.ipv4 + 10, 2, ipv4_checksum(d[f.ipv4:f.ipv4 + IP4]))
        frame = bytes(bridge) + bytes(d[f.at:])
        if port == DROP_PORT or 9 + len(d) - f.at < PTF_MIN:   # (bridge_h on it in ingress)
            return Expect(f"{rule}, to port {port} of {len(frame)} bytes: Tofino drops it")
        care = bytearray(b"\xff" * len(frame))
        if f.words and f.homagg is not None and not all(care_words):
            base = len(bridge) + f.homagg - f.at + HB
            for half, keep in enumerate(care_words):
                if not keep:
                    s = base + 4 * self.half * half
                    care[s:s + 4 * self.half] = bytes(4 * self.half)
        return Expect(rule, port, frame, bytes(care))

    # -- a worker's datagram (pass 1) ---------------------------------------------------------
    def _job(self, f: Frame, port: int) -> tuple[JobEntry, dict[str, int]] | None:
        assert f.ipv4 is not None and f.udp is not None
        src = (f.u(f.ipv4 + 12, 4), f.u(f.udp, 2))
        action, p = self.t.exact("job_workers", *src)
        if action != "set_worker":
            return None
        workers, worker = p["workers"], p["worker"]
        if not 1 <= workers <= self.c["MAX_WORKERS"] or worker >= workers:
            # (admission's drops and refusals do not depend on it: the model answers those;
            # a packet it admits has no bookkeeping to compare with: _worker says so)
            self.invalid = (f"job entry with worker {worker} of {workers}: homagg-ctl writes "
                            f"workers 0..n-1 of at most {self.c['MAX_WORKERS']}")
            workers = max(workers, worker + 1)
        addrs = [(f"0.0.0.{w}", 1) for w in range(workers)]
        addrs[worker] = (_ip(src[0]), src[1])
        ports = [port ^ 1] * workers
        ports[worker] = p["port"]
        job = JobEntry(id=p["job"], workers=addrs, epoch=p["epoch"], base=p["region_base"],
                       size=p["region_size"], ports=ports, auth=p["auth"])
        return job, p

    def _worker(self, port: int, f: Frame) -> Expect:
        model = SwitchModel(words=self.k)
        model.job_stats = np.zeros(wire.JOB_STATS_PER_JOB << 16, np.int64)  # (any 16-bit id)
        self.invalid = ""
        hit = self._job(f, port)
        job = None
        if hit is not None:
            job, p = hit
            model.install(job)
        ip, udp = f.ipv4, f.udp
        assert ip is not None and udp is not None
        total, ulen = f.u(ip + 2, 2), f.u(udp + 4, 2)
        if total != IP4 + ulen or len(f.data) < ip + total:
            return Expect("admission: IPv4 and UDP lengths disagree (DROP_BAD_LENGTH)")
        data = bytes(f.data[udp + UDP:ip + total])
        src = (_ip(f.u(ip + 12, 4)), f.u(udp, 2))
        if job is not None and len(data) >= HB and data[0] & 0xF != wire.OP_JOIN \
                and wire.fields(data)["slot"] < job.size \
                and job.base + wire.fields(data)["slot"] >= wire.SLOTS:
            raise Outside(f"job region {job.base}+{job.size}: a slot past the pool's "
                          f"{wire.SLOTS}, which homagg-ctl never writes")
        if job is not None and len(data) >= HB and not self.invalid:
            self.seed(model, job, p["worker"], data)
        out = model.process(data, src, port)
        if self.invalid and out.verdict is not None:   # admitted: bookkeeping follows
            raise Outside(self.invalid)
        if not out.replies:
            return Expect(f"model: {out.counter}, nothing sent")
        assert job is not None
        reply = self._declare(out.replies[0][0], data)
        h = wire.fields(data)
        if out.counter != "STAT_ACCEPTED" and not (
                out.counter == "STAT_RETRANS_REPLY" and h["op"] != wire.OP_JOIN):
            return self._back(f"model: {out.counter}, a reply to the sender", port, f, reply)
        idx = ((job.base + h["slot"]) % wire.SLOTS) * 2 + (1 if h["flags"] & wire.FLAG_PHASE
                                                           else 0)
        c = self.c
        if h["op"] == wire.OP_JOIN:   # the join's multicast: the replica result_dst addresses
            return self._replica("model: the join completes, multicast", f, reply, job.id,
                                 from_switch=True)
        if out.counter == "STAT_RETRANS_REPLY":   # two more passes read the result
            br = bridge_bytes(c["BRIDGE_RETRANS_HI"], job.id, p["mcast_group"], port, idx)
            self._to_sender(f)
            self._payload(f, reply)
            return self._out("model: a finished round's result again (recirculated for its "
                             "high lanes)", self.recirc, f, br, (False, False))
        br = bridge_bytes(c["BRIDGE_HARVEST_MCAST"], job.id, p["mcast_group"], port, idx)
        self._from_switch(f)
        self._payload(f, reply)
        return self._out("model: the round completes (recirculated for its low lanes)",
                         self.recirc, f, br, (False, True))

    def seed(self, model: SwitchModel, job: JobEntry, worker: int, data: bytes) -> None:
        """The model's state for the packet's slot copy (or its job's join) from the TNA
        registers' cells the test set; cells it left unset are 0."""
        h = wire.fields(data)
        me = 1 << worker
        full = (1 << len(job.workers)) - 1
        if h["op"] == wire.OP_JOIN:
            j = job.id % wire.MAX_JOBS
            mem = self.cell("join_state.join_members", j) or {}
            gen = self.cell("join_state.join_generation", j) or {}
            # (the registers keep the run with the job's epoch in its high half: md.join_run)
            pkt_run = int.from_bytes(data[HB:HB + 4], "big")
            key = pkt_run ^ job.epoch << 16
            seen, ours = mem.get("seen", 0), mem.get("run", 0) == key
            if ours != (gen.get("run", 0) == key):
                raise Outside("join registers of two runs (members' run != generation's)")
            if not ours:   # another run's: both registers start afresh, reading no more
                seen &= full   # (a run of nobody past the job is a run of fewer)
            if seen & ~full:
                raise Outside(f"join members {seen:#x} outside the job's {full:#x}")
            count = seen.bit_count()
            g = gen.get("gen", 0) & 0xFF
            run = pkt_run if ours else pkt_run ^ 1
            model.join_state[job.id] = [seen, count, g, job.epoch, int(count == len(
                job.workers)), g, 0, run]
            if seen & me and ours:   # no nonce kept: a member's join is a resend
                model.join_nonce[(job.id, worker)] = h["seq"]
            elif RUNS in self.declared:   # ... and nobody else's, whatever its nonce (0 too)
                model.join_nonce[(job.id, worker)] = h["seq"] ^ 1
            return
        idx = 2 * (job.base + h["slot"]) + (1 if h["flags"] & wire.FLAG_PHASE else 0)
        if idx >= 2 * wire.SLOTS:
            return
        own = self.hashed_cell("slot_round.slot_owner", idx) or {}
        rnd = self.hashed_cell("slot_round.slot_round", idx) or {}
        owner, otag = own.get("owner", 0), own.get("tag", 0)
        seen, rtag = rnd.get("seen", 0), rnd.get("tag", 0)
        m = model.mem
        mine = job.epoch << 8 | h["gen"]
        if owner >> 24 or (RUNS in self.declared and owner != mine):
            m.epoch[idx] = (job.epoch + 1) & 0xFFFF   # another owner's copy: empty to us
        else:
            m.epoch[idx], m.gen[idx] = owner >> 8, owner & 0xFF
        if owner == mine and otag != rtag:
            raise Outside(f"slot copy {idx}: owner's tag {otag} != round's tag {rtag}")
        if seen & ~full:
            raise Outside(f"slot copy {idx}: contributors {seen:#x} outside the job's "
                          f"{full:#x}")
        m.seen[idx], m.count[idx], m.tag[idx] = seen, seen.bit_count(), otag
        m.op[idx] = h["op"]                            # no op kept (docs/switch.md)
        m.final[idx] = seen.bit_count() == len(job.workers)
        lo, hi = self.lanes(idx)
        m.words[idx] = np.concatenate([lo, hi]).view(np.int32)

    def _declare(self, reply: bytes, data: bytes) -> bytes:
        """The model's reply with the differences this projection was asked to take as the
        TNA design declares them (``DIFFERENCES``)."""
        r = bytearray(reply)
        flags = r[wire.OFFSETS["flags"]]
        if NO_OVERFLOW in self.declared:
            r[wire.OFFSETS["flags"]] = flags & ~wire.FLAG_OVERFLOW & 0xFF
        if NO_COUNT in self.declared and flags & wire.FLAG_STATUS:
            r[-4:] = bytes(4)
        if JOIN_WORDS in self.declared and data[0] & 0xF == wire.OP_JOIN:
            keep = bytearray(data[HB:HB + 4 * wire.JOIN_WORDS])
            keep[4 * wire.JOIN_RUN_WORD:4 * wire.JOIN_RUN_WORD + 4] = bytes(4)
            if flags & wire.FLAG_STATUS:
                keep[-8:-4] = r[-8:-4]
            if flags & wire.FLAG_REFUSED:
                keep[-4:] = r[-4:]
            r[HB:] = keep
        return bytes(r)

    def _back(self, rule: str, port: int, f: Frame, reply: bytes) -> Expect:
        self._to_sender(f)
        self._payload(f, reply)
        return self._out(rule, port, f)
    def _payload(self, f: Frame, reply: bytes) -> None:
        f.data[f.homagg:f.homagg + len(reply)] = reply  # type: ignore[operator]

    def _to_sender(self, f: Frame) -> None:
        d, ip, udp = f.data, f.ipv4, f.udp
        assert ip is not None and udp is not None
        d[0:6], d[6:12] = d[6:12], d[0:6]
        d[ip + 12:ip + 16], d[ip + 16:ip + 20] = d[ip + 16:ip + 20], d[ip + 12:ip + 16]
        d[udp:udp + 2], d[udp + 2:udp + 4] = d[udp + 2:udp + 4], d[udp:udp + 2]
        f.put(udp + 6, 2, 0)
        d[ip + 8] = 64

    def _from_switch(self, f: Frame) -> None:
        d, ip, udp, a = f.data, f.ipv4, f.udp, f.at
        assert ip is not None and udp is not None
        d[a + 6:a + 12] = d[a:a + 6]
        d[ip + 12:ip + 16] = d[ip + 16:ip + 20]
        d[udp:udp + 2] = d[udp + 2:udp + 4]
        f.put(udp + 6, 2, 0)
        d[ip + 8] = 64

    def _replica(self, rule: str, f: Frame, reply: bytes | None, job: int,
                 from_switch: bool = False) -> Expect:
        """A multicast result's replicas: each addressed by its result_dst entry (the replica's
        rid is P4Testgen's choice and not in its test, so the one it took is matched by
        address: ``expect_replica``); the datagram is the model's result."""
        if from_switch:
            self._from_switch(f)
        if reply is not None:
            self._payload(f, reply)
        e = self._out(rule, None, f)
        e.job = job
        return e

    def replicas(self, job: int, e: Expect) -> list[Expect]:
        """``e`` as each replica result_dst lets out: one per entry of the job."""
        out = []
        for (kjob, rid), action, p in self.t.entries.get("result_dst", []):
            if kjob != job or action != "set_result_dst" or e.frame is None:
                continue
            f = parse(e.frame, 0, self.k)
            f.put(0, 6, p["mac"])
            if f.ipv4 is not None:
                f.put(f.ipv4 + 16, 4, p["ip"])
            if f.udp is not None:
                f.put(f.udp + 2, 2, p["port"])
            out.append(self._out(f"{e.rule}, rid {rid}", None, f))
        return out

    # -- a recirculated pass -----------------------------------------------------------------
    def _recirculated(self, data: bytes) -> Expect:
        c = self.c
        need = 9 + ETH + IP4 + UDP + HB + 4 * self.k
        if len(data) < need:
            raise Outside("a recirculated frame shorter than the one the first pass sends")
        kind, job, mcast, port, idx = parse_bridge(data)
        f = parse(data, 9, self.k)
        if f.ipv4 is None or f.udp is None or not f.words:
            raise Outside("a recirculated frame without the IPv4 and UDP the first pass sends")
        o = f.homagg
        assert o is not None
        words = np.frombuffer(bytes(f.data[o + HB:o + HB + 4 * self.k]), ">u4").copy()
        lo, hi = self.lanes(idx)
        if kind == c["BRIDGE_RETRANS_HI"]:   # the high lanes (adding the zeroed words)
            words[:self.half], words[self.half:] = 0, hi
            f.data[o + HB:o + HB + 4 * self.k] = words.astype(">u4").tobytes()
            br = bytes([c["BRIDGE_HARVEST_UNICAST"]]) + bytes(data[1:9])  # (pads as they came)
            return self._out("harvest: a retransmission's high lanes, recirculated again",
                             self.recirc, f, br)
        words[:self.half] = lo                 # the low lanes: the result is whole
        f.data[o + HB:o + HB + 4 * self.k] = words.astype(">u4").tobytes()
        if kind == c["BRIDGE_HARVEST_MCAST"]:
            return self._replica("harvest: the result, multicast", f, None, job)
        return self._out("harvest: the result, to the sender's port", port, f)


def _ip(v: int) -> str:
    return ".".join(str(v >> s & 0xFF) for s in (24, 16, 8, 0))
