/* homagg on Tofino: the sizes the TNA program adds to ../../include/size.p4, in one place.
 *
 * Words per packet (K) are the values one pass adds: WORDS_PER_PACKET, 64 unless -D says
 * otherwise. They live in K / 2
 * register pairs of two int32 lanes (Tofino's widest stateful cell is 64 bits, one stateful ALU
 * per register, four per stage), SwitchML's layout: 64 values in 32 pairs fill the eight
 * stages that follow the bookkeeping. */
#ifndef HOMAGG_TNA_SIZE_P4
#define HOMAGG_TNA_SIZE_P4

#ifndef WORDS_PER_PACKET
#define WORDS_PER_PACKET 64
#endif
#if WORDS_PER_PACKET != 64
#error "the TNA program takes WORDS_PER_PACKET 64 (SwitchML's 256 B: 32 pairs in 8 stages)"
#endif
#define VALUE_PAIRS (WORDS_PER_PACKET / 2)

/* Workers per job on one Tofino switch: one bit each in a 32-bit register cell. */
#define TNA_MAX_WORKERS 32

/* The recirculation port of pipe 0, where a completed round's second read pass goes
 * (Tofino 1: 68; Tofino 2: 6). -DRECIRC_PORT=N for another pipe. */
#ifndef RECIRC_PORT
#if __TARGET_TOFINO__ == 2
#define RECIRC_PORT 6
#else
#define RECIRC_PORT 68
#endif
#endif

#endif
