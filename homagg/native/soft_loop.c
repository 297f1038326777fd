/* The software aggregator's datagram loop, native: receive runs of datagrams (recvmmsg, UDP
 * GRO), admit and aggregate the common case, a job's worker adding into a slot, and send each
 * completed round's result to the job's workers (sendmmsg, UDP GSO), with no Python and no GIL.
 *
 * The switch model (homagg.switch_model) stays the authority. This loop works on the model's
 * own state: its slot memory, its counters (numpy arrays, by pointer) and a copy of its job
 * and parents tables (hx_set_jobs, hx_set_parents, on every table change). It takes an ACCEPT
 * (the round's result multicast, or a tree's partial sum sent up to the parent) and a parent's
 * final result for a tree's child job; any other packet (a join, a refusal, a retransmission,
 * a status, an unknown sender, a malformed packet) it hands to Python untouched (HX_SLOW): the
 * model decides it, and the loop goes on after it, so packets are decided in the order they
 * came, as the Python engine does. The fast path here mirrors SwitchModel.process line by
 * line: its verdicts, its words (int32 lanes that wrap, overflow per lane), its counters and
 * its replies; tests hold the two to the same results bit for bit.
 *
 * Built by the package's own build (setup.py, setuptools' Extension); loaded with ctypes, which
 * releases the GIL for every call (homagg.native). Plain C11 and Linux's socket API: no Python
 * header, no library beyond libc and libpthread.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "wire.h"

/* the header widths this file reads: a change in the P4 header breaks the build, not the sums */
_Static_assert(HX_BYTES_VERSION_OP == 1 && HX_BYTES_FLAGS == 1 && HX_BYTES_JOB == 2 &&
               HX_BYTES_WORKER == 1 && HX_BYTES_GEN == 1 && HX_BYTES_SLOT == 2 &&
               HX_BYTES_SEQ == 4 && HX_BYTES_AUTH == 4, "homagg header widths changed");
_Static_assert(HX_MAX_WORKERS <= 64, "a slot's bitmap of workers is 64 bits");

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#define HX_UDP_SEGMENT 103 /* linux/udp.h */
#define HX_UDP_GRO 104

#define HX_MAX_PORTS 16
#define HX_BATCH 16          /* runs per recvmmsg */
#define HX_RUN_BYTES 65536   /* a coalesced run (GRO stops at 64 KiB) */
#define HX_DRAIN 16          /* recvmmsg calls on one port before the next port's turn */
#define HX_MAX_SEGMENTS 64   /* the kernel's UDP_MAX_SEGMENTS (Linux before 6.x) */
#define HX_MAX_GSO_BYTES (65507 - 8 - 20)
#define HX_SEND_WAIT_MS 200  /* patience with a full send buffer, as the Python engine's */
#define HX_MAX_OUT 512       /* send messages per flush */

/* hx_serve's answers */
#define HX_IDLE 0     /* nothing came within the timeout, or a batch of work is done */
#define HX_SLOW 1     /* a packet for Python: hx_slow() describes it */
#define HX_CONTROL 2  /* the control descriptor is readable */

typedef struct {
    uint32_t id, auth;
    int64_t base, size, epoch;
    int32_t workers, native; /* native: 0 for a job this loop leaves to Python whole */
    int32_t res_at, res_n;   /* its result addresses: res_ip/res_port[res_at .. res_at+res_n) */
    /* a tree's child job (uplink.p4): its partial sums go to the parent, as worker up_worker
     * of job up_job with key up_auth, from port up_fdi (-1: the one the request came to) */
    int32_t up, up_job, up_worker, up_fdi;
    uint32_t up_auth, up_ip;
    uint16_t up_port;
} hx_job;

typedef struct { /* admission.p4's parents table: whose results reach which job row */
    uint32_t ip, job, auth;
    uint16_t port;
    int32_t row;
} hx_parent;

typedef struct {
    uint64_t key; /* (1 << 48) | ip << 16 | port; 0: empty */
    int32_t job, worker;
} hx_sender;

typedef struct { /* a queued message, while the queue is rebuilt (split_queue) */
    int fd;
    uint8_t *data;
    size_t len;
    uint32_t ip;
    uint16_t port;
} hx_queued;

