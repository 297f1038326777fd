/* The agent's round loop, native: one call streams a round's chunks through the job's slots
 * and matches their results, with no Python and no GIL, until the round is done or something
 * needs Python.
 *
 * It is the Python engine's Round (homagg/host_agent/engine/round.py and loss.py) on its
 * common path, line for line: new chunks sent as the slots free up, a run per system call
 * (sendmmsg of UDP GSO runs); results received in batches (recvmmsg, UDP GRO), matched to
 * their chunks and written in place (results.py's pass); the timeout's estimate (rto.py),
 * RACK's state and the wake-up time of every timer (loss.py's wake_at and probe_at). It works
 * on the round's own numpy arrays (by pointer) and on the scalars of ha_round, which Python
 * copies in and out around each call.
 *
 * What it does not decide it hands back, so the protocol's rules are written once, in Python:
 * - HA_ODD: a datagram from the switch that is not a plain result of this round (a status, a
 *   refusal, another size, another run or job): Python's Round.take decides it; the next call
 *   goes on with the batch where this one stopped;
 * - HA_DUE: a timer is due (a timeout, RACK's deadline, a tail-loss probe, or the 50 ms tick
 *   that lets Python check the deadline and the controller): Python's retransmit and deadline
 *   run, then call again;
 * - HA_ERROR: a send failed (err: its errno); HA_WAIT_ERROR: the wait for results did.
 * The join, the congestion control's window and pacing, a fixed rate, and sockets with faults
 * injected stay in Python (homagg.host_agent.engine.native says which engine a round runs).
 *
 * Built beside soft_loop.c (setup.py), loaded with ctypes, which releases the GIL.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "wire.h"

_Static_assert(HX_BYTES_FLAGS == 1 && HX_BYTES_SLOT == 2 && HX_BYTES_SEQ == 4 && HX_BYTES_AUTH == 4 && HX_OFF_SEQ == 8 && HX_OFF_AUTH == 12 && HX_OFF_WORDS == 16,
               "the agent reads the round tag and the key as the header's 3rd and 4th words");

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#define HA_UDP_SEGMENT 103 /* linux/udp.h */
#define HA_UDP_GRO 104
#define HA_BATCH 16          /* receives per recvmmsg: 1 MiB of runs */
#define HA_RUN_BYTES 65536   /* a coalesced run (GRO stops at 64 KiB) */
#define HA_MAX_SEGMENTS 64   /* the kernel's UDP_MAX_SEGMENTS (Linux before 6.x) */
#define HA_MAX_GSO_BYTES (65507 - 8 - 20)
#define HA_MAX_MSGS 64       /* messages per sendmmsg */
#define HA_TICK 0.05         /* Python's loop runs at least this often (the deadline's check) */

/* ha_round's answers */
#define HA_DONE 0
#define HA_DUE 1
#define HA_ODD 2
#define HA_ERROR 3
#define HA_WAIT_ERROR 4

/* A round's state: mirrored field for field by homagg/host_agent/engine/native.py (_Round),
 * every field 8 bytes. */
typedef struct {
    /* the round, fixed */
    int64_t fd, switch_ip, switch_port;
    int64_t psize, k, nchunks, slots, seq0, auth;
    /* a plain result's first 8 header bytes under mask: expect for chunks before split,
     * expect2 from it on (a fused round: its second part has an op of its own) */
    uint64_t mask, expect, ovf_mask, expect2;
    int64_t split;
    uint8_t *buf;      /* nchunks packets of psize bytes, end to end */
    int32_t *out;      /* nchunks * k words: the results, native order */
    uint8_t *done, *resent, *held;
    double *sent_at, *rto;
    uint8_t *rbuf;     /* HA_BATCH * HA_RUN_BYTES: where batches are received */
    /* the timeout's estimate (rto.RtoEstimator) */
    int64_t has_srtt, samples;
    double srtt, rttvar, cur_rto, min_rto, max_rto;
    double min_cur, min_prev;  /* the least round trip of this epoch and the last (min_rtt) */
    /* loss recovery (loss.LossRecovery) */
    double rack_ts, rack_rtt, last_progress, last_new;
    int64_t rack_c, nprobes, probe_c, lossy, probes, probe_samples;
    int64_t held_probes, held_max, min_n, min_epoch;
    /* progress */
    int64_t next_c, ndone, overflow;
    /* counters: added to (Python adds them to its own and zeroes them) */
    int64_t packets_sent, bytes_sent, results, ignored, tail_copies;
    int64_t send_calls, sent, recv_calls, received;
    /* UDP GSO in use (in and out: a refusal turns it off for the socket's life) */
    int64_t gso;
    /* out: the datagram for Python (HA_ODD), at rbuf + odd_at; errno (HA_ERROR) */
    int64_t odd_at, odd_len, err;
} ha_round;

