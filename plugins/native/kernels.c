/* The quantized matmul, the activation quantizer and the elementwise kernels of kernels.h (what
 * they compute, the block layout and the numerics are described there); attention is in
 * attention.c. x86-64: AVX-512 VNNI, AVX-VNNI or AVX2, chosen at compile time (-march), and on
 * AVX-512 builds AMX tiles where the CPU has them, chosen at run time (amx.h, tiles_select). */
#define _GNU_SOURCE     /* syscall(): the tile permission request (amx.h) */
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"
#include "simd.h"

/* activation rows per pass over a weight group: 8 on AVX-512 (8 rows' 16 accumulators and the 8
   weight vectors fit its 32 registers; a verify of 4-8 rows or 2-4 wide rows decodes each weight
   block once: T = 8 -15%, wide T = 4 -17%, T = 1 unchanged, perf-notes §21), 4 on AVX2 (16) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define ROW_TILE 8
#else
#define ROW_TILE 4
#endif
_Static_assert(ROW_TILE % 2 == 0, "a tile holds whole pairs of wide activation rows");
/* software prefetch distance in the weight stream: the hardware prefetcher alone left T = 1 ~20%
   slower (perf-notes §12); a prefetch never faults, so reading past a matrix's end is harmless */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif

int kernel_abi(int64_t *out) {
    static const int kinds[] = {SD_Q4_1, SD_Q8_0, SD_Q5_0, SD_Q5_1, SD_Q4_K, SD_Q5_K, SD_Q6_K};
    int count = 0;
    out[count++] = LANES;
    out[count++] = QBLOCK;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        out[count++] = kinds[i];
        out[count++] = (int64_t)block_bytes(kinds[i]);
    }
    return count;
}

/* ---- activations ------------------------------------------------------------------------- */

/* one block of 32: q = round(x / db), db = amax / 127 (0 for an all-zero block), sum = sum q,
   dsum = db * sum (the offset kinds' factor, computed once here instead of per weight group) */
static void quantize_block(const float *xb, int8_t *q, float *d, int32_t *sum, float *dsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
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
    _mm256_storeu_si256((__m256i *)q, p8);
    *d = db;
    *sum = total;
    *dsum = db * (float)total;
}

/* row r of x into int8 row r (narrow) or rows 2r, 2r + 1 (wide: the blocks, then their residuals) */
static void quantize_row(const float *x, int k, int wide, int8_t *q, float *d, int32_t *sum, float *dsum) {
    const int nb = k / QBLOCK;
    for (int b = 0; b < nb; b++) {
        quantize_block(x + b * QBLOCK, q + b * QBLOCK, d + b, sum + b, dsum + b);
        if (!wide) continue;
        float res[QBLOCK];
        const __m256 db = _mm256_set1_ps(d[b]);
        for (int i = 0; i < QBLOCK; i += 8) {      /* x - db q, elementwise (no fused multiply-add) */
            __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + b * QBLOCK + i))));
            _mm256_storeu_ps(res + i, _mm256_sub_ps(_mm256_loadu_ps(x + b * QBLOCK + i), _mm256_mul_ps(db, qf)));
        }
        quantize_block(res, q + k + b * QBLOCK, d + nb + b, sum + nb + b, dsum + nb + b);
    }
}

void quantize_rows(const float *x, int rows, int ldx, act_q *a) {
    const int nb = a->k / QBLOCK, per = 1 + a->wide;
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++)
        quantize_row(x + (size_t)r * ldx, a->k, a->wide, a->q + (size_t)r * per * a->k,
                     a->d + (size_t)r * per * nb, a->sum + (size_t)r * per * nb, a->dsum + (size_t)r * per * nb);
}

/* ---- matrix x activations ---------------------------------------------------------------- */

/* out[r][0..16) = W[group g] . x[r0 + r] for nr <= ROW_TILE rows. Per 32-element block b: s, the
 * exact integer dot of the 16 lanes' unsigned integers u with the row's int8 block, then
 *   acc_d += float(s) * (dw * dx[b])
 *   acc_m += mw * (dx[b] * sum[b])          the offset kinds (Q4_1, Q5_1, Q4_K, Q5_K)
 * dw, mw: the block's f16 d and m, or a K-quant sub-block's d * sc and -(dmin * m) (exact in
 * float: an f16 times a 6-bit integer), the values GGUF's dequantization computes. The zero-point
 * kinds take zero * sum[b] off s (Q8_0: 128, Q5_0: 16). Q6_K: s = sc0 (s0 - 32 sum0) + sc1 (s1 -
 * 32 sum1) over the block's two sub-blocks of 16 (int8 scales; |s| < 2^24, exact in float), dw =
 * the super-block's d. Each accumulator runs over the blocks in order; the two are added at the
 * end. Several integer accumulators keep the dependency chains short (one row alone, T = 1, is
 * otherwise bound by the latency of eight dependent dot instructions per block). A K-quant
 * sub-block reloads its pair's nibble bytes from L1 rather than keep them in registers (faster). */

/* the sum of 16 int8 activations (Q6_K's sub-blocks of 16; act_q has the sums per 32) */
static inline int32_t sum16(const int8_t *q) {
    __m128i v = _mm_xor_si128(_mm_loadu_si128((const __m128i *)q), _mm_set1_epi8((char)0x80));
    __m128i s = _mm_sad_epu8(v, _mm_setzero_si128());          /* two sums of 8 (q + 128) */
    return _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 16 * 128;
}

