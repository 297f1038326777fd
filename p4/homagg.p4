/* homagg: in-network aggregation of homomorphically compressed gradients (P4_16, v1model).
 *
 * Ethernet / IPv4 / UDP (ports 0xBEE0-0xBEEF) / homagg header / WORDS_PER_PACKET words.
 * The switch adds int32 words (sketches, dense and residual values) or ORs them (bitmaps) in a
 * pool of slots per job, and multicasts each finished slot to the job's workers. Everything
 * else is routed as plain IPv4 (with proxy ARP), so hosts can still talk.
 *
 * This file only wires the pipeline together. include/: size.p4 (every size), constants.p4
 * (the protocol), types.p4, headers.p4 (the wire diagram), parser.p4, lanes.p4; one control per
 * file under include/control/: forwarding, aggregation (admission, join, slot_state, words,
 * reply, uplink for trees), result_addressing.
 */
#include <core.p4>
#include <v1model.p4>

#include "include/size.p4"
#include "include/constants.p4"
#include "include/types.p4"
#include "include/headers.p4"
#include "include/lanes.p4"
#include "include/parser.p4"
#include "include/control/forwarding.p4"
#include "include/control/aggregation.p4"
#include "include/control/result_addressing.p4"

control HomaggIngress(inout headers_t hdr, inout metadata_t meta,
                      inout standard_metadata_t standard_metadata) {
    Forwarding() forwarding;
    Aggregation() aggregation;

    action to_switch() {
        meta.to_switch = 1;
    }

    /* The switch's own IPv4 addresses: homagg packets to these are aggregated. */
    table local_ip {
        key = { hdr.ipv4.dst_addr: exact @name("dst_addr"); }
        actions = { to_switch; NoAction; }
        default_action = NoAction();
        size = LOCAL_IP_TABLE_SIZE;
    }

    apply {
        /* bmv2's default egress port is 0: drop unless something decides otherwise. */
        mark_to_drop(standard_metadata);
        meta.to_switch = 0;
        meta.mcast_result = 0;
        if (hdr.ipv4.isValid()) {
            local_ip.apply();
        }
        /* Even a truncated homagg header goes to aggregation, to be counted as malformed. */
        if (meta.to_switch == 1 && hdr.udp.isValid() &&
                (hdr.udp.dst_port & 0xFFF0) == HOMAGG_UDP_PORT_MIN) {
            aggregation.apply(hdr, meta, standard_metadata);
        } else {
            forwarding.apply(hdr, standard_metadata);
        }
    }
}

control HomaggEgress(inout headers_t hdr, inout metadata_t meta,
                     inout standard_metadata_t standard_metadata) {
    ResultAddressing() result_addressing;

    apply {
        if (meta.mcast_result == 1) {
            result_addressing.apply(hdr, meta, standard_metadata);
        }
    }
}

V1Switch(HomaggParser(), HomaggVerifyChecksum(), HomaggIngress(), HomaggEgress(),
         HomaggComputeChecksum(), HomaggDeparser()) main;
