/* Per-token ops around attention on the CPU, float32: RMSNorm, RoPE, K/V writes.

   Each is a few microseconds of work on a decode step's [batch, width] rows, where a torch
   op costs a dispatch per step of its formula (RMSNorm is five ops on the CPU: pow, mean,
   add, rsqrt, mul, each allocating). Here each is one call over all rows. Inputs are rows
   of `dim` contiguous floats addressed by two strides (tokens, then heads), so q and k read
   straight out of a fused q/k/v projection's output. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "simd.h"

/* out[t, h, :] = x[t, h, :] / rms(x[t, h, :]) * (offset + w); w NULL: no weight. */
void hkv_rms_norm_f32(const float *x, int64_t x_stride0, int64_t x_stride1, float *out,
                      int64_t n0, int64_t n1, int64_t dim, const float *w, float offset,
                      float eps) {
    for (int64_t t = 0; t < n0; t++)
        for (int64_t h = 0; h < n1; h++) {
            const float *row = x + t * x_stride0 + h * x_stride1;
            float *dst = out + (t * n1 + h) * dim;
            float ss = 0.f;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < dim; d++) ss += row[d] * row[d];
            const float inv = 1.f / sqrtf(ss / (float)dim + eps);
            if (w == NULL) {
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) dst[d] = row[d] * inv;
            } else {
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) dst[d] = row[d] * inv * (offset + w[d]);
            }
        }
}

/* RoPE, the half-split convention: the first `rot` of each head rotated by (cos, sin) of
   the token ([n0, rot] rows, the first half's angles repeated in the second), the rest of
   the head copied. out is [n0, n1, dim] contiguous. */
void hkv_rope_f32(const float *x, int64_t x_stride0, int64_t x_stride1, float *out,
                  int64_t n0, int64_t n1, int64_t dim, const float *cos, const float *sin,
                  int64_t rot) {
    const int64_t half = rot / 2;
    for (int64_t t = 0; t < n0; t++) {
        const float *c = cos + t * rot, *s = sin + t * rot;
        for (int64_t h = 0; h < n1; h++) {
            const float *row = x + t * x_stride0 + h * x_stride1;
            float *dst = out + (t * n1 + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                dst[i] = row[i] * c[i] - row[i + half] * s[i];
                dst[i + half] = row[i + half] * c[i + half] + row[i] * s[i + half];
            }
            if (rot < dim) memcpy(dst + rot, row + rot, sizeof(float) * (dim - rot));
        }
    }
}

/* K and V rows ([n0 tokens, n1 heads, dim], two strides each) into their slots of the KV
   view [pages, blocks_per_page, 2, block, Hk, D] (strides in floats). */
void hkv_write_kv_f32(const float *k, int64_t k_stride0, int64_t k_stride1, const float *v,
                      int64_t v_stride0, int64_t v_stride1, int64_t n0, int64_t n1,
                      int64_t dim, const int64_t *slots, float *cache, int64_t page_stride,
                      int64_t slot_stride, int64_t kv_stride, int64_t token_stride,
                      int64_t head_stride, int64_t block_size, int64_t blocks_per_page) {
    for (int64_t t = 0; t < n0; t++) {
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        float *base = cache + (block / blocks_per_page) * page_stride
                      + (block % blocks_per_page) * slot_stride + offset * token_stride;
        for (int64_t h = 0; h < n1; h++) {
            memcpy(base + h * head_stride, k + t * k_stride0 + h * k_stride1,
                   sizeof(float) * dim);
            memcpy(base + kv_stride + h * head_stride, v + t * v_stride0 + h * v_stride1,
                   sizeof(float) * dim);
        }
    }
}

/* softplus as torch computes it: the input itself past 20. */
static inline float softplus(float v) { return v > 20.f ? v : log1pf(expf(v)); }

/* One token of a depthwise causal conv from its state, then silu: out[c] = silu(bias[c] +
   sum_j w[c, j] win[j, c]) (win: the state's kernel - 1 inputs, then in[c]; bias may be
   NULL), the token shifted into the state [channels, kernel - 1]. The decode steps' conv. */
