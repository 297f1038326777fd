/* homagg: in-network aggregation of homomorphically compressed gradients, for Tofino (TNA).
 *
 * The same protocol as the v1model program (../homagg.p4): the wire headers and every
 * protocol constant are its own (../include/headers.p4, ../include/constants.p4), built with
 * K = WORDS_PER_PACKET = 64 (include/size.p4). What differs, and why, is in docs/switch.md
 * ("Tofino"); in short:
 *   - the words live in 32 register pairs of two int32 lanes (pair.p4), SwitchML's layout:
 *     one pass adds 64 values, and a completed round's packet recirculates once to read the
 *     low lanes before it is multicast;
 *   - a slot copy's bookkeeping is two registers (aggregation.p4: owner, round), and a job
 *     has at most 32 workers per switch;
 *   - adds wrap: no overflow flag (the agents' codec leaves the room that keeps a job's sums
 *     inside int32);
 *   - no tree uplink: a job's workers all hang off this switch.
 *
 * Pass 1 (a worker's packet): admission, the slot copy's owner and round, the 32 pairs, the
 * reply. Pass 2 (recirculated, bridge_h in front): the low lanes of a finished copy, then the
 * multicast (or the unicast of a retransmission's result). Egress addresses each result
 * replica to its worker (result_dst, the v1model program's table).
 */
#include <core.p4>
#if __TARGET_TOFINO__ == 2
#include <t2na.p4>
#else
#include <tna.p4>
#endif

#include "include/size.p4"
#include "../include/size.p4"
#include "../include/constants.p4"
#include "../include/headers.p4"
#include "include/headers.p4"
#include "include/pair.p4"
#include "include/aggregation.p4"
#include "include/forwarding.p4"

/* A reply's flags: the given ones, and the packet's phase (FLAG_PHASE, bit 5) kept as it is:
 * two slice writes, one operation each (a read-modify-write of the byte would take two). */
#define SET_FLAGS(f) hdr.homagg.flags[7:6] = (f)[7:6]; hdr.homagg.flags[4:0] = (f)[4:0];

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<16> ETHERTYPE_ARP  = 0x0806;
const bit<8>  IP_PROTO_UDP   = 17;

parser HomaggIngressParser(packet_in pkt, out tna_headers_t hdr, out tna_metadata_t md,
                           out ingress_intrinsic_metadata_t ig_intr_md) {
    state start {
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        transition select(ig_intr_md.ingress_port) {
            RECIRC_PORT: parse_bridge;   /* a finished round's second pass */
            default: parse_ethernet;
        }
    }
    /* always a homagg data packet, whatever its UDP ports say now (a retransmission's
     * result is already addressed to the worker's port) */
    state parse_bridge {
        pkt.extract(hdr.bridge);
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.homagg);
        transition parse_words;
    }
    state parse_ethernet {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            ETHERTYPE_ARP:  parse_arp;
            default: accept;
        }
    }
    state parse_arp {
        pkt.extract(hdr.arp);
        transition accept;
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (5, 0, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            HOMAGG_UDP_PORT_MIN &&& 0xFFF0: parse_homagg;
            default: accept;
        }
    }
    state parse_homagg {
        pkt.extract(hdr.homagg);
        transition select(hdr.homagg.op) {
            OP_JOIN: parse_join;
            default: parse_words;
        }
    }
    state parse_join {
        pkt.extract(hdr.join);
        transition accept;
    }
    state parse_words {
        pkt.extract(hdr.lo);
        pkt.extract(hdr.hi);
        transition accept;
    }
}

