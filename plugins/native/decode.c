/* The native CPU decode step: one Llama-family forward over a batch of token trees, straight
 * from GGUF-style 4-bit / 8-bit blocks (built by backend/build/native_engine.py, driven through
 * ctypes by backend/runtime/native.py).
 *
 * Why it exists (docs/perf-notes.md section 12): ONNX Runtime runs our 4-bit graph as ~1400
 * separate kernels, reads ~15% more bytes per token than llama.cpp (fp32 scales, a separate
 * Q4_1 offset pass), and had to cast the whole V cache to float64 each step to keep sums
 * independent of where padding and rejected columns sit. Here each matrix is read once per step
 * in its GGUF block encoding, and every output value is computed by one thread in one fixed
 * order, so a row's result never depends on the batch, the tree, the thread count or garbage
 * columns: batch invariance holds by construction, in float32.
 *
 * Weights. Rows are grouped by 16 outputs ("lanes"); per group and 32-wide block along K:
 *   Q4_1 (320 bytes): 16 x f16 d, 16 x f16 m, then 4 chunks of 64 bytes; chunk c holds, for
 *        lane i, 4 bytes whose low nibbles are elements 4c..4c+3 and high nibbles 16+4c..16+4c+3;
 *        w = d * u + m, u in [0, 16).
 *   Q8_0 (544 bytes): 16 x f16 d, then 8 chunks of 64 bytes; chunk c holds elements 4c..4c+3 of
 *        each lane as u = q + 128; w = d * (u - 128).
 * So one VNNI instruction (u8 x s8 -> i32) adds 4 products for all 16 outputs of a group at once
 * (8 per instruction on AVX2 machines, in two halves) against a broadcast of 4 activation
 * bytes, with no horizontal sums; d and m are the GGUF's own
 * f16 values, so the bytes read per token equal llama.cpp's for the same file.
 *
 * Activations are quantized per row to int8 blocks of 32 (scale amax/127, as llama.cpp's Q8_1):
 *   y[n] = sum_b d[n,b] * dx[b] * sum_j u[n,b,j] a[b,j] + m[n,b] * dx[b] * sum_j a[b,j]
 * The integer sums are exact; the float sum runs over blocks in order, per output.
 *
 * Attention reads each node's committed columns [0, ctx) and then its path of scratch nodes
 * (kv_slots.py), in that order; a plain step and a verify see the same keys in the same order.
 * Compiled with -ffp-contract=off: every fused multiply-add is written out, none is chosen by
 * the compiler differently in two copies of a loop.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define HALF 8
#define QBLOCK 32
#define ROW_TILE 4
#define MAX_HEAD_DIM 256
/* software prefetch distance in the weight stream: the hardware prefetcher alone left T = 1 ~20%
   slower (perf-notes §12); a prefetch never faults, so reading past a matrix's end is harmless */
#define PREFETCH_AHEAD 4096

enum { SD_Q4_1 = 1, SD_Q8_0 = 2 };

typedef struct {
    const uint8_t *data;   /* [rows/16, cols/32, block bytes] */
    int32_t type;          /* SD_Q4_1 | SD_Q8_0 */
    int32_t rows;          /* outputs (a multiple of 16) */
    int32_t cols;          /* inputs (a multiple of 32) */
    int32_t pad_;
} sd_matrix;

typedef struct {
    const float *attn_norm, *mlp_norm;   /* [H] */
    const float *qkv_bias;               /* [(Hq + 2 Hkv) D] or NULL */
    const float *hidden_norm;            /* [H] an EAGLE-3 head's feature norm, else NULL */
    sd_matrix qkv, o, gate_up, down;
} sd_layer;

typedef struct {
    int32_t hidden, inter, num_layers, num_heads, num_kv_heads, head_dim, vocab, max_pos;
    float eps, scale;
    const float *rope_cos, *rope_sin;    /* [max_pos, D/2] */
    const float *norm;                   /* [H] */
    sd_matrix embed, lm_head;            /* embed: gathered one row per token */
    const sd_layer *layers;
    sd_matrix fc;                        /* EAGLE head: x = fc([embed(token), feature]) + fc_bias; */
    const float *fc_bias;                /* fc.data NULL for a plain decoder */
} sd_model;

typedef struct {                         /* a batch of rows quantized to int8 blocks */
    int8_t *q;                           /* [rows, K] */
    float *d;                            /* [rows, K/32] */
    int32_t *sum;                        /* [rows, K/32] */
    int k;
} act_q;

static size_t block_bytes(int type) { return type == SD_Q4_1 ? 320 : 544; }