typedef struct {
    pthread_mutex_t mu; /* the model's state: held while a run is decided, and by Python's lock */
    int epfd, nfd, control_fd;
    int fds[HX_MAX_PORTS];
    /* the model's state (numpy arrays, by pointer) */
    int64_t copies;
    int32_t k, pkt_bytes;
    uint64_t *seen;
    int64_t *count, *tag, *op, *epoch, *gen;
    uint8_t *final, *overflow;
    int32_t *words;
    int64_t *stats, *job_stats;
    /* the job table (a copy) */
    hx_job *jobs;
    int32_t njobs;
    hx_sender *senders;
    uint64_t smask;
    uint32_t *res_ip;
    uint16_t *res_port;
    hx_parent *parents;
    int32_t nparents;
    /* the batch received, and where deciding it stands */
    uint8_t *buf;
    struct mmsghdr msgs[HX_BATCH];
    struct iovec iov[HX_BATCH];
    struct sockaddr_in src[HX_BATCH];
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } cbuf[HX_BATCH];
    int nmsg, cur_msg, cur_off, cur_fdi, drain_left;
    int ready[HX_MAX_PORTS + 1], nready, ready_i;
    /* the packet handed to Python */
    const uint8_t *slow;
    int32_t slow_len, slow_fdi;
    uint32_t slow_ip;
    uint16_t slow_port;
    /* replies built, not yet sent: datagrams in out, each message a run of them to one place */
    uint8_t *out;
    size_t out_len, out_cap;
    struct mmsghdr omsgs[HX_MAX_OUT];
    struct iovec oiov[HX_MAX_OUT];
    struct sockaddr_in odst[HX_MAX_OUT];
    int ofd[HX_MAX_OUT]; /* the socket each message leaves from */
    union { char buf[CMSG_SPACE(sizeof(uint16_t))]; struct cmsghdr align; } ocbuf[HX_MAX_OUT];
    hx_queued split[HX_MAX_OUT];
    int nout, gso;
    /* system calls and datagrams, each way (homagg.udpio.io_counts' names), and the messages
     * (GSO runs) sent */
    int64_t send_calls, sent, recv_calls, received, send_dropped, taken, send_runs;
} hx_ctx;

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
/* A reply's job and key fields (a tree's answers take on the job they go to: uplink.p4) */
static inline void put_identity(uint8_t *r, uint32_t job, uint32_t auth) {
    r[HX_OFF_JOB] = (uint8_t)(job >> 8);
    r[HX_OFF_JOB + 1] = (uint8_t)job;
    for (int b = 0; b < 4; b++) r[HX_OFF_AUTH + b] = (uint8_t)(auth >> (24 - 8 * b));
}

static inline uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* serial arithmetic, homagg.switch_model.state.newer and newer_gen */
static inline int newer(uint32_t seq, uint32_t tag) {
    uint32_t d = seq - tag;
    return d != 0 && d < 0x80000000u;
}
static inline int newer_gen(uint32_t gen, uint32_t than) {
    uint32_t d = (gen - than) & 0xFF;
    return d != 0 && d < 0x80;
}

hx_ctx *hx_new(void) {
    hx_ctx *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&c->mu, &a);
    pthread_mutexattr_destroy(&a);
    c->epfd = epoll_create1(EPOLL_CLOEXEC);
    c->control_fd = -1;
    c->gso = 1;
    c->buf = malloc((size_t)HX_BATCH * HX_RUN_BYTES);
    c->out_cap = 1 << 20;
    c->out = malloc(c->out_cap);
    if (c->epfd < 0 || !c->buf || !c->out) {
        if (c->epfd >= 0) close(c->epfd);
        free(c->buf);
        free(c->out);
        free(c);
        return NULL;
    }
    for (int i = 0; i < HX_BATCH; i++) {
        c->iov[i].iov_base = c->buf + (size_t)i * HX_RUN_BYTES;
        c->iov[i].iov_len = HX_RUN_BYTES;
    }
    return c;
}

void hx_free(hx_ctx *c) {
    if (!c) return;
    close(c->epfd);
    free(c->buf);
    free(c->out);
    free(c->jobs);
    free(c->senders);
    free(c->res_ip);
    free(c->res_port);
    free(c->parents);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

void hx_lock(hx_ctx *c) { pthread_mutex_lock(&c->mu); }
void hx_unlock(hx_ctx *c) { pthread_mutex_unlock(&c->mu); }

/* The sockets to serve (bound, non-blocking) and a control descriptor (-1: none). */
int hx_set_sockets(hx_ctx *c, const int32_t *fds, int32_t n, int32_t control_fd) {
    if (n < 0 || n > HX_MAX_PORTS) return -EINVAL;
    for (int i = 0; i < n; i++) {
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        if (epoll_ctl(c->epfd, EPOLL_CTL_ADD, fds[i], &ev) < 0) return -errno;
        c->fds[i] = fds[i];
    }
    c->nfd = n;
    if (control_fd >= 0) {
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = HX_MAX_PORTS};
        if (epoll_ctl(c->epfd, EPOLL_CTL_ADD, control_fd, &ev) < 0) return -errno;
    }
    c->control_fd = control_fd;
    return 0;
}

/* The model's slot memory and counters (arrays of `copies` cells; words: copies x k). Called
 * with the lock held by the caller (Python holds it while the model is replaced). */
void hx_set_memory(hx_ctx *c, int64_t copies, int32_t k, uint64_t *seen, int64_t *count,
                   int64_t *tag, int64_t *op, int64_t *epoch, int64_t *gen, uint8_t *final,
                   uint8_t *overflow, int32_t *words, int64_t *stats, int64_t *job_stats) {
    c->copies = copies;
    c->k = k;
    c->pkt_bytes = HX_HOMAGG_HDR_BYTES + 4 * k;
    c->seen = seen;
    c->count = count;
    c->tag = tag;
    c->op = op;
    c->epoch = epoch;
    c->gen = gen;
    c->final = final;
    c->overflow = overflow;
    c->words = words;
    c->stats = stats;
    c->job_stats = job_stats;
}

