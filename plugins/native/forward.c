/* The native CPU decode step: one Llama-family forward over a batch of token trees, straight
 * from GGUF-style 4-bit / 8-bit blocks (built by backend/devices/native/export.py, driven through
 * ctypes by backend/runtime/native.py), composed from the kernels in kernels.h. This file is the
 * model: its structs (mirrored in runtime/native.py, checked at load by sd_abi), the checks of
 * every index a step follows, the KV cache layout, the layer, and the exported entry points.
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

/* The optional norms an architecture places in a layer, by the names the engine file gives them
 * ("layers.<i>.<name>"): runtime/native.py fills sd_layer.norms[] in sd_norm_names()' order (NULL
 * where the engine has none) and devices/native/export.py writes the ones a checkpoint has, so a
 * new placement is a name here and its use below. */
enum { SD_Q_NORM, SD_K_NORM, SD_POST_ATTN_NORM, SD_POST_MLP_NORM, SD_NORMS, SD_MAX_NORMS = 8 };
static const char SD_NORM_NAMES[] = "q_norm,k_norm,post_attn_norm,post_mlp_norm";   /* SD_NORMS names, in order */
_Static_assert(SD_NORMS <= SD_MAX_NORMS, "sd_layer.norms has room for SD_MAX_NORMS");

/* What an architecture adds to the Llama layer is data here, read as flags (the model description,
 * backend/manifest.py ModelConfig, each layer's LayerPlan): NULL norms are absent, window 0 is full
 * attention. */
typedef struct {
    const float *attn_norm, *mlp_norm;   /* [H] */
    const float *qkv_bias;               /* [(Hq + 2 Hkv) D] or NULL */
    const float *hidden_norm;            /* [H] an EAGLE-3 head's feature norm, else NULL */
    const float *norms[SD_MAX_NORMS];    /* SD_Q_NORM, SD_K_NORM: [D] per-head norms of q and k before
                                            rotary (Gemma-3, Qwen3); SD_POST_ATTN_NORM, SD_POST_MLP_NORM:
                                            [H] norms of the attention and MLP outputs (Gemma); or NULL */
    const float *rope_cos, *rope_sin;    /* [max_pos, D/2] this layer's rotary tables; NULL: the model's */
    int32_t window, pad_;                /* sliding window (keys at positions > pos - window), 0: none */
    sd_matrix qkv[3];                    /* fused [q; k; v] in qkv[0] (qkv[1].data NULL), or q, k, v
                                            apart when their block kinds differ */
    sd_matrix gate_up[2];                /* fused [gate; up] in gate_up[0], or apart likewise */
    sd_matrix o, down;
} sd_layer;

enum { SD_SILU = 0, SD_GELU_TANH = 1 };

/* sd_model.wide: the matrix families whose inputs are wide activations (kernels.h act_q.wide) */
enum { SD_WIDE_QKV = 1, SD_WIDE_O = 2, SD_WIDE_GATE_UP = 4, SD_WIDE_DOWN = 8, SD_WIDE_LM_HEAD = 16 };

typedef struct {
    int32_t hidden, inter, num_layers, num_heads, num_kv_heads, head_dim, vocab, max_pos;
    float eps, scale;
    int32_t act;                         /* SD_SILU | SD_GELU_TANH: the gated MLP's activation */
    float embed_scale;                   /* the embedding's multiplier (Gemma: sqrt(H)); 0 or 1: none */
    float final_softcap;                 /* logits = cap tanh(logits / cap); 0: none */
    float attn_softcap;                  /* attention scores likewise, before the mask (Gemma-2); 0: none */
    int32_t wide;                        /* SD_WIDE_* bits: these matrices take wide activations */
    const float *rope_cos, *rope_sin;    /* [max_pos, D/2] */
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

/* an EAGLE-3 head: the feature is the residual stream, the attention reads
 * [norm(embedding), norm(feature)] (2h wide) */
static inline int is_eagle3(const sd_model *m) { return m->num_layers > 0 && m->layers[0].hidden_norm != NULL; }

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
    float *hn;               /* [max(N, L), H] normed rows; then the logit rows' features */
    float *qkv;              /* [N, (Hq + 2 Hkv) D] */
    float *att;              /* [N, Hq D] */
    float *gu;               /* [N, 2 I] gate | up */
    float *act;              /* [N, I] */
    float *cat;              /* [N, 2H] an EAGLE head's fc input, an EAGLE-3 head's attention input; else NULL */
    float *emb;              /* [N, H] an EAGLE-3 head's token embeddings, else NULL */
    float *fin;              /* [N, H] final-norm rows: s->hidden itself when that is all it holds */
    float *work;             /* [threads, work_len] attention scratch, a slice per thread */
    size_t work_len;
    uint16_t *zero_col;      /* [MAX_HEAD_DIM] f16 zeros: attention's padding columns */
    act_q a;                 /* [max(N, L), Kmax] int8 activations; k set per stage */
} buffers;