static void conv_token_silu(float *cs, const float *in, const float *weight, const float *bias,
                            int64_t kernel, int64_t channels, float *out) {
    const int64_t keep = kernel - 1;
    for (int64_t c = 0; c < channels; c++) {
        float *win = cs + c * keep;
        const float *w = weight + c * kernel;
        float acc = bias != NULL ? bias[c] : 0.f;
        for (int64_t j = 0; j < keep; j++) acc += w[j] * win[j];
        acc += w[keep] * in[c];
        for (int64_t j = 0; j + 1 < keep; j++) win[j] = win[j + 1];
        if (keep > 0) win[keep - 1] = in[c];
        out[c] = acc;
    }
#pragma omp simd
    for (int64_t c = 0; c < channels; c++) out[c] = gated_act(out[c], 1.f, 1);
}

/* One Mamba-2 decode step of `rows` requests, from the in-projection's rows to y, each
   request's conv and SSM states updated in place:
       conv[c]        = bias[c] + sum_j w[c, j] win[j, c]   (win: the state's kernel - 1
                        inputs, then this token's xbc[r, c]), then silu; the state shifts in
       x, B, C        = conv[0 .. inner), [inner .. + G N), [inner + G N .. + G N)
       dt'            = softplus(dt[r, h] + dt_bias[h])          (no floor in single steps)
       state[h, p, :] = state[h, p, :] * exp(dt' a[h]) + x[h, p] dt' * B[g, :]
       y[r, h, p]     = state[h, p, :] . C[g, :] + x[h, p] skip[h]     (g: head h's group)
   Row r's conv state [channels, kernel - 1] sits at conv_states + conv_offsets[r], its SSM
   state [heads, head_dim, state_size] at ssm_states + ssm_offsets[r]. One pass reads and
   writes each state once; the torch code gathers the rows' states, builds an outer-product
   temporary the size of a state, scatters them back and runs ~25 ops a layer. work:
   channels floats. */
void hkv_mamba2_decode_f32(float *conv_states, const int64_t *conv_offsets, float *ssm_states,
                           const int64_t *ssm_offsets, int64_t rows, const float *xbc,
                           int64_t xbc_stride, const float *weight, const float *bias,
                           int64_t kernel, int64_t channels, const float *dt,
                           int64_t dt_stride, const float *dt_bias, const float *a,
                           const float *skip, int64_t heads, int64_t head_dim,
                           int64_t state_size, int64_t groups, float *y, float *work) {
    const int64_t per = heads / groups, inner = heads * head_dim;
    for (int64_t r = 0; r < rows; r++) {
        conv_token_silu(conv_states + conv_offsets[r], xbc + r * xbc_stride, weight, bias,
                        kernel, channels, work);
        const float *x = work, *b = work + inner, *cc = work + inner + groups * state_size;
        float *st = ssm_states + ssm_offsets[r];
        for (int64_t h = 0; h < heads; h++) {
            const float dtv = softplus(dt[r * dt_stride + h] + dt_bias[h]);
            const float dcy = expf(dtv * a[h]);
            const float *bg = b + (h / per) * state_size, *cg = cc + (h / per) * state_size;
            for (int64_t p = 0; p < head_dim; p++) {
                float *row = st + (h * head_dim + p) * state_size;
                const float xv = x[h * head_dim + p], u = xv * dtv;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t n = 0; n < state_size; n++) {
                    const float v = row[n] * dcy + u * bg[n];
                    row[n] = v;
                    acc += v * cg[n];
                }
                y[r * inner + h * head_dim + p] = acc + xv * skip[h];
            }
        }
    }
}

/* One request's Mamba-2 prompt after its convolution, token by token (the recurrence
   hkv_mamba2_decode_f32 steps, which the chunked form in models/layers/ssd.py equals to float
   rounding), from the conv's output rows: x (heads * head_dim), B at b_offset and C at
   c_offset (groups * state_size each) in rows of xbc_stride floats, and dt [t, heads]:
       dt'            = max(softplus(dt[t, h] + dt_bias[h]), dt_min)
       state[h, p, :] = state[h, p, :] * exp(dt' a[h]) + x[t, h, p] dt' * b[t, g, :]
       y[t, h, p]     = state[h, p, :] . c[t, g, :] + x[t, h, p] skip[h]
   (g: head h's group). state [heads, head_dim, state_size] in place; saves[k] (k <
   num_saves) receives the state after save_at[k] tokens (0 < save_at[k] <= tokens,
   ascending), each a [heads, head_dim, state_size] float buffer. Heads outermost, each
   head's state turned to [state_size, head_dim] in `work` for the whole prompt: the update
   and the output then run along head_dim with B's and C's values broadcast, no sum across
   a vector's lanes, and the state (16 KiB at 64 x 64) stays in L1 across the tokens. On
   one core 2-3x the chunked form's time at Nemotron-H's and Mamba2's shapes (128-1,050
   tokens). work: 2 tokens heads + head_dim state_size floats. */
