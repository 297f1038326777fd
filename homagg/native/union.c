/* The union's kernels over the packed bitmap: its size, its positions, a worker's values at
 * their ranks in it, the dense sum decoded from it, and the hierarchical index's levels
 * (homagg/host_agent/codec/_native.py calls them for the codec's compiled kernels).
 *
 * Each is the numba kernel of the same name in homagg/host_agent/codec/_jit_bitmap.py and
 * _jit_blocks.py, and the numpy function in _ref.py (the reference); the tests hold the three
 * to the same bits. They are here so that an agent whose tensors are float32 runs its whole
 * codec in this library and never imports numba (numba's import and its kernels' machine code
 * cost a worker about 100 MB of its peak memory).
 *
 * The bitmap is numpy's packbits read as little-endian uint32 words: tensor element 8 j + t is
 * bit 7 - t of byte j. brev8 turns a word into tensor order (bit j is element 32 i + j).
 */
#include <stdint.h>
#include <string.h>

/* Each loop is built twice, for x86-64's baseline and for x86-64-v3 (AVX2, POPCNT, BMI): the
 * loader picks the one the CPU runs (GCC's function multiversioning). The baseline has no
 * popcount or trailing-zero instruction, which these loops are made of; numba compiles for the
 * host's CPU, and so, here, does the second build. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HC_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define HC_CLONES
#endif

static inline uint32_t brev8(uint32_t w) {
    w = ((w >> 1) & 0x55555555u) | ((w & 0x55555555u) << 1);
    w = ((w >> 2) & 0x33333333u) | ((w & 0x33333333u) << 2);
    return ((w >> 4) & 0x0F0F0F0Fu) | ((w & 0x0F0F0F0Fu) << 4);
}

/* the tensor-order word i of a bitmap of n elements, its bits past n cleared */
static inline uint32_t tensor_word(const uint32_t *words, int64_t n, int64_t i) {
    uint32_t t = brev8(words[i]);
    int64_t rem = n - 32 * i;
    return rem < 32 ? t & (uint32_t)((1ull << rem) - 1) : t;
}

static inline double pow2(int64_t s) { /* 2**s, -1022 <= s <= 1023 */
    union { uint64_t u; double d; } v = {.u = (uint64_t)(s + 1023) << 52};
    return v.d;
}

/* How many of the first n tensor positions are set (the union's size). */
HC_CLONES
int64_t hc_union_size(const uint32_t *words, int64_t n) {
    int64_t full = n / 32, total = 0, i = 0;
    for (; i + 2 <= full; i += 2) { /* two words a popcount */
        uint64_t w;
        memcpy(&w, words + i, 8);
        total += __builtin_popcountll(w);
    }
    for (; i < full; i++)
        total += __builtin_popcount(words[i]);
    if (n > 32 * full)
        total += __builtin_popcount(tensor_word(words, n, full));
    return total;
}

/* The set positions < n, ascending, into out (room for the union's size); their count. */
HC_CLONES
int64_t hc_set_bits(const uint32_t *words, int64_t n, int64_t *out) {
    int64_t k = 0, nw = (n + 31) / 32;
    for (int64_t i = 0; i < nw; i++) {
        if (!words[i]) /* (most words of a sparse union) */
            continue;
        for (uint32_t t = i == nw - 1 ? tensor_word(words, n, i) : brev8(words[i]); t;
             t &= t - 1)
            out[k++] = 32 * i + __builtin_ctz(t);
    }
    return k;
}

/* The bitmap of a float32 tensor's non-zeros (NaN included, -0.0 not) into words; their
 * count. */
HC_CLONES
int64_t hc_pack_nonzero_f32(const uint32_t *xi, int64_t n, uint32_t *words) {
    int64_t total = 0, nw = (n + 31) / 32;
    for (int64_t i = 0; i < nw; i++) {
        int64_t base = 32 * i, lim = n - base < 32 ? n - base : 32;
        uint32_t t = 0;
        for (int64_t j = 0; j < lim; j++)
            t |= (uint32_t)((xi[base + j] & 0x7fffffffu) != 0) << j;
        words[i] = brev8(t);
        total += __builtin_popcount(t);
    }
    return total;
}

/* out[r] = q[the r-th set position < n] */
HC_CLONES
void hc_gather_union(const uint32_t *words, int64_t n, const int32_t *q, int32_t *out) {
    int64_t k = 0, nw = (n + 31) / 32;
    for (int64_t i = 0; i < nw; i++) {
        if (!words[i])
            continue;
        for (uint32_t t = i == nw - 1 ? tensor_word(words, n, i) : brev8(words[i]); t;
             t &= t - 1)
            out[k++] = q[32 * i + __builtin_ctz(t)];
    }
}

