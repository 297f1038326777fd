/* homagg: the slot state machine. Per slot copy (index 2 * (region_base + slot) + phase), all
 * reset by the data plane itself: bmv2's P4Runtime server cannot write registers, so the first
 * packet of a new round overwrites instead of adding.
 *   slot_seen     worker bitmap of this round's contributors
 *   slot_count    how many contributed
 *   slot_seq      the round tag (seq) and slot_op its op: every contribution must match
 *   slot_epoch    the job incarnation that wrote the copy: a re-installed job (new epoch)
 *                 treats older state as empty, whatever a previous job left there
(The words and the round's overflow bit live in words.p4, under the same index.)
 * Shadow copy (as SwitchML): a worker's slot alternates between its two copies. When worker w
 * contributes to copy p it clears its bit in copy 1-p: it can only be there because it got copy
 * 1-p's result. A new round of copy p therefore always finds its bitmap empty, while a finished
 * copy keeps its result for workers that have not received it (retransmissions get it back by
 * unicast) until every worker has moved on.
 */
#ifndef HOMAGG_SLOT_STATE_P4
#define HOMAGG_SLOT_STATE_P4

/* bmv2's simple_switch runs ingress in one thread, so this control's bookkeeping and Words'
 * read-modify-write of the same slot copy are never interleaved with another packet's. */
control SlotState(in headers_t hdr, inout metadata_t meta) {
    register<worker_bitmap_t>(SLOT_STATE_SIZE) slot_seen;
    register<bit<8>>(SLOT_STATE_SIZE) slot_count;
    register<seq_t>(SLOT_STATE_SIZE) slot_seq;
    register<bit<4>>(SLOT_STATE_SIZE) slot_op;
    register<epoch_t>(SLOT_STATE_SIZE) slot_epoch;

    apply {
        bit<1> phase = ((hdr.homagg.flags & FLAG_PHASE) != 0) ? 1w1 : 1w0;
        meta.idx = ((slot_index_t)(meta.region_base + hdr.homagg.slot) << 1) | (slot_index_t)phase;
        worker_bitmap_t me = (worker_bitmap_t)1 << meta.worker;
        meta.verdict = Verdict.ACCEPT;
        meta.complete = 0;

        @atomic {
            worker_bitmap_t seen;
            bit<8> count;
            seq_t tag;
            bit<4> op;
            epoch_t epoch;
            slot_seen.read(seen, meta.idx);
            slot_count.read(count, meta.idx);
            slot_seq.read(tag, meta.idx);
            slot_op.read(op, meta.idx);
            slot_epoch.read(epoch, meta.idx);

            meta.first = 0;
            if (epoch != meta.epoch) {
                meta.first = 1;                       /* left by another job incarnation */
            } else if ((seen & me) != 0) {
                if (count == meta.workers && tag == hdr.homagg.seq) {
                    meta.verdict = Verdict.RETRANS_REPLY;  /* finished: send the result again */
                } else if (tag == hdr.homagg.seq) {
                    meta.verdict = Verdict.DUP_PENDING;    /* still waiting for other workers */
                } else {
                    meta.verdict = Verdict.STALE;
                }
            } else if (seen == 0) {
                /* a new round: its tag must be newer than the copy's last (serial arithmetic) */
                if ((int<32>)(hdr.homagg.seq - tag) > 0) {
                    meta.first = 1;
                } else {
                    meta.verdict = Verdict.STALE;
                }
            } else if (count >= meta.workers) {
                meta.verdict = Verdict.STALE;         /* finished, and this worker moved on */
            } else if ((int<32>)(hdr.homagg.seq - tag) < 0) {
                meta.verdict = Verdict.STALE;         /* an older round, delayed */
            } else if (tag != hdr.homagg.seq || op != hdr.homagg.op) {
                meta.verdict = Verdict.SEQ_MISMATCH;
            }

            if (meta.verdict == Verdict.ACCEPT) {
                if (meta.first == 1) {
                    seen = me;
                    count = 1;
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
                if (count == meta.workers) {
                    meta.complete = 1;
                }
            }
            meta.seen = seen;
            meta.count = count;
        }
    }
}

#endif
