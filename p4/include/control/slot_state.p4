/* homagg: the slot state machine. Per slot copy (index 2 * (region_base + slot) + phase), all
 * reset by the data plane itself: bmv2's P4Runtime server cannot write registers, so the first
 * packet of a new round overwrites instead of adding.
 *   seen     worker bitmap of this round's contributors
 *   count    how many contributed
 *   tag      the round tag (seq) and op its op: every contribution must match
 *   epoch    the job incarnation that wrote the copy: a re-installed job (new epoch)
 *            treats older state as empty, whatever a previous job left there
 *   gen      the run generation that wrote it (join.p4): a newer run's packet treats it as
 *            empty, so every run's round tags start at 1; an older run's (a worker of a
 *            previous run still retransmitting) is stale
 * packed in one slot_copy_t (types.p4), both copies of a slot in one register cell.
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
    /* Both copies of a slot in one cell (index region_base + slot): a packet's bookkeeping is
     * one register read and one write, the other copy's release included. bmv2 pays per
     * primitive, and five registers per copy cost ten reads and ten writes. */
    register<slot_pair_t>(SLOTS) slot_state;

    apply {
        bit<1> phase = ((hdr.homagg.flags & FLAG_PHASE) != 0) ? 1w1 : 1w0;
        slot_index_t slot = (slot_index_t)(meta.region_base + hdr.homagg.slot);
        meta.idx = (slot << 1) | (slot_index_t)phase;
        worker_bitmap_t me = (worker_bitmap_t)1 << meta.worker;
        meta.verdict = Verdict.ACCEPT;
        meta.complete = 0;

        @atomic {
            slot_pair_t pair;
            slot_state.read(pair, slot);
            slot_copy_t cur;
            slot_copy_t other;
            if (phase == 0) {
                cur = pair[SLOT_COPY_BITS - 1:0];
                other = pair[2 * SLOT_COPY_BITS - 1:SLOT_COPY_BITS];
            } else {
                cur = pair[2 * SLOT_COPY_BITS - 1:SLOT_COPY_BITS];
                other = pair[SLOT_COPY_BITS - 1:0];
            }
            worker_bitmap_t seen = cur[SEEN_HI:SEEN_LO];
            bit<8> count = cur[COUNT_HI:COUNT_LO];
            seq_t tag = cur[TAG_HI:TAG_LO];
            bit<4> op = cur[OP_HI:OP_LO];
            epoch_t epoch = cur[EPOCH_HI:EPOCH_LO];
            gen_t gen = cur[GEN_HI:GEN_LO];
            bit<1> final = cur[FINAL_BIT:FINAL_BIT];

            meta.first = 0;
            if (meta.from_parent == 1) {
                /* the parent answers the round this switch sent up (uplink.p4): it must
                 * still wait for it; a result makes the copy final */
                if (epoch != meta.epoch || gen != hdr.homagg.gen || tag != hdr.homagg.seq
                        || count != meta.workers || final == 1) {
                    meta.verdict = Verdict.STALE;
                } else if ((hdr.homagg.flags & (FLAG_STATUS | FLAG_REFUSED)) == 0) {
                    cur[FINAL_BIT:FINAL_BIT] = 1;
                    if (phase == 0) {
                        slot_state.write(slot, other ++ cur);
                    } else {
                        slot_state.write(slot, cur ++ other);
                    }
                    meta.complete = 1;
                }
            } else if (epoch != meta.epoch) {
                meta.first = 1;                       /* left by another job incarnation */
            } else if (gen != hdr.homagg.gen) {
                if ((int<8>)(hdr.homagg.gen - gen) > 0) {
                    meta.first = 1;                   /* left by an earlier run */
                } else {
                    meta.verdict = Verdict.STALE;     /* from an earlier run */
                }
            } else if ((seen & me) != 0) {
                if (count == meta.workers && tag == hdr.homagg.seq) {
                    if (final == 1 || meta.tree == 0) {
                        meta.verdict = Verdict.RETRANS_REPLY;  /* finished: the result again */
                    } else if (meta.worker == ((worker_id_t)hdr.homagg.seq & (meta.workers - 1))) {
                        /* the parent's answer was lost: the round's designated worker sends
                         * the partial up again. Only one: every worker here times out on the
                         * same round, and N resends up per timeout multiplied the parent's
                         * bytes. seq & (workers - 1) is always a worker of the job, and
                         * rotates over all of them when workers is a power of two. */
                        meta.verdict = Verdict.RESEND_UP;
                    } else {
                        meta.verdict = Verdict.DUP_PENDING;  /* every worker here has sent */
                    }
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

            if (meta.verdict == Verdict.ACCEPT && meta.from_parent == 0) {
                if (meta.first == 1) {
                    seen = me;
                    count = 1;
                } else {
                    seen = seen | me;
                    count = count + 1;
                }
                cur = seen ++ count ++ hdr.homagg.seq ++ hdr.homagg.op ++ meta.epoch ++ hdr.homagg.gen
                      ++ 1w0 ++ 3w0;   /* not final: the round is open */
                /* This worker has the other copy's result: release its claim there. */
                other[SEEN_HI:SEEN_LO] = other[SEEN_HI:SEEN_LO] & ~me;
                if (phase == 0) {
                    slot_state.write(slot, other ++ cur);
                } else {
                    slot_state.write(slot, cur ++ other);
                }
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