/* ---- small vector helpers ---------------------------------------------------------------- */

static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    /* portable fallback (no VNNI): the same exact integer sums, one byte at a time */
    uint8_t ub[32];
    int8_t sb[32];
    int32_t r[8];
    _mm256_storeu_si256((__m256i *)ub, u);
    _mm256_storeu_si256((__m256i *)sb, s);
    _mm256_storeu_si256((__m256i *)r, acc);
    for (int i = 0; i < 8; i++)
        for (int e = 0; e < 4; e++) r[i] += (int32_t)ub[4 * i + e] * (int32_t)sb[4 * i + e];
    return _mm256_loadu_si256((const __m256i *)r);
#endif
}

static inline float hsum8(__m256 v) {   /* fixed order: (0+4)+(2+6) + (1+5)+(3+7) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0 (softmax, SiLU of a clamped argument): 2^n * p(f), relative error ~2e-7;
   exact 0 for -inf. Elementwise, so every lane gets the same bits for the same input. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2, in two parts (Cody-Waite) */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 r2 = _mm256_mul_ps(r, r);
    p = _mm256_fmadd_ps(p, r2, r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    p = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(zero_mask, p);
}

/* ---- activations ------------------------------------------------------------------------- */

static void quantize_row(const float *x, int k, int8_t *q, float *d, int32_t *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < k / QBLOCK; b++) {
        const float *xb = x + b * QBLOCK;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);                   /* max is exact in any order */
        float db = amax / 127.0f, id = db > 0.0f ? 127.0f / amax : 0.0f;
        __m256i qi[4];
        for (int i = 0; i < 4; i++)                       /* round to nearest even */
            qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
        __m256i s01 = _mm256_add_epi32(qi[0], qi[1]), s23 = _mm256_add_epi32(qi[2], qi[3]);
        __m256i st = _mm256_add_epi32(s01, s23);
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, st);
        int32_t total = 0;
        for (int i = 0; i < 8; i++) total += lanes[i];
        __m256i p16 = _mm256_packs_epi32(qi[0], qi[1]);   /* in-lane order, fixed below */
        __m256i p16b = _mm256_packs_epi32(qi[2], qi[3]);
        __m256i p8 = _mm256_packs_epi16(p16, p16b);
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * QBLOCK), p8);
        d[b] = db;
        sum[b] = total;
    }
}

static void quantize_rows(const float *x, int rows, int ldx, act_q *a) {
    int nb = a->k / QBLOCK;
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++)
        quantize_row(x + (size_t)r * ldx, a->k, a->q + (size_t)r * a->k, a->d + (size_t)r * nb,
                     a->sum + (size_t)r * nb);
}

/* ---- matrix x activations ---------------------------------------------------------------- */

/* out[r][0..16) = W[group g] . x[r0 + r] for nr <= ROW_TILE rows: a scale term and (Q4_1) an
 * offset term, each summed over blocks in order, added at the end. Several integer and float
 * accumulators keep the dependency chains short (one row alone, T = 1, is otherwise bound by
 * the latency of eight dependent dot instructions per block). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __m512i block_dot16(const __m512i *wv, const int8_t *q) {
    __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int c = 0; c < 8; c++) {
        int32_t f;
        memcpy(&f, q + 4 * c, 4);
        s[c & 1] = _mm512_dpbusd_epi32(s[c & 1], wv[c], _mm512_set1_epi32(f));
    }
    return _mm512_add_epi32(s[0], s[1]);
}

static void group_dot(const sd_matrix *w, int g, const act_q *a, int r0, int nr, float out[][LANES]) {
    int nb = w->cols / QBLOCK, q4 = w->type == SD_Q4_1;
    size_t bb = block_bytes(w->type);
    const uint8_t *blk = w->data + (size_t)g * nb * bb;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 accd[ROW_TILE], accm[ROW_TILE];
    for (int r = 0; r < ROW_TILE; r++) accd[r] = accm[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, blk += bb) {
        for (size_t line = 0; line < bb; line += 64) _mm_prefetch((const char *)blk + PREFETCH_AHEAD + line, _MM_HINT_T0);
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        __m512 mw = _mm512_setzero_ps();
        __m512i wv[8];
        if (q4) {
            mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
            for (int c = 0; c < 4; c++) {
                __m512i v = _mm512_loadu_si512((const void *)(blk + 64 + 64 * c));
                wv[c] = _mm512_and_si512(v, low);
                wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
            for (int c = 0; c < 8; c++) wv[c] = _mm512_loadu_si512((const void *)(blk + 32 + 64 * c));
        }
        for (int r = 0; r < nr; r++) {
            size_t row = (size_t)(r0 + r), at = row * (a->k / QBLOCK) + b;
            __m512i s = block_dot16(wv, a->q + row * a->k + b * QBLOCK);
            float dx = a->d[at];
            if (q4) {
                accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dx * (float)a->sum[at]), accm[r]);
            } else {
                s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * a->sum[at]));
            }
            accd[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), accd[r]);
        }
    }
    for (int r = 0; r < nr; r++) _mm512_storeu_ps(out[r], _mm512_add_ps(accd[r], accm[r]));
}
#else
/* wv[c] holds elements 4c .. 4c+3 of each of 8 lanes (Q4: c < 4 the low nibbles, c >= 4 the high) */
static inline __m256i block_dot8(const __m256i *wv, const int8_t *q) {
    __m256i s[4];
    for (int c = 0; c < 4; c++) {
        int32_t f0, f1;
        memcpy(&f0, q + 4 * c, 4);
        memcpy(&f1, q + 4 * (c + 4), 4);
        s[c] = dot4(_mm256_setzero_si256(), wv[c], _mm256_set1_epi32(f0));
        s[c] = dot4(s[c], wv[c + 4], _mm256_set1_epi32(f1));
    }
    return _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3]));
}

