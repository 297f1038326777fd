/* homagg on Tofino: admission, the slot copy's bookkeeping and the join, each register
 * accessed once per pass by one RegisterAction (pair.p4 holds the words).
 *
 * The v1model program keeps a slot copy's bookkeeping packed in one cell that one atomic
 * action reads, decides on and writes (slot_state.p4). Tofino runs each register in its own
 * stateful ALU, at most two conditions and two packet words per RegisterAction, in pipeline
 * order, and a RegisterAction answers either constants or register words, not both. So the
 * bookkeeping is split in two registers, one stage after the other:
 *   slot_owner  {epoch ++ gen, newest tag}: a copy another owner (an earlier job incarnation
 *               or run) wrote is empty to this packet, and a newer tag starts a round;
 *   slot_round  {contributors, round tag}: a new round starts with this worker alone; a packet
 *               of the copy's round adds it and learns who came before; one of an older
 *               round changes nothing and learns nobody (0), and is refused as stale.
 * and the rest follows from the answer (md.rv) without another register: a round is
 * complete when its contributors are every worker of the job (the job's mask), so no count
 * is kept (a status reply's count word is 0: the agents count the bitmap), and no op is kept
 * (a worker that sends another op into a round sends wrong words, as any faulty worker of
 * the job can). */
#ifndef HOMAGG_TNA_AGGREGATION_P4
#define HOMAGG_TNA_AGGREGATION_P4
#ifdef HOMAGG_TESTGEN_STEER
#include <testgen.p4>
#endif

/* Who may send, and is the packet well formed: the v1model program's checks (admission.p4),
 * in its order, each leaving its DROP_* reason in md.drop_reason. The job table's lookup
 * comes first, for every packet on a homagg port (stage 0: it has no effect but metadata),
 * and compares what it can in its action (differences to 0); one priority table then takes
 * the first check that fails, so admission costs two stages, not one per check. No parents
 * (trees) here: a result from a host is forged. */