static uint64_t sender_key(uint32_t ip, uint16_t port) {
    return (uint64_t)1 << 48 | (uint64_t)ip << 16 | port;
}

static hx_sender *sender_find(hx_ctx *c, uint64_t key) {
    if (!c->senders) return NULL;
    uint64_t h = (key * 0x9E3779B97F4A7C15ull) >> 17;
    for (uint64_t i = h & c->smask;; i = (i + 1) & c->smask) {
        if (c->senders[i].key == key) return &c->senders[i];
        if (c->senders[i].key == 0) return NULL;
    }
}

/* The job table, whole: jobs[njobs] rows of HX_JOB_COLS (id, auth, base, size, epoch, workers,
 * native, res_at, res_n, up, up_job, up_worker, up_auth, up_ip, up_port, up_fdi); senders[nsend]
 * rows of (ip, port, job row, worker); the result addresses (ip, port). IPs in host order.
 * Copied: the caller's arrays may go. Called with the lock held. */
#define HX_JOB_COLS 16
int32_t hx_job_cols(void) { return HX_JOB_COLS; }

int hx_set_jobs(hx_ctx *c, const int64_t *jobs, int32_t njobs, const int64_t *senders,
                int32_t nsend, const int64_t *res, int32_t nres) {
    hx_job *j = calloc((size_t)(njobs ? njobs : 1), sizeof *j);
    uint64_t cap = 8;
    while (cap < 2 * (uint64_t)nsend) cap <<= 1;
    hx_sender *s = calloc(cap, sizeof *s);
    uint32_t *rip = calloc((size_t)(nres ? nres : 1), sizeof *rip);
    uint16_t *rport = calloc((size_t)(nres ? nres : 1), sizeof *rport);
    if (!j || !s || !rip || !rport) {
        free(j);
        free(s);
        free(rip);
        free(rport);
        return -ENOMEM;
    }
    for (int i = 0; i < njobs; i++) {
        const int64_t *r = jobs + HX_JOB_COLS * i;
        j[i] = (hx_job){.id = (uint32_t)r[0], .auth = (uint32_t)r[1], .base = r[2],
                        .size = r[3], .epoch = r[4], .workers = (int32_t)r[5],
                        .native = (int32_t)r[6], .res_at = (int32_t)r[7], .res_n = (int32_t)r[8],
                        .up = (int32_t)r[9], .up_job = (int32_t)r[10],
                        .up_worker = (int32_t)r[11], .up_auth = (uint32_t)r[12],
                        .up_ip = (uint32_t)r[13], .up_port = (uint16_t)r[14],
                        .up_fdi = (int32_t)r[15]};
    }
    for (int i = 0; i < nres; i++) {
        rip[i] = (uint32_t)res[2 * i];
        rport[i] = (uint16_t)res[2 * i + 1];
    }
    free(c->jobs);
    free(c->senders);
    free(c->res_ip);
    free(c->res_port);
    c->jobs = j;
    c->njobs = njobs;
    c->senders = s;
    c->smask = cap - 1;
    c->res_ip = rip;
    c->res_port = rport;
    for (int i = 0; i < nsend; i++) {
        const int64_t *r = senders + 4 * i;
        uint64_t key = sender_key((uint32_t)r[0], (uint16_t)r[1]);
        uint64_t h = (key * 0x9E3779B97F4A7C15ull) >> 17;
        uint64_t at = h & c->smask;
        while (s[at].key != 0 && s[at].key != key) at = (at + 1) & c->smask;
        s[at] = (hx_sender){key, (int32_t)r[2], (int32_t)r[3]};
    }
    return 0;
}

/* The parents table, whole: rows of (parent ip, port, parent job, parent key, job row). Called
 * with the lock held. */
int hx_set_parents(hx_ctx *c, const int64_t *rows, int32_t n) {
    hx_parent *q = calloc((size_t)(n ? n : 1), sizeof *q);
    if (!q) return -ENOMEM;
    for (int i = 0; i < n; i++) {
        const int64_t *r = rows + 5 * i;
        q[i] = (hx_parent){.ip = (uint32_t)r[0], .port = (uint16_t)r[1], .job = (uint32_t)r[2],
                           .auth = (uint32_t)r[3], .row = (int32_t)r[4]};
    }
    free(c->parents);
    c->parents = q;
    c->nparents = n;
    return 0;
}

/* -- sending ---------------------------------------------------------------------------------- */
static void wait_writable(int fd, int ms) {
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    poll(&p, 1, ms);
}

static int64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Message i's length: len bytes of datagrams (a GSO run, with its segment size, where that
 * is more than one). */
