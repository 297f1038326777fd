/* homagg on Tofino: one register pair, words i and K/2 + i of every slot copy (SwitchML's
 * Processor). Four RegisterActions, Tofino's most per register:
 *   write_hi  a round's first packet: both lanes overwritten (the data plane resets itself)
 *   add_hi    int32 adds, wrapping: no overflow flag (docs/switch.md, "Tofino")
 *   or_hi     bitwise ORs (bitmaps)
 *   read_lo   a finished copy's low lane, in the harvest pass
 * Each returns one 32-bit word, the high lane after the update, so a pass reads half of a
 * result: the completing packet recirculates once to read the low lanes (PASS_HARVEST). A
 * retransmission of a finished round zeroes its words and recirculates twice: add_hi adds
 * zero and reads the high lanes (PASS_RETRANS_HI), then read_lo (PASS_HARVEST).
 *
 * The table picks the action from the pass (PASS_FIRST: a new round) and the round register's
 * answer (md.rv, aggregation.p4): 0 (an older round's packet: a refusal's words), the
 * worker's own bit set (a duplicate: its words become a status reply's), or else the op's. status_word and refused_word are what this pair's high word holds
 * in a status reply and in a refusal (the last words of the packet, reply.p4). */
#ifndef HOMAGG_TNA_PAIR_P4
#define HOMAGG_TNA_PAIR_P4

struct pair_t {
    bit<32> lo;
    bit<32> hi;
}

/* Pair4 ... Pair11: the pair, its table pinned to a stage (@stage): four pairs per stage, one
 * stateful ALU each, fill the eight stages after the bookkeeping (left to itself, the
 * compiler's table placement puts other tables there first and runs out of stages). */
