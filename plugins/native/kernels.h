/* The native kernels: the weight block layout, int8 activation blocks, the quantized matmul,
 * attention over one KV head's f16 columns, and the elementwise ops of a Llama layer (kernels.c,
 * attention.c; simd.h has the vector helpers both use). They know no model, layer, cache or step:
 * forward.c composes them into the model's forward (ggml's split of ops from the graph llama.cpp
 * builds per architecture).
 *
 * Weights. Rows are grouped by LANES = 16 outputs; per group and QBLOCK = 32-wide block along K
 * one of the blocks below, the GGUF's own f16 d (and m) with its integers interleaved by lane, so
 * one VNNI instruction (u8 x s8 -> i32) adds 4 products for all 16 outputs of a group at once (8
 * per instruction on AVX2 machines, in two halves) against a broadcast of 4 activation bytes, with
 * no horizontal sums. The bytes read per token equal llama.cpp's for the same file.
 * backend/engine_format.py writes this layout (repack); runtime/native.py checks the sizes at load
 * (sd_abi in forward.c), as ggml-common.h static_asserts its blocks.
 *
 * Activations are quantized per row to int8 blocks of 32 (scale amax/127, as llama.cpp's Q8_1):
 *   y[n] = sum_b d[n,b] * dx[b] * sum_j u[n,b,j] a[b,j] + m[n,b] * dx[b] * sum_j a[b,j]
 * The integer sums are exact; the float sum runs over blocks in order, per output.
 *
 * Numerics: every output value is computed by one thread in one fixed order, so a row's result
 * never depends on the batch, the tree, the thread count or garbage columns (batch invariance by
 * construction, in float32). Compiled with -ffp-contract=off: every fused multiply-add is written
 * out, none is chosen by the compiler differently in two copies of a loop.
 *
 * Threads: matmul, quantize_rows and the *_rows kernels are OpenMP worksharing loops (orphaned
 * `omp for`): every thread of the caller's parallel region calls them, in the same order. The
 * others run on the calling thread.
 */
#ifndef SD_KERNELS_H
#define SD_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#define LANES 16                /* outputs interleaved per weight block */
#define QBLOCK 32               /* elements per block along K (weights and activations) */
#define MAX_HEAD_DIM 256
#if defined(__AVX512F__)
#define VW 16                   /* floats per attention vector; head_dim is a multiple of it */
#else
#define VW 8
#endif

/* the library's own symbols: not exported, never bound to a same-named symbol elsewhere */
#define SD_KERNEL __attribute__((visibility("hidden")))

enum { SD_Q4_1 = 1, SD_Q8_0 = 2 };

/* Q4_1, one group of 16 rows x 32 inputs: w = d * u + m, u in [0, 16). qs[c][i] holds, for lane
 * i, 4 bytes whose low nibbles are elements 4c..4c+3 and high nibbles 16+4c..16+4c+3. */
typedef struct {
    uint16_t d[LANES];                  /* f16 */
    uint16_t m[LANES];                  /* f16 */
    uint8_t qs[QBLOCK / 8][LANES][4];
} block_q4_1x16;

/* Q8_0, one group of 16 rows x 32 inputs: w = d * (u - 128), u = q + 128. qs[c][i] holds
 * elements 4c..4c+3 of lane i. */
typedef struct {
    uint16_t d[LANES];                  /* f16 */
    uint8_t qs[QBLOCK / 4][LANES][4];
} block_q8_0x16;

_Static_assert(sizeof(block_q4_1x16) == LANES * (2 + 2 + QBLOCK / 2), "Q4_1 block: 16 x (d, m, 16 nibble bytes)");
_Static_assert(sizeof(block_q8_0x16) == LANES * (2 + QBLOCK), "Q8_0 block: 16 x (d, 32 bytes)");
_Static_assert(offsetof(block_q4_1x16, qs) == 64 && offsetof(block_q8_0x16, qs) == 32,
               "the integer chunks follow the scales unpadded (64-byte vector loads)");

static inline size_t block_bytes(int type) {
    return type == SD_Q4_1 ? sizeof(block_q4_1x16) : sizeof(block_q8_0x16);
}

typedef struct {
    const uint8_t *data;   /* [rows/16, cols/32] blocks of `type` */
    int32_t type;          /* SD_Q4_1 | SD_Q8_0 */
    int32_t rows;          /* outputs (a multiple of 16) */
    int32_t cols;          /* inputs (a multiple of 32) */
    int32_t pad_;
} sd_matrix;

typedef struct {                         /* a batch of rows quantized to int8 blocks */
    int8_t *q;                           /* [rows, k] */
    float *d;                            /* [rows, k/32] */
    int32_t *sum;                        /* [rows, k/32] */
    int k;
} act_q;

/* ---- activations and matrices (omp for) ----------------------------------------------------- */

/* a->q, d, sum for rows of x [rows, ldx], a->k wide */
SD_KERNEL void quantize_rows(const float *x, int rows, int ldx, act_q *a);
/* y[rows, ldy] = a W^T (+ y when accumulate; + bias [n_out]); only the first n_out outputs stored */
SD_KERNEL void matmul(const sd_matrix *w, const act_q *a, int rows, float *y, int ldy, int n_out,
                      int accumulate, const float *bias);
/* out [w->cols] = row n of w, dequantized (the embedding gather; on the calling thread) */
SD_KERNEL void dequant_row(const sd_matrix *w, int n, float *out);

/* ---- elementwise -------------------------------------------------------------------------- */

/* y = x / rms(x) * w, x [rows, h], rows of y ldy apart; w NULL: y = x */
SD_KERNEL void rmsnorm_rows(const float *x, int rows, int h, const float *w, float eps, float *y, int ldy);
/* dst rows (ldd apart) = src rows (lds apart), h floats each */
SD_KERNEL void copy_rows(const float *src, int lds, float *dst, int ldd, int rows, int h);
/* out [rows, inter] = silu(gate) * up, gu [rows, 2 inter] = [gate | up] */
SD_KERNEL void swiglu_rows(const float *gu, int rows, int inter, float *out);
/* rotary (rotate-half) in place on `heads` vectors of d at v; cos, sin [d/2] of one position */
SD_KERNEL void rope(float *v, int heads, int d, const float *cos, const float *sin);
/* dst [n] f16 = src rounded to nearest even; n a multiple of 8 */
SD_KERNEL void store_f16(uint16_t *dst, const float *src, int n);

/* ---- attention ---------------------------------------------------------------------------- */

/* floats of `work` one attend_row call takes for up to `tokens` nodes, ctx + path_len columns */
SD_KERNEL size_t attend_work_floats(int tokens, int ctx, int path_len);
/* One query head over one row's `tokens` nodes. k, v: the head's KV columns [ctx + scratch, d]
 * f16; node t sees the committed columns [0, ctx) and then its path (paths [tokens, path_len],
 * scratch column ids after ctx, -1 padded), in that order, so a plain step and a verify see the
 * same keys in the same order. q [tokens] rows ldq apart, out likewise ldo apart (d floats each);
 * scale multiplies q; zero_col [MAX_HEAD_DIM] f16 zeros. */
SD_KERNEL void attend_row(const uint16_t *k, const uint16_t *v, int d, float scale, int ctx,
                          const int32_t *paths, int path_len, int tokens, const float *q, int ldq,
                          float *out, int ldo, float *work, const uint16_t *zero_col);

#endif