typedef struct {
    struct mmsghdr msgs[HA_BATCH];
    struct iovec iov[HA_BATCH];
    struct sockaddr_in src[HA_BATCH];
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } cbuf[HA_BATCH];
    int nmsg, cur_msg;
    int64_t cur_off;
    /* the batch's round trips, for one sample per batch (results.take's fresh_sum, fresh) */
    double fresh_sum;
    int64_t fresh;
    /* sending */
    struct mmsghdr omsgs[HA_MAX_MSGS];
    struct iovec oiov[HA_MAX_MSGS];
    union { char buf[CMSG_SPACE(sizeof(uint16_t))]; struct cmsghdr align; } ocbuf[HA_MAX_MSGS];
} ha_ctx;

/* The word loops, built for x86-64's baseline and for AVX2 (byte swaps vectorize only from
 * SSSE3 on), the best picked at load (GCC's and clang's target_clones), as in soft_loop.c. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HA_WORD_LOOP __attribute__((target_clones("default", "avx2")))
#else
#define HA_WORD_LOOP
#endif

/* n words between the wire's order (big-endian) and the host's, either way */
HA_WORD_LOOP static void swap_words(uint8_t *restrict dst, const uint8_t *restrict src,
                                    int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        uint32_t v;
        memcpy(&v, src + 4 * j, 4);
        v = ntohl(v);
        memcpy(dst + 4 * j, &v, 4);
    }
}

int64_t ha_round_bytes(void) { return (int64_t)sizeof(ha_round); }

/* A round's packets, as round.Round builds them with numpy (its reference): chunk c is global
 * chunk g0 + c, in slot g % slots, copy (g / slots) % 2 (FLAG_PHASE), round tag g + 1; the
 * header is ``head`` (HX_OFF_WORDS bytes, its slot and tag zero; its flags FLAG_OVERFLOW where a
 * partial sum overflowed, else zero) with those three set;
 * then chunk c's k words of ``words`` (n in all) in the wire's order, the last chunk's tail
 * zero. */
void ha_pack(uint8_t *buf, const int32_t *words, int64_t n, int64_t k, int64_t nchunks,
             int64_t g0, int64_t slots, const uint8_t *head) {
    size_t ps = (size_t)(HX_OFF_WORDS + 4 * k);
    for (int64_t c = 0; c < nchunks; c++) {
        uint8_t *p = buf + (size_t)c * ps;
        int64_t g = g0 + c, slot = g % slots;
        uint32_t seq = htonl((uint32_t)((g + 1) & 0xFFFFFFFF));
        memcpy(p, head, HX_OFF_WORDS);
        p[HX_OFF_FLAGS] = (uint8_t)(head[HX_OFF_FLAGS] | ((g / slots) % 2 ? HX_FLAG_PHASE : 0));
        p[HX_OFF_SLOT] = (uint8_t)(slot >> 8);
        p[HX_OFF_SLOT + 1] = (uint8_t)slot;
        memcpy(p + HX_OFF_SEQ, &seq, 4);
        int64_t at = c * k, m = n - at < k ? n - at : k;
        if (m < 0) m = 0;
        swap_words(p + HX_OFF_WORDS, (const uint8_t *)(words + at), m);
        if (m < k) memset(p + HX_OFF_WORDS + 4 * m, 0, (size_t)(k - m) * 4);
    }
}

