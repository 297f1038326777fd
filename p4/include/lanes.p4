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

/* int32 add; a fresh round (meta.first) overwrites instead of adding, so slot state resets
 * itself in the data plane. Signed overflow: operands of one sign, result of the other. */
#define ADD_LANE(L) \
    lane_##L.read(r, meta.idx); \
    r = (meta.first == 1) ? 32w0 : r; \
    v = hdr.words.w##L; \
    s = r + v; \
    ovf = ovf | ((r ^ s) & (v ^ s)); \
    lane_##L.write(meta.idx, s); \
    hdr.words.w##L = s;

#define OR_LANE(L) \
    lane_##L.read(r, meta.idx); \
    r = (meta.first == 1) ? 32w0 : r; \
    s = r | hdr.words.w##L; \
    lane_##L.write(meta.idx, s); \
    hdr.words.w##L = s;

#define READ_LANE(L) lane_##L.read(hdr.words.w##L, meta.idx);

#endif
