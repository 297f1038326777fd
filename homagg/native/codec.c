/* The codec's round-1 reading of a float32 tensor in one pass: the hot loop of an all-reduce's
 * per-element work (homagg/native/codec.py calls it for the codec's compiled kernels).
 *
 * hc_summary_f32 is ``summary`` of homagg/host_agent/codec/_jit_blocks.py (numba) and _ref.py
 * (numpy, the reference), for float32 and a block of whole bitmap words (32 elements); the
 * tests hold the three to the same bits. Where numba reads the tensor three times (the bitmap,
 * each block's peak, its run of small values) with a scalar loop per element, this reads each
 * word of 32 values once, with AVX2 where the CPU has it: its non-zero bits and its non-finite
 * bits as two compares and movemasks, its largest magnitude as an unsigned max. A magnitude's
 * bits order as its value, so a block's peak is the float whose bits are its largest magnitude,
 * and "small" is an integer compare with the limit's bits. The run check reads the block again
 * while it is in L1, and only where the block has at least a run's worth of non-zeros. Asked to,
 * it lists a sparse tensor's non-zeros (positions and values) in the same pass, while each word
 * is in registers, where a listing from the bitmap afterwards read every value again.
 * A large tensor is split between threads, a share of the blocks each (codec._native asks for
 * them from 2M elements on).
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HC_X86 1
#endif

#define HC_MAG 0x7fffffffu  /* all but the sign */
#define HC_EXPO 0x7f800000u /* the exponent: all set for Inf and NaN */
#define HC_MANT 23
#define HC_BIAS 127
/* A part stops listing once it holds more than a quarter of its values plus this many: the
 * codec lists a tensor of at most a quarter non-zeros (codec.scan.Summary) */
#define HC_LIST_SLACK 4096

/* Reverse the bits of each byte: a tensor-order word (bit j is element 32 i + j) to the packed
 * bitmap's (numpy's packbits, big-endian bit order, read as a little-endian uint32). */
static inline uint32_t brev8(uint32_t w) {
    w = ((w >> 1) & 0x55555555u) | ((w & 0x55555555u) << 1);
    w = ((w >> 2) & 0x33333333u) | ((w & 0x33333333u) << 2);
    return ((w >> 4) & 0x0F0F0F0Fu) | ((w & 0x0F0F0F0Fu) << 4);
}

/* Whether the block xi[0:count] (its largest magnitude ``top`` > 0) holds ``run`` consecutive
 * non-zeros each under 2**(e_peak - 1 - binades): the split rule (codec.blocks.split_flags). */
static inline uint8_t split_block(const uint32_t *xi, int64_t count, uint32_t top,
                                  int64_t binades, int64_t run) {
    uint32_t e = top >> HC_MANT;
    int64_t fe = e ? (int64_t)e - (HC_BIAS - 1)  /* frexp's exponent of the peak */
                   : (int64_t)(32 - __builtin_clz(top)) - (HC_BIAS + HC_MANT - 1);
    int64_t m = fe - 1 - binades; /* the limit is 2**m */
    int64_t limit;
    if (m >= 1 - HC_BIAS)
        limit = (m + HC_BIAS) << HC_MANT;
    else if (m >= 1 - HC_BIAS - HC_MANT)
        limit = (int64_t)1 << (m + HC_BIAS + HC_MANT - 1);
    else
        limit = 0;
    /* the count in 32-bit lanes (limit < 2**31), which the compiler vectorizes: most blocks of
     * a dense tensor end here */
    int32_t lim = (int32_t)limit, small = 0;
    for (int64_t i = 0; i < count; i++) {
        int32_t a = (int32_t)(xi[i] & HC_MAG);
        small += (a != 0) & (a < lim);
    }
    if (small < run)
        return 0;
    int64_t c = 0;
    for (int64_t i = 0; i < count; i++) {
        int64_t a = xi[i] & HC_MAG;
        c = (a != 0 && a < limit) ? c + 1 : 0;
        if (c >= run)
            return 1;
    }
    return 0;
}