control Admission(in tna_headers_t hdr, inout tna_metadata_t md, in bit<9> ingress_port,
                  in bit<16> parser_err) {
    action set_worker(bit<16> job, bit<8> worker, bit<8> workers, bit<16> epoch,
                      bit<16> region_base, bit<16> region_size, bit<16> mcast_group,
                      bit<9> port, bit<32> auth) {
        md.job_known = 1;
        md.job = job;
        md.worker = worker;
        md.workers = workers;
        md.epoch = epoch;
        md.mcast_group = mcast_group;
        md.slot = region_base + hdr.homagg.slot;
        md.owner = epoch ++ hdr.homagg.gen;            /* who may write the slot's copies */
        md.room = region_size |-| hdr.homagg.slot;   /* 0: the slot is outside the region */
        md.port_diff = port ^ ingress_port;          /* the port a worker is cabled to */
        md.auth_diff = auth ^ hdr.homagg.auth;       /* the job's key */
        md.job_diff = job ^ hdr.homagg.job;          /* the header's identity */
        md.worker_diff = worker ^ hdr.homagg.worker;
        md.join_run = hdr.join.run ^ (epoch ++ 16w0);   /* (JoinState) */
    }

    table job_workers {
        key = {
            hdr.ipv4.src_addr: exact @name("src_addr");
            hdr.udp.src_port:  exact @name("src_port");
        }
        actions = { set_worker; @defaultonly NoAction; }
        const default_action = NoAction();
        size = JOB_TABLE_SIZE;
    }

    action drop(bit<8> reason) {
        md.drop_reason = reason;
    }

    action admit() {
        md.drop_reason = (bit<8>)NO_DROP;
    }

    /* the first check that fails (first entry that matches): each entry pins the checks
     * before its own to their passing values */
    table checks {
        key = {
            parser_err:           ternary @name("parser_err");
            hdr.hi.isValid():     ternary @name("words");
            hdr.join.isValid():   ternary @name("join");
            hdr.ipv4.total_len:   ternary @name("total_len");
            hdr.udp.length:       ternary @name("udp_len");
            hdr.homagg.version:   ternary @name("version");
            hdr.homagg.op:        ternary @name("op");
            hdr.homagg.flags[7:7]: ternary @name("result");
            md.job_known:         ternary;
            md.port_diff:         ternary;
            md.auth_diff:         ternary;
            md.job_diff:          ternary;
            md.worker_diff:       ternary;
            md.room:              ternary;
        }
        actions = { drop; admit; }
        const default_action = drop((bit<8>)DROP_MALFORMED);
        size = 64;
        const entries = {
            /* a contribution */
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_ADD, 0, 1, 0, 0, 0, 0, 0): drop((bit<8>)DROP_BAD_SLOT);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_ADD, 0, 1, 0, 0, 0, 0, _): admit();
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_ADD, 0, 1, 0, 0, _, _, _): drop((bit<8>)DROP_WRONG_IDENTITY);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_ADD, 0, 1, 0, _, _, _, _): drop((bit<8>)DROP_SPOOFED);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_ADD, 0, 1, _, _, _, _, _): drop((bit<8>)DROP_SPOOFED);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_ADD, 0, _, _, _, _, _, _): drop((bit<8>)DROP_UNKNOWN_SENDER);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_ADD, _, _, _, _, _, _, _): drop((bit<8>)DROP_FORGED_RESULT);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_OR, 0, 1, 0, 0, 0, 0, 0): drop((bit<8>)DROP_BAD_SLOT);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_OR, 0, 1, 0, 0, 0, 0, _): admit();
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_OR, 0, 1, 0, 0, _, _, _): drop((bit<8>)DROP_WRONG_IDENTITY);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_OR, 0, 1, 0, _, _, _, _): drop((bit<8>)DROP_SPOOFED);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_OR, 0, 1, _, _, _, _, _): drop((bit<8>)DROP_SPOOFED);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_OR, 0, _, _, _, _, _, _): drop((bit<8>)DROP_UNKNOWN_SENDER);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, OP_OR, _, _, _, _, _, _, _): drop((bit<8>)DROP_FORGED_RESULT);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, HOMAGG_VERSION, _, _, _, _, _, _, _, _): drop((bit<8>)DROP_BAD_OP);
            (0, true, false, HOMAGG_IPV4_LEN, HOMAGG_UDP_LEN, _, _, _, _, _, _, _, _, _): drop((bit<8>)DROP_BAD_VERSION);
            (0, true, false, _, _, _, _, _, _, _, _, _, _, _): drop((bit<8>)DROP_BAD_LENGTH);
            /* a join (its slot inside the job's region too, as on bmv2) */
            (0, false, true, HOMAGG_JOIN_IPV4_LEN, HOMAGG_JOIN_UDP_LEN, HOMAGG_VERSION, OP_JOIN, 0, 1, 0, 0, 0, 0, 0): drop((bit<8>)DROP_BAD_SLOT);
            (0, false, true, HOMAGG_JOIN_IPV4_LEN, HOMAGG_JOIN_UDP_LEN, HOMAGG_VERSION, OP_JOIN, 0, 1, 0, 0, 0, 0, _): admit();
            (0, false, true, HOMAGG_JOIN_IPV4_LEN, HOMAGG_JOIN_UDP_LEN, HOMAGG_VERSION, OP_JOIN, 0, 1, 0, 0, _, _, _): drop((bit<8>)DROP_WRONG_IDENTITY);
            (0, false, true, HOMAGG_JOIN_IPV4_LEN, HOMAGG_JOIN_UDP_LEN, HOMAGG_VERSION, OP_JOIN, 0, 1, 0, _, _, _, _): drop((bit<8>)DROP_SPOOFED);
            (0, false, true, HOMAGG_JOIN_IPV4_LEN, HOMAGG_JOIN_UDP_LEN, HOMAGG_VERSION, OP_JOIN, 0, 1, _, _, _, _, _): drop((bit<8>)DROP_SPOOFED);
            (0, false, true, HOMAGG_JOIN_IPV4_LEN, HOMAGG_JOIN_UDP_LEN, HOMAGG_VERSION, OP_JOIN, 0, _, _, _, _, _, _): drop((bit<8>)DROP_UNKNOWN_SENDER);
            (0, false, true, HOMAGG_JOIN_IPV4_LEN, HOMAGG_JOIN_UDP_LEN, HOMAGG_VERSION, OP_JOIN, _, _, _, _, _, _, _): drop((bit<8>)DROP_FORGED_RESULT);
            (0, false, true, HOMAGG_JOIN_IPV4_LEN, HOMAGG_JOIN_UDP_LEN, HOMAGG_VERSION, _, _, _, _, _, _, _, _): drop((bit<8>)DROP_BAD_OP);
            (0, false, true, HOMAGG_JOIN_IPV4_LEN, HOMAGG_JOIN_UDP_LEN, _, _, _, _, _, _, _, _, _): drop((bit<8>)DROP_BAD_VERSION);
            (0, false, true, _, _, _, _, _, _, _, _, _, _, _): drop((bit<8>)DROP_BAD_LENGTH);
            /* neither a contribution's shape nor a join's */
            (0, true, false, _, _, _, _, _, _, _, _, _, _, _): drop((bit<8>)DROP_BAD_LENGTH);
            (0, false, true, _, _, _, _, _, _, _, _, _, _, _): drop((bit<8>)DROP_BAD_LENGTH);
        }
    }

    /* this worker's bit, and the job's every-worker mask (at most TNA_MAX_WORKERS: a worker
     * past it has no bit, and the controller installs no such job) */
    action set_me(bit<32> me) {
        md.me = me;
    }

    table worker_bit {
        key = { md.worker: exact; }
        actions = { set_me; }
        const default_action = set_me(0);
        size = 64;
        const entries = {
            0: set_me(0x00000001);
            1: set_me(0x00000002);
            2: set_me(0x00000004);
            3: set_me(0x00000008);
            4: set_me(0x00000010);
            5: set_me(0x00000020);
            6: set_me(0x00000040);
            7: set_me(0x00000080);
            8: set_me(0x00000100);
            9: set_me(0x00000200);
            10: set_me(0x00000400);
            11: set_me(0x00000800);
            12: set_me(0x00001000);
            13: set_me(0x00002000);
            14: set_me(0x00004000);
            15: set_me(0x00008000);
            16: set_me(0x00010000);
            17: set_me(0x00020000);
            18: set_me(0x00040000);
            19: set_me(0x00080000);
            20: set_me(0x00100000);
            21: set_me(0x00200000);
            22: set_me(0x00400000);
            23: set_me(0x00800000);
            24: set_me(0x01000000);
            25: set_me(0x02000000);
            26: set_me(0x04000000);
            27: set_me(0x08000000);
            28: set_me(0x10000000);
            29: set_me(0x20000000);
            30: set_me(0x40000000);
            31: set_me(0x80000000);
        }
    }

    action set_mask(bit<32> mask) {
        md.mask = mask;
    }

    table job_mask {
        key = { md.workers: exact; }
        actions = { set_mask; }
        const default_action = set_mask(0);
        size = 64;
        const entries = {
            1: set_mask(0x00000001);
            2: set_mask(0x00000003);
            3: set_mask(0x00000007);
            4: set_mask(0x0000000f);
            5: set_mask(0x0000001f);
            6: set_mask(0x0000003f);
            7: set_mask(0x0000007f);
            8: set_mask(0x000000ff);
            9: set_mask(0x000001ff);
            10: set_mask(0x000003ff);
            11: set_mask(0x000007ff);
            12: set_mask(0x00000fff);
            13: set_mask(0x00001fff);
            14: set_mask(0x00003fff);
            15: set_mask(0x00007fff);
            16: set_mask(0x0000ffff);
            17: set_mask(0x0001ffff);
            18: set_mask(0x0003ffff);
            19: set_mask(0x0007ffff);
            20: set_mask(0x000fffff);
            21: set_mask(0x001fffff);
            22: set_mask(0x003fffff);
            23: set_mask(0x007fffff);
            24: set_mask(0x00ffffff);
            25: set_mask(0x01ffffff);
            26: set_mask(0x03ffffff);
            27: set_mask(0x07ffffff);
            28: set_mask(0x0fffffff);
            29: set_mask(0x1fffffff);
            30: set_mask(0x3fffffff);
            31: set_mask(0x7fffffff);
            32: set_mask(0xffffffff);
        }
    }


    /* every worker of the job but this one */
    action all_but_me() {
        md.mask_me = md.mask ^ md.me;
    }

    table others {
        actions = { all_but_me; }
        const default_action = all_but_me();
        size = 1;
    }

    apply {
        job_workers.apply();
#ifdef HOMAGG_TESTGEN_STEER
        /* P4Testgen only (homagg-ctl build --testgen): its greedy search takes a branch's
         * first side, and `room = 0` is the saturated subtraction's first, so no test it
         * writes is admitted. These runs steer it past admission, a contribution's or a
         * join's, to control-plane state homagg-ctl writes (controller/tna_testgen.py). */
        testgen_assume(md.room != 0 && md.worker < md.workers
                       && md.workers <= TNA_MAX_WORKERS);
#if HOMAGG_TESTGEN_STEER == 1
        testgen_assume(hdr.hi.isValid() && md.slot < SLOTS
                       && md.slot >= hdr.homagg.slot);   /* (no wrap) */
#else
        testgen_assume(hdr.join.isValid() && md.epoch != 0);   /* (md.join_run's epoch) */
#endif
#endif
        checks.apply();
        if (md.job_known == 1) {
            worker_bit.apply();
            job_mask.apply();
            others.apply();
        }
    }
}

