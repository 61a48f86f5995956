/* The native CPU decode step: one decoder forward over a batch of token trees, straight
 * from GGUF-style 4-bit / 8-bit blocks (built by backend/devices/native/export.py, driven through
 * ctypes by backend/runtime/native.py), composed from the kernels in kernels.h. This file is the
 * model: its structs (mirrored in runtime/native.py, checked at load by sd_abi), the checks of
 * every index a step follows, the KV cache layout, the layer as a program of ops, and the
 * exported entry points.
 *
 * Why it exists (docs/perf-notes.md section 12): ONNX Runtime runs our 4-bit graph as ~1400
 * separate kernels, reads ~15% more bytes per token than llama.cpp (fp32 scales, a separate
 * Q4_1 offset pass), and had to cast the whole V cache to float64 each step to keep sums
 * independent of where padding and rejected columns sit. Here each matrix is read once per step
 * in its GGUF block encoding, and every output value is computed by one thread in one fixed
 * order (kernels.h), so batch invariance holds by construction, in float32.
 *
 * Attention reads each node's committed columns [0, ctx) and then its path of scratch nodes
 * (kv_slots.py), in that order; a plain step and a verify see the same keys in the same order.
 *
 * Memory: the caller owns an sd_workspace (one per runtime). A forward carves its buffers from
 * it and grows it only when it holds less than the forward needs, so steady decoding allocates
 * nothing (ggml plans one work buffer per graph: ggml_graph_plan's work_size). Before, each
 * forward allocated and freed up to 14 buffers, fresh zero pages at prefill sizes.
 */
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

/* A layer is a program (backend/program.py, ModelConfig.program): its ops in order, each a record
 * runtime/native.py fills from the op of the same kind, and layer() a switch over them, as ggml
 * walks a graph's nodes. The machine has the residual stream x and the value worked on h (x itself
 * at a layer's start and after each residual). A new order or placement is another op array; a
 * new kind is a case here, its name in SD_OP_NAMES and its record's fields. */
enum { SD_OP_FEATURES, SD_OP_NORM, SD_OP_LINEAR, SD_OP_HEAD_NORM, SD_OP_ROPE, SD_OP_ATTENTION, SD_OP_GATE,
       SD_OP_RESIDUAL, SD_OP_KINDS, SD_MAX_OPS = 16 };
static const char SD_OP_NAMES[] = "features,norm,linear,head_norm,rope,attention,gate,residual";  /* SD_OP_*, in order */

enum { SD_SILU = 0, SD_GELU_TANH = 1 };

typedef struct {
    int32_t kind;                        /* SD_OP_* */
    int32_t out;                         /* LINEAR: outputs per row */
    int32_t wide;                        /* LINEAR: its family's SD_WIDE_* bit (sd_model.wide: whether wide) */
    int32_t window;                      /* ATTENTION: keys at positions > pos - window; 0: all */
    int32_t act;                         /* GATE: SD_SILU | SD_GELU_TANH */
    int32_t parallel;                    /* RESIDUAL: 1: x stays, this value is added at the next residual */
    float scale, softcap;                /* ATTENTION: q's multiplier; the scores' cap tanh(s / cap), 0: none */
    const float *w, *w2;                 /* NORM: [its input's width] its weight (NULL: none) and an EAGLE-3
                                            head's feature norm [H] (NULL: none); HEAD_NORM: [D] q's and k's;
                                            RESIDUAL: [H] the value's norm (NULL: none) */
    const float *cos, *sin;              /* ROPE: [max_pos, D/2] its table */
    const float *bias;                   /* LINEAR: [out] or NULL */
    sd_matrix mat[3];                    /* LINEAR: fused in mat[0] (mat[1].data NULL), or its parts apart,
                                            when their block kinds differ */
} sd_op;

typedef struct {
    int32_t num_ops, pad_;
    sd_op ops[SD_MAX_OPS];
} sd_layer;