/* One word of up to 32 values: *nz its non-zero bits, *odd its non-finite bits (tensor order),
 * *top raised to its largest magnitude. */
static inline void word_scalar(const uint32_t *xi, int64_t count, uint32_t *nz, uint32_t *odd,
                               uint32_t *top) {
    uint32_t t = 0, o = 0, m = *top;
    for (int64_t j = 0; j < count; j++) {
        uint32_t a = xi[j] & HC_MAG;
        t |= (uint32_t)(a != 0) << j;
        o |= (uint32_t)((xi[j] & HC_EXPO) == HC_EXPO) << j;
        m = a > m ? a : m;
    }
    *nz = t;
    *odd = o;
    *top = m;
}

/* A share of the blocks, for one thread: blocks [b0, b1); bad (first non-finite position or
 * -1) and nnz are its answers. */
typedef struct {
    const uint32_t *xi;
    int64_t n, block, binades, run, b0, b1, bad, nnz;
    int32_t split, baseline;
    uint32_t *words;
    double *peaks;
    uint8_t *mask;
    /* the listing (idx NULL: none): this part's share of idx and raw is [at, at + cap); it
     * listed ``listed`` non-zeros, or gave up (-1: too many, or too dense to be worth it) */
    int64_t *idx;
    uint32_t *raw;
    int64_t at, cap, listed;
} hc_part;

/* Append the non-zeros of one word (tensor-order bits t of the values xi[base..base+32)) at
 * idx[m], raw[m]: the first two written whatever t holds (an empty slot is overwritten by
 * the next word's), the rest by a loop, so most words of a sparse tensor take no branch that
 * depends on their bits. Room for 32 more is the caller's to check. Returns the new m. */
static inline int64_t list_word(uint32_t t, const uint32_t *xi, int64_t base, int64_t *idx,
                                uint32_t *raw, int64_t m, int64_t count) {
    uint32_t j = (uint32_t)__builtin_ctz(t | 0x80000000u);
    if (j >= count) /* (a partial word's last value may lie past the tensor: read none) */
        j = 0;
    idx[m] = base + j;
    raw[m] = xi[j];
    uint32_t r = t & (t - 1);
    j = (uint32_t)__builtin_ctz(r | 0x80000000u);
    if (j >= count)
        j = 0;
    idx[m + 1] = base + j;
    raw[m + 1] = xi[j];
    int64_t c = __builtin_popcount(t);
    if (c > 2) {
        r &= r - 1;
        for (int64_t k = m + 2; r; k++, r &= r - 1) {
            j = (uint32_t)__builtin_ctz(r);
            idx[k] = base + j;
            raw[k] = xi[j];
        }
    }
    return m + c;
}

/* The blocks' loop, the whole words of a block through ``WORD`` (a statement setting t, o and
 * acc from xi + base), the last partial word through word_scalar. */