static void group_dot(const sd_matrix *w, int g, const act_q *a, int r0, int nr, float out[][LANES]) {
    int nb = w->cols / QBLOCK, q4 = w->type == SD_Q4_1;
    size_t bb = block_bytes(w->type);
    const __m256i low = _mm256_set1_epi8(15);
    for (int half = 0; half < 2; half++) {            /* lanes 0..7, then 8..15 */
        const uint8_t *blk = w->data + (size_t)g * nb * bb;
        __m256 accd[ROW_TILE], accm[ROW_TILE];
        for (int r = 0; r < ROW_TILE; r++) accd[r] = accm[r] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++, blk += bb) {
            if (half == 0)
                for (size_t line = 0; line < bb; line += 64) _mm_prefetch((const char *)blk + PREFETCH_AHEAD + line, _MM_HINT_T0);
            __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * half)));
            __m256 mw = _mm256_setzero_ps();
            __m256i wv[8];
            if (q4) {
                mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * half)));
                for (int c = 0; c < 4; c++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 + 64 * c + 32 * half));
                    wv[c] = _mm256_and_si256(v, low);
                    wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
            } else {
                for (int c = 0; c < 8; c++) wv[c] = _mm256_loadu_si256((const __m256i *)(blk + 32 + 64 * c + 32 * half));
            }
            for (int r = 0; r < nr; r++) {
                size_t row = (size_t)(r0 + r), at = row * (a->k / QBLOCK) + b;
                __m256i s = block_dot8(wv, a->q + row * a->k + b * QBLOCK);
                float dx = a->d[at];
                if (q4) {
                    accm[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(dx * (float)a->sum[at]), accm[r]);
                } else {
                    s = _mm256_sub_epi32(s, _mm256_set1_epi32(128 * a->sum[at]));
                }
                accd[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), accd[r]);
            }
        }
        for (int r = 0; r < nr; r++) _mm256_storeu_ps(out[r] + HALF * half, _mm256_add_ps(accd[r], accm[r]));
    }
}
#endif

/* y[rows, ldy] = x W^T (+ y when accumulate; + bias), parallel over groups of 8 outputs.
 * Only the first `n_out` outputs are stored (the rest is padding of the last group). */
static void matmul(const sd_matrix *w, const act_q *a, int rows, float *y, int ldy, int n_out,
                   int accumulate, const float *bias) {
    int groups = w->rows / LANES;
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) {
        for (int r0 = 0; r0 < rows; r0 += ROW_TILE) {
            int nr = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            float out[ROW_TILE][LANES];
            group_dot(w, g, a, r0, nr, out);
            for (int r = 0; r < nr; r++) {
                float *yr = y + (size_t)(r0 + r) * ldy + g * LANES;
                for (int i = 0; i < LANES && g * LANES + i < n_out; i++) {
                    float v = out[r][i];
                    if (bias) v = v + bias[g * LANES + i];
                    yr[i] = accumulate ? yr[i] + v : v;
                }
            }
        }
    }
}