/* The hierarchical index's sub-blocks: mid holds two bytes per union block (its 16 sub-block
 * bits, most significant first); out (room for their set bits) gets 16 * block + s for each. */
HC_CLONES
void hc_subblocks(const uint8_t *mid, const int64_t *blocks, int64_t nblocks, int64_t *out) {
    int64_t k = 0;
    for (int64_t r = 0; r < nblocks; r++) {
        uint32_t w = ((uint32_t)mid[2 * r] << 8) | mid[2 * r + 1];
        int64_t base = blocks[r] << 4;
        while (w) {
            int s = 31 - __builtin_clz(w); /* the highest set bit is sub-block 15 - s */
            out[k++] = base + 15 - s;
            w &= ~(1u << s);
        }
    }
}

/* How many of a uint64's 8 bytes are not zero (bit 7 of each byte says, no carries). */
static inline int64_t nonzero_bytes(uint64_t v) {
    const uint64_t low7 = 0x7F7F7F7F7F7F7F7Full, high = 0x8080808080808080ull;
    return __builtin_popcountll((((v & low7) + low7) | v) & high);
}

/* A flat bitmap's hierarchy counts: bytes (sub-blocks of 8) with a bit set, and blocks of 16
 * bytes with one: of the bitmap's ``used`` bytes. */
HC_CLONES
void hc_level_counts(const uint8_t *b, int64_t used, int64_t *c1, int64_t *c2) {
    int64_t blocks = 0, subs = 0, lo = 0;
    for (; lo + 16 <= used; lo += 16) {
        uint64_t q[2];
        memcpy(q, b + lo, 16);
        int64_t k = nonzero_bytes(q[0]) + nonzero_bytes(q[1]);
        subs += k;
        blocks += k != 0;
    }
    int64_t k = 0;
    for (; lo < used; lo++)
        k += b[lo] != 0;
    *c1 = blocks + (k != 0);
    *c2 = subs + k;
}

/* Per word, the union's count in the words before it (a position's rank: its word's count
 * plus the bits below it). */
static void word_prefix(const uint32_t *words, int64_t nw, int64_t *pre) {
    int64_t acc = 0;
    for (int64_t i = 0; i < nw; i++) {
        pre[i] = acc;
        acc += __builtin_popcount(words[i]);
    }
}

/* Position p's rank in the union, or -1 where p is not in it (nor in 0..n-1). */
static inline int64_t rank_of(const uint32_t *words, const int64_t *pre, int64_t n, int64_t p) {
    if (p < 0 || p >= n)
        return -1;
    uint32_t t = brev8(words[p >> 5]);
    int j = (int)(p & 31);
    if (!((t >> j) & 1))
        return -1;
    return pre[p >> 5] + __builtin_popcount(t & ((1u << j) - 1));
}

/* A worker's float32 non-zeros (positions idx, values raw) as int32 words by union rank into
 * out (zeros, the union's size), each quantized at its block's shift or, for the positions in
 * the sorted ``at``, at its own: 1, or 0 where a value does not quantize or a position is
 * outside the union. pre: scratch of (n + 31) / 32. */
HC_CLONES
int32_t hc_encode_union_f32(const uint32_t *words, int64_t n, const int64_t *idx,
                            const float *raw, int64_t k, const int64_t *shifts, int64_t block,
                            const int64_t *at, const int64_t *at_shifts, int64_t nat,
                            int32_t *out, int64_t *pre) {
    word_prefix(words, (n + 31) / 32, pre);
    int64_t j = 0;
    for (int64_t i = 0; i < k; i++) {
        int64_t p = idx[i], r = rank_of(words, pre, n, p);
        if (r < 0)
            return 0;
        double q = __builtin_rint((double)raw[i] * pow2(shifts[p / block]));
        if (nat) { /* split blocks: their elements at their own scale */
            while (j < nat && at[j] < p)
                j++;
            if (j < nat && at[j] == p)
                q = __builtin_rint((double)raw[i] * pow2(at_shifts[j]));
        }
        if (!(q >= -2147483648.0 && q <= 2147483647.0)) /* (false for NaN) */
            return 0;
        out[r] = (int32_t)q;
    }
    return 1;
}

/* Zero one bitmap word's 32 outputs of ``size`` bytes each, in 32-byte stores: a memset the
 * compiler writes as ``rep stos``, slow to start for 128 or 256 bytes. */
typedef char hc_v32 __attribute__((vector_size(32), aligned(1)));
static inline void zero_word(void *p, size_t size) {
    char *c = p;
    hc_v32 z = {0};
    *(hc_v32 *)(c + 0) = z;
    *(hc_v32 *)(c + 32) = z;
    *(hc_v32 *)(c + 64) = z;
    *(hc_v32 *)(c + 96) = z;
    if (size == 8) {
        *(hc_v32 *)(c + 128) = z;
        *(hc_v32 *)(c + 160) = z;
        *(hc_v32 *)(c + 192) = z;
        *(hc_v32 *)(c + 224) = z;
    }
}

