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
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SD_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))
#define TILE_ROWS 16            /* int8 rows per tile (whole pairs of wide rows) */
#define TILE_MAX_COLS 16384     /* two groups' decoded blocks live on the thread's stack (~0.8 KB per 32
                                   inputs each, 800 KB here; Llama-3.1-8B's widest, 14336, fits); wider
                                   matrices stay on VNNI */
static int tiles_on;            /* TILES_*: set by tiles_select between forwards, read by matmul */

/* from how many int8 rows a matmul of this kind runs on tiles (TILES_AUTO): where tiles measured
   faster, 1 and 2 threads (perf-notes §25): a round of tile dots costs about what 2-3 rows of VNNI
   dots cost, so a plain step and a short verify stay on VNNI; Q6_K's half tiles never paid */
static inline int tile_min_rows(int type) {
    if (tiles_on == TILES_ALWAYS) return 1;
    return type == SD_Q6_K ? INT32_MAX : 10;
}

/* A group's blocks are all decoded into its weight tiles (kind_blocks with the tile consumers
   below) before its row tiles run over them, during the previous group's rounds (kernels.c
   matmul_tiles, two scratches): a tile load never reads weights the vector units stored a moment
   ago (no store forwarding into tile loads), and a prefill's row tiles decode each block once. A round issues up to ROUND blocks' dots together (tiles 0-3 the
   dots, 4/5 the activations and 6/7 the weights in turn; Q6_K: 2 blocks as two halves of 16
   each); round n's epilogue runs after round n+1's dots are issued (two buffers of dots). */
#define ROUND 4
#define EPI_ROWS 4      /* rows the epilogue takes at once (their accumulators in registers) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* m int8 rows per tile; q6: the half tiles (16 bytes of activations, 4 weight rows) */
static SD_AMX_TARGET void tiles_config(int m, int q6) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 4; i++) c.rows[i] = (uint8_t)m, c.colsb[i] = 64;
    for (int i = 4; i < 6; i++) c.rows[i] = (uint8_t)m, c.colsb[i] = q6 ? 16 : 32;
    for (int i = 6; i < 8; i++) c.rows[i] = q6 ? 4 : 8, c.colsb[i] = 64;
    /* not _tile_loadconfig: GCC 12's macro names only the first 8 bytes as read, and the stores
       of the rest are dropped as dead; the whole struct is the operand here */
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

enum { TILE_DM, TILE_DZ, TILE_Q6 };

typedef struct { vf dw, mw; vi sc0, sc1; } tile_scales;   /* a block's: rows_dm / rows_dz / rows_q6's */

/* one group's decoded blocks (32 elements each), in the caller's scratch */
typedef struct {
    uint8_t (*w)[8][64];                /* [blocks] block b's weights as a tile: row c = wv[c] */
    const uint8_t **wb;                 /* [blocks] where block b's weight tile is: w[b], or Q8_0's
                                           own integers, which are that tile as they are */
    tile_scales *sc;                    /* [blocks] */
    int kind, zero;
} tiles;

/* the next group's decode, done a slice at a time between the current group's tile rounds */
typedef struct {
    const sd_matrix *w;
    int g, done, units;                 /* group; its units (block_elems inputs each) decoded, of `units` */
    tiles *t;                           /* into this scratch */
} tile_decoder;

/* units u0 .. u1 of group g decoded into t (kernels.c: kind_blocks with the consumers below) */
static void decode_units(const sd_matrix *w, int g, int u0, int u1, tiles *t);

static inline void decode_next(tile_decoder *d, int n) {
    const int u1 = d->done + n < d->units ? d->done + n : d->units;
    if (u1 > d->done) decode_units(d->w, d->g, d->done, u1, d->t);
    d->done = u1;
}

/* the consumers kind_blocks calls per block: its weights and scales kept for the row tiles */
static inline void tile_keep(tiles *t, const vi *wv, vf dw, int b) {
    for (int c = 0; c < 8; c++) vi_store(t->w[b][c], wv[c]);
    t->wb[b] = t->w[b][0];
    t->sc[b].dw = dw;
}

/* Q8_0: its integers are read by the tile load where they lie (no decode, no copy) */
static inline void tile_q8(tiles *t, const uint8_t *qs, vf dw, int b) {
    t->zero = 128;
    t->wb[b] = qs;
    t->sc[b].dw = dw;
}