/* sd_model.wide: the matrix families whose inputs are wide activations (kernels.h act_q.wide) */
enum { SD_WIDE_QKV = 1, SD_WIDE_O = 2, SD_WIDE_GATE_UP = 4, SD_WIDE_DOWN = 8, SD_WIDE_LM_HEAD = 16 };

typedef struct {
    int32_t hidden, num_layers, num_heads, num_kv_heads, head_dim, vocab, max_pos;
    float eps;
    float embed_scale;                   /* the embedding's multiplier (Gemma: sqrt(H)); 0 or 1: none */
    float final_softcap;                 /* logits = cap tanh(logits / cap); 0: none */
    int32_t wide;                        /* SD_WIDE_* bits: these matrices take wide activations */
    const float *norm;                   /* [H] */
    sd_matrix embed, lm_head;            /* embed: gathered one row per token */
    const sd_layer *layers;
    sd_matrix fc;                        /* EAGLE head: x = fc([embed(token), feature]) + fc_bias; */
    const float *fc_bias;                /* fc.data NULL for a plain decoder */
} sd_model;

typedef struct {
    uint16_t *cache;         /* [layers, 2, slots, Hkv, L, D] f16: llama.cpp's default KV type, half the bytes */
    int64_t slots, cols;     /* slots (incl. the spare), L */
} sd_cache;

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

typedef struct {             /* the caller's scratch memory for sd_forward; {NULL, 0} at first */
    void *data;              /* [capacity] bytes, SD_ALIGN-aligned; sd_forward grows it, sd_workspace_free frees it */
    int64_t capacity;
} sd_workspace;

#define SD_ALIGN 64          /* every carved buffer starts on a cache line */

static inline uint16_t *kv_at(const sd_cache *c, const sd_model *m, int layer, int kind, int64_t slot,
                              int h, int64_t col) {
    int64_t d = m->head_dim, hkv = m->num_kv_heads;
    return c->cache + ((((int64_t)layer * 2 + kind) * c->slots + slot) * hkv + h) * c->cols * d + col * d;
}

/* an EAGLE-3 head (a norm of its program reads the embedding beside the feature): the feature is
 * the residual stream, the attention reads [norm(embedding), norm(feature)] (2h wide) */
