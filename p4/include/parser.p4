/* homagg: parser and deparser. */
#ifndef HOMAGG_PARSER_P4
#define HOMAGG_PARSER_P4

#include "headers.p4"

const bit<16> ETHERTYPE_IPV4 = 0x0800;
const bit<16> ETHERTYPE_ARP  = 0x0806;
const bit<8>  IP_PROTO_UDP   = 17;

parser HomaggParser(packet_in packet, out headers_t hdr, inout metadata_t meta,
                    inout standard_metadata_t standard_metadata) {
    state start {
        packet.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            ETHERTYPE_ARP:  parse_arp;
            default: accept;
        }
    }
    state parse_arp {
        packet.extract(hdr.arp);
        transition accept;
    }
    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        /* Options are not parsed: a homagg packet with them is dropped as malformed. */
        transition select(hdr.ipv4.ihl, hdr.ipv4.frag_offset, hdr.ipv4.protocol) {
            (5, 0, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        packet.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            HOMAGG_UDP_PORT_MIN &&& 0xFFF0: parse_homagg;   /* the 16-port range 0xBEE0-0xBEEF */
            default: accept;
        }
    }
    state parse_homagg {
        packet.extract(hdr.homagg);
        transition select(hdr.homagg.op) {
            OP_JOIN: parse_join;       /* JOIN_WORDS words: the agent does not know K yet */
            default: parse_words;
        }
    }

    state parse_join {
        packet.extract(hdr.join_words);
        transition accept;
    }

    state parse_words {
        packet.extract(hdr.words);   /* a short packet fails here: parser_error, counted, dropped */
        transition accept;
    }
}

control HomaggDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.ethernet);
        packet.emit(hdr.arp);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
        packet.emit(hdr.homagg);
        packet.emit(hdr.words);
        packet.emit(hdr.join_words);
    }
}

control HomaggVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control HomaggComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len,
              hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
              hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum, HashAlgorithm.csum16);
    }
}

#endif
