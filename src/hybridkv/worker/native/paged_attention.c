/* Attention of every query over the paged KV cache, read in place (worker/attention/cpu.py
   sends it decode steps and prompt chunks alike, for float32 and int8 pages).

   The torch path copies each request's context out of its blocks and then reads the copy
   again in SDPA; at decode, where a step attends one query per request, that copy is most of
   the attention's time. Here each query walks its request's kernel blocks directly, every
   head at once block by block (so a block is read in address order, once per step), with an
   online softmax per head (running max, sum and output) and the block two ahead prefetched
   a few lines per key scored. A query's arithmetic depends only on its position, its keys
   and the block layout, never on the other queries of its chunk or step: a token's output
   is the same bytes however its step was made (batch invariance).

   Pages hold float32 values or quantized rows (kv/spec.py: per token and head, an fp16
   scale per group of 32 values, then int8 values or q4 nibbles). Quantized rows are decoded
   a tile at a time into a small buffer that stays in L1 (TILE rows of one KV head), then
   scored and weighed like float rows: no float copy of the context is ever made.
   q4 K/V pages (kv/spec.py `q4_kv_layout`): V rows are symmetric nibbles of Hadamard-rotated
   values, so the output is rotated back (the rotation is orthonormal); K rows are nibbles
   quantized per channel over groups of KEY_GROUP tokens, the group's (scale, minimum) pairs
   spread over its rows' tails. A query reads the keys of its own group, which may not be
   quantized yet, in full precision from `fresh` (worker/attention/backend.py: FreshKeys).

   Requests split across threads. Addressing follows the KV view [pages, blocks_per_page, 2,
   block, Hk, row] given by its strides in bytes, so padded large pages and kernel blocks
   inside manager blocks need no special case. Masks: causal, sliding window, chunked local
   attention; optional logit soft-cap and per-head sink logits, as in worker/attention/backend.py.
   `hkv_paged_attention_scored` also takes what depends on the query token (Inkling): a bias
   per query, head and backward distance d < extent added to the scaled score, and a sink
   logit per query and head (worker/attention/scored.py computes the same). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PREFETCH_BLOCKS 2 /* how far ahead the next blocks are fetched */
#define TILE 32 /* at most this many keys scored before the running softmax is updated */
#define ITEM_QUERIES 4 /* queries of one request per work item (a prompt's split over threads) */
#define GROUP 32 /* values per scale in quantized rows */
#define KEY_GROUP 16 /* tokens per key group of q4 K/V pages */

enum { CODEC_F32 = 0, CODEC_INT8 = 1, CODEC_Q4 = 2 };

typedef struct {
    const char *cache; /* strides in bytes */
    int64_t page_stride, slot_stride, kv_stride, token_stride, head_stride;
    int64_t block_size, kernel_block_size, blocks_per_page;
} kv_view;

/* Address of token `pos` of a request (K; V is kv_stride further), head 0. */
static inline const char *token_row(const kv_view *kv, const int64_t *table, int64_t pos) {
    int64_t kid = table[pos / kv->kernel_block_size];
    int64_t per = kv->block_size / kv->kernel_block_size;
    int64_t block = kid / per;
    int64_t offset = (kid % per) * kv->kernel_block_size + pos % kv->kernel_block_size;
    return kv->cache + (block / kv->blocks_per_page) * kv->page_stride
           + (block % kv->blocks_per_page) * kv->slot_stride + offset * kv->token_stride;
}

typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));

/* Eight int8 / uint8 values as floats. GCC turns the generic conversion into eight scalar
   ones; AVX2 has it as one sign/zero extension and one int-to-float instruction. */
#ifdef __AVX2__
#include <immintrin.h>
static inline v8 i8_to_v8(const uint8_t *p) {
    __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    v8 out;
    memcpy(&out, &x, sizeof out);
    return out;
}
static inline v8 u8_to_v8(u8x8 b) {
    __m128i w;
    memcpy(&w, &b, 8);
    __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(w));
    v8 out;
    memcpy(&out, &x, sizeof out);
    return out;
}
#else
static inline v8 i8_to_v8(const uint8_t *p) { i8x8 x; memcpy(&x, p, 8); return __builtin_convertvector(x, v8); }
static inline v8 u8_to_v8(u8x8 x) { return __builtin_convertvector(x, v8); }
#endif
static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }
/* 8 floats: one AVX register (generic 16-wide vectors on AVX2 go through the stack). */
static inline v8 load8(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }

/* One quantized row of `dim` values into `dst`: [fp16 scale per GROUP | values] (int8, or
   q4 V rows: nibble - 8). */
static inline void decode_row(int codec, const char *row, int64_t dim, float *restrict dst) {
    const int64_t groups = (dim + GROUP - 1) / GROUP;
    const uint8_t *vals = (const uint8_t *)row + 2 * groups;
    for (int64_t g = 0; g < groups; g++) {
        uint16_t bits;
        memcpy(&bits, row + 2 * g, 2);
        const float s = half_to_float(bits);
        const float m = codec == CODEC_Q4 ? -8.f * s : 0.f;
        const int64_t d0 = g * GROUP, n = dim - d0 < GROUP ? dim - d0 : GROUP;
        if (codec == CODEC_INT8) {
            const uint8_t *v = vals + d0;
            if (n == GROUP) {
                for (int k = 0; k < GROUP; k += 8) store8(dst + d0 + k, i8_to_v8(v + k) * s);
            } else {
                for (int64_t d = 0; d < n; d++) dst[d0 + d] = (float)(int8_t)v[d] * s;
            }
        } else { /* q4: byte i = value i (low nibble) | value i + half (high nibble) */
            const uint8_t *v = vals + d0 / 2;
            if (n == GROUP) {
                for (int k = 0; k < 16; k += 8) {
                    u8x8 b;
                    memcpy(&b, v + k, 8);
                    store8(dst + d0 + k, u8_to_v8(b & 15) * s + m);
                    store8(dst + d0 + 16 + k, u8_to_v8(b >> 4) * s + m);
                }
            } else {
                const int64_t half = (n + 1) / 2;
                for (int64_t d = 0; d < half; d++) dst[d0 + d] = (float)(v[d] & 15) * s + m;
                for (int64_t d = half; d < n; d++)
                    dst[d0 + d] = (float)(v[d - half] >> 4) * s + m;
            }
        }
    }
}