static void set_len(hx_ctx *c, int i, size_t len) {
    size_t size = (size_t)c->pkt_bytes;
    struct msghdr *h = &c->omsgs[i].msg_hdr;
    c->oiov[i].iov_len = len;
    if (len > size && !h->msg_control) {
        h->msg_control = c->ocbuf[i].buf;
        h->msg_controllen = sizeof c->ocbuf[i].buf;
        struct cmsghdr *cm = CMSG_FIRSTHDR(h);
        cm->cmsg_level = SOL_UDP;
        cm->cmsg_type = HX_UDP_SEGMENT;
        cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
        uint16_t seg = (uint16_t)size;
        memcpy(CMSG_DATA(cm), &seg, sizeof seg);
    }
}

/* Queue one message: datagrams of pkt_bytes end to end at `data` (a GSO run where len is
 * more than one), to (ip, port), from socket `fd`. The queue must have room. */
static void queue_msg(hx_ctx *c, int fd, uint8_t *data, size_t len, uint32_t ip, uint16_t port) {
    int i = c->nout++;
    c->ofd[i] = fd;
    c->oiov[i].iov_base = data;
    c->odst[i] = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = htons(port),
                                      .sin_addr.s_addr = htonl(ip)};
    struct msghdr *h = &c->omsgs[i].msg_hdr;
    memset(h, 0, sizeof *h);
    h->msg_name = &c->odst[i];
    h->msg_namelen = sizeof(struct sockaddr_in);
    h->msg_iov = &c->oiov[i];
    h->msg_iovlen = 1;
    set_len(c, i, len);
}

/* The queue's latest message to (ip, port) from `fd`, if it ends where `data` begins and
 * has room for more of a GSO run (`per` bytes in all): its index, else -1. Only the last
 * HX_EXTEND_BACK messages are looked at (a run's results go to each destination in turn, so
 * the last run's message there is among its last few). */
#define HX_EXTEND_BACK 64
static int extendable(hx_ctx *c, int fd, const uint8_t *data, uint32_t ip, uint16_t port,
                      size_t per) {
    uint32_t nip = htonl(ip);
    uint16_t nport = htons(port);
    int stop = c->nout > HX_EXTEND_BACK ? c->nout - HX_EXTEND_BACK : 0;
    for (int i = c->nout - 1; i >= stop; i--) {
        if (c->ofd[i] != fd || c->odst[i].sin_addr.s_addr != nip || c->odst[i].sin_port != nport)
            continue;
        const uint8_t *end = (const uint8_t *)c->oiov[i].iov_base + c->oiov[i].iov_len;
        return end == data && c->oiov[i].iov_len < per ? i : -1;
    }
    return -1;
}

static int64_t datagrams(hx_ctx *c, size_t len) {
    return (int64_t)((len + (size_t)c->pkt_bytes - 1) / (size_t)c->pkt_bytes);
}

/* GSO refused: the queue from `from` on again, one datagram per message (what does not fit
 * is dropped, counted: the workers' timeouts recover it). */
static void split_queue(hx_ctx *c, int from) {
    hx_queued *q = c->split;
    int n = c->nout - from;
    for (int i = 0; i < n; i++)
        q[i] = (hx_queued){c->ofd[from + i], c->oiov[from + i].iov_base,
                               c->oiov[from + i].iov_len,
                               ntohl(c->odst[from + i].sin_addr.s_addr),
                               ntohs(c->odst[from + i].sin_port)};
    c->nout = from;
    for (int i = 0; i < n; i++)
        for (size_t at = 0; at < q[i].len; at += (size_t)c->pkt_bytes) {
            size_t one = q[i].len - at < (size_t)c->pkt_bytes ? q[i].len - at
                                                                : (size_t)c->pkt_bytes;
            if (c->nout == HX_MAX_OUT) {
                c->send_dropped += datagrams(c, one);
                continue;
            }
            queue_msg(c, q[i].fd, q[i].data + at, one, q[i].ip, q[i].port);
        }
}

/* Send what is queued: sendmmsg over each stretch of messages from one socket, each message
 * a GSO run. A full send buffer is waited on for up to HX_SEND_WAIT_MS, then the rest of the
 * queue is dropped (the workers' timeouts recover it), as the Python engine does. */
static void flush(hx_ctx *c) {
    int at = 0;
    int64_t deadline = 0;
    while (at < c->nout) {
        int fd = c->ofd[at], end = at + 1;
        while (end < c->nout && c->ofd[end] == fd) end++;
        int n = sendmmsg(fd, c->omsgs + at, (unsigned)(end - at), MSG_DONTWAIT);
        if (n > 0) {
            for (int i = at; i < at + n; i++) c->sent += datagrams(c, c->oiov[i].iov_len);
            c->send_calls++;
            c->send_runs += n;
            at += n;
            continue;
        }
        int e = errno;
        if (e == EAGAIN || e == EINTR) {
            int64_t t = now_ms();
            if (!deadline) deadline = t + HX_SEND_WAIT_MS;
            if (t >= deadline) break;
            wait_writable(fd, (int)(deadline - t));
            continue;
        }
        if (c->gso && (e == EINVAL || e == EIO || e == ENOPROTOOPT || e == EOPNOTSUPP)) {
            /* the kernel or the route will not segment (no checksum offload on the device):
             * one datagram per message from now on, as udpio.BatchSocket does */
            c->gso = 0;
            split_queue(c, at);
            continue;
        }
        /* a worker gone (ECONNREFUSED...): the others still get theirs */
        at++;
    }
    for (int i = at; i < c->nout; i++) c->send_dropped += datagrams(c, c->oiov[i].iov_len);
    c->nout = 0; /* (out's bytes are free again once the caller says so: out_len) */
}

