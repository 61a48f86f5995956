/* The tile path: the quantized matmul's integer block dots on AMX tiles (Intel Sapphire Rapids
 * and later), everything else as the VNNI path computes it. Included by kernels.c only, after its
 * W = 16 vector mapping (every AMX CPU has AVX-512).
 *
 * One TDPBSUD multiplies a tile of up to 16 int8 activation rows x 32 bytes (one 32-element block
 * of each row, loaded straight from act_q with the row stride) by a 8 x 64-byte unsigned weight
 * tile: row c of it is chunk c of the block, lane i's 4 consecutive elements 4c..4c+3, which is
 * exactly the kernel's decoded weight vector wv[c] (kernels.h). The result is the exact int32 dot
 * of every row and lane, the same integers block_dot computes with 8 VNNI instructions per row,
 * for all 16 rows at once (8,192 products against 64 per VNNI instruction). The float epilogue
 * per block (rows_dm / rows_dz / rows_q6 in kernels.c) is applied to those integers in the same
 * order with the same operations, so every output has the VNNI path's bits (tested per block
 * kind, wide and narrow, ragged rows, 1 and 2 threads: tests/test_native_amx.py).
 *
 * Scales stay per 32-element block (the K-quants' sub-blocks; Q6_K's halves of 16 take their own
 * pair of half tiles), so a tile dot never mixes two blocks' integers: that is what keeps the bits.
 *
 * Linux gives a process the tile state only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); before that the first tile instruction dies with SIGILL. tiles_select asks
 * once, after CPUID and XCR0 say the CPU and the OS have AMX-TILE and AMX-INT8.
 */
#ifndef SD_AMX_H
#define SD_AMX_H

#if W == 16 && defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)
#define SD_AMX 1
#else
#define SD_AMX 0
#endif

#if SD_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SD_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#define TILE_ROWS 16            /* int8 rows per tile (whole pairs of wide rows) */
/* from how many int8 rows a matmul runs on tiles: 1 and 2 rows (a plain step, narrow or wide)
   measured faster on tiles too (perf-notes §25) */
#define TILE_MIN_ROWS 1

static int tiles_on;            /* set by tiles_select between forwards, read by matmul */

/* tiles: 0 the dots (C), 1 the activations (A, 32 bytes a row), 2 the weights (B, 8 rows);
   Q6_K's halves: 3 the second dots, 4 and 5 the activation halves (16 bytes), 6 and 7 the weight
   halves (4 rows) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static SD_AMX_TARGET void tiles_config(int m) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const uint8_t rows[8] = {(uint8_t)m, (uint8_t)m, 8, (uint8_t)m, (uint8_t)m, (uint8_t)m, 4, 4};
    const uint16_t colsb[8] = {64, 32, 64, 64, 16, 16, 64, 64};
    for (int i = 0; i < 8; i++) c.rows[i] = rows[i], c.colsb[i] = colsb[i];
    /* not _tile_loadconfig: GCC 12's macro names only the first 8 bytes as read, and the stores
       of the rest are dropped as dead; the whole struct is the operand here */
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

/* one thread's tile scratch for one group and up to TILE_ROWS rows: the decoded weight tile, the
   dots, the accumulators (the VNNI path's acc.d / acc.m, one per row) */
typedef struct {
    _Alignas(64) uint8_t w[8][64];
    _Alignas(64) int32_t s[2][TILE_ROWS][LANES];
    vf d[TILE_ROWS], m[TILE_ROWS];
} tiles;

/* t->s[0] = the exact dots of rows r0 .. r0 + nr (the tile config's rows) with block b's wv */
static inline SD_AMX_TARGET void tile_dots(tiles *t, const vi *wv, const act_q *a, int r0, int b) {
    for (int c = 0; c < 8; c++) _mm512_store_si512(t->w[c], wv[c]);
    _tile_loadd(2, t->w, 64);
    _tile_loadd(1, a->q + (size_t)r0 * a->k + (size_t)b * QBLOCK, a->k);
    _tile_zero(0);
    _tile_dpbsud(0, 1, 2);
    _tile_stored(0, t->s[0], 64);
}

/* rows_dm on tiles */
static inline SD_AMX_TARGET void tile_dm(tiles *t, const vi *wv, vf dw, vf mw, const act_q *a, int r0, int nr,
                                         int b) {
    tile_dots(t, wv, a, r0, b);
    for (int r = 0; r < nr; r++) {
        size_t at = (size_t)(r0 + r) * (a->k / QBLOCK) + b;
        float dx = a->d[at];
        t->m[r] = vf_fmadd(mw, vf_set1(dx * (float)a->sum[at]), t->m[r]);
        t->d[r] = vf_fmadd(vf_of_i32(vi_load(t->s[0][r])), vf_mul(dw, vf_set1(dx)), t->d[r]);
    }
}

/* rows_dz on tiles */
static inline SD_AMX_TARGET void tile_dz(tiles *t, const vi *wv, vf dw, int zero, const act_q *a, int r0, int nr,
                                         int b) {
    tile_dots(t, wv, a, r0, b);
    for (int r = 0; r < nr; r++) {
        size_t at = (size_t)(r0 + r) * (a->k / QBLOCK) + b;
        vi s = vi_sub32(vi_load(t->s[0][r]), vi_set1_32(zero * a->sum[at]));
        t->d[r] = vf_fmadd(vf_of_i32(s), vf_mul(dw, vf_set1(a->d[at])), t->d[r]);
    }
}

/* rows_q6 on tiles: the block's two halves of 16 on half tiles */
static inline SD_AMX_TARGET void tile_q6(tiles *t, const vi *wv, vi sc0, vi sc1, vf dw, const act_q *a, int r0,
                                         int nr, int b) {
    for (int c = 0; c < 8; c++) _mm512_store_si512(t->w[c], wv[c]);
    const int8_t *q0 = a->q + (size_t)r0 * a->k + (size_t)b * QBLOCK;
    _tile_loadd(6, t->w[0], 64);
    _tile_loadd(7, t->w[4], 64);
    _tile_loadd(4, q0, a->k);
    _tile_loadd(5, q0 + 16, a->k);
    _tile_zero(0);
    _tile_zero(3);
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(3, 5, 7);
    _tile_stored(0, t->s[0], 64);
    _tile_stored(3, t->s[1], 64);
    for (int r = 0; r < nr; r++) {
        size_t row = (size_t)(r0 + r), at = row * (a->k / QBLOCK) + b;
        int32_t lo = sum16(a->q + row * a->k + (size_t)b * QBLOCK), hi = a->sum[at] - lo;
        vi s0 = vi_sub32(vi_load(t->s[0][r]), vi_set1_32(32 * lo));
        vi s1 = vi_sub32(vi_load(t->s[1][r]), vi_set1_32(32 * hi));
        vi s = vi_add32(vi_mul32(s0, sc0), vi_mul32(s1, sc1));
        t->d[r] = vf_fmadd(vf_of_i32(s), vf_mul(dw, vf_set1(a->d[at])), t->d[r]);
    }
}

/* CPUID AMX-TILE and AMX-INT8, the OS's XCR0 tile state, and Linux's permission for this process */
static int tiles_available(void) {
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) return 0;
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 0;          /* XTILECFG, XTILEDATA */
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

int tiles_select(int on) {
    static int available = -1;
    if (on && available < 0) available = tiles_available();
    tiles_on = on && available > 0;
    return tiles_on;
}
#else
typedef struct tiles tiles;     /* never defined: the tile path is not compiled for this CPU */
int tiles_select(int on) { (void)on; return 0; }
#endif

#endif
