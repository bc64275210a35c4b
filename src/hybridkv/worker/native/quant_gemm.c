/* y = x W^T on GGML-quantized weights (and F32 / F16 / BF16 rows) with one order of
   arithmetic for every number of x rows: a row's result never depends on the rows beside it,
   so a token's K/V, logits and every activation are the same bytes whether it is computed
   alone, in a chunk of 7, after a cached prefix or in a batch of 32 (batch invariance).

   The order, per x row i and weight row j (K = cols, 8 lanes):
     w        the row's values dequantized 32 at a time (deq32: codes to float, times their
              scale, plus their min where the type has one, each value rounded once);
     acc      eight lane sums, acc = fma(w[k .. k + 8], x[k .. k + 8], acc) for k = 0, 8, ..
              K - 8 in that order;
     y        the lanes summed as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) (hsum8);
     gated    act(y_gate) * y_up by simd.h's gated_act (modes of worker/linear/cpu.py).
   Two kernels compute it:
     few rows   (decode: fewer than BUF_FROM x rows) dequantize each weight block in
                registers as they stream it, every x row of a pass dotting it (no float copy
                of the weights is written, so a decode step reads the quantized bytes once);
     many rows  (prefill, large batches) dequantize a chunk of weight rows once into a
                thread's buffer (the same deq32, stored) and run 3 x 3 register tiles of x
                rows against it.
   Both issue the same fma per (i, j, k) in the same k order and reduce alike, so they
   agree bitwise, whatever tile a row falls in and however the outputs are split over
   threads (work is split by output rows only; no reduction is ever split).

   The cost of the order against the kernels it replaced (quant.c's fused rows and the
   float tiles on dequantized panels, whose sums differed from each other): see
   docs/engine.md, "Batch invariance". */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QG_AVX2 1
#endif

#define BUF_FROM 8       /* x rows from which weight chunks are dequantized into a buffer */
#define CHUNK_ROWS 32    /* weight rows per work item (few rows) */
#define BUF_FLOATS 65536 /* a thread's buffer: 256 KiB of dequantized rows (many rows) */
#define MAX_BUF_ROWS 48