/* one row of a blocked matrix, dequantized (the embedding gather) */
static void dequant_row(const sd_matrix *w, int n, float *out) {
    int g = n / LANES, lane = n % LANES, nb = w->cols / QBLOCK;
    size_t bb = block_bytes(w->type);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w->data + ((size_t)g * nb + b) * bb;
        float d = _cvtsh_ss(((const uint16_t *)blk)[lane]);
        for (int j = 0; j < QBLOCK; j++) {
            float v;
            if (w->type == SD_Q4_1) {
                float m = _cvtsh_ss(((const uint16_t *)(blk + 32))[lane]);
                int c = (j % 16) / 4, e = j % 4;
                uint8_t byte = blk[64 + 64 * c + 4 * lane + e];
                int u = j < 16 ? (byte & 15) : (byte >> 4);
                v = d * (float)u + m;
            } else {
                int c = j / 4, e = j % 4;
                v = d * (float)((int)blk[32 + 64 * c + 4 * lane + e] - 128);
            }
            out[b * QBLOCK + j] = v;
        }
    }
}

/* ---- elementwise ------------------------------------------------------------------------- */

/* y = x / rms(x) * w, rows of y `ldy` apart; w NULL: y = x (an EAGLE-1/2 head has no input
 * norm, and no final norm) */
static void rmsnorm_rows(const float *x, int rows, int h, const float *w, float eps, float *y, int ldy) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * h;
        if (!w) {
            if (y != x) memcpy(y + (size_t)r * ldy, xr, sizeof(float) * h);
            continue;
        }
        __m256 ss = _mm256_setzero_ps();
        for (int j = 0; j < h; j += 8) {
            __m256 v = _mm256_loadu_ps(xr + j);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        float inv = 1.0f / sqrtf(hsum8(ss) / (float)h + eps);
        for (int j = 0; j < h; j++) y[(size_t)r * ldy + j] = (xr[j] * inv) * w[j];
    }
}

/* dst rows (ldd apart) = src rows (lds apart), h floats each */
static void copy_rows(const float *src, int lds, float *dst, int ldd, int rows, int h) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) memcpy(dst + (size_t)r * ldd, src + (size_t)r * lds, sizeof(float) * h);
}

static void rope(float *v, int heads, int d, const float *cos, const float *sin) {
    int half = d / 2;
    for (int hh = 0; hh < heads; hh++) {
        float *x = v + hh * d;
        for (int i = 0; i < half; i++) {
            float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * cos[i] - x2 * sin[i];
            x[i + half] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

static void swiglu_rows(const float *gu, int rows, int inter, float *out) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *g = gu + (size_t)r * 2 * inter, *u = g + inter;
        float *o = out + (size_t)r * inter;
        for (int j = 0; j < inter; j += 8) {
            __m256 gv = _mm256_loadu_ps(g + j);
            /* silu(g) = g / (1 + exp(-g)); exp of a positive argument overflows to inf -> 0 */
            __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), gv);
            __m256 big = _mm256_cmp_ps(neg, _mm256_set1_ps(88.0f), _CMP_GT_OQ);
            __m256 e = exp8(_mm256_min_ps(neg, _mm256_set1_ps(88.0f)));
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            s = _mm256_andnot_ps(big, s);
            _mm256_storeu_ps(o + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
        }
    }
}

/* ---- attention --------------------------------------------------------------------------- */