static void to_np(const float *restrict src, float *restrict dst, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < cols; k++) dst[k * rows + r] = src[r * cols + k];
}

/* One token of one head: st [state_size, head_dim] updated with u = x dt (x: the head's
   head_dim inputs), y[0 .. head_dim) = st . c + x skip written. */
static void ssd_token(float *restrict st, int64_t head_dim, int64_t state_size, float dcy,
                      const float *restrict x, float dtv, const float *bg, const float *cg,
                      float skip, float *restrict yt) {
#if defined(__AVX512F__)
    if (head_dim == 64) { /* Mamba-2's usual head: y in four registers */
        const __m512 d = _mm512_set1_ps(dcy), dv = _mm512_set1_ps(dtv);
        const __m512 xv[4] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16),
                              _mm512_loadu_ps(x + 32), _mm512_loadu_ps(x + 48)};
        const __m512 uv[4] = {_mm512_mul_ps(xv[0], dv), _mm512_mul_ps(xv[1], dv),
                              _mm512_mul_ps(xv[2], dv), _mm512_mul_ps(xv[3], dv)};
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                         _mm512_setzero_ps()};
        for (int64_t n = 0; n < state_size; n++) {
            float *col = st + n * 64;
            const __m512 bn = _mm512_set1_ps(bg[n]), cn = _mm512_set1_ps(cg[n]);
            for (int j = 0; j < 4; j++) {
                const __m512 v = _mm512_fmadd_ps(
                    uv[j], bn, _mm512_mul_ps(_mm512_loadu_ps(col + 16 * j), d));
                _mm512_storeu_ps(col + 16 * j, v);
                acc[j] = _mm512_fmadd_ps(v, cn, acc[j]);
            }
        }
        const __m512 sk = _mm512_set1_ps(skip);
        for (int j = 0; j < 4; j++)
            _mm512_storeu_ps(yt + 16 * j, _mm512_add_ps(acc[j], _mm512_mul_ps(xv[j], sk)));
        return;
    }
#endif
    float u[head_dim];
    for (int64_t p = 0; p < head_dim; p++) {
        u[p] = x[p] * dtv;
        yt[p] = 0.f;
    }
    for (int64_t n = 0; n < state_size; n++) {
        float *restrict col = st + n * head_dim;
        const float bn = bg[n], cn = cg[n];
#pragma omp simd
        for (int64_t p = 0; p < head_dim; p++) {
            const float v = col[p] * dcy + u[p] * bn;
            col[p] = v;
            yt[p] += v * cn;
        }
    }
    for (int64_t p = 0; p < head_dim; p++) yt[p] += x[p] * skip;
}

/* One head's recurrence over the prompt (hkv_mamba2_scan_f32), in `st`, a
   [state_size, head_dim] buffer of its own. */
static void scan_head(float *state, int64_t h, int64_t tokens, int64_t heads, int64_t head_dim,
                      int64_t state_size, int64_t per, int64_t size, int64_t inner,
                      const float *xbc, int64_t xbc_stride, int64_t b_offset,
                      int64_t c_offset, const float *dts, const float *decay,
                      const float *skip, const int64_t *save_at, int64_t num_saves,
                      float *const *saves, float *y, float *st) {
    to_np(state + h * size, st, head_dim, state_size);
    const int64_t g = h / per;
    int64_t next = 0;
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = xbc + t * xbc_stride;
        ssd_token(st, head_dim, state_size, decay[t * heads + h], row + h * head_dim,
                  dts[t * heads + h], row + b_offset + g * state_size,
                  row + c_offset + g * state_size, skip[h], y + t * inner + h * head_dim);
        while (next < num_saves && save_at[next] == t + 1) {
            to_np(st, saves[next] + h * size, state_size, head_dim);
            next++;
        }
    }
    to_np(st, state + h * size, state_size, head_dim);
}

