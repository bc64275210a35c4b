/* A decode step's decoder layers in one call: the pre-norm attention + gated-MLP layer
   (Llama, Qwen, Mistral; Gemma 2/3 with their sandwich norms) on GGUF-quantized weights.

   At one to a few rows a layer's arithmetic is small (Gemma 3 270M: ~5.6M weights) and
   the ~25 operators around it each cost a Python call, a torch dispatch and an allocation:
   about a third of a batch-1 step went there. Here the layers run back to back from
   descriptors the Python side fills once at load (models/native_decode.py), calling the
   same kernels the operator-by-operator path calls (passed in as function pointers: the
   quantized matmul, RMSNorm, RoPE, the K/V write and the paged attention), so they compute
   the same values; only the residual adds and the gated activation are written here.

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

typedef struct {
    void *rms_norm, *rope, *write_kv, *attention, *matmul;
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

int64_t hkv_decode_scratch(const hkv_layer *layers, int64_t n, int64_t m, int64_t hidden) {
    int64_t most = 0;
    for (int64_t l = 0; l < n; l++) {
        const hkv_layer *L = &layers[l];
        const int64_t q = L->heads * L->head_dim, kv = L->kv_heads * L->head_dim;
        const int64_t need = 2 * hidden + (q + 2 * kv) + 2 * (q + kv) + q +
                             3 * L->intermediate;
        if (need > most) most = need;
    }
    return m * most;
}

/* h [m, hidden] (rows contiguous) through layers 0..n-1, in place. cos/sin: per RoPE table,
   [m, rotary_dim] rows. Returns 0; 2 where a product could not allocate, 3 where the
   kernel refused a matrix, 4 where the attention kernel refused its arguments. */
int hkv_decode_layers(const hkv_layer *layers, int64_t n, const hkv_group *groups,
                      const hkv_kernels *k, const float *const *cos, const float *const *sin,
                      float *h, int64_t m, int64_t hidden, float *scratch, int64_t threads) {
    for (int64_t l = 0; l < n; l++) {
        const hkv_layer *L = &layers[l];
        const hkv_group *G = &groups[L->group];
        const int64_t D = L->head_dim, qw = L->heads * D, kw = L->kv_heads * D;
        const int64_t width = qw + 2 * kw, I = L->intermediate;
        float *x = scratch, *o = x + m * hidden, *qkv = o + m * hidden;
        float *qn = qkv + m * width, *kn = qn + m * qw, *q = kn + m * kw, *kk = q + m * qw;
        float *att = kk + m * kw, *gu = att + m * qw;
        float *act = gu + m * 2 * I;
        int rc;

        ((rms_norm_fn)k->rms_norm)(h, hidden, 0, x, m, 1, hidden, L->in_norm, L->norm_offset,
                                   L->eps);
        if ((rc = product(k, x, m, hidden, L->qkv, L->n_qkv, hidden, qkv, width)) != 0)
            return rc;
        /* q and k: their norms (into qn / kn), then RoPE (into q / kk). Without a norm RoPE
           reads the projection directly; without either attention does. */
        const float *qs = qkv, *ks = qkv + qw;
        int64_t qs0 = width, ks0 = width;
        if (L->q_norm != NULL) {
            ((rms_norm_fn)k->rms_norm)(qkv, width, D, qn, m, L->heads, D, L->q_norm,
                                       L->qk_offset, L->qk_eps);
            qs = qn, qs0 = qw;
        }
        if (L->k_norm != NULL) {
            ((rms_norm_fn)k->rms_norm)(qkv + qw, width, D, kn, m, L->kv_heads, D, L->k_norm,
                                       L->qk_offset, L->qk_eps);
            ks = kn, ks0 = kw;
        }
        if (L->rope >= 0) {
            ((rope_fn)k->rope)(qs, qs0, D, q, m, L->heads, D, cos[L->rope], sin[L->rope],
                               L->rotary_dim);
            ((rope_fn)k->rope)(ks, ks0, D, kk, m, L->kv_heads, D, cos[L->rope],
                               sin[L->rope], L->rotary_dim);
            qs = q, qs0 = qw, ks = kk, ks0 = kw;
        }
        ((write_kv_fn)k->write_kv)(ks, ks0, D, qkv + qw + kw, width, D, m, L->kv_heads, D,
                                   G->slot_mapping, L->cache, L->cs[0], L->cs[1], L->cs[2],
                                   L->cs[3], L->cs[4], G->block_size, G->blocks_per_page);
        const int64_t f = (int64_t)sizeof(float);
        rc = ((attention_fn)k->attention)(
            qs, qs0, D, att, qw, D, (const char *)L->cache, 0, L->cs[0] * f, L->cs[1] * f,
            L->cs[2] * f, L->cs[3] * f, L->cs[4] * f, G->block_size, G->kernel_block_size,
            G->blocks_per_page, G->block_table, G->table_stride, G->rows, G->num_rows,
            G->query_start_loc, G->seq_lens, L->heads, L->kv_heads, D, L->scale, L->window,
            0, L->softcap, NULL, NULL, 0, NULL, threads);
        if (rc != 0) return 4;
        if ((rc = product(k, att, m, qw, &L->o, 1, qw, o, hidden)) != 0) return rc;
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