static void store_f16(uint16_t *dst, const float *src, int n) {     /* round to nearest even */
    for (int i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}

typedef struct {
    uint16_t *cache;         /* [layers, 2, slots, Hkv, L, D] f16: llama.cpp's default KV type, half the bytes */
    int64_t slots, cols;     /* slots (incl. the spare), L */
} sd_cache;

static inline uint16_t *kv_at(const sd_cache *c, const sd_model *m, int layer, int kind, int64_t slot,
                           int h, int64_t col) {
    int64_t d = m->head_dim, hkv = m->num_kv_heads;
    return c->cache + ((((int64_t)layer * 2 + kind) * c->slots + slot) * hkv + h) * c->cols * d + col * d;
}

#if defined(__AVX512F__)
typedef __m512 vf;
#define VW 16
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
#define VW 8
#define vload _mm256_loadu_ps
#define vfma _mm256_fmadd_ps
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vadd _mm256_add_ps
#define vmul _mm256_mul_ps
#define vstore _mm256_storeu_ps
static inline __m256 fold(vf v) { return v; }
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
 * column sits among the 8 */
static inline __m256 scores8(const vf *qv, int dv, const uint16_t *const *k8) {
    __m256 f[8];
    for (int i = 0; i < 8; i++) {
        vf acc = vzero();
        for (int e = 0; e < dv; e++) acc = vfma(qv[e], vloadh(k8[i] + e * VW), acc);
        f[i] = fold(acc);
    }
    return sum8x8(f);
}

static inline void mask_tail(float *sc, int from, int to) {
    for (int i = from; i < to; i++) sc[i] = -INFINITY;
}

/* All T nodes of one row against query head qh: node t sees the committed columns [0, ctx)
 * and then its path; its scores sit in sc[t] at those indices, padded with -inf to a multiple
 * of 8. Each committed column's K and V are loaded once for all T nodes (a tree verify costs
 * about one node's memory traffic, not T). Per node the arithmetic is the same as for a node
 * alone: per-column scores, max, exp, the sum of sc[t] in 8 lanes, the weighted values summed
 * over columns in order, even and odd columns apart (two chains). */
static void attend_row(const sd_model *m, const sd_cache *c, int layer, int64_t slot, int ctx,
                       const int32_t *paths, int path_len, int tokens, int qh, const float *qkv, int nqkv,
                       float *out, int ldo, float *work, const uint16_t *zero_col) {
    int d = m->head_dim, grp = m->num_heads / m->num_kv_heads, dv = d / VW, h = qh / grp;
    int spad = (ctx + path_len + 7) & ~7;
    const uint16_t *kb = kv_at(c, m, layer, 0, slot, h, 0), *vb = kv_at(c, m, layer, 1, slot, h, 0);
    float *scores = work;                                     /* [T, spad] */
    vf *acc = (vf *)(work + (size_t)tokens * spad + 16 - ((uintptr_t)(work + (size_t)tokens * spad) / 4) % 16);
    vf *qv = acc + (size_t)tokens * 2 * dv;                    /* [T, dv] */
    int *plen = (int *)(qv + (size_t)tokens * dv);              /* [T] */
    float *zinv = (float *)(plen + tokens);                     /* [T] */
    for (int t = 0; t < tokens; t++) {
        const int32_t *pt = paths + (size_t)t * path_len;
        plen[t] = 0;
        while (plen[t] < path_len && pt[plen[t]] >= 0) plen[t]++;
        for (int e = 0; e < dv; e++) qv[t * dv + e] = vmul(vload(qkv + (size_t)t * nqkv + qh * d + e * VW), vset1(m->scale));
    }
    /* committed columns, 8 at a time, shared by every node */
    const uint16_t *k8[8];
    for (int j0 = 0; j0 < ctx; j0 += 8) {
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
        mask_tail(sc, n, (n + 7) & ~7);
    }
    /* softmax weights per node */
    for (int t = 0; t < tokens; t++) {
        float *sc = scores + (size_t)t * spad;
        int n = ctx + plen[t], npad = (n + 7) & ~7;
        __m256 mx8 = _mm256_set1_ps(-INFINITY);
        for (int j = 0; j < npad; j += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sc + j));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx8), _mm256_extractf128_ps(mx8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        __m256 zsum = _mm256_setzero_ps(), mv = _mm256_set1_ps(n ? _mm_cvtss_f32(m4) : 0.0f);
        for (int j = 0; j < npad; j += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
            _mm256_storeu_ps(sc + j, e);
            zsum = _mm256_add_ps(zsum, e);
        }
        float z = hsum8(zsum);
        zinv[t] = z > 0.0f ? 1.0f / z : 0.0f;
        for (int e = 0; e < 2 * dv; e++) acc[t * 2 * dv + e] = vzero();
    }
    /* weighted values: committed columns shared, then each node's path */
    for (int j = 0; j < ctx; j++) {
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
        float *o = out + (size_t)t * ldo + qh * d;
        vf inv = vset1(zinv[t]), *a = acc + (size_t)t * 2 * dv;
        for (int e = 0; e < dv; e++) vstore(o + e * VW, vmul(vadd(a[e], a[dv + e]), inv));
    }
}

/* ---- the forward ------------------------------------------------------------------------- */

typedef struct {
    int32_t batch, rows, path_len, num_logits, threads, num_features;
    const int32_t *row_start;                  /* [B + 1] the nodes of row b are row_start[b] .. row_start[b+1]
                                                  (rows are ragged: no padding nodes are computed) */
    const int64_t *ids, *pos, *wslot, *wcol;   /* [N] per node */
    const int32_t *paths;                      /* [N, P] scratch node ids, -1 padded */
    const int32_t *ctx, *slots;                /* [B] */
    const int64_t *logit_rows;                 /* [L] nodes that get logits */
    const int32_t *feature_layers;             /* [F] EAGLE-3: these layers' inputs follow in `hidden` */
    const float *features;                     /* [N, H] the target's features (EAGLE head), or NULL */
    float *hidden;                             /* [N, H (1 + F)] out: final-norm features, then each
                                                  feature layer's input; an EAGLE-3 head: [N, H]
                                                  its pre-norm output (its next level's feature) */
    float *logits;                             /* [L, V] out */
} sd_step;

