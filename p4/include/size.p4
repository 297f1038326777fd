/* homagg: every size, in one place, derived from widths where an index type depends on it
 * (after fabric-tna's size.p4), so a register's index and its size cannot drift. */
#ifndef HOMAGG_SIZE_P4
#define HOMAGG_SIZE_P4

/* Slots: the streaming pool shared by all jobs. A job owns a region [base, base + size). Each
 * slot has two copies (phase 0/1, the shadow copy), so slot registers have 2 * SLOTS entries.
 * 1024 slots x 2 x K lanes x 4 B = 2 MiB of register state at K = 256: trivial for bmv2, and
 * enough for 8 jobs with a window of 128 packets each. */
#define SLOT_INDEX_WIDTH 10
#define SLOTS (1 << SLOT_INDEX_WIDTH)
#define SLOT_STATE_SIZE (2 << SLOT_INDEX_WIDTH)                /* two copies per slot */

/* Workers per job: one bit each in the slot's worker bitmap (worker_bitmap_t). */
#define MAX_WORKERS 64

/* Jobs: ids index the per-job counters. */
#define JOB_ID_WIDTH 6
#define MAX_JOBS (1 << JOB_ID_WIDTH)

/* Counter arrays (indices in constants.p4). */
#define STATS_SIZE 32
#define FWD_STATS_SIZE 4
#define JOB_STATS_PER_JOB 4
#define JOB_STATS_SIZE (MAX_JOBS * JOB_STATS_PER_JOB)

/* Tables. One job_workers entry per (job, worker): 1024 covers 16 full-size jobs of 64. Egress
 * has one result_dst entry per worker as well. ARP and routes: one per host and the switch. */
#define LOCAL_IP_TABLE_SIZE 16
#define JOB_TABLE_SIZE 1024
#define RESULT_TABLE_SIZE 1024
#define ARP_TABLE_SIZE 1024
#define ROUTE_TABLE_SIZE 1024
/* Trees: one parent per child job (uplink.p4). */
#define PARENT_TABLE_SIZE MAX_JOBS

#endif