/* Queue the datagrams out[first .. end) (equal sizes) where a job's rounds go: to each of its
 * result addresses from `fd` (the port the request came to), or with `up`, a tree's child
 * job's partial sums to its parent, from its uplink's port. Where the queue's last message
 * there ends where these begin (the run decided before, in the same batch), they go on in it,
 * up to a GSO run's limit: fewer, longer messages, each a wake-up at the other end. */
static void queue_results(hx_ctx *c, const hx_job *job, int up, size_t first, size_t end,
                          int fd) {
    size_t total = end - first;
    if (!total) return;
    size_t size = (size_t)c->pkt_bytes;
    size_t per = size * (c->gso ? (HX_MAX_GSO_BYTES / size < HX_MAX_SEGMENTS
                                       ? HX_MAX_GSO_BYTES / size : HX_MAX_SEGMENTS)
                                : 1);
    int dests = up ? 1 : job->res_n;
    if (up && job->up_fdi >= 0) fd = c->fds[job->up_fdi];
    for (int r = 0; r < dests; r++) {
        uint32_t ip = up ? job->up_ip : c->res_ip[job->res_at + r];
        uint16_t port = up ? job->up_port : c->res_port[job->res_at + r];
        size_t at = 0;
        /* the run goes on from the last one's datagrams there (consecutive runs of a job's
         * results lie end to end in out): one GSO run of both, where it fits */
        int last = extendable(c, fd, c->out + first, ip, port, per);
        if (last >= 0) {
            size_t room = per - c->oiov[last].iov_len;
            at = total < room ? total : room;
            set_len(c, last, c->oiov[last].iov_len + at);
        }
        for (; at < total; at += per) {
            if (c->nout == HX_MAX_OUT) flush(c);
            queue_msg(c, fd, c->out + first + at, total - at < per ? total - at : per, ip, port);
        }
    }
}

/* -- the words: big-endian on the wire, int32 lanes in slot memory ------------------------------
 * Byte swaps vectorize only from SSSE3 on (pshufb), past x86-64's baseline: on x86-64 these
 * loops are built for the baseline and for AVX2, the one the CPU runs picked when the library
 * loads (GCC's and clang's target_clones). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HX_WORD_LOOP __attribute__((target_clones("default", "avx2")))
#else
#define HX_WORD_LOOP
#endif

static inline int32_t load_be(const uint8_t *p) {
    uint32_t b;
    memcpy(&b, p, 4);
    return (int32_t)__builtin_bswap32(b);
}

HX_WORD_LOOP static void words_load(int32_t *restrict acc, const uint8_t *restrict w, int k) {
    for (int i = 0; i < k; i++) acc[i] = load_be(w + 4 * i);
}

/* acc += w, lanes wrapping; returns the OR over lanes of (acc ^ sum) & (w ^ sum), negative
 * where a lane overflowed (lanes.p4: both operands' signs differ from the sum's) */
HX_WORD_LOOP static int32_t words_add(int32_t *restrict acc, const uint8_t *restrict w, int k) {
    int32_t lanes = 0;
    for (int i = 0; i < k; i++) {
        int32_t v = load_be(w + 4 * i);
        int32_t t = (int32_t)((uint32_t)acc[i] + (uint32_t)v);
        lanes |= (acc[i] ^ t) & (v ^ t);
        acc[i] = t;
    }
    return lanes;
}

HX_WORD_LOOP static void words_or(int32_t *restrict acc, const uint8_t *restrict w, int k) {
    for (int i = 0; i < k; i++) acc[i] |= load_be(w + 4 * i);
}

HX_WORD_LOOP static void words_store(uint8_t *restrict r, const int32_t *restrict acc, int k) {
    for (int i = 0; i < k; i++) {
        uint32_t b = __builtin_bswap32((uint32_t)acc[i]);
        memcpy(r + 4 * i, &b, 4);
    }
}

/* -- deciding ----------------------------------------------------------------------------------
 * A parent switch's final result for a tree's child job here (SwitchModel._from_parent): kept
 * in the slot copy (retransmissions get it) and multicast to the job's workers with this job's
 * id and key. 1 if taken; 0 for anything else (a status or refusal relayed, a duplicate, a
 * forged result, a bad slot: the model's). */