/* The dense sum of n elements from the union bitmap: 0 off the union, values[rank] times the
 * scale of its word (scales[i * stride]; stride 0: one scale) on it, rounded once to the
 * output's type. Returns the union's size, or -1 where values (u of them) is shorter.
 * Per word: zero its 32 outputs, then write its first four set bits whatever the word holds (a
 * sentinel bit 32 sends a missing one to the next word's first output, which that word's
 * zeroing overwrites), and loop only for the rest: no unpredictable loop exit for most words
 * (numba's kernel does the same). The fast loop needs a next word and 32 values to read. */
#define DECODE(NAME, VT, OT)                                                                   \
    HC_CLONES int64_t NAME(OT *restrict out, int64_t n, const uint32_t *restrict words,      \
                           const VT *restrict values, int64_t u,                              \
                           const double *restrict scales, int64_t stride) {                   \
        int64_t r = 0, i = 0, nfull = n / 32, nw = (n + 31) / 32;                              \
        for (; i < nfull - 1 && r + 32 <= u; i++) {                                            \
            int64_t base = 32 * i;                                                             \
            double scale = scales[i * stride];                                                 \
            zero_word(out + base, sizeof(OT));                                                 \
            uint32_t w = brev8(words[i]);                                                      \
            uint64_t t = (uint64_t)w | (1ull << 32);                                           \
            for (int j = 0; j < 4; j++) {                                                      \
                out[base + __builtin_ctzll(t)] = (OT)((double)values[r + j] * scale);          \
                t = (t & (t - 1)) | (1ull << 32);                                              \
            }                                                                                  \
            int c = __builtin_popcount(w);                                                     \
            if (c > 4) {                                                                       \
                t &= 0xFFFFFFFFull; /* drops the sentinel: bits 5.. of w remain */             \
                for (int64_t k = r + 4; t; k++, t &= t - 1)                                    \
                    out[base + __builtin_ctzll(t)] = (OT)((double)values[k] * scale);          \
            }                                                                                  \
            r += c;                                                                            \
        }                                                                                      \
        for (; i < nw; i++) {                                                                  \
            int64_t base = 32 * i, lim = n - base < 32 ? n - base : 32;                       \
            double scale = scales[i * stride];                                                 \
            for (int64_t j = 0; j < lim; j++)                                                  \
                out[base + j] = 0;                                                             \
            uint32_t t = tensor_word(words, n, i);                                             \
            if (r + __builtin_popcount(t) > u)                                                 \
                return -1;                                                                     \
            for (; t; t &= t - 1)                                                              \
                out[base + __builtin_ctz(t)] = (OT)((double)values[r++] * scale);              \
        }                                                                                      \
        return r;                                                                              \
    }
DECODE(hc_decode_union_i32_f32, int32_t, float)
DECODE(hc_decode_union_i32_f64, int32_t, double)
DECODE(hc_decode_union_i64_f32, int64_t, float)
DECODE(hc_decode_union_i64_f64, int64_t, double)

/* out (n zeros) at the union's positions: values[r] (int32, or int64 where ``wide``) times
 * scale, rounded once to the output's type */
HC_CLONES
void hc_assemble(void *out, int32_t f64, const int64_t *uni, const void *values, int32_t wide,
                 int64_t u, double scale) {
    for (int64_t r = 0; r < u; r++) {
        double v = wide ? (double)((const int64_t *)values)[r]
                        : (double)((const int32_t *)values)[r];
        if (f64)
            ((double *)out)[uni[r]] = v * scale;
        else
            ((float *)out)[uni[r]] = (float)(v * scale);
    }
}

/* out[i] = values[i] * scales[i / block], rounded once to the output's type: values int64
 * (vtype 1) or float64 (2); hc_scale_i32 (codec.c) takes int32. A block at a time, one loop
 * per pair of types. */
#define SCALE(VT, OT)                                                                          \
    for (int64_t b = 0, lo = 0; lo < n; b++, lo += block) {                                    \
        int64_t hi = lo + block < n ? lo + block : n;                                          \
        double s = scales[b];                                                                  \
        for (int64_t i = lo; i < hi; i++)                                                      \
            ((OT *)out)[i] = (OT)((double)((const VT *)values)[i] * s);                        \
    }
HC_CLONES
void hc_scale_wide(const void *values, int32_t vtype, int64_t n, const double *scales,
                   int64_t block, void *out, int32_t f64) {
    if (vtype == 1 && f64)
        SCALE(int64_t, double)
    else if (vtype == 1)
        SCALE(int64_t, float)
    else if (f64)
        SCALE(double, double)
    else
        SCALE(double, float)
}
