/* bench/p4/l2fwd.p4: the baseline for bench/switch_cost.py. The least a bmv2 program can do
 * per packet: parse Ethernet, one exact-match table lookup on the ingress port, forward
 * (port 1 <-> port 2, const entries, so no control plane is needed), deparse. Same
 * architecture (v1model) and the same first statement as p4/homagg.p4's ingress. */
#include <core.p4>
#include <v1model.p4>

header ethernet_t {
    bit<48> dst_addr;
    bit<48> src_addr;
    bit<16> ether_type;
}

struct headers_t { ethernet_t ethernet; }
struct metadata_t { }

parser L2Parser(packet_in pkt, out headers_t hdr, inout metadata_t meta,
                inout standard_metadata_t standard_metadata) {
    state start {
        pkt.extract(hdr.ethernet);
        transition accept;
    }
}

control L2VerifyChecksum(inout headers_t hdr, inout metadata_t meta) { apply { } }

control L2Ingress(inout headers_t hdr, inout metadata_t meta,
                  inout standard_metadata_t standard_metadata) {
    action forward(bit<9> port) {
        standard_metadata.egress_spec = port;
    }

    table l2_port {
        key = { standard_metadata.ingress_port: exact; }
        actions = { forward; NoAction; }
        default_action = NoAction();
        const entries = {
            1 : forward(2);
            2 : forward(1);
        }
    }

    apply {
        mark_to_drop(standard_metadata);
        l2_port.apply();
    }
}

control L2Egress(inout headers_t hdr, inout metadata_t meta,
                 inout standard_metadata_t standard_metadata) { apply { } }

control L2ComputeChecksum(inout headers_t hdr, inout metadata_t meta) { apply { } }

control L2Deparser(packet_out pkt, in headers_t hdr) {
    apply { pkt.emit(hdr.ethernet); }
}

V1Switch(L2Parser(), L2VerifyChecksum(), L2Ingress(), L2Egress(), L2ComputeChecksum(),
         L2Deparser()) main;
