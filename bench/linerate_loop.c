/* bench.linerate's C side: a load that costs little per datagram, and the baseline loops.
 *
 *   linerate_loop echo IP:PORT plain|gso SECONDS
 *       the baseline: a UDP reflector. plain: recvfrom + sendto per datagram; gso: recvmmsg
 *       with UDP GRO, each coalesced run sent back to its sender as one UDP GSO send. Writes
 *       "datagrams bytes" (received) on stdout when done.
 *   linerate_loop blast SWITCH_IP:PORT JOB AUTH K SLOTS SECONDS CHECK BIND_IP:PORT...
 *       every worker of one job (one BIND each), round after round: each worker sends one
 *       packet to each slot (one GSO run), then waits for every slot's answer; a round not
 *       answered within 0.2 s is sent again. Worker w puts w + 1 in every word, so with CHECK
 *       every result's first and last word must be the sum W(W+1)/2 (a wrong one is counted).
 *       Writes "rounds resends wrong answers" on stdout.
 *
 * Built by bench/linerate.py with the machine's cc into a temporary folder: a benchmark tool,
 * not part of homagg. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../homagg/native/wire.h"

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#define UDP_SEGMENT_ 103
#define UDP_GRO_ 104
#define RUN 65536
#define BATCH 16

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static struct sockaddr_in addr_of(const char *text) {
    char host[64];
    struct sockaddr_in a = {.sin_family = AF_INET};
    const char *colon = strrchr(text, ':');
    if (!colon || (size_t)(colon - text) >= sizeof host) {
        fprintf(stderr, "bad address %s\n", text);
        exit(2);
    }
    memcpy(host, text, (size_t)(colon - text));
    host[colon - text] = 0;
    inet_pton(AF_INET, host, &a.sin_addr);
    a.sin_port = htons((uint16_t)atoi(colon + 1));
    return a;
}

static int bound(struct sockaddr_in a) {
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    int big = 8 << 20;
    setsockopt(s, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    setsockopt(s, SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
    if (bind(s, (struct sockaddr *)&a, sizeof a) < 0) {
        perror("bind");
        exit(2);
    }
    return s;
}

static int send_run(int s, const uint8_t *data, size_t len, uint16_t seg,
                    const struct sockaddr_in *to, int gso) {
    if (!gso || len <= seg) {
        for (size_t at = 0; at < len; at += seg)
            sendto(s, data + at, len - at < seg ? len - at : seg, 0, (const void *)to, sizeof *to);
        return 0;
    }
    size_t per = (65507 - 28) / seg;
    if (per > 64) per = 64;
    per *= seg;
    for (size_t at = 0; at < len; at += per) {
        size_t n = len - at < per ? len - at : per;
        struct iovec v = {(void *)(data + at), n};
        union { char b[CMSG_SPACE(sizeof(uint16_t))]; struct cmsghdr a; } cb;
        struct msghdr h = {.msg_name = (void *)to, .msg_namelen = sizeof *to, .msg_iov = &v,
                           .msg_iovlen = 1};
        if (n > seg) {
            h.msg_control = cb.b;
            h.msg_controllen = sizeof cb.b;
            struct cmsghdr *c = CMSG_FIRSTHDR(&h);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT_;
            c->cmsg_len = CMSG_LEN(sizeof seg);
            memcpy(CMSG_DATA(c), &seg, sizeof seg);
        }
        while (sendmsg(s, &h, 0) < 0) {
            if (errno != EAGAIN && errno != ENOBUFS) return -1;
            struct pollfd p = {s, POLLOUT, 0};
            poll(&p, 1, 10);
        }
    }
    return 0;
}

static int echo(const char *where, int gso, double seconds) {
    int s = bound(addr_of(where));
    int one = 1;
    if (gso) setsockopt(s, SOL_UDP, UDP_GRO_, &one, sizeof one);
    struct timeval tv = {0, 200000};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    static uint8_t buf[BATCH][RUN];
    struct mmsghdr m[BATCH];
    struct iovec v[BATCH];
    struct sockaddr_in src[BATCH];
    union { char b[CMSG_SPACE(sizeof(int))]; struct cmsghdr a; } cb[BATCH];
    long long dgrams = 0, bytes = 0;
    double end = now() + seconds;
    while (now() < end) {
        if (!gso) {
            struct sockaddr_in a;
            socklen_t al = sizeof a;
            ssize_t n = recvfrom(s, buf[0], RUN, 0, (void *)&a, &al);
            if (n < 0) continue;
            sendto(s, buf[0], (size_t)n, 0, (void *)&a, al);
            dgrams++;
            bytes += n;
            continue;
        }
        for (int i = 0; i < BATCH; i++) {
            v[i] = (struct iovec){buf[i], RUN};
            m[i].msg_hdr = (struct msghdr){.msg_name = &src[i], .msg_namelen = sizeof src[i],
                                           .msg_iov = &v[i], .msg_iovlen = 1,
                                           .msg_control = cb[i].b,
                                           .msg_controllen = sizeof cb[i].b};
        }
        int n = recvmmsg(s, m, BATCH, MSG_WAITFORONE, NULL);
        for (int i = 0; i < n; i++) {
            size_t len = m[i].msg_len;
            int seg = (int)len;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&m[i].msg_hdr); c;
                 c = CMSG_NXTHDR(&m[i].msg_hdr, c))
                if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO_)
                    memcpy(&seg, CMSG_DATA(c), sizeof seg);
            if (seg <= 0) seg = (int)len;
            send_run(s, buf[i], len, (uint16_t)seg, &src[i], 1);
            dgrams += (long long)((len + (size_t)seg - 1) / (size_t)seg);
            bytes += (long long)len;
        }
    }
    printf("%lld %lld\n", dgrams, bytes);
    return 0;
}

static void put16(uint8_t *p, uint32_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
static void put32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}
static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static int blast(int argc, char **argv) {
    struct sockaddr_in sw = addr_of(argv[0]);
    uint32_t job = (uint32_t)atoi(argv[1]);
    uint32_t auth = (uint32_t)strtoul(argv[2], NULL, 0);
    int k = atoi(argv[3]), slots = atoi(argv[4]);
    double seconds = atof(argv[5]);
    int check = atoi(argv[6]);
    int workers = argc - 7;
    size_t size = HX_HOMAGG_HDR_BYTES + 4 * (size_t)k;
    int *socks = calloc((size_t)workers, sizeof *socks);
    uint8_t **runs = calloc((size_t)workers, sizeof *runs);
    int one = 1;
    for (int w = 0; w < workers; w++) {
        socks[w] = bound(addr_of(argv[7 + w]));
        setsockopt(socks[w], SOL_UDP, UDP_GRO_, &one, sizeof one);
        runs[w] = calloc((size_t)slots, size);
        for (int s = 0; s < slots; s++) {
            uint8_t *p = runs[w] + (size_t)s * size;
            p[HX_OFF_VERSION_OP] = (uint8_t)(HX_HOMAGG_VERSION << HX_SHIFT_VERSION | HX_OP_ADD);
            put16(p + HX_OFF_JOB, job);
            p[HX_OFF_WORKER] = (uint8_t)w;
            put16(p + HX_OFF_SLOT, (uint32_t)s);
            put32(p + HX_OFF_AUTH, auth);
            for (int i = 0; i < k; i++) put32(p + HX_OFF_WORDS + 4 * i, (uint32_t)(w + 1));
        }
    }
    uint32_t want = (uint32_t)(workers * (workers + 1) / 2);
    static uint8_t buf[RUN];
    long long rounds = 0, resends = 0, wrong = 0, answers = 0;
    double end = now() + seconds;
    for (uint32_t seq = 1; now() < end; seq++) {
        for (int w = 0; w < workers; w++)
            for (int s = 0; s < slots; s++) {
                uint8_t *p = runs[w] + (size_t)s * size;
                put32(p + HX_OFF_SEQ, seq);
                p[HX_OFF_FLAGS] = (seq & 1) ? 0 : HX_FLAG_PHASE;
            }
        int need = workers * slots;
        double sent_at = now();
        for (int w = 0; w < workers; w++)
            send_run(socks[w], runs[w], (size_t)slots * size, (uint16_t)size, &sw, 1);
        struct pollfd pf[64];
        for (int w = 0; w < workers; w++) pf[w] = (struct pollfd){socks[w], POLLIN, 0};
        while (need > 0) {
            if (poll(pf, (nfds_t)workers, 20) <= 0) {
                if (now() - sent_at > 0.2) { /* resend the round */
                    for (int w = 0; w < workers; w++)
                        send_run(socks[w], runs[w], (size_t)slots * size, (uint16_t)size, &sw, 1);
                    sent_at = now();
                    resends++;
                }
                continue;
            }
            for (int w = 0; w < workers; w++) {
                if (!(pf[w].revents & POLLIN)) continue;
                union { char b[CMSG_SPACE(sizeof(int))]; struct cmsghdr a; } cb;
                struct iovec v = {buf, RUN};
                struct msghdr h = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = cb.b,
                                   .msg_controllen = sizeof cb.b};
                ssize_t n = recvmsg(socks[w], &h, MSG_DONTWAIT);
                if (n <= 0) continue;
                int seg = (int)n;
                for (struct cmsghdr *c = CMSG_FIRSTHDR(&h); c; c = CMSG_NXTHDR(&h, c))
                    if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO_)
                        memcpy(&seg, CMSG_DATA(c), sizeof seg);
                if (seg <= 0) seg = (int)n;
                for (ssize_t at = 0; at < n; at += seg) {
                    const uint8_t *p = buf + at;
                    if (get32(p + HX_OFF_SEQ) != seq) continue; /* an earlier round's repeat */
                    answers++;
                    need--;
                    if (check && (get32(p + HX_OFF_WORDS) != want ||
                                  get32(p + HX_OFF_WORDS + 4 * (size_t)(k - 1)) != want ||
                                  !(p[HX_OFF_FLAGS] & HX_FLAG_RESULT)))
                        wrong++;
                }
            }
        }
        rounds++;
    }
    printf("%lld %lld %lld %lld\n", rounds, resends, wrong, answers);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 5 && !strcmp(argv[1], "echo")) return echo(argv[2], !strcmp(argv[3], "gso"),
                                                            atof(argv[4]));
    if (argc >= 10 && !strcmp(argv[1], "blast")) return blast(argc - 2, argv + 2);
    fprintf(stderr, "usage: see bench/linerate_loop.c\n");
    return 2;
}