/* the bytes of `len` weight bytes PREFETCH_AHEAD ahead of p, one prefetch per 64 */
static inline void prefetch_ahead(const uint8_t *p, size_t len) {
    for (size_t line = 0; line < len; line += 64) _mm_prefetch((const char *)p + PREFETCH_AHEAD + line, _MM_HINT_T0);
}

/* The block loops below are written once over a vector of W int32/float lanes: AVX-512 covers a
 * group's 16 lanes in one pass (W = 16), AVX2 in two passes of 8 (W = 8, `pass` picks the half).
 * Each ISA maps the operations to its own intrinsics (as ggml's simd mappings do) and supplies the
 * three helpers that differ in kind, not width: the integer block dot (VNNI dpbusd on 512-bit
 * lanes; dot4 on 256), its two halves, and the fifth-bit planes (a mask add; a byte shuffle).
 * The mapping is one to one, so every output has the bits it had when each ISA had its own copy. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define W 16
typedef __m512i vi;
typedef __m512 vf;
#define vf_zero() _mm512_setzero_ps()
#define vf_set1(x) _mm512_set1_ps(x)
#define vf_add(a, b) _mm512_add_ps(a, b)
#define vf_sub(a, b) _mm512_sub_ps(a, b)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_fmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_of_i32(v) _mm512_cvtepi32_ps(v)
#define vf_store(p, v) _mm512_storeu_ps(p, v)
#define vf_load_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define vi_zero() _mm512_setzero_si512()
#define vi_load(p) _mm512_loadu_si512((const void *)(p))
#define vi_store(p, v) _mm512_storeu_si512((void *)(p), v)
#define vi_load_i8_as_i32(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define vi_set1_8(x) _mm512_set1_epi8(x)
#define vi_set1_32(x) _mm512_set1_epi32(x)
#define vi_and(a, b) _mm512_and_si512(a, b)
#define vi_or(a, b) _mm512_or_si512(a, b)
#define vi_add32(a, b) _mm512_add_epi32(a, b)
#define vi_sub32(a, b) _mm512_sub_epi32(a, b)
#define vi_mul32(a, b) _mm512_mullo_epi32(a, b)
#define vi_srli16(v, n) _mm512_srli_epi16(v, n)
#define vi_slli16(v, n) _mm512_slli_epi16(v, n)
#define vi_srli32(v, n) _mm512_srli_epi32(v, n)

static inline __m512i block_dot(const __m512i *wv, const int8_t *q) {
    __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int c = 0; c < 8; c++) {
        int32_t f;
        memcpy(&f, q + 4 * c, 4);
        s[c & 1] = _mm512_dpbusd_epi32(s[c & 1], wv[c], _mm512_set1_epi32(f));
    }
    return _mm512_add_epi32(s[0], s[1]);
}

/* the dots of elements 0..15 (chunks 0..3) and 16..31 (chunks 4..7) apart */
static inline void block_dot_halves(const __m512i *wv, const int8_t *q, __m512i *s0, __m512i *s1) {
    __m512i s[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int c = 0; c < 8; c++) {
        int32_t f;
        memcpy(&f, q + 4 * c, 4);
        s[(c >> 2) * 2 + (c & 1)] = _mm512_dpbusd_epi32(s[(c >> 2) * 2 + (c & 1)], wv[c], _mm512_set1_epi32(f));
    }
    *s0 = _mm512_add_epi32(s[0], s[1]);
    *s1 = _mm512_add_epi32(s[2], s[3]);
}

/* dpbusd sums the whole u8 range exactly */
static inline __m512i block_dot_u8(const __m512i *wv, const int8_t *q) { return block_dot(wv, q); }