#define HC_BLOCKS(WORD, ACC_T, ACC_INIT, ACC_TOP)                                              \
    const uint32_t *xi = p->xi;                                                               \
    int64_t n = p->n, block = p->block, run = p->run, bad = -1, nnz = 0;                      \
    int64_t *idx = p->idx ? p->idx + p->at : NULL, m = 0, first = p->b0 * block;             \
    uint32_t *raw = p->idx ? p->raw + p->at : NULL;                                           \
    for (int64_t b = p->b0; b < p->b1; b++) {                                                 \
        int64_t lo = b * block, hi = lo + block < n ? lo + block : n;                         \
        ACC_T acc = ACC_INIT;                                                                 \
        uint32_t tail_top = 0;                                                                \
        int64_t bnz = 0;                                                                      \
        for (int64_t base = lo; base < hi; base += 32) {                                      \
            uint32_t t, o;                                                                    \
            if (base + 32 <= n) {                                                             \
                WORD;                                                                         \
            } else {                                                                          \
                word_scalar(xi + base, n - base, &t, &o, &tail_top);                          \
            }                                                                                 \
            p->words[base >> 5] = brev8(t);                                                   \
            bnz += __builtin_popcount(t);                                                     \
            if (idx) { /* listing: while there is room and the tensor is sparse so far */      \
                if (m + 32 > p->cap || m > ((base - first) >> 2) + HC_LIST_SLACK)             \
                    idx = NULL;                                                               \
                else                                                                          \
                    m = list_word(t, xi + base, base, idx, raw, m, n - base);                 \
            }                                                                                 \
            if (o && bad < 0)                                                                 \
                bad = base + __builtin_ctz(o);                                                \
        }                                                                                     \
        nnz += bnz;                                                                           \
        uint32_t top = ACC_TOP;                                                               \
        top = tail_top > top ? tail_top : top;                                                \
        float f;                                                                              \
        memcpy(&f, &top, 4);                                                                  \
        p->peaks[b] = top ? (double)f : 0.0;                                                  \
        p->mask[b] = (p->split && top && bnz >= run)                                          \
                         ? split_block(xi + lo, hi - lo, top, p->binades, run) : 0;           \
    }                                                                                         \
    p->bad = bad;                                                                             \
    p->nnz = nnz;                                                                             \
    p->listed = idx ? m : -1;

static void summary_scalar(hc_part *p) {
    HC_BLOCKS(word_scalar(xi + base, 32, &t, &o, &acc), uint32_t, 0, acc)
}

#ifdef HC_X86
__attribute__((target("avx2"))) static inline uint32_t hmax_epu32(__m256i v) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

/* One whole word of 32 values (see word_scalar), four vectors of 8. */
__attribute__((target("avx2"))) static inline void word_avx2(const uint32_t *xi, uint32_t *nz,
                                                             uint32_t *odd, __m256i *acc) {
    const __m256i mag = _mm256_set1_epi32((int)HC_MAG), expo = _mm256_set1_epi32((int)HC_EXPO);
    uint32_t t = 0, o = 0;
    __m256i m = *acc;
    for (int q = 0; q < 4; q++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(xi + 8 * q));
        __m256i a = _mm256_and_si256(v, mag);
        uint32_t zero = (uint32_t)_mm256_movemask_ps(
            _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, _mm256_setzero_si256())));
        uint32_t inf = (uint32_t)_mm256_movemask_ps(
            _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(v, expo), expo)));
        t |= (~zero & 0xFFu) << (8 * q);
        o |= inf << (8 * q);
        m = _mm256_max_epu32(m, a);
    }
    *nz = t;
    *odd = o;
    *acc = m;
}

__attribute__((target("avx2"))) static void summary_avx2(hc_part *p) {
    HC_BLOCKS(word_avx2(xi + base, &t, &o, &acc), __m256i, _mm256_setzero_si256(),
              hmax_epu32(acc))
}
#endif

static void *summary_part(void *arg) {
    hc_part *p = arg;
#ifdef HC_X86
    if (!p->baseline && __builtin_cpu_supports("avx2")) {
        summary_avx2(p);
        return NULL;
    }
#endif
    summary_scalar(p);
    return NULL;
}

#define HC_MAX_THREADS 16

/* Run ``fn`` on parts[0..count): parts 1.. on threads of their own, part 0 on the caller's (a
 * thread that cannot start runs on the caller's too). */
static void run_parts(void *(*fn)(void *), void *parts, size_t size, int64_t count) {
    pthread_t tid[HC_MAX_THREADS];
    int started[HC_MAX_THREADS] = {0};
    for (int64_t i = 1; i < count; i++)
        started[i] = pthread_create(&tid[i], NULL, fn, (char *)parts + i * size) == 0;
    fn(parts);
    for (int64_t i = 1; i < count; i++) {
        if (started[i])
            pthread_join(tid[i], NULL);
        else
            fn((char *)parts + i * size);
    }
}