/* ---- 8-lane values ---- */
#if defined(QG_AVX2)
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float hsum8(vf a) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
/* Eight codes (int32 lanes) as floats. */
typedef __m256i vi;
static inline vf vi_float(vi q) { return _mm256_cvtepi32_ps(q); }
static inline vi u8_lanes(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline vi i8_lanes(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
static inline vi vi_and(vi a, int m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
static inline vi vi_shr(vi a, int s) { return _mm256_srli_epi32(a, s); }
static inline vi vi_shl(vi a, int s) { return _mm256_slli_epi32(a, s); }
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_sub(vi a, int s) { return _mm256_sub_epi32(a, _mm256_set1_epi32(s)); }
/* Lane l: bit (first + l) of `bits`. */
static inline vi bit_lanes(uint32_t bits, int first) {
    const vi shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return vi_and(_mm256_srlv_epi32(_mm256_set1_epi32((int)(bits >> first)), shifts), 1);
}
static inline vf f16_lanes(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vf bf16_lanes(const uint8_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#else
/* The same arithmetic lane by lane (fmaf: one rounding, as the FMA instruction). */
typedef struct { float l[8]; } vf;
typedef struct { int32_t l[8]; } vi;
static inline vf vf_zero(void) { vf r = {{0}}; return r; }
static inline vf vf_load(const float *p) { vf r; memcpy(r.l, p, sizeof r.l); return r; }
static inline void vf_store(float *p, vf a) { memcpy(p, a.l, sizeof a.l); }
static inline vf vf_set1(float a) { vf r; for (int i = 0; i < 8; i++) r.l[i] = a; return r; }
static inline vf vf_mul(vf a, vf b) { for (int i = 0; i < 8; i++) a.l[i] *= b.l[i]; return a; }
static inline vf vf_fma(vf a, vf b, vf c) {
    for (int i = 0; i < 8; i++) c.l[i] = fmaf(a.l[i], b.l[i], c.l[i]);
    return c;
}
static inline float hsum8(vf a) {
    float s4[4], s2[2];
    for (int i = 0; i < 4; i++) s4[i] = a.l[i] + a.l[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}
static inline vf vi_float(vi q) { vf r; for (int i = 0; i < 8; i++) r.l[i] = (float)q.l[i]; return r; }
static inline vi u8_lanes(const uint8_t *p) { vi r; for (int i = 0; i < 8; i++) r.l[i] = p[i]; return r; }
static inline vi i8_lanes(const uint8_t *p) {
    vi r;
    for (int i = 0; i < 8; i++) r.l[i] = (int8_t)p[i];
    return r;
}
static inline vi vi_and(vi a, int m) { for (int i = 0; i < 8; i++) a.l[i] &= m; return a; }
static inline vi vi_shr(vi a, int s) {
    for (int i = 0; i < 8; i++) a.l[i] = (int32_t)((uint32_t)a.l[i] >> s);
    return a;
}
static inline vi vi_shl(vi a, int s) { for (int i = 0; i < 8; i++) a.l[i] <<= s; return a; }
static inline vi vi_or(vi a, vi b) { for (int i = 0; i < 8; i++) a.l[i] |= b.l[i]; return a; }
static inline vi vi_sub(vi a, int s) { for (int i = 0; i < 8; i++) a.l[i] -= s; return a; }
static inline vi bit_lanes(uint32_t bits, int first) {
    vi r;
    for (int i = 0; i < 8; i++) r.l[i] = (int32_t)((bits >> (first + i)) & 1);
    return r;
}
static inline vf f16_lanes(const uint8_t *p) {
    vf r;
    for (int i = 0; i < 8; i++) r.l[i] = half_to_float(rd16(p + 2 * i));
    return r;
}
static inline vf bf16_lanes(const uint8_t *p) {
    vf r;
    for (int i = 0; i < 8; i++) {
        const uint32_t bits = (uint32_t)rd16(p + 2 * i) << 16;
        memcpy(&r.l[i], &bits, 4);
    }
    return r;
}
#endif

/* Whether `type`'s blocks hold 256 values (eight sub-blocks of 32, whose scales come from
   the block's header: walked a block at a time so the header is read once). */
static inline int super_block(int type) {
    return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

/* Q4_K / Q5_K block p's sub-block s: its scale d sc and its offset -(dmin mn), both
   dequantizations' (so both give the same values). */
static inline void k_scale_min(const uint8_t *p, int s, vf *d, vf *m) {
    float sc, mn;
    scale_min_k4(p + 4, s, &sc, &mn);
    *d = vf_set1(half_to_float(rd16(p)) * sc);
    *m = vf_set1(-(half_to_float(rd16(p + 2)) * mn));
}

/* ---- Dequantization, 32 values at a time ----
   w[t] = values 32 sb + 8 t .. + 7 of the row (sb: sub-block `sub` of 256-value block `blk`,
   else block `blk`, sub 0): d q (Q4_0, Q5_0, Q8_0, Q6_K with
   d = block scale times sub-block scale), fma(q, d, m) for the types with a min (Q4_1,
   Q5_1; Q4_K / Q5_K with d = d sc and m = -(dmin mn)). */
static inline __attribute__((always_inline)) void deq32_lanes(const int type, const uint8_t *row,
                                                              int64_t blk, const int sub, vf w[4]) {
    const int64_t sb = blk * (super_block(type) ? 8 : 1) + sub;
    switch (type) {
    case T_Q8_0: {
        const uint8_t *p = row + sb * 34;
        const vf d = vf_set1(half_to_float(rd16(p)));
        for (int t = 0; t < 4; t++) w[t] = vf_mul(vi_float(i8_lanes(p + 2 + 8 * t)), d);
        return;
    }
    case T_Q4_0:
    case T_Q4_1:
    case T_Q5_0:
    case T_Q5_1: {
        const int with_min = type == T_Q4_1 || type == T_Q5_1;
        const int five = type == T_Q5_0 || type == T_Q5_1;
        const int64_t size = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
        const uint8_t *p = row + sb * size;
        const uint8_t *qs = p + 2 + 2 * with_min + 4 * five;
        const uint32_t qh = five ? rd32(p + 2 + 2 * with_min) : 0;
        const vf d = vf_set1(half_to_float(rd16(p)));
        const vf m = vf_set1(with_min ? half_to_float(rd16(p + 2)) : 0.f);
        for (int t = 0; t < 4; t++) {
            /* values 0-15: low nibbles of qs[0..16), 16-31: their high nibbles */
            const vi b = u8_lanes(qs + 8 * (t & 1));
            vi q = t < 2 ? vi_and(b, 15) : vi_shr(b, 4);
            if (five) q = vi_or(q, vi_shl(bit_lanes(qh, 8 * t), 4));
            if (with_min) {
                w[t] = vf_fma(vi_float(q), d, m);
            } else {
                w[t] = vf_mul(vi_float(vi_sub(q, five ? 16 : 8)), d);
            }
        }
        return;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int five = type == T_Q5_K;
        const int s = sub;
        const uint8_t *p = row + blk * (five ? 176 : 144);
        vf d, m;
        k_scale_min(p, s, &d, &m);
        const uint8_t *qh = p + 16, *qs = p + (five ? 48 : 16) + 32 * (s >> 1);
        for (int t = 0; t < 4; t++) {
            vi q = vi_and(vi_shr(u8_lanes(qs + 8 * t), 4 * (s & 1)), 15);
            if (five) q = vi_or(q, vi_shl(vi_and(vi_shr(u8_lanes(qh + 8 * t), s), 1), 4));
            w[t] = vf_fma(vi_float(q), d, m);
        }
        return;
    }
    case T_Q6_K: {
        const int h = sub >> 2, s = sub & 3;
        const uint8_t *p = row + blk * 210;
        const uint8_t *ql = p + 64 * h + 32 * (s & 1), *qh = p + 128 + 32 * h;
        const int8_t *scales = (const int8_t *)(p + 192);
        const float d = half_to_float(rd16(p + 208));
        for (int t = 0; t < 4; t++) {
            const vi lo = vi_and(vi_shr(u8_lanes(ql + 8 * t), 4 * (s >> 1)), 15);
            const vi hi = vi_and(vi_shr(u8_lanes(qh + 8 * t), 2 * s), 3);
            const vf ds = vf_set1(d * (float)scales[8 * h + 2 * s + (t >> 1)]);
            w[t] = vf_mul(vi_float(vi_sub(vi_or(lo, vi_shl(hi, 4)), 32)), ds);
        }
        return;
    }
    case T_F32:
        for (int t = 0; t < 4; t++) w[t] = vf_load((const float *)(const void *)row + 32 * sb + 8 * t);
        return;
    case T_F16:
        for (int t = 0; t < 4; t++) w[t] = f16_lanes(row + 2 * (32 * sb + 8 * t));
        return;
    case T_BF16:
        for (int t = 0; t < 4; t++) w[t] = bf16_lanes(row + 2 * (32 * sb + 8 * t));
        return;
    default:
        for (int t = 0; t < 4; t++) w[t] = vf_zero();
        return;
    }
}

#if defined(QG_AVX2)
/* 32 byte codes as floats: w[t] = code d (d0 for values 0-15, d1 for 16-31), or
   fma(code, d, m) (with_min): the values deq32_lanes gives, built from whole registers of
   bytes (lane by lane the integer work was 1.2-1.8x a decode step's matmul time). */
static inline __attribute__((always_inline)) void widen32(__m256i q, vf d0, vf d1, vf m,
                                                          const int with_min, vf w[4]) {
    const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
    const __m128i parts[4] = {a, _mm_srli_si128(a, 8), b, _mm_srli_si128(b, 8)};
    for (int t = 0; t < 4; t++) {
        const vf f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[t]));
        const vf d = t < 2 ? d0 : d1;
        w[t] = with_min ? vf_fma(f, d, m) : vf_mul(f, d);
    }
}

/* A sub-block's 32 codes as signed bytes and the scales that make them values (widen32):
   code d0 (values 0-15), code d1 (16-31), or fma(code, d0, m) for the types with a min. */
typedef struct {
    __m256i q;
    float d0, d1, m;
} codes32;

static inline int with_min(int type) {
    return type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K;
}

/* A 256-value type's sub-block `sub` of block `blk`, its block's scales from block_scales
   (the same float products deq32_lanes makes per sub-block). */
static inline __attribute__((always_inline)) codes32 k_codes(const int type, const uint8_t *row,
                                                             int64_t blk, const int sub,
                                                             const float *d, const float *m) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    codes32 c;
    if (type == T_Q6_K) {
        const int h = sub >> 2, s = sub & 3;
        const uint8_t *p = row + blk * 210;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32 * (s & 1)));
        if (s >> 1) lo = _mm256_srli_epi16(lo, 4);
        lo = _mm256_and_si256(lo, low4);
        __m256i hi = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
        hi = _mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * s));
        hi = _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(3)), 4);
        c.q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
        c.d0 = d[8 * h + 2 * s], c.d1 = d[8 * h + 2 * s + 1], c.m = 0.f;
        return c;
    }
    const int five = type == T_Q5_K;
    const uint8_t *p = row + blk * (five ? 176 : 144);
    __m256i q = _mm256_loadu_si256((const __m256i *)(p + (five ? 48 : 16) + 32 * (sub >> 1)));
    if (sub & 1) q = _mm256_srli_epi16(q, 4);
    q = _mm256_and_si256(q, low4);
    if (five) {
        const __m256i bit = _mm256_set1_epi8((char)(1 << sub));
        const __m256i hv = _mm256_loadu_si256((const __m256i *)(p + 16));
        q = _mm256_or_si256(q, _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(hv, bit), bit), _mm256_set1_epi8(0x10)));
    }
    c.q = q, c.d0 = c.d1 = d[sub], c.m = m[sub];
    return c;
}

