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
 * The integer sums are exact; the float sum runs over blocks in order, per output. "Wide"
 * activations (act_q.wide) add a second int8 row per row, the residual x - dx a quantized the
 * same way, and y is the sum of the two rows' products: the weights are read once (the two rows
 * share a pass over each weight group), the dot products double. A model chooses them per matrix
 * family where int8 alone loses its answers (forward.c sd_model.wide).
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

enum { SD_Q4_1 = 1, SD_Q8_0 = 2, SD_Q5_0 = 3, SD_Q5_1 = 4, SD_Q4_K = 5, SD_Q5_K = 6, SD_Q6_K = 7 };

#define QK_K 256                /* elements per K-quant super-block along K (Q4_K, Q5_K, Q6_K) */

/* Every kind holds its GGUF block's bytes, 16 rows' worth rearranged per block (so a matrix has
 * the GGUF tensor's size, rows padded to 16 aside; Q4_0 is read as Q4_1 with m = -8d). A "chunk"
 * [LANES][4] is 64 bytes: for lane i, 4 consecutive elements 4c..4c+3 of one 32-element
 * (activation) block, one VNNI operand; a "bit plane" is 64 bits, bit 4i+e for byte e of lane i
 * of one chunk (an AVX-512 byte mask as it is; AVX2 expands its 32-bit halves). */

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

/* Q5_0 / Q5_1, one group of 16 rows x 32 inputs: u = low 4 bits | 16 * fifth bit, u in [0, 32);
 * Q5_0 w = d * (u - 16), Q5_1 w = d * u + m. qs as Q4_1's; qh[c] is the bit plane of the fifth
 * bits of elements 4c..4c+3 (c < 8). */
typedef struct {
    uint16_t d[LANES];                  /* f16 */
    uint8_t qh[QBLOCK / 4][8];
    uint8_t qs[QBLOCK / 8][LANES][4];
} block_q5_0x16;

typedef struct {
    uint16_t d[LANES];                  /* f16 */
    uint16_t m[LANES];                  /* f16 */
    uint8_t qh[QBLOCK / 4][8];
    uint8_t qs[QBLOCK / 8][LANES][4];
} block_q5_1x16;

/* Q4_K / Q5_K, one group of 16 rows x 256 inputs (8 sub-blocks of 32): sub-block j of lane i has
 * w = d[i] sc_j * u - dmin[i] m_j, sc_j and m_j 6-bit, packed in the GGUF's 12 bytes per row as
 * it has them, held as 3 little-endian words: scales[w][i] = word w of lane i (the kernel unpacks
 * 16 lanes at once with 32-bit shifts and masks). qs[p][c]: the chunk c of sub-blocks 2p (low
 * nibbles) and 2p+1 (high nibbles): the GGUF's own qs bytes, permuted. Q5_K adds qh[j][c], the bit plane of
 * the fifth bits (u += 16) of chunk c of sub-block j. */
typedef struct {
    uint16_t d[LANES];                  /* f16 */
    uint16_t dmin[LANES];               /* f16 */
    uint32_t scales[3][LANES];
    uint8_t qs[QK_K / 64][QBLOCK / 4][LANES][4];
} block_q4_Kx16;

typedef struct {
    uint16_t d[LANES];                  /* f16 */
    uint16_t dmin[LANES];               /* f16 */
    uint32_t scales[3][LANES];
    uint8_t qh[QK_K / 32][QBLOCK / 4][8];
    uint8_t qs[QK_K / 64][QBLOCK / 4][LANES][4];
} block_q5_Kx16;

/* Q6_K, one group of 16 rows x 256 inputs (16 sub-blocks of 16, two per 32-element block): w =
 * d[i] scales[s][i] * (u - 32), u = low 4 bits | 16 * high 2 bits in [0, 64), scales int8. ql as
 * Q4_K's qs (32-element blocks 2p low nibbles, 2p+1 high); qh[b][h] for block b holds, in byte e
 * of lane i, bits 2k..2k+1 = the high 2 bits of element 4(4h+k)+e (h = 0: sub-block 2b, 1: 2b+1). */