void hkv_mamba2_scan_f32(float *state, int64_t tokens, int64_t heads, int64_t head_dim,
                         int64_t state_size, int64_t groups, const float *xbc,
                         int64_t xbc_stride, int64_t b_offset, int64_t c_offset,
                         const float *dt, int64_t dt_stride, const float *dt_bias,
                         const float *a, const float *skip, float dt_min,
                         const int64_t *save_at, int64_t num_saves, float *const *saves,
                         float *y, float *work) {
    const int64_t per = heads / groups, size = head_dim * state_size, inner = heads * head_dim;
    float *dts = work, *decay = work + tokens * heads, *st = work + 2 * tokens * heads;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            float v = softplus(dt[t * dt_stride + h] + dt_bias[h]);
            if (v < dt_min) v = dt_min;
            dts[t * heads + h] = v;
            decay[t * heads + h] = expf(v * a[h]);
        }
    /* Heads are independent: split over torch's OpenMP threads, each head's recurrence in
       a buffer of its thread's (the first thread's in `work`, the others' from malloc, or
       their stack where that fails), the same operations in the same order as on one
       thread, so the same bytes. */
    const int parallel = heads > 1 && tokens * heads * size >= (1 << 18);
#pragma omp parallel if (parallel)
    {
        float *own = NULL;
#ifdef _OPENMP
        if (omp_get_thread_num() > 0) own = malloc(sizeof(float) * size);
        const int on_stack = omp_get_thread_num() > 0 && own == NULL;
#else
        const int on_stack = 0;
#endif
        float local[on_stack ? size : 1];
        float *buf = on_stack ? local : own != NULL ? own : st;
#pragma omp for schedule(static)
        for (int64_t h = 0; h < heads; h++)
            scan_head(state, h, tokens, heads, head_dim, state_size, per, size, inner, xbc,
                      xbc_stride, b_offset, c_offset, dts, decay, skip, save_at, num_saves,
                      saves, y, buf);
        free(own);
    }
}

/* Depthwise causal convolution of one request's tokens, continuing from its last `kernel
   - 1` inputs: out[t, c] = bias[c] + sum_j weight[c, j] win[t + j, c], win the state's
   inputs then the tokens' (x rows of `channels` floats, row stride x_stride); then silu
   if asked. conv_state [channels, kernel - 1] becomes the last kernel - 1 inputs, and
   saves[k] (k < num_saves, same layout) the kernel - 1 inputs before token save_at[k]
   (0 <= save_at[k] <= tokens). Vectorised along the channels, which torch's depthwise
   conv1d on the CPU is not (~0.3 ms for a 128-token Mamba-2 prompt against ~0.03 here). */
void hkv_causal_conv_f32(const float *x, int64_t x_stride, int64_t tokens, int64_t channels,
                         float *conv_state, const float *weight, const float *bias,
                         int64_t kernel, int silu, const int64_t *save_at, int64_t num_saves,
                         float *const *saves, float *out, float *work) {
    const int64_t keep = kernel - 1;
    float *wt = work, *head = work + kernel * channels; /* weight [kernel, C]; state rows */
    for (int64_t c = 0; c < channels; c++) {
        for (int64_t j = 0; j < kernel; j++) wt[j * channels + c] = weight[c * kernel + j];
        for (int64_t i = 0; i < keep; i++) head[i * channels + c] = conv_state[c * keep + i];
    }
#define WIN(i) ((i) < keep ? head + (i) * channels : x + ((i) - keep) * x_stride)
    for (int64_t t = 0; t < tokens; t++) {
        float *restrict o = out + t * channels;
        if (bias != NULL) memcpy(o, bias, sizeof(float) * channels);
        else memset(o, 0, sizeof(float) * channels);
        for (int64_t j = 0; j < kernel; j++) {
            const float *restrict in = WIN(t + j), *restrict w = wt + j * channels;
#pragma omp simd
            for (int64_t c = 0; c < channels; c++) o[c] += w[c] * in[c];
        }
        if (silu) {
#pragma omp simd
            for (int64_t c = 0; c < channels; c++) o[c] = gated_act(o[c], 1.f, 1);
        }
    }
    for (int64_t k = 0; k < num_saves; k++)
        for (int64_t i = 0; i < keep; i++) {
            const float *in = WIN(save_at[k] + i);
            for (int64_t c = 0; c < channels; c++) saves[k][c * keep + i] = in[c];
        }
    for (int64_t i = 0; i < keep; i++) {
        const float *in = WIN(tokens + i);
        for (int64_t c = 0; c < channels; c++) conv_state[c * keep + i] = in[c];
    }
#undef WIN
}