/* u += 16 where the bit plane says (the fifth bits of Q5_0, Q5_1, Q5_K); one pass has all lanes */
static inline void add_planes(__m512i *wv, const uint8_t (*qh)[8], int pass) {
    (void)pass;
    const __m512i c16 = _mm512_set1_epi8(16);
    for (int c = 0; c < 8; c++) {
        __mmask64 k;
        memcpy(&k, qh[c], 8);
        wv[c] = _mm512_mask_add_epi8(wv[c], k, wv[c], c16);
    }
}
#else
#define W 8
typedef __m256i vi;
typedef __m256 vf;
#define vf_zero() _mm256_setzero_ps()
#define vf_set1(x) _mm256_set1_ps(x)
#define vf_add(a, b) _mm256_add_ps(a, b)
#define vf_sub(a, b) _mm256_sub_ps(a, b)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_fmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_of_i32(v) _mm256_cvtepi32_ps(v)
#define vf_store(p, v) _mm256_storeu_ps(p, v)
#define vf_load_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define vi_zero() _mm256_setzero_si256()
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_load_i8_as_i32(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define vi_set1_8(x) _mm256_set1_epi8(x)
#define vi_set1_32(x) _mm256_set1_epi32(x)
#define vi_and(a, b) _mm256_and_si256(a, b)
#define vi_or(a, b) _mm256_or_si256(a, b)
#define vi_add32(a, b) _mm256_add_epi32(a, b)
#define vi_sub32(a, b) _mm256_sub_epi32(a, b)
#define vi_mul32(a, b) _mm256_mullo_epi32(a, b)
#define vi_srli16(v, n) _mm256_srli_epi16(v, n)
#define vi_slli16(v, n) _mm256_slli_epi16(v, n)
#define vi_srli32(v, n) _mm256_srli_epi32(v, n)

/* acc + the 8 sums of 4 products u8 x s8. Without VNNI (AVX2 alone: AMD Zen 1-3, Intel before
   Ice Lake / Alder Lake): pairs by maddubs (u8 x s8 -> i16, saturating), then madd (i16 pairs ->
   i32): exact where a pair fits i16, 2 * 127 * 128 < 32768, so for u <= 127, which every kind's
   weight bytes are but Q8_0's offset bytes (block_dot_u8 splits those). The sums are the VNNI
   dot's, so every output keeps its bits; the byte-at-a-time loop it replaces made the whole
   forward ~10x slower on such machines (perf-notes section 34). */
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* wv[c] holds elements 4c .. 4c+3 of each of 8 lanes (Q4: c < 4 the low nibbles, c >= 4 the high) */
static inline __m256i block_dot(const __m256i *wv, const int8_t *q) {
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

/* the dots of elements 0..15 (chunks 0..3) and 16..31 (chunks 4..7) apart */
static inline void block_dot_halves(const __m256i *wv, const int8_t *q, __m256i *s0, __m256i *s1) {
    __m256i s[4];
    for (int c = 0; c < 2; c++) {
        int32_t f0, f1, f2, f3;
        memcpy(&f0, q + 4 * c, 4);
        memcpy(&f1, q + 4 * (c + 2), 4);
        memcpy(&f2, q + 4 * (c + 4), 4);
        memcpy(&f3, q + 4 * (c + 6), 4);
        s[c] = dot4(dot4(_mm256_setzero_si256(), wv[c], _mm256_set1_epi32(f0)), wv[c + 2], _mm256_set1_epi32(f1));
        s[c + 2] = dot4(dot4(_mm256_setzero_si256(), wv[c + 4], _mm256_set1_epi32(f2)), wv[c + 6], _mm256_set1_epi32(f3));
    }
    *s0 = _mm256_add_epi32(s[0], s[1]);
    *s1 = _mm256_add_epi32(s[2], s[3]);
}

/* block_dot for weight bytes of the whole u8 range (Q8_0's q + 128): where dot4 is exact only for
   u <= 127, u = lo + 128 hi with lo = u & 127 and hi = u >> 7, two exact dots */
static inline __m256i block_dot_u8(const __m256i *wv, const int8_t *q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
    return block_dot(wv, q);
#else
    __m256i lo[8], hi[8];
    for (int c = 0; c < 8; c++) {
        lo[c] = _mm256_and_si256(wv[c], _mm256_set1_epi8(0x7f));
        hi[c] = _mm256_and_si256(_mm256_srli_epi16(wv[c], 7), _mm256_set1_epi8(1));
    }
    return _mm256_add_epi32(block_dot(lo, q), _mm256_slli_epi32(block_dot(hi, q), 7));
#endif
}

/* u += 16 where half `pass` of the bit plane says: bit p of the plane's 32-bit half -> byte p */
static inline void add_planes(__m256i *wv, const uint8_t (*qh)[8], int pass) {
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    for (int c = 0; c < 8; c++) {
        int32_t bits;
        memcpy(&bits, qh[c] + 4 * pass, 4);
        __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread);
        v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
        wv[c] = _mm256_or_si256(wv[c], _mm256_and_si256(v, _mm256_set1_epi8(16)));
    }
}
#endif

static inline vi nib_lo(vi v) { return vi_and(v, vi_set1_8(15)); }
static inline vi nib_hi(vi v) { return vi_and(vi_srli16(v, 4), vi_set1_8(15)); }

/* the offset kinds' rows: w = dw u + mw over block b */
static inline void rows_dm(const vi *wv, vf dw, vf mw, const act_q *a, int r0, int nr, int b, vf *accd, vf *accm) {
    for (int r = 0; r < nr; r++) {
        size_t row = (size_t)(r0 + r), at = row * (a->k / QBLOCK) + b;
        vi s = block_dot(wv, a->q + row * a->k + (size_t)b * QBLOCK);
        float dx = a->d[at];
        accm[r] = vf_fmadd(mw, vf_set1(a->dsum[at]), accm[r]);
        accd[r] = vf_fmadd(vf_of_i32(s), vf_mul(dw, vf_set1(dx)), accd[r]);
    }
}

/* the zero-point kinds' rows: w = dw (u - zero) over block b; u spans 0 .. 2 zero - 1, so Q8_0's
   (zero 128, a constant where inlined) takes block_dot_u8 */
static inline void rows_dz(const vi *wv, vf dw, int zero, const act_q *a, int r0, int nr, int b, vf *accd) {
    for (int r = 0; r < nr; r++) {
        size_t row = (size_t)(r0 + r), at = row * (a->k / QBLOCK) + b;
        const int8_t *q = a->q + row * a->k + (size_t)b * QBLOCK;
        vi s = zero > 64 ? block_dot_u8(wv, q) : block_dot(wv, q);
        float dx = a->d[at];
        s = vi_sub32(s, vi_set1_32(zero * a->sum[at]));
        accd[r] = vf_fmadd(vf_of_i32(s), vf_mul(dw, vf_set1(dx)), accd[r]);
    }
}

/* Q6_K's rows: w = dw sc0 (u - 32) over the first 16 elements of block b, dw sc1 (u - 32) over
 * the last 16 */
static inline void rows_q6(const vi *wv, vi sc0, vi sc1, vf dw, const act_q *a, int r0, int nr, int b, vf *accd) {
    for (int r = 0; r < nr; r++) {
        size_t row = (size_t)(r0 + r), at = row * (a->k / QBLOCK) + b;
        const int8_t *q = a->q + row * a->k + (size_t)b * QBLOCK;
        vi s0, s1;
        block_dot_halves(wv, q, &s0, &s1);
        int32_t lo = sum16(q), hi = a->sum[at] - lo;
        s0 = vi_sub32(s0, vi_set1_32(32 * lo));
        s1 = vi_sub32(s1, vi_set1_32(32 * hi));
        vi s = vi_add32(vi_mul32(s0, sc0), vi_mul32(s1, sc1));
        accd[r] = vf_fmadd(vf_of_i32(s), vf_mul(dw, vf_set1(a->d[at])), accd[r]);
    }
}

/* Q4_K / Q5_K's 8 sub-block scales and mins of W lanes from lane0: byte j of sc[j / 4] (min:
 * mn[j / 4]) */
static inline void unpack_k_scales(const uint32_t (*scales)[LANES], int lane0, vi sc[2], vi mn[2]) {
    vi w0 = vi_load(scales[0] + lane0), w1 = vi_load(scales[1] + lane0), w2 = vi_load(scales[2] + lane0);
    const vi m6 = vi_set1_8(0x3f), m4 = vi_set1_8(0x0f), top = vi_set1_8(0x30);
    sc[0] = vi_and(w0, m6);
    mn[0] = vi_and(w1, m6);
    sc[1] = vi_or(vi_and(w2, m4), vi_and(vi_srli32(w0, 2), top));
    mn[1] = vi_or(vi_and(vi_srli32(w2, 4), m4), vi_and(vi_srli32(w1, 2), top));
}

static inline vf byte_as_float(vi v, int j) {
    return vf_of_i32(vi_and(vi_srli32(v, 8 * (j & 3)), vi_set1_32(0xff)));
}

/* wv[c] = the low nibbles of chunk c, wv[c + 4] its high nibbles (Q4_1, Q5_0, Q5_1's qs) */
static inline void load_nibble_pairs(vi *wv, const uint8_t (*qs)[LANES][4], int lane0) {
    for (int c = 0; c < 4; c++) {
        vi v = vi_load(qs[c][lane0]);
        wv[c] = nib_lo(v);
        wv[c + 4] = nib_hi(v);
    }
}

typedef struct { vf d[ROW_TILE], m[ROW_TILE]; } accw;

#ifndef EXP
#define EXP 0
#endif
#include "amx.h"      /* the tile path (AMX): the same blocks' integer dots on tiles, the same epilogue */

/* a block's rows: on tiles where t (amx.h), else by the VNNI dots above */
static inline void rows_or_tile_dm(tiles *t, const vi *wv, vf dw, vf mw, const act_q *a, int r0, int nr, int b,
                                   accw *acc) {
#if SD_AMX
    if (t) { tile_dm(t, wv, dw, mw, b); return; }
#endif
    rows_dm(wv, dw, mw, a, r0, nr, b, acc->d, acc->m);
}

static inline void rows_or_tile_dz(tiles *t, const vi *wv, vf dw, int zero, const act_q *a, int r0, int nr, int b,
                                   accw *acc) {
#if SD_AMX
    if (t) { tile_dz(t, wv, dw, zero, b); return; }
#endif
    rows_dz(wv, dw, zero, a, r0, nr, b, acc->d);
}

static inline void rows_or_tile_q6(tiles *t, const vi *wv, vi sc0, vi sc1, vf dw, const act_q *a, int r0, int nr,
                                   int b, accw *acc) {
#if SD_AMX
    if (t) { tile_q6(t, wv, sc0, sc1, dw, b); return; }
#endif
    rows_q6(wv, sc0, sc1, dw, a, r0, nr, b, acc->d);
}

/* each over the W lanes of pass `pass` of a group (lanes W pass .. W pass + W-1); pass 0 prefetches.
 * Q4_1, Q8_0, Q5_0, Q5_1: one block of 32 inputs per step (`type` is a constant where inlined) */
static inline void blocks32(const uint8_t *blk, int u0, int u1, int type, int pass, const act_q *a, int r0, int nr,
                            accw *acc, tiles *t) {
    const size_t bb = block_bytes(type);
    const int lane0 = W * pass;
    vi wv[8];
    blk += (size_t)u0 * bb;
    for (int b = u0; b < u1; b++, blk += bb) {
        if (pass == 0) prefetch_ahead(blk, bb);
        if (type == SD_Q4_1) {
            const block_q4_1x16 *B = (const block_q4_1x16 *)blk;
            vf dw = vf_load_f16(B->d + lane0), mw = vf_load_f16(B->m + lane0);
            load_nibble_pairs(wv, B->qs, lane0);
            rows_or_tile_dm(t, wv, dw, mw, a, r0, nr, b, acc);
        } else if (type == SD_Q8_0) {
            const block_q8_0x16 *B = (const block_q8_0x16 *)blk;
            vf dw = vf_load_f16(B->d + lane0);
#if SD_AMX
            if (t) {
                tile_q8(t, B->qs[0][0], dw, b);
                continue;
            }
#endif
            for (int c = 0; c < 8; c++) wv[c] = vi_load(B->qs[c][lane0]);
            rows_or_tile_dz(t, wv, dw, 128, a, r0, nr, b, acc);
        } else if (type == SD_Q5_0) {
            const block_q5_0x16 *B = (const block_q5_0x16 *)blk;
            load_nibble_pairs(wv, B->qs, lane0);
            add_planes(wv, B->qh, pass);
            rows_or_tile_dz(t, wv, vf_load_f16(B->d + lane0), 16, a, r0, nr, b, acc);
        } else {                                       /* SD_Q5_1 */
            const block_q5_1x16 *B = (const block_q5_1x16 *)blk;
            load_nibble_pairs(wv, B->qs, lane0);
            add_planes(wv, B->qh, pass);
            rows_or_tile_dm(t, wv, vf_load_f16(B->d + lane0), vf_load_f16(B->m + lane0), a, r0, nr, b, acc);
        }
    }
}

/* Q4_K / Q5_K: per super-block the 8 sub-blocks' d sc and -dmin m first, then the sub-blocks */
static inline void k_blocks(const uint8_t *blk, int u0, int u1, int q5, int pass, const act_q *a, int r0, int nr,
                            accw *acc, tiles *t) {
    const size_t bb = q5 ? sizeof(block_q5_Kx16) : sizeof(block_q4_Kx16);
    const int lane0 = W * pass;
    vi wv[8];
    blk += (size_t)u0 * bb;
    for (int sb = u0; sb < u1; sb++, blk += bb) {
        const block_q4_Kx16 *k4 = (const block_q4_Kx16 *)blk;
        const block_q5_Kx16 *k5 = (const block_q5_Kx16 *)blk;
        vf d = vf_load_f16((q5 ? k5->d : k4->d) + lane0);
        vf nmin = vf_sub(vf_zero(), vf_load_f16((q5 ? k5->dmin : k4->dmin) + lane0));
        vi sc[2], mn[2];
        unpack_k_scales(q5 ? k5->scales : k4->scales, lane0, sc, mn);
        const uint8_t (*qs)[QBLOCK / 4][LANES][4] = q5 ? k5->qs : k4->qs;
#pragma GCC unroll 8
        for (int j = 0; j < QK_K / QBLOCK; j++) {
            if (pass == 0) prefetch_ahead(blk + j * (bb / 8), bb / 8);
            if (j & 1)
                for (int c = 0; c < 8; c++) wv[c] = nib_hi(vi_load(qs[j >> 1][c][lane0]));
            else
                for (int c = 0; c < 8; c++) wv[c] = nib_lo(vi_load(qs[j >> 1][c][lane0]));
            if (q5) add_planes(wv, k5->qh[j], pass);
            vf dw = vf_mul(d, byte_as_float(sc[j >> 2], j));
            vf mw = vf_mul(nmin, byte_as_float(mn[j >> 2], j));
            rows_or_tile_dm(t, wv, dw, mw, a, r0, nr, sb * (QK_K / QBLOCK) + j, acc);
        }
    }
}

static inline void q6_blocks(const uint8_t *blk, int u0, int u1, int pass, const act_q *a, int r0, int nr,
                             accw *acc, tiles *t) {
    const size_t bb = sizeof(block_q6_Kx16);
    const int lane0 = W * pass;
    const vi top = vi_set1_8(0x30);
    vi wv[8];
    blk += (size_t)u0 * bb;
    for (int sb = u0; sb < u1; sb++, blk += bb) {
        const block_q6_Kx16 *k6 = (const block_q6_Kx16 *)blk;
        vf d = vf_load_f16(k6->d + lane0);
#pragma GCC unroll 8
        for (int b = 0; b < QK_K / QBLOCK; b++) {
            if (pass == 0) prefetch_ahead(blk + b * (bb / 8), bb / 8);
            for (int hh = 0; hh < 2; hh++) {
                vi hv = vi_load(k6->qh[b][hh][lane0]);
                vi hb[4] = {vi_slli16(hv, 4), vi_slli16(hv, 2), hv, vi_srli16(hv, 2)};
                for (int k = 0; k < 4; k++) {
                    int c = 4 * hh + k;
                    vi v = vi_load(k6->ql[b >> 1][c][lane0]);
                    wv[c] = vi_or(b & 1 ? nib_hi(v) : nib_lo(v), vi_and(hb[k], top));
                }
            }
            vi sc0 = vi_load_i8_as_i32(k6->scales[2 * b] + lane0);
            vi sc1 = vi_load_i8_as_i32(k6->scales[2 * b + 1] + lane0);
            rows_or_tile_q6(t, wv, sc0, sc1, d, a, r0, nr, sb * (QK_K / QBLOCK) + b, acc);
        }
    }
}

/* the kind's block loop over group g's blocks u0 .. u1 (of block_elems(type) inputs each) for int8
 * rows r0 .. r0 + nr, one pass of W lanes; t: on tiles */
static inline __attribute__((always_inline)) void kind_blocks(const sd_matrix *w, int g, int u0, int u1, int pass,
                                                              const act_q *a, int r0, int nr, accw *acc, tiles *t) {
    const int type = w->type, nblk = w->cols / block_elems(type);
    const uint8_t *blk = w->data + (size_t)g * nblk * block_bytes(type);
    switch (type) {
    case SD_Q4_1: blocks32(blk, u0, u1, SD_Q4_1, pass, a, r0, nr, acc, t); break;
    case SD_Q8_0: blocks32(blk, u0, u1, SD_Q8_0, pass, a, r0, nr, acc, t); break;
    case SD_Q5_0: blocks32(blk, u0, u1, SD_Q5_0, pass, a, r0, nr, acc, t); break;
    case SD_Q5_1: blocks32(blk, u0, u1, SD_Q5_1, pass, a, r0, nr, acc, t); break;
    case SD_Q4_K: k_blocks(blk, u0, u1, 0, pass, a, r0, nr, acc, t); break;
    case SD_Q5_K: k_blocks(blk, u0, u1, 1, pass, a, r0, nr, acc, t); break;
    case SD_Q6_K: q6_blocks(blk, u0, u1, pass, a, r0, nr, acc, t); break;
    default: break;
    }
}

static void group_dot(const sd_matrix *w, int g, const act_q *a, int r0, int nr, float out[][LANES]) {
    for (int pass = 0; pass < LANES / W; pass++) {
        accw acc;
        for (int r = 0; r < ROW_TILE; r++) acc.d[r] = acc.m[r] = vf_zero();
        kind_blocks(w, g, 0, w->cols / block_elems(w->type), pass, a, r0, nr, &acc, NULL);
        for (int r = 0; r < nr; r++) vf_store(out[r] + W * pass, vf_add(acc.d[r], acc.m[r]));
    }
}

/* y's rows for int8 rows r0 .. r0 + nr of group g from their dots `out` (wide: pairs added) */
static inline void store_rows(const float out[][LANES], const act_q *a, int r0, int nr, int g, float *y, int ldy,
                              int n_out, int accumulate, const float *bias) {
    const int per = 1 + a->wide;
    for (int r = 0; r < nr / per; r++) {
        float *yr = y + (size_t)(r0 / per + r) * ldy + g * LANES;
        for (int i = 0; i < LANES && g * LANES + i < n_out; i++) {
            float v = a->wide ? out[2 * r][i] + out[2 * r + 1][i] : out[r][i];
            if (bias) v = v + bias[g * LANES + i];
            yr[i] = accumulate ? yr[i] + v : v;
        }
    }
}

#if SD_AMX
static void decode_units(const sd_matrix *w, int g, int u0, int u1, tiles *t) {
    kind_blocks(w, g, u0, u1, 0, NULL, 0, 0, NULL, t);
}

/* scratch for one group's decoded blocks (tile weights, scales, where each block's tile is) */
static size_t tile_scratch_bytes(int nblk) { return (size_t)nblk * (512 + sizeof(tile_scales) + sizeof(uint8_t *)); }

static tiles tile_scratch(uint8_t *base, int nblk, int type) {
    return (tiles){(uint8_t (*)[8][64])base, (const uint8_t **)(base + (size_t)nblk * (512 + sizeof(tile_scales))),
                   (tile_scales *)(base + (size_t)nblk * 512),
                   type == SD_Q6_K ? TILE_Q6 : type == SD_Q8_0 || type == SD_Q5_0 ? TILE_DZ : TILE_DM, 0};
}

/* matmul on tiles (amx.h): each thread takes a contiguous range of groups; a group's blocks are
 * decoded into one of two scratches while the previous group's tiles run over the other
 * (tile_rows), then every tile of up to TILE_ROWS int8 rows runs over them; the tiles
 * reconfigured only when a tile's row count differs from the last one's (a ragged last tile). */
static SD_AMX_TARGET void matmul_tiles(const sd_matrix *w, const act_q *a, int arows, float *y, int ldy, int n_out,
                                       int accumulate, const float *bias) {
    const int groups = w->rows / LANES, nblk = w->cols / QBLOCK, units = w->cols / block_elems(w->type);
    const size_t bytes = (tile_scratch_bytes(nblk) + 63) & ~(size_t)63;
    uint8_t raw[2 * bytes + 64];
    uint8_t *base = raw + (64 - (uintptr_t)raw % 64) % 64;
    tiles t[2] = {tile_scratch(base, nblk, w->type), tile_scratch(base + bytes, nblk, w->type)};
    int configured = 0;
#ifdef _OPENMP
    const int team = omp_get_num_threads();
#else
    const int team = 1;
#endif
#pragma omp for schedule(static)
    for (int c = 0; c < team; c++) {           /* one range per thread, as schedule(static) would split */
        const int g0 = (int)((int64_t)groups * c / team), g1 = (int)((int64_t)groups * (c + 1) / team);
        if (g0 < g1) decode_units(w, g0, 0, units, &t[0]);
        for (int g = g0; g < g1; g++) {
            tiles *cur = &t[(g - g0) & 1];
            tile_decoder next = {w, g + 1, 0, g + 1 < g1 ? units : 0, &t[(g - g0 + 1) & 1]};
            for (int r0 = 0; r0 < arows; r0 += TILE_ROWS) {
                const int nr = arows - r0 < TILE_ROWS ? arows - r0 : TILE_ROWS;
                if (nr != configured) tiles_config(configured = nr, w->type == SD_Q6_K);
                float out[TILE_ROWS][LANES];
                tile_rows(cur, a, r0, nr, nblk, out, r0 == 0 ? &next : NULL);
                store_rows(out, a, r0, nr, g, y, ldy, n_out, accumulate, bias);
            }
            decode_next(&next, units);        /* what the rounds left */
        }
    }
    _tile_release();
}
#endif

/* Parallel over groups of LANES outputs; a row's outputs never depend on the other rows. Wide
 * activations: a tile's int8 rows are pairs (ROW_TILE is even), a row's output the pair's sum.
 * On tiles (amx.h) from tile_min_rows int8 rows: the same bits. */
void matmul(const sd_matrix *w, const act_q *a, int rows, float *y, int ldy, int n_out,
            int accumulate, const float *bias) {
    const int groups = w->rows / LANES, arows = rows * (1 + a->wide);
#if SD_AMX
    if (tiles_on && arows >= tile_min_rows(w->type) && w->cols <= TILE_MAX_COLS) {
        matmul_tiles(w, a, arows, y, ldy, n_out, accumulate, bias);
        return;
    }
#endif
#pragma omp for schedule(static)
    for (int g = 0; g < groups; g++) {
        for (int r0 = 0; r0 < arows; r0 += ROW_TILE) {
            int nr = arows - r0 < ROW_TILE ? arows - r0 : ROW_TILE;
            float out[ROW_TILE][LANES];
            group_dot(w, g, a, r0, nr, out);
            store_rows(out, a, r0, nr, g, y, ldy, n_out, accumulate, bias);
        }
    }
}

/* bit (4 lane + e) of bit plane `plane`: the fifth bit of element 4c+e */
static inline int plane_bit(const uint8_t *plane, int lane, int e) {
    int p = 4 * lane + e;
    return (plane[p >> 3] >> (p & 7)) & 1;
}

/* Q4_K / Q5_K sub-block j's 6-bit scale and min of one lane (the GGUF's packing, kernels.h) */
static inline void k_scale_min(const uint32_t (*scales)[LANES], int lane, int j, int *sc, int *mn) {
    uint8_t s[12];
    for (int w = 0; w < 3; w++) memcpy(s + 4 * w, &scales[w][lane], 4);
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Each value as GGUF's dequantization computes it in float32 (gguf.quants, ggml-quants.c):
 * Q4_1/Q5_1 d u + m; Q8_0/Q5_0 d (u - zero); Q4_K/Q5_K (d sc) u - (dmin m); Q6_K (d sc) (u - 32). */
void dequant_row(const sd_matrix *w, int n, float *out) {
    const int type = w->type, g = n / LANES, lane = n % LANES, nblk = w->cols / block_elems(type);
    const uint8_t *base = w->data + (size_t)g * nblk * block_bytes(type);
    for (int b = 0; b < nblk; b++) {
        const uint8_t *blk = base + (size_t)b * block_bytes(type);
        if (type == SD_Q4_1) {
            const block_q4_1x16 *B = (const block_q4_1x16 *)blk;
            float d = _cvtsh_ss(B->d[lane]), m = _cvtsh_ss(B->m[lane]);
            for (int j = 0; j < QBLOCK; j++) {
                uint8_t byte = B->qs[(j % 16) / 4][lane][j % 4];
                int u = j < 16 ? (byte & 15) : (byte >> 4);
                *out++ = d * (float)u + m;
            }
        } else if (type == SD_Q8_0) {
            const block_q8_0x16 *B = (const block_q8_0x16 *)blk;
            float d = _cvtsh_ss(B->d[lane]);
            for (int j = 0; j < QBLOCK; j++) *out++ = d * (float)((int)B->qs[j / 4][lane][j % 4] - 128);
        } else if (type == SD_Q5_0 || type == SD_Q5_1) {
            const block_q5_0x16 *B0 = (const block_q5_0x16 *)blk;
            const block_q5_1x16 *B1 = (const block_q5_1x16 *)blk;
            const int q51 = type == SD_Q5_1;
            const uint8_t (*qs)[LANES][4] = q51 ? B1->qs : B0->qs;
            const uint8_t (*qh)[8] = q51 ? B1->qh : B0->qh;
            float d = _cvtsh_ss(q51 ? B1->d[lane] : B0->d[lane]), m = q51 ? _cvtsh_ss(B1->m[lane]) : 0.0f;
            for (int j = 0; j < QBLOCK; j++) {
                uint8_t byte = qs[(j % 16) / 4][lane][j % 4];
                int u = (j < 16 ? (byte & 15) : (byte >> 4)) | plane_bit(qh[j / 4], lane, j % 4) << 4;
                *out++ = q51 ? d * (float)u + m : d * (float)(u - 16);
            }
        } else if (type == SD_Q4_K || type == SD_Q5_K) {
            const block_q4_Kx16 *K4 = (const block_q4_Kx16 *)blk;
            const block_q5_Kx16 *K5 = (const block_q5_Kx16 *)blk;
            const int q5 = type == SD_Q5_K;
            float d = _cvtsh_ss(q5 ? K5->d[lane] : K4->d[lane]), dmin = _cvtsh_ss(q5 ? K5->dmin[lane] : K4->dmin[lane]);
            const uint8_t (*qs)[QBLOCK / 4][LANES][4] = q5 ? K5->qs : K4->qs;
            for (int j = 0; j < QK_K / QBLOCK; j++) {
                int sc, mn;
                k_scale_min(q5 ? K5->scales : K4->scales, lane, j, &sc, &mn);
                float d1 = d * (float)sc, m1 = dmin * (float)mn;
                for (int l = 0; l < QBLOCK; l++) {
                    uint8_t byte = qs[j / 2][l / 4][lane][l % 4];
                    int u = j & 1 ? byte >> 4 : byte & 15;
                    if (q5) u |= plane_bit(K5->qh[j][l / 4], lane, l % 4) << 4;
                    *out++ = d1 * (float)u - m1;
                }
            }
        } else if (type == SD_Q6_K) {
            const block_q6_Kx16 *K6 = (const block_q6_Kx16 *)blk;
            float d = _cvtsh_ss(K6->d[lane]);
            for (int bq = 0; bq < QK_K / QBLOCK; bq++)
                for (int l = 0; l < QBLOCK; l++) {
                    int c = l / 4, e = l % 4;
                    uint8_t byte = K6->ql[bq / 2][c][lane][e];
                    int u = (bq & 1 ? byte >> 4 : byte & 15) | ((K6->qh[bq][c / 4][lane][e] >> (2 * (c % 4))) & 3) << 4;
                    float d1 = d * (float)K6->scales[2 * bq + l / 16][lane];
                    *out++ = d1 * (float)(u - 32);
                }
        }
    }
}

/* out [w->cols] = row n of w, dequantized: dequant_row alone, exported for the tests (the
 * library's entry points are otherwise forward.c's); -1 for a row or kind it does not have */
int sd_dequant_row(const sd_matrix *w, int n, float *out) {
    if (n < 0 || n >= w->rows || block_bytes(w->type) == 0 || w->cols % block_elems(w->type)) return -1;
    dequant_row(w, n, out);
    return 0;
}

/* ---- elementwise ------------------------------------------------------------------------- */

/* 1 / rms(x) over n floats (n a multiple of 8): one sum order for every norm kernel */
static inline float inv_rms(const float *x, int n, float eps) {
    __m256 ss = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    return 1.0f / sqrtf(hsum8(ss) / (float)n + eps);
}

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
        float inv = inv_rms(xr, h, eps);
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

/* x [rows, h] += t / rms(t) * w (Gemma's norms after attention and MLP) */
void add_normed_rows(const float *t, int rows, int h, const float *w, float eps, float *x) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *tr = t + (size_t)r * h;
        float *xr = x + (size_t)r * h;
        float inv = inv_rms(tr, h, eps);
        for (int j = 0; j < h; j++) xr[j] = xr[j] + (tr[j] * inv) * w[j];
    }
}