static int from_parent(hx_ctx *c, const uint8_t *p, uint32_t ip, uint16_t port, uint8_t flags,
                       const hx_job **done_job, int *up) {
    if (flags & (HX_FLAG_STATUS | HX_FLAG_REFUSED)) return 0;
    uint32_t pjob = rd16(p + HX_OFF_JOB), pauth = rd32(p + HX_OFF_AUTH);
    const hx_job *job = NULL;
    for (int i = 0; i < c->nparents; i++) {
        const hx_parent *q = &c->parents[i];
        if (q->ip == ip && q->port == port && q->job == pjob && q->auth == pauth) {
            job = &c->jobs[q->row];
            break;
        }
    }
    if (!job || !job->native) return 0;
    uint32_t slot = rd16(p + HX_OFF_SLOT);
    if ((int64_t)slot >= job->size) return 0;
    int64_t idx = 2 * (job->base + (int64_t)slot) + ((flags & HX_FLAG_PHASE) ? 1 : 0);
    if (idx < 0 || idx >= c->copies) return 0;
    /* the round must be the one this switch sent up and still waits for */
    if (!(c->epoch[idx] == job->epoch && c->gen[idx] == (int64_t)p[HX_OFF_GEN] &&
          (uint32_t)c->tag[idx] == rd32(p + HX_OFF_SEQ) && c->count[idx] == job->workers &&
          !c->final[idx]))
        return 0;
    int k = c->k;
    int32_t *acc = c->words + idx * k;
    words_load(acc, p + HX_OFF_WORDS, k);
    c->overflow[idx] = (uint8_t)(c->overflow[idx] || (flags & HX_FLAG_OVERFLOW));
    c->final[idx] = 1;
    c->stats[HX_STAT_RX]++;
    c->stats[HX_STAT_FROM_PARENT]++;
    c->stats[HX_STAT_COMPLETED]++;
    c->job_stats[(int64_t)HX_JOB_STATS_PER_JOB * job->id + HX_JOB_STAT_COMPLETED]++;
    uint8_t rflags = HX_FLAG_RESULT | (flags & HX_FLAG_PHASE);
    if (c->overflow[idx]) {
        rflags |= HX_FLAG_OVERFLOW;
        c->stats[HX_STAT_OVERFLOW]++;
    }
    uint8_t *r = c->out + c->out_len;
    memcpy(r, p, HX_OFF_WORDS);
    r[HX_OFF_FLAGS] = rflags;
    put_identity(r, job->id, job->auth);
    memcpy(r + HX_OFF_WORDS, p + HX_OFF_WORDS, 4 * (size_t)k); /* (the parent's words as sent) */
    c->out_len += (size_t)c->pkt_bytes;
    *done_job = job;
    *up = 0;
    return 1;
}

/* One datagram from (ip, port): 1 if it was taken here (accepted, and its round's result
 * queued if it completed), 0 if it goes to Python, untouched. Mirrors SwitchModel.process. */