/* Block `blk` of a 32-value type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). */
static inline __attribute__((always_inline)) codes32 block_codes(const int type,
                                                                 const uint8_t *row,
                                                                 int64_t blk) {
    codes32 c;
    if (type == T_Q8_0) {
        const uint8_t *p = row + blk * 34;
        c.q = _mm256_loadu_si256((const __m256i *)(p + 2));
        c.d0 = c.d1 = half_to_float(rd16(p)), c.m = 0.f;
        return c;
    }
    const int five = type == T_Q5_0 || type == T_Q5_1, min = with_min(type);
    const int64_t size = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
    const uint8_t *p = row + blk * size;
    __m256i q = nibbles32(p + 2 + 2 * min + 4 * five);
    if (five) q = _mm256_or_si256(q, bits_to_0x10(rd32(p + 2 + 2 * min)));
    if (!min) q = _mm256_sub_epi8(q, _mm256_set1_epi8(five ? 16 : 8));
    c.q = q, c.d0 = c.d1 = half_to_float(rd16(p)), c.m = min ? half_to_float(rd16(p + 2)) : 0.f;
    return c;
}

static inline __attribute__((always_inline)) void widen_codes(const int type, codes32 c, vf w[4]) {
    widen32(c.q, vf_set1(c.d0), vf_set1(c.d1), vf_set1(c.m), with_min(type), w);
}

