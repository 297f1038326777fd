/* homagg: a slot copy's WORDS_PER_PACKET words as one 2048-bit register value (SWAR).
 *
 * bmv2 interprets every primitive: 64 separate 32-bit lanes cost 64 reads, adds, overflow
 * checks and writes per packet. Held as one bit<2048> value, a packet costs one read, a few
 * wide operations and one write. The 64 int32 additions are done at once without carries
 * crossing lanes (SIMD within a register): add the low 31 bits of every lane, then fix bit 31
 * with an XOR. A lane overflowed iff its operands have one sign and its sum the other:
 * bit 31 of (r ^ s) & (v ^ s).
 */
#ifndef HOMAGG_LANES_P4
#define HOMAGG_LANES_P4

#include "constants.p4"

#define WORDS_BITS 2048                                /* 32 * WORDS_PER_PACKET */
typedef bit<WORDS_BITS> words_t;

/* bit 31 of every 32-bit lane */
const words_t LANE_SIGN = 0x80000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000;

/* per-lane int32 sum of r and v, carries kept inside each lane */
#define LANE_ADD(r, v) ((((r) & ~LANE_SIGN) + ((v) & ~LANE_SIGN)) ^ (((r) ^ (v)) & LANE_SIGN))

#endif