static int is_eagle3(const sd_model *m) {
    for (int j = 0; m->num_layers > 0 && j < m->layers[0].num_ops; j++)
        if (m->layers[0].ops[j].kind == SD_OP_NORM && m->layers[0].ops[j].w2) return 1;
    return 0;
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

/* ---- the workspace ------------------------------------------------------------------------ */

typedef struct {             /* one forward's buffers, carved from the workspace (N nodes, L logit rows) */
    float *x;                /* [N, H] the residual stream */
    float *hn;               /* [max(N, L), H] the logit rows' features */
    float *v[2];             /* [N, vmax] each: the values a layer's ops work on, one the other's output */
    float *pend;             /* [N, H] a parallel branch's value waiting for the next residual, or NULL */
    float *emb;              /* [N, H] an EAGLE-3 head's token embeddings, else NULL */
    float *fin;              /* [N, H] final-norm rows: s->hidden itself when that is all it holds */
    float *work;             /* [threads, work_len] attention scratch, a slice per thread */
    size_t work_len;
    uint16_t *zero_col;      /* [MAX_HEAD_DIM] f16 zeros: attention's padding columns */
    act_q a;                 /* [max(N, L), kmax] int8 activations; k set per stage */
} buffers;

static size_t round_up(size_t n) { return (n + SD_ALIGN - 1) / SD_ALIGN * SD_ALIGN; }

/* n bytes (at least one line) on a line boundary; C11's aligned_alloc takes whole lines */
static void *alloc_lines(size_t n) { return aligned_alloc(SD_ALIGN, n < SD_ALIGN ? SD_ALIGN : round_up(n)); }

static void *take(uint8_t *base, size_t *used, size_t bytes) {
    void *p = base ? base + *used : NULL;
    *used += round_up(bytes);
    return p;
}

static size_t max_z(size_t a, size_t b) { return a > b ? a : b; }

/* The widest value the layers' ops make (vmax), the widest matrix input (kmax; an EAGLE head's fc
 * takes 2h, the LM head h), and whether a parallel branch waits, walking each program's widths as
 * the forward does. sd_model_ok checks the same walk against the matrices. */
static void program_widths(const sd_model *m, size_t *vmax, size_t *kmax, int *parallel) {
    const size_t h = (size_t)m->hidden, hqd = (size_t)m->num_heads * m->head_dim;
    *vmax = *kmax = m->fc.data || is_eagle3(m) ? 2 * h : h;
    *parallel = 0;
    for (int l = 0; l < m->num_layers; l++) {
        size_t w = h;
        for (int j = 0; j < m->layers[l].num_ops; j++) {
            const sd_op *op = &m->layers[l].ops[j];
            if (op->kind == SD_OP_NORM) w = op->w2 ? 2 * h : w;
            else if (op->kind == SD_OP_LINEAR) *kmax = max_z(*kmax, w), w = (size_t)op->out;
            else if (op->kind == SD_OP_ATTENTION) w = hqd;
            else if (op->kind == SD_OP_GATE) w /= 2;
            else if (op->kind == SD_OP_RESIDUAL) w = h, *parallel |= op->parallel;
            *vmax = max_z(*vmax, w);
        }
    }
}

/* Lays this step's buffers out from `base` (NULL: only measures); the bytes they take. */
static size_t carve(const sd_model *m, const sd_step *s, uint8_t *base, buffers *b) {
    const size_t rows = (size_t)s->rows, h = (size_t)m->hidden;
    const size_t arows = rows > (size_t)s->num_logits ? rows : (size_t)s->num_logits;
    size_t vmax, kmax;
    int parallel;
    program_widths(m, &vmax, &kmax, &parallel);
    const int eagle3 = is_eagle3(m), threads = s->threads > 0 ? s->threads : 1;
    int max_tokens = 0, max_ctx = 0;
    for (int i = 0; i < s->batch; i++) {
        int n = s->row_start[i + 1] - s->row_start[i];
        max_tokens = n > max_tokens ? n : max_tokens;
        max_ctx = s->ctx[i] > max_ctx ? s->ctx[i] : max_ctx;
    }
    size_t used = 0;
    b->x = take(base, &used, sizeof(float) * rows * h);
    b->hn = take(base, &used, sizeof(float) * arows * h);
    b->v[0] = take(base, &used, sizeof(float) * rows * vmax);
    b->v[1] = take(base, &used, sizeof(float) * rows * vmax);
    b->pend = parallel ? take(base, &used, sizeof(float) * rows * h) : NULL;
    b->emb = eagle3 ? take(base, &used, sizeof(float) * rows * h) : NULL;
    b->fin = eagle3 || s->num_features ? take(base, &used, sizeof(float) * rows * h) : s->hidden;
    b->work_len = attend_work_floats(max_tokens, max_ctx, s->path_len);
    b->work = take(base, &used, sizeof(float) * b->work_len * threads);
    b->zero_col = take(base, &used, sizeof(uint16_t) * MAX_HEAD_DIM);
    const size_t qrows = arows * (m->wide ? 2 : 1);        /* wide: two int8 rows per row */
    b->a = (act_q){take(base, &used, qrows * kmax), take(base, &used, sizeof(float) * qrows * kmax / QBLOCK),
                   take(base, &used, sizeof(int32_t) * qrows * kmax / QBLOCK),
                   take(base, &used, sizeof(float) * qrows * kmax / QBLOCK), (int)h, 0};
    return used;
}

/* At least `bytes` in the workspace: grown only when it holds less, with half again as much
 * headroom (a context growing a column per step does not regrow it every few steps); never
 * shrunk. Fails (-1, the workspace left empty) only when the memory is not there. */
static int reserve(sd_workspace *ws, size_t bytes) {
    if (!ws) return -1;
    if (ws->data && (size_t)ws->capacity >= bytes) return 0;
    size_t cap = round_up(bytes + bytes / 2);
    free(ws->data);
    ws->data = alloc_lines(cap);
    ws->capacity = ws->data ? (int64_t)cap : 0;
    return ws->data ? 0 : -1;
}

void sd_workspace_free(sd_workspace *ws) {
    free(ws->data);
    ws->data = NULL;
    ws->capacity = 0;
}

/* ---- the forward (each function runs on every thread of the forward's parallel region) ----- */

/* my = rows of x [rows, k] quantized for the matrices of family `wide_bit` (SD_WIDE_*; 0: none) */
static void quantize_for(act_q *my, const sd_model *m, int wide_bit, const float *x, int rows, int k) {
    my->k = k;
    my->wide = (m->wide & wide_bit) != 0;
    quantize_rows(x, rows, k, my);
}

/* x = the tokens' embeddings (an EAGLE-3 head: emb, and x = its features); an EAGLE head: x =
 * fc([embedding, feature]) + fc_bias */
static void embed(const sd_model *m, const sd_step *s, const buffers *b, act_q *my) {
    const int rows = s->rows, h = m->hidden, eagle3 = is_eagle3(m);
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) dequant_row(&m->embed, (int)s->ids[r], (eagle3 ? b->emb : b->x) + (size_t)r * h);
    if (m->embed_scale != 0.0f && m->embed_scale != 1.0f) scale_rows(eagle3 ? b->emb : b->x, rows, h, m->embed_scale);
    if (eagle3) {
        copy_rows(s->features, h, b->x, h, rows, h);
    } else if (m->fc.data) {
#pragma omp for schedule(static)
        for (int r = 0; r < rows; r++) {
            memcpy(b->v[0] + (size_t)r * 2 * h, b->x + (size_t)r * h, sizeof(float) * h);
            memcpy(b->v[0] + (size_t)r * 2 * h + h, s->features + (size_t)r * h, sizeof(float) * h);
        }
        quantize_for(my, m, 0, b->v[0], rows, 2 * h);
        matmul(&m->fc, my, rows, b->x, h, h, 0, m->fc_bias);
    }
}