static int take(hx_ctx *c, const uint8_t *p, size_t n, uint32_t ip, uint16_t port,
                const hx_job **done_job, int *up) {
    if (n != (size_t)c->pkt_bytes || !c->seen) return 0;
    uint8_t vo = p[HX_OFF_VERSION_OP];
    uint32_t version = (vo >> HX_SHIFT_VERSION) & HX_MASK_VERSION;
    uint32_t op = (vo >> HX_SHIFT_OP) & HX_MASK_OP;
    uint8_t flags = p[HX_OFF_FLAGS];
    if (version != HX_HOMAGG_VERSION || (op != HX_OP_ADD && op != HX_OP_OR)) return 0;
    if (flags & HX_FLAG_RESULT) return from_parent(c, p, ip, port, flags, done_job, up);
    hx_sender *s = sender_find(c, sender_key(ip, port));
    if (!s) return 0;
    const hx_job *job = &c->jobs[s->job];
    if (!job->native || rd32(p + HX_OFF_AUTH) != job->auth || rd16(p + HX_OFF_JOB) != job->id ||
        p[HX_OFF_WORKER] != (uint32_t)s->worker)
        return 0;
    uint32_t slot = rd16(p + HX_OFF_SLOT);
    if ((int64_t)slot >= job->size) return 0;
    int64_t idx = 2 * (job->base + (int64_t)slot) + ((flags & HX_FLAG_PHASE) ? 1 : 0);
    if (idx < 0 || idx >= c->copies) return 0; /* (the tables keep regions in the pool) */
    uint32_t seq = rd32(p + HX_OFF_SEQ), gen = p[HX_OFF_GEN];
    uint64_t me = (uint64_t)1 << s->worker;
    int64_t workers = job->workers;

    /* slot_state.p4 (SwitchModel._slot_state): only an ACCEPT is decided here */
    uint64_t seen = c->seen[idx];
    int64_t count = c->count[idx];
    uint32_t tag = (uint32_t)c->tag[idx];
    if (c->epoch[idx] != job->epoch) {
        seen = 0;
    } else if (c->gen[idx] != (int64_t)gen) {
        if (!newer_gen(gen, (uint32_t)c->gen[idx])) return 0;
        seen = 0;
    } else if (seen & me) {
        return 0;
    } else if (seen == 0) {
        if (!newer(seq, tag)) return 0;
    } else if (count >= workers || newer(tag, seq)) {
        return 0;
    } else if (tag != seq || c->op[idx] != (int64_t)op) {
        return 0;
    }
    int first = seen == 0;
    if (first) {
        seen = me;
        count = 1;
    } else {
        seen |= me;
        count += 1;
    }
    c->seen[idx] = seen;
    c->count[idx] = count;
    c->tag[idx] = seq;
    c->op[idx] = op;
    c->epoch[idx] = job->epoch;
    c->gen[idx] = gen;
    c->seen[idx ^ 1] &= ~me;
    c->final[idx] = 0;

    /* words.p4 (SwitchModel._merge_words) */
    int32_t *acc = c->words + idx * c->k;
    const uint8_t *w = p + HX_OFF_WORDS;
    int over = (flags & HX_FLAG_OVERFLOW) != 0;
    int k = c->k;
    if (first)
        words_load(acc, w, k);
    else if (op == HX_OP_ADD)
        over = (words_add(acc, w, k) < 0) || over; /* (the add first: always) */
    else
        words_or(acc, w, k);
    c->overflow[idx] = (uint8_t)(over || (!first && c->overflow[idx]));

    int64_t *js = c->job_stats + (int64_t)HX_JOB_STATS_PER_JOB * job->id;
    c->stats[HX_STAT_RX]++;
    c->stats[HX_STAT_ACCEPTED]++;
    js[HX_JOB_STAT_ACCEPTED]++;
    if (count == workers && job->up) { /* uplink.p4: the partial sum goes up */
        c->stats[HX_STAT_PARTIAL_UP]++;
        uint8_t *r = c->out + c->out_len;
        memcpy(r, p, HX_OFF_WORDS);
        r[HX_OFF_FLAGS] = (uint8_t)((flags & HX_FLAG_PHASE) |
                                    (c->overflow[idx] ? HX_FLAG_OVERFLOW : 0));
        put_identity(r, (uint32_t)job->up_job, job->up_auth);
        r[HX_OFF_WORKER] = (uint8_t)job->up_worker;
        words_store(r + HX_OFF_WORDS, acc, k);
        c->out_len += (size_t)c->pkt_bytes;
        *done_job = job;
        *up = 1;
    } else if (count == workers) { /* reply.p4: complete, multicast to the job's workers */
        c->final[idx] = 1;
        c->stats[HX_STAT_COMPLETED]++;
        js[HX_JOB_STAT_COMPLETED]++;
        uint8_t rflags = HX_FLAG_RESULT | (flags & HX_FLAG_PHASE);
        if (c->overflow[idx]) {
            rflags |= HX_FLAG_OVERFLOW;
            c->stats[HX_STAT_OVERFLOW]++;
        }
        uint8_t *r = c->out + c->out_len;
        memcpy(r, p, HX_OFF_WORDS);
        r[HX_OFF_FLAGS] = rflags;
        words_store(r + HX_OFF_WORDS, acc, k);
        c->out_len += (size_t)c->pkt_bytes;
        *done_job = job;
        *up = 0;
    }
    return 1;
}

/* The segment size of a received run (UDP GRO's control message), else its length. */
static size_t gro_size(struct msghdr *h, size_t nb) {
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(h); cm; cm = CMSG_NXTHDR(h, cm)) {
        if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == HX_UDP_GRO) {
            int v;
            memcpy(&v, CMSG_DATA(cm), sizeof v);
            if (v > 0) return (size_t)v;
        }
    }
    return nb;
}

/* Decide the batch from where it stands; 1 when stopped at a packet for Python. A run is
 * decided under the lock, and its results are queued (addresses copied) before the lock goes:
 * a table write between two runs cannot pull a job from under a queued result. */
