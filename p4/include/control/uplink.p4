/* homagg: trees of switches (leaf/spine). A job whose switch has a parent is a child job: a
 * round complete here is not the final sum but a partial one, and goes up as this switch's
 * contribution to the parent's job (this switch is one of the parent job's workers); the
 * parent's result (the final) comes back down, is kept in the slot copy for retransmissions
 * (slot_state.p4's final bit) and multicast to the workers here. A worker's retransmission
 * of a round complete here gets the final if it came down; else the round's designated
 * worker's (seq & (workers - 1)) sends the partial up again (Verdict.RESEND_UP) and the
 * others get a status: so a loss on any link is recovered by the workers' own timeouts, with
 * one resend up per timeout, and the parent's own duplicate checks keep every partial
 * counted once. The join goes up the
 * same way (join.p4), so every switch of the tree stamps the root's generation.
 *
 * The uplink table says where a child job's partial sums go; admission's parents table
 * (admission.p4) says which results, statuses and refusals come from a child job's parent. */
#ifndef HOMAGG_UPLINK_P4
#define HOMAGG_UPLINK_P4

control UplinkLookup(inout metadata_t meta) {
    /* job: the parent's job id; worker: this switch's worker id in it; auth: the parent
     * job's key; the parent's homagg address (mac, ip, udp_port), the source port this
     * switch sends from (the one its workers send to, where the parent's answers come
     * back), and the switch port to it. */
    action set_uplink(job_id_t job, worker_id_t worker, bit<48> mac, bit<32> ip,
                      bit<16> udp_port, bit<16> src_port, bit<9> port, bit<32> auth) {
        meta.tree = 1;
        meta.up_job = job;
        meta.up_worker = worker;
        meta.up_auth = auth;
        meta.up_mac = mac;
        meta.up_ip = ip;
        meta.up_udp_port = udp_port;
        meta.up_src_port = src_port;
        meta.up_port = port;
    }

    table uplink {
        key = { meta.job: exact @name("job"); }
        actions = { set_uplink; NoAction; }
        default_action = NoAction();
        size = PARENT_TABLE_SIZE;
    }

    apply {
        meta.tree = 0;
        uplink.apply();
    }
}

#endif