static inline void tile_dm(tiles *t, const vi *wv, vf dw, vf mw, int b) {
    tile_keep(t, wv, dw, b);
    t->sc[b].mw = mw;
}

static inline void tile_dz(tiles *t, const vi *wv, vf dw, int zero, int b) {
    t->zero = zero;
    tile_keep(t, wv, dw, b);
}

static inline void tile_q6(tiles *t, const vi *wv, vi sc0, vi sc1, vf dw, int b) {
    tile_keep(t, wv, dw, b);
    t->sc[b].sc0 = sc0, t->sc[b].sc1 = sc1;
}

/* the dots of blocks b0 .. b0 + n of rows q (a->k apart) into s: tile j of C from the activation
   tile ta and the weight tile tb */
#define DOT32(j, ta, tb)                                                                          \
    if (n > j) {                                                                                  \
        _tile_loadd(tb, t->wb[b0 + j], 64);                                                       \
        _tile_loadd(ta, q + (size_t)(b0 + j) * QBLOCK, k);                                        \
        _tile_zero(j);                                                                            \
        _tile_dpbsud(j, ta, tb);                                                                  \
    }
#define DOT16(j, h, ta, tb)                                                                       \
    if (n > j / 2) {                                                                              \
        _tile_loadd(tb, t->wb[b0 + j / 2] + 256 * h, 64);                                         \
        _tile_loadd(ta, q + (size_t)(b0 + j / 2) * QBLOCK + 16 * h, k);                           \
        _tile_zero(j);                                                                            \
        _tile_dpbsud(j, ta, tb);                                                                  \
    }
#define STORE(j)                                                                                  \
    if (slots > j) _tile_stored(j, s[j], 64);

static inline SD_AMX_TARGET void round_dots(const tiles *t, const int8_t *q, int k, int b0, int n,
                                            int32_t (*s)[TILE_ROWS][LANES]) {
    const int slots = t->kind == TILE_Q6 ? 2 * n : n;
    if (t->kind == TILE_Q6) {
        DOT16(0, 0, 4, 6) DOT16(1, 1, 5, 7) DOT16(2, 0, 4, 6) DOT16(3, 1, 5, 7)
    } else {
        DOT32(0, 4, 6) DOT32(1, 5, 7) DOT32(2, 4, 6) DOT32(3, 5, 7)
    }
    STORE(0) STORE(1) STORE(2) STORE(3)
}

/* blocks b0 .. b0 + n's scales on their dots s, per row over the blocks in order (rows_dm /
   rows_dz / rows_q6's operations), into the accumulators d, m of rows r0 .. r0 + nr */