/* A slot copy's owner and newest round tag: the first of its two registers. */
struct owner_t {
    bit<32> owner;  /* epoch ++ gen: the job incarnation and run that wrote the copy */
    bit<32> tag;    /* the newest round tag it has seen */
}

struct round_t {
    bit<32> seen;   /* the round's contributors */
    bit<32> tag;    /* its tag (the packets' seq) */
}

/* The slot copy's bookkeeping, in two registers one stage apart. md.newround: this packet
 * starts a round (the copy was another owner's, or its tag is newer); md.rv: the round's
 * contributors before this packet, for a packet of the copy's current round, or 0 for one
 * of an older round (a packet of the current round always finds its first contributor). */
control SlotRound(in homagg_h h, inout tna_metadata_t md) {
    Register<owner_t, tna_index_t>(SLOT_STATE_SIZE) slot_owner;
    Register<round_t, tna_index_t>(SLOT_STATE_SIZE) slot_round;

    RegisterAction<owner_t, tna_index_t, bit<1>>(slot_owner) claim = {
        void apply(inout owner_t v, out bit<1> newround) {
            if (v.owner != (bit<32>)md.owner) {           /* another owner's: empty to us */
                v.owner = (bit<32>)md.owner;
                v.tag = h.seq;
                newround = 1;
            } else if ((int<32>)(h.seq - v.tag) > 0) {    /* a newer round (serial) */
                v.tag = h.seq;
                newround = 1;
            } else {
                newround = 0;                             /* this round, or an older one */
            }
        }
    };

    /* a new round: this worker alone */
    RegisterAction<round_t, tna_index_t, bit<32>>(slot_round) start = {
        void apply(inout round_t v, out bit<32> rv) {
            v.seen = md.me;
            v.tag = h.seq;
            rv = 0;
        }
    };

    /* the copy's current round adds this worker; an older round's packet changes nothing */
    RegisterAction<round_t, tna_index_t, bit<32>>(slot_round) take = {
        void apply(inout round_t v, out bit<32> rv) {
            if (v.tag == h.seq) {
                rv = v.seen;
                v.seen = v.seen | md.me;
            }
        }
    };

    /* the copy's index (2 * slot + phase), straight from the slot and the header's phase
     * bit: md.idx takes a stage more to assemble, and these two registers cannot wait */
    Hash<tna_index_t>(HashAlgorithm_t.IDENTITY) copy_of;
    Hash<tna_index_t>(HashAlgorithm_t.IDENTITY) copy_of2;

    apply {
        md.newround = claim.execute(copy_of.get({md.slot[SLOT_INDEX_WIDTH - 1:0],
                                                 h.flags[5:5]}));
        if (md.newround == 1) {
            md.rv = start.execute(copy_of2.get({md.slot[SLOT_INDEX_WIDTH - 1:0], h.flags[5:5]}));
        } else {
            md.rv = take.execute(copy_of2.get({md.slot[SLOT_INDEX_WIDTH - 1:0], h.flags[5:5]}));
        }
    }
}