static size_t round_up(size_t n) { return (n + SD_ALIGN - 1) / SD_ALIGN * SD_ALIGN; }

/* n bytes (at least one line) on a line boundary; C11's aligned_alloc takes whole lines */
static void *alloc_lines(size_t n) { return aligned_alloc(SD_ALIGN, n < SD_ALIGN ? SD_ALIGN : round_up(n)); }

static void *take(uint8_t *base, size_t *used, size_t bytes) {
    void *p = base ? base + *used : NULL;
    *used += round_up(bytes);
    return p;
}

/* Lays this step's buffers out from `base` (NULL: only measures); the bytes they take. */
static size_t carve(const sd_model *m, const sd_step *s, uint8_t *base, buffers *b) {
    const size_t rows = (size_t)s->rows, h = (size_t)m->hidden, inter = (size_t)m->inter;
    const size_t hqd = (size_t)m->num_heads * m->head_dim, nqkv = (size_t)(m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    const size_t arows = rows > (size_t)s->num_logits ? rows : (size_t)s->num_logits;
    size_t kmax = 2 * h > hqd ? 2 * h : hqd;      /* 2h: an EAGLE head's fc input */
    kmax = inter > kmax ? inter : kmax;
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
    b->qkv = take(base, &used, sizeof(float) * rows * nqkv);
    b->att = take(base, &used, sizeof(float) * rows * hqd);
    b->gu = take(base, &used, sizeof(float) * rows * 2 * inter);
    b->act = take(base, &used, sizeof(float) * rows * inter);
    b->cat = m->fc.data || eagle3 ? take(base, &used, sizeof(float) * rows * 2 * h) : NULL;
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
            memcpy(b->cat + (size_t)r * 2 * h, b->x + (size_t)r * h, sizeof(float) * h);
            memcpy(b->cat + (size_t)r * 2 * h + h, s->features + (size_t)r * h, sizeof(float) * h);
        }
        quantize_for(my, m, 0, b->cat, rows, 2 * h);
        matmul(&m->fc, my, rows, b->x, h, h, 0, m->fc_bias);
    }
}

/* att = attention of every node, after rotary on qkv and the new K, V written to their columns */
static void attention(const sd_model *m, sd_cache *c, const sd_step *s, const buffers *b, float *work, int l) {
    const sd_layer *L = &m->layers[l];
    const int d = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads, nqkv = (hq + 2 * hkv) * d;
    const float *cos = L->rope_cos ? L->rope_cos : m->rope_cos, *sin = L->rope_sin ? L->rope_sin : m->rope_sin;
#pragma omp for schedule(static)
    for (int r = 0; r < s->rows; r++) {
        float *qr = b->qkv + (size_t)r * nqkv;
        int64_t p = s->pos[r];
        if (L->norms[SD_Q_NORM]) rmsnorm_heads(qr, hq, d, L->norms[SD_Q_NORM], m->eps);
        if (L->norms[SD_K_NORM]) rmsnorm_heads(qr + (size_t)hq * d, hkv, d, L->norms[SD_K_NORM], m->eps);
        rope(qr, hq + hkv, d, cos + p * (d / 2), sin + p * (d / 2));
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
                       m->scale, m->attn_softcap, L->window, s->pos + r0, s->ctx[row], s->paths + r0 * s->path_len,
                       s->path_len, n, b->qkv + r0 * nqkv + qh * d, nqkv, b->att + r0 * hq * d + qh * d, hq * d, work,
                       b->zero_col);
    }
}

/* y [rows, width] = a times a fused matrix (w[0] only) or its n parts apart, their outputs side
 * by side (+ bias [width] or NULL) */
static void parts(const sd_matrix *w, int n, const act_q *a, int rows, float *y, int width, const float *bias) {
    if (!w[1].data) {
        matmul(&w[0], a, rows, y, width, width, 0, bias);
        return;
    }
    int off = 0;
    for (int i = 0; i < n && w[i].data; i++) {
        int n_out = i == n - 1 || !w[i + 1].data ? width - off : w[i].rows;
        matmul(&w[i], a, rows, y + off, width, n_out, 0, bias ? bias + off : NULL);
        off += n_out;
    }
}