ha_ctx *ha_new(void) { return calloc(1, sizeof(ha_ctx)); }

void ha_free(ha_ctx *x) { free(x); }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline uint32_t ld32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static size_t gro_size(struct msghdr *h, size_t nb) {
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(h); cm; cm = CMSG_NXTHDR(h, cm)) {
        if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == HA_UDP_GRO) {
            int v;
            memcpy(&v, CMSG_DATA(cm), sizeof v);
            if (v > 0) return (size_t)v;
        }
    }
    return nb;
}

/* A new round: what the previous one left received and not decided is dropped, counted as
 * ignored (late copies of its results: the round had every result it needed). */
void ha_reset(ha_ctx *x, ha_round *r) {
    for (; x->cur_msg < x->nmsg; x->cur_msg++, x->cur_off = 0) {
        size_t nb = x->msgs[x->cur_msg].msg_len;
        size_t seg = gro_size(&x->msgs[x->cur_msg].msg_hdr, nb);
        if (!seg) seg = 1;
        size_t left = nb > (size_t)x->cur_off ? nb - (size_t)x->cur_off : 0;
        r->ignored += (int64_t)((left + seg - 1) / seg);
    }
    x->nmsg = x->cur_msg = 0;
    x->cur_off = 0;
    x->fresh_sum = 0.0;
    x->fresh = 0;
}

/* -- the timeout's estimate and RACK (rto.py, loss.py) ----------------------------------- */

static void rtt_sample(ha_round *r, double rtt) {
    r->samples++;
    if (rtt < r->min_cur) r->min_cur = rtt;
    if (++r->min_n >= r->min_epoch) {
        r->min_prev = r->min_cur;
        r->min_cur = INFINITY;
        r->min_n = 0;
    }
    if (!r->has_srtt) {
        r->srtt = rtt;
        r->rttvar = rtt / 2;
        r->has_srtt = 1;
    } else {
        r->rttvar = 0.75 * r->rttvar + 0.25 * fabs(r->srtt - rtt);
        r->srtt = 0.875 * r->srtt + 0.125 * rtt;
    }
    double v = r->srtt + 4 * r->rttvar;
    if (v < r->min_rto) v = r->min_rto;
    if (v > r->max_rto) v = r->max_rto;
    r->cur_rto = v;
}

static void delivered(ha_round *r, int64_t c, double now) {
    double sent = r->sent_at[c];
    if (sent > r->rack_ts || (sent == r->rack_ts && c > r->rack_c)) {
        r->rack_ts = sent;
        r->rack_c = c;
        r->rack_rtt = now - sent;
    }
}

/* loss.LossRecovery.pto: the probe timeout, or -1 while there is none */
static double pto(const ha_round *r) {
    if (!r->has_srtt || r->samples < r->probe_samples) return -1.0;
    if (r->lossy) {
        double least = r->min_cur < r->min_prev ? r->min_cur : r->min_prev;
        double v = 2 * least, floor = r->min_rto / 16;
        return v > floor ? v : floor;
    }
    double floor = r->min_rto / 4, v = 2 * r->srtt;
    double est = r->srtt + 4 * r->rttvar;
    if (floor > est) est = floor;
    return v > est ? v : est;
}

