/* homagg: a slot copy's words as 2048-bit register values of 64 lanes each (SWAR).
 *
 * bmv2 interprets every primitive: 64 separate 32-bit lanes cost 64 reads, adds, overflow
 * checks and writes per packet. Held as one bit<2048> value per 64 words, a packet costs one read, a few
 * wide operations and one write. The 64 int32 additions are done at once without carries
 * crossing lanes (SIMD within a register): add the low 31 bits of every lane, then fix bit 31
 * with an XOR. A lane overflowed iff its operands have one sign and its sum the other:
 * bit 31 of (r ^ s) & (v ^ s).
 */
#ifndef HOMAGG_LANES_P4
#define HOMAGG_LANES_P4

#include "constants.p4"

/* chunk_t (bit<2048>, 64 lanes) and the chunking are in types.p4: 2048 bits is the widest type
 * p4c supports, so a packet of K words is K / 64 chunks, each added as below. */

/* bit 31 of every 32-bit lane of a chunk */
const chunk_t LANE_SIGN = 0x80000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000800000008000000080000000;

/* per-lane int32 sum of r and v, carries kept inside each lane */
#define LANE_ADD(r, v) ((((r) & ~LANE_SIGN) + ((v) & ~LANE_SIGN)) ^ (((r) ^ (v)) & LANE_SIGN))

#endif
