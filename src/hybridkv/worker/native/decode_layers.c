/* A decode step's decoder layers in one call: the pre-norm attention + gated-MLP layer
   (Llama, Qwen, Mistral; Gemma 2/3 with their sandwich norms; Qwen3.5's output-gated
   attention) and the state layers of Qwen3.5 (Gated DeltaNet) and LFM2 (short convs) on
   GGUF-quantized weights.

   At one to a few rows a layer's arithmetic is small (Gemma 3 270M: ~5.6M weights) and
   the ~25 operators around it each cost a Python call, a torch dispatch and an allocation:
   about a third of a batch-1 step went there. Here the layers run back to back from
   descriptors the Python side fills once at load (models/native_decode.py), calling the
   same kernels the operator-by-operator path calls (passed in as function pointers: the
   quantized matmul, RMSNorm, RoPE, the K/V write, the paged attention and cpu_ops.c's
   state steps, output gate and gated head norm), so they compute the same values; only
   the residual adds, the gated activation and an input column gather are written here.

   Scratch (floats, see hkv_decode_scratch): x and o [m, hidden], qkv [m, qkv width],
   q and k after their norms and after RoPE (RoPE reads a row while writing it, so not in
   place), the attention's output [m, heads * head dim], gate/up [m, 2 * intermediate] and
   act(gate) * up [m, intermediate]. */

#include <stdint.h>
#include <string.h>

#include "simd.h"

typedef void (*rms_norm_fn)(const float *, int64_t, int64_t, float *, int64_t, int64_t,
                            int64_t, const float *, float, float);
typedef void (*rope_fn)(const float *, int64_t, int64_t, float *, int64_t, int64_t, int64_t,
                        const float *, const float *, int64_t);