/* The ops (each runs on every thread of the forward's parallel region). A value: rows of `width`
 * floats at p, a layer's x or one of the value buffers. */
typedef struct { float *p; int width; } value;

/* the buffer an op writes its output to: the value buffer h does not occupy */
static float *other(const buffers *b, value h) { return h.p == b->v[0] ? b->v[1] : b->v[0]; }

/* HEAD_NORM, ROPE: in place on each node's q and k heads of q/k/v rows h. Without a barrier
 * (nowait): the attention's first loop has the same static schedule over the same rows, so each
 * row stays on its thread until it is stored, where the barrier is. */
static void head_norm(const sd_model *m, const sd_op *op, const sd_step *s, value h) {
    const int d = m->head_dim, hq = m->num_heads;
#pragma omp for schedule(static) nowait
    for (int r = 0; r < s->rows; r++) {
        float *qr = h.p + (size_t)r * h.width;
        rmsnorm_heads(qr, hq, d, op->w, m->eps);
        rmsnorm_heads(qr + (size_t)hq * d, m->num_kv_heads, d, op->w2, m->eps);
    }
}

static void rotary(const sd_model *m, const sd_op *op, const sd_step *s, value h) {
    const int d = m->head_dim;
#pragma omp for schedule(static) nowait
    for (int r = 0; r < s->rows; r++)
        rope(h.p + (size_t)r * h.width, m->num_heads + m->num_kv_heads, d, op->cos + s->pos[r] * (d / 2),
             op->sin + s->pos[r] * (d / 2));
}