/* loss.LossRecovery.wake_at with its probe_at, over the chunks in flight (in_flight) */
static double wake_at(const ha_round *r, double now) {
    int64_t hi = r->next_c, lo = hi ? (hi - r->slots > 0 ? hi - r->slots : 0) : 0;
    double first = INFINITY, oldest = INFINITY, srtt = r->has_srtt ? r->srtt : 0.0;
    int any = 0, candidate = 0;
    for (int64_t c = lo; c < hi; c++) {
        if (r->done[c]) continue;
        any = 1;
        double sent = r->sent_at[c], due = sent + r->rto[c];
        int before = c < r->rack_c && sent <= r->rack_ts; /* (loss.py: rack_due) */
        if (before && !r->held[c]) {
            double rack = sent + r->rack_rtt + srtt / 4;
            if (rack < due) due = rack;
        }
        if (due < first) first = due;
        if (sent < oldest) oldest = sent;
        if (!r->held[c] || sent < r->last_progress) candidate = 1;
    }
    if (!any) return now + HA_TICK;
    double p = pto(r), probe = INFINITY;
    if (p >= 0 && r->nprobes >= r->probes) {
        if (r->lossy && r->held_probes < r->held_max)
            probe = oldest + p * 4 * (double)(1LL << r->held_probes);
    } else if (p >= 0) {
        if (r->nprobes) {
            if (!r->done[r->probe_c]) probe = r->sent_at[r->probe_c] + p;
        } else if (candidate) {
            probe = (r->last_progress > r->last_new ? r->last_progress : r->last_new) + p;
        } else if (r->lossy) {
            probe = oldest + p;
        }
    }
    if (probe < first) first = probe;
    return first < now + HA_TICK ? first : now + HA_TICK;
}

/* The C loop's timer and estimate, for tests that hold them to loss.py's and rto.py's */
double ha_wake_at(const ha_round *r, double now) { return wake_at(r, now); }

void ha_rtt_sample(ha_round *r, double rtt) { rtt_sample(r, rtt); }

/* -- sending --------------------------------------------------------------------------- */

static int gso_refused(int e) {
    return e == EINVAL || e == EIO || e == ENOPROTOOPT || e == EOPNOTSUPP;
}

/* Datagrams c0 .. end - 1 of buf, as runs of UDP GSO (one datagram per message once GSO was
 * refused), many messages per sendmmsg. Returns the datagrams sent (a full socket buffer stops
 * there: the timeout resends the rest, as Python's send_many), or -1 (r->err). */
static int64_t send_run(ha_ctx *x, ha_round *r, int64_t c0, int64_t end) {
    struct sockaddr_in dst = {0};
    dst.sin_family = AF_INET;
    dst.sin_addr.s_addr = htonl((uint32_t)r->switch_ip);
    dst.sin_port = htons((uint16_t)r->switch_port);
    size_t ps = (size_t)r->psize;
    int64_t sent = 0, c = c0;
    while (c < end) {
        int64_t per = 1;
        if (r->gso) {
            per = HA_MAX_GSO_BYTES / (int64_t)ps;
            if (per > HA_MAX_SEGMENTS) per = HA_MAX_SEGMENTS;
            if (per < 1) per = 1;
        }
        int m = 0;
        int64_t at = c;
        for (; m < HA_MAX_MSGS && at < end; m++) {
            int64_t n = end - at < per ? end - at : per;
            struct msghdr *h = &x->omsgs[m].msg_hdr;
            memset(h, 0, sizeof *h);
            x->oiov[m].iov_base = r->buf + (size_t)at * ps;
            x->oiov[m].iov_len = (size_t)n * ps;
            h->msg_iov = &x->oiov[m];
            h->msg_iovlen = 1;
            h->msg_name = &dst;
            h->msg_namelen = sizeof dst;
            if (n > 1) {
                h->msg_control = x->ocbuf[m].buf;
                h->msg_controllen = sizeof x->ocbuf[m].buf;
                struct cmsghdr *cm = CMSG_FIRSTHDR(h);
                cm->cmsg_level = SOL_UDP;
                cm->cmsg_type = HA_UDP_SEGMENT;
                cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
                uint16_t seg = (uint16_t)ps;
                memcpy(CMSG_DATA(cm), &seg, sizeof seg);
            }
            at += n;
        }
        int done = sendmmsg((int)r->fd, x->omsgs, (unsigned)m, 0);
        if (done < 0) {
            int e = errno;
            if (e == EAGAIN || e == EWOULDBLOCK || e == ENOBUFS) break;
            if (e == EINTR) continue;
            if (r->gso && gso_refused(e) && sent == 0 && x->oiov[0].iov_len > ps) {
                /* GSO refused, or a real error: a plain send of the first datagram tells */
                if (sendto((int)r->fd, r->buf + (size_t)c * ps, ps, 0,
                           (struct sockaddr *)&dst, sizeof dst) < 0) {
                    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) break;
                    r->err = errno;
                    return -1;
                }
                r->gso = 0;
                r->send_calls++;
                r->sent++;
                sent++;
                c++;
                continue;
            }
            r->err = e;
            return -1;
        }
        r->send_calls++;
        for (int i = 0; i < done; i++) {
            int64_t n = (int64_t)(x->oiov[i].iov_len / ps);
            sent += n;
            c += n;
        }
        if (done < m) break;    /* the rest would not go: a full buffer */
    }
    r->sent += sent;
    return sent;
}