typedef void (*write_kv_fn)(const float *, int64_t, int64_t, const float *, int64_t, int64_t,
                            int64_t, int64_t, int64_t, const int64_t *, float *, int64_t,
                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
typedef int (*attention_fn)(const float *, int64_t, int64_t, float *, int64_t, int64_t,
                            const char *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, const int64_t *, int64_t,
                            const int64_t *, int64_t, const int64_t *, const int64_t *,
                            int64_t, int64_t, int64_t, float, int64_t, int64_t, float,
                            const float *, const float *, int64_t, const int64_t *, int64_t);
/* quant_gemm.c's hkv_quant_gemm: one order of arithmetic for every row count, so a
   decode step's rows are the bytes the operator path gives them at any batch. */
typedef int (*matmul_fn)(const float *, int64_t, int64_t, const uint8_t *, int64_t, int,
                         int64_t, int64_t, float *, int64_t, int, const uint8_t *);

/* cpu_ops.c's state-mixer steps (the calls the operator path makes for decode rows). */
typedef void (*gdn_gates_fn)(const float *, int64_t, const float *, int64_t, int64_t, int64_t,
                             const float *, const float *, float, float *, float *);
typedef void (*gdn_decode_fn)(float *, const int64_t *, float *, const int64_t *, int64_t,
                              const float *, int64_t, const float *, int64_t, const float *,
                              const float *, int64_t, int64_t, int64_t, int64_t, float *,
                              float *);
typedef void (*head_norm_fn)(const float *, const float *, int64_t, int64_t, int64_t, int64_t,
                             const float *, float, float *);
typedef void (*sigmoid_gate_fn)(float *, const float *, int64_t, int64_t, int64_t, int64_t,
                                int64_t);
typedef void (*short_conv_fn)(float *, const int64_t *, int64_t, const float *, int64_t,
                              const float *, const float *, int64_t, int64_t, float *);

typedef struct {
    void *rms_norm, *rope, *write_kv, *attention, *matmul;
    void *gdn_gates, *gdn_decode, *gated_head_norm, *sigmoid_gate, *short_conv;
} hkv_kernels;

/* One quantized matrix: rows of `cols` values, `ldw` bytes apart. `order` (NULL: none):
   the matrix row of each output (rows the file stores in another order, llama.cpp's q/k
   permutation: worker/linear/quant.py QuantizedWeight.row_order); q/k/v parts only. */
typedef struct {
    const uint8_t *w;
    int64_t ldw, type, rows;
    const int64_t *order;
} hkv_qmatrix;

#define MAX_PARTS 3

typedef struct {
    /* Norm weights (NULL: the layer has no such norm; a NULL input or pre-FFN norm is
       refused at load). The layer's four norms share offset and eps, q/k norms theirs. */
    const float *in_norm, *post_attn_norm, *pre_ffn_norm, *post_ffn_norm, *q_norm, *k_norm;
    float norm_offset, eps, qk_offset, qk_eps;
    hkv_qmatrix qkv[MAX_PARTS]; /* side by side: q | k | v columns of one output row */
    int64_t n_qkv;
    hkv_qmatrix o;
    hkv_qmatrix gate_up[MAX_PARTS]; /* gate | up columns */
    int64_t n_gate_up;
    hkv_qmatrix down;
    int64_t heads, kv_heads, head_dim, intermediate, act; /* act: 1 SiLU, 2 GELU (tanh) */
    int64_t rope, rotary_dim;                              /* rope: cos/sin table index */
    float scale, softcap;
    int64_t window;
    /* The layer's K/V pages [pages, per_page, 2, block, Hk, D], strides in floats. */
    float *cache;
    int64_t cs[5];
    int64_t group; /* its KV cache group's step metadata */
    /* What the layer mixes tokens with: 0 attention, 1 Gated DeltaNet (Qwen3.5), 2 a short
       conv (LFM2). Attention with q_gate: each head's q_proj rows are q, then its output
       gate (Qwen3-Next, Qwen3.5). */
    int64_t mixer, q_gate;
    /* State mixers: in[] their in-projections (Gated DeltaNet: q|k|v, z, b, a; short conv:
       B|C|x), `o` their out-projection, o_cols (NULL: none) the input column each of its
       columns reads (a file's reordered columns). */
    hkv_qmatrix in[4];
    int64_t n_in;
    const int64_t *o_cols;
    const float *conv_w, *conv_b; /* [channels, kernel] */
    int64_t kernel;
    const float *dt_bias, *a_neg, *head_norm; /* Gated DeltaNet: a_neg = -exp(A_log) */
    float beta_scale, head_eps;
    int64_t k_heads, v_heads, k_dim, v_dim;
    float *conv_states, *ssm_states;
    const int64_t *conv_at, *ssm_at; /* per step: each row's states, in floats from those */
} hkv_layer;

/* A KV cache group's metadata for this step (worker/attention/backend.py: AttentionMetadata). */
typedef struct {
    const int64_t *block_table, *slot_mapping, *rows, *query_start_loc, *seq_lens;
    int64_t table_stride, num_rows, block_size, kernel_block_size, blocks_per_page;
} hkv_group;

static void gated(const float *gu, int64_t m, int64_t n, int act, float *out) {
    for (int64_t i = 0; i < m; i++) gated_row(gu + i * 2 * n, gu + i * 2 * n + n, n, act, out + i * n);
}

/* y = x W^T for one matrix, or act(x G^T) * (x U^T) (mode: 1 SiLU, 2 GELU-tanh): G = w,
   U = up (w and up of one type and width), or, up NULL, w's n / 2 gate rows then n / 2 up
   rows. */
static int product1(const hkv_kernels *k, const float *x, int64_t m, int64_t ldx,
                    const hkv_qmatrix *w, const hkv_qmatrix *up, int64_t cols, float *y,
                    int64_t ldy, int mode) {
    const int64_t n = !mode ? w->rows : up != NULL ? w->rows : w->rows / 2;
    const int rc = ((matmul_fn)k->matmul)(x, m, ldx, w->w, w->ldw, (int)w->type, n, cols, y,
                                          ldy, mode, up != NULL ? up->w : NULL);
    return rc == -2 ? 2 : rc != 0 ? 3 : 0;
}

static int product(const hkv_kernels *k, const float *x, int64_t m, int64_t ldx,
                   const hkv_qmatrix *parts, int64_t n, int64_t cols, float *y, int64_t ldy) {
    for (int64_t p = 0; p < n; p++) {
        const int rc = product1(k, x, m, ldx, &parts[p], NULL, cols, y, ldy, 0);
        if (rc != 0) return rc;
        if (parts[p].order != NULL) {
            const int64_t rows = parts[p].rows;
            float row[rows];
            for (int64_t i = 0; i < m; i++) {
                memcpy(row, y + i * ldy, sizeof(float) * rows);
                for (int64_t j = 0; j < rows; j++) y[i * ldy + j] = row[parts[p].order[j]];
            }
        }
        y += parts[p].rows;
    }
    return 0;
}

/* h += norm(y) (norm NULL: h += y), row by row; y may be overwritten. */
static void add_normed(const hkv_kernels *k, float *h, float *y, int64_t m, int64_t hidden,
                       const float *norm, float offset, float eps) {
    if (norm != NULL)
        ((rms_norm_fn)k->rms_norm)(y, hidden, 0, y, m, 1, hidden, norm, offset, eps);
    for (int64_t i = 0; i < m * hidden; i++) h[i] += y[i];
}

/* Floats per row a state mixer needs past x and o (see its step below). */
static int64_t state_scratch(const hkv_layer *L, int64_t hidden) {
    if (L->mixer == 2) return 3 * hidden + hidden;
    const int64_t ks = L->k_heads * L->k_dim, vs = L->v_heads * L->v_dim;
    const int64_t channels = 2 * ks + vs;
    return 2 * channels + vs + 4 * L->v_heads + 3 * vs;
}

/* Floats per row a layer's mixer needs past x and o: a state mixer's, or attention's
   q|(gate)|k|v, q and k after their norms and after RoPE, and its output. */
static int64_t mixer_scratch(const hkv_layer *L, int64_t hidden) {
    if (L->mixer != 0) return state_scratch(L, hidden);
    const int64_t q = L->heads * L->head_dim, kv = L->kv_heads * L->head_dim;
    return (1 + (L->q_gate != 0)) * q + 2 * kv + 2 * (q + kv) + q;
}

int64_t hkv_decode_scratch(const hkv_layer *layers, int64_t n, int64_t m, int64_t hidden) {
    int64_t most = 0;
    for (int64_t l = 0; l < n; l++) {
        const hkv_layer *L = &layers[l];
        const int64_t need = 2 * hidden + mixer_scratch(L, hidden) + 3 * L->intermediate;
        if (need > most) most = need;
    }
    return m * most;
}

/* A state mixer's step on x [m, hidden] (normed) into o [m, hidden], in `w`'s floats; each
   row's states at conv_states + conv_at[r] (and ssm_states + ssm_at[r]) updated in place. */
static int state_mixer(const hkv_kernels *k, const hkv_layer *L, const float *x, int64_t m,
                       int64_t hidden, float *o, float *w) {
    int rc;
    const float *y;
    int64_t width;
    if (L->mixer == 2) { /* LFM2: y = C * conv(B * x) */
        float *bcx = w, *out = bcx + m * 3 * hidden;
        if ((rc = product(k, x, m, hidden, L->in, 1, hidden, bcx, 3 * hidden)) != 0) return rc;
        ((short_conv_fn)k->short_conv)(L->conv_states, L->conv_at, m, bcx, 3 * hidden,
                                       L->conv_w, L->conv_b, L->kernel, hidden, out);
        y = out, width = hidden;
    } else { /* Gated DeltaNet */
        const int64_t ks = L->k_heads * L->k_dim, vs = L->v_heads * L->v_dim, hv = L->v_heads;
        const int64_t channels = 2 * ks + vs;
        float *mixed = w, *z = mixed + m * channels, *b = z + m * vs, *a = b + m * hv;
        float *beta = a + m * hv, *g = beta + m * hv, *work = g + m * hv;
        float *out = work + m * channels, *normed = out + m * vs, *cols = normed + m * vs;
        if ((rc = product(k, x, m, hidden, &L->in[0], 1, hidden, mixed, channels)) != 0 ||
            (rc = product(k, x, m, hidden, &L->in[1], 1, hidden, z, vs)) != 0 ||
            (rc = product(k, x, m, hidden, &L->in[2], 1, hidden, b, hv)) != 0 ||
            (rc = product(k, x, m, hidden, &L->in[3], 1, hidden, a, hv)) != 0)
            return rc;
        ((gdn_gates_fn)k->gdn_gates)(b, hv, a, hv, m, hv, L->dt_bias, L->a_neg, L->beta_scale,
                                     beta, g);
        ((gdn_decode_fn)k->gdn_decode)(L->conv_states, L->conv_at, L->ssm_states, L->ssm_at, m,
                                       mixed, channels, L->conv_w, L->kernel, beta, g,
                                       L->k_heads, hv, L->k_dim, L->v_dim, out, work);
        ((head_norm_fn)k->gated_head_norm)(out, z, vs, m, hv, L->v_dim, L->head_norm,
                                           L->head_eps, normed);
        y = normed, width = vs;
        if (L->o_cols != NULL) {
            for (int64_t i = 0; i < m; i++)
                for (int64_t j = 0; j < vs; j++) cols[i * vs + j] = normed[i * vs + L->o_cols[j]];
            y = cols;
        }
    }
    return product(k, y, m, width, &L->o, 1, width, o, hidden);
}

/* Attention on x [m, hidden] (normed) into o [m, hidden], in `w`'s floats: q/k/v, their
   norms and RoPE, the K/V write, paged attention, the output gate, o_proj. */
static int attention_mixer(const hkv_kernels *k, const hkv_layer *L, const hkv_group *G,
                           const float *const *cos, const float *const *sin, const float *x,
                           int64_t m, int64_t hidden, float *o, float *w, int64_t threads) {
    const int64_t D = L->head_dim, qw = L->heads * D, kw = L->kv_heads * D;
    /* q_gate: q_proj's output is each head's q then its gate (2 D floats a head). */
    const int64_t qf = L->q_gate ? 2 * qw : qw, hs = L->q_gate ? 2 * D : D;
    const int64_t width = qf + 2 * kw;
    float *qkv = w, *qn = qkv + m * width, *kn = qn + m * qw, *q = kn + m * kw;
    float *kk = q + m * qw, *att = kk + m * kw;
    int rc;
    if ((rc = product(k, x, m, hidden, L->qkv, L->n_qkv, hidden, qkv, width)) != 0) return rc;
    /* q and k: their norms (into qn / kn), then RoPE (into q / kk). Without a norm RoPE
       reads the projection directly; without either attention does. */
    const float *qs = qkv, *ks = qkv + qf;
    int64_t qs0 = width, qs1 = hs, ks0 = width;
    if (L->q_norm != NULL) {
        ((rms_norm_fn)k->rms_norm)(qkv, width, hs, qn, m, L->heads, D, L->q_norm, L->qk_offset,
                                   L->qk_eps);
        qs = qn, qs0 = qw, qs1 = D;
    }
    if (L->k_norm != NULL) {
        ((rms_norm_fn)k->rms_norm)(qkv + qf, width, D, kn, m, L->kv_heads, D, L->k_norm,
                                   L->qk_offset, L->qk_eps);
        ks = kn, ks0 = kw;
    }
    if (L->rope >= 0) {
        ((rope_fn)k->rope)(qs, qs0, qs1, q, m, L->heads, D, cos[L->rope], sin[L->rope],
                           L->rotary_dim);
        ((rope_fn)k->rope)(ks, ks0, D, kk, m, L->kv_heads, D, cos[L->rope], sin[L->rope],
                           L->rotary_dim);
        qs = q, qs0 = qw, qs1 = D, ks = kk, ks0 = kw;
    }
    ((write_kv_fn)k->write_kv)(ks, ks0, D, qkv + qf + kw, width, D, m, L->kv_heads, D,
                               G->slot_mapping, L->cache, L->cs[0], L->cs[1], L->cs[2],
                               L->cs[3], L->cs[4], G->block_size, G->blocks_per_page);
    const int64_t f = (int64_t)sizeof(float);
    rc = ((attention_fn)k->attention)(
        qs, qs0, qs1, att, qw, D, (const char *)L->cache, 0, L->cs[0] * f, L->cs[1] * f,
        L->cs[2] * f, L->cs[3] * f, L->cs[4] * f, G->block_size, G->kernel_block_size,
        G->blocks_per_page, G->block_table, G->table_stride, G->rows, G->num_rows,
        G->query_start_loc, G->seq_lens, L->heads, L->kv_heads, D, L->scale, L->window, 0,
        L->softcap, NULL, NULL, 0, NULL, threads);
    if (rc != 0) return 4;
    if (L->q_gate) ((sigmoid_gate_fn)k->sigmoid_gate)(att, qkv + D, width, hs, m, L->heads, D);
    return product(k, att, m, qw, &L->o, 1, qw, o, hidden);
}

/* h [m, hidden] (rows contiguous) through layers 0..n-1, in place. cos/sin: per RoPE table,
   [m, rotary_dim] rows. Returns 0; 2 where a product could not allocate, 3 where the
   kernel refused a matrix, 4 where the attention kernel refused its arguments. */
int hkv_decode_layers(const hkv_layer *layers, int64_t n, const hkv_group *groups,
                      const hkv_kernels *k, const float *const *cos, const float *const *sin,
                      float *h, int64_t m, int64_t hidden, float *scratch, int64_t threads) {
    for (int64_t l = 0; l < n; l++) {
        const hkv_layer *L = &layers[l];
        const int64_t I = L->intermediate, mix = mixer_scratch(L, hidden);
        /* x and o, then the mixer's floats, then the MLP's gate/up and activation. */
        float *x = scratch, *o = x + m * hidden, *w = o + m * hidden;
        float *gu = w + m * mix, *act = gu + m * 2 * I;
        int rc;

        ((rms_norm_fn)k->rms_norm)(h, hidden, 0, x, m, 1, hidden, L->in_norm, L->norm_offset,
                                   L->eps);
        rc = L->mixer != 0 ? state_mixer(k, L, x, m, hidden, o, w)
                           : attention_mixer(k, L, &groups[L->group], cos, sin, x, m, hidden,
                                             o, w, threads);
        if (rc != 0) return rc;
        add_normed(k, h, o, m, hidden, L->post_attn_norm, L->norm_offset, L->eps);
        ((rms_norm_fn)k->rms_norm)(h, hidden, 0, x, m, 1, hidden, L->pre_ffn_norm,
                                   L->norm_offset, L->eps);
        const hkv_qmatrix *gu2 = L->gate_up;
        if (L->n_gate_up == 1 || (L->n_gate_up == 2 && gu2[0].type == gu2[1].type &&
                                  gu2[0].ldw == gu2[1].ldw && gu2[0].rows == gu2[1].rows)) {
            /* Gate and up of one type (one matrix, or two where the file holds them): the
               kernel applies the activation and product. */
            if ((rc = product1(k, x, m, hidden, gu2, L->n_gate_up == 2 ? &gu2[1] : NULL, hidden,
                               act, I, (int)L->act)) != 0)
                return rc;
        } else {
            if ((rc = product(k, x, m, hidden, L->gate_up, L->n_gate_up, hidden, gu, 2 * I)))
                return rc;
            gated(gu, m, I, (int)L->act, act);
        }
        if ((rc = product(k, act, m, I, &L->down, 1, I, o, hidden)) != 0) return rc;
        add_normed(k, h, o, m, hidden, L->post_ffn_norm, L->norm_offset, L->eps);
    }
    return 0;
}