static void *xalloc(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n < 64 ? 64 : n)) return NULL;
    return p;
}

/* Every index sd_forward follows, checked before it writes anything (issue 31): 0, or which
 * field is out of range (runtime/native.py names it in an IndexError). A few ns a node. */
enum { SD_BAD_CACHE = -9, SD_BAD_ROWS = -10, SD_BAD_SLOT = -11, SD_BAD_CTX = -12, SD_BAD_ID = -13,
       SD_BAD_POS = -14, SD_BAD_WSLOT = -15, SD_BAD_WCOL = -16, SD_BAD_PATH = -17,
       SD_BAD_LOGIT_ROW = -18, SD_BAD_FEATURE_LAYER = -19 };

static int check_step(const sd_model *m, const sd_cache *c, const sd_step *s) {
    if (!c->cache || c->slots < 1 || c->cols < 1) return SD_BAD_CACHE;
    if (s->batch < 0 || s->rows < 0 || s->path_len < 1 || s->num_logits < 0 || s->row_start[0] != 0
        || s->row_start[s->batch] != s->rows) return SD_BAD_ROWS;
    for (int b = 0; b < s->batch; b++) {
        if (s->row_start[b + 1] < s->row_start[b]) return SD_BAD_ROWS;
        if (s->slots[b] < 0 || s->slots[b] >= c->slots - 1) return SD_BAD_SLOT;   /* the last: spare */
        if (s->ctx[b] < 0 || s->ctx[b] > c->cols) return SD_BAD_CTX;
        for (int r = s->row_start[b]; r < s->row_start[b + 1]; r++) {
            if (s->ids[r] < 0 || s->ids[r] >= m->embed.rows) return SD_BAD_ID;
            if (s->pos[r] < 0 || s->pos[r] >= m->max_pos) return SD_BAD_POS;
            if (s->wslot[r] < 0 || s->wslot[r] >= c->slots) return SD_BAD_WSLOT;
            if (s->wcol[r] < 0 || s->wcol[r] >= c->cols) return SD_BAD_WCOL;
            for (int k = 0; k < s->path_len; k++) {
                int32_t p = s->paths[(size_t)r * s->path_len + k];
                if (p < -1 || (p >= 0 && (int64_t)s->ctx[b] + p >= c->cols)) return SD_BAD_PATH;
            }
        }
    }
    for (int l = 0; l < s->num_logits; l++)
        if (s->logit_rows[l] < 0 || s->logit_rows[l] >= s->rows) return SD_BAD_LOGIT_ROW;
    for (int f = 0; f < s->num_features; f++)
        if (s->feature_layers[f] < 0 || s->feature_layers[f] >= m->num_layers) return SD_BAD_FEATURE_LAYER;
    return 0;
}