/* One Gated DeltaNet decode step of `rows` requests, from the projection's q|k|v rows to the
   recurrence's output (before the gated norm), each request's conv and delta-rule states
   updated in place:
       conv[c]  = sum_j w[c, j] win[j, c], then silu; the conv state shifts in (no bias)
       q, k     = conv's first two key_size blocks per key head, L2-normalised
                  (x rsqrt(|x|^2 + 1e-6)), q also by 1/sqrt(k_dim); v = the value block
       S        = S exp(g[r, h]);  delta = (v - S^T k) beta[r, h];  S += k delta^T
       out[r,h] = S^T q                       (value head h reads key head h / per)
   Row r's conv state [channels, kernel - 1] sits at conv_states + conv_offsets[r], its delta
   state [v_heads, k_dim, v_dim] at ssm_states + ssm_offsets[r]; beta and g are [rows,
   v_heads] contiguous. The torch code (models/layers/gated_deltanet.py) gathers the states,
   builds three state-sized temporaries and scatters them back, ~15 ops a layer. Here each
   state is read twice and written once, the heads split over the threads (each head one
   thread's, so the bytes do not depend on the thread count). work: rows * channels floats. */
static void gdn_head(float *restrict s, const float *restrict q, const float *restrict k,
                     const float *restrict v, float decay, float beta, int64_t k_dim,
                     int64_t v_dim, float *restrict o) {
    float mem[v_dim];
    for (int64_t j = 0; j < v_dim; j++) mem[j] = 0.f;
    for (int64_t i = 0; i < k_dim; i++) {
        const float *restrict row = s + i * v_dim;
        const float ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < v_dim; j++) mem[j] += row[j] * ki;
    }
    for (int64_t j = 0; j < v_dim; j++) {
        mem[j] = (v[j] - mem[j] * decay) * beta; /* delta */
        o[j] = 0.f;
    }
    for (int64_t i = 0; i < k_dim; i++) {
        float *restrict row = s + i * v_dim;
        const float ki = k[i], qi = q[i];
#pragma omp simd
        for (int64_t j = 0; j < v_dim; j++) {
            const float x = row[j] * decay + ki * mem[j];
            row[j] = x;
            o[j] += x * qi;
        }
    }
}

void hkv_gdn_decode_f32(float *conv_states, const int64_t *conv_offsets, float *ssm_states,
                        const int64_t *ssm_offsets, int64_t rows, const float *mixed,
                        int64_t mixed_stride, const float *weight, int64_t kernel,
                        const float *beta, const float *g, int64_t k_heads, int64_t v_heads,
                        int64_t k_dim, int64_t v_dim, float *out, float *work) {
    const int64_t key_size = k_heads * k_dim;
    const int64_t channels = 2 * key_size + v_heads * v_dim, per = v_heads / k_heads;
    const float scale = 1.f / sqrtf((float)k_dim);
    for (int64_t r = 0; r < rows; r++) {
        float *x = work + r * channels;
        conv_token_silu(conv_states + conv_offsets[r], mixed + r * mixed_stride, weight, NULL,
                        kernel, channels, x);
        for (int64_t h = 0; h < 2 * k_heads; h++) { /* q heads, then k heads */
            float *head = x + h * k_dim, sq = 0.f;
            for (int64_t i = 0; i < k_dim; i++) sq += head[i] * head[i];
            const float norm = 1.f / sqrtf(sq + 1e-6f) * (h < k_heads ? scale : 1.f);
            for (int64_t i = 0; i < k_dim; i++) head[i] *= norm;
        }
    }
    const int64_t size = k_dim * v_dim, work_items = rows * v_heads;
#pragma omp parallel for schedule(static) if (work_items * size >= 8192)
    for (int64_t item = 0; item < work_items; item++) {
        const int64_t r = item / v_heads, h = item % v_heads, kh = h / per;
        const float *x = work + r * channels;
        gdn_head(ssm_states + ssm_offsets[r] + h * size, x + kh * k_dim,
                 x + key_size + kh * k_dim, x + 2 * key_size + h * v_dim,
                 expf(g[r * v_heads + h]), beta[r * v_heads + h], k_dim, v_dim,
                 out + (r * v_heads + h) * v_dim);
    }
}

