/* homagg: the aggregation pipeline (ingress part): admission, the slot state machine, the
 * words, the reply, and the counters they feed (one place counts, so every drop reason is
 * counted exactly once). */
#ifndef HOMAGG_AGGREGATION_P4
#define HOMAGG_AGGREGATION_P4

#include "admission.p4"
#include "join.p4"
#include "slot_state.p4"
#include "words.p4"
#include "reply.p4"
#include "uplink.p4"

control Aggregation(inout headers_t hdr, inout metadata_t meta,
                    inout standard_metadata_t standard_metadata) {
    counter(STATS_SIZE, CounterType.packets) stats;
    counter(JOB_STATS_SIZE, CounterType.packets_and_bytes) job_stats;

    Admission() admission;
    Join() join;
    SlotState() slot_state;
    Words() words;
    Reply() reply;
    UplinkLookup() uplink;

    action job_count(bit<32> kind) {
        job_stats.count((bit<32>)meta.job * JOB_STATS_PER_JOB + kind);
    }

    apply {
        stats.count(STAT_RX);
        admission.apply(hdr, meta, standard_metadata);
        if (meta.drop_reason != NO_DROP) {
            stats.count(meta.drop_reason);
            if (meta.job_known == 1) {
                job_count(JOB_STAT_DROPPED);
                /* a registered sender (its address and port are the job table's): a config
                 * error the agent should name, not wait out (never the parent: no answer to
                 * an answer) */
                if (meta.from_parent == 0 && (meta.drop_reason == DROP_WRONG_IDENTITY
                        || meta.drop_reason == DROP_BAD_SLOT)) {
                    meta.refuse = 1;
                    reply.apply(hdr, meta, standard_metadata);
                }
            }
            return;
        }
        uplink.apply(meta);
        if (hdr.homagg.op == OP_JOIN) {
            join.apply(hdr, meta);                    /* its words: zeros, or a status */
        } else {
            slot_state.apply(hdr, meta);
            words.apply(hdr, meta);
        }
        reply.apply(hdr, meta, standard_metadata);

        if (meta.from_parent == 1) {
            if (meta.verdict == Verdict.ACCEPT) {
                stats.count(STAT_FROM_PARENT);
                if (meta.complete == 1) {             /* the round (or join) is final here */
                    stats.count(STAT_COMPLETED);
                    job_count(JOB_STAT_COMPLETED);
                    if (meta.overflowed == 1) {
                        stats.count(STAT_OVERFLOW);
                    }
                }
            } else {
                stats.count(DROP_PARENT_DUP);
                job_count(JOB_STAT_DROPPED);
            }
        } else if (meta.verdict == Verdict.ACCEPT) {
            stats.count(STAT_ACCEPTED);
            job_count(JOB_STAT_ACCEPTED);
            if (meta.afresh == 1) {
                stats.count(STAT_JOIN_AFRESH);
            }
            if (meta.complete == 1 && meta.tree == 1) {
                stats.count(STAT_PARTIAL_UP);         /* complete here: the partial went up */
            } else if (meta.complete == 1) {
                stats.count(STAT_COMPLETED);
                job_count(JOB_STAT_COMPLETED);
                if (meta.overflowed == 1) {
                    stats.count(STAT_OVERFLOW);
                }
            }
        } else if (meta.verdict == Verdict.RESEND_UP) {
            stats.count(STAT_PARTIAL_RESENT);
            job_count(JOB_STAT_RETRANS);
        } else if (meta.verdict == Verdict.RETRANS_REPLY) {
            stats.count(STAT_RETRANS_REPLY);
            job_count(JOB_STAT_RETRANS);
        } else if (meta.verdict == Verdict.DUP_PENDING) {
            stats.count(STAT_DUP_PENDING);
            job_count(JOB_STAT_RETRANS);
        } else if (meta.verdict == Verdict.SEQ_MISMATCH) {
            stats.count(DROP_SEQ_MISMATCH);
            job_count(JOB_STAT_DROPPED);
        } else {
            stats.count(DROP_STALE);
            job_count(JOB_STAT_DROPPED);
        }
    }
}

#endif
