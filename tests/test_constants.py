"""The P4 source and the Python side share every wire constant: this fails if they drift."""

import re

import numpy as np
import pytest

from homagg import paths, wire

P4 = paths.p4_dir()


def _eval(expr: str, env: dict) -> int:
    expr = re.sub(r"/\*.*?\*/", "", expr).strip()
    expr = re.sub(r"\b\d+w(\d+)\b", r"\1", expr)  # P4 width-prefixed literals
    names = {k: v for k, v in env.items()}
    return int(eval(expr, {"__builtins__": {}}, names))  # noqa: S307 - our own source file


def p4_constants() -> dict:
    text = (P4 / "include" / "constants.p4").read_text()
    env: dict = {}
    for line in text.splitlines():
        m = re.match(r"\s*const\s+bit<\d+>\s+(\w+)\s*=\s*([^;]+);", line)
        if m:
            env[m.group(1)] = _eval(m.group(2), env)
            continue
        m = re.match(r"\s*#define\s+([A-Z_][A-Z0-9_]*)\s+(.+?)\s*(/\*.*)?$", line)
        if m and not m.group(1).startswith("HOMAGG_CONSTANTS"):
            try:
                env[m.group(1)] = _eval(m.group(2), env)
            except Exception:
                pass  # not a number (typedef helpers etc.)
    return env


def p4_header_fields(name: str) -> list[tuple[str, int]]:
    text = (P4 / "include" / "headers.p4").read_text()
    body = re.search(rf"header\s+{name}\s*{{(.*?)}}", text, re.S).group(1)
    return [(f, int(w)) for w, f in re.findall(r"bit<(\d+)>\s+(\w+);", body)]


C = p4_constants()

SCALARS = [
    "HOMAGG_UDP_PORT_MIN", "HOMAGG_UDP_PORT_MAX", "HOMAGG_VERSION", "OP_ADD", "OP_OR",
    "FLAG_RESULT", "FLAG_OVERFLOW", "FLAG_PHASE", "FLAG_RETRANS", "FLAG_STATUS", "WORDS_PER_PACKET",
    "HOMAGG_HDR_BYTES", "HOMAGG_PAYLOAD_BYTES", "HOMAGG_UDP_LEN", "HOMAGG_IPV4_LEN",
    "SLOT_INDEX_WIDTH", "SLOTS", "SLOT_STATE_SIZE", "MAX_WORKERS", "JOB_ID_WIDTH", "MAX_JOBS",
    "STATS_SIZE", "EPOCH_STORE", "FWD_STATS_SIZE", "JOB_STATS_PER_JOB", "JOB_STATS_SIZE", "RID_WORKER_OFFSET",
]


@pytest.mark.parametrize("name", SCALARS)
def test_scalar_constant_matches_p4(name):
    assert name in C, f"{name} missing from constants.p4"
    assert getattr(wire, name) == C[name]


def test_counter_indices_match_p4():
    for table in (wire.STATS, wire.FWD_STATS, wire.JOB_STATS):
        for index, name in table.items():
            assert C.get(name) == index, name
    p4_stats = {k for k in C if k.startswith(("STAT_", "DROP_"))}
    assert p4_stats == set(wire.STATS.values())
    assert max(wire.STATS) < wire.EPOCH_STORE < wire.STATS_SIZE
    assert max(wire.FWD_STATS) < wire.FWD_STATS_SIZE


def test_port_range_is_one_ternary_block():
    # The parser matches the range as HOMAGG_UDP_PORT_MIN &&& 0xFFF0.
    assert wire.HOMAGG_UDP_PORT_MIN & 0xF == 0
    assert wire.HOMAGG_UDP_PORT_MAX == wire.HOMAGG_UDP_PORT_MIN | 0xF


def test_header_layout_matches_p4():
    fields = p4_header_fields("homagg_h")
    assert [f for f, _ in fields] == ["version", "op", "flags", "job", "worker", "reserved",
                                      "slot", "seq"]
    assert sum(w for _, w in fields) == 8 * wire.HOMAGG_HDR_BYTES == 8 * wire.HEADER.size
    # struct layout: each struct field carries the P4 fields of the same bytes
    assert wire.HEADER.format == "!BBHBBHI"


def test_words_field_holds_exactly_the_packet_words():
    fields = p4_header_fields("words_h")
    assert fields == [("w", 32 * wire.WORDS_PER_PACKET)]
    lanes = (P4 / "include" / "lanes.p4").read_text()
    assert f"#define WORDS_BITS {32 * wire.WORDS_PER_PACKET}" in lanes
    sign = re.search(r"const words_t LANE_SIGN = 0x([0-9a-fA-F]+);", lanes).group(1)
    assert sign.lower() == "80000000" * wire.WORDS_PER_PACKET


def test_status_words_fit_in_the_packet():
    assert wire.STATUS_WORD + 3 == wire.WORDS_PER_PACKET


def test_lengths_are_consistent():
    assert wire.HOMAGG_PAYLOAD_BYTES == 4 * wire.WORDS_PER_PACKET
    assert wire.HOMAGG_UDP_LEN == 8 + wire.HOMAGG_HDR_BYTES + wire.HOMAGG_PAYLOAD_BYTES
    assert wire.HOMAGG_IPV4_LEN == 20 + wire.HOMAGG_UDP_LEN


def test_pack_unpack_round_trip():
    words = np.arange(-5, 59, dtype=np.int32)
    buf = wire.pack(wire.OP_ADD, 3, 2, 17, 2**32 - 1, words, flags=wire.FLAG_PHASE)
    assert len(buf) == wire.PACKET_BYTES
    p = wire.unpack(buf)
    assert (p.op, p.job, p.worker, p.slot, p.seq, p.phase) == (wire.OP_ADD, 3, 2, 17, 2**32 - 1, 1)
    np.testing.assert_array_equal(p.words, words)


def test_pack_pads_and_accepts_bitsets():
    p = wire.unpack(wire.pack(wire.OP_OR, 0, 0, 0, 1, np.array([0xFFFFFFFF, 1], np.uint32)))
    assert p.words[0] == -1 and p.words[1] == 1 and not p.words[2:].any()


@pytest.mark.parametrize("buf,reason", [
    (b"", "bytes"),
    (bytes(wire.PACKET_BYTES - 1), "bytes"),
    (bytes([0x21]) + bytes(wire.PACKET_BYTES - 1), "version"),
    (bytes([0x1F]) + bytes(wire.PACKET_BYTES - 1), "op"),
])
def test_unpack_refuses_bad_packets(buf, reason):
    with pytest.raises(wire.WireError, match=reason):
        wire.unpack(buf)


def test_packet_dtype_matches_struct():
    batch = wire.packets(2)
    batch["version_op"] = (wire.HOMAGG_VERSION << 4) | wire.OP_ADD
    batch["job"] = 5
    batch["worker"] = 1
    batch["slot"] = [0, 1]
    batch["seq"] = 9
    batch["words"][1] = np.arange(64)
    p = wire.unpack(batch[1].tobytes())
    assert (p.job, p.worker, p.slot, p.seq) == (5, 1, 1, 9)
    np.testing.assert_array_equal(p.words, np.arange(64))
