/* homagg: every protocol constant, in one place (sizes are in size.p4).
 *
 * Python never retypes these: homagg/_p4consts.py is generated from this directory
 * (homagg.controller.genconsts, run by `homagg-ctl build`), and tests/test_constants.py fails
 * if the committed file differs from what the generator makes now.
 */
#ifndef HOMAGG_CONSTANTS_P4
#define HOMAGG_CONSTANTS_P4

#include "size.p4"

/* ---- wire protocol ---------------------------------------------------------------------- */
/* Workers send to the switch's address on a UDP port in [MIN, MAX]: several agents may share a
 * host, each on its own source port, and the fixed range keeps homagg traffic easy to match. */
const bit<16> HOMAGG_UDP_PORT_MIN = 48864;   /* 0xBEE0 */
const bit<16> HOMAGG_UDP_PORT_MAX = 48879;   /* 0xBEEF */
const bit<4>  HOMAGG_VERSION      = 2;   /* 2: the header's auth word */

const bit<4>  OP_ADD = 1;    /* int32 two's-complement add, overflow flagged */
const bit<4>  OP_OR  = 2;    /* bitwise OR of 32-bit words (bitmaps) */
const bit<4>  OP_JOIN = 3;   /* a new run's barrier: the switch hands out its generation
                                (join.p4); seq carries the joining agent's nonce */

/* flags byte (most significant bit first) */
const bit<8>  FLAG_RESULT    = 0x80;   /* set by the switch on every result it sends */
const bit<8>  FLAG_OVERFLOW  = 0x40;   /* some int32 add of this slot round overflowed */
const bit<8>  FLAG_PHASE     = 0x20;   /* which of the slot's two copies (shadow copy) */
const bit<8>  FLAG_RETRANS   = 0x10;   /* result re-sent by unicast to a retransmission */
const bit<8>  FLAG_STATUS    = 0x08;   /* reply to a retransmission of an unfinished round:
                                          words 61-62 = contributors bitmap (high, low),
                                          word 63 = their count; not a result */
const bit<8>  FLAG_REFUSED   = 0x04;   /* reply to a packet of a registered sender that the
                                          switch dropped (wrong identity, bad slot, stale,
                                          round mismatch): word 63 = the DROP_* reason, so the
                                          agent can say why; not a result */
const bit<8>  FLAG_UPSTREAM  = 0x02;   /* a status or refusal that a tree's parent switch sent
                                          (relayed down by the leaf): its bitmap and count
                                          are the parent's children, not workers */

/* Words per packet (K), set at build time: `homagg-ctl build --words K` compiles with
 * -DWORDS_PER_PACKET=K. 64 x 32 bit (256 B of payload, 314 B frames) is SwitchML's choice and
 * suits Tofino; on bmv2 the per-packet cost (parse, queue, thread hand-offs) dominates the
 * per-word cost, so the default is 256 (1024 B of payload, 1082 B frames). A multiple of 64
 * (the words are 64-word chunks: types.p4): 64 to 320 within the default 1500-byte MTU, up to
 * 2176 within a 9000-byte (jumbo) one. Everything below derives from it: the words fields, the
 * registers, the lengths. Agents learn K from the join's reply. (MAX_WORDS_PER_PACKET is the
 * wire's limit, for any target: what a jumbo frame holds. What an MTU holds, 364 words at
 * 1500, is Python's check, against the MTU in use: wire.mtu_words.) */
#ifndef WORDS_PER_PACKET
#define WORDS_PER_PACKET 256
#endif
#define DEFAULT_MTU 1500
#define JUMBO_MTU 9000
#define MAX_WORDS_PER_PACKET 2239  /* (JUMBO_MTU - 20 IPv4 - 8 UDP - 16 homagg) / 4 */
#define MIN_WORDS_PER_PACKET 16    /* room for a status reply and the scale negotiation */
/* A status reply (FLAG_STATUS) carries the contributors bitmap (high, low) and their count in
 * its last three words, from STATUS_WORD on: the low end of the words field, because bmv2
 * limits wide shifts (reply.p4). */
const bit<32> STATUS_WORD = WORDS_PER_PACKET - 3;
const bit<16> HOMAGG_HDR_BYTES     = 16;
const bit<16> HOMAGG_PAYLOAD_BYTES = 4 * WORDS_PER_PACKET;
const bit<16> HOMAGG_UDP_LEN       = 8 + HOMAGG_HDR_BYTES + HOMAGG_PAYLOAD_BYTES;
const bit<16> HOMAGG_IPV4_LEN      = 20 + HOMAGG_UDP_LEN;    /* no IPv4 options */
/* A join (and its replies) carries JOIN_WORDS words whatever K, since the agent does not know K
 * yet: room for a status reply, and small, because bmv2 cannot grow a packet by more than its
 * buffer's headroom. The join's replies say K in the header's slot field. Word JOIN_RUN_WORD
 * of a join is the agent's run (headers.p4, join_words_h). */
