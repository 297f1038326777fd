/* homagg: headers and metadata. */
#ifndef HOMAGG_HEADERS_P4
#define HOMAGG_HEADERS_P4

#include "constants.p4"
#include "types.p4"

header ethernet_h {
    bit<48> dst_addr;
    bit<48> src_addr;
    bit<16> ether_type;
}

header arp_h {
    bit<16> htype;
    bit<16> ptype;
    bit<8>  hlen;
    bit<8>  plen;
    bit<16> oper;
    bit<48> sha;
    bit<32> spa;
    bit<48> tha;
    bit<32> tpa;
}

header ipv4_h {
    bit<4>  version;
    bit<4>  ihl;
    bit<8>  diffserv;
    bit<16> total_len;
    bit<16> identification;
    bit<3>  flags;
    bit<13> frag_offset;
    bit<8>  ttl;
    bit<8>  protocol;
    bit<16> hdr_checksum;
    bit<32> src_addr;
    bit<32> dst_addr;
}

header udp_h {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

/* The homagg header, after UDP (all fields big-endian):
 *
 *  0                   1                   2                   3
 *  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
 * +-------+-------+---------------+-------------------------------+
 * |version|  op   |R|O|P|T|S|zero |            job id             |
 * +-------+-------+---------------+-------------------------------+
 * |   worker id   |      gen      |        slot (in region)       |
 * +---------------+---------------+-------------------------------+
 * |                   sequence number (round tag)                 |
 * +---------------------------------------------------------------+
 * |                      auth (the job's key)                     |
 * +---------------------------------------------------------------+
 * |                            word 0                             |
 * +---------------------------------------------------------------+
 * :                              ...                              :
 * +---------------------------------------------------------------+
 * |                 word K - 1 (K = WORDS_PER_PACKET)             |
 * +---------------------------------------------------------------+
 *
 *  op:     OP_ADD (int32 add), OP_OR (bitwise OR), or OP_JOIN (a new run's first packet)
 *  gen:    the run's generation, handed out by the join (join.p4): a slot copy written by
 *          an older generation is empty to a newer one, so round tags restart each run
 *  flags:  R result (switch -> host only), O overflow, P phase (which copy of the slot),
 *          T retransmitted result (unicast reply to a duplicate), S status: the round is not
 *          finished yet (reply to a duplicate; words K-3, K-2 contributors bitmap, word K-1 count,
 *          all others 0)
 *  slot:   index within the job's slot region
 *  seq:    the round tag: every worker sends the same seq into the same slot round, and a
 *          worker's successive rounds on one slot have increasing seq (serial arithmetic)
 *  auth:   the job's 32-bit key, agreed at the join (the controller installs it with the
 *          job): admission drops a registered sender's packet with another key as spoofed,
 *          unanswered, and the agents drop results with another key. It keeps out an off-path
 *          sender who cannot read the job's traffic; not an on-path one (it travels in clear)
 *  words:  int32 (ADD) or bit sets (OR); results come back in the same layout
 */
header homagg_h {
    bit<4>  version;
    bit<4>  op;
    bit<8>  flags;
    bit<16> job;        /* job_id_t */
    bit<8>  worker;     /* worker_id_t */
    bit<8>  gen;        /* gen_t: the run's generation, from the job's join (join.p4) */
    bit<16> slot;       /* slot_t */
    bit<32> seq;        /* seq_t */
    bit<32> auth;       /* the job's key (admission.p4) */
}

/* WORDS_PER_PACKET words as chunks of 64 (types.p4; lanes.p4 says why): word 0, first on the
 * wire, is w0's top 32 bits; word K - 1 is the last chunk's low 32 bits. */
#define WORDS_FIELD(i) chunk_t w##i;
header words_h {
    FOR_CHUNKS(WORDS_FIELD)
}

/* A join's JOIN_WORDS words (constants.p4). From an agent: word 0 its run, the attempt that
 * every worker of one run of the job shares (join.p4), then zeros. In a reply: word 0 zero,
 * then zeros, a status or a refusal's reason. A child job's join of its parent's carries the
 * run up. */
header join_words_h {
    bit<32>  run;  /* word 0 */
    bit<480> w;    /* words 1 .. JOIN_WORDS - 1 */
}

struct headers_t {
    ethernet_h ethernet;
    arp_h      arp;
    ipv4_h     ipv4;
    udp_h      udp;
    homagg_h   homagg;
    words_h    words;
    join_words_h join_words;
}

struct metadata_t {
    bit<1>          to_switch;      /* homagg packet addressed to the switch itself */
    bit<1>          mcast_result;   /* egress rewrites the destination per replica */
    /* admission: the job table's entry for the sender */
    bit<32>         drop_reason;    /* a DROP_* counter index, or NO_DROP */
    bit<1>          job_known;      /* the sender matched the job table (per-job counters) */
    job_id_t        job;
    worker_id_t     worker;
    bit<8>          workers;
    epoch_t         epoch;
    bit<16>         region_base;
    bit<16>         region_size;
    bit<16>         mcast_group;
    bit<9>          sender_port;    /* the switch port the sender is cabled to */
    /* slot state */
    slot_index_t    idx;            /* 2 * (region_base + slot) + phase */
    Verdict         verdict;
    bit<1>          first;          /* this packet starts a new round of its slot copy */
    bit<1>          complete;       /* this packet completes its round */
    bit<8>          count;          /* contributions so far, this one included */
    worker_bitmap_t seen;           /* contributors so far (status replies) */
    bit<1>          overflowed;     /* some add of this round overflowed (this one included) */
    bit<1>          overflow;       /* some lane of this packet's add overflowed */
    bit<1>          refuse;         /* tell the sender its packet was dropped, and why */
    /* trees (uplink.p4) */
    bit<1>          from_parent;    /* a result, status or refusal from the job's parent */
    bit<1>          held;           /* a parent's join answer kept, not relayed (join.p4) */
    bit<1>          afresh;         /* a pending join of another run started afresh (join.p4) */
    bit<1>          tree;           /* the job has a parent (the uplink table's entry) */
    bit<1>          flagged;        /* the packet's FLAG_OVERFLOW: a child's partial overflowed */
    bit<32>         auth;           /* the job's key: what its workers' packets carry */
    job_id_t        up_job;
    worker_id_t     up_worker;
    bit<32>         up_auth;        /* the parent job's key: what a partial going up carries */
    bit<48>         up_mac;
    bit<32>         up_ip;
    bit<16>         up_udp_port;
    bit<16>         up_src_port;
    bit<9>          up_port;
}

#endif
