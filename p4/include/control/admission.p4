/* homagg: admission. Who may send, and is the packet well formed?
 *
 * The job table maps (source address, source port) to the sender's job, worker id, the job's
 * size, epoch, slot region, multicast group, key (auth) and the switch port the worker is
 * cabled to. A packet from another port, or with another key, is spoofed: dropped, counted,
 * never answered (headers.p4 says what the key keeps out). Every
 * check leaves its DROP_* reason in meta.drop_reason (NO_DROP when the packet passes), and
 * meta.job_known says whether the per-job counters apply; Aggregation counts.
 */
#ifndef HOMAGG_ADMISSION_P4
#define HOMAGG_ADMISSION_P4

control Admission(inout headers_t hdr, inout metadata_t meta,
                  in standard_metadata_t standard_metadata) {
    action set_worker(job_id_t job, worker_id_t worker, bit<8> workers, epoch_t epoch,
                      bit<16> region_base, bit<16> region_size, bit<16> mcast_group,
                      bit<9> port, bit<32> auth) {
        meta.sender_port = port;
        meta.auth = auth;
        meta.job = job;
        meta.worker = worker;
        meta.workers = workers;
        meta.epoch = epoch;
        meta.region_base = region_base;
        meta.region_size = region_size;
        meta.mcast_group = mcast_group;
    }

    /* A child job's parent (uplink.p4): its results, statuses and refusals, identified by
     * the parent's address, its job id and its job's key, carry this switch's job for the
     * rest of the pipeline (the same parameters as the job's set_worker entries). */
    action set_parent(job_id_t job, bit<8> workers, epoch_t epoch, bit<16> region_base,
                      bit<16> region_size, bit<16> mcast_group, bit<9> port, bit<32> auth) {
        meta.from_parent = 1;
        meta.sender_port = port;
        meta.auth = auth;
        meta.job = job;
        meta.worker = 0;
        meta.workers = workers;
        meta.epoch = epoch;
        meta.region_base = region_base;
        meta.region_size = region_size;
        meta.mcast_group = mcast_group;
    }

    table parents {
        key = {
            hdr.ipv4.src_addr: exact @name("src_addr");
            hdr.udp.src_port: exact @name("src_port");
            hdr.homagg.job: exact @name("parent_job");
            hdr.homagg.auth: exact @name("parent_auth");
        }
        actions = { set_parent; NoAction; }
        default_action = NoAction();
        size = PARENT_TABLE_SIZE;
    }

    table job_workers {
        key = {
            hdr.ipv4.src_addr: exact @name("src_addr");
            hdr.udp.src_port: exact @name("src_port");
        }
        actions = { set_worker; NoAction; }
        default_action = NoAction();
        size = JOB_TABLE_SIZE;
    }

    apply {
        meta.drop_reason = NO_DROP;
        meta.job_known = 0;
        meta.from_parent = 0;
        meta.held = 0;
        meta.afresh = 0;
        meta.flagged = ((hdr.homagg.flags & FLAG_OVERFLOW) != 0) ? 1w1 : 1w0;
        bool join = hdr.join_words.isValid();
        if (standard_metadata.parser_error != error.NoError
                || (!hdr.words.isValid() && !join)) {
            meta.drop_reason = DROP_MALFORMED;
        } else if (join && (hdr.ipv4.total_len != HOMAGG_JOIN_IPV4_LEN
                            || hdr.udp.length != HOMAGG_JOIN_UDP_LEN)) {
            meta.drop_reason = DROP_BAD_LENGTH;
        } else if (!join && (hdr.ipv4.total_len != HOMAGG_IPV4_LEN
                             || hdr.udp.length != HOMAGG_UDP_LEN)) {
            meta.drop_reason = DROP_BAD_LENGTH;
        } else if (hdr.homagg.version != HOMAGG_VERSION) {
            meta.drop_reason = DROP_BAD_VERSION;
        } else if (hdr.homagg.op != OP_ADD && hdr.homagg.op != OP_OR
                   && hdr.homagg.op != OP_JOIN) {
            meta.drop_reason = DROP_BAD_OP;
        } else if ((hdr.homagg.flags & FLAG_RESULT) != 0) {
            /* only a child job's parent sends results to a switch, with its job's key */
            if (!parents.apply().hit) {
                meta.drop_reason = DROP_FORGED_RESULT;
            } else {
                meta.job_known = 1;
                if (standard_metadata.ingress_port != meta.sender_port) {
                    meta.drop_reason = DROP_SPOOFED;
                } else if (!join && hdr.homagg.slot >= meta.region_size) {
                    meta.drop_reason = DROP_BAD_SLOT;     /* (a join's answer says K there) */
                }
            }
        } else if (!job_workers.apply().hit) {
            meta.drop_reason = DROP_UNKNOWN_SENDER;
        } else {
            meta.job_known = 1;
            if (standard_metadata.ingress_port != meta.sender_port) {
                /* Source addresses are easy to forge; the port a worker is cabled to is not. */
                meta.drop_reason = DROP_SPOOFED;
            } else if (hdr.homagg.auth != meta.auth) {
                /* nor is the job's key, to a sender off the job's path */
                meta.drop_reason = DROP_SPOOFED;
            } else if (hdr.homagg.job != meta.job || hdr.homagg.worker != meta.worker) {
                meta.drop_reason = DROP_WRONG_IDENTITY;
            } else if (hdr.homagg.slot >= meta.region_size) {
                meta.drop_reason = DROP_BAD_SLOT;
            }
        }
    }
}

#endif