/* 32-value types through their codes; the 256-value ones are deq32_k's (the few-row and
   buffered kernels read their block's scales once), the float types deq32_lanes'. */
static inline __attribute__((always_inline)) void deq32(const int type, const uint8_t *row,
                                                        int64_t blk, const int sub, vf w[4]) {
    switch (type) {
    case T_Q8_0: case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1:
        widen_codes(type, block_codes(type, row, blk), w);
        return;
    default:
        deq32_lanes(type, row, blk, sub, w);
        return;
    }
}
#else
#define deq32 deq32_lanes
#endif

/* A 256-value block's sub-block scales, as deq32 computes them one sub-block at a time
   (the same float products, so the same values): Q4_K / Q5_K d[s] = d sc_s and m[s] =
   -(dmin mn_s); Q6_K d[i] = d scale_i for its 16 groups of 16. The few-row kernel reads a
   block's header once per weight row instead of once per sub-block (unpacking the 6-bit
   scales and converting the halves was most of a K-quant decode's instructions). */
static inline __attribute__((always_inline)) void block_scales(const int type, const uint8_t *row,
                                                               int64_t blk, float d[16], float m[8]) {
    if (type == T_Q6_K) {
        const uint8_t *p = row + blk * 210;
        const int8_t *scales = (const int8_t *)(p + 192);
        const float dd = half_to_float(rd16(p + 208));
        for (int i = 0; i < 16; i++) d[i] = dd * (float)scales[i];
        return;
    }
    const uint8_t *p = row + blk * (type == T_Q5_K ? 176 : 144);
    const float dd = half_to_float(rd16(p)), dm = half_to_float(rd16(p + 2));
    for (int s = 0; s < 8; s++) {
        float sc, mn;
        scale_min_k4(p + 4, s, &sc, &mn);
        d[s] = dd * sc;
        m[s] = -(dm * mn);
    }
}