#define JOIN_WORDS 16
#define JOIN_RUN_WORD 0
const bit<16> HOMAGG_JOIN_UDP_LEN  = 8 + HOMAGG_HDR_BYTES + 4 * JOIN_WORDS;
const bit<16> HOMAGG_JOIN_IPV4_LEN = 20 + HOMAGG_JOIN_UDP_LEN;

/* ---- counters ---------------------------------------------------------------------------- */
/* Switch-wide (STATS_SIZE cells): index = reason. A new drop reason is one line here, and
 * one use where the packet is dropped; Python learns it from the generated constants. */
const bit<32> STAT_RX              = 0;   /* homagg packets addressed to the switch */
const bit<32> STAT_ACCEPTED        = 1;   /* contributions added into a slot */
const bit<32> STAT_COMPLETED       = 2;   /* slot rounds completed (results multicast) */
const bit<32> STAT_RETRANS_REPLY   = 3;   /* finished results re-sent by unicast */
const bit<32> STAT_DUP_PENDING     = 4;   /* duplicates of a round in progress: not added,
                                             answered with a FLAG_STATUS reply */
const bit<32> STAT_OVERFLOW        = 5;   /* slot rounds whose result carries FLAG_OVERFLOW */
const bit<32> DROP_MALFORMED       = 6;   /* truncated, IPv4 options, parser error */
const bit<32> DROP_BAD_LENGTH      = 7;   /* IPv4/UDP length not the homagg packet size */
const bit<32> DROP_BAD_VERSION     = 8;
const bit<32> DROP_BAD_OP          = 9;
const bit<32> DROP_FORGED_RESULT   = 10;  /* FLAG_RESULT set by a host */
const bit<32> DROP_UNKNOWN_SENDER  = 11;  /* (source address, port) not in the job table */
const bit<32> DROP_WRONG_IDENTITY  = 12;  /* header job/worker differ from the job table's */
const bit<32> DROP_BAD_SLOT        = 13;  /* slot outside the job's region */
const bit<32> DROP_SEQ_MISMATCH    = 14;  /* contribution for another round than the slot's */
const bit<32> DROP_STALE           = 15;  /* a round that already finished (late duplicate) */
const bit<32> DROP_SPOOFED         = 16;  /* a registered sender's address from another port,
                                              * or without its job's key (auth) */
/* Trees (a leaf switch whose job has a parent: uplink.p4). */
const bit<32> STAT_PARTIAL_UP      = 17;  /* rounds complete here, partial sum sent to the parent */
const bit<32> STAT_PARTIAL_RESENT  = 18;  /* partial sums re-sent to the parent for a worker's
                                             retransmission (the parent's answer was lost) */
const bit<32> STAT_FROM_PARENT     = 19;  /* results (finals), statuses and refusals from the
                                             parent, multicast to this switch's workers */
const bit<32> DROP_PARENT_DUP      = 20;  /* a parent's result this switch already holds, or
                                             for a round it does not (late duplicate) */
/* The join (join.p4). */
const bit<32> STAT_JOIN_AFRESH     = 21;  /* joins of a new run that found another run's join
                                             pending (it never completed) and started afresh */
/* Never counted by the data plane: the controller keeps the last job epoch it handed out here
 * (P4Runtime can write counters but not registers), so epochs stay unique for the switch's
 * lifetime, across controller restarts, and restart with the registers when the switch does. */
const bit<32> EPOCH_STORE          = 31;
/* Cell 30 is never counted either: homagg-ctl serve keeps there, as a bitmask of job ids, the
 * jobs it placed (controller/service.py, SERVICE_JOBS_CELL), so a restarted service finds them. */

/* Plain traffic (forwarding control, FWD_STATS_SIZE cells): index = outcome. */
const bit<32> FWD_ROUTED           = 0;   /* IPv4 packets routed */
const bit<32> FWD_ARP_REPLIES      = 1;   /* ARP requests answered (proxy ARP) */
const bit<32> FWD_NO_ROUTE         = 2;   /* no route, TTL expired, or neither IPv4 nor ARP */
const bit<32> FWD_SPOOFED          = 3;   /* UDP from a homagg port: only the switch sends those */

/* Per job (JOB_STATS_SIZE cells): index = job * JOB_STATS_PER_JOB + kind. */
const bit<32> JOB_STAT_ACCEPTED    = 0;
const bit<32> JOB_STAT_COMPLETED   = 1;
const bit<32> JOB_STAT_RETRANS     = 2;   /* retransmissions seen (replied or dropped) */
const bit<32> JOB_STAT_DROPPED     = 3;   /* dropped after the job was identified */

/* Not a counter: what admission leaves in meta.drop_reason when a packet passes. */
const bit<32> NO_DROP = 0xFF;

/* Replication ids: worker w of a job is rid w + 1 in the job's multicast group. */
const bit<16> RID_WORKER_OFFSET = 1;

#endif
