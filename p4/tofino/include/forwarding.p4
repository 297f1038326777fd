/* homagg on Tofino: plain forwarding, the v1model program's (../../include/control/
 * forwarding.p4) with the same tables, keys and actions: proxy ARP for every address the
 * controller lists, IPv4 routes by prefix, and homagg results from a host dropped unless it
 * is a trusted fallback aggregator. */
#ifndef HOMAGG_TNA_FORWARDING_P4
#define HOMAGG_TNA_FORWARDING_P4

const bit<16> ARP_OPER_REQUEST = 1;
const bit<16> ARP_OPER_REPLY   = 2;

control Forwarding(inout tna_headers_t hdr, inout tna_metadata_t md, in bit<9> ingress_port,
                   inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                   inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {
    action arp_reply(bit<48> mac) {
        bit<32> asked = hdr.arp.tpa;
        hdr.arp.oper = ARP_OPER_REPLY;
        hdr.arp.tha = hdr.arp.sha;
        hdr.arp.tpa = hdr.arp.spa;
        hdr.arp.sha = mac;
        hdr.arp.spa = asked;
        hdr.ethernet.dst_addr = hdr.ethernet.src_addr;
        hdr.ethernet.src_addr = mac;
        ig_tm_md.ucast_egress_port = ingress_port;
        ig_dprsr_md.drop_ctl = 0;
        md.fwd_stat = (bit<2>)FWD_ARP_REPLIES;
    }

    action no_route() {
        md.fwd_stat = (bit<2>)FWD_NO_ROUTE;
    }

    table arp_proxy {
        key = { hdr.arp.tpa: exact @name("tpa"); }
        actions = { arp_reply; no_route; }
        default_action = no_route();
        size = ARP_TABLE_SIZE;
    }

    action route(bit<9> port, bit<48> src_mac, bit<48> dst_mac) {
        ig_tm_md.ucast_egress_port = port;
        hdr.ethernet.src_addr = src_mac;
        hdr.ethernet.dst_addr = dst_mac;
        hdr.ipv4.ttl = hdr.ipv4.ttl - 1;
        ig_dprsr_md.drop_ctl = 0;
        md.fwd_stat = (bit<2>)FWD_ROUTED;
    }

    table ipv4_route {
        key = { hdr.ipv4.dst_addr: lpm @name("dst_addr"); }
        actions = { route; no_route; }
        default_action = no_route();
        size = ROUTE_TABLE_SIZE;
    }

    action trusted() {
        md.trusted = 1;
    }

    /* Software aggregators behind this switch (the controller's fallback): their results,
     * from a homagg port, are routed to their workers; only from their own address on their
     * own port, so a host still cannot forge one. */
    table aggregators {
        key = {
            hdr.ipv4.src_addr: exact @name("src_addr");
            ingress_port: exact @name("port");
        }
        actions = { trusted; NoAction; }
        default_action = NoAction();
        size = LOCAL_IP_TABLE_SIZE;
    }

    action spoofed() {
        md.fwd_stat = (bit<2>)FWD_SPOOFED;   /* only the switch sends homagg results */
    }

    /* One outcome per packet, in md.fwd_stat; HomaggIngress counts it last (fwd_stats). */
    apply {
        if (hdr.arp.isValid() && hdr.arp.oper == ARP_OPER_REQUEST) {
            arp_proxy.apply();
        } else {
            aggregators.apply();
            if (hdr.udp.isValid() && (hdr.udp.src_port & 0xFFF0) == HOMAGG_UDP_PORT_MIN
                    && md.trusted == 0) {
                spoofed();
            } else if (hdr.ipv4.isValid() && hdr.ipv4.ttl > 1) {
                ipv4_route.apply();
            } else {
                no_route();
            }
        }
    }
}

#endif
