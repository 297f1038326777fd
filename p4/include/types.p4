/* homagg: the types every control shares (P4_16 spec naming: _t for types). */
#ifndef HOMAGG_TYPES_P4
#define HOMAGG_TYPES_P4

#include "size.p4"
#include "constants.p4"

typedef bit<16> job_id_t;        /* header job field; < MAX_JOBS for the per-job counters */
typedef bit<8>  worker_id_t;     /* < MAX_WORKERS */
typedef bit<16> slot_t;          /* a slot within the job's region */
typedef bit<32> seq_t;           /* round tag, compared with serial arithmetic */
typedef bit<16> epoch_t;         /* job incarnation, handed out by the controller */
typedef bit<8>  gen_t;           /* run generation, handed out by the join (serial arithmetic) */
typedef bit<32> slot_index_t;    /* 2 * (region_base + slot) + phase, < SLOT_STATE_SIZE */
typedef bit<MAX_WORKERS> worker_bitmap_t;
/* A packet's K words as K / 64 chunks of 64 words, each one 2048-bit value (lanes.p4 says
 * why): 2048 bits is the widest type p4c supports. K = WORDS_PER_PACKET (constants.p4). */
#define CHUNK_WORDS 64
#define CHUNK_BITS 2048
#define WORD_CHUNKS (WORDS_PER_PACKET / CHUNK_WORDS)
#define WORDS_BITS (32 * WORDS_PER_PACKET)
typedef bit<CHUNK_BITS> chunk_t;

/* FOR_CHUNKS(X) expands X(0) X(1) ... X(WORD_CHUNKS - 1): one field, register or statement
 * per chunk; LAST_CHUNK is the chunk holding word K - 1 (status and refusal words). */
#if WORD_CHUNKS == 1
#define FOR_CHUNKS(X) X(0)
#define LAST_CHUNK w0
#elif WORD_CHUNKS == 2
#define FOR_CHUNKS(X) X(0) X(1)
#define LAST_CHUNK w1
#elif WORD_CHUNKS == 3
#define FOR_CHUNKS(X) X(0) X(1) X(2)
#define LAST_CHUNK w2
#elif WORD_CHUNKS == 4
#define FOR_CHUNKS(X) X(0) X(1) X(2) X(3)
#define LAST_CHUNK w3
#elif WORD_CHUNKS == 5
#define FOR_CHUNKS(X) X(0) X(1) X(2) X(3) X(4)
#define LAST_CHUNK w4
#elif WORD_CHUNKS == 6
#define FOR_CHUNKS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define LAST_CHUNK w5
#elif WORD_CHUNKS == 7
#define FOR_CHUNKS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6)
#define LAST_CHUNK w6
#elif WORD_CHUNKS == 8
#define FOR_CHUNKS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define LAST_CHUNK w7
#elif WORD_CHUNKS == 9
#define FOR_CHUNKS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)
#define LAST_CHUNK w8
#elif WORD_CHUNKS == 10
#define FOR_CHUNKS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
#define LAST_CHUNK w9
#elif WORD_CHUNKS == 11
#define FOR_CHUNKS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10)
#define LAST_CHUNK w10
#elif WORD_CHUNKS == 12
#define FOR_CHUNKS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define LAST_CHUNK w11
#elif WORD_CHUNKS == 13
#define FOR_CHUNKS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12)
#define LAST_CHUNK w12
#elif WORD_CHUNKS == 14
#define FOR_CHUNKS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13)
#define LAST_CHUNK w13
#elif WORD_CHUNKS == 15
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14)
#define LAST_CHUNK w14
#elif WORD_CHUNKS == 16
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15)
#define LAST_CHUNK w15
#elif WORD_CHUNKS == 17
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16)
#define LAST_CHUNK w16
#elif WORD_CHUNKS == 18
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17)
#define LAST_CHUNK w17
#elif WORD_CHUNKS == 19
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18)
#define LAST_CHUNK w18
#elif WORD_CHUNKS == 20
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19)
#define LAST_CHUNK w19
#elif WORD_CHUNKS == 21
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20)
#define LAST_CHUNK w20
#elif WORD_CHUNKS == 22
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21)
#define LAST_CHUNK w21
#elif WORD_CHUNKS == 23
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22)
#define LAST_CHUNK w22
#elif WORD_CHUNKS == 24
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
#define LAST_CHUNK w23
#elif WORD_CHUNKS == 25
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24)
#define LAST_CHUNK w24
#elif WORD_CHUNKS == 26
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25)
#define LAST_CHUNK w25
#elif WORD_CHUNKS == 27
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26)
#define LAST_CHUNK w26
#elif WORD_CHUNKS == 28
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27)
#define LAST_CHUNK w27
#elif WORD_CHUNKS == 29
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) \
    X(28)