typedef struct {
    uint16_t d[LANES];                  /* f16 */
    int8_t scales[QK_K / 16][LANES];
    uint8_t qh[QK_K / 32][2][LANES][4];
    uint8_t ql[QK_K / 64][QBLOCK / 4][LANES][4];
} block_q6_Kx16;

_Static_assert(sizeof(block_q4_1x16) == LANES * (2 + 2 + QBLOCK / 2), "Q4_1 block: 16 x (d, m, 16 nibble bytes)");
_Static_assert(sizeof(block_q8_0x16) == LANES * (2 + QBLOCK), "Q8_0 block: 16 x (d, 32 bytes)");
_Static_assert(sizeof(block_q5_0x16) == LANES * 22, "Q5_0 block: 16 x GGUF's 22 bytes");
_Static_assert(sizeof(block_q5_1x16) == LANES * 24, "Q5_1 block: 16 x GGUF's 24 bytes");
_Static_assert(sizeof(block_q4_Kx16) == LANES * 144, "Q4_K block: 16 x GGUF's 144 bytes");
_Static_assert(sizeof(block_q5_Kx16) == LANES * 176, "Q5_K block: 16 x GGUF's 176 bytes");
_Static_assert(sizeof(block_q6_Kx16) == LANES * 210, "Q6_K block: 16 x GGUF's 210 bytes");
_Static_assert(offsetof(block_q4_1x16, qs) == 64 && offsetof(block_q8_0x16, qs) == 32,
               "the integer chunks follow the scales unpadded (64-byte vector loads)");
_Static_assert(offsetof(block_q5_0x16, qs) == 96 && offsetof(block_q5_1x16, qs) == 128 &&
               offsetof(block_q4_Kx16, qs) == 256 && offsetof(block_q5_Kx16, qs) == 768 &&
               offsetof(block_q6_Kx16, ql) == 1312, "no padding between the fields");

/* elements along K per block of `type`: QBLOCK, or QK_K for the K-quants */
static inline int block_elems(int type) {
    return type == SD_Q4_K || type == SD_Q5_K || type == SD_Q6_K ? QK_K : QBLOCK;
}

static inline size_t block_bytes(int type) {
    switch (type) {
    case SD_Q4_1: return sizeof(block_q4_1x16);
    case SD_Q8_0: return sizeof(block_q8_0x16);
    case SD_Q5_0: return sizeof(block_q5_0x16);
    case SD_Q5_1: return sizeof(block_q5_1x16);
    case SD_Q4_K: return sizeof(block_q4_Kx16);
    case SD_Q5_K: return sizeof(block_q5_Kx16);
    case SD_Q6_K: return sizeof(block_q6_Kx16);
    default: return 0;
    }
}

/* the layout constants runtime/native.py checks at load (engine_format.kernel_abi mirrors
 * them): LANES, QBLOCK, then each weight kind's id and block bytes; at most 32 values; the count */
SD_KERNEL int kernel_abi(int64_t *out);

typedef struct {
    const uint8_t *data;   /* [rows/16, cols/block_elems(type)] blocks of `type` */
    int32_t type;          /* SD_Q4_1 | SD_Q8_0 | SD_Q5_0 | SD_Q5_1 | SD_Q4_K | SD_Q5_K | SD_Q6_K */
    int32_t rows;          /* outputs (a multiple of 16) */
    int32_t cols;          /* inputs (a multiple of 32; of 256 for the K-quants) */
    int32_t pad_;
} sd_matrix;

