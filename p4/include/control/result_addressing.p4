/* homagg: egress. Each replica of a multicast result is addressed to its worker
 * (replication id = worker + RID_WORKER_OFFSET); a replica with no entry is dropped. */
#ifndef HOMAGG_RESULT_ADDRESSING_P4
#define HOMAGG_RESULT_ADDRESSING_P4

control ResultAddressing(inout headers_t hdr, in metadata_t meta,
                         inout standard_metadata_t standard_metadata) {
    action set_result_dst(bit<48> mac, bit<32> ip, bit<16> port) {
        hdr.ethernet.dst_addr = mac;
        hdr.ipv4.dst_addr = ip;
        hdr.udp.dst_port = port;
    }

    action drop_replica() {
        mark_to_drop(standard_metadata);
    }

    table result_dst {
        key = {
            meta.job: exact @name("job");
            standard_metadata.egress_rid: exact @name("rid");
        }
        actions = { set_result_dst; drop_replica; }
        default_action = drop_replica();
        size = RESULT_TABLE_SIZE;
    }

    apply {
        result_dst.apply();
    }
}

#endif