/* ATTENTION of every node of q/k/v rows h into out [N, Hq D], after the new K, V are written to
 * their columns */
static void attention(const sd_model *m, const sd_op *op, sd_cache *c, const sd_step *s, value h, float *out,
                      float *work, const buffers *b, int l) {
    const int d = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads, nqkv = h.width;
#pragma omp for schedule(static)
    for (int r = 0; r < s->rows; r++) {
        const float *qr = h.p + (size_t)r * nqkv;
        for (int kh = 0; kh < hkv; kh++) {
            store_f16(kv_at(c, m, l, 0, s->wslot[r], kh, s->wcol[r]), qr + (hq + kh) * d, d);
            store_f16(kv_at(c, m, l, 1, s->wslot[r], kh, s->wcol[r]), qr + (hq + hkv + kh) * d, d);
        }
    }
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < s->batch * hq; task++) {   /* one query head of one row's nodes */
        int row = task / hq, qh = task % hq, kh = qh / (hq / hkv);
        size_t r0 = (size_t)s->row_start[row];
        int n = s->row_start[row + 1] - s->row_start[row];
        if (n > 0)
            attend_row(kv_at(c, m, l, 0, s->slots[row], kh, 0), kv_at(c, m, l, 1, s->slots[row], kh, 0), d,
                       op->scale, op->softcap, op->window, s->pos + r0, s->ctx[row], s->paths + r0 * s->path_len,
                       s->path_len, n, h.p + r0 * nqkv + qh * d, nqkv, out + r0 * hq * d + qh * d, hq * d, work,
                       b->zero_col);
    }
}

/* y [rows, width] (= or += where accumulate) = a times a fused matrix (w[0] only) or its n parts
 * apart, their outputs side by side (+ bias [width] or NULL) */
static void parts(const sd_matrix *w, int n, const act_q *a, int rows, float *y, int width, int accumulate,
                  const float *bias) {
    if (!w[1].data) {
        matmul(&w[0], a, rows, y, width, width, accumulate, bias);
        return;
    }
    int off = 0;
    for (int i = 0; i < n && w[i].data; i++) {
        int n_out = i == n - 1 || !w[i + 1].data ? width - off : w[i].rows;
        matmul(&w[i], a, rows, y + off, width, n_out, accumulate, bias ? bias + off : NULL);
        off += n_out;
    }
}

/* x [rows, h] += t */
static void add_rows(float *x, const float *t, int rows, int h) {
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < h; j++) x[(size_t)r * h + j] += t[(size_t)r * h + j];
}

/* RESIDUAL of value h: x += h, or x += norm(h) where the op names a norm (Gemma's post norms),
 * after a waiting parallel branch's value; a parallel op's value waits in pend instead */
static void residual(const sd_model *m, const sd_op *op, const sd_step *s, const buffers *b, value h, int *pending) {
    const int rows = s->rows, hd = m->hidden;
    if (op->parallel) {
        rmsnorm_rows(h.p, rows, hd, op->w, m->eps, b->pend, hd);     /* a copy where there is no norm */
        *pending = 1;
        return;
    }
    if (*pending) add_rows(b->x, b->pend, rows, hd);
    *pending = 0;
    if (op->w) add_normed_rows(h.p, rows, hd, op->w, m->eps, b->x);
    else add_rows(b->x, h.p, rows, hd);
}

/* LINEAR of value h: the op's matrix on h's rows quantized for its family -> the next value;
 * straight into x (the matmul adding to it) where a plain residual follows (*fold). */
static value linear(const sd_model *m, const sd_op *op, const sd_op *next, const sd_step *s, const buffers *b,
                    act_q *my, value h, int *pending, int *fold) {
    const int rows = s->rows;
    quantize_for(my, m, op->wide, h.p, rows, h.width);
    *fold = next && next->kind == SD_OP_RESIDUAL && !next->w && !next->parallel;
    if (*fold) {
        if (*pending) add_rows(b->x, b->pend, rows, m->hidden);
        *pending = 0;
        parts(op->mat, 3, my, rows, b->x, op->out, 1, op->bias);
        return (value){b->x, m->hidden};
    }
    value y = {other(b, h), op->out};
    parts(op->mat, 3, my, rows, y.p, y.width, 0, op->bias);
    return y;
}

