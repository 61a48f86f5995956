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
static inline __m256 fold(vf v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
static inline vf vloadh(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
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
#endif

/* lane i = the sum of the 8 lanes of f[i], by one tree that is the same for every i */
static inline __m256 sum8x8(const __m256 *f) {
    __m256 t0 = _mm256_hadd_ps(f[0], f[1]), t1 = _mm256_hadd_ps(f[2], f[3]);
    __m256 t2 = _mm256_hadd_ps(f[4], f[5]), t3 = _mm256_hadd_ps(f[6], f[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* scores of query q (scaled) against 8 columns; each lane's arithmetic is the same wherever its
 * column sits among the 8, and on either width: AVX-512's lanes 0-7 chain the even 8-float chunks
 * of the head dimension and lanes 8-15 the odd ones, then fold; AVX2 keeps those two chains, so a
 * score has the same bits on both (tests/test_native_isa.py) */
static inline __m256 scores8(const vf *qv, int dv, const uint16_t *const *k8) {
    __m256 f[8];
    for (int i = 0; i < 8; i++) {
#if defined(__AVX512F__)
        vf acc = vzero();
        for (int e = 0; e < dv; e++) acc = vfma(qv[e], vloadh(k8[i] + e * VW), acc);
        f[i] = fold(acc);
#else
        __m256 acc[2] = {vzero(), vzero()};
        for (int e = 0; e < dv; e++) acc[e & 1] = vfma(qv[e], vloadh(k8[i] + e * VW), acc[e & 1]);
        f[i] = _mm256_add_ps(acc[0], acc[1]);
#endif
    }
    return sum8x8(f);
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

/* All T nodes of one row against one query head: node t's scores sit in sc[t] at the indices of
 * its columns, padded with -inf to a multiple of 8. Each committed column's K and V are loaded
 * once for all T nodes (a tree verify costs about one node's memory traffic, not T). Per node the
 * arithmetic is the same as for a node alone: per-column scores, max, exp, the sum of sc[t] in 8
 * lanes, the weighted values summed over columns in order, even and odd columns apart (two
 * chains). */
void attend_row(const uint16_t *kb, const uint16_t *vb, int d, float scale, float softcap, int window,
                const int64_t *pos, int ctx,
                const int32_t *paths, int path_len, int tokens, const float *q, int ldq,
                float *out, int ldo, float *work, const uint16_t *zero_col) {
    int dv = d / VW;
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
    /* committed columns, 8 at a time, shared by every node */
    const uint16_t *k8[8];
    for (int j0 = j_start; j0 < ctx; j0 += 8) {
        for (int i = 0; i < 8; i++) k8[i] = j0 + i < ctx ? kb + (int64_t)(j0 + i) * d : zero_col;
        for (int t = 0; t < tokens; t++) _mm256_storeu_ps(scores + (size_t)t * spad + j0, scores8(qv + t * dv, dv, k8));
    }
    /* each node's path columns (they overwrite the committed tail's padding lanes) */
    for (int t = 0; t < tokens; t++) {
        const int32_t *pt = paths + (size_t)t * path_len;
        float *sc = scores + (size_t)t * spad;
        int n = ctx + plen[t];
        int j0 = ctx & ~7;
        for (; j0 < n; j0 += 8) {
            float tmp[8];
            for (int i = 0; i < 8; i++) {
                int j = j0 + i;
                k8[i] = j < ctx ? kb + (int64_t)j * d : (j < n ? kb + (int64_t)(ctx + pt[j - ctx]) * d : zero_col);
            }
            _mm256_storeu_ps(tmp, scores8(qv + t * dv, dv, k8));
            for (int i = 0; i < 8 && j0 + i < n; i++) if (j0 + i >= ctx) sc[j0 + i] = tmp[i];
        }
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
    }
    /* softmax weights per node */
    for (int t = 0; t < tokens; t++) {
        float *sc = scores + (size_t)t * spad;
        int n = ctx + plen[t], npad = (n + 7) & ~7;
        __m256 mx8 = _mm256_set1_ps(-INFINITY);
        for (int j = j_start; j < npad; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sc + j));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx8), _mm256_extractf128_ps(mx8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        __m256 zsum = _mm256_setzero_ps(), mv = _mm256_set1_ps(n ? _mm_cvtss_f32(m4) : 0.0f);
        for (int j = j_start; j < npad; j += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
            _mm256_storeu_ps(sc + j, e);
            zsum = _mm256_add_ps(zsum, e);
        }
        float z = hsum8(zsum);
        zinv[t] = z > 0.0f ? 1.0f / z : 0.0f;
        for (int e = 0; e < 2 * dv; e++) acc[t * 2 * dv + e] = vzero();
    }
    /* weighted values: committed columns shared, then each node's path */
    for (int j = j_start; j < ctx; j++) {
        const uint16_t *v = vb + (int64_t)j * d;
        vf vv[MAX_HEAD_DIM / VW];
        for (int e = 0; e < dv; e++) vv[e] = vloadh(v + e * VW);
        for (int t = 0; t < tokens; t++) {
            vf p = vset1(scores[(size_t)t * spad + j]), *a = acc + (size_t)t * 2 * dv + (j & 1) * dv;
            for (int e = 0; e < dv; e++) a[e] = vfma(p, vv[e], a[e]);
        }
    }
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