static inline void round_epilogue(const tiles *t, const act_q *a, int r0, int nr, int b0, int n,
                                  int32_t (*s)[TILE_ROWS][LANES], vf *d, vf *m) {
    const size_t nb = a->k / QBLOCK;
    const tile_scales *sc = t->sc + b0;
    if (t->kind == TILE_DM) {
        int r = 0;
        for (; r + EPI_ROWS <= nr; r += EPI_ROWS) {     /* EPI_ROWS rows at once: a block's dw, mw loaded once */
            vf dr[EPI_ROWS], mr[EPI_ROWS];
            for (int i = 0; i < EPI_ROWS; i++) dr[i] = d[r + i], mr[i] = m[r + i];
            for (int j = 0; j < n; j++) {
                const vf dw = sc[j].dw, mw = sc[j].mw;
                for (int i = 0; i < EPI_ROWS; i++) {
                    const size_t at = (size_t)(r0 + r + i) * nb + b0 + j;
                    mr[i] = vf_fmadd(mw, vf_set1(a->dsum[at]), mr[i]);
                    dr[i] = vf_fmadd(vf_of_i32(vi_load(s[j][r + i])), vf_mul(dw, vf_set1(a->d[at])), dr[i]);
                }
            }
            for (int i = 0; i < EPI_ROWS; i++) d[r + i] = dr[i], m[r + i] = mr[i];
        }
        for (; r < nr; r++) {
            const float *dx = a->d + (size_t)(r0 + r) * nb + b0, *ds = a->dsum + (size_t)(r0 + r) * nb + b0;
            vf dr = d[r], mr = m[r];
            for (int j = 0; j < n; j++) {
                mr = vf_fmadd(sc[j].mw, vf_set1(ds[j]), mr);
                dr = vf_fmadd(vf_of_i32(vi_load(s[j][r])), vf_mul(sc[j].dw, vf_set1(dx[j])), dr);
            }
            d[r] = dr, m[r] = mr;
        }
    } else if (t->kind == TILE_DZ) {
        for (int r = 0; r < nr; r++) {
            const size_t at = (size_t)(r0 + r) * nb + b0;
            vf dr = d[r];
            for (int j = 0; j < n; j++) {
                vi si = vi_sub32(vi_load(s[j][r]), vi_set1_32(t->zero * a->sum[at + j]));
                dr = vf_fmadd(vf_of_i32(si), vf_mul(sc[j].dw, vf_set1(a->d[at + j])), dr);
            }
            d[r] = dr;
        }
    } else {
        for (int r = 0; r < nr; r++) {
            const size_t at = (size_t)(r0 + r) * nb + b0;
            vf dr = d[r];
            for (int j = 0; j < n; j++) {
                int32_t lo = sum16(a->q + (size_t)(r0 + r) * a->k + (size_t)(b0 + j) * QBLOCK), hi = a->sum[at + j] - lo;
                vi s0 = vi_sub32(vi_load(s[2 * j][r]), vi_set1_32(32 * lo));
                vi s1 = vi_sub32(vi_load(s[2 * j + 1][r]), vi_set1_32(32 * hi));
                vi si = vi_add32(vi_mul32(s0, sc[j].sc0), vi_mul32(s1, sc[j].sc1));
                dr = vf_fmadd(vf_of_i32(si), vf_mul(sc[j].dw, vf_set1(a->d[at + j])), dr);
            }
            d[r] = dr;
        }
    }
}

/* out [nr][LANES] = the group's outputs for int8 rows r0 .. r0 + nr over its nblk decoded blocks
   (the tiles configured for nr rows): round i's dots issued, then round i - 1's epilogue (its dots
   were issued a round earlier), two buffers of dots. Meanwhile the next group's blocks are
   decoded into the other scratch (`next`, NULL: none), a slice per round: the weights stream from
   memory and the vector units decode while the tiles compute, and a tile load never reads what
   the vector units stored a moment ago (decoding a group's blocks all at once, then its rows, left
   the tile path ~30-80% slower than VNNI at one row, perf-notes §38). */
static SD_AMX_TARGET void tile_rows(const tiles *t, const act_q *a, int r0, int nr, int nblk, float out[][LANES],
                                    tile_decoder *next) {
    _Alignas(64) int32_t s[2][ROUND][TILE_ROWS][LANES];
    vf d[TILE_ROWS], m[TILE_ROWS];
    for (int r = 0; r < nr; r++) d[r] = m[r] = vf_zero();
    const int8_t *q = a->q + (size_t)r0 * a->k;
    const int per = t->kind == TILE_Q6 ? ROUND / 2 : ROUND, rounds = (nblk + per - 1) / per;
    const int slice = next ? (next->units + rounds - 1) / rounds : 0;
    for (int i = 0; i <= rounds; i++) {
        if (i < rounds) round_dots(t, q, a->k, i * per, nblk - i * per < per ? nblk - i * per : per, s[i & 1]);
        if (next) decode_next(next, slice);
        if (i > 0) {
            const int b0 = (i - 1) * per;
            round_epilogue(t, a, r0, nr, b0, nblk - b0 < per ? nblk - b0 : per, s[(i - 1) & 1], d, m);
        }
    }
    for (int r = 0; r < nr; r++) vf_store(out[r], vf_add(d[r], m[r]));
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

int tiles_select(int mode) {
    static int available = -1;
    if (mode != TILES_OFF && available < 0) available = tiles_available();
    tiles_on = available > 0 ? mode : TILES_OFF;
    return tiles_on;
}
#else
typedef struct tiles tiles;     /* never defined: the tile path is not compiled for this CPU */
int tiles_select(int mode) { (void)mode; return TILES_OFF; }
#endif

#endif