int sd_forward(const sd_model *m, sd_cache *c, const sd_step *s) {
    const int bad = check_step(m, c, s);
    if (bad) return bad;
    const int rows = s->rows, h = m->hidden, d = m->head_dim;
    const int hq = m->num_heads, hkv = m->num_kv_heads, inter = m->inter;
    const int nqkv = (hq + 2 * hkv) * d;
    int kmax = 2 * h > hq * d ? 2 * h : hq * d;   /* 2h: an EAGLE head's fc input */
    kmax = inter > kmax ? inter : kmax;
    const int nrows_logits = s->num_logits;
    /* an EAGLE-3 head: the feature is the residual stream, the attention reads
     * [norm(embedding), norm(feature)] (2h wide) */
    const int eagle3 = m->num_layers > 0 && m->layers[0].hidden_norm != NULL;
    const int nf = s->num_features, hw = h * (1 + nf);
    int max_tokens = 0;
    for (int b = 0; b < s->batch; b++) {
        int n = s->row_start[b + 1] - s->row_start[b];
        max_tokens = n > max_tokens ? n : max_tokens;
    }
    const int arows = rows > nrows_logits ? rows : nrows_logits;
    int max_ctx = 0;
    for (int b = 0; b < s->batch; b++) max_ctx = s->ctx[b] > max_ctx ? s->ctx[b] : max_ctx;
    int threads = s->threads > 0 ? s->threads : 1;

    float *x = xalloc(sizeof(float) * (size_t)rows * h);
    float *hn = xalloc(sizeof(float) * (size_t)arows * h);
    float *qkv = xalloc(sizeof(float) * (size_t)rows * nqkv);
    float *att = xalloc(sizeof(float) * (size_t)rows * hq * d);
    float *gu = xalloc(sizeof(float) * (size_t)rows * 2 * inter);
    float *act = xalloc(sizeof(float) * (size_t)rows * inter);
    float *cat = m->fc.data || eagle3 ? xalloc(sizeof(float) * (size_t)rows * 2 * h) : NULL;
    float *emb = eagle3 ? xalloc(sizeof(float) * (size_t)rows * h) : NULL;
    /* final-norm rows: written straight to `hidden` when that is all it holds */
    float *fin = eagle3 || nf ? xalloc(sizeof(float) * (size_t)rows * h) : s->hidden;
    /* attention work per thread: scores [T, spad], accumulators [T, 2, D], queries [T, D] */
    const int spad = (max_ctx + s->path_len + 7) & ~7;
    const size_t work_len = (size_t)max_tokens * spad + 16 + (size_t)max_tokens * (3 * MAX_HEAD_DIM + 2);
    float *work = xalloc(sizeof(float) * work_len * threads);
    uint16_t *zero_col = xalloc(sizeof(uint16_t) * MAX_HEAD_DIM);
    act_q a = {xalloc((size_t)arows * kmax), xalloc(sizeof(float) * (size_t)arows * kmax / QBLOCK),
               xalloc(sizeof(int32_t) * (size_t)arows * kmax / QBLOCK), h};
    int ok = x && hn && qkv && att && gu && act && work && zero_col && a.q && a.d && a.sum
             && (!m->fc.data || (cat && s->features)) && (!eagle3 || (cat && emb && s->features)) && fin;

    if (ok) memset(zero_col, 0, sizeof(uint16_t) * MAX_HEAD_DIM);
    if (d % VW || d > MAX_HEAD_DIM || h % QBLOCK || inter % QBLOCK || (hq * d) % QBLOCK) ok = 0;
    if (ok) {
#pragma omp parallel num_threads(threads)
        {
            act_q my = a;                    /* this thread's view: the row width changes per stage */
#ifdef _OPENMP
            int me = omp_get_thread_num();
#else
            int me = 0;
#endif
            float *my_work = work + work_len * me;
#pragma omp for schedule(static)
            for (int r = 0; r < rows; r++) dequant_row(&m->embed, (int)s->ids[r], (eagle3 ? emb : x) + (size_t)r * h);
            if (eagle3) {
                copy_rows(s->features, h, x, h, rows, h);
            } else if (m->fc.data) {                       /* EAGLE: fuse each token with its feature */
#pragma omp for schedule(static)
                for (int r = 0; r < rows; r++) {
                    memcpy(cat + (size_t)r * 2 * h, x + (size_t)r * h, sizeof(float) * h);
                    memcpy(cat + (size_t)r * 2 * h + h, s->features + (size_t)r * h, sizeof(float) * h);
                }
                my.k = 2 * h;
                quantize_rows(cat, rows, 2 * h, &my);
                matmul(&m->fc, &my, rows, x, h, h, 0, m->fc_bias);
            }
            for (int l = 0; l < m->num_layers; l++) {
                const sd_layer *L = &m->layers[l];
                for (int f = 0; f < nf; f++)
                    if (s->feature_layers[f] == l) copy_rows(x, h, s->hidden + (size_t)(1 + f) * h, hw, rows, h);
                if (L->hidden_norm) {
                    rmsnorm_rows(emb, rows, h, L->attn_norm, m->eps, cat, 2 * h);
                    rmsnorm_rows(x, rows, h, L->hidden_norm, m->eps, cat + h, 2 * h);
                    my.k = 2 * h;
                    quantize_rows(cat, rows, 2 * h, &my);
                } else {
                    rmsnorm_rows(x, rows, h, L->attn_norm, m->eps, hn, h);
                    my.k = h;
                    quantize_rows(hn, rows, h, &my);
                }
                matmul(&L->qkv, &my, rows, qkv, nqkv, nqkv, 0, L->qkv_bias);
#pragma omp for schedule(static)
                for (int r = 0; r < rows; r++) {          /* rotary, then the new KV to its column */
                    float *qr = qkv + (size_t)r * nqkv;
                    int64_t p = s->pos[r];
                    rope(qr, hq + hkv, d, m->rope_cos + p * (d / 2), m->rope_sin + p * (d / 2));
                    for (int kh = 0; kh < hkv; kh++) {
                        store_f16(kv_at(c, m, l, 0, s->wslot[r], kh, s->wcol[r]), qr + (hq + kh) * d, d);
                        store_f16(kv_at(c, m, l, 1, s->wslot[r], kh, s->wcol[r]), qr + (hq + hkv + kh) * d, d);
                    }
                }
#pragma omp for schedule(dynamic, 1)
                for (int task = 0; task < s->batch * hq; task++) {   /* one query head of one row's nodes */
                    int b = task / hq, qi = task % hq;
                    size_t r0 = (size_t)s->row_start[b];
                    int n = s->row_start[b + 1] - s->row_start[b];
                    if (n > 0)
                        attend_row(m, c, l, s->slots[b], s->ctx[b], s->paths + r0 * s->path_len, s->path_len,
                                   n, qi, qkv + r0 * nqkv, nqkv, att + r0 * hq * d, hq * d, my_work, zero_col);
                }
                my.k = hq * d;
                quantize_rows(att, rows, hq * d, &my);
                matmul(&L->o, &my, rows, x, h, h, 1, NULL);
                rmsnorm_rows(x, rows, h, L->mlp_norm, m->eps, hn, h);
                my.k = h;
                quantize_rows(hn, rows, h, &my);
                matmul(&L->gate_up, &my, rows, gu, 2 * inter, 2 * inter, 0, NULL);
                swiglu_rows(gu, rows, inter, act);
                my.k = inter;
                quantize_rows(act, rows, inter, &my);
                matmul(&L->down, &my, rows, x, h, h, 1, NULL);
            }
            rmsnorm_rows(x, rows, h, m->norm, m->eps, fin, h);
            if (eagle3) copy_rows(x, h, s->hidden, h, rows, h);
            else if (nf) copy_rows(fin, h, s->hidden, hw, rows, h);
#pragma omp for schedule(static)
            for (int i = 0; i < nrows_logits; i++) {
                memcpy(hn + (size_t)i * h, fin + (size_t)s->logit_rows[i] * h, sizeof(float) * h);
            }
            my.k = h;
            quantize_rows(hn, nrows_logits, h, &my);
            matmul(&m->lm_head, &my, nrows_logits, s->logits, m->vocab, m->vocab, 0, NULL);
        }
    }
    free(x); free(hn); free(qkv); free(att); free(gu); free(act); free(work); free(zero_col); free(cat); free(emb);
    if (fin != s->hidden) free(fin);
    free(a.q); free(a.d); free(a.sum);
    return ok ? 0 : -1;
}