/* Byte offsets of q4 K/V rows (kv/spec.py q4_kv_layout). */
typedef struct {
    int64_t nibbles, channels, k_tail, v_tail, v_bytes;
} q4_layout;

static q4_layout q4_layout_of(int64_t dim) {
    q4_layout l;
    l.nibbles = (dim + 1) / 2;
    l.channels = (dim + KEY_GROUP - 1) / KEY_GROUP;
    l.v_bytes = 2 * ((dim + GROUP - 1) / GROUP) + l.nibbles;
    const int64_t row = 2 * ((l.nibbles + 4 * l.channels + l.v_bytes + 3) / 4);
    l.k_tail = row - l.nibbles < 4 * l.channels ? row - l.nibbles : 4 * l.channels;
    l.v_tail = 4 * l.channels - l.k_tail;
    return l;
}

/* A key group's per-channel scales and minimums from its KEY_GROUP rows' shares (`krow`:
   the K row of the group's first token, this head; its V row is kv_stride further). */
static void load_key_group(const q4_layout *l, const char *krow, int64_t token_stride,
                           int64_t kv_stride, int64_t dim, float *scale, float *least) {
    /* The group's (scale, minimum) fp16 pairs, channel by channel. */
    uint16_t pairs[2 * KEY_GROUP * ((1024 + KEY_GROUP - 1) / KEY_GROUP)];
    char *dst = (char *)pairs;
    for (int64_t i = 0; i < KEY_GROUP; i++, dst += 4 * l->channels) {
        const char *row = krow + i * token_stride;
        memcpy(dst, row + l->nibbles, l->k_tail);
        memcpy(dst + l->k_tail, row + kv_stride + l->v_bytes, l->v_tail);
    }
    int64_t c = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; c + 4 <= dim; c += 4) { /* 8 halves at once: s0 m0 s1 m1 s2 m2 s3 m3 */
        float f[8];
        _mm256_storeu_ps(f, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pairs + 2 * c))));
        for (int j = 0; j < 4; j++) scale[c + j] = f[2 * j], least[c + j] = f[2 * j + 1];
    }
#endif
    for (; c < dim; c++) {
        scale[c] = half_to_float(pairs[2 * c]);
        least[c] = half_to_float(pairs[2 * c + 1]);
    }
}

/* A q4 K row's nibbles (packed per GROUP as q4 rows are) through its group's channels. */
static inline void decode_key_row(const char *row, int64_t dim, const float *scale,
                                  const float *least, float *restrict dst) {
    const uint8_t *v = (const uint8_t *)row;
    for (int64_t d0 = 0; d0 < dim; d0 += GROUP) {
        const int64_t n = dim - d0 < GROUP ? dim - d0 : GROUP;
        const uint8_t *b = v + d0 / 2;
        if (n == GROUP) {
            for (int k = 0; k < 16; k += 8) {
                u8x8 x;
                memcpy(&x, b + k, 8);
                store8(dst + d0 + k, u8_to_v8(x & 15) * load8(scale + d0 + k) + load8(least + d0 + k));
                store8(dst + d0 + 16 + k,
                       u8_to_v8(x >> 4) * load8(scale + d0 + 16 + k) + load8(least + d0 + 16 + k));
            }
            continue;
        }
        const int64_t half = (n + 1) / 2;
        for (int64_t d = 0; d < half; d++) {
            dst[d0 + d] = (float)(b[d] & 15) * scale[d0 + d] + least[d0 + d];
            if (d + half < n)
                dst[d0 + d + half] = (float)(b[d] >> 4) * scale[d0 + d + half]
                                     + least[d0 + d + half];
        }
    }
}

/* The orthonormal Hadamard transform of each full group of GROUP values (its own inverse):
   what q4 rows were rotated by when written (worker/attention/kv_quant.py). */
static void rotate_groups(float *x, int64_t dim) {
    const float norm = 0.17677669529663687f; /* 1 / sqrt(32) */
    for (int64_t g = 0; g + GROUP <= dim; g += GROUP) {
        float *y = x + g;
        for (int64_t len = 1; len < GROUP; len <<= 1)
            for (int64_t i = 0; i < GROUP; i += 2 * len)
                for (int64_t j = i; j < i + len; j++) {
                    const float a = y[j], b = y[j + len];
                    y[j] = a + b;
                    y[j + len] = a - b;
                }
        for (int64_t j = 0; j < GROUP; j++) y[j] *= norm;
    }
}


/* [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]: vhaddps. */
static inline v8 hadd8(v8 a, v8 b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14)
           + __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

static inline float hsum8(v8 x) {
    v4 y = __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
    return (y[0] + y[2]) + (y[1] + y[3]);
}

