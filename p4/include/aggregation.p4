/* homagg: the aggregation pipeline (ingress part), one job table and a streaming slot pool.
 *
 * Slot state per copy (index 2 * (region_base + slot) + phase), all reset by the data plane
 * itself: bmv2's P4Runtime server cannot write registers, so the first packet of a new round
 * overwrites instead of adding.
 *   slot_seen     worker bitmap of this round's contributors
 *   slot_count    how many contributed
 *   slot_seq      the round tag (seq) and slot_op its op: every contribution must match
 *   slot_epoch    the job incarnation that wrote the copy: a re-installed job (new epoch)
 *                 treats older state as empty, whatever a previous job left there
 *   slot_overflow an int32 add of this round overflowed
 *   slot_words    the 64 words, as one 2048-bit value (lanes.p4)
 * Shadow copy (as SwitchML): a worker's slot alternates between its two copies. When worker w
 * contributes to copy p it clears its bit in copy 1-p: it can only be there because it got copy
 * 1-p's result. A new round of copy p therefore always finds its bitmap empty, while a finished
 * copy keeps its result for workers that have not received it (retransmissions get it back by
 * unicast) until every worker has moved on.
 */
#ifndef HOMAGG_AGGREGATION_P4
#define HOMAGG_AGGREGATION_P4

#include "headers.p4"
#include "lanes.p4"

/* Verdicts of the slot state machine. */
#define V_ACCEPT 0
#define V_RETRANS_REPLY 1
#define V_DUP_PENDING 2
#define V_SEQ_MISMATCH 3
#define V_STALE 4