/* deq32 for a 256-value type with its block's scales from block_scales. */
static inline __attribute__((always_inline)) void deq32_k(const int type, const uint8_t *row,
                                                          int64_t blk, const int sub,
                                                          const float *d, const float *m,
                                                          vf w[4]) {
#if defined(QG_AVX2)
    widen_codes(type, k_codes(type, row, blk, sub, d, m), w);
#else
    (void)d, (void)m;
    deq32_lanes(type, row, blk, sub, w);
#endif
}

static int gemm_type(int type) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_Q4_K:
    case T_Q5_K: case T_Q6_K: case T_F32: case T_F16: case T_BF16:
        return 1;
    default:
        return 0;
    }
}

/* ---- Few rows: weight blocks dequantized in registers ----
   sums[i * lds + j] = the order's y for x rows i < R and the C weight rows wr[j]. */
static inline __attribute__((always_inline)) void tile_codes(
    const int type, const uint8_t *const *wr, int64_t cols, const float *x, int64_t ldx,
    float *sums, int64_t lds, const int R, const int C) {
    vf acc[4][4];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) acc[i][j] = vf_zero();
    const int per = super_block(type) ? 8 : 1;
    const int64_t blocks = cols / (32 * per);
    /* Sub-blocks outer, weight rows inner: the C rows' FMA chains interleave (one row's
       eight sub-blocks in a row kept each step waiting on the last: 1.2-1.7x slower). */
    for (int64_t b = 0; b < blocks; b++) {
        float kd[4][16], km[4][8]; /* 256-value types: each row's sub-block scales */
        if (super_block(type))
            for (int j = 0; j < C; j++) block_scales(type, wr[j], b, kd[j], km[j]);
        /* Unrolled: a sub-block's shifts become immediates (a shift by a register count
           was a K-quant decode's hottest instruction). */
#pragma GCC unroll 8
        for (int u = 0; u < per; u++) {
            const float *xk = x + 32 * (b * per + u);
            for (int j = 0; j < C; j++) {
                vf w[4];
                if (super_block(type))
                    deq32_k(type, wr[j], b, u, kd[j], km[j], w);
                else
                    deq32(type, wr[j], b, u, w);
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < R; i++)
                        acc[i][j] = vf_fma(w[t], vf_load(xk + i * ldx + 8 * t), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) sums[i * lds + j] = hsum8(acc[i][j]);
}

/* tile_codes for each (R, C) with `type` constant. */
static inline __attribute__((always_inline)) void tile_codes_any(
    const int type, const uint8_t *const *wr, int64_t cols, const float *x, int64_t ldx,
    float *sums, int64_t lds, int r, int c) {
#define TC(R, C) case (R) * 8 + (C): tile_codes(type, wr, cols, x, ldx, sums, lds, R, C); break;
    switch (r * 8 + c) {
    TC(1, 4) TC(1, 3) TC(1, 2) TC(1, 1) TC(2, 4) TC(2, 3) TC(2, 2) TC(2, 1)
    TC(3, 2) TC(3, 1) TC(4, 2) TC(4, 1)
    default: break;
    }
#undef TC
}

static void codes_chunk(int type, const uint8_t *const *wr, int64_t nr, int64_t cols,
                        const float *x, int64_t m, int64_t ldx, float *sums, int64_t lds) {
#define TYPED(T) case T:                                                                  \
    for (int64_t i = 0; i < m;) {                                                         \
        const int r = m - i >= 4 ? 4 : (int)(m - i);                                      \
        const int c = r <= 2 ? 4 : 2;                                                     \
        for (int64_t j = 0; j < nr; j += c)                                               \
            tile_codes_any(T, wr + j, cols, x + i * ldx, ldx, sums + i * lds + j, lds, r, \
                           nr - j < c ? (int)(nr - j) : c);                               \
        i += r;                                                                           \
    }                                                                                     \
    break;
    switch (type) {
    TYPED(T_Q4_0) TYPED(T_Q4_1) TYPED(T_Q5_0) TYPED(T_Q5_1) TYPED(T_Q8_0) TYPED(T_Q4_K)
    TYPED(T_Q5_K) TYPED(T_Q6_K) TYPED(T_F32) TYPED(T_F16) TYPED(T_BF16)
    default: break;
    }
#undef TYPED
}

/* ---- Many rows: a chunk of weight rows dequantized once, register tiles over it ---- */
static inline __attribute__((always_inline)) void tile_buf(
    const float *w, int64_t cols, const float *x, int64_t ldx, float *sums, int64_t lds,
    const int R, const int C) {
    vf acc[3][3];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) acc[i][j] = vf_zero();
    for (int64_t k = 0; k < cols; k += 8) {
        vf wv[3];
        for (int j = 0; j < C; j++) wv[j] = vf_load(w + j * cols + k);
        for (int i = 0; i < R; i++) {
            const vf xv = vf_load(x + i * ldx + k);
            for (int j = 0; j < C; j++) acc[i][j] = vf_fma(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) sums[i * lds + j] = hsum8(acc[i][j]);
}

/* The full 3 x 3 tile, its six operands loaded once a step: left to itself GCC folds a
   load into every FMA (18 loads for 9 FMAs, load-bound at twice the time). The same fma
   per (i, j, k) as tile_buf. */
static void tile_buf33(const float *w, int64_t cols, const float *x, int64_t ldx,
                       float *sums, int64_t lds) {
    const float *w0 = w, *w1 = w + cols, *w2 = w + 2 * cols;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx;
    vf a00 = vf_zero(), a01 = vf_zero(), a02 = vf_zero(), a10 = vf_zero(), a11 = vf_zero(),
       a12 = vf_zero(), a20 = vf_zero(), a21 = vf_zero(), a22 = vf_zero();
    for (int64_t k = 0; k < cols; k += 8) {
        vf b0 = vf_load(w0 + k), b1 = vf_load(w1 + k), b2 = vf_load(w2 + k);
        vf c0 = vf_load(x0 + k), c1 = vf_load(x1 + k), c2 = vf_load(x2 + k);
#if defined(QG_AVX2)
        /* Keep the six operands in registers (else GCC folds each load into the FMAs). */
        __asm__("" : "+x"(b0), "+x"(b1), "+x"(b2), "+x"(c0), "+x"(c1), "+x"(c2));
#endif
        a00 = vf_fma(b0, c0, a00);
        a01 = vf_fma(b1, c0, a01);
        a02 = vf_fma(b2, c0, a02);
        a10 = vf_fma(b0, c1, a10);
        a11 = vf_fma(b1, c1, a11);
        a12 = vf_fma(b2, c1, a12);
        a20 = vf_fma(b0, c2, a20);
        a21 = vf_fma(b1, c2, a21);
        a22 = vf_fma(b2, c2, a22);
    }
    sums[0] = hsum8(a00), sums[1] = hsum8(a01), sums[2] = hsum8(a02);
    sums[lds] = hsum8(a10), sums[lds + 1] = hsum8(a11), sums[lds + 2] = hsum8(a12);
    sums[2 * lds] = hsum8(a20), sums[2 * lds + 1] = hsum8(a21), sums[2 * lds + 2] = hsum8(a22);
}

static void buf_rows(const float *w, int64_t nr, int64_t cols, const float *x, int64_t r,
                     int64_t ldx, float *sums, int64_t lds) {
#define TB(R, C) case (R) * 4 + (C): tile_buf(w + j * cols, cols, x, ldx, sums + j, lds, R, C); break;
    for (int64_t j = 0; j < nr; j += 3) {
        const int c = nr - j < 3 ? (int)(nr - j) : 3;
        switch ((int)r * 4 + c) {
        case 15: tile_buf33(w + j * cols, cols, x, ldx, sums + j, lds); break;
        TB(3, 2) TB(3, 1) TB(2, 3) TB(2, 2) TB(2, 1) TB(1, 3) TB(1, 2) TB(1, 1)
        default: break;
        }
    }
#undef TB
}

static void deq_rows(int type, const uint8_t *const *wr, int64_t nr, int64_t cols, float *out) {
#define DQ(T) case T:                                                                       \
    for (int64_t j = 0; j < nr; j++)                                                        \
        for (int64_t b = 0; b < cols / (32 * (super_block(T) ? 8 : 1)); b++) {             \
            float kd[16], km[8];                                                            \
            if (super_block(T)) block_scales(T, wr[j], b, kd, km);                          \
            for (int u = 0; u < (super_block(T) ? 8 : 1); u++) {                            \
                vf w[4];                                                                    \
                float *o = out + j * cols + 32 * (b * (super_block(T) ? 8 : 1) + u);        \
                if (super_block(T))                                                         \
                    deq32_k(T, wr[j], b, u, kd, km, w);                                     \
                else                                                                        \
                    deq32(T, wr[j], b, u, w);                                               \
                for (int t = 0; t < 4; t++) vf_store(o + 8 * t, w[t]);                      \
            }                                                                               \
        }                                                                                   \
    break;
    switch (type) {
    DQ(T_Q4_0) DQ(T_Q4_1) DQ(T_Q5_0) DQ(T_Q5_1) DQ(T_Q8_0) DQ(T_Q4_K) DQ(T_Q5_K) DQ(T_Q6_K)
    DQ(T_F32) DQ(T_F16) DQ(T_BF16)
    default: break;
    }
#undef DQ
}

/* A thread's buffer of dequantized rows, kept for its next calls (grown, never freed: it
   is BUF_FLOATS floats, or two rows where rows are wider, and a fresh allocation of that
   size per call costs a mapping and its page faults). */
static __thread float *thread_buf;
static __thread int64_t thread_buf_floats;

/* y[i, j0 + j] for the chunk's outputs from their sums (plain, or gated: sums hold gate,
   up pairs, which gated_row takes from a copy side by side). */
static inline void finish(const float *sums, int64_t lds, int64_t m, int64_t outs, int mode,
                          float *y, int64_t ldy) {
    for (int64_t i = 0; i < m; i++) {
        const float *s = sums + i * lds;
        if (!mode) {
            memcpy(y + i * ldy, s, (size_t)outs * sizeof(float));
            continue;
        }
        float g[MAX_BUF_ROWS], u[MAX_BUF_ROWS];
        for (int64_t j = 0; j < outs; j++) g[j] = s[2 * j], u[j] = s[2 * j + 1];
        gated_row(g, u, outs, mode, y + i * ldy);
    }
}

/* out [m, n] (row stride ldo) = act(g) * u (simd.h's gated_row), for gate and up
   computed apart (matrices of two block types). */
void hkv_gated_rows(const float *g, int64_t ldg, const float *u, int64_t ldu, int64_t m,
                    int64_t n, int mode, float *out, int64_t ldo) {
    for (int64_t i = 0; i < m; i++) gated_row(g + i * ldg, u + i * ldu, n, mode, out + i * ldo);
}

/* y [m, n] (row stride ldy) = x [m, cols] (row stride ldx) times W^T, W's rows of `type`
   at row stride ldw bytes: mode 0, W holds the n output rows; a gated mode (1 SiLU, 2
   GELU-tanh, 3 ReLU), y = act(x G^T) * (x U^T) with G = W's first n rows and U = u's n rows
   (same type and stride), or W's next n rows where u is NULL. Gate and up stay two
   matrices where they lie in the file (a mapped GGUF), rather than one copy side by side.
   cols: a multiple of 32 (whole blocks of every quantized type). Returns -1 for a type or
   width not handled here, -2 when a buffer cannot be allocated, else 0. */
int hkv_quant_gemm(const float *x, int64_t m, int64_t ldx, const uint8_t *w, int64_t ldw,
                   int type, int64_t n, int64_t cols, float *y, int64_t ldy, int mode,
                   const uint8_t *u) {
    if (u == NULL) u = w + n * ldw;
    if (!gemm_type(type) || cols % 32 || cols <= 0) return -1;
    if (m <= 0 || n <= 0) return 0;
    const int gated = mode != 0;
    const int many = m >= BUF_FROM;
    int64_t rows_per = CHUNK_ROWS;
    if (many) {
        rows_per = BUF_FLOATS / cols;
        if (rows_per > MAX_BUF_ROWS) rows_per = MAX_BUF_ROWS;
        if (rows_per < 2) rows_per = 2;
    }
    if (gated) rows_per -= rows_per % 2;
    const int64_t outs_per = gated ? rows_per / 2 : rows_per;
    const int64_t chunks = (n + outs_per - 1) / outs_per;
    const int parallel = m * n * cols >= (1 << 17) && chunks > 1;
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        /* sums of one group of x rows (3 or 4) against the chunk's weight rows */
        float sums[4 * 2 * MAX_BUF_ROWS];
        const uint8_t *wr[2 * MAX_BUF_ROWS];
        float *buf = NULL;
        if (many) {
            /* Rows wider than BUF_FLOATS / 2 still take two rows a chunk. */
            const int64_t need = rows_per * cols > BUF_FLOATS ? rows_per * cols : BUF_FLOATS;
            if (thread_buf_floats < need) {
                free(thread_buf);
                thread_buf = malloc((size_t)need * sizeof(float));
                thread_buf_floats = thread_buf == NULL ? 0 : need;
            }
            buf = thread_buf;
            if (buf == NULL) {
#pragma omp atomic write
                failed = 1;
            }
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            if (many && buf == NULL) continue;
            const int64_t j0 = c * outs_per;
            const int64_t outs = n - j0 < outs_per ? n - j0 : outs_per;
            const int64_t nr = gated ? 2 * outs : outs;
            for (int64_t j = 0; j < outs; j++) {
                if (gated) {
                    wr[2 * j] = w + (j0 + j) * ldw;
                    wr[2 * j + 1] = u + (j0 + j) * ldw;
                } else {
                    wr[j] = w + (j0 + j) * ldw;
                }
            }
            if (many) {
                deq_rows(type, wr, nr, cols, buf);
                for (int64_t i = 0; i < m; i += 3) {
                    const int64_t r = m - i < 3 ? m - i : 3;
                    buf_rows(buf, nr, cols, x + i * ldx, r, ldx, sums, nr);
                    finish(sums, nr, r, outs, mode, y + i * ldy + j0, ldy);
                }
            } else {
                for (int64_t i = 0; i < m; i += 4) {
                    const int64_t r = m - i < 4 ? m - i : 4;
                    codes_chunk(type, wr, nr, cols, x + i * ldx, r, ldx, sums, nr);
                    finish(sums, nr, r, outs, mode, y + i * ldy + j0, ldy);
                }
            }
        }
    }
    return failed ? -2 : 0;
}