/* scores[t] = q . rows[t * stride], t < n. Eight keys at a time, each with its own
   accumulator, reduced together at the end (three rounds of pairwise adds for all eight)
   instead of one horizontal sum per key, which cost more than the key's products. */
static inline void score_rows(const float *restrict q, const float *rows, int64_t stride,
                              int64_t n, int64_t dim, float *restrict scores) {
    int64_t t = 0;
    if (dim % 8 == 0) {
        for (; t + 8 <= n; t += 8) {
            const float *r = rows + t * stride;
            v8 a[8] = {{0}};
            for (int64_t d = 0; d < dim; d += 8) {
                const v8 qv = load8(q + d);
                for (int i = 0; i < 8; i++) a[i] += qv * load8(r + i * stride + d);
            }
            const v8 h0 = hadd8(hadd8(a[0], a[1]), hadd8(a[2], a[3]));
            const v8 h1 = hadd8(hadd8(a[4], a[5]), hadd8(a[6], a[7]));
            const v8 sum = __builtin_shufflevector(h0, h1, 0, 1, 2, 3, 8, 9, 10, 11)
                           + __builtin_shufflevector(h0, h1, 4, 5, 6, 7, 12, 13, 14, 15);
            memcpy(scores + t, &sum, sizeof sum);
        }
        for (; t < n; t++) {
            const float *r = rows + t * stride;
            v8 a = {0};
            for (int64_t d = 0; d < dim; d += 8) a += load8(q + d) * load8(r + d);
            scores[t] = hsum8(a);
        }
        return;
    }
    for (; t < n; t++) {
        float acc = 0.f;
        for (int64_t d = 0; d < dim; d++) acc += q[d] * rows[t * stride + d];
        scores[t] = acc;
    }
}

/* out[d] = out[d] * c + sum_t p[t] * rows[t * stride + d]: the running output of one head
   over a tile. Eight 8-wide slices at a time stay in registers across the tile's rows, so
   the adds of consecutive rows do not wait on each other. */
static inline void weigh_rows(float *restrict out, float c, const float *restrict p,
                              const float *rows, int64_t stride, int64_t n, int64_t dim) {
    int64_t d = 0;
    if (dim % 8 == 0) {
        for (; d + 64 <= dim; d += 64) {
            v8 a[8];
            for (int i = 0; i < 8; i++) a[i] = load8(out + d + 8 * i) * c;
            for (int64_t t = 0; t < n; t++) {
                const float *row = rows + t * stride + d;
                for (int i = 0; i < 8; i++) a[i] += p[t] * load8(row + 8 * i);
            }
            memcpy(out + d, a, sizeof a);
        }
        for (; d < dim; d += 8) {
            v8 acc = load8(out + d) * c;
            for (int64_t t = 0; t < n; t++) acc += p[t] * load8(rows + t * stride + d);
            store8(out + d, acc);
        }
        return;
    }
    for (; d < dim; d++) {
        float acc = out[d] * c;
        for (int64_t t = 0; t < n; t++) acc += p[t] * rows[t * stride + d];
        out[d] = acc;
    }
}

/* x (dim values) -> int8 per GROUP with scale max|x| / 127 (values in [-127, 127]). */
static void quantize_q8(const float *x, int64_t dim, int8_t *q8, float *scales) {
    for (int64_t g = 0; g < dim / GROUP; g++) {
        float amax = 0.f;
        for (int64_t d = 0; d < GROUP; d++) amax = fmaxf(amax, fabsf(x[g * GROUP + d]));
        const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int64_t d = 0; d < GROUP; d++)
            q8[g * GROUP + d] = (int8_t)lrintf(x[g * GROUP + d] * inv);
        scales[g] = s;
    }
}

/* x through int8 per GROUP and back, as quantize_q8 stores it (the decode path's queries
   over int8 pages, where the integer dot products below are not compiled). */
static void __attribute__((unused)) q8_round_trip(float *x, int64_t dim) {
    int8_t q8[GROUP];
    for (int64_t g = 0; g + GROUP <= dim; g += GROUP) {
        float scale;
        quantize_q8(x + g, GROUP, q8, &scale);
        for (int64_t d = 0; d < GROUP; d++) x[g + d] = (float)q8[d] * scale;
    }
}

#if defined(__AVX2__) && defined(__F16C__)
/* int8 pages without decoding them (head sizes a multiple of GROUP). The query is quantized
   like a K row (int8 per GROUP with one scale, as llama.cpp's q8_0 dot products do; every
   path does the same to queries over int8 pages, worker/attention/kv_quant.py:
   quantize_queries), so q.k is integer products summed exactly, times the two scales: 32
   products in four instructions, no float copy of the row. V rows are converted in registers, each
   converted slice weighed into every query head of the KV head, with the row's scale
   folded into the head's softmax weight. */
#define I8_DOT 1

static inline float half_at(const char *p) {
    uint16_t bits;
    memcpy(&bits, p, 2);
    return _cvtsh_ss(bits);
}

/* The 8 int32 lanes of GROUP products q.k (k signed, |q|, |k| <= 127: no saturation). */
static inline __m256i dot32(__m256i q, __m256i k) {
    const __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(k, k), _mm256_sign_epi8(q, k));
    return _mm256_madd_epi16(prod, _mm256_set1_epi16(1));
}

/* scores[t] = q . k_t for the n int8 rows at row0 + t * stride (bytes). Eight keys at a
   time, their lanes reduced together. */