/* The binary interface runtime/native.py mirrors with ctypes (the structs above, the block
 * layout build/native_engine.py writes, the weight kinds), checked by Python when it loads the
 * library: a stale or foreign build is refused with a clear message instead of misreading
 * memory. Bump SD_ABI_VERSION when a struct or layout changes meaning without changing size. */
#define SD_ABI_VERSION 1
int sd_abi(int64_t *out, int n) {
    const int64_t v[] = {SD_ABI_VERSION, sizeof(sd_matrix), sizeof(sd_layer), sizeof(sd_model),
                         sizeof(sd_cache), sizeof(sd_step), LANES, QBLOCK, SD_Q4_1, SD_Q8_0,
                         (int64_t)block_bytes(SD_Q4_1), (int64_t)block_bytes(SD_Q8_0)};
    const int count = (int)(sizeof v / sizeof v[0]);
    for (int i = 0; i < n && i < count; i++) out[i] = v[i];
    return count;
}

/* which instruction set this build uses, for the manifest and the build summary */
const char *sd_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512-vnni";
#elif defined(__AVXVNNI__)
    return "avx-vnni";
#else
    return "avx2";
#endif
}

/* y[rows, W.rows] = x W^T for float rows x [rows, W.cols]: the kernel alone, for its tests */
int sd_matmul(const sd_matrix *w, const float *x, int rows, float *y, int threads) {
    int nb = w->cols / QBLOCK;
    act_q a = {xalloc((size_t)rows * w->cols), xalloc(sizeof(float) * (size_t)rows * nb),
               xalloc(sizeof(int32_t) * (size_t)rows * nb), w->cols};
    int ok = a.q && a.d && a.sum && w->cols % QBLOCK == 0 && w->rows % LANES == 0;
    if (ok) {
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
        {
            quantize_rows(x, rows, w->cols, &a);
            matmul(w, &a, rows, y, w->rows, w->rows, 0, NULL);
        }
    }
    free(a.q); free(a.d); free(a.sum);
    return ok ? 0 : -1;
}
