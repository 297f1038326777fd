/* homagg: a slot copy's words and overflow bit, and the packet's part in them.
 *
 * A round's first packet overwrites (the data plane resets itself); later ones read-add-write
 * or read-or-write; only the completing packet copies the result into its header; a
 * retransmission of a finished round reads it back. Each action is one read-modify-write of
 * the slot copy, atomic in bmv2. The 64 words are one 2048-bit value (lanes.p4: SWAR adds).
 */
#ifndef HOMAGG_WORDS_P4
#define HOMAGG_WORDS_P4

control Words(inout headers_t hdr, inout metadata_t meta) {
    register<words_t>(SLOT_STATE_SIZE) slot_words;
    register<bit<1>>(SLOT_STATE_SIZE) slot_overflow;   /* an int32 add of this round overflowed */

    action first_words() {
        slot_words.write(meta.idx, hdr.words.w);
        slot_overflow.write(meta.idx, 0);
        meta.overflowed = 0;
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
        words_t r;
        slot_words.read(r, meta.idx);
        words_t s = LANE_ADD(r, hdr.words.w);
        meta.overflow = (((r ^ s) & (hdr.words.w ^ s) & LANE_SIGN) == 0) ? 1w0 : 1w1;
        slot_words.write(meta.idx, s);
    }

    action add_words_emit() {
        words_t r;
        slot_words.read(r, meta.idx);
        words_t s = LANE_ADD(r, hdr.words.w);
        meta.overflow = (((r ^ s) & (hdr.words.w ^ s) & LANE_SIGN) == 0) ? 1w0 : 1w1;
        slot_words.write(meta.idx, s);
        hdr.words.w = s;
    }

    action or_words() {
        words_t r;
        slot_words.read(r, meta.idx);
        slot_words.write(meta.idx, r | hdr.words.w);
        meta.overflow = 0;
    }

    action or_words_emit() {
        words_t r;
        slot_words.read(r, meta.idx);
        hdr.words.w = r | hdr.words.w;
        slot_words.write(meta.idx, hdr.words.w);
        meta.overflow = 0;
    }

    action read_result() {
        slot_words.read(hdr.words.w, meta.idx);
        slot_overflow.read(meta.overflowed, meta.idx);
    }

    apply {
        if (meta.verdict == Verdict.ACCEPT) {
            if (meta.first == 1) {
                first_words();               /* the header already holds the words */
            } else {
                if (hdr.homagg.op == OP_ADD) {
                    if (meta.complete == 1) { add_words_emit(); } else { add_words(); }
                } else {
                    if (meta.complete == 1) { or_words_emit(); } else { or_words(); }
                }
                merge_overflow(meta.overflow);
            }
        } else if (meta.verdict == Verdict.RETRANS_REPLY) {
            read_result();
        }
    }
}

#endif
