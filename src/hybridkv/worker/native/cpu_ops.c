/* Per-token ops around attention on the CPU, float32: RMSNorm, RoPE, K/V writes.

   Each is a few microseconds of work on a decode step's [batch, width] rows, where a torch
   op costs a dispatch per step of its formula (RMSNorm is five ops on the CPU: pow, mean,
   add, rsqrt, mul, each allocating). Here each is one call over all rows. Inputs are rows
   of `dim` contiguous floats addressed by two strides (tokens, then heads), so q and k read
   straight out of a fused q/k/v projection's output. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

/* One Mamba-2 decode step of `rows` requests, each state updated in place:
       state[h, p, :] = state[h, p, :] * decay[r, h] + dtx[r, h, p] * b[r, g, :]
       y[r, h, p]     = state[h, p, :] . c[r, g, :]          (g: head h's group)
   Row r's state [heads, head_dim, state_size] is contiguous at states + offsets[r]. One
   pass reads and writes each state once; torch's formula gathers the rows' states, makes
   an outer-product temporary the size of a state, scatters them back and reads them again
   for the output. */
void hkv_ssd_decode_f32(float *states, const int64_t *offsets, int64_t rows, int64_t heads,
                        int64_t head_dim, int64_t state_size, int64_t groups,
                        const float *decay, const float *dtx, const float *b, const float *c,
                        float *y) {
    const int64_t per = heads / groups;
    for (int64_t r = 0; r < rows; r++) {
        float *st = states + offsets[r];
        for (int64_t h = 0; h < heads; h++) {
            const float dcy = decay[r * heads + h];
            const float *bg = b + (r * groups + h / per) * state_size;
            const float *cg = c + (r * groups + h / per) * state_size;
            for (int64_t p = 0; p < head_dim; p++) {
                float *row = st + (h * head_dim + p) * state_size;
                const float u = dtx[(r * heads + h) * head_dim + p];
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t n = 0; n < state_size; n++) {
                    const float v = row[n] * dcy + u * bg[n];
                    row[n] = v;
                    acc += v * cg[n];
                }
                y[(r * heads + h) * head_dim + p] = acc;
            }
        }
    }
}

/* One request's Mamba-2 prompt, token by token (the recurrence hkv_ssd_decode_f32 steps,
   which the chunked form in models/layers/ssd.py equals to float rounding):
       state[h, p, :] = state[h, p, :] * decay[t, h] + dtx[t, h, p] * b[t, g, :]
       y[t, h, p]     = state[h, p, :] . c[t, g, :]
   state [heads, head_dim, state_size] in place; saves[k] (k < num_saves) receives the
   state after save_at[k] tokens (0 < save_at[k] <= tokens, ascending), each a
   [heads, head_dim, state_size] float buffer. Heads outermost, each head's state turned
   to [state_size, head_dim] in `work` (head_dim * state_size floats) for the whole
   prompt: the update and the output then run along head_dim with B's and C's values
   broadcast, no sum across a vector's lanes, and the state (16 KiB at 64 x 64) stays in
   L1 across the tokens. On one core 2-3x the chunked form's time at Nemotron-H's and
   Mamba2's shapes (128-1,050 tokens). */
static void to_np(const float *restrict src, float *restrict dst, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < cols; k++) dst[k * rows + r] = src[r * cols + k];
}

/* One token of one head: st [state_size, head_dim] updated, y[0 .. head_dim) written. */
static void ssd_token(float *restrict st, int64_t head_dim, int64_t state_size, float dcy,
                      const float *restrict u, const float *bg, const float *cg,
                      float *restrict yt) {
#if defined(__AVX512F__)
    if (head_dim == 64) { /* Mamba-2's usual head: y in four registers */
        const __m512 d = _mm512_set1_ps(dcy);
        const __m512 uv[4] = {_mm512_loadu_ps(u), _mm512_loadu_ps(u + 16),
                              _mm512_loadu_ps(u + 32), _mm512_loadu_ps(u + 48)};
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
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(yt + 16 * j, acc[j]);
        return;
    }
#endif
    for (int64_t p = 0; p < head_dim; p++) yt[p] = 0.f;
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
}

void hkv_ssd_scan_f32(float *state, int64_t tokens, int64_t heads, int64_t head_dim,
                      int64_t state_size, int64_t groups, const float *decay, const float *dtx,
                      const float *b, const float *c, float *y, const int64_t *save_at,
                      int64_t num_saves, float *const *saves, float *work) {
    const int64_t per = heads / groups, size = head_dim * state_size;
    for (int64_t h = 0; h < heads; h++) {
        to_np(state + h * size, work, head_dim, state_size);
        const int64_t g = h / per;
        int64_t next = 0;
        for (int64_t t = 0; t < tokens; t++) {
            ssd_token(work, head_dim, state_size, decay[t * heads + h],
                      dtx + (t * heads + h) * head_dim, b + (t * groups + g) * state_size,
                      c + (t * groups + g) * state_size, y + (t * heads + h) * head_dim);
            while (next < num_saves && save_at[next] == t + 1) {
                to_np(work, saves[next] + h * size, state_size, head_dim);
                next++;
            }
        }
        to_np(work, state + h * size, state_size, head_dim);
    }
}