static int decide(hx_ctx *c) {
    int fd = c->fds[c->cur_fdi];
    for (; c->cur_msg < c->nmsg; c->cur_msg++, c->cur_off = 0) {
        struct mmsghdr *m = &c->msgs[c->cur_msg];
        size_t nb = m->msg_len;
        size_t seg = gro_size(&m->msg_hdr, nb);
        const uint8_t *base = c->iov[c->cur_msg].iov_base;
        uint32_t ip = ntohl(c->src[c->cur_msg].sin_addr.s_addr);
        uint16_t port = ntohs(c->src[c->cur_msg].sin_port);
        /* an empty datagram is one packet too (Python counts it DROP_MALFORMED) */
        size_t step = seg ? seg : 1;
        size_t end = nb ? nb : 1;
        if (c->out_len + HX_RUN_BYTES > c->out_cap) { /* (a run's results fit) */
            flush(c);
            c->out_len = 0;
        }
        /* the run's replies so far, all of one job and one way (a run is one sender's:
         * a worker's, or a parent's answers) */
        const hx_job *job = NULL;
        int up = 0;
        size_t first = c->out_len;
        pthread_mutex_lock(&c->mu);
        while ((size_t)c->cur_off < end) {
            size_t at = (size_t)c->cur_off;
            size_t len = nb ? (seg < nb - at ? seg : nb - at) : 0;
            const hx_job *done = NULL;
            int done_up = 0;
            size_t before = c->out_len;
            if (!take(c, base + at, len, ip, port, &done, &done_up)) {
                if (job) queue_results(c, job, up, first, c->out_len, fd);
                pthread_mutex_unlock(&c->mu);
                flush(c);
                c->out_len = 0;
                c->slow = base + at;
                c->slow_len = (int32_t)len;
                c->slow_ip = ip;
                c->slow_port = port;
                c->slow_fdi = c->cur_fdi;
                c->cur_off = (int)(at + step);
                return 1;
            }
            c->taken++;
            if (done && job && (done != job || done_up != up)) { /* (another job's reply) */
                queue_results(c, job, up, first, before, fd);
                first = before;
            }
            if (done) {
                job = done;
                up = done_up;
            }
            c->cur_off = (int)(at + step);
        }
        if (job) queue_results(c, job, up, first, c->out_len, fd);
        pthread_mutex_unlock(&c->mu);
    }
    flush(c);
    c->out_len = 0;
    c->nmsg = 0;
    return 0;
}

static int receive(hx_ctx *c, int fdi) {
    for (int i = 0; i < HX_BATCH; i++) {
        struct msghdr *h = &c->msgs[i].msg_hdr;
        memset(h, 0, sizeof *h);
        h->msg_name = &c->src[i];
        h->msg_namelen = sizeof c->src[i];
        h->msg_iov = &c->iov[i];
        h->msg_iovlen = 1;
        h->msg_control = c->cbuf[i].buf;
        h->msg_controllen = sizeof c->cbuf[i].buf;
    }
    int n = recvmmsg(c->fds[fdi], c->msgs, HX_BATCH, MSG_DONTWAIT, NULL);
    if (n <= 0) return 0;
    c->recv_calls++;
    for (int i = 0; i < n; i++) {
        size_t nb = c->msgs[i].msg_len, seg = gro_size(&c->msgs[i].msg_hdr, nb);
        c->received += seg ? (int64_t)((nb + seg - 1) / seg) : 1;
    }
    c->nmsg = n;
    c->cur_msg = 0;
    c->cur_off = 0;
    c->cur_fdi = fdi;
    return n;
}

/* Serve for one wait of up to timeout_ms: decide every run that came, port by port (a bounded
 * number of receives each, so that no port starves the others). HX_SLOW: a packet for Python
 * (hx_slow), after which the next call goes on where this one stopped; HX_CONTROL: the control
 * descriptor is readable; HX_IDLE: done, or nothing came; < 0: -errno of a failed wait. */
int hx_serve(hx_ctx *c, int32_t timeout_ms) {
    int waited = 0;
    for (;;) {
        if (c->nmsg) {
            if (decide(c)) return HX_SLOW;
            if (c->drain_left-- > 0 && receive(c, c->cur_fdi) > 0) continue;
            c->ready_i++;
        }
        while (c->ready_i < c->nready) {
            int fdi = c->ready[c->ready_i];
            if (fdi == HX_MAX_PORTS) {
                c->ready_i++;
                return HX_CONTROL;
            }
            c->drain_left = HX_DRAIN - 1;
            if (receive(c, fdi) > 0) break;
            c->ready_i++;
        }
        if (c->nmsg) continue;
        if (waited) return HX_IDLE;
        struct epoll_event ev[HX_MAX_PORTS + 1];
        int n = epoll_wait(c->epfd, ev, HX_MAX_PORTS + 1, timeout_ms);
        if (n < 0) return errno == EINTR ? HX_IDLE : -errno;
        waited = 1;
        c->nready = n;
        c->ready_i = 0;
        for (int i = 0; i < n; i++) c->ready[i] = (int)ev[i].data.u32;
        if (n == 0) return HX_IDLE;
    }
}

/* The packet hx_serve handed to Python: its bytes are valid until the next hx_serve. */
int32_t hx_slow(hx_ctx *c, const uint8_t **data, uint32_t *ip, uint16_t *port) {
    *data = c->slow;
    *ip = c->slow_ip;
    *port = c->slow_port;
    return c->slow_len;
}

int32_t hx_slow_port(hx_ctx *c) { return c->slow_fdi; }

/* send_calls, sent, recv_calls, received, datagrams dropped on a full send buffer, packets
 * decided here (not handed to Python), and messages sent (GSO runs) */
void hx_io_counts(hx_ctx *c, int64_t *out) {
    out[6] = c->send_runs;
    out[5] = c->taken;
    out[0] = c->send_calls;
    out[1] = c->sent;
    out[2] = c->recv_calls;
    out[3] = c->received;
    out[4] = c->send_dropped;
}

int32_t hx_gso(hx_ctx *c) { return c->gso; }