/* x += a W^T, or x += norm(a W^T) where the architecture norms a block's output (Gemma) */
static void residual(const sd_matrix w, const float *post_norm, const sd_model *m, const act_q *a, int rows,
                     const buffers *b) {
    const int h = m->hidden;
    if (!post_norm) {
        matmul(&w, a, rows, b->x, h, h, 1, NULL);
        return;
    }
    matmul(&w, a, rows, b->hn, h, h, 0, NULL);
    add_normed_rows(b->hn, rows, h, post_norm, m->eps, b->x);
}

/* decoder layer l over every node, the residual stream x in place */
static void layer(const sd_model *m, sd_cache *c, const sd_step *s, const buffers *b, act_q *my, float *work, int l) {
    const sd_layer *L = &m->layers[l];
    const int rows = s->rows, h = m->hidden, hqd = m->num_heads * m->head_dim, inter = m->inter;
    const int nqkv = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim, hw = h * (1 + s->num_features);
    for (int f = 0; f < s->num_features; f++)
        if (s->feature_layers[f] == l) copy_rows(b->x, h, s->hidden + (size_t)(1 + f) * h, hw, rows, h);
    if (L->hidden_norm) {
        rmsnorm_rows(b->emb, rows, h, L->attn_norm, m->eps, b->cat, 2 * h);
        rmsnorm_rows(b->x, rows, h, L->hidden_norm, m->eps, b->cat + h, 2 * h);
        quantize_for(my, m, SD_WIDE_QKV, b->cat, rows, 2 * h);
    } else {
        rmsnorm_rows(b->x, rows, h, L->attn_norm, m->eps, b->hn, h);
        quantize_for(my, m, SD_WIDE_QKV, b->hn, rows, h);
    }
    parts(L->qkv, 3, my, rows, b->qkv, nqkv, L->qkv_bias);
    attention(m, c, s, b, work, l);
    quantize_for(my, m, SD_WIDE_O, b->att, rows, hqd);
    residual(L->o, L->norms[SD_POST_ATTN_NORM], m, my, rows, b);
    rmsnorm_rows(b->x, rows, h, L->mlp_norm, m->eps, b->hn, h);
    quantize_for(my, m, SD_WIDE_GATE_UP, b->hn, rows, h);
    parts(L->gate_up, 2, my, rows, b->gu, 2 * inter, NULL);
    gated_rows(b->gu, rows, inter, m->act == SD_GELU_TANH, b->act);
    quantize_for(my, m, SD_WIDE_DOWN, b->act, rows, inter);
    residual(L->down, L->norms[SD_POST_MLP_NORM], m, my, rows, b);
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

/* 1 when every matrix of the model is one the kernels can run; runtime/native.py asks once, when
 * it loads an engine (not on every forward) */
int sd_model_ok(const sd_model *m) {
    if (!usable(&m->embed) || !usable(&m->lm_head) || (m->fc.data && !usable(&m->fc))) return 0;
    for (int l = 0; l < m->num_layers; l++) {
        const sd_layer *L = &m->layers[l];
        for (int i = 0; i < 3; i++) if ((i == 0 || L->qkv[i].data) && !usable(&L->qkv[i])) return 0;
        for (int i = 0; i < 2; i++) if ((i == 0 || L->gate_up[i].data) && !usable(&L->gate_up[i])) return 0;
        if (!usable(&L->o) || !usable(&L->down)) return 0;
    }
    return 1;
}

/* 0; a refusal (SD_BAD_*, nothing written); or -1: shapes the kernels do not take, a missing
 * input or output, or no memory for the workspace */
int sd_forward(const sd_model *m, sd_cache *c, const sd_step *s, sd_workspace *ws) {
    const int bad = check_step(m, c, s);
    if (bad) return bad;
    const int h = m->hidden, d = m->head_dim;
    if (d % VW || d > MAX_HEAD_DIM || h % QBLOCK || m->inter % QBLOCK || (m->num_heads * d) % QBLOCK) return -1;
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
#define SD_ABI_VERSION 6   /* 3: model flags (Gemma-3), sliding windows, kernel_abi; 4: attn_softcap;
                              5: wide activations (sd_model.wide, sd_matmul's wide); 6: sd_layer.norms
                              by name (sd_norm_names) */
int sd_abi(int64_t *out, int n) {
    int64_t v[8 + 32] = {SD_ABI_VERSION, sizeof(sd_matrix), sizeof(sd_layer), sizeof(sd_model),
                         sizeof(sd_cache), sizeof(sd_step), sizeof(sd_workspace)};
    const int count = 7 + kernel_abi(v + 7);
    for (int i = 0; i < n && i < count; i++) out[i] = v[i];
    return count;
}

/* the names of sd_layer.norms' entries, comma separated, in order */
const char *sd_norm_names(void) { return SD_NORM_NAMES; }

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
