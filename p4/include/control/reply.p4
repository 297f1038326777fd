/* homagg: what goes back, by verdict. A completed round is multicast to the job's workers
 * (ResultAddressing addresses each replica in egress); a retransmission of a finished round
 * gets the result by unicast (FLAG_RETRANS); one of an unfinished round gets a status reply
 * naming the contributors so far (FLAG_STATUS), which is how an agent names a dead peer. A
 * registered sender's packet dropped as stale, a round mismatch, a wrong identity or a bad
 * slot is answered with FLAG_REFUSED and the drop reason, so the agent's error can say why
 * (never an unregistered or spoofed sender: no reply to addresses the switch cannot vouch
 * for). */
#ifndef HOMAGG_REPLY_P4
#define HOMAGG_REPLY_P4

#define ZERO_CHUNK(i) hdr.words.w##i = 0;

control Reply(inout headers_t hdr, inout metadata_t meta,
              inout standard_metadata_t standard_metadata) {
    /* Results come from the switch's address and homagg port. */
    action from_switch() {
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.udp.src_port = hdr.udp.dst_port;
        hdr.udp.checksum = 0;
        hdr.ipv4.ttl = 64;
    }

    /* Send this packet back where it came from, from the switch's address. */
    action to_sender() {
        bit<48> mac = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = hdr.ethernet.src_addr;
        hdr.ethernet.src_addr = mac;
        bit<32> ip = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = hdr.ipv4.src_addr;
        hdr.ipv4.src_addr = ip;
        bit<16> port = hdr.udp.dst_port;
        hdr.udp.dst_port = hdr.udp.src_port;
        hdr.udp.src_port = port;
        hdr.udp.checksum = 0;
        hdr.ipv4.ttl = 64;
        standard_metadata.egress_spec = standard_metadata.ingress_port;
    }

    /* A child job's partial (or join) goes up as this switch's contribution to the parent's
     * job (uplink.p4), from the address its workers send to. */
    action to_parent() {
        hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
        hdr.ethernet.dst_addr = meta.up_mac;
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.ipv4.dst_addr = meta.up_ip;
        hdr.udp.src_port = meta.up_src_port;
        hdr.udp.dst_port = meta.up_udp_port;
        hdr.udp.checksum = 0;
        hdr.ipv4.ttl = 64;
        hdr.homagg.job = meta.up_job;
        hdr.homagg.worker = meta.up_worker;
        hdr.homagg.auth = meta.up_auth;
        standard_metadata.egress_spec = meta.up_port;
    }

    apply {
        bool join = hdr.join_words.isValid();
        bit<32> run = 0;
        if (join) {
            hdr.homagg.slot = WORDS_PER_PACKET;  /* how the agent learns K */
            run = hdr.join_words.run;
            hdr.join_words.run = 0;              /* a reply's word 0 (headers.p4) */
        }
        bit<8> phase = hdr.homagg.flags & FLAG_PHASE;
        bit<8> overflow = (meta.overflowed == 1) ? FLAG_OVERFLOW : 8w0;
        if (meta.from_parent == 1) {
            /* the parent's answer to a round (or join) of this switch: a result (final) is
             * multicast to the workers here; a status or refusal is relayed to them, marked
             * as the parent's (its bitmap names the parent's children) */
            if (meta.verdict == Verdict.ACCEPT && meta.held == 0) {
                if (meta.complete == 1) {
                    hdr.homagg.flags = FLAG_RESULT | phase | overflow;
                } else {
                    hdr.homagg.flags = (hdr.homagg.flags & ~FLAG_RETRANS) | FLAG_UPSTREAM;
                }
                hdr.homagg.job = meta.job;
                hdr.homagg.auth = meta.auth;
                from_switch();
                standard_metadata.mcast_grp = meta.mcast_group;
                meta.mcast_result = 1;
            }
        } else if (meta.tree == 1 && ((meta.verdict == Verdict.ACCEPT && meta.complete == 1)
                                      || meta.verdict == Verdict.RESEND_UP)) {
            /* (a join's was set up by Join: its nonce, no flags, the run, zero words) */
            if (join) {
                hdr.homagg.slot = 0;
                hdr.join_words.run = run;
            } else {
                hdr.homagg.flags = phase | overflow;
            }
            to_parent();
        } else if (meta.refuse == 1 || meta.verdict == Verdict.STALE
                   || meta.verdict == Verdict.SEQ_MISMATCH) {
            hdr.homagg.flags = FLAG_RESULT | FLAG_REFUSED | phase;
            bit<32> reason = meta.drop_reason;
            if (meta.verdict == Verdict.STALE) {
                reason = DROP_STALE;
            } else if (meta.verdict == Verdict.SEQ_MISMATCH) {
                reason = DROP_SEQ_MISMATCH;
            }
            if (join) {
                hdr.join_words.w = (bit<480>)reason;
            } else {
                FOR_CHUNKS(ZERO_CHUNK)
                hdr.words.LAST_CHUNK = (chunk_t)reason;   /* word K-1, the low end (below) */
            }
            to_sender();
        } else if (meta.verdict == Verdict.ACCEPT && meta.complete == 1) {
            hdr.homagg.flags = FLAG_RESULT | phase | overflow;
            from_switch();
            standard_metadata.mcast_grp = meta.mcast_group;
            meta.mcast_result = 1;
        } else if (meta.verdict == Verdict.RETRANS_REPLY) {
            hdr.homagg.flags = FLAG_RESULT | FLAG_RETRANS | phase | overflow;
            to_sender();
        } else if (meta.verdict == Verdict.DUP_PENDING) {
            hdr.homagg.flags = FLAG_RESULT | FLAG_STATUS | phase;
            /* words STATUS_WORD..: contributors bitmap (high, low), then their count (the low
             * end of the field: a wide shift up to word 0 is beyond bmv2's limit) */
            if (join) {
                hdr.join_words.w = (bit<480>)(meta.seen ++ (bit<32>)meta.count);
            } else {
                FOR_CHUNKS(ZERO_CHUNK)
                hdr.words.LAST_CHUNK = (chunk_t)(meta.seen ++ (bit<32>)meta.count);
            }
            to_sender();
        }
        /* else: absorbed (an accepted, unfinished contribution) or dropped; the packet stays
         * marked to drop */
    }
}

#endif