static void score_rows_i8(const int8_t *q8, const float *qsc, const char *row0,
                          int64_t stride, int64_t n, int64_t dim, float *scores) {
    const int64_t groups = dim / GROUP, voff = 2 * groups;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const char *r = row0 + t * stride;
        __m256 res = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(q8 + g * GROUP));
            __m256i d[8];
            float ks[8];
            for (int i = 0; i < 8; i++) {
                const char *row = r + i * stride;
                d[i] = dot32(qv, _mm256_loadu_si256((const __m256i *)(row + voff + g * GROUP)));
                ks[i] = half_at(row + 2 * g);
            }
            const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]),
                                                 _mm256_hadd_epi32(d[2], d[3]));
            const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]),
                                                 _mm256_hadd_epi32(d[6], d[7]));
            const __m256i sum = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                                                 _mm256_permute2x128_si256(h0, h1, 0x31));
            const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(ks), _mm256_set1_ps(qsc[g]));
            res = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, res);
        }
        _mm256_storeu_ps(scores + t, res);
    }
    for (; t < n; t++) {
        const char *row = row0 + t * stride;
        float acc = 0.f;
        for (int64_t g = 0; g < groups; g++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(q8 + g * GROUP));
            const __m256i d = dot32(qv, _mm256_loadu_si256((const __m256i *)(row + voff + g * GROUP)));
            const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(d),
                                             _mm256_extracti128_si256(d, 1));
            const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            const __m128i s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1));
            acc += (float)_mm_cvtsi128_si32(s1) * half_at(row + 2 * g) * qsc[g];
        }
        scores[t] = acc;
    }
}

/* out[h][d] = out[h][d] * corr[h] + sum_t p[h][t] * v_t[d] for the `heads` query heads of
   one KV head (out rows dim apart, p rows TILE apart), v_t the n int8 rows at row0 +
   t * stride. Sixteen values of a row are converted once and weighed into up to four heads
   held in registers. */
static void weigh_rows_i8(float *out, const float *corr, const float *p, int64_t heads,
                          const char *row0, int64_t stride, int64_t n, int64_t dim) {
    const int64_t groups = dim / GROUP, voff = 2 * groups;
    float vs[TILE * (1024 / GROUP)]; /* [t][g] the rows' scales */
    for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < groups; g++)
            vs[t * groups + g] = half_at(row0 + t * stride + 2 * g);
    for (int64_t h0 = 0; h0 < heads; h0 += 4) {
        const int64_t hn = heads - h0 < 4 ? heads - h0 : 4;
        for (int64_t d = 0; d < dim; d += 16) {
            const int64_t g = d / GROUP;
            __m256 a[4][2];
            for (int64_t h = 0; h < hn; h++) {
                const __m256 c = _mm256_set1_ps(corr[h0 + h]);
                a[h][0] = _mm256_mul_ps(_mm256_loadu_ps(out + (h0 + h) * dim + d), c);
                a[h][1] = _mm256_mul_ps(_mm256_loadu_ps(out + (h0 + h) * dim + d + 8), c);
            }
            for (int64_t t = 0; t < n; t++) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(row0 + t * stride + voff + d));
                const __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
                const __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
                const float s = vs[t * groups + g];
                for (int64_t h = 0; h < hn; h++) {
                    const __m256 w = _mm256_set1_ps(p[(h0 + h) * TILE + t] * s);
                    a[h][0] = _mm256_fmadd_ps(w, v0, a[h][0]);
                    a[h][1] = _mm256_fmadd_ps(w, v1, a[h][1]);
                }
            }
            for (int64_t h = 0; h < hn; h++) {
                _mm256_storeu_ps(out + (h0 + h) * dim + d, a[h][0]);
                _mm256_storeu_ps(out + (h0 + h) * dim + d + 8, a[h][1]);
            }
        }
    }
}
#endif

/* One tile of scores into the running softmax of a head: scores become the tile's weights
   exp(s - new max); returns the factor the head's running output is scaled by. */
static inline float softmax_tile(float *scores, int64_t n, float softcap, float *run_max,
                                 float *run_sum) {
    if (softcap > 0.f)
        for (int64_t t = 0; t < n; t++) scores[t] = tanhf(scores[t] / softcap) * softcap;
    float tile_max = scores[0];
    for (int64_t t = 1; t < n; t++) tile_max = scores[t] > tile_max ? scores[t] : tile_max;
    const float new_max = tile_max > *run_max ? tile_max : *run_max;
    const float correction = *run_max == -INFINITY ? 0.f : expf(*run_max - new_max);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        scores[t] = exp_nonpositive(scores[t] - new_max);
        sum += scores[t];
    }
    *run_sum = *run_sum * correction + sum;
    *run_max = new_max;
    return correction;
}

/* q4 pages, a prompt chunk: its request's paged rows decoded once into float rows [t, Hk, D]
   that every query of the chunk reads, keys [base, k_end) (the complete key groups before
   the last query's own) and values [base, seq_len). Decoding a key group per query and tile
   cost each query a whole context's decode (a 512-token prompt's attention 3.3x the torch
   path's); these are the same floats read in the same tiles, so a query's bytes are those
   of the per-query decode: batch invariant either way. */
typedef struct {
    float *k, *v; /* NULL: this request decodes per query and tile */
    int64_t base, k_end;
} q4_rows;

/* At most this many bytes of decoded rows per call; requests past it decode per query. */
#define Q4_ROWS_BYTES ((int64_t)256 << 20)

