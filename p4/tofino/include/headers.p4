/* homagg on Tofino: the packet as the TNA program holds it. The wire headers (Ethernet, ARP,
 * IPv4, UDP, homagg_h) are the v1model program's (../../include/headers.p4): one protocol. The
 * K words are 32-bit fields here, two halves of K / 2 each: word i is lo.v[i], word K/2 + i is
 * hi.v[i], the two lanes of register pair i (pair.p4). */
#ifndef HOMAGG_TNA_HEADERS_P4
#define HOMAGG_TNA_HEADERS_P4

/* A slot copy's index: 2 * (region_base + slot) + phase, as on bmv2 */
typedef bit<(SLOT_INDEX_WIDTH + 1)> tna_index_t;

#define VALUE_FIELDS(X) \
    X(00) X(01) X(02) X(03) X(04) X(05) X(06) X(07) X(08) X(09) X(10) X(11) X(12) X(13) \
    X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) \
    X(28) X(29) X(30) X(31)
#define FIRST_30(X) \
    X(00) X(01) X(02) X(03) X(04) X(05) X(06) X(07) X(08) X(09) X(10) X(11) X(12) X(13) \
    X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) \
    X(28) X(29)
#define VALUE_FIELD(i) bit<32> v##i;

/* K / 2 consecutive words of the packet */
header half_h {
    VALUE_FIELDS(VALUE_FIELD)
}

/* A join's JOIN_WORDS words (constants.p4), as join_words_h lays them out: word 0 the run,
 * then JOIN_WORDS - 1 words, the last three a status or a refusal in a reply. */
header join_h {
    bit<32> run;
    bit<32> j1;  bit<32> j2;  bit<32> j3;  bit<32> j4;  bit<32> j5;
    bit<32> j6;  bit<32> j7;  bit<32> j8;  bit<32> j9;  bit<32> j10;
    bit<32> j11; bit<32> j12;
    bit<32> seen_hi;   /* word JOIN_WORDS - 3 */
    bit<32> seen_lo;   /* word JOIN_WORDS - 2 */
    bit<32> last;      /* word JOIN_WORDS - 1: a status's count, a refusal's reason */
}

/* What ingress tells egress, and a recirculated pass tells ingress (the first header the
 * ingress deparser emits, whatever the packet). */
header bridge_h {
    bit<8>  kind;          /* BRIDGE_* below */
    bit<16> job;           /* egress: the job whose worker a result replica goes to */
    bit<16> mcast_group;   /* a harvest pass: the job's group (BRIDGE_HARVEST_MCAST) */
    bit<7>  pad;
    bit<9>  port;          /* a harvest pass: the sender's port (BRIDGE_HARVEST_UNICAST) */
    bit<5>  pad2;
    tna_index_t idx;       /* a harvest pass: the slot copy's index (slot.p4) */
}

const bit<8> BRIDGE_NONE            = 0;   /* nothing for egress to do */
const bit<8> BRIDGE_RESULT          = 1;   /* a result replica: egress addresses it */
const bit<8> BRIDGE_HARVEST_MCAST   = 2;   /* recirculated: read the low lanes, multicast */
const bit<8> BRIDGE_HARVEST_UNICAST = 3;   /* recirculated: read the low lanes, to the sender */
const bit<8> BRIDGE_RETRANS_HI      = 4;   /* recirculated: read the high lanes, then harvest */

struct tna_headers_t {
    bridge_h   bridge;
    ethernet_h ethernet;
    arp_h      arp;
    ipv4_h     ipv4;
    udp_h      udp;
    homagg_h   homagg;
    half_h     lo;
    half_h     hi;
    join_h     join;
}

/* What the bookkeeping decides for an admitted packet (the verdict table). */
const bit<3> VERDICT_ACCEPT   = 0;   /* added (or first of its round), the round still open */
const bit<3> VERDICT_COMPLETE = 1;   /* added, and it completes the round (or the join) */
const bit<3> VERDICT_RETRANS  = 2;   /* a duplicate of a finished round: the result again */
const bit<3> VERDICT_PENDING  = 3;   /* a duplicate of an open round: a status reply */
const bit<3> VERDICT_STALE    = 4;   /* a packet of an older round: refused */

/* What a pair's table does with this pass (pair.p4). */
const bit<3> PASS_NONE       = 0;   /* not an aggregation packet, or dropped */
const bit<3> PASS_AGGREGATE  = 1;   /* a worker's contribution (first pass) */
const bit<3> PASS_HARVEST    = 2;   /* read the low lanes of a finished copy */
const bit<3> PASS_RETRANS_HI = 3;   /* read the high lanes (adds the zeroed words) */
const bit<3> PASS_REFUSE     = 4;   /* a refusal: zero words, the reason in the last */
const bit<3> PASS_FIRST      = 5;   /* a worker's contribution that starts its round */

struct tna_metadata_t {
    bit<1>   to_switch;
    bit<1>   job_known;
    bit<1>   refuse;         /* answer the sender with the drop reason */
    bit<1>   slot_ok;        /* the slot is inside the job's region */
    bit<3>   pass;           /* PASS_* */
    bit<8>   drop_reason;    /* a DROP_* counter index, or NO_DROP */
    bit<8>   stat;           /* the one STATS cell this pass counts */
    bit<2>   job_stat;       /* the JOB_STATS kind this pass counts */
    bit<1>   count_job;
    bit<1>   count_stat;
    bit<1>   admitted;       /* passed admission: a join, or a contribution */
    bit<1>   forwarded;      /* plain forwarding: fwd_stat counts it */
    bit<2>   fwd_stat;       /* FWD_* */
    bit<1>   trusted;        /* from a trusted fallback aggregator (forwarding.p4) */
    /* the job table's entry for the sender (admission) */
    bit<16>  job;
    bit<8>   worker;
    bit<8>   workers;
    bit<16>  epoch;
    bit<16>  mcast_group;
    /* the slot */
    bit<16>  slot;           /* region_base + the header's slot */
    tna_index_t idx;         /* 2 * slot + phase */
    bit<24>  owner;          /* epoch ++ gen: who may write the copy (aggregation.p4) */
    bit<1>   fresh;          /* the copy was another owner's: empty to this packet */
    bit<32>  me;             /* 1 << worker */
    bit<32>  mask;           /* (1 << workers) - 1 */
    bit<1>   newround;       /* this packet starts its copy's round (aggregation.p4) */
    bit<32>  rv;             /* the contributors before this packet; 0 for an older round's */
    bit<32>  mask_me;        /* mask ^ me: every worker but this one */
    bit<16>  room;           /* region_size - slot, saturated: 0 for a slot outside it */
    bit<9>   port_diff;      /* the job table's differences to the packet: 0 where they agree */
    bit<32>  auth_diff;
    bit<16>  job_diff;
    bit<8>   worker_diff;
    bit<32>  dup;            /* rv & me: this worker had already sent */
    bit<32>  left_before;    /* rv ^ mask: 0 when the round was complete before this packet */
    bit<32>  left_after;     /* rv ^ mask ^ me: 0 when this packet completes it */
    bit<3>   verdict;        /* VERDICT_* (the verdict table, homagg_tna.p4) */
    bit<32>  refusal;        /* the last word of a refusal: a DROP_* reason */
    bit<8>   gen;            /* a join's answer: the run's generation */
    bit<32>  join_run;       /* a join's run in this incarnation: run ^ (epoch ++ 16w0) */
}

struct tna_egress_headers_t {
    bridge_h   bridge;
    ethernet_h ethernet;
    ipv4_h     ipv4;
    udp_h      udp;
}

struct tna_egress_metadata_t {
}

#endif
