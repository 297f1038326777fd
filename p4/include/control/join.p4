/* homagg: the join, a new run's barrier. Every agent of a job starts a run (a process, a
 * training script) with one OP_JOIN packet whose seq is a random nonce of its own; when every
 * worker of the job has joined, the result is multicast with the run's generation in the gen
 * field, and from then on the agents stamp it on every packet (slot_state.p4: a slot copy
 * written by an older generation is empty to a newer one). So runs that follow each other on
 * one job need no controller reset, and each run's round tags start at 1.
 *
 * Per job (index job id), packed in one join_state_t (types.p4):
 *   seen, count  the workers that joined this generation so far
 *   gen          the generation this join hands out (the last one, once complete)
 *   epoch        the job incarnation that wrote it: a re-installed job starts with no join
 * and per (job, worker) the nonce of the worker's last join, which tells a retransmission of
 * that join (the same nonce: it gets the result again, or a status naming who is missing)
 * from a new run of the worker (a new nonce). A new run's first join after a complete one
 * starts the next generation; a worker that joins again while a join is pending (its
 * process restarted) is counted once.
 *
 * In a tree (uplink.p4) a child job's join, complete here, goes up as this switch's join of
 * the parent's job; the parent's result hands out the root's generation (handed), which is
 * what retransmissions get, and a resend of a worker's join resends it up until it does.
 * The parent can answer while the join here is pending: it completed its join with this
 * switch's previous join (a run here that never got its answer, then new workers). That
 * answer is ours (nothing newer went up), so it is held (handed, the held bit) and handed
 * out when the join here completes, instead of a join up that the parent would count as its
 * next run, leaving the other children with a generation this switch never hands out.
 *
 * A join's membership belongs to one attempt, its run: every worker of one run of the job
 * carries the same run number in its join (word 0: the launcher, the controller service or
 * torchrun's run id and restart count hand it out). A run whose join never completed (a
 * worker never started, or the job died during its join and was restarted) leaves a pending
 * join behind; a join of another run finds it, and starts afresh instead of counting the
 * stale members (who would complete the join with a worker of the new run, and strand the
 * rest of it in the next generation). Why a run number and not an age: workers of one run
 * can join minutes apart (loading a model), while an elastic restart comes within seconds,
 * so no timeout tells the two apart. On Tofino the run is a 32-bit register of its own, read
 * and replaced by one RegisterAction in the stage before the membership's, whose output bit
 * ("another run") selects the membership RegisterAction that starts afresh.
 *
 * Touched only by OP_JOIN packets: once per run per worker, so the data path pays nothing. */
#ifndef HOMAGG_JOIN_P4
#define HOMAGG_JOIN_P4