/* Key group `g` (of KEY_GROUP tokens from `s->base`) of request `r` decoded into `s`. */
static void decode_q4_group(const kv_view *kv, const q4_layout *l, const int64_t *table,
                            const q4_rows *s, int64_t g, int64_t seq_len, int64_t num_kv_heads,
                            int64_t head_dim) {
    const int64_t t0 = s->base + g * KEY_GROUP;
    const int64_t t1 = t0 + KEY_GROUP < seq_len ? t0 + KEY_GROUP : seq_len;
    const int64_t hs = num_kv_heads * head_dim;
    float scale[head_dim], least[head_dim];
    for (int64_t kh = 0; kh < num_kv_heads; kh++) {
        const char *krow = token_row(kv, table, t0) + kh * kv->head_stride;
        const int keys = t0 < s->k_end; /* a complete group: k_end is group aligned */
        if (keys)
            load_key_group(l, krow, kv->token_stride, kv->kv_stride, head_dim, scale, least);
        for (int64_t t = t0; t < t1; t++) {
            const char *row = krow + (t - t0) * kv->token_stride;
            const int64_t at = (t - s->base) * hs + kh * head_dim;
            decode_row(CODEC_Q4, row + kv->kv_stride, head_dim, s->v + at);
            if (keys) decode_key_row(row, head_dim, scale, least, s->k + at);
        }
    }
}

/* Per-query score terms (NULL pointers: none). bias [T, Hq, extent] with strides in floats;
   sinks [T, Hq] replace the per-head sinks. */
typedef struct {
    const float *bias;
    int64_t bias_token_stride, bias_head_stride, extent;
    const float *sinks;
    int64_t sink_token_stride;
} query_terms;

/* scores[t] of keys at positions first + t, for the query at `pos`: + bias[pos - key]. */
static inline void add_bias(float *scores, int64_t n, const float *bias, int64_t pos,
                            int64_t first, int64_t extent) {
    for (int64_t t = 0; t < n; t++) {
        const int64_t d = pos - (first + t);
        if (d < extent) scores[t] += bias[d];
    }
}

static int paged_attention(
    const float *q, int64_t q_token_stride, int64_t q_head_stride,
    float *out, int64_t out_token_stride, int64_t out_head_stride,
    const char *cache, int64_t codec, int64_t page_stride, int64_t slot_stride,
    int64_t kv_stride, int64_t token_stride, int64_t head_stride,
    int64_t block_size, int64_t kernel_block_size, int64_t blocks_per_page,
    const int64_t *block_table, int64_t table_stride,
    const int64_t *rows, int64_t num_rows,
    const int64_t *query_start_loc, const int64_t *seq_lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, int64_t chunk, float softcap, const float *sinks,
    const float *fresh, int64_t fresh_stride, const int64_t *fresh_starts,
    const query_terms *terms, int64_t num_threads);

/* Returns 0, or a negative code for arguments it cannot take (checked by the caller too).
   Cache strides are in bytes; `codec` says what the rows hold (CODEC_*). */
int hkv_paged_attention(
    const float *q, int64_t q_token_stride, int64_t q_head_stride,
    float *out, int64_t out_token_stride, int64_t out_head_stride,
    const char *cache, int64_t codec, int64_t page_stride, int64_t slot_stride,
    int64_t kv_stride, int64_t token_stride, int64_t head_stride,
    int64_t block_size, int64_t kernel_block_size, int64_t blocks_per_page,
    const int64_t *block_table, int64_t table_stride,
    const int64_t *rows, int64_t num_rows,
    const int64_t *query_start_loc, const int64_t *seq_lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, int64_t chunk, float softcap, const float *sinks,
    const float *fresh, int64_t fresh_stride, const int64_t *fresh_starts,
    int64_t num_threads) {
    const query_terms none = {NULL, 0, 0, 0, NULL, 0};
    return paged_attention(q, q_token_stride, q_head_stride, out, out_token_stride,
                           out_head_stride, cache, codec, page_stride, slot_stride, kv_stride,
                           token_stride, head_stride, block_size, kernel_block_size,
                           blocks_per_page, block_table, table_stride, rows, num_rows,
                           query_start_loc, seq_lens, num_heads, num_kv_heads, head_dim, scale,
                           window, chunk, softcap, sinks, fresh, fresh_stride, fresh_starts,
                           &none, num_threads);
}

/* hkv_paged_attention with per-query terms; soft-capping is refused (-1): the bias joins
   the score after the cap in the reference order, which the tile softmax does not keep. */
int hkv_paged_attention_scored(
    const float *q, int64_t q_token_stride, int64_t q_head_stride,
    float *out, int64_t out_token_stride, int64_t out_head_stride,
    const char *cache, int64_t codec, int64_t page_stride, int64_t slot_stride,
    int64_t kv_stride, int64_t token_stride, int64_t head_stride,
    int64_t block_size, int64_t kernel_block_size, int64_t blocks_per_page,
    const int64_t *block_table, int64_t table_stride,
    const int64_t *rows, int64_t num_rows,
    const int64_t *query_start_loc, const int64_t *seq_lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, int64_t chunk, const float *sinks,
    const float *bias, int64_t bias_token_stride, int64_t bias_head_stride, int64_t extent,
    const float *token_sinks, int64_t sink_token_stride, int64_t num_threads) {
    if (codec == CODEC_Q4 || (bias != NULL && extent <= 0)) return -1;
    const query_terms terms = {bias, bias_token_stride, bias_head_stride, extent, token_sinks,
                               sink_token_stride};
    return paged_attention(q, q_token_stride, q_head_stride, out, out_token_stride,
                           out_head_stride, cache, codec, page_stride, slot_stride, kv_stride,
                           token_stride, head_stride, block_size, kernel_block_size,
                           blocks_per_page, block_table, table_stride, rows, num_rows,
                           query_start_loc, seq_lens, num_heads, num_kv_heads, head_dim, scale,
                           window, chunk, 0.f, sinks, NULL, 0, NULL, &terms, num_threads);
}

