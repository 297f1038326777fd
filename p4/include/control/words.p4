/* homagg: a slot copy's words and overflow bit, and the packet's part in them.
 *
 * A round's first packet overwrites (the data plane resets itself); later ones read-add-write
 * or read-or-write; only the completing packet copies the result into its header; a
 * retransmission of a finished round reads it back. Each action is one read-modify-write of
 * the slot copy, atomic in bmv2. Each 64 words are one 2048-bit value (lanes.p4: SWAR adds).
 *
 * An add ORs every chunk's overflow bits into one value (ov) and tests it once. A test per
 * chunk (if (...) { meta.overflow = 1; }) costs more than it seems: p4c turns each into
 * meta.overflow = cond ? 1 : <the previous value>, substituting the previous chunk's whole
 * expression, so chunk i's assignment re-evaluates the conditions of chunks 0..i - quadratic
 * in the chunks (34 at K = 2176: a 4.7 MB action in the bmv2 JSON, 630 tests per packet).
 */
#ifndef HOMAGG_WORDS_P4
#define HOMAGG_WORDS_P4

/* One statement (or declaration) per chunk i of the words (types.p4: FOR_CHUNKS). */
#define WORDS_REGISTER(i) register<chunk_t>(SLOT_STATE_SIZE) slot_words##i;
#define WRITE_CHUNK(i) slot_words##i.write(meta.idx, hdr.words.w##i);
#define READ_CHUNK(i) slot_words##i.read(hdr.words.w##i, meta.idx);
/* r: the slot's chunk; s: the lane-wise sum; a lane overflowed iff its operands have one sign
 * and its sum the other (lanes.p4) */
#define ADD_CHUNK(i) { \
        chunk_t r; \
        slot_words##i.read(r, meta.idx); \
        chunk_t s = LANE_ADD(r, hdr.words.w##i); \
        ov = ov | ((r ^ s) & (hdr.words.w##i ^ s)); \
        slot_words##i.write(meta.idx, s); \
    }
#define ADD_CHUNK_EMIT(i) { \
        chunk_t r; \
        slot_words##i.read(r, meta.idx); \
        chunk_t s = LANE_ADD(r, hdr.words.w##i); \
        ov = ov | ((r ^ s) & (hdr.words.w##i ^ s)); \
        slot_words##i.write(meta.idx, s); \
        hdr.words.w##i = s; \
    }
#define OR_CHUNK(i) { \
        chunk_t r; \
        slot_words##i.read(r, meta.idx); \
        slot_words##i.write(meta.idx, r | hdr.words.w##i); \
    }
#define OR_CHUNK_EMIT(i) { \
        chunk_t r; \
        slot_words##i.read(r, meta.idx); \
        hdr.words.w##i = r | hdr.words.w##i; \
        slot_words##i.write(meta.idx, hdr.words.w##i); \
    }

control Words(inout headers_t hdr, inout metadata_t meta) {
    FOR_CHUNKS(WORDS_REGISTER)
    register<bit<1>>(SLOT_STATE_SIZE) slot_overflow;   /* an int32 add of this round overflowed */

    /* a round's first packet; meta.flagged: a child switch's partial that overflowed */
    action first_words() {
        FOR_CHUNKS(WRITE_CHUNK)
        slot_overflow.write(meta.idx, meta.flagged);
        meta.overflowed = meta.flagged;
    }

    /* the parent's result (uplink.p4) replaces this switch's partial */
    action keep_final() {
        FOR_CHUNKS(WRITE_CHUNK)
    }

    /* meta.overflowed: this round's flag so far, this packet's lanes included */
    action merge_overflow(bit<1> lanes) {
        bit<1> before;
        slot_overflow.read(before, meta.idx);
        meta.overflowed = before | lanes;
        slot_overflow.write(meta.idx, meta.overflowed);
    }

    /* Separate actions for the completing packet: bmv2 pays for every primitive, and only
     * that packet needs the result in its header. */
    action add_words() {
        chunk_t ov = 0;
        FOR_CHUNKS(ADD_CHUNK)
        meta.overflow = ((ov & LANE_SIGN) != 0) ? 1w1 : 1w0;
    }

    action add_words_emit() {
        chunk_t ov = 0;
        FOR_CHUNKS(ADD_CHUNK_EMIT)
        meta.overflow = ((ov & LANE_SIGN) != 0) ? 1w1 : 1w0;
    }

    action or_words() {
        FOR_CHUNKS(OR_CHUNK)
        meta.overflow = 0;
    }

    action or_words_emit() {
        FOR_CHUNKS(OR_CHUNK_EMIT)
        meta.overflow = 0;
    }

    action read_result() {
        FOR_CHUNKS(READ_CHUNK)
        slot_overflow.read(meta.overflowed, meta.idx);
    }

    apply {
        if (meta.from_parent == 1) {
            if (meta.verdict == Verdict.ACCEPT && meta.complete == 1) {
                keep_final();
                merge_overflow(meta.flagged);
            }
        } else if (meta.verdict == Verdict.ACCEPT) {
            if (meta.first == 1) {
                first_words();               /* the header already holds the words */
            } else {
                if (hdr.homagg.op == OP_ADD) {
                    if (meta.complete == 1) { add_words_emit(); } else { add_words(); }
                } else {
                    if (meta.complete == 1) { or_words_emit(); } else { or_words(); }
                }
                merge_overflow(meta.overflow | meta.flagged);
            }
        } else if (meta.verdict == Verdict.RETRANS_REPLY || meta.verdict == Verdict.RESEND_UP) {
            read_result();
        }
    }
}

#endif