/* NORM of value h (an EAGLE-3 head's: [norm(embedding), norm(h)]) -> the next value */
static value norm(const sd_model *m, const sd_op *op, const sd_step *s, const buffers *b, value h) {
    const int rows = s->rows, hd = m->hidden;
    value y = {other(b, h), op->w2 ? 2 * hd : h.width};
    if (op->w2) {
        rmsnorm_rows(b->emb, rows, hd, op->w, m->eps, y.p, 2 * hd);
        rmsnorm_rows(h.p, rows, hd, op->w2, m->eps, y.p + hd, 2 * hd);
    } else {
        rmsnorm_rows(h.p, rows, h.width, op->w, m->eps, y.p, h.width);
    }
    return y;
}

/* decoder layer l over every node, its program's ops in order, the residual stream x in place */
static void layer(const sd_model *m, sd_cache *c, const sd_step *s, const buffers *b, act_q *my, float *work, int l) {
    const sd_layer *L = &m->layers[l];
    const int rows = s->rows, h = m->hidden, hw = h * (1 + s->num_features);
    value v = {b->x, h};
    int pending = 0, fold = 0;
    for (int j = 0; j < L->num_ops; j++) {
        const sd_op *op = &L->ops[j];
        switch (op->kind) {
        case SD_OP_FEATURES:
            for (int f = 0; f < s->num_features; f++)
                if (s->feature_layers[f] == l) copy_rows(b->x, h, s->hidden + (size_t)(1 + f) * h, hw, rows, h);
            break;
        case SD_OP_NORM: v = norm(m, op, s, b, v); break;
        case SD_OP_LINEAR:
            v = linear(m, op, j + 1 < L->num_ops ? op + 1 : NULL, s, b, my, v, &pending, &fold);
            j += fold;                         /* the residual it added to x */
            break;
        case SD_OP_HEAD_NORM: head_norm(m, op, s, v); break;
        case SD_OP_ROPE: rotary(m, op, s, v); break;
        case SD_OP_ATTENTION: {
            value y = {other(b, v), m->num_heads * m->head_dim};
            attention(m, op, c, s, v, y.p, work, b, l);
            v = y;
            break;
        }
        case SD_OP_GATE: {
            value y = {other(b, v), v.width / 2};
            gated_rows(v.p, rows, y.width, op->act == SD_GELU_TANH, y.p);
            v = y;
            break;
        }
        case SD_OP_RESIDUAL:
            residual(m, op, s, b, v, &pending);
            v = (value){b->x, h};
            break;
        }
    }
}

/* the final norm, the features out, the logits of the nodes that get them */
static void head(const sd_model *m, const sd_step *s, const buffers *b, act_q *my) {
    const int rows = s->rows, h = m->hidden, hw = h * (1 + s->num_features);
    rmsnorm_rows(b->x, rows, h, m->norm, m->eps, b->fin, h);
    if (is_eagle3(m)) copy_rows(b->x, h, s->hidden, h, rows, h);
    else if (s->num_features) copy_rows(b->fin, h, s->hidden, hw, rows, h);
#pragma omp for schedule(static)
    for (int i = 0; i < s->num_logits; i++)
        memcpy(b->hn + (size_t)i * h, b->fin + (size_t)s->logit_rows[i] * h, sizeof(float) * h);
    quantize_for(my, m, SD_WIDE_LM_HEAD, b->hn, s->num_logits, h);
    matmul(&m->lm_head, my, s->num_logits, s->logits, m->vocab, m->vocab, 0, NULL);
    if (m->final_softcap > 0.0f) softcap_rows(s->logits, s->num_logits, m->vocab, m->vocab, m->final_softcap);
}

