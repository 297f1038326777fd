"""One source of truth for the protocol: the committed homagg/_p4consts.py is what the generator
makes from the P4 program now, and everything wire derives from it is consistent."""

from __future__ import annotations

import numpy as np
import pytest

from homagg import _p4consts, paths, wire
from homagg.controller import genconsts
from homagg.targets.toolchain import missing

COMMITTED = genconsts.OUT.read_text()


def test_generated_constants_match_the_p4_source():
    fresh, _ = genconsts.split_halves(genconsts.render(paths.p4_dir(), None))
    committed, _ = genconsts.split_halves(COMMITTED)
    assert committed == fresh, ("homagg/_p4consts.py is out of date with p4/include: run "
                                "`homagg-ctl build` (or python -m homagg.controller.genconsts)")


@pytest.mark.skipif(bool(missing("p4c-bm2-ss")), reason=f"P4Info half: {missing('p4c-bm2-ss')}")
def test_generated_names_match_the_compiled_p4info(tmp_path):
    from homagg.controller.build import build

    p = build(tmp_path, force=True, regenerate=False)
    fresh = genconsts.render(paths.p4_dir(), genconsts.parse_p4info(p.p4info))
    assert fresh == COMMITTED, "homagg/_p4consts.py is out of date: run `homagg-ctl build`"


def test_counter_groups_are_complete_and_fit():
    drops = {k for k in vars(_p4consts) if k.startswith(("STAT_", "DROP_"))}
    assert drops == set(wire.STATS.values())
    assert max(wire.STATS) < wire.EPOCH_STORE < wire.STATS_SIZE
    assert max(wire.FWD_STATS) < wire.FWD_STATS_SIZE
    assert max(wire.JOB_STATS) < wire.JOB_STATS_PER_JOB
    assert wire.NO_DROP not in wire.STATS and wire.NO_DROP >= wire.STATS_SIZE


def test_port_range_is_one_ternary_block():
    # The parser matches the range as HOMAGG_UDP_PORT_MIN &&& 0xFFF0.
    assert wire.HOMAGG_UDP_PORT_MIN & 0xF == 0
    assert wire.HOMAGG_UDP_PORT_MAX == wire.HOMAGG_UDP_PORT_MIN | 0xF


def test_header_derives_from_the_p4_field_list():
    assert [f for f, _ in wire.HEADER_FIELDS] == ["version", "op", "flags", "job", "worker",
                                                  "gen", "slot", "seq", "auth"]
    bits = sum(w for _, w in wire.HEADER_FIELDS)
    assert bits == 8 * wire.HOMAGG_HDR_BYTES == 8 * wire.HEADER.size
    assert wire.HEADER.format == "!BBHBBHII"
    assert wire.OFFSETS == {"version_op": 0, "flags": 1, "job": 2, "worker": 4, "gen": 5,
                            "slot": 6, "seq": 8, "auth": 12, "words": 16}
    assert wire.PACKET_DTYPE.names[:-1] == tuple(wire.OFFSETS)[:-1]


def test_words_are_whole_chunks_and_lane_sign_has_bit_31_of_every_lane():
    """p4c's widest type is 2048 bits: the words are K / 64 chunks of 64 lanes each."""
    import re

    assert wire.CHUNK_BITS == 32 * wire.CHUNK_WORDS == 2048
    assert wire.WORDS_PER_PACKET % wire.CHUNK_WORDS == 0
    assert wire.WORD_CHUNKS * wire.CHUNK_WORDS == wire.WORDS_PER_PACKET
    assert wire.WORDS_BITS == 32 * wire.WORDS_PER_PACKET
    lanes = (paths.p4_dir() / "include" / "lanes.p4").read_text()
    sign = re.search(r"const chunk_t LANE_SIGN = 0x([0-9a-fA-F]+);", lanes).group(1)
    assert sign.lower() == "80000000" * wire.CHUNK_WORDS


def test_lengths_are_consistent():
    assert wire.STATUS_WORD + 3 == wire.WORDS_PER_PACKET
    assert wire.HOMAGG_JOIN_UDP_LEN == 8 + wire.JOIN_BYTES
    assert wire.HOMAGG_JOIN_IPV4_LEN == 20 + wire.HOMAGG_JOIN_UDP_LEN
    # K: what a jumbo (9000-byte) MTU holds at most; the default MTU, 1500, holds 364
    assert (wire.DEFAULT_MTU, wire.JUMBO_MTU) == (1500, 9000)
    for mtu, most in ((wire.DEFAULT_MTU, 364), (wire.JUMBO_MTU, wire.MAX_WORDS_PER_PACKET)):
        assert wire.mtu_words(mtu) == most
        assert wire.frame_bytes(most) == 20 + 8 + wire.packet_bytes(most) <= mtu
        assert wire.frame_bytes(most + 1) > mtu
    assert wire.mtu_words(65536) == wire.MAX_WORDS_PER_PACKET == 2239
    # the default K fits the default MTU, and the largest build (34 chunks) a jumbo one
    assert wire.check_words(wire.WORDS_PER_PACKET, wire.DEFAULT_MTU)
    assert wire.check_words(34 * wire.CHUNK_WORDS, wire.JUMBO_MTU) == 2176
    with pytest.raises(wire.WireError, match="16 to 2239"):
        wire.check_words(35 * wire.CHUNK_WORDS, wire.JUMBO_MTU)
    with pytest.raises(wire.WireError, match="more than a 1500-byte MTU holds .364 words"):
        wire.check_words(365, wire.DEFAULT_MTU)
    assert wire.HOMAGG_PAYLOAD_BYTES == 4 * wire.WORDS_PER_PACKET
    assert wire.HOMAGG_UDP_LEN == 8 + wire.HOMAGG_HDR_BYTES + wire.HOMAGG_PAYLOAD_BYTES
    assert wire.HOMAGG_IPV4_LEN == 20 + wire.HOMAGG_UDP_LEN
    assert wire.SLOTS == 1 << wire.SLOT_INDEX_WIDTH and wire.MAX_JOBS == 1 << wire.JOB_ID_WIDTH