struct members_t {
    bit<32> seen;   /* the workers that joined this run */
    bit<32> run;    /* the run they joined (a join's word 0), with the epoch: md.join_run */
}

struct generation_t {
    bit<32> gen;    /* the last run's generation */
    bit<32> run;    /* that run (md.join_run) */
}

/* The join (join.p4's protocol, on two registers per job): a join of another run than the
 * job's last starts the membership afresh and the next generation; a join of the same run
 * adds its worker (a retransmission adds nothing). md.rv: the members before this join.
 * The registers are the job id's and a cell has no room for the epoch, so the run they keep
 * is md.join_run, the join's run with the job's epoch in its high half: a job added again
 * under its id starts its joins afresh, as on bmv2, where its workers join run 0 again. */
control JoinState(inout tna_metadata_t md) {
    Register<members_t, bit<JOB_ID_WIDTH>>(MAX_JOBS) join_members;
    Register<generation_t, bit<JOB_ID_WIDTH>>(MAX_JOBS) join_generation;

    RegisterAction<members_t, bit<JOB_ID_WIDTH>, bit<32>>(join_members) member = {
        void apply(inout members_t v, out bit<32> rv) {
            if (v.run != md.join_run) {
                rv = 0;
                v.seen = md.me;
                v.run = md.join_run;
            } else {
                rv = v.seen;
                v.seen = v.seen | md.me;
            }
        }
    };

    RegisterAction<generation_t, bit<JOB_ID_WIDTH>, bit<32>>(join_generation) generation = {
        void apply(inout generation_t v, out bit<32> rv) {
            if (v.run != md.join_run) {
                v.gen = v.gen + 1;
                v.run = md.join_run;
            }
            rv = v.gen;
        }
    };

    apply {
        md.rv = member.execute(md.job[JOB_ID_WIDTH - 1:0]);
        md.gen = (bit<8>)generation.execute(md.job[JOB_ID_WIDTH - 1:0]);
    }
}

#endif