void rmsnorm_heads(float *v, int heads, int d, const float *w, float eps) {
    for (int hh = 0; hh < heads; hh++) {
        float *x = v + (size_t)hh * d;
        float inv = inv_rms(x, d, eps);
        for (int j = 0; j < d; j++) x[j] = (x[j] * inv) * w[j];
    }
}

void scale_rows(float *x, int rows, int h, float s) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < h; j++) x[(size_t)r * h + j] *= s;
}

void softcap_rows(float *y, int rows, int n, int ld, float cap) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        float *yr = y + (size_t)r * ld;
        int j = 0;
        for (; j + 8 <= n; j += 8)
            _mm256_storeu_ps(yr + j, _mm256_mul_ps(_mm256_set1_ps(cap),
                             tanh8(_mm256_div_ps(_mm256_loadu_ps(yr + j), _mm256_set1_ps(cap)))));
        for (; j < n; j++) yr[j] = cap * tanhf(yr[j] / cap);
    }
}

/* gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Gemma's GeGLU) */
static inline __m256 gelu_tanh8(__m256 x) {
    const __m256 c = _mm256_set1_ps(0.7978845608028654f), k = _mm256_set1_ps(0.044715f), half = _mm256_set1_ps(0.5f);
    __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    __m256 inner = _mm256_mul_ps(c, _mm256_add_ps(x, _mm256_mul_ps(k, x3)));
    return _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(_mm256_set1_ps(1.0f), tanh8(inner)));
}

/* silu(g) = g / (1 + exp(-g)); exp of a positive argument overflows to inf -> 0 */
static inline __m256 silu8(__m256 gv) {
    __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), gv);
    __m256 big = _mm256_cmp_ps(neg, _mm256_set1_ps(88.0f), _CMP_GT_OQ);
    __m256 e = exp8(_mm256_min_ps(neg, _mm256_set1_ps(88.0f)));
    return _mm256_andnot_ps(big, _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
}

void gated_rows(const float *gu, int rows, int inter, int gelu_tanh, float *out) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *g = gu + (size_t)r * 2 * inter, *u = g + inter;
        float *o = out + (size_t)r * inter;
        for (int j = 0; j < inter; j += 8) {
            __m256 x = _mm256_loadu_ps(g + j);
            _mm256_storeu_ps(o + j, _mm256_mul_ps(gelu_tanh ? gelu_tanh8(x) : silu8(x), _mm256_loadu_ps(u + j)));
        }
    }
}
