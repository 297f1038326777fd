/* homagg: plain forwarding, so hosts still talk (ping, the controller, ssh) through the switch.
 *
 * The switch answers ARP for every address the controller lists (its own and the hosts'), so
 * hosts send everything to the switch's MAC and it routes IPv4 by prefix, rewriting MACs. */
#ifndef HOMAGG_FORWARDING_P4
#define HOMAGG_FORWARDING_P4

const bit<16> ARP_OPER_REQUEST = 1;
const bit<16> ARP_OPER_REPLY   = 2;

control Forwarding(inout headers_t hdr, inout standard_metadata_t standard_metadata) {
    counter(FWD_STATS_SIZE, CounterType.packets) fwd_stats;

    action arp_reply(bit<48> mac) {
        bit<32> asked = hdr.arp.tpa;
        hdr.arp.oper = ARP_OPER_REPLY;
        hdr.arp.tha = hdr.arp.sha;
        hdr.arp.tpa = hdr.arp.spa;
        hdr.arp.sha = mac;
        hdr.arp.spa = asked;
        hdr.ethernet.dst_addr = hdr.ethernet.src_addr;
        hdr.ethernet.src_addr = mac;
        standard_metadata.egress_spec = standard_metadata.ingress_port;
        fwd_stats.count(FWD_ARP_REPLIES);
    }

    table arp_proxy {
        key = { hdr.arp.tpa: exact @name("tpa"); }
        actions = { arp_reply; NoAction; }
        default_action = NoAction();
        size = ARP_TABLE_SIZE;
    }

    action route(bit<9> port, bit<48> src_mac, bit<48> dst_mac) {
        standard_metadata.egress_spec = port;
        hdr.ethernet.src_addr = src_mac;
        hdr.ethernet.dst_addr = dst_mac;
        hdr.ipv4.ttl = hdr.ipv4.ttl - 1;
        fwd_stats.count(FWD_ROUTED);
    }

    table ipv4_route {
        key = { hdr.ipv4.dst_addr: lpm @name("dst_addr"); }
        actions = { route; NoAction; }
        default_action = NoAction();
        size = ROUTE_TABLE_SIZE;
    }

    action trusted() { }

    /* Software aggregators behind this switch (the controller's fallback): their results,
     * from a homagg port, are routed to their workers; only from their own address on their
     * own port, so a host still cannot forge one. */
    table aggregators {
        key = {
            hdr.ipv4.src_addr: exact @name("src_addr");
            standard_metadata.ingress_port: exact @name("port");
        }
        actions = { trusted; NoAction; }
        default_action = NoAction();
        size = LOCAL_IP_TABLE_SIZE;
    }

    apply {
        bool done = false;
        if (hdr.arp.isValid() && hdr.arp.oper == ARP_OPER_REQUEST) {
            done = arp_proxy.apply().hit;
        } else if (hdr.udp.isValid() &&
                   (hdr.udp.src_port & 0xFFF0) == HOMAGG_UDP_PORT_MIN &&
                   !aggregators.apply().hit) {
            /* Results come only from the switch (or a fallback aggregator): a host must not
             * forge one for another. */
            fwd_stats.count(FWD_SPOOFED);
            done = true;
        } else if (hdr.ipv4.isValid() && hdr.ipv4.ttl > 1) {
            done = ipv4_route.apply().hit;
        }
        if (!done) {
            fwd_stats.count(FWD_NO_ROUTE);
        }
    }
}

#endif