#define LAST_CHUNK w28
#elif WORD_CHUNKS == 30
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) \
    X(28) X(29)
#define LAST_CHUNK w29
#elif WORD_CHUNKS == 31
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) \
    X(28) X(29) X(30)
#define LAST_CHUNK w30
#elif WORD_CHUNKS == 32
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) \
    X(28) X(29) X(30) X(31)
#define LAST_CHUNK w31
#elif WORD_CHUNKS == 33
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) \
    X(28) X(29) X(30) X(31) X(32)
#define LAST_CHUNK w32
#elif WORD_CHUNKS == 34
#define FOR_CHUNKS(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) \
    X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) \
    X(28) X(29) X(30) X(31) X(32) X(33)
#define LAST_CHUNK w33
#else
#error "WORDS_PER_PACKET: a multiple of 64, from 64 to 2176 (34 chunks: what a 9000-byte MTU holds)"
#endif

/* A slot copy's bookkeeping, packed (slot_state.p4): seen ++ count ++ tag ++ op ++ epoch ++ gen
 * ++ final ++ 3 spare bits, most significant first; a slot's two copies side by side (copy 1
 * high). final: a child job's copy holds the parent's result, not its partial (uplink.p4). */
#define SLOT_COPY_BITS 136
#define SEEN_HI 135
#define SEEN_LO 72
#define COUNT_HI 71
#define COUNT_LO 64
#define TAG_HI 63
#define TAG_LO 32
#define OP_HI 31
#define OP_LO 28
#define EPOCH_HI 27
#define EPOCH_LO 12
#define GEN_HI 11
#define GEN_LO 4
#define FINAL_BIT 3
typedef bit<SLOT_COPY_BITS> slot_copy_t;
typedef bit<(2 * SLOT_COPY_BITS)> slot_pair_t;

/* A job's join (join.p4), packed: run ++ seen ++ count ++ gen ++ epoch ++ handed ++ held ++
 * final, most significant first. run: the attempt the current join belongs to (its joins'
 * run word); handed: the generation the last complete join handed out (the root's, in a
 * tree); held: the parent's answer came while the join here was still pending, and handed is
 * already its generation; final: the current join is complete at the root, not only here
 * (uplink.p4). */
#define JOIN_BITS 138
#define JOIN_RUN_HI 137
#define JOIN_RUN_LO 106
#define JOIN_SEEN_HI 105
#define JOIN_SEEN_LO 42
#define JOIN_COUNT_HI 41
#define JOIN_COUNT_LO 34
#define JOIN_GEN_HI 33
#define JOIN_GEN_LO 26
#define JOIN_EPOCH_HI 25
#define JOIN_EPOCH_LO 10
#define JOIN_HANDED_HI 9
#define JOIN_HANDED_LO 2
#define JOIN_HELD 1
#define JOIN_FINAL 0
typedef bit<JOIN_BITS> join_state_t;

/* What the slot state machine decides for a contribution that passed admission. */
enum bit<8> Verdict {
    ACCEPT        = 0,   /* added (or overwrote, first of a round) */
    RETRANS_REPLY = 1,   /* a duplicate of a finished round: its result goes back by unicast */
    DUP_PENDING   = 2,   /* a duplicate of an unfinished round: a status reply goes back */
    SEQ_MISMATCH  = 3,   /* a contribution for another round than the slot's */
    STALE         = 4,   /* a round that already finished, or an older one */
    RESEND_UP     = 5    /* a duplicate of a round complete here whose final (the parent's
                            result) has not come down: the partial goes up again (trees) */
}

#endif