typedef struct {                         /* a batch of rows quantized to int8 blocks */
    int8_t *q;                           /* [rows (x2 wide), k] */
    float *d;                            /* [rows (x2 wide), k/32] */
    int32_t *sum;                        /* [rows (x2 wide), k/32] */
    float *dsum;                         /* [rows (x2 wide), k/32] d * sum, the offset kinds' factor */
    int k;
    int wide;                            /* 1: each row is two int8 rows, x's blocks and then the
                                            residual's (x - d q), quantized alike; matmul adds the
                                            two products: ~14 bits of activation instead of 8 */
} act_q;

/* ---- activations and matrices (omp for) ----------------------------------------------------- */

/* a->q, d, sum for rows of x [rows, ldx], a->k wide (a->wide: two int8 rows per row of x) */
SD_KERNEL void quantize_rows(const float *x, int rows, int ldx, act_q *a);
/* y[rows, ldy] = a W^T (+ y when accumulate; + bias [n_out]); only the first n_out outputs stored */
SD_KERNEL void matmul(const sd_matrix *w, const act_q *a, int rows, float *y, int ldy, int n_out,
                      int accumulate, const float *bias);
/* out [w->cols] = row n of w, dequantized (the embedding gather; on the calling thread) */
SD_KERNEL void dequant_row(const sd_matrix *w, int n, float *out);

/* The matmul's integer block dots from now on (amx.h; between forwards only): TILES_OFF on the
 * VNNI path; TILES_AUTO on AMX tiles where the CPU and the OS have them (the process's tile
 * permission is asked for once) for the kinds and row counts where tiles measured faster;
 * TILES_ALWAYS on tiles for every kind and row count (the bitwise tests). Returns the mode in
 * force (TILES_OFF where there are no tiles). */
enum { TILES_OFF = 0, TILES_AUTO = 1, TILES_ALWAYS = 2 };
SD_KERNEL int tiles_select(int mode);

/* ---- elementwise -------------------------------------------------------------------------- */

/* y = x / rms(x) * w, x [rows, h], rows of y ldy apart; w NULL: y = x */
SD_KERNEL void rmsnorm_rows(const float *x, int rows, int h, const float *w, float eps, float *y, int ldy);
/* dst rows (ldd apart) = src rows (lds apart), h floats each */
SD_KERNEL void copy_rows(const float *src, int lds, float *dst, int ldd, int rows, int h);
/* out [rows, inter] = act(gate) * up, gu [rows, 2 inter] = [gate | up]; act: silu, or where
 * gelu_tanh the tanh GELU (Gemma's GeGLU) */
SD_KERNEL void gated_rows(const float *gu, int rows, int inter, int gelu_tanh, float *out);
/* x [rows, h] += t / rms(t) * w: a norm after attention or MLP, added to the residual stream */
SD_KERNEL void add_normed_rows(const float *t, int rows, int h, const float *w, float eps, float *x);
/* each of `heads` vectors of d at v = v / rms(v) * w, w [d] (q/k norms; on the calling thread) */
SD_KERNEL void rmsnorm_heads(float *v, int heads, int d, const float *w, float eps);
/* x [rows, h] *= s (an embedding scale) */
SD_KERNEL void scale_rows(float *x, int rows, int h, float s);
/* the first n of each row of y (ld apart) = cap * tanh(y / cap) (a logit soft-cap) */
SD_KERNEL void softcap_rows(float *y, int rows, int n, int ld, float cap);
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
 * scale multiplies q; softcap > 0: scores = softcap tanh(scores / softcap) before masking
 * (Gemma-2's attention soft-cap; 0: none); zero_col [MAX_HEAD_DIM] f16 zeros. window > 0: node t
 * (at position pos[t]) sees only keys at positions > pos[t] - window, counted along its own path
 * (the j-th key a node sees, committed or on its path, is at position j). */
SD_KERNEL void attend_row(const uint16_t *k, const uint16_t *v, int d, float scale, float softcap, int window,
                          const int64_t *pos, int ctx,
                          const int32_t *paths, int path_len, int tokens, const float *q, int ldq,
                          float *out, int ldo, float *work, const uint16_t *zero_col);

#endif