control Aggregation(inout headers_t hdr, inout metadata_t meta,
                    inout standard_metadata_t standard_metadata) {
    counter(STATS_SIZE, CounterType.packets) stats;
    counter(JOB_STATS_SIZE, CounterType.packets_and_bytes) job_stats;

    register<worker_bitmap_t>(SLOT_STATE_SIZE) slot_seen;
    register<bit<8>>(SLOT_STATE_SIZE) slot_count;
    register<bit<32>>(SLOT_STATE_SIZE) slot_seq;
    register<bit<4>>(SLOT_STATE_SIZE) slot_op;
    register<bit<16>>(SLOT_STATE_SIZE) slot_epoch;
    register<bit<1>>(SLOT_STATE_SIZE) slot_overflow;
    register<words_t>(SLOT_STATE_SIZE) slot_words;

    /* ---- who may send: (source address, source port) -> job and worker ---------------- */
    action set_worker(bit<16> job, bit<8> worker, bit<8> workers, bit<16> epoch,
                      bit<16> region_base, bit<16> region_size, bit<16> mcast_group,
                      bit<9> port) {
        meta.sender_port = port;
        meta.job = job;
        meta.worker = worker;
        meta.workers = workers;
        meta.epoch = epoch;
        meta.region_base = region_base;
        meta.region_size = region_size;
        meta.mcast_group = mcast_group;
    }

    table job_workers {
        key = {
            hdr.ipv4.src_addr: exact;
            hdr.udp.src_port: exact;
        }
        actions = { set_worker; NoAction; }
        default_action = NoAction();
        size = 1024;
    }

    /* ---- the words: one action each, so a slot's read-modify-write is atomic in bmv2 ----
     * A round's first packet overwrites (the data plane resets itself); later ones
     * read-add-write; only the completing packet copies the sum into its header. */
    action first_words() {
        slot_words.write(meta.idx, hdr.words.w);
        meta.overflow = 0;
    }

    action add_words() {
        words_t r;
        slot_words.read(r, meta.idx);
        words_t s = LANE_ADD(r, hdr.words.w);
        meta.overflow = (((r ^ s) & (hdr.words.w ^ s) & LANE_SIGN) == 0) ? 1w0 : 1w1;
        slot_words.write(meta.idx, s);
    }

    action add_words_emit() {
        words_t r;
        slot_words.read(r, meta.idx);
        words_t s = LANE_ADD(r, hdr.words.w);
        meta.overflow = (((r ^ s) & (hdr.words.w ^ s) & LANE_SIGN) == 0) ? 1w0 : 1w1;
        slot_words.write(meta.idx, s);
        hdr.words.w = s;
    }

    action or_words() {
        words_t r;
        slot_words.read(r, meta.idx);
        slot_words.write(meta.idx, r | hdr.words.w);
        meta.overflow = 0;
    }

    action or_words_emit() {
        words_t r;
        slot_words.read(r, meta.idx);
        hdr.words.w = r | hdr.words.w;
        slot_words.write(meta.idx, hdr.words.w);
        meta.overflow = 0;
    }

    action read_words() {
        slot_words.read(hdr.words.w, meta.idx);
    }

    /* Send this packet back where it came from, from the switch's address. */
    action reply_to_sender() {
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

    action job_count(bit<32> kind) {
        job_stats.count((bit<32>)meta.job * JOB_STATS_PER_JOB + kind);
    }

    apply {
        stats.count(STAT_RX);
        if (standard_metadata.parser_error != error.NoError || !hdr.words.isValid()) {
            stats.count(DROP_MALFORMED);
            return;
        }
        if (hdr.ipv4.total_len != HOMAGG_IPV4_LEN || hdr.udp.length != HOMAGG_UDP_LEN) {
            stats.count(DROP_BAD_LENGTH);
            return;
        }
        if (hdr.homagg.version != HOMAGG_VERSION) {
            stats.count(DROP_BAD_VERSION);
            return;
        }
        if (hdr.homagg.op != OP_ADD && hdr.homagg.op != OP_OR) {
            stats.count(DROP_BAD_OP);
            return;
        }
        if ((hdr.homagg.flags & FLAG_RESULT) != 0) {
            stats.count(DROP_FORGED_RESULT);
            return;
        }
        if (!job_workers.apply().hit) {
            stats.count(DROP_UNKNOWN_SENDER);
            return;
        }
        if (standard_metadata.ingress_port != meta.sender_port) {
            /* Source addresses are easy to forge; the port a worker is cabled to is not. */
            stats.count(DROP_SPOOFED);
            job_count(JOB_STAT_DROPPED);
            return;
        }
        if (hdr.homagg.job != meta.job || hdr.homagg.worker != meta.worker) {
            stats.count(DROP_WRONG_IDENTITY);
            job_count(JOB_STAT_DROPPED);
            return;
        }
        if (hdr.homagg.slot >= meta.region_size) {
            stats.count(DROP_BAD_SLOT);
            job_count(JOB_STAT_DROPPED);
            return;
        }

        bit<1> phase = ((hdr.homagg.flags & FLAG_PHASE) != 0) ? 1w1 : 1w0;
        meta.idx = ((bit<32>)(meta.region_base + hdr.homagg.slot) << 1) | (bit<32>)phase;
        worker_bitmap_t me = (worker_bitmap_t)1 << meta.worker;
        bit<8> verdict = V_ACCEPT;
        bit<8> count;
        bit<1> overflowed;
        worker_bitmap_t seen;

        @atomic {
            bit<32> tag;
            bit<4> op;
            bit<16> epoch;
            slot_seen.read(seen, meta.idx);
            slot_count.read(count, meta.idx);
            slot_seq.read(tag, meta.idx);
            slot_op.read(op, meta.idx);
            slot_epoch.read(epoch, meta.idx);
            slot_overflow.read(overflowed, meta.idx);

            meta.first = 0;
            if (epoch != meta.epoch) {
                meta.first = 1;                       /* left by another job incarnation */
            } else if ((seen & me) != 0) {
                if (count == meta.workers && tag == hdr.homagg.seq) {
                    verdict = V_RETRANS_REPLY;        /* finished: send the result again */
                } else if (tag == hdr.homagg.seq) {
                    verdict = V_DUP_PENDING;          /* still waiting for other workers */
                } else {
                    verdict = V_STALE;
                }
            } else if (seen == 0) {
                /* a new round: its tag must be newer than the copy's last (serial arithmetic) */
                if ((int<32>)(hdr.homagg.seq - tag) > 0) {
                    meta.first = 1;
                } else {
                    verdict = V_STALE;
                }
            } else if (count >= meta.workers) {
                verdict = V_STALE;                    /* finished, and this worker moved on */
            } else if ((int<32>)(hdr.homagg.seq - tag) < 0) {
                verdict = V_STALE;                    /* an older round, delayed */
            } else if (tag != hdr.homagg.seq || op != hdr.homagg.op) {
                verdict = V_SEQ_MISMATCH;
            }

            if (verdict == V_ACCEPT) {
                if (meta.first == 1) {
                    seen = me;
                    count = 1;
                    overflowed = 0;
                } else {
                    seen = seen | me;
                    count = count + 1;
                }
                slot_seen.write(meta.idx, seen);
                slot_count.write(meta.idx, count);
                slot_seq.write(meta.idx, hdr.homagg.seq);
                slot_op.write(meta.idx, hdr.homagg.op);
                slot_epoch.write(meta.idx, meta.epoch);
                /* This worker has the other copy's result: release its claim there. */
                worker_bitmap_t other;
                slot_seen.read(other, meta.idx ^ 1);
                slot_seen.write(meta.idx ^ 1, other & ~me);

                if (meta.first == 1) {
                    first_words();               /* the header already holds the words */
                } else if (hdr.homagg.op == OP_ADD) {
                    if (count == meta.workers) {
                        add_words_emit();
                    } else {
                        add_words();
                    }
                } else if (count == meta.workers) {
                    or_words_emit();
                } else {
                    or_words();
                }
                overflowed = overflowed | meta.overflow;
                slot_overflow.write(meta.idx, overflowed);
            } else if (verdict == V_RETRANS_REPLY) {
                read_words();
            }
        }

        if (verdict == V_ACCEPT) {
            stats.count(STAT_ACCEPTED);
            job_count(JOB_STAT_ACCEPTED);
            if (count == meta.workers) {
                /* Complete: the result goes to every worker of the job. */
                stats.count(STAT_COMPLETED);
                job_count(JOB_STAT_COMPLETED);
                hdr.homagg.flags = FLAG_RESULT | (hdr.homagg.flags & FLAG_PHASE);
                if (overflowed == 1) {
                    hdr.homagg.flags = hdr.homagg.flags | FLAG_OVERFLOW;
                    stats.count(STAT_OVERFLOW);
                }
                hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
                hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
                hdr.udp.src_port = hdr.udp.dst_port;
                hdr.udp.checksum = 0;
                hdr.ipv4.ttl = 64;
                standard_metadata.mcast_grp = meta.mcast_group;
                meta.mcast_result = 1;
            }
            /* else: absorbed; the packet stays marked to drop */
        } else if (verdict == V_RETRANS_REPLY) {
            stats.count(STAT_RETRANS_REPLY);
            job_count(JOB_STAT_RETRANS);
            hdr.homagg.flags = FLAG_RESULT | FLAG_RETRANS | (hdr.homagg.flags & FLAG_PHASE);
            if (overflowed == 1) {
                hdr.homagg.flags = hdr.homagg.flags | FLAG_OVERFLOW;
            }
            reply_to_sender();
        } else if (verdict == V_DUP_PENDING) {
            /* Tell the retransmitting worker who has contributed: it names the missing peers
             * in its error instead of guessing. */
            stats.count(STAT_DUP_PENDING);
            job_count(JOB_STAT_RETRANS);
            hdr.homagg.flags = FLAG_RESULT | FLAG_STATUS | (hdr.homagg.flags & FLAG_PHASE);
            /* words 61-62: contributors bitmap (high, low), word 63: their count (the low
             * end of the field: a wide shift up to word 0 is beyond bmv2's limit) */
            hdr.words.w = (words_t)(seen ++ (bit<32>)count);
            reply_to_sender();
        } else if (verdict == V_SEQ_MISMATCH) {
            stats.count(DROP_SEQ_MISMATCH);
            job_count(JOB_STAT_DROPPED);
        } else {
            stats.count(DROP_STALE);
            job_count(JOB_STAT_DROPPED);
        }
    }
}

/* Egress: each replica of a result is addressed to its worker (rid = worker + 1). */
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
            meta.job: exact;
            standard_metadata.egress_rid: exact;
        }
        actions = { set_result_dst; drop_replica; }
        default_action = drop_replica();
        size = 1024;
    }

    apply {
        result_dst.apply();
    }
}

#endif