static int64_t clamp_threads(int64_t threads, int64_t units) {
    if (threads > HC_MAX_THREADS)
        threads = HC_MAX_THREADS;
    if (threads > units)
        threads = units;
    return threads < 1 ? 1 : threads;
}

/* Round 1's reading of x (n float32 values as their bits ``xi``), ``block`` a multiple of 32,
 * with the best loop the CPU runs (``baseline`` 0) or the x86-64 baseline's (1: for the tests),
 * on ``threads`` threads (each a share of the blocks; 1: the caller's alone):
 * the packed non-zero bitmap (``words``, (n + 31) / 32; NaN and Inf count as non-zero), each
 * block's peak magnitude (``peaks``, float64, 0 for an all-zero block), each block's split flag
 * (``mask``, 0 or 1; all 0 unless ``split``), the count of non-zeros (*nnz_out); returns the
 * first non-finite position, or -1. With a non-finite value the peaks and flags are all 0.
 * Returns -2 (and writes nothing) for a block that is not a positive multiple of 32.
 * With ``idx`` (room for ``cap`` values there and in ``raw``), the non-zeros are listed in the
 * same pass, while each value is in a register: their positions in order (idx) and their bits
 * (raw), *listed_out of them; -1 where the pass gave up (more than ``cap``, or some share of
 * the tensor more than a quarter non-zeros): then idx and raw hold nothing. */
int64_t hc_summary_f32(const uint32_t *xi, int64_t n, int64_t block, int64_t binades,
                       int64_t run, int32_t split, uint32_t *words, double *peaks,
                       uint8_t *mask, int64_t *nnz_out, int32_t baseline, int64_t threads,
                       int64_t *idx, uint32_t *raw, int64_t cap, int64_t *listed_out) {
    if (block <= 0 || block % 32)
        return -2;
    int64_t nb = (n + block - 1) / block;
    threads = clamp_threads(threads, nb);
    hc_part parts[HC_MAX_THREADS];
    for (int64_t i = 0; i < threads; i++)
        parts[i] = (hc_part){.xi = xi, .n = n, .block = block, .binades = binades, .run = run,
                             .b0 = nb * i / threads, .b1 = nb * (i + 1) / threads,
                             .split = split, .baseline = baseline, .words = words,
                             .peaks = peaks, .mask = mask, .idx = idx, .raw = raw,
                             .at = cap * i / threads,
                             .cap = cap * (i + 1) / threads - cap * i / threads};
    run_parts(summary_part, parts, sizeof(hc_part), threads);
    int64_t bad = -1, nnz = 0;
    for (int64_t i = 0; i < threads; i++) { /* the parts in order: the first bad is the least */
        if (bad < 0)
            bad = parts[i].bad;
        nnz += parts[i].nnz;
    }
    if (bad >= 0) { /* nothing is scaled */
        memset(peaks, 0, (size_t)nb * sizeof(double));
        memset(mask, 0, (size_t)nb);
    }
    *nnz_out = nnz;
    int64_t listed = idx ? 0 : -1;
    for (int64_t i = 0; i < threads && listed >= 0; i++) { /* each share after the one before */
        if (parts[i].listed < 0) {
            listed = -1;
        } else {
            if (parts[i].at != listed) {
                memmove(idx + listed, idx + parts[i].at, (size_t)parts[i].listed * 8);
                memmove(raw + listed, raw + parts[i].at, (size_t)parts[i].listed * 4);
            }
            listed += parts[i].listed;
        }
    }
    *listed_out = listed;
    return bad;
}