/* a matrix the kernels can run: a known kind, whole blocks and lane groups (matmul and
 * dequant_row cannot fail, and an unknown kind would give zeros) */
static int usable(const sd_matrix *w) {
    return block_bytes(w->type) != 0 && w->cols % block_elems(w->type) == 0 && w->rows % LANES == 0;
}

/* 1 when layer L's program runs as the forward walks it: known kinds, within SD_MAX_OPS; each
 * op given the width it takes (a residual or an EAGLE-3 head's norm the stream's, the attention's
 * ops q/k/v rows, a linear its matrices' columns in whole int8 blocks, matrices the kernels can
 * run); the layer ending on the stream, no parallel branch left waiting */
static int layer_ok(const sd_model *m, const sd_layer *L) {
    const int h = m->hidden, nqkv = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    int w = h, pending = 0;
    if (L->num_ops < 0 || L->num_ops > SD_MAX_OPS) return 0;
    for (int j = 0; j < L->num_ops; j++) {
        const sd_op *op = &L->ops[j];
        switch (op->kind) {
        case SD_OP_FEATURES: break;
        case SD_OP_NORM: if (op->w2 && w != h) return 0; w = op->w2 ? 2 * h : w; break;
        case SD_OP_LINEAR: {
            int rows = 0;
            if (w % QBLOCK || op->out <= 0) return 0;
            for (int i = 0; i < 3; i++) {
                if (i > 0 && !op->mat[i].data) continue;
                if (!usable(&op->mat[i]) || op->mat[i].cols != w) return 0;
                rows += op->mat[i].rows;
            }
            if (op->out > rows) return 0;
            w = op->out;
            break;
        }
        case SD_OP_HEAD_NORM: if (w != nqkv || !op->w || !op->w2) return 0; break;
        case SD_OP_ROPE: if (w != nqkv || !op->cos || !op->sin) return 0; break;
        case SD_OP_ATTENTION: if (w != nqkv) return 0; w = m->num_heads * m->head_dim; break;
        case SD_OP_GATE: if (w % 2 || (op->act != SD_SILU && op->act != SD_GELU_TANH)) return 0; w /= 2; break;
        case SD_OP_RESIDUAL: if (w != h) return 0; pending = op->parallel; break;
        default: return 0;
        }
    }
    return w == h && !pending;
}

/* 1 when every matrix and layer program of the model is one the kernels can run; runtime/native.py
 * asks once, when it loads an engine (not on every forward) */
int sd_model_ok(const sd_model *m) {
    if (!usable(&m->embed) || !usable(&m->lm_head) || (m->fc.data && !usable(&m->fc))) return 0;
    for (int l = 0; l < m->num_layers; l++)
        if (!layer_ok(m, &m->layers[l])) return 0;
    return 1;
}

/* 0; a refusal (SD_BAD_*, nothing written); or -1: shapes the kernels do not take, a missing
 * input or output, or no memory for the workspace */
int sd_forward(const sd_model *m, sd_cache *c, const sd_step *s, sd_workspace *ws) {
    const int bad = check_step(m, c, s);
    if (bad) return bad;
    const int h = m->hidden, d = m->head_dim;
    if (d % VW || d > MAX_HEAD_DIM || h % QBLOCK) return -1;      /* the layers' widths: sd_model_ok */
    if (((m->fc.data || is_eagle3(m)) && !s->features) || !s->hidden) return -1;
    buffers b;
    if (reserve(ws, carve(m, s, NULL, &b))) return -1;
    carve(m, s, ws->data, &b);
#ifdef SD_POISON_WORKSPACE
    memset(ws->data, 0xff, (size_t)ws->capacity);   /* sanitize.sh: a read of stale scratch shows as NaN */
#endif
    memset(b.zero_col, 0, sizeof(uint16_t) * MAX_HEAD_DIM);
#pragma omp parallel num_threads(s->threads > 0 ? s->threads : 1)
    {
        act_q my = b.a;                      /* this thread's view: the row width changes per stage */
#ifdef _OPENMP
        float *work = b.work + b.work_len * omp_get_thread_num();
#else
        float *work = b.work;
#endif
        embed(m, s, &b, &my);
        for (int l = 0; l < m->num_layers; l++) layer(m, c, s, &b, &my, work, l);
        head(m, s, &b, &my);
    }
    return 0;
}