control HomaggIngress(inout tna_headers_t hdr, inout tna_metadata_t md,
                      in ingress_intrinsic_metadata_t ig_intr_md,
                      in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                      inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                      inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    Counter<bit<32>, bit<5>>(STATS_SIZE, CounterType_t.PACKETS) stats;
    Counter<bit<32>, bit<8>>(JOB_STATS_SIZE, CounterType_t.PACKETS_AND_BYTES) job_stats;
    Counter<bit<32>, bit<2>>(FWD_STATS_SIZE, CounterType_t.PACKETS) fwd_stats;

    Forwarding() forwarding;
    Admission() admission;
    SlotRound() slot_round;
    JoinState() join_state;
    Pair4() p00; Pair4() p01; Pair4() p02; Pair4() p03;
    Pair5() p04; Pair5() p05; Pair5() p06; Pair5() p07;
    Pair6() p08; Pair6() p09; Pair6() p10; Pair6() p11;
    Pair7() p12; Pair7() p13; Pair7() p14; Pair7() p15;
    Pair8() p16; Pair8() p17; Pair8() p18; Pair8() p19;
    Pair9() p20; Pair9() p21; Pair9() p22; Pair9() p23;
    Pair10() p24; Pair10() p25; Pair10() p26; Pair10() p27;
    Pair11() p28; Pair11() p29; Pair11() p30; Pair11() p31;

    action to_switch() {
        md.to_switch = 1;
    }

    /* The switch's own IPv4 addresses: homagg packets to these are aggregated. */
    table local_ip {
        key = { hdr.ipv4.dst_addr: exact @name("dst_addr"); }
        actions = { to_switch; NoAction; }
        default_action = NoAction();
        size = LOCAL_IP_TABLE_SIZE;
    }




    action zero_words() {
        VALUE_FIELDS(ZERO_PAIR)
    }

    /* the bookkeeping's answer against the job's workers (one operation each) */
    action bitmaps() {
        md.dup = md.rv & md.me;
        md.left_before = md.rv ^ md.mask;
        md.left_after = md.rv ^ md.mask_me;
    }

    table bits {
        actions = { bitmaps; }
        const default_action = bitmaps();
        size = 1;
    }

    /* What goes back, by verdict: each action the whole reply (the v1model program's
     * reply.p4), and the one STATS and JOB_STATS cell the packet counts. */
#define COUNT(s_, k_) md.stat = (bit<8>)(s_); md.job_stat = (bit<2>)(k_); \
        md.count_stat = 1; md.count_job = 1;
#define TO_SENDER \
        bit<48> mac = hdr.ethernet.dst_addr; \
        hdr.ethernet.dst_addr = hdr.ethernet.src_addr; \
        hdr.ethernet.src_addr = mac; \
        bit<32> ip = hdr.ipv4.dst_addr; \
        hdr.ipv4.dst_addr = hdr.ipv4.src_addr; \
        hdr.ipv4.src_addr = ip; \
        bit<16> port = hdr.udp.dst_port; \
        hdr.udp.dst_port = hdr.udp.src_port; \
        hdr.udp.src_port = port; \
        hdr.udp.checksum = 0; \
        hdr.ipv4.ttl = 64;
#define FROM_SWITCH \
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr; \
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr; \
        hdr.udp.src_port = hdr.udp.dst_port; \
        hdr.udp.checksum = 0; \
        hdr.ipv4.ttl = 64;
#define BACK ig_tm_md.ucast_egress_port = ig_intr_md.ingress_port; ig_dprsr_md.drop_ctl = 0;
/* a finished copy's low lanes are read in a second pass (pair.p4) */
#define RECIRCULATE(k, sender) \
        hdr.bridge.kind = (k); \
        hdr.bridge.job = md.job; \
        hdr.bridge.mcast_group = md.mcast_group; \
        hdr.bridge.port = (sender); \
        hdr.bridge.idx = md.idx; \
        ig_tm_md.ucast_egress_port = RECIRC_PORT; \
        ig_tm_md.bypass_egress = 1; \
        ig_dprsr_md.drop_ctl = 0;
#define JOIN_REPLY hdr.homagg.slot = WORDS_PER_PACKET; hdr.join.run = 0;

    /* a packet of an older round: refused, as stale */
    action stale() {
        SET_FLAGS(FLAG_RESULT | FLAG_REFUSED)
        TO_SENDER BACK COUNT(DROP_STALE, JOB_STAT_DROPPED)
    }
    /* a finished round's result again, by unicast: two more passes */
    action again() {
        SET_FLAGS(FLAG_RESULT | FLAG_RETRANS)
        TO_SENDER RECIRCULATE(BRIDGE_RETRANS_HI, ig_intr_md.ingress_port)
        COUNT(STAT_RETRANS_REPLY, JOB_STAT_RETRANS)
    }
    /* an open round: a status naming the contributors (the pairs wrote its words) */
    action pending() {
        SET_FLAGS(FLAG_RESULT | FLAG_STATUS)
        TO_SENDER BACK COUNT(STAT_DUP_PENDING, JOB_STAT_RETRANS)
    }
    /* complete: the high lanes are in the packet, the low ones next pass, then multicast */
    action complete() {
        SET_FLAGS(FLAG_RESULT)
        FROM_SWITCH RECIRCULATE(BRIDGE_HARVEST_MCAST, ig_intr_md.ingress_port)
        COUNT(STAT_ACCEPTED, JOB_STAT_ACCEPTED)
    }
    /* added; the round waits for others (the packet is dropped) */
    action absorb() {
        COUNT(STAT_ACCEPTED, JOB_STAT_ACCEPTED)
    }
    action join_again() {
        JOIN_REPLY hdr.homagg.gen = md.gen; SET_FLAGS(FLAG_RESULT | FLAG_RETRANS)
        TO_SENDER BACK COUNT(STAT_RETRANS_REPLY, JOB_STAT_RETRANS)
    }
    action join_complete() {
        JOIN_REPLY hdr.homagg.gen = md.gen; SET_FLAGS(FLAG_RESULT)
        FROM_SWITCH
        ig_tm_md.mcast_grp_a = md.mcast_group;
        ig_tm_md.level1_exclusion_id = 0xFFFF;
        hdr.bridge.kind = BRIDGE_RESULT;
        hdr.bridge.job = md.job;
        ig_dprsr_md.drop_ctl = 0;
        COUNT(STAT_COMPLETED, JOB_STAT_COMPLETED)
    }
    action join_pending() {
        JOIN_REPLY SET_FLAGS(FLAG_RESULT | FLAG_STATUS)
        hdr.join.seen_lo = md.rv;   /* who joined (this worker among them) */
        TO_SENDER BACK COUNT(STAT_DUP_PENDING, JOB_STAT_RETRANS)
    }

    /* The verdict and its reply, from the bitmaps (first match wins). A join: its members
     * before it (rv), 0 where its run starts afresh. A contribution: newround (its copy's
     * round starts with it), rv 0 without newround (a packet of an older round), else the
     * round's contributors before it. */
    table reply {
        key = {
            hdr.join.isValid(): ternary @name("join");
            md.newround:        ternary;
            md.rv:              ternary;
            md.dup:             ternary;
            md.left_before:     ternary;
            md.left_after:      ternary;
        }
        actions = { stale; again; pending; complete; absorb; join_again; join_complete;
                    join_pending; }
        const default_action = pending();
        size = 16;
        const entries = {
            (true,  _, _, _, 0, _): join_again();
            (true,  _, _, 0, _, 0): join_complete();
            (true,  _, _, 0, _, _): absorb();
            (true,  _, _, _, _, _): join_pending();
            (false, 1, _, _, _, 0): complete();
            (false, 1, _, _, _, _): absorb();
            (false, 0, 0, _, _, _): stale();
            (false, 0, _, 0, _, 0): complete();
            (false, 0, _, 0, _, _): absorb();
            (false, 0, _, _, 0, _): again();
        }
    }

    /* a registered sender's packet with a wrong identity or slot: why, to it (its drop
     * reason is counted with the drop) */
    action refuse_words() {
        SET_FLAGS(FLAG_RESULT | FLAG_REFUSED)
        TO_SENDER BACK
    }
    action refuse_join() {
        SET_FLAGS(FLAG_RESULT | FLAG_REFUSED)
        JOIN_REPLY hdr.join.last = md.refusal;
        TO_SENDER BACK
    }

    table refusal {
        key = { hdr.join.isValid(): exact @name("join"); }
        actions = { refuse_words; refuse_join; }
        const default_action = refuse_words();
        size = 2;
        const entries = {
            true: refuse_join();
        }
    }

    /* A finished round's second (or third) pass. */
    action harvested_mcast() {
        ig_tm_md.mcast_grp_a = hdr.bridge.mcast_group;
        ig_tm_md.level1_exclusion_id = 0xFFFF;
        hdr.bridge.kind = BRIDGE_RESULT;
        ig_dprsr_md.drop_ctl = 0;
        md.stat = (bit<8>)STAT_COMPLETED;
        md.job_stat = (bit<2>)JOB_STAT_COMPLETED;
        md.count_stat = 1;
        md.count_job = 1;
    }
    action harvested_unicast() {
        ig_tm_md.ucast_egress_port = hdr.bridge.port;
        hdr.bridge.kind = BRIDGE_NONE;
        ig_dprsr_md.drop_ctl = 0;
    }
    action high_read() {   /* the low lanes next */
        RECIRCULATE(BRIDGE_HARVEST_UNICAST, hdr.bridge.port)
    }

    table harvest {
        key = { hdr.bridge.kind: exact; }
        actions = { harvested_mcast; harvested_unicast; high_read; }
        const default_action = harvested_unicast();
        size = 4;
        const entries = {
            BRIDGE_HARVEST_MCAST: harvested_mcast();
            BRIDGE_RETRANS_HI: high_read();
        }
    }

    apply {
        /* (metadata starts at 0: pa_auto_init_metadata, below) */
        md.refusal = (bit<32>)DROP_STALE;
        ig_dprsr_md.drop_ctl = 1;   /* dropped unless something below decides otherwise */

        bool pass2 = hdr.bridge.isValid();
        if (pass2) {
            /* a finished round's second (or third) pass: bridge_h says what to read */
            md.idx = hdr.bridge.idx;
            md.job = hdr.bridge.job;
            md.mcast_group = hdr.bridge.mcast_group;
            if (hdr.bridge.kind == BRIDGE_RETRANS_HI) {
                zero_words();
                md.pass = PASS_RETRANS_HI;
            } else {
                md.pass = PASS_HARVEST;
            }
        } else {
            hdr.bridge.setValid();
            hdr.bridge.kind = BRIDGE_NONE;
            hdr.bridge.job = 0;
            hdr.bridge.mcast_group = 0;
            hdr.bridge.pad = 0;
            hdr.bridge.port = 0;
            hdr.bridge.pad2 = 0;
            hdr.bridge.idx = 0;
            bool homagg_port = hdr.udp.isValid()
                               && (hdr.udp.dst_port & 0xFFF0) == HOMAGG_UDP_PORT_MIN;
            if (hdr.ipv4.isValid()) {
                local_ip.apply();
            }
            if (homagg_port) {   /* (lookups only: nothing happens unless it is to the switch) */
                admission.apply(hdr, md, ig_intr_md.ingress_port, ig_prsr_md.parser_err);
                md.idx = md.slot[SLOT_INDEX_WIDTH - 1:0] ++ hdr.homagg.flags[5:5];
            }
            if (md.to_switch == 1 && homagg_port) {
                if (md.drop_reason != (bit<8>)NO_DROP) {
                    md.stat = md.drop_reason;
                    md.count_stat = 1;
                    md.job_stat = (bit<2>)JOB_STAT_DROPPED;
                    md.count_job = md.job_known;
                    if (md.job_known == 1 && (md.drop_reason == (bit<8>)DROP_WRONG_IDENTITY
                            || md.drop_reason == (bit<8>)DROP_BAD_SLOT)) {
                        md.refusal = (bit<32>)md.drop_reason;
                        md.refuse = 1;
                        if (!hdr.join.isValid()) {
                            md.pass = PASS_REFUSE;
                        }
                    }
                } else if (hdr.join.isValid()) {
                    md.admitted = 1;
                    join_state.apply(md);
                } else {
                    slot_round.apply(hdr.homagg, md);
                    if (md.newround == 1) {
                        md.pass = PASS_FIRST;
                    } else {
                        md.pass = PASS_AGGREGATE;
                    }
                    md.admitted = 1;
                }
            } else {
                md.forwarded = 1;
                forwarding.apply(hdr, md, ig_intr_md.ingress_port, ig_dprsr_md, ig_tm_md);
            }
        }

        FIRST_30(PAIR_APPLY)   /* the words' pairs (pair.p4); 30 and 31 hold a reply's last words */
        p30.apply(hdr.lo.v30, hdr.hi.v30, md, hdr.homagg.op, md.rv, 32w0);
        p31.apply(hdr.lo.v31, hdr.hi.v31, md, hdr.homagg.op, 32w0, md.refusal);

        if (pass2) {
            harvest.apply();
        } else if (md.refuse == 1) {
            refusal.apply();
        } else if (md.admitted == 1) {
            bits.apply();
            reply.apply();
        }

        if (md.forwarded == 1) {
            fwd_stats.count(md.fwd_stat);
        }
        if (md.count_stat == 1) {
            stats.count(md.stat[4:0]);
        }
        if (md.count_job == 1) {
            job_stats.count(md.job[JOB_ID_WIDTH - 1:0] ++ md.job_stat);
        }
    }
}

