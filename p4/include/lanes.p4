/* homagg: the WORDS_PER_PACKET register lanes, written once as macros.
 *
 * Lane L holds word L of every slot copy. LANES(X) expands X(00) .. X(77): two octal digits,
 * lane number 8 * tens + units, matching the words_h field names. */
#ifndef HOMAGG_LANES_P4
#define HOMAGG_LANES_P4

#define LANES8(X, p) X(p##0) X(p##1) X(p##2) X(p##3) X(p##4) X(p##5) X(p##6) X(p##7)
#define LANES(X) LANES8(X, 0) LANES8(X, 1) LANES8(X, 2) LANES8(X, 3) \
                 LANES8(X, 4) LANES8(X, 5) LANES8(X, 6) LANES8(X, 7)

#define DECLARE_LANE(L) register<bit<32>>(SLOT_STATE_SIZE) lane_##L;

/* Per lane, as few bmv2 primitives as possible: the packet rate is what they cost.
 * A round's first packet overwrites (no read: the data plane resets itself). Later packets
 * read, add and write back; only the packet that completes the round copies the sum into
 * its header (the result), the others are absorbed. Signed overflow: operands of one sign,
 * sum of the other, i.e. bit 31 of (r ^ s) & (v ^ s). */
#define FIRST_LANE(L) lane_##L.write(meta.idx, hdr.words.w##L);

#define ADD_LANE(L) \
    lane_##L.read(r, meta.idx); \
    s = r + hdr.words.w##L; \
    ovf = ovf | ((r ^ s) & (hdr.words.w##L ^ s)); \
    lane_##L.write(meta.idx, s);

#define ADD_LANE_EMIT(L) ADD_LANE(L) hdr.words.w##L = s;

#define OR_LANE(L) \
    lane_##L.read(r, meta.idx); \
    s = r | hdr.words.w##L; \
    lane_##L.write(meta.idx, s);

#define OR_LANE_EMIT(L) OR_LANE(L) hdr.words.w##L = s;

#define READ_LANE(L) lane_##L.read(hdr.words.w##L, meta.idx);

#endif
