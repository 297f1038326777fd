/* The sketch's kernels: a position's three counters and signs, a worker's values encoded into
 * counters, and the summed counters peeled back into values (homagg/host_agent/codec/_native.py
 * calls them for the codec's compiled kernels).
 *
 * Each is the numba kernel of the same name in homagg/host_agent/codec/_jit_sketch.py and the
 * numpy function in _ref.py (the reference): the same hash (splitmix64's finaliser over the
 * position times M1, plus either seed) and the same level-synchronous peeling, bit for bit;
 * the tests hold the three to it. See union.c for why they are here.
 */
#include <stdint.h>
#include <stdlib.h>

/* built for x86-64's baseline and for x86-64-v3, as union.c's loops */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HC_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define HC_CLONES
#endif

#define M1 0x9E3779B97F4A7C15ull
#define M2 0xBF58476D1CE4E5B9ull
#define M3 0x94D049BB133111EBull

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= M2;
    x ^= x >> 27;
    x *= M3;
    x ^= x >> 31;
    return x;
}

/* counters p[0..2] and signs g[0..2] (+-1) of tensor position i; part = m / 3 */
static inline void hash3(int64_t i, int64_t part, uint64_t s1, uint64_t s2, int64_t *p,
                         int64_t *g) {
    uint64_t base = (uint64_t)i * M1, a = mix(base + s1), b = mix(base + s2);
    uint64_t q = (uint64_t)part;
    p[0] = (int64_t)(((a >> 32) * q) >> 32);
    p[1] = (int64_t)(((a & 0xFFFFFFFFull) * q) >> 32) + part;
    p[2] = (int64_t)(((b >> 32) * q) >> 32) + 2 * part;
    g[0] = (int64_t)(b & 1) * 2 - 1;
    g[1] = (int64_t)((b >> 1) & 1) * 2 - 1;
    g[2] = (int64_t)((b >> 2) & 1) * 2 - 1;
}

/* pos (3, k) and sgn (3, k), row-major, of positions idx[0:k] */
HC_CLONES
void hc_hashes(const int64_t *idx, int64_t k, int64_t part, uint64_t s1, uint64_t s2,
               int64_t *pos, int8_t *sgn) {
    int64_t p[3], g[3];
    for (int64_t i = 0; i < k; i++) {
        hash3(idx[i], part, s1, s2, p, g);
        for (int j = 0; j < 3; j++) {
            pos[j * k + i] = p[j];
            sgn[j * k + i] = (int8_t)g[j];
        }
    }
}

/* c (m zeros) += each value at its three counters, times their signs; values int32 (wide 0)
 * or int64 (1) */
HC_CLONES
void hc_sketch_encode(const int64_t *idx, const void *val, int32_t wide, int64_t k, int64_t m,
                      uint64_t s1, uint64_t s2, int64_t *c) {
    int64_t part = m / 3, p[3], g[3];
    for (int64_t i = 0; i < k; i++) {
        hash3(idx[i], part, s1, s2, p, g);
        int64_t v = wide ? ((const int64_t *)val)[i] : ((const int32_t *)val)[i];
        c[p[0]] += g[0] * v;
        c[p[1]] += g[1] * v;
        c[p[2]] += g[2] * v;
    }
}

/* Peel the summed sketch res (m counters, reduced in place) over the union (u positions):
 * values[r] and resolved[r] per union rank; the number of rounds, -1 where a counter holds
 * too many elements for the packed state (the caller then runs the numpy reference), -2 where
 * memory runs out. Per counter the state packs the count of its unresolved elements (low
 * ``bits`` bits) and the xor of their ranks (above): a counter with one element names it.
 * Rounds are level-synchronous, as the reference's: each takes the counters holding one
 * element at its start (numba's kernel says why the passes are split as they are). */
#define PEEL(NAME, ST, BITS)                                                                   \
    HC_CLONES static int64_t NAME(const int64_t *uni, int64_t u, uint64_t s1, uint64_t s2,   \
                                  int64_t *values, uint8_t *resolved, int64_t *res,        \
                                  int64_t m, int64_t *scratch) {                            \
        ST *state = calloc((size_t)(m ? m : 1), sizeof(ST));                                   \
        if (!state)                                                                            \
            return -2;                                                                         \
        int64_t *frontier = scratch, *nxt = scratch + m, *bc = scratch + 2 * m,                \
                *br = scratch + 3 * m;                                                         \
        const ST low = (ST)((1 << BITS) - 1);                                                  \
        int64_t part = m / 3, p[3], g[3], rounds = 0, nf = 0;                                  \
        for (int64_t r = 0; r < u; r++) {                                                      \
            hash3(uni[r], part, s1, s2, p, g);                                                 \
            ST x = (ST)(r << BITS);                                                            \
            for (int j = 0; j < 3; j++)                                                        \
                state[p[j]] = (ST)((state[p[j]] ^ x) + 1);                                     \
            if (((state[p[0]] | state[p[1]] | state[p[2]]) & low) == low) {                    \
                free(state);                                                                   \
                return -1;                                                                     \
            }                                                                                  \
        }                                                                                      \
        for (int64_t c = 0; c < m; c++)                                                        \
            if ((state[c] & low) == 1)                                                         \
                frontier[nf++] = c;                                                            \
        while (nf) {                                                                           \
            rounds++;                                                                          \
            int64_t end = nf, nb = 0, *t = frontier;                                           \
            nf = 0;                                                                            \
            frontier = nxt;                                                                    \
            nxt = t;                                                                           \
            for (int64_t i = 0; i < end; i++) { /* counters still holding one element */      \
                ST s = state[nxt[i]];                                                          \
                bc[nb] = nxt[i];                                                               \
                br[nb] = (int64_t)(s >> BITS);                                                 \
                nb += (s & low) == 1;                                                          \
            }                                                                                  \
            for (int64_t i = 0; i < nb; i++) /* rank -> tensor position */                    \
                nxt[i] = uni[br[i]];                                                           \
            for (int64_t i = 0; i < nb; i++) {                                                 \
                int64_t c = bc[i], r = br[i];                                                  \
                if (resolved[r]) /* pure in two counters: peeled already this round */        \
                    continue;                                                                  \
                hash3(nxt[i], part, s1, s2, p, g);                                             \
                int64_t v = g[c / part < 2 ? c / part : 2] * res[c];                          \
                values[r] = v;                                                                 \
                resolved[r] = 1;                                                               \
                ST x = (ST)(r << BITS);                                                        \
                for (int j = 0; j < 3; j++) {                                                  \
                    res[p[j]] -= g[j] * v;                                                     \
                    state[p[j]] = (ST)((state[p[j]] - 1) ^ x);                                 \
                }                                                                              \
                for (int j = 0; j < 3; j++)                                                    \
                    if ((state[p[j]] & low) == 1)                                              \
                        frontier[nf++] = p[j];                                                 \
            }                                                                                  \
        }                                                                                      \
        free(state);                                                                           \
        return rounds;                                                                         \
    }
PEEL(peel32, int32_t, 8)
PEEL(peel64, int64_t, 16)

/* peel with the state in int32 (8 + 23 bits) below 2**23 union positions, else in int64
 * (16 + 47); scratch: 4 m int64 */
HC_CLONES
int64_t hc_peel(const int64_t *uni, int64_t u, uint64_t s1, uint64_t s2, int64_t *values,
                uint8_t *resolved, int64_t *res, int64_t m, int64_t *scratch, int32_t small) {
    return small ? peel32(uni, u, s1, s2, values, resolved, res, m, scratch)
                 : peel64(uni, u, s1, s2, values, resolved, res, m, scratch);
}