control HomaggIngressDeparser(packet_out pkt, inout tna_headers_t hdr, in tna_metadata_t md,
                              in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        if (hdr.ipv4.isValid()) {
            hdr.ipv4.hdr_checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
                hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
                hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr });
        }
        pkt.emit(hdr);
    }
}

parser HomaggEgressParser(packet_in pkt, out tna_egress_headers_t hdr,
                          out tna_egress_metadata_t md,
                          out egress_intrinsic_metadata_t eg_intr_md) {
    state start {
        pkt.extract(eg_intr_md);
        pkt.extract(hdr.bridge);
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (5, 0, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition accept;
    }
}

/* Each replica of a multicast result is addressed to its worker (replication id = worker +
 * RID_WORKER_OFFSET); a replica with no entry is dropped. The v1model program's table. */
control HomaggEgress(inout tna_egress_headers_t hdr, inout tna_egress_metadata_t md,
                     in egress_intrinsic_metadata_t eg_intr_md,
                     in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                     inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                     inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {
    action set_result_dst(bit<48> mac, bit<32> ip, bit<16> port) {
        hdr.ethernet.dst_addr = mac;
        hdr.ipv4.dst_addr = ip;
        hdr.udp.dst_port = port;
    }

    action drop_replica() {
        eg_dprsr_md.drop_ctl = 1;
    }

    table result_dst {
        key = {
            hdr.bridge.job: exact @name("job");
            eg_intr_md.egress_rid: exact @name("rid");
        }
        actions = { set_result_dst; drop_replica; }
        default_action = drop_replica();
        size = RESULT_TABLE_SIZE;
    }

    apply {
        if (hdr.bridge.kind == BRIDGE_RESULT) {
            result_dst.apply();
        }
        hdr.bridge.setInvalid();
    }
}

control HomaggEgressDeparser(packet_out pkt, inout tna_egress_headers_t hdr,
                             in tna_egress_metadata_t md,
                             in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {
    Checksum() ipv4_checksum;

    apply {
        if (hdr.ipv4.isValid()) {
            hdr.ipv4.hdr_checksum = ipv4_checksum.update({
                hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
                hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
                hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr });
        }
        pkt.emit(hdr);
    }
}

@pa_auto_init_metadata
Pipeline(HomaggIngressParser(), HomaggIngress(), HomaggIngressDeparser(),
         HomaggEgressParser(), HomaggEgress(), HomaggEgressDeparser()) pipe;

Switch(pipe) main;