/* round.Round.send_new without the congestion control: every chunk the slots allow, as one
 * run (chunk c may go once chunk c - S, its slot's previous, is done). */
static int send_new(ha_ctx *x, ha_round *r, double now) {
    int64_t S = r->slots, c0 = r->next_c, N = r->nchunks;
    int64_t end = c0 > S ? c0 : S;
    if (end > N) end = N;
    if (end < N) {
        int64_t c = end - S;
        while (c < N - S && r->done[c]) c++;
        end = c < N - S ? c + S : N;
    }
    if (end <= c0) return 0;
    int64_t n = send_run(x, r, c0, end);
    if (n < 0) return -1;
    if (end == N && r->lossy) { /* round.Round.tail_copy: the last chunk twice while lossy */
        int64_t m = send_run(x, r, end - 1, end);
        if (m < 0) return -1;
        r->tail_copies += m;
        n += m;
    }
    r->packets_sent += n;
    r->bytes_sent += n * r->psize;
    for (int64_t c = c0; c < end; c++) {
        r->sent_at[c] = now;
        r->rto[c] = r->cur_rto;
    }
    r->next_c = end;
    r->last_new = now;
    return 0;
}

/* -- receiving ------------------------------------------------------------------------- */

static int receive(ha_ctx *x, ha_round *r) {
    for (int i = 0; i < HA_BATCH; i++) {
        struct msghdr *h = &x->msgs[i].msg_hdr;
        memset(h, 0, sizeof *h);
        x->iov[i].iov_base = r->rbuf + (size_t)i * HA_RUN_BYTES;
        x->iov[i].iov_len = HA_RUN_BYTES;
        h->msg_name = &x->src[i];
        h->msg_namelen = sizeof x->src[i];
        h->msg_iov = &x->iov[i];
        h->msg_iovlen = 1;
        h->msg_control = x->cbuf[i].buf;
        h->msg_controllen = sizeof x->cbuf[i].buf;
    }
    int n = recvmmsg((int)r->fd, x->msgs, HA_BATCH, MSG_DONTWAIT, NULL);
    if (n <= 0) return 0;
    r->recv_calls++;
    for (int i = 0; i < n; i++) {
        size_t nb = x->msgs[i].msg_len, seg = gro_size(&x->msgs[i].msg_hdr, nb);
        r->received += seg ? (int64_t)((nb + seg - 1) / seg) : 1;
    }
    x->nmsg = n;
    x->cur_msg = 0;
    x->cur_off = 0;
    return n;
}

/* The chunk of a datagram of the round's size if it is a plain result of this round (its op,
 * the chunk's part's, flags, job and run under mask, the job's key, a round tag of this
 * round), else -1. */
static inline int64_t plain_chunk(const ha_round *r, const uint8_t *p) {
    uint64_t h = (uint64_t)ld32(p) | (uint64_t)ld32(p + 4) << 32;
    int64_t c = (int64_t)((ntohl(ld32(p + HX_OFF_SEQ)) - (uint32_t)r->seq0) & 0xFFFFFFFFu);
    if (c >= r->nchunks || (h & r->mask) != (c < r->split ? r->expect : r->expect2) ||
        ntohl(ld32(p + HX_OFF_AUTH)) != (uint32_t)r->auth)
        return -1;
    return c;
}