/* The binary interface runtime/native.py mirrors with ctypes (the structs above, the block
 * layout devices/native/export.py writes, the weight kinds), checked by Python when it loads the
 * library: a stale or foreign build is refused with a clear message instead of misreading
 * memory. Bump SD_ABI_VERSION when a struct, layout or entry point changes meaning without
 * changing a size (2: sd_forward takes the caller's sd_workspace). */
#define SD_ABI_VERSION 7   /* 3: model flags (Gemma-3), sliding windows, kernel_abi; 4: attn_softcap;
                              5: wide activations (sd_model.wide, sd_matmul's wide); 6: sd_layer.norms
                              by name (sd_norm_names); 7: a layer is its program (sd_op, sd_op_names) */
int sd_abi(int64_t *out, int n) {
    int64_t v[10 + 32] = {SD_ABI_VERSION, sizeof(sd_matrix), sizeof(sd_op), sizeof(sd_layer), sizeof(sd_model),
                         sizeof(sd_cache), sizeof(sd_step), sizeof(sd_workspace), SD_MAX_OPS, SD_OP_KINDS};
    const int count = 10 + kernel_abi(v + 10);
    for (int i = 0; i < n && i < count; i++) out[i] = v[i];
    return count;
}

/* the names of the op kinds (SD_OP_*), comma separated, in order */
const char *sd_op_names(void) { return SD_OP_NAMES; }

static int tiles_in_use;

/* kernels.h tiles_select's modes (TILES_OFF | TILES_AUTO | TILES_ALWAYS; bitwise the VNNI
 * path's on every one); between forwards only. Returns the mode in force. runtime/native.py calls
 * it once when it loads the library (SPECDEC_ISA). */
int sd_use_tiles(int mode) {
    tiles_in_use = tiles_select(mode);
    return tiles_in_use;
}

/* the path the matmul runs on (amx | avx512-vnni | avx-vnni | avx2), for the manifest, `specdec
 * info`, the startup line and the metrics */
const char *sd_isa(void) {
    if (tiles_in_use) return "amx";
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512-vnni";
#elif defined(__AVXVNNI__)
    return "avx-vnni";
#else
    return "avx2";
#endif
}

/* y[rows, W.rows] = x W^T for float rows x [rows, W.cols] (wide: wide activations): the kernel
 * alone, for its tests and host-side products between steps (runtime/native.py BlockedMatrix).
 * Its own small buffers: callers on any thread share no state. */
int sd_matmul(const sd_matrix *w, const float *x, int rows, float *y, int threads, int wide) {
    const size_t nb = w->cols / QBLOCK, qrows = (size_t)rows * (wide ? 2 : 1);
    act_q a = {alloc_lines(qrows * w->cols), alloc_lines(sizeof(float) * qrows * nb),
               alloc_lines(sizeof(int32_t) * qrows * nb), alloc_lines(sizeof(float) * qrows * nb), w->cols,
               wide != 0};
    int ok = a.q && a.d && a.sum && a.dsum && w->cols % QBLOCK == 0 && usable(w);
    if (ok) {
#pragma omp parallel num_threads(threads > 0 ? threads : 1)
        {
            quantize_rows(x, rows, w->cols, &a);
            matmul(w, &a, rows, y, w->rows, w->rows, 0, NULL);
        }
    }
    free(a.q); free(a.d); free(a.sum); free(a.dsum);
    return ok ? 0 : -1;
}