#define PAIR_CONTROL(S) \
control Pair##S(inout bit<32> lo, inout bit<32> hi, in tna_metadata_t md, in bit<4> op, \
             in bit<32> status_word, in bit<32> refused_word) { \
    Register<pair_t, tna_index_t>(SLOT_STATE_SIZE) lanes; \
 \
    RegisterAction<pair_t, tna_index_t, bit<32>>(lanes) write_hi_ra = { \
        void apply(inout pair_t v, out bit<32> rv) { \
            v.lo = lo; \
            v.hi = hi; \
            rv = v.hi; \
        } \
    }; \
 \
    RegisterAction<pair_t, tna_index_t, bit<32>>(lanes) add_hi_ra = { \
        void apply(inout pair_t v, out bit<32> rv) { \
            v.lo = v.lo + lo; \
            v.hi = v.hi + hi; \
            rv = v.hi; \
        } \
    }; \
 \
    RegisterAction<pair_t, tna_index_t, bit<32>>(lanes) or_hi_ra = { \
        void apply(inout pair_t v, out bit<32> rv) { \
            v.lo = v.lo | lo; \
            v.hi = v.hi | hi; \
            rv = v.hi; \
        } \
    }; \
 \
    RegisterAction<pair_t, tna_index_t, bit<32>>(lanes) read_lo_ra = { \
        void apply(inout pair_t v, out bit<32> rv) { \
            rv = v.lo; \
        } \
    }; \
 \
    action write_hi() { hi = write_hi_ra.execute(md.idx); } \
    action add_hi()   { hi = add_hi_ra.execute(md.idx); } \
    action or_hi()    { hi = or_hi_ra.execute(md.idx); } \
    action read_lo()  { lo = read_lo_ra.execute(md.idx); } \
    action status()   { lo = 0; hi = status_word; } \
    action refused()  { lo = 0; hi = refused_word; } \
 \
    @stage(S) table act { \
        key = { \
            md.pass:   ternary; \
            md.worker: ternary; \
            md.rv:     ternary; \
            op:        ternary; \
        } \
        actions = { write_hi; add_hi; or_hi; read_lo; status; refused; NoAction; } \
        const default_action = NoAction(); \
        size = 64; \
        const entries = { \
            (PASS_HARVEST, _, _, _): read_lo(); \
            (PASS_RETRANS_HI, _, _, _): add_hi(); \
            (PASS_REFUSE, _, _, _): refused(); \
            (PASS_FIRST, _, _, _): write_hi(); \
            (PASS_AGGREGATE, _, 0, _): refused();          /* an older round's */ \
            (PASS_AGGREGATE, 0, 0x00000001 &&& 0x00000001, _): status(); \
            (PASS_AGGREGATE, 1, 0x00000002 &&& 0x00000002, _): status(); \
            (PASS_AGGREGATE, 2, 0x00000004 &&& 0x00000004, _): status(); \
            (PASS_AGGREGATE, 3, 0x00000008 &&& 0x00000008, _): status(); \
            (PASS_AGGREGATE, 4, 0x00000010 &&& 0x00000010, _): status(); \
            (PASS_AGGREGATE, 5, 0x00000020 &&& 0x00000020, _): status(); \
            (PASS_AGGREGATE, 6, 0x00000040 &&& 0x00000040, _): status(); \
            (PASS_AGGREGATE, 7, 0x00000080 &&& 0x00000080, _): status(); \
            (PASS_AGGREGATE, 8, 0x00000100 &&& 0x00000100, _): status(); \
            (PASS_AGGREGATE, 9, 0x00000200 &&& 0x00000200, _): status(); \
            (PASS_AGGREGATE, 10, 0x00000400 &&& 0x00000400, _): status(); \
            (PASS_AGGREGATE, 11, 0x00000800 &&& 0x00000800, _): status(); \
            (PASS_AGGREGATE, 12, 0x00001000 &&& 0x00001000, _): status(); \
            (PASS_AGGREGATE, 13, 0x00002000 &&& 0x00002000, _): status(); \
            (PASS_AGGREGATE, 14, 0x00004000 &&& 0x00004000, _): status(); \
            (PASS_AGGREGATE, 15, 0x00008000 &&& 0x00008000, _): status(); \
            (PASS_AGGREGATE, 16, 0x00010000 &&& 0x00010000, _): status(); \
            (PASS_AGGREGATE, 17, 0x00020000 &&& 0x00020000, _): status(); \
            (PASS_AGGREGATE, 18, 0x00040000 &&& 0x00040000, _): status(); \
            (PASS_AGGREGATE, 19, 0x00080000 &&& 0x00080000, _): status(); \
            (PASS_AGGREGATE, 20, 0x00100000 &&& 0x00100000, _): status(); \
            (PASS_AGGREGATE, 21, 0x00200000 &&& 0x00200000, _): status(); \
            (PASS_AGGREGATE, 22, 0x00400000 &&& 0x00400000, _): status(); \
            (PASS_AGGREGATE, 23, 0x00800000 &&& 0x00800000, _): status(); \
            (PASS_AGGREGATE, 24, 0x01000000 &&& 0x01000000, _): status(); \
            (PASS_AGGREGATE, 25, 0x02000000 &&& 0x02000000, _): status(); \
            (PASS_AGGREGATE, 26, 0x04000000 &&& 0x04000000, _): status(); \
            (PASS_AGGREGATE, 27, 0x08000000 &&& 0x08000000, _): status(); \
            (PASS_AGGREGATE, 28, 0x10000000 &&& 0x10000000, _): status(); \
            (PASS_AGGREGATE, 29, 0x20000000 &&& 0x20000000, _): status(); \
            (PASS_AGGREGATE, 30, 0x40000000 &&& 0x40000000, _): status(); \
            (PASS_AGGREGATE, 31, 0x80000000 &&& 0x80000000, _): status(); \
            (PASS_AGGREGATE, _, _, OP_ADD): add_hi(); \
            (PASS_AGGREGATE, _, _, OP_OR): or_hi(); \
        } \
    } \
 \
    apply { \
        act.apply(); \
    } \
}

PAIR_CONTROL(4)
PAIR_CONTROL(5)
PAIR_CONTROL(6)
PAIR_CONTROL(7)
PAIR_CONTROL(8)
PAIR_CONTROL(9)
PAIR_CONTROL(10)
PAIR_CONTROL(11)

/* One statement per pair i (headers.p4: VALUE_FIELDS), in HomaggIngress. */
#define PAIR_APPLY(i) p##i.apply(hdr.lo.v##i, hdr.hi.v##i, md, hdr.homagg.op, 32w0, 32w0);
#define ZERO_PAIR(i) hdr.lo.v##i = 0; hdr.hi.v##i = 0;

#endif