/* One sample per batch: the mean send time of the results taken that were sent once (Karn). */
static void sample_batch(ha_ctx *x, ha_round *r, double now) {
    if (x->fresh) {
        rtt_sample(r, now - x->fresh_sum / (double)x->fresh);
        x->fresh_sum = 0.0;
        x->fresh = 0;
    }
}

/* Match the batch from where it stands (results.take's pass, a datagram at a time); 1 when
 * stopped at a datagram for Python (odd_at, odd_len). */
static int take_batch(ha_ctx *x, ha_round *r) {
    double now = now_s();
    size_t ps = (size_t)r->psize;
    int64_t K = r->k;
    for (; x->cur_msg < x->nmsg; x->cur_msg++, x->cur_off = 0) {
        struct mmsghdr *m = &x->msgs[x->cur_msg];
        size_t nb = m->msg_len, seg = gro_size(&m->msg_hdr, nb);
        size_t step = seg ? seg : 1, end = nb ? nb : 1;
        uint32_t ip = ntohl(x->src[x->cur_msg].sin_addr.s_addr);
        uint16_t port = ntohs(x->src[x->cur_msg].sin_port);
        if (ip != (uint32_t)r->switch_ip || port < HX_HOMAGG_UDP_PORT_MIN || port > HX_HOMAGG_UDP_PORT_MAX) {
            size_t left = end - (size_t)x->cur_off;
            r->ignored += (int64_t)((left + step - 1) / step);
            continue;
        }
        const uint8_t *base = x->iov[x->cur_msg].iov_base;
        while ((size_t)x->cur_off < end) {
            size_t at = (size_t)x->cur_off;
            size_t len = nb ? (seg < nb - at ? seg : nb - at) : 0;
            const uint8_t *p = base + at;
            int64_t c = len == ps ? plain_chunk(r, p) : -1;
            if (c < 0) {
                sample_batch(x, r, now);
                r->odd_at = (int64_t)(p - r->rbuf);
                r->odd_len = (int64_t)len;
                x->cur_off = (int64_t)(at + step);
                return 1;
            }
            x->cur_off = (int64_t)(at + step);
            if (r->done[c]) { /* a late duplicate */
                r->ignored++;
                continue;
            }
            swap_words((uint8_t *)(r->out + c * K), p + HX_OFF_WORDS, K);
            r->done[c] = 1;
            r->ndone++;
            r->results++;
            delivered(r, c, now);
            if (!r->resent[c]) {
                x->fresh_sum += r->sent_at[c];
                x->fresh++;
            }
            if (((uint64_t)ld32(p) | (uint64_t)ld32(p + 4) << 32) & r->ovf_mask) r->overflow = 1;
            r->last_progress = now;
            r->nprobes = 0;
            r->held_probes = 0;
        }
    }
    x->nmsg = 0;
    sample_batch(x, r, now);
    return 0;
}

/* Stream the round until it is done or Python is needed (HA_DONE, HA_DUE, HA_ODD, HA_ERROR,
 * HA_WAIT_ERROR:
 * see the top of this file). */
int ha_round_run(ha_ctx *x, ha_round *r) {
    for (;;) {
        if (x->nmsg) {
            if (take_batch(x, r)) return HA_ODD;
            if (receive(x, r) > 0) continue; /* drain what is queued before the timers */
        }
        if (r->ndone >= r->nchunks) return HA_DONE;
        double now = now_s();
        if (send_new(x, r, now) < 0) return HA_ERROR;
        double wake = wake_at(r, now);
        now = now_s();
        if (wake <= now) return HA_DUE;
        if (receive(x, r) > 0) continue; /* results already queued: no sleep, no poll */
        double wait = wake - now;
        struct timespec ts = {(time_t)wait, (long)((wait - (double)(time_t)wait) * 1e9)};
        struct pollfd pfd = {(int)r->fd, POLLIN, 0};
        int n = ppoll(&pfd, 1, &ts, NULL);
        if (n < 0 && errno != EINTR) {
            r->err = errno;
            return HA_WAIT_ERROR;
        }
        if (n <= 0) return HA_DUE;
        if (receive(x, r) == 0) continue;
    }
}
