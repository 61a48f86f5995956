/* Attention over one KV head's f16 columns, and the f16 store that writes them (kernels.h).
 * Vectors along the head dimension: AVX-512 where the machine has it, else AVX2. */
#include <math.h>

#include "kernels.h"
#include "simd.h"

void store_f16(uint16_t *dst, const float *src, int n) {     /* round to nearest even */
    for (int i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}

#if defined(__AVX512F__)
typedef __m512 vf;
#define vload _mm512_loadu_ps
#define vfma _mm512_fmadd_ps
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vadd _mm512_add_ps
#define vmul _mm512_mul_ps
#define vstore _mm512_storeu_ps
static inline vf vloadh(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* lane i = the score of column i from its 16 lane sums acc[i]: F_l = acc_l + acc_l+8, then
 * ((F0 + F1) + (F2 + F3)) + ((F4 + F5) + (F6 + F7)), the additions a fold to 256 bits per column
 * and the hadd tree of the AVX2 tree8 below make (the same bits), done for 8 columns at once in
 * 512-bit shuffles: 16 shuffles and 8 adds instead of 22 and 15 (perf-notes §40) */
static inline __m256 tree8(const vf *acc) {
    vf x[4], y[2];
    for (int k = 0; k < 4; k++)   /* lanes 0-7: column 2k's F_l, 8-15: column 2k+1's */
        x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], 0xEE));
    for (int k = 0; k < 2; k++)   /* per 128 bits: F01, F23 (F45, F67) of columns 4k, 4k+2 (4k+1, 4k+3) */
        y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0x88), _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0xDD));
    /* 128-bit blocks: F0123 of columns 0, 2, 4, 6; their F4567; the same for 1, 3, 5, 7 */
    vf z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
    const __m512i lo = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i hi = _mm512_setr_epi32(4, 12, 5, 13, 6, 14, 7, 15, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_add_ps(_mm512_permutexvar_ps(lo, z), _mm512_permutexvar_ps(hi, z)));
}
#else
typedef __m256 vf;
#define vload _mm256_loadu_ps
#define vfma _mm256_fmadd_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vmul _mm256_mul_ps
#define vstore _mm256_storeu_ps
static inline vf vloadh(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* lane i = the sum of the 8 lanes of f[i], by one tree that is the same for every i */
static inline __m256 tree8(const vf *f) {
    __m256 t0 = _mm256_hadd_ps(f[0], f[1]), t1 = _mm256_hadd_ps(f[2], f[3]);
    __m256 t2 = _mm256_hadd_ps(f[4], f[5]), t3 = _mm256_hadd_ps(f[6], f[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* ACCUMULATE(acc, key_e): a column's lane sums of q . k over the head dimension in one order on
 * either width: AVX-512's lanes 0-7 chain the even 8-float chunks of the head dimension and lanes
 * 8-15 the odd ones, which tree8 folds; AVX2 keeps those two chains and adds them, so a score has
 * the same bits on both (tests/test_native_isa.py) */
#if defined(__AVX512F__)
#define ACCUMULATE(acc, key_e)                                                   \
    do {                                                                         \
        acc = vzero();                                                           \
        for (int e = 0; e < dv; e++) acc = vfma(qv[e], key_e, acc);              \
    } while (0)
#else
#define ACCUMULATE(acc, key_e)                                                   \
    do {                                                                         \
        vf chain[2] = {vzero(), vzero()};                                        \
        for (int e = 0; e < dv; e++) chain[e & 1] = vfma(qv[e], key_e, chain[e & 1]); \
        acc = vadd(chain[0], chain[1]);                                          \
    } while (0)
#endif

/* scores of query q (scaled) against 8 columns; each lane's arithmetic is the same wherever its
 * column sits among the 8 */
static inline __m256 scores8(const vf *qv, int dv, const uint16_t *const *k8) {
    vf acc[8];
    for (int i = 0; i < 8; i++) ACCUMULATE(acc[i], vloadh(k8[i] + e * VW));
    return tree8(acc);
}

/* scores8 against 8 columns already converted to float (kf[i * dv + e]): the f16 conversion is
 * exact, so the same bits as scores8 on their f16 keys */
static inline __m256 scores8f(const vf *qv, int dv, const vf *kf) {
    vf acc[8];
    for (int i = 0; i < 8; i++) ACCUMULATE(acc[i], kf[i * dv + e]);
    return tree8(acc);
}

static inline void mask_tail(float *sc, int from, int to) {
    for (int i = from; i < to; i++) sc[i] = -INFINITY;
}

/* work: scores [T, spad], 64-byte alignment slack, accumulators [T, 2, D], queries [T, D],
 * path lengths and 1/z [T] */
size_t attend_work_floats(int tokens, int ctx, int path_len) {
    size_t spad = (size_t)(ctx + path_len + 7) & ~(size_t)7;
    return (size_t)tokens * spad + 16 + (size_t)tokens * (3 * MAX_HEAD_DIM + 2);
}

#define KCOLS 8          /* committed columns whose keys are converted together (one scores8) */
#define VCOLS 16         /* committed columns whose values are converted together */

/* Columns from .. to of a head's f16 values toward L1, while the scores run: a head's KV comes from
 * memory (the weights' stream evicts it between layers), and the values' loads would wait (a head's
 * attention -7% with its KV out of cache; the keys' stream the hardware prefetches well enough:
 * prefetching them too measured no better, perf-notes §40) */
static inline void prefetch_columns(const uint16_t *base, int d, int from, int to) {
    const char *p = (const char *)(base + (int64_t)from * d);
    for (int64_t off = 0; off < (int64_t)(to - from) * d * 2; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

/* The committed columns' scores of every node: per group of 8 columns, the keys converted from
 * f16 once for all nodes where there are several (a node alone reads them straight) */
static inline __attribute__((always_inline)) void committed_scores(const uint16_t *kb, const uint16_t *vb, int d,
                                                                   int dv, int j_start, int ctx, int tokens,
                                                                   const vf *qv, float *scores, int spad,
                                                                   const uint16_t *zero_col) {
    const uint16_t *k8[KCOLS];
    vf kf[KCOLS * MAX_HEAD_DIM / VW];
    for (int j0 = j_start; j0 < ctx; j0 += KCOLS) {
        for (int i = 0; i < KCOLS; i++) k8[i] = j0 + i < ctx ? kb + (int64_t)(j0 + i) * d : zero_col;
        prefetch_columns(vb, d, j0, j0 + KCOLS < ctx ? j0 + KCOLS : ctx);   /* values: wanted after the scores */
        if (tokens == 1) {
            _mm256_storeu_ps(scores + j0, scores8(qv, dv, k8));
            continue;
        }
        for (int i = 0; i < KCOLS; i++)
            for (int e = 0; e < dv; e++) kf[i * dv + e] = vloadh(k8[i] + e * VW);
        for (int t = 0; t < tokens; t++) _mm256_storeu_ps(scores + (size_t)t * spad + j0, scores8f(qv + t * dv, dv, kf));
    }
}

/* a0 (even columns) and a1 (odd) += the values of columns 0 .. jn (x, dv vectors each, in f16 where
 * half, else converted) weighted by sc, columns in order */
static inline __attribute__((always_inline)) void add_columns(const vf *x, const uint16_t *half, int d, int dv,
                                                              const float *sc, int jn, vf *a0, vf *a1) {
    for (int i = 0; i < jn; i += 2) {
        const vf p0 = vset1(sc[i]);
        for (int e = 0; e < dv; e++)
            a0[e] = vfma(p0, half ? vloadh(half + (size_t)i * d + e * VW) : x[(size_t)i * dv + e], a0[e]);
        if (i + 1 == jn) break;
        const vf p1 = vset1(sc[i + 1]);
        for (int e = 0; e < dv; e++)
            a1[e] = vfma(p1, half ? vloadh(half + (size_t)(i + 1) * d + e * VW) : x[(size_t)(i + 1) * dv + e], a1[e]);
    }
}

/* acc[t] (two chains, even and odd columns) += the committed columns' values weighted by node
 * t's softmax numerators, columns in order; per group of VCOLS columns the values converted once
 * for all nodes and each node's accumulators held in registers across the group (a whole group's
 * loop has constant bounds: unrolled, no index arithmetic per vector) */
static inline __attribute__((always_inline)) void committed_values(const uint16_t *vb, int d, int dv, int j_start,
                                                                   int ctx, int tokens, const float *scores,
                                                                   int spad, vf *acc) {
    vf vfb[VCOLS * MAX_HEAD_DIM / VW];
    _Static_assert(VCOLS % 2 == 0 && KCOLS % 2 == 0, "a group starts on an even column");
    for (int j0 = j_start; j0 < ctx; j0 += VCOLS) {
        const int jn = ctx - j0 < VCOLS ? ctx - j0 : VCOLS;
        const uint16_t *half = tokens > 1 ? NULL : vb + (int64_t)j0 * d;
        if (tokens > 1)
            for (int i = 0; i < jn; i++)
                for (int e = 0; e < dv; e++) vfb[i * dv + e] = vloadh(vb + (int64_t)(j0 + i) * d + e * VW);
        for (int t = 0; t < tokens; t++) {             /* j0 is even: column j0 + i is on chain i & 1 */
            vf a0[MAX_HEAD_DIM / VW], a1[MAX_HEAD_DIM / VW];
            vf *at = acc + (size_t)t * 2 * dv;
            for (int e = 0; e < dv; e++) a0[e] = at[e], a1[e] = at[dv + e];
            const float *sc = scores + (size_t)t * spad + j0;
            if (jn == VCOLS && half)
                add_columns(vfb, half, d, dv, sc, VCOLS, a0, a1);
            else if (jn == VCOLS)
                add_columns(vfb, NULL, d, dv, sc, VCOLS, a0, a1);
            else
                add_columns(vfb, half, d, dv, sc, jn, a0, a1);
            for (int e = 0; e < dv; e++) at[e] = a0[e], at[dv + e] = a1[e];
        }
    }
}

/* a node's path columns ctx .. n (its scratch nodes `pt`), scored into sc where the committed
 * tail's padding lanes were */
static inline __attribute__((always_inline)) void path_scores(const uint16_t *kb, int d, int dv, int ctx, int n,
                                                              const int32_t *pt, const vf *qv, float *sc,
                                                              const uint16_t *zero_col) {
    const uint16_t *k8[8];
    for (int j0 = ctx & ~7; j0 < n; j0 += 8) {
        float tmp[8];
        for (int i = 0; i < 8; i++) {
            int j = j0 + i;
            k8[i] = j < ctx ? kb + (int64_t)j * d : (j < n ? kb + (int64_t)(ctx + pt[j - ctx]) * d : zero_col);
        }
        _mm256_storeu_ps(tmp, scores8(qv, dv, k8));
        for (int i = 0; i < 8 && j0 + i < n; i++) if (j0 + i >= ctx) sc[j0 + i] = tmp[i];
    }
}

/* sc[j_start .. n) (padded with -inf to a multiple of 8) -> exp(sc - max), in place; 1 / their sum
 * (summed in 8 lanes, then across them), 0 where there is nothing */
static inline float softmax_weights(float *sc, int j_start, int n) {
    const int npad = (n + 7) & ~7;
    __m256 mx8 = _mm256_set1_ps(-INFINITY);
    for (int j = j_start; j < npad; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sc + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx8), _mm256_extractf128_ps(mx8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    __m256 zsum = _mm256_setzero_ps(), mv = _mm256_set1_ps(n ? _mm_cvtss_f32(m4) : 0.0f);
    int j = j_start;
#if defined(__AVX512F__)
    for (const __m512 mv16 = _mm512_set1_ps(n ? _mm_cvtss_f32(m4) : 0.0f); j + 16 <= npad; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + j), mv16));
        _mm512_storeu_ps(sc + j, e);            /* the sum's 8 lanes take the columns in order, as below */
        zsum = _mm256_add_ps(_mm256_add_ps(zsum, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
    }
#endif
    for (; j < npad; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
        _mm256_storeu_ps(sc + j, e);
        zsum = _mm256_add_ps(zsum, e);
    }
    float z = hsum8(zsum);
    return z > 0.0f ? 1.0f / z : 0.0f;
}

/* All T nodes of one row against one query head: node t's scores sit in sc[t] at the indices of
 * its columns, padded with -inf to a multiple of 8. Each committed column's K and V are loaded
 * and converted once for all T nodes (a tree verify costs about one node's memory traffic, not
 * T). Per node the arithmetic is the same as for a node alone: per-column scores, max, exp, the
 * sum of sc[t] in 8 lanes, the weighted values summed over columns in order, even and odd columns
 * apart (two chains). dv (= d / VW) is a constant where attend_row inlines this, so the loops
 * over a head's vectors unroll and their accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend(const uint16_t *kb, const uint16_t *vb, int d, int dv,
                                                         float scale, float softcap, int window, const int64_t *pos,
                                                         int ctx, const int32_t *paths, int path_len, int tokens,
                                                         const float *q, int ldq, float *out, int ldo, float *work,
                                                         const uint16_t *zero_col) {
    int spad = (ctx + path_len + 7) & ~7;
    float *scores = work;                                     /* [T, spad] */
    vf *acc = (vf *)(work + (size_t)tokens * spad + 16 - ((uintptr_t)(work + (size_t)tokens * spad) / 4) % 16);
    vf *qv = acc + (size_t)tokens * 2 * dv;                    /* [T, dv] */
    int *plen = (int *)(qv + (size_t)tokens * dv);              /* [T] */
    float *zinv = (float *)(plen + tokens);                     /* [T] */
    for (int t = 0; t < tokens; t++) {
        const int32_t *pt = paths + (size_t)t * path_len;
        plen[t] = 0;
        while (plen[t] < path_len && pt[plen[t]] >= 0) plen[t]++;
        for (int e = 0; e < dv; e++) qv[t * dv + e] = vmul(vload(q + (size_t)t * ldq + e * VW), vset1(scale));
    }
    /* a sliding window: columns below j_start are out of every node's window. They are skipped,
     * not computed: a masked column adds exactly 0 to every sum below, so skipping it gives the
     * same bits as masking it, and a node's result does not depend on its batch-mates. */
    int j_start = 0;
    if (window > 0) {
        int64_t lo = pos[0];
        for (int t = 1; t < tokens; t++) lo = pos[t] < lo ? pos[t] : lo;
        lo = lo - window + 1;
        j_start = lo <= 0 ? 0 : (int)(lo < ctx ? lo : ctx) & ~7;
    }
    committed_scores(kb, vb, d, dv, j_start, ctx, tokens, qv, scores, spad, zero_col);
    for (int t = 0; t < tokens; t++) {
        float *sc = scores + (size_t)t * spad;
        const int n = ctx + plen[t];
        path_scores(kb, d, dv, ctx, n, paths + (size_t)t * path_len, qv + t * dv, sc, zero_col);
        if (softcap > 0.0f) {                 /* Gemma-2: scores = cap tanh(scores / cap), before the masks */
            const __m256 cap = _mm256_set1_ps(softcap);
            for (int j = j_start; j < n; j += 8)
                _mm256_storeu_ps(sc + j, _mm256_mul_ps(cap, tanh8(_mm256_div_ps(_mm256_loadu_ps(sc + j), cap))));
        }
        mask_tail(sc, n, (n + 7) & ~7);
        if (window > 0) {                     /* keys at positions <= pos - window */
            int64_t lo = pos[t] - window + 1;
            mask_tail(sc, j_start, lo < n ? (int)lo : n);
        }
        zinv[t] = softmax_weights(sc, j_start, n);
        for (int e = 0; e < 2 * dv; e++) acc[t * 2 * dv + e] = vzero();
    }
    /* weighted values: committed columns shared, then each node's path */
    committed_values(vb, d, dv, j_start, ctx, tokens, scores, spad, acc);
    for (int t = 0; t < tokens; t++) {
        const int32_t *pt = paths + (size_t)t * path_len;
        for (int i = 0; i < plen[t]; i++) {
            int j = ctx + i;
            const uint16_t *v = vb + (int64_t)(ctx + pt[i]) * d;
            vf p = vset1(scores[(size_t)t * spad + j]), *a = acc + (size_t)t * 2 * dv + (j & 1) * dv;
            for (int e = 0; e < dv; e++) a[e] = vfma(p, vloadh(v + e * VW), a[e]);
        }
        float *o = out + (size_t)t * ldo;
        vf inv = vset1(zinv[t]), *a = acc + (size_t)t * 2 * dv;
        for (int e = 0; e < dv; e++) vstore(o + e * VW, vmul(vadd(a[e], a[dv + e]), inv));
    }
}

/* attend() with the head's vector count a constant for the common head sizes (64, 128, 256) */
void attend_row(const uint16_t *kb, const uint16_t *vb, int d, float scale, float softcap, int window,
                const int64_t *pos, int ctx,
                const int32_t *paths, int path_len, int tokens, const float *q, int ldq,
                float *out, int ldo, float *work, const uint16_t *zero_col) {
#define ATTEND(dv) attend(kb, vb, d, dv, scale, softcap, window, pos, ctx, paths, path_len, tokens, q, ldq, out, ldo, \
                          work, zero_col)
    switch (d) {
    case 64: ATTEND(64 / VW); break;
    case 128: ATTEND(128 / VW); break;
    case 256: ATTEND(256 / VW); break;
    default: ATTEND(d / VW); break;
    }
#undef ATTEND
}