/* ---- the value rounds' per-element work: quantize before, scale back after -------------------
 *
 * hc_quantize_f32 is ``quantize_blocks`` of _jit_blocks.py and _ref.py for float32 (every shift
 * a normal float64's exponent, -1022..1023: the caller checks), hc_scale_i32 ``scale_blocks``
 * for int32 values into float32 or float64. Each value goes through float64 as there: q =
 * rint(x * 2**s) (round half to even, as rint under the default rounding mode), an exact
 * product since 2**s is a power of two and x a float32; the scaled value v * 2**-s rounded once
 * to the output's type. numba's loops run a scalar conversion and a libm rint per element; these
 * run four lanes of AVX2 at a time where the CPU has it (the quantize eight, in float32, where
 * the block's scale is a normal float32), so each is about a memory pass. */

static inline double pow2(int64_t s) { /* 2**s, -1022 <= s <= 1023 */
    union { uint64_t u; double d; } v = {.u = (uint64_t)(s + 1023) << 52};
    return v.d;
}

static inline int quantize_one(float x, double scale, int32_t *out) {
    double q = __builtin_rint((double)x * scale);
    if (!(q >= -2147483648.0 && q <= 2147483647.0)) /* (false for NaN) */
        return 0;
    *out = (int32_t)q;
    return 1;
}

/* whether position i is one of the sorted ``at`` (its own shift, patched afterwards) */
static inline int is_at(const int64_t *at, int64_t nat, int64_t i) {
    int64_t lo = 0, hi = nat;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (at[mid] < i)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < nat && at[lo] == i;
}

/* x[lo:hi) at ``scale``: the first position that does not quantize (and is not in ``at``), or
 * -1 */
static int64_t quantize_scalar(const float *x, int64_t lo, int64_t hi, double scale,
                               const int64_t *at, int64_t nat, int32_t *out) {
    for (int64_t i = lo; i < hi; i++)
        if (!quantize_one(x[i], scale, out + i) && !is_at(at, nat, i))
            return i;
    return -1;
}

#ifdef HC_X86
__attribute__((target("avx2"))) static int64_t quantize_avx2(const float *x, int64_t lo,
                                                              int64_t hi, double scale,
                                                              const int64_t *at, int64_t nat,
                                                              int32_t *out) {
    const __m256d s = _mm256_set1_pd(scale), top = _mm256_set1_pd(2147483647.0),
                  bottom = _mm256_set1_pd(-2147483648.0);
    int64_t i = lo;
    for (; i + 4 <= hi; i += 4) {
        __m256d q = _mm256_round_pd(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i)), s),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256d ok = _mm256_and_pd(_mm256_cmp_pd(q, bottom, _CMP_GE_OQ),
                                   _mm256_cmp_pd(q, top, _CMP_LE_OQ));
        if (_mm256_movemask_pd(ok) != 0xF) {
            int64_t bad = quantize_scalar(x, i, i + 4, scale, at, nat, out);
            if (bad >= 0)
                return bad;
            continue;
        }
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtpd_epi32(q));
    }
    return quantize_scalar(x, i, hi, scale, at, nat, out);
}

/* quantize_avx2 in float32, eight lanes at a time, for a block whose 2**shift is a normal
 * float32 (-126 <= shift <= 127): x * 2**shift is then exact in float32 wherever it is normal,
 * as in float64, and a product too small to be normal rounds to 0 either way, so every word is
 * the float64 loop's. A group of eight with a value out of int32 (or not finite) goes through
 * the scalar loop, in float64, and so does the block's tail. */
__attribute__((target("avx2"))) static int64_t quantize_avx2_f32(const float *x, int64_t lo,
                                                                  int64_t hi, double scale,
                                                                  const int64_t *at,
                                                                  int64_t nat, int32_t *out) {
    const __m256 s = _mm256_set1_ps((float)scale), top = _mm256_set1_ps(2147483648.0f),
                 bottom = _mm256_set1_ps(-2147483648.0f);
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 ok = _mm256_and_ps(_mm256_cmp_ps(q, bottom, _CMP_GE_OQ),
                                  _mm256_cmp_ps(q, top, _CMP_LT_OQ));
        if (_mm256_movemask_ps(ok) != 0xFF) {
            int64_t bad = quantize_scalar(x, i, i + 8, scale, at, nat, out);
            if (bad >= 0)
                return bad;
            continue;
        }
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_cvttps_epi32(q));
    }
    return quantize_scalar(x, i, hi, scale, at, nat, out);
}
#endif