static int paged_attention(
    const float *q, int64_t q_token_stride, int64_t q_head_stride,
    float *out, int64_t out_token_stride, int64_t out_head_stride,
    const char *cache, int64_t codec, int64_t page_stride, int64_t slot_stride,
    int64_t kv_stride, int64_t token_stride, int64_t head_stride,
    int64_t block_size, int64_t kernel_block_size, int64_t blocks_per_page,
    const int64_t *block_table, int64_t table_stride,
    const int64_t *rows, int64_t num_rows,
    const int64_t *query_start_loc, const int64_t *seq_lens,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, int64_t chunk, float softcap, const float *sinks,
    const float *fresh, int64_t fresh_stride, const int64_t *fresh_starts,
    const query_terms *terms, int64_t num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 ||
        num_heads * head_dim > (1 << 16) || head_dim > 1024 || codec < CODEC_F32 ||
        codec > CODEC_Q4 || (codec == CODEC_Q4 && (fresh == NULL || kernel_block_size % KEY_GROUP)))
        return -1;
    const q4_layout q4 = q4_layout_of(head_dim);
    const int quantized = codec != CODEC_F32;
#ifdef I8_DOT
    const int i8dot = codec == CODEC_INT8 && head_dim % GROUP == 0;
#endif
    const int64_t group = num_heads / num_kv_heads;
    kv_view kv = {cache, page_stride, slot_stride, kv_stride, token_stride, head_stride,
                  block_size, kernel_block_size, blocks_per_page};
    /* The bytes of one kernel block's K (or V) rows, prefetched a block ahead: the block
       table's indirection hides the next block from the hardware prefetcher. */
    const int64_t block_bytes = (kernel_block_size - 1) * token_stride
                                + num_kv_heads * head_stride;
    const int64_t tiles_per_block = (kernel_block_size + TILE - 1) / TILE;
    const int64_t pf_lines_per_head =
        (block_bytes / 64 + num_heads * tiles_per_block) / (num_heads * tiles_per_block);

    /* Queries are independent (each has its own running max, sum and output, over keys in
       one order): work items are runs of up to ITEM_QUERIES queries of one request, split
       across torch's OpenMP threads (the library links the libgomp torch has loaded, so
       both share one pool). A query's bytes do not depend on the item or thread it falls
       in, and a one-request prompt uses every thread. */
    int64_t items_stack[65];
    int64_t *item_start = num_rows < 64 ? items_stack : malloc(sizeof(int64_t) * (num_rows + 1));
    if (item_start == NULL) return -2;
    item_start[0] = 0;
    for (int64_t i = 0; i < num_rows; i++) {
        const int64_t nq = query_start_loc[rows[i] + 1] - query_start_loc[rows[i]];
        item_start[i + 1] = item_start[i] + (nq + ITEM_QUERIES - 1) / ITEM_QUERIES;
    }
    const int64_t num_items = item_start[num_rows];

    q4_rows *dec = NULL;
    int64_t *unit_start = NULL; /* key groups to decode, prefix sums over requests */
    if (codec == CODEC_Q4) {
        dec = calloc(num_rows, sizeof *dec);
        unit_start = malloc(sizeof(int64_t) * (num_rows + 1));
        if (dec == NULL || unit_start == NULL) {
            free(dec), free(unit_start);
            if (item_start != items_stack) free(item_start);
            return -2;
        }
        int64_t budget = Q4_ROWS_BYTES;
        unit_start[0] = 0;
        for (int64_t i = 0; i < num_rows; i++) {
            const int64_t r = rows[i], seq_len = seq_lens[r];
            const int64_t num_q = query_start_loc[r + 1] - query_start_loc[r];
            unit_start[i + 1] = unit_start[i];
            if (num_q <= ITEM_QUERIES) continue;
            const int64_t p0 = seq_len - num_q; /* the first query's keys start at lo */
            int64_t lo = 0;
            if (window > 0 && p0 - window + 1 > lo) lo = p0 - window + 1;
            if (chunk > 0 && p0 / chunk * chunk > lo) lo = p0 / chunk * chunk;
            const int64_t base = lo - lo % KEY_GROUP;
            const int64_t k_end = (seq_len - 1) - (seq_len - 1) % KEY_GROUP;
            const int64_t k_rows = k_end > base ? k_end - base : 0, v_rows = seq_len - base;
            const int64_t bytes = (int64_t)sizeof(float) * (k_rows + v_rows) * num_kv_heads * head_dim;
            if (bytes > budget) continue;
            float *buf = malloc(bytes);
            if (buf == NULL) continue; /* decoded per query instead: the same bytes */
            budget -= bytes;
            dec[i] = (q4_rows){buf + v_rows * num_kv_heads * head_dim, buf, base, k_end};
            unit_start[i + 1] += (v_rows + KEY_GROUP - 1) / KEY_GROUP;
        }
        const int64_t num_units = unit_start[num_rows];
#pragma omp parallel for schedule(dynamic, 4) num_threads(num_threads) \
    if (num_threads > 1 && num_units > 1)
        for (int64_t u = 0; u < num_units; u++) {
            int64_t i = 0, hi = num_rows;
            while (hi - i > 1) {
                const int64_t mid = (i + hi) / 2;
                if (unit_start[mid] <= u) i = mid; else hi = mid;
            }
            /* the last request with unit_start[i] <= u: one with rows to decode */
            const int64_t r = rows[i];
            decode_q4_group(&kv, &q4, block_table + r * table_stride, &dec[i], u - unit_start[i],
                            seq_lens[r], num_kv_heads, head_dim);
        }
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) \
    if (num_threads > 1 && num_items > 1)
    for (int64_t item = 0; item < num_items; item++) {
        int64_t i = 0, hi = num_rows; /* the request: item_start[i] <= item < item_start[i + 1] */
        while (hi - i > 1) {
            const int64_t mid = (i + hi) / 2;
            if (item_start[mid] <= item) i = mid; else hi = mid;
        }
        float qs[num_heads * head_dim];  /* scaled queries of one position, [Hq, D] */
        float acc[num_heads * head_dim]; /* running outputs [Hq, D] */
        float scores[TILE];
        /* A tile's decoded K and V rows of one KV head (quantized pages only). */
        float kbuf[quantized ? TILE * head_dim : 1], vbuf[quantized ? TILE * head_dim : 1];
        /* q4 K/V: the per-channel scales and minimums of the key group being decoded. */
        float kscale[codec == CODEC_Q4 ? head_dim : 1], kleast[codec == CODEC_Q4 ? head_dim : 1];
#ifdef I8_DOT
        /* int8 pages read in place: the queries as int8 with their scales, and a KV head's
           query heads' weights for a tile. */
        int8_t q8[i8dot ? num_heads * head_dim : 1];
        float qsc[i8dot ? num_heads * head_dim / GROUP : 1];
        float probs[i8dot ? group * TILE : 1], corr[i8dot ? group : 1];
#endif
        float run_max[num_heads], run_sum[num_heads];
        const char *pf_k = NULL, *pf_v = NULL; /* the block being prefetched, K and V */
        int64_t pf_at = 0;                       /* its bytes prefetched so far */
        const int64_t r = rows[i];
        const int64_t first_tok = query_start_loc[r];
        const int64_t num_q = query_start_loc[r + 1] - first_tok;
        const int64_t seq_len = seq_lens[r];
        const int64_t *table = block_table + r * table_stride;
        const int64_t j_first = (item - item_start[i]) * ITEM_QUERIES;
        const int64_t j_end = j_first + ITEM_QUERIES < num_q ? j_first + ITEM_QUERIES : num_q;
        for (int64_t j = j_first; j < j_end; j++) {
            const int64_t tok = first_tok + j;
            const int64_t pos = seq_len - num_q + j;
            int64_t lo = 0;
            if (window > 0 && pos - window + 1 > lo) lo = pos - window + 1;
            if (chunk > 0 && pos / chunk * chunk > lo) lo = pos / chunk * chunk;
            for (int64_t h = 0; h < num_heads; h++) {
                const float *src = q + tok * q_token_stride + h * q_head_stride;
                for (int64_t d = 0; d < head_dim; d++) qs[h * head_dim + d] = src[d] * scale;
#ifdef I8_DOT
                if (i8dot)
                    quantize_q8(qs + h * head_dim, head_dim, q8 + h * head_dim,
                                qsc + h * (head_dim / GROUP));
#else
                /* int8 pages are read with int8 queries on every path (the torch one
                   included): here the decoded rows meet the query's round trip. */
                if (codec == CODEC_INT8 && head_dim % GROUP == 0)
                    q8_round_trip(qs + h * head_dim, head_dim);
#endif
                const float *sink = terms->sinks != NULL
                    ? terms->sinks + tok * terms->sink_token_stride + h
                    : sinks != NULL ? sinks + h : NULL;
                run_max[h] = sink ? *sink : -INFINITY;
                run_sum[h] = sink ? 1.f : 0.f;
            }
            memset(acc, 0, sizeof(float) * num_heads * head_dim);
            /* q4 K/V: keys from `own` on (the query's group) are read from `fresh`. */
            const int64_t own = codec == CODEC_Q4 ? pos - pos % KEY_GROUP : pos + 1;
            const int64_t fresh_base =
                codec == CODEC_Q4 ? r * fresh_stride - fresh_starts[r] * num_kv_heads * head_dim : 0;
            for (int64_t t0 = lo; t0 <= pos;) {
                /* A tile never crosses a kernel block: its rows are evenly spaced. */
                const int64_t block_end = (t0 / kernel_block_size + 1) * kernel_block_size;
                int64_t end = block_end <= pos + 1 ? block_end : pos + 1;
                if (t0 < own && end > own) end = own; /* nor the query's own key group */
                const int64_t n = end - t0 < TILE ? end - t0 : TILE;
                const char *row0 = token_row(&kv, table, t0);
                if (t0 % kernel_block_size == 0) {
                    /* The block PREFETCH_BLOCKS ahead, in this row or the next one's first. */
                    const char *ahead = NULL;
                    const int64_t at = block_end + (PREFETCH_BLOCKS - 1) * kernel_block_size;
                    if (at <= pos)
                        ahead = token_row(&kv, table, at);
                    else if (j + 1 == num_q && i + 1 < num_rows) {
                        const int64_t r2 = rows[i + 1];
                        const int64_t k2 = (at - pos - 1) / kernel_block_size;
                        if (k2 * kernel_block_size < seq_lens[r2])
                            ahead = token_row(&kv, block_table + r2 * table_stride,
                                              k2 * kernel_block_size);
                    }
                    pf_k = ahead;
                    pf_v = ahead == NULL ? NULL : ahead + kv_stride;
                    pf_at = 0;
                }
                t0 += n;
                for (int64_t kh = 0; kh < num_kv_heads; kh++) {
                    /* The prefetch spread over the block's work, a few lines per key and
                       head: a burst of hundreds at the block's start fills the miss buffers
                       and stalls the core instead of overlapping it (1.5x slower from DRAM). */
                    const int64_t per_token = (pf_lines_per_head + n - 1) / n;
#define PREFETCH_HEAD()                                                                  \
    if (pf_k != NULL)                                                                    \
        for (int64_t c = 0; c < per_token * n && pf_at < block_bytes; c++, pf_at += 64) { \
            __builtin_prefetch(pf_k + pf_at, 0, 2);                                      \
            __builtin_prefetch(pf_v + pf_at, 0, 2);                                      \
        }
#ifdef I8_DOT
                    if (i8dot) {
                        const char *krow = row0 + kh * head_stride;
                        for (int64_t g = 0; g < group; g++) {
                            const int64_t h = kh * group + g;
                            PREFETCH_HEAD()
                            float *w = probs + g * TILE;
                            score_rows_i8(q8 + h * head_dim, qsc + h * (head_dim / GROUP),
                                          krow, token_stride, n, head_dim, w);
                            if (terms->bias != NULL)
                                add_bias(w, n, terms->bias + tok * terms->bias_token_stride
                                                   + h * terms->bias_head_stride,
                                         pos, t0 - n, terms->extent);
                            corr[g] = softmax_tile(w, n, softcap, &run_max[h], &run_sum[h]);
                        }
                        weigh_rows_i8(acc + kh * group * head_dim, corr, probs, group,
                                      krow + kv_stride, token_stride, n, head_dim);
                        continue;
                    }
#endif
                    /* The tile's rows as floats: in place, or decoded into the buffers. */
                    const float *k0, *v0;
                    int64_t stride;
                    if (codec == CODEC_Q4 && dec[i].v != NULL) {
                        /* Tiles stop at the query's own group: all decoded or all fresh. */
                        const int64_t first = t0 - n, hs = num_kv_heads * head_dim;
                        const q4_rows *s = &dec[i];
                        k0 = first < own ? s->k + (first - s->base) * hs + kh * head_dim
                                         : fresh + fresh_base + (first * num_kv_heads + kh) * head_dim;
                        v0 = s->v + (first - s->base) * hs + kh * head_dim;
                        stride = hs;
                    } else if (codec == CODEC_Q4) {
                        /* Tiles stop at the query's own group: all paged or all fresh. */
                        const int64_t first = t0 - n; /* t0 was advanced past the tile */
                        for (int64_t t = 0; t < n; t++) {
                            const char *row = row0 + t * token_stride + kh * head_stride;
                            const int64_t at = first + t;
                            decode_row((int)codec, row + kv_stride, head_dim, vbuf + t * head_dim);
                            if (at >= own) {
                                memcpy(kbuf + t * head_dim,
                                       fresh + fresh_base + (at * num_kv_heads + kh) * head_dim,
                                       sizeof(float) * head_dim);
                                continue;
                            }
                            if (t == 0 || at % KEY_GROUP == 0)
                                load_key_group(&q4, row - (at % KEY_GROUP) * token_stride,
                                               token_stride, kv_stride, head_dim, kscale, kleast);
                            decode_key_row(row, head_dim, kscale, kleast, kbuf + t * head_dim);
                        }
                        k0 = kbuf, v0 = vbuf, stride = head_dim;
                    } else if (quantized) {
                        for (int64_t t = 0; t < n; t++) {
                            const char *row = row0 + t * token_stride + kh * head_stride;
                            decode_row((int)codec, row, head_dim, kbuf + t * head_dim);
                            decode_row((int)codec, row + kv_stride, head_dim, vbuf + t * head_dim);
                        }
                        k0 = kbuf, v0 = vbuf, stride = head_dim;
                    } else {
                        k0 = (const float *)(row0 + kh * head_stride);
                        v0 = (const float *)(row0 + kv_stride + kh * head_stride);
                        stride = token_stride / 4;
                    }
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t h = kh * group + g;
                        PREFETCH_HEAD()
                        score_rows(qs + h * head_dim, k0, stride, n, head_dim, scores);
                        if (terms->bias != NULL) /* t0 was advanced past the tile */
                            add_bias(scores, n, terms->bias + tok * terms->bias_token_stride
                                                    + h * terms->bias_head_stride,
                                     pos, t0 - n, terms->extent);
                        const float correction = softmax_tile(scores, n, softcap, &run_max[h],
                                                              &run_sum[h]);
                        weigh_rows(acc + h * head_dim, correction, scores, v0, stride, n,
                                   head_dim);
                    }
#undef PREFETCH_HEAD
                }
            }
            for (int64_t h = 0; h < num_heads; h++) {
                float *dst = out + tok * out_token_stride + h * out_head_stride;
                const float inv = 1.f / run_sum[h];
                if (codec == CODEC_Q4) rotate_groups(acc + h * head_dim, head_dim);
                for (int64_t d = 0; d < head_dim; d++) dst[d] = acc[h * head_dim + d] * inv;
            }
        }
    }
    if (item_start != items_stack) free(item_start);
    if (dec != NULL)
        for (int64_t i = 0; i < num_rows; i++) free(dec[i].v); /* one buffer: v first */
    free(dec), free(unit_start);
    return 0;
}
