/* The quantized matmul, the activation quantizer and the elementwise kernels of kernels.h (what
 * they compute, the block layout and the numerics are described there); attention is in
 * attention.c. x86-64: AVX-512 VNNI, AVX-VNNI or AVX2, chosen at compile time (-march). */
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define HALF 8                  /* lanes per AVX2 half of a group */
#define ROW_TILE 4              /* activation rows per pass over a weight group */
/* software prefetch distance in the weight stream: the hardware prefetcher alone left T = 1 ~20%
   slower (perf-notes §12); a prefetch never faults, so reading past a matrix's end is harmless */
#define PREFETCH_AHEAD 4096

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

void quantize_rows(const float *x, int rows, int ldx, act_q *a) {
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
        const block_q4_1x16 *b4 = (const block_q4_1x16 *)blk;
        const block_q8_0x16 *b8 = (const block_q8_0x16 *)blk;
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(q4 ? b4->d : b8->d)));
        __m512 mw = _mm512_setzero_ps();
        __m512i wv[8];
        if (q4) {
            mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b4->m));
            for (int c = 0; c < 4; c++) {
                __m512i v = _mm512_loadu_si512((const void *)b4->qs[c]);
                wv[c] = _mm512_and_si512(v, low);
                wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
            for (int c = 0; c < 8; c++) wv[c] = _mm512_loadu_si512((const void *)b8->qs[c]);
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
/* acc + the 8 sums of 4 products u8 x s8 */
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
            const block_q4_1x16 *b4 = (const block_q4_1x16 *)blk;
            const block_q8_0x16 *b8 = (const block_q8_0x16 *)blk;
            __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((q4 ? b4->d : b8->d) + HALF * half)));
            __m256 mw = _mm256_setzero_ps();
            __m256i wv[8];
            if (q4) {
                mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b4->m + HALF * half)));
                for (int c = 0; c < 4; c++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)b4->qs[c][HALF * half]);
                    wv[c] = _mm256_and_si256(v, low);
                    wv[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
            } else {
                for (int c = 0; c < 8; c++) wv[c] = _mm256_loadu_si256((const __m256i *)b8->qs[c][HALF * half]);
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

/* Parallel over groups of LANES outputs; a row's outputs never depend on the other rows. */
void matmul(const sd_matrix *w, const act_q *a, int rows, float *y, int ldy, int n_out,
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

void dequant_row(const sd_matrix *w, int n, float *out) {
    int g = n / LANES, lane = n % LANES, nb = w->cols / QBLOCK;
    for (int b = 0; b < nb; b++, out += QBLOCK) {
        if (w->type == SD_Q4_1) {
            const block_q4_1x16 *blk = (const block_q4_1x16 *)w->data + (size_t)g * nb + b;
            float d = _cvtsh_ss(blk->d[lane]), m = _cvtsh_ss(blk->m[lane]);
            for (int j = 0; j < QBLOCK; j++) {
                uint8_t byte = blk->qs[(j % 16) / 4][lane][j % 4];
                int u = j < 16 ? (byte & 15) : (byte >> 4);
                out[j] = d * (float)u + m;
            }
        } else {
            const block_q8_0x16 *blk = (const block_q8_0x16 *)w->data + (size_t)g * nb + b;
            float d = _cvtsh_ss(blk->d[lane]);
            for (int j = 0; j < QBLOCK; j++) out[j] = d * (float)((int)blk->qs[j / 4][lane][j % 4] - 128);
        }
    }
}

/* ---- elementwise ------------------------------------------------------------------------- */

/* y = x / rms(x) * w, rows of y `ldy` apart; w NULL: y = x (an EAGLE-1/2 head has no input
 * norm, and no final norm) */
void rmsnorm_rows(const float *x, int rows, int h, const float *w, float eps, float *y, int ldy) {
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
void copy_rows(const float *src, int lds, float *dst, int ldd, int rows, int h) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) memcpy(dst + (size_t)r * ldd, src + (size_t)r * lds, sizeof(float) * h);
}

void rope(float *v, int heads, int d, const float *cos, const float *sin) {
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

void swiglu_rows(const float *gu, int rows, int inter, float *out) {
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