/* sigmoid(x) from exp(-|x|), as gated_act's SiLU takes it (no overflow at either end). */
static inline float sigmoid(float x) {
    const float e = exp_nonpositive(-fabsf(x));
    return (x >= 0.f ? 1.f : e) / (1.f + e);
}

/* A Gated DeltaNet step's gates from its b and a projections, rows [rows, heads] (strides
   ldb, lda): beta = sigmoid(b) * beta_scale, g = a_neg * softplus(a + dt_bias) (a_neg:
   -exp(A_log), computed once). Both out [rows, heads] contiguous. */
void hkv_gdn_gates_f32(const float *b, int64_t ldb, const float *a, int64_t lda, int64_t rows,
                       int64_t heads, const float *dt_bias, const float *a_neg,
                       float beta_scale, float *beta, float *g) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            beta[r * heads + h] = sigmoid(b[r * ldb + h]) * beta_scale;
            g[r * heads + h] = a_neg[h] * softplus(a[r * lda + h] + dt_bias[h]);
        }
}

/* Gated DeltaNet's output norm per value head: y = w * (o / rms(o)) * silu(z), o [rows,
   heads, dim] contiguous, z rows of ldz floats (heads * dim used), y [rows, heads * dim]. */
void hkv_gated_head_norm_f32(const float *o, const float *z, int64_t ldz, int64_t rows,
                             int64_t heads, int64_t dim, const float *w, float eps, float *y) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            const float *row = o + (r * heads + h) * dim, *zr = z + r * ldz + h * dim;
            float *dst = y + (r * heads + h) * dim;
            float ss = 0.f;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < dim; d++) ss += row[d] * row[d];
            const float inv = 1.f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
            for (int64_t d = 0; d < dim; d++)
                dst[d] = gated_act(zr[d], w[d] * (row[d] * inv), 1);
        }
}

/* Attention's output gate (Qwen3-Next, Qwen3.5): out[r, h, :] *= sigmoid(gate[r, h, :]),
   out [rows, heads * dim] contiguous, gate heads `gs1` and rows `gs0` floats apart. */
void hkv_sigmoid_gate_f32(float *out, const float *gate, int64_t gs0, int64_t gs1,
                          int64_t rows, int64_t heads, int64_t dim) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *o = out + (r * heads + h) * dim;
            const float *gt = gate + r * gs0 + h * gs1;
            for (int64_t d = 0; d < dim; d++) o[d] *= sigmoid(gt[d]);
        }
}

/* One LFM2 short-conv decode step of `rows` requests from the in-projection's rows
   bcx [rows, 3 * channels] (B | C | x, row stride ld): y[r, c] = C[c] * (bias[c] +
   sum_j w[c, j] win[j, c]) over the window of the state's kernel - 1 inputs then B[c] x[c],
   the state [channels, kernel - 1] at conv_states + conv_offsets[r] shifted in place. */
void hkv_short_conv_decode_f32(float *conv_states, const int64_t *conv_offsets, int64_t rows,
                               const float *bcx, int64_t ld, const float *weight,
                               const float *bias, int64_t kernel, int64_t channels, float *y) {
    const int64_t keep = kernel - 1;
    for (int64_t r = 0; r < rows; r++) {
        const float *b = bcx + r * ld, *cc = b + channels, *x = b + 2 * channels;
        float *cs = conv_states + conv_offsets[r], *yr = y + r * channels;
        for (int64_t c = 0; c < channels; c++) {
            float *win = cs + c * keep;
            const float *w = weight + c * kernel, in = b[c] * x[c];
            float acc = bias != NULL ? bias[c] : 0.f;
            for (int64_t j = 0; j < keep; j++) acc += w[j] * win[j];
            acc += w[keep] * in;
            for (int64_t j = 0; j + 1 < keep; j++) win[j] = win[j + 1];
            if (keep > 0) win[keep - 1] = in;
            yr[c] = cc[c] * acc;
        }
    }
}
