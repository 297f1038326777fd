"""The typed P4 schema (homagg/p4schema.py): lookups, the one table-entry codec, the one pipeline
check; and that the controller and the software aggregator's server now write the same bytes.

No network: the server's service object is called directly."""

from __future__ import annotations

import random

import pytest

from homagg import _p4consts as P4
from homagg.p4schema import (
    P4Action,
    P4MatchField,
    P4Schema,
    P4SchemaError,
    P4Table,
    TableEntry,
    canonical,
    decode_entry,
    encode_entry,
    pipeline_differences,
)

S = P4.SCHEMA


# -- lookups -----------------------------------------------------------------------------------


def test_every_object_is_found_by_name_and_by_id():
    for kind in ("table", "action", "counter", "register"):
        for o in getattr(S, kind + "s"):
            assert getattr(S, kind)(o.name) is o
            assert getattr(S, kind)(o.id) is o
    t = S.table(P4.TABLE_JOB_WORKERS)
    assert t.match_field("src_port") is t.match_field(2)
    a = S.action(P4.ACTION_SET_WORKER)
    assert a.param("epoch") is a.param(4)


@pytest.mark.parametrize("lookup,message", [
    (lambda: S.table("local_ip"), r"no table 'local_ip' in the P4Info; did you mean "
                                  r"HomaggIngress\.local_ip\?"),
    (lambda: S.action("set_workr"), r"did you mean HomaggIngress\.aggregation\.admission\."
                                    r"set_worker"),
    (lambda: S.counter(7), r"^no counter id 7 in the P4Info$"),
    (lambda: S.register("zzzz"), r"^no register 'zzzz' in the P4Info$"),
    (lambda: S.table(P4.TABLE_JOB_WORKERS).match_field("src_adr"),
     r"has no match field 'src_adr'; did you mean src_addr"),
    (lambda: S.action(P4.ACTION_SET_WORKER).param("epok"),
     r"has no parameter 'epok'; did you mean epoch\?"),
    (lambda: S.table_action(S.table(P4.TABLE_LOCAL_IP), P4.ACTION_ROUTE),
     r"is not one of table HomaggIngress\.local_ip's"),
])
def test_a_miss_is_a_clear_error_with_the_nearest_names(lookup, message):
    with pytest.raises(P4SchemaError, match=message):
        lookup()


def test_the_generated_schema_is_the_shipped_p4infos():
    """One P4Info conversion (genconsts uses from_p4info): the committed schema is what it
    makes of homagg/_p4info.txtpb."""
    pytest.importorskip("p4.config.v1")
    from homagg.controller import genconsts
    from homagg.paths import P4INFO_FILE

    assert genconsts.parse_p4info(P4INFO_FILE) == S


# -- the codec ---------------------------------------------------------------------------------


def _value(rng: random.Random, bits: int) -> int:
    return rng.choice([0, 1, (1 << bits) - 1, rng.getrandbits(bits)])


def _entries(table: P4Table, n: int, seed: int) -> list[TableEntry]:
    """Valid entries of ``table``: edge and random values, every action it may hold."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        match: dict = {}
        for k in table.match_fields:
            if k.match_type == "lpm":
                plen = rng.choice([0, 1, k.bitwidth, rng.randint(1, k.bitwidth)])
                v = _value(rng, k.bitwidth) >> (k.bitwidth - plen) << (k.bitwidth - plen) \
                    if plen else 0
                match[k.name] = (v, plen)
            else:
                match[k.name] = _value(rng, k.bitwidth)
        a = S.action(table.action_ids[i % len(table.action_ids)])
        out.append(TableEntry(table.name, match, a.name,
                              {p.name: _value(rng, p.bitwidth) for p in a.params}))
    return out


@pytest.mark.parametrize("table", [t.name for t in S.tables])
def test_entries_round_trip_in_canonical_bytes(table):
    pytest.importorskip("p4.v1")
    for e in _entries(S.table(table), 200, seed=len(table)):
        te = encode_entry(S, e)
        assert decode_entry(S, te) == e
        assert decode_entry(S, te, need_action=False) == TableEntry(e.table, e.match)
        values = [fm.exact.value or fm.lpm.value for fm in te.match]
        values += [p.value for p in te.action.action.params]
        for b in values:  # canonical: no leading zero byte, at least one byte
            assert len(b) >= 1 and (len(b) == 1 or b[0] != 0)
        lpm = [k.name for k in S.table(table).match_fields if k.match_type == "lpm"]
        assert len(te.match) == len(e.match) - sum(e.match[n][1] == 0 for n in lpm)


def test_both_match_kinds_the_program_has_are_covered():
    assert {k.match_type for t in S.tables for k in t.match_fields} == {"exact", "lpm"}


def test_canonical_bytes():
    assert canonical(0, 32, "x") == b"\x00"
    assert canonical(1, 48, "x") == b"\x01"
    assert canonical(0x1FF, 9, "x") == b"\x01\xff"
    with pytest.raises(P4SchemaError, match=r"x: 0x200 does not fit in 9 bits"):
        canonical(0x200, 9, "x")
    with pytest.raises(P4SchemaError, match="does not fit"):
        canonical(-1, 9, "x")


def test_decode_takes_padded_bytes_too():
    """Older P4Runtime servers and clients pad to the field's width; the value is the same."""
    pytest.importorskip("p4.v1")
    e = TableEntry(P4.TABLE_LOCAL_IP, {"dst_addr": 5}, P4.ACTION_TO_SWITCH)
    te = encode_entry(S, e)
    te.match[0].exact.value = (5).to_bytes(4, "big")
    assert decode_entry(S, te) == e