def test_verdict_enum_comes_from_p4():
    assert wire.VERDICTS == {"ACCEPT": 0, "RETRANS_REPLY": 1, "DUP_PENDING": 2,
                             "SEQ_MISMATCH": 3, "STALE": 4, "RESEND_UP": 5}


def test_pack_unpack_round_trip():
    words = np.arange(-5, wire.WORDS_PER_PACKET - 5, dtype=np.int32)
    buf = wire.pack(wire.OP_ADD, 3, 2, 17, 2**32 - 1, words, flags=wire.FLAG_PHASE)
    assert len(buf) == wire.PACKET_BYTES
    p = wire.unpack(buf)
    assert (p.op, p.job, p.worker, p.slot, p.seq, p.phase) == (wire.OP_ADD, 3, 2, 17, 2**32 - 1, 1)
    np.testing.assert_array_equal(p.words, words)


@pytest.mark.parametrize("k", [64, wire.WORDS_PER_PACKET])
def test_any_k_packs_and_unpacks_and_a_join_is_the_header_alone(k):
    words = np.arange(k, dtype=np.int32) - 7
    buf = wire.pack(wire.OP_ADD, 3, 2, 17, 5, words, k=k)
    assert len(buf) == wire.packet_bytes(k) and wire.words_in(len(buf)) == k
    np.testing.assert_array_equal(wire.unpack(buf).words, words)
    np.testing.assert_array_equal(wire.unpack(buf, k).words, words)
    with pytest.raises(wire.WireError, match="bytes"):
        wire.unpack(buf, k + 1)
    join = wire.pack(wire.OP_JOIN, 3, 2, 0, 99, k=k)  # whatever k: JOIN_WORDS words
    assert len(join) == wire.JOIN_BYTES == wire.HOMAGG_HDR_BYTES + 4 * wire.JOIN_WORDS
    p = wire.unpack(join, k)
    assert p.op == wire.OP_JOIN and p.seq == 99 and p.words.size == wire.JOIN_WORDS
    with pytest.raises(wire.WireError, match="do not fit"):
        wire.pack(wire.OP_JOIN, 3, 2, 0, 99, np.ones(wire.JOIN_WORDS + 1))
    status = wire.status_words(3, 2, k)
    assert status.size == k and wire.parse_status(status) == (3, 2)
    with pytest.raises(wire.WireError, match="words per packet"):
        wire.check_words(wire.MAX_WORDS_PER_PACKET + 1)


def test_pack_pads_and_accepts_bitsets():
    p = wire.unpack(wire.pack(wire.OP_OR, 0, 0, 0, 1, np.array([0xFFFFFFFF, 1], np.uint32)))
    assert p.words[0] == -1 and p.words[1] == 1 and not p.words[2:].any()


def test_status_reply_round_trip():
    seen, count = (1 << 63) | (1 << 33) | 5, 4
    words = wire.status_words(seen, count)
    assert not words[:wire.STATUS_WORD].any()
    p = wire.unpack(wire.pack(wire.OP_ADD, 1, 0, 0, 1, words,
                              flags=wire.FLAG_RESULT | wire.FLAG_STATUS))
    assert p.status == (seen, count)


@pytest.mark.parametrize("buf,reason", [
    (b"", "bytes"),
    (bytes(wire.PACKET_BYTES - 1), "bytes"),
    (bytes([0x31]) + bytes(wire.PACKET_BYTES - 1), "version"),
    (bytes([0x11]) + bytes(wire.PACKET_BYTES - 1), "version 1, expected 2"),  # before the key
    (bytes([0x2F]) + bytes(wire.PACKET_BYTES - 1), "op"),
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
    batch["words"][1] = np.arange(wire.WORDS_PER_PACKET)
    p = wire.unpack(batch[1].tobytes())
    assert (p.job, p.worker, p.slot, p.seq) == (5, 1, 1, 9)
    np.testing.assert_array_equal(p.words, np.arange(wire.WORDS_PER_PACKET))