control Join(inout headers_t hdr, inout metadata_t meta) {
    register<join_state_t>(MAX_JOBS) join_state;
    register<seq_t>(MAX_JOBS * MAX_WORKERS) join_nonce;

    apply {
        worker_bitmap_t me = (worker_bitmap_t)1 << meta.worker;
        bit<32> job = (bit<32>)meta.job;
        bit<32> at = job * MAX_WORKERS + (bit<32>)meta.worker;
        meta.verdict = Verdict.ACCEPT;
        meta.complete = 0;
        meta.first = 0;

        @atomic {
            join_state_t st;
            join_state.read(st, job);
            seq_t last;
            join_nonce.read(last, at);
            bit<32> run = st[JOIN_RUN_HI:JOIN_RUN_LO];
            worker_bitmap_t seen = st[JOIN_SEEN_HI:JOIN_SEEN_LO];
            bit<8> count = st[JOIN_COUNT_HI:JOIN_COUNT_LO];
            gen_t gen = st[JOIN_GEN_HI:JOIN_GEN_LO];
            gen_t handed = st[JOIN_HANDED_HI:JOIN_HANDED_LO];
            bit<1> held = st[JOIN_HELD:JOIN_HELD];
            bit<1> final = st[JOIN_FINAL:JOIN_FINAL];
            bool same_epoch = st[JOIN_EPOCH_HI:JOIN_EPOCH_LO] == meta.epoch;
            if (!same_epoch) {
                seen = 0;                             /* no join yet in this incarnation */
                count = 0;
                held = 0;
            }
            /* a child job's join of its parent's job, for this switch's run gen (uplink.p4):
             * unique per run and job incarnation, so a resend is the same join */
            seq_t nonce = (seq_t)(meta.epoch ++ gen);
            bool up = false;
            if (meta.from_parent == 1) {
                /* the parent's answer: a status or refusal answers our own join (its nonce);
                 * a result is the parent's multicast, which echoes whichever child completed
                 * the join, so any newer generation than the last handed out is ours */
                bool answer = (hdr.homagg.flags & (FLAG_STATUS | FLAG_REFUSED)) != 0;
                bool waiting = same_epoch && count == meta.workers && final == 0;
                bool newer = (int<8>)(hdr.homagg.gen - handed) > 0;
                if (answer) {
                    if (!waiting || hdr.homagg.seq != nonce) {
                        meta.verdict = Verdict.STALE;
                    }
                } else if (waiting && newer) {
                    join_state.write(job, run ++ seen ++ count ++ gen ++ meta.epoch
                                          ++ hdr.homagg.gen ++ 1w0 ++ 1w1);
                    meta.complete = 1;
                } else if (same_epoch && count != 0 && count != meta.workers && held == 0
                           && newer) {
                    /* pending here: held for the local join's completion (above) */
                    join_state.write(job, run ++ seen ++ count ++ gen ++ meta.epoch
                                          ++ hdr.homagg.gen ++ 1w1 ++ 1w0);
                    meta.held = 1;
                } else {
                    meta.verdict = Verdict.STALE;
                }
            } else if (same_epoch && last == hdr.homagg.seq) {
                /* this agent's join again (its reply was lost, or the join is pending) */
                if ((seen & me) == 0) {
                    meta.verdict = Verdict.STALE;     /* a newer run's join replaced it */
                } else if (count == meta.workers && final == 0) {
                    meta.verdict = Verdict.RESEND_UP; /* a child job's, still at the parent */
                    up = true;
                } else if (count == meta.workers) {
                    meta.verdict = Verdict.RETRANS_REPLY;
                } else {
                    meta.verdict = Verdict.DUP_PENDING;
                }
                hdr.homagg.gen = (meta.verdict == Verdict.RETRANS_REPLY) ? handed : gen;
            } else {
                join_nonce.write(at, hdr.homagg.seq);
                bool afresh = count != 0 && count != meta.workers
                              && hdr.join_words.run != run;
                if (count == meta.workers || count == 0 || afresh) {
                    seen = me;                        /* the first of a new run */
                    count = 1;
                    gen = gen + 1;
                    run = hdr.join_words.run;
                    meta.first = 1;
                    if (afresh) {
                        held = 0;                     /* the parent's answer to the other run */
                        meta.afresh = 1;
                    }
                } else if ((seen & me) == 0) {
                    seen = seen | me;
                    count = count + 1;
                }
                bit<1> fin = 0;
                if (count == meta.workers) {
                    meta.complete = 1;
                    if (meta.tree == 0) {
                        fin = 1;                      /* the root hands out its generation */
                        handed = gen;
                    } else if (held == 1) {
                        /* the parent's held answer: hand it out here, as a root would
                         * (Reply multicasts it, Aggregation counts it complete) */
                        fin = 1;
                        held = 0;
                        meta.tree = 0;
                    } else {
                        up = true;                    /* a child job's join goes up */
                    }
                }
                join_state.write(job, run ++ seen ++ count ++ gen ++ meta.epoch ++ handed
                                      ++ held ++ fin);
                nonce = (seq_t)(meta.epoch ++ gen);
                hdr.homagg.gen = (fin == 1) ? handed : gen;
            }
            if (up) {
                hdr.homagg.seq = nonce;
                hdr.homagg.gen = 0;
                hdr.homagg.flags = 0;
                hdr.join_words.run = run;            /* the run goes up (Reply keeps it) */
                hdr.join_words.w = 0;
            }
            meta.seen = seen;
            meta.count = count;
        }
    }
}

#endif