def test_decode_refuses_what_the_schema_cannot_hold():
    pytest.importorskip("p4.v1")
    ok = TableEntry(P4.TABLE_JOB_WORKERS, {"src_addr": 1, "src_port": 2}, P4.ACTION_SET_WORKER,
                    {p.name: 1 for p in S.action(P4.ACTION_SET_WORKER).params})

    def broken(change):
        te = encode_entry(S, ok)
        change(te)
        return te

    cases = [
        (lambda te: setattr(te, "table_id", 5), "no table id 5"),
        (lambda te: te.match.add().CopyFrom(te.match[0]), "given twice"),
        (lambda te: te.match[1].exact.__setattr__("value", b"\x01\x00\x00"),
         "does not fit in 16 bits"),
        (lambda te: te.match.pop(), "exact match field src_port missing"),
        (lambda te: te.action.action.params.pop(), r"parameter\(s\) auth missing"),
        (lambda te: setattr(te.action.action, "action_id", S.action(P4.ACTION_ROUTE).id),
         "is not one of this table's"),
        (lambda te: setattr(te, "priority", 3), "take no priority"),
    ]
    for change, message in cases:
        with pytest.raises(P4SchemaError, match=message):
            decode_entry(S, broken(change))
    route = encode_entry(S, TableEntry(P4.TABLE_IPV4_ROUTE, {"dst_addr": (0x0A000000, 8)},
                                       P4.ACTION_NOACTION))
    route.match[0].lpm.prefix_len = 4  # 10.0.0.0/4 has bits past its prefix
    with pytest.raises(P4SchemaError, match="is not a prefix"):
        decode_entry(S, route)


def test_encode_refuses_unknown_names_and_unsupported_kinds():
    pytest.importorskip("p4.v1")
    with pytest.raises(P4SchemaError, match="did you mean dst_addr"):
        encode_entry(S, TableEntry(P4.TABLE_LOCAL_IP, {"dst_adr": 1}))
    with pytest.raises(P4SchemaError, match="has no parameter 'mak'; did you mean mac"):
        encode_entry(S, TableEntry(P4.TABLE_ARP_PROXY, {"tpa": 1}, P4.ACTION_ARP_REPLY,
                                   {"mak": 1}))
    ternary = P4Schema(tables=(P4Table("t", 1, (P4MatchField("f", 1, 8, "ternary"),), (2,), 1),),
                       actions=(P4Action("a", 2),))
    with pytest.raises(P4SchemaError, match="ternary match fields are not supported"):
        encode_entry(ternary, TableEntry("t", {"f": 1}, "a"))


# -- the pipeline check ------------------------------------------------------------------------


def test_the_pipeline_check_names_what_differs():
    pytest.importorskip("p4.config.v1")
    from homagg.targets.p4runtime_server import load_p4info

    info = load_p4info()
    assert pipeline_differences(info, S) == []
    info.tables[0].size += 1
    info.actions[1].preamble.name = "Other.action"
    del info.counters[0]
    assert pipeline_differences(info, S) == [
        f"table {S.tables[0].name} differs",
        f"no action {S.actions[1].name}",
        "action Other.action is not homagg's",
        f"no counter {S.counters[0].name}",
    ]


# -- one encoding on both sides ----------------------------------------------------------------


def test_the_controller_and_the_server_write_the_same_bytes():
    """What the controller sends for an entry is, byte for byte, what the software
    aggregator's server answers when the entry is read back."""
    pytest.importorskip("grpc")
    pytest.importorskip("p4runtime_sh")
    from p4.v1 import p4runtime_pb2 as pb

    from homagg.controller.p4client import P4RuntimeSwitch
    from homagg.targets.p4runtime_server import _Service
    from homagg.targets.soft import SoftSwitch

    client = P4RuntimeSwitch()  # not connected: _entry_pb only builds the message
    service = _Service(SoftSwitch(), device_id=1)
    checked = 0
    for t in S.tables:
        for e in _entries(t, 20, seed=t.id):
            sent = client._entry_pb(e)
            u = pb.Update(type=pb.Update.INSERT)
            u.entity.table_entry.CopyFrom(sent)
            code, message = service._update(u)
            if code != 0:  # a duplicate key drawn twice
                assert "exists" in message
                continue
            back = service._read_tables(pb.TableEntry(table_id=t.id))
            assert sent.SerializeToString() in {b.table_entry.SerializeToString() for b in back}
            checked += 1
    assert checked >= len(S.tables) * 5