/* Every element of x[0:n) as int32 rint(x * 2**shift), shift its block's (``shifts``, one per
 * ``block`` elements) or, at the sorted positions ``at`` (nat of them), its own
 * (``at_shifts``); returns the first position whose value is not finite or not in int32 there,
 * or -1 (the words are then unspecified from some point on). ``baseline``: the x86-64
 * baseline's loop even where the CPU has AVX2 (the tests check both). */
int64_t hc_quantize_f32(const float *x, int64_t n, const int64_t *shifts, int64_t block,
                        const int64_t *at, const int64_t *at_shifts, int64_t nat,
                        int32_t *out, int32_t baseline) {
    int64_t bad = -1;
#ifdef HC_X86
    int wide = !baseline && __builtin_cpu_supports("avx2");
#endif
    for (int64_t b = 0, lo = 0; lo < n && bad < 0; b++, lo += block) {
        int64_t hi = lo + block < n ? lo + block : n;
#ifdef HC_X86
        int64_t sh = shifts[b];
        bad = !wide ? quantize_scalar(x, lo, hi, pow2(sh), at, nat, out)
              : sh >= -126 && sh <= 127 ? quantize_avx2_f32(x, lo, hi, pow2(sh), at, nat, out)
                                        : quantize_avx2(x, lo, hi, pow2(sh), at, nat, out);
#else
        bad = quantize_scalar(x, lo, hi, pow2(shifts[b]), at, nat, out);
#endif
    }
    for (int64_t k = 0; k < nat && (bad < 0 || at[k] < bad); k++)
        if (!quantize_one(x[at[k]], pow2(at_shifts[k]), out + at[k]))
            return at[k];
    return bad;
}

static void scale_scalar(const int32_t *v, int64_t lo, int64_t hi, double scale, void *out,
                         int32_t f64) {
    if (f64)
        for (int64_t i = lo; i < hi; i++)
            ((double *)out)[i] = (double)v[i] * scale;
    else
        for (int64_t i = lo; i < hi; i++)
            ((float *)out)[i] = (float)((double)v[i] * scale);
}

#ifdef HC_X86
__attribute__((target("avx2"))) static void scale_avx2(const int32_t *v, int64_t lo,
                                                        int64_t hi, double scale, void *out,
                                                        int32_t f64) {
    const __m256d s = _mm256_set1_pd(scale);
    int64_t i = lo;
    for (; i + 4 <= hi; i += 4) {
        __m256d d = _mm256_mul_pd(_mm256_cvtepi32_pd(_mm_loadu_si128((const __m128i *)(v + i))),
                                  s);
        if (f64)
            _mm256_storeu_pd((double *)out + i, d);
        else
            _mm_storeu_ps((float *)out + i, _mm256_cvtpd_ps(d));
    }
    scale_scalar(v, i, hi, scale, out, f64);
}
#endif

/* out[i] = v[i] * scales[i / block], rounded once to float32 (``f64`` 0) or float64 (1). */
void hc_scale_i32(const int32_t *v, int64_t n, const double *scales, int64_t block, void *out,
                  int32_t f64, int32_t baseline) {
#ifdef HC_X86
    int wide = !baseline && __builtin_cpu_supports("avx2");
#endif
    for (int64_t b = 0, lo = 0; lo < n; b++, lo += block) {
        int64_t hi = lo + block < n ? lo + block : n;
#ifdef HC_X86
        if (wide) {
            scale_avx2(v, lo, hi, scales[b], out, f64);
            continue;
        }
#endif
        scale_scalar(v, lo, hi, scales[b], out, f64);
    }
}
