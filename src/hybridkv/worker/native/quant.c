/* GGML-quantized weights on the CPU: dequantization, row gathers (embeddings) and
   y = x W^T with W kept in its GGUF blocks (worker/linear/quant.py calls these).

   The block layouts (as gguf-py's quants.py reads them; all little-endian, f16 scales):
     Q4_0  32 values, 18 bytes: d, qs[16]; value j = d (nibble - 8), low nibbles j < 16,
           high nibbles j >= 16.
     Q4_1  32 / 20: d, m, qs[16]; d q + m.
     Q5_0  32 / 22: d, qh (u32: bit j is value j's fifth bit), qs[16]; d (q - 16).
     Q5_1  32 / 24: d, m, qh, qs[16]; d q + m.
     Q8_0  32 / 34: d, qs[32] int8; d q.
     Q4_K  256 / 144: d, dmin, scales[12] (eight 6-bit scales and mins), qs[128]; sub-block s
           (32 values) is nibble (s & 1) of bytes 32 (s / 2) ... + 31; d sc q - dmin m.
     Q5_K  256 / 176: as Q4_K with qh[32] before qs: value i of sub-block s has bit s of qh[i]
           as its fifth bit.
     Q6_K  256 / 210: ql[128], qh[64], scales[16] int8 (one per 16 values), d; value
           h 128 + s 32 + i: low nibble (s / 2) of ql[64 h + 32 (s & 1) + i], high two bits
           (2 s) of qh[32 h + i], minus 32.
     F32, F16, BF16: one value a block.

   The product here is the 8-bit activations' (off by default): for the quantized types
   with AVX2 it quantizes every x row to 8 bits once per call (at any number of rows, each
   row alone: batch invariant) and takes integer dot products with each weight block (no
   float copy of the weights, so decode streams the quantized rows once, near memory
   bandwidth); hkv_quant_gemm_int8 is the same product with quant_gemm.c's call, gated
   modes included (the native decode layers).
   x in float takes quant_gemm.c, whose order of arithmetic does not depend on the number
   of rows (worker/linear/quant.py); hkv_quant_matmul refuses it (-1).
   hkv_quant_float_activations(1) keeps x in float on every path. Work is split over
   torch's OpenMP threads. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "quant_blocks.h"

/* The portable dequantization: nb blocks starting at p -> nb * values floats. */
static void dequant_blocks_portable(int type, const uint8_t *p, int64_t nb, float *out) {
    switch (type) {
    case T_F32:
        memcpy(out, p, (size_t)nb * 4);
        break;
    case T_F16: {
        int64_t i = 0;
#if defined(__F16C__)
        for (; i + 8 <= nb; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * i))));
#endif
        for (; i < nb; i++) out[i] = half_to_float(rd16(p + 2 * i));
        break;
    }
    case T_BF16:
        for (int64_t i = 0; i < nb; i++) {
            const uint32_t bits = (uint32_t)rd16(p + 2 * i) << 16;
            memcpy(out + i, &bits, 4);
        }
        break;
    case T_Q4_0:
        for (int64_t b = 0; b < nb; b++, p += 18, out += 32) {
            const float d = half_to_float(rd16(p));
            const uint8_t *q = p + 2;
            for (int j = 0; j < 16; j++) {
                out[j] = d * (float)((int)(q[j] & 15) - 8);
                out[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
            }
        }
        break;
    case T_Q4_1:
        for (int64_t b = 0; b < nb; b++, p += 20, out += 32) {
            const float d = half_to_float(rd16(p)), m = half_to_float(rd16(p + 2));
            const uint8_t *q = p + 4;
            for (int j = 0; j < 16; j++) {
                out[j] = d * (float)(q[j] & 15) + m;
                out[j + 16] = d * (float)(q[j] >> 4) + m;
            }
        }
        break;
    case T_Q5_0:
        for (int64_t b = 0; b < nb; b++, p += 22, out += 32) {
            const float d = half_to_float(rd16(p));
            const uint32_t qh = rd32(p + 2);
            const uint8_t *q = p + 6;
            for (int j = 0; j < 16; j++) {
                const int lo = (q[j] & 15) | (int)(((qh >> j) & 1) << 4);
                const int hi = (q[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
                out[j] = d * (float)(lo - 16);
                out[j + 16] = d * (float)(hi - 16);
            }
        }
        break;
    case T_Q5_1:
        for (int64_t b = 0; b < nb; b++, p += 24, out += 32) {
            const float d = half_to_float(rd16(p)), m = half_to_float(rd16(p + 2));
            const uint32_t qh = rd32(p + 4);
            const uint8_t *q = p + 8;
            for (int j = 0; j < 16; j++) {
                const int lo = (q[j] & 15) | (int)(((qh >> j) & 1) << 4);
                const int hi = (q[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
                out[j] = d * (float)lo + m;
                out[j + 16] = d * (float)hi + m;
            }
        }
        break;
    case T_Q8_0:
        for (int64_t b = 0; b < nb; b++, p += 34, out += 32) {
            const float d = half_to_float(rd16(p));
            const int8_t *q = (const int8_t *)(p + 2);
            for (int j = 0; j < 32; j++) out[j] = d * (float)q[j];
        }
        break;
    case T_Q4_K:
        for (int64_t b = 0; b < nb; b++, p += 144, out += 256) {
            const float d = half_to_float(rd16(p)), dmin = half_to_float(rd16(p + 2));
            const uint8_t *sc = p + 4, *q = p + 16;
            for (int s = 0; s < 8; s += 2) {
                float s0, m0, s1, m1;
                scale_min_k4(sc, s, &s0, &m0);
                scale_min_k4(sc, s + 1, &s1, &m1);
                const float d0 = d * s0, o0 = dmin * m0, d1 = d * s1, o1 = dmin * m1;
                const uint8_t *qq = q + 16 * s;
                float *o = out + 32 * s;
                for (int i = 0; i < 32; i++) {
                    o[i] = d0 * (float)(qq[i] & 15) - o0;
                    o[i + 32] = d1 * (float)(qq[i] >> 4) - o1;
                }
            }
        }
        break;
    case T_Q5_K:
        for (int64_t b = 0; b < nb; b++, p += 176, out += 256) {
            const float d = half_to_float(rd16(p)), dmin = half_to_float(rd16(p + 2));
            const uint8_t *sc = p + 4, *qh = p + 16, *q = p + 48;
            for (int s = 0; s < 8; s += 2) {
                float s0, m0, s1, m1;
                scale_min_k4(sc, s, &s0, &m0);
                scale_min_k4(sc, s + 1, &s1, &m1);
                const float d0 = d * s0, o0 = dmin * m0, d1 = d * s1, o1 = dmin * m1;
                const uint8_t *qq = q + 16 * s;
                float *o = out + 32 * s;
                for (int i = 0; i < 32; i++) {
                    const int lo = (qq[i] & 15) | (((qh[i] >> s) & 1) << 4);
                    const int hi = (qq[i] >> 4) | (((qh[i] >> (s + 1)) & 1) << 4);
                    o[i] = d0 * (float)lo - o0;
                    o[i + 32] = d1 * (float)hi - o1;
                }
            }
        }
        break;
    case T_Q6_K:
        for (int64_t b = 0; b < nb; b++, p += 210, out += 256) {
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *sc = (const int8_t *)(p + 192);
            const float d = half_to_float(rd16(p + 208));
            for (int h = 0; h < 2; h++)
                for (int s = 0; s < 4; s++) {
                    const uint8_t *l = ql + 64 * h + 32 * (s & 1), *hb = qh + 32 * h;
                    const int shift = 4 * (s >> 1);
                    float *o = out + 128 * h + 32 * s;
                    const float da = d * (float)sc[8 * h + 2 * s];
                    const float db = d * (float)sc[8 * h + 2 * s + 1];
                    for (int i = 0; i < 16; i++) {
                        const int q = (((l[i] >> shift) & 15) | (((hb[i] >> (2 * s)) & 3) << 4)) - 32;
                        o[i] = da * (float)q;
                    }
                    for (int i = 16; i < 32; i++) {
                        const int q = (((l[i] >> shift) & 15) | (((hb[i] >> (2 * s)) & 3) << 4)) - 32;
                        o[i] = db * (float)q;
                    }
                }
        }
        break;
    default:
        break;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* 16 unsigned bytes -> 16 floats d q + off. */
static inline void cvt16(float *o, __m128i q, __m256 d, __m256 off) {
    _mm256_storeu_ps(o, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), off));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(
        d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), off));
}
/* 32 unsigned bytes -> 32 floats, the first 16 with (d0, o0), the last 16 with (d1, o1). */
static inline void cvt32(float *o, __m256i q, __m256 d0, __m256 o0, __m256 d1, __m256 o1) {
    cvt16(o, _mm256_castsi256_si128(q), d0, o0);
    cvt16(o + 16, _mm256_extracti128_si256(q, 1), d1, o1);
}
#define HAVE_FAST_DEQUANT 1

/* Q4_K / Q5_K: the 32 bytes v (at q + 16 s) hold sub-block s's codes in their low nibbles
   and sub-block s + 1's in their high ones; Q5_K (five) adds bit s / s + 1 of each of the
   32 high-bit bytes hv as 0x10. */
static inline void k_subblock_codes(__m256i v, __m256i hv, int s, int five, __m256i *lo,
                                    __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (five) {
        const __m256i b0 = _mm256_set1_epi8((char)(1 << s));
        const __m256i b1 = _mm256_set1_epi8((char)(1 << (s + 1)));
        const __m256i x10 = _mm256_set1_epi8(0x10);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(hv, b0), b0), x10));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_and_si256(hv, b1), b1), x10));
    }
}

/* Q6_K: the codes (0..63) of values 128 h + 32 s .. + 31 of a block whose low bits are at
   ql and whose high-bit bytes qh + 32 h are hb. */
static inline __m256i q6k_codes(const uint8_t *ql, __m256i hb, int h, int s) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (s & 1)));
    if (s >> 1) l = _mm256_srli_epi16(l, 4);
    l = _mm256_and_si256(l, m4);
    __m256i hi = _mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * s));
    hi = _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(3)), 4);
    return _mm256_or_si256(l, hi);
}

/* The block types through AVX2; returns 0 for a type left to the portable code. */
static int dequant_blocks_avx2(int type, const uint8_t *p, int64_t nb, float *out) {
    switch (type) {
    case T_Q4_0:
        for (int64_t b = 0; b < nb; b++, p += 18, out += 32) {
            const float d = half_to_float(rd16(p));
            const __m256 dv = _mm256_set1_ps(d), ov = _mm256_set1_ps(-8.f * d);
            cvt32(out, nibbles32(p + 2), dv, ov, dv, ov);
        }
        return 1;
    case T_Q4_1:
        for (int64_t b = 0; b < nb; b++, p += 20, out += 32) {
            const __m256 dv = _mm256_set1_ps(half_to_float(rd16(p)));
            const __m256 ov = _mm256_set1_ps(half_to_float(rd16(p + 2)));
            cvt32(out, nibbles32(p + 4), dv, ov, dv, ov);
        }
        return 1;
    case T_Q5_0:
        for (int64_t b = 0; b < nb; b++, p += 22, out += 32) {
            const float d = half_to_float(rd16(p));
            const __m256 dv = _mm256_set1_ps(d), ov = _mm256_set1_ps(-16.f * d);
            const __m256i q = _mm256_or_si256(nibbles32(p + 6), bits_to_0x10(rd32(p + 2)));
            cvt32(out, q, dv, ov, dv, ov);
        }
        return 1;
    case T_Q5_1:
        for (int64_t b = 0; b < nb; b++, p += 24, out += 32) {
            const __m256 dv = _mm256_set1_ps(half_to_float(rd16(p)));
            const __m256 ov = _mm256_set1_ps(half_to_float(rd16(p + 2)));
            const __m256i q = _mm256_or_si256(nibbles32(p + 8), bits_to_0x10(rd32(p + 4)));
            cvt32(out, q, dv, ov, dv, ov);
        }
        return 1;
    case T_Q8_0:
        for (int64_t b = 0; b < nb; b++, p += 34, out += 32) {
            const __m256 dv = _mm256_set1_ps(half_to_float(rd16(p)));
            for (int k = 0; k < 4; k++) {
                const __m128i q = _mm_loadl_epi64((const __m128i *)(p + 2 + 8 * k));
                _mm256_storeu_ps(out + 8 * k,
                                 _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
            }
        }
        return 1;
    case T_Q4_K:
    case T_Q5_K: {
        const int five = type == T_Q5_K;
        const int64_t size = five ? 176 : 144;
        for (int64_t b = 0; b < nb; b++, p += size, out += 256) {
            const float d = half_to_float(rd16(p)), dmin = half_to_float(rd16(p + 2));
            const uint8_t *sc = p + 4, *qh = p + 16, *q = p + (five ? 48 : 16);
            const __m256i hv = five ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
            for (int s = 0; s < 8; s += 2) {
                float s0, m0, s1, m1;
                scale_min_k4(sc, s, &s0, &m0);
                scale_min_k4(sc, s + 1, &s1, &m1);
                const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 * s));
                __m256i lo, hi;
                k_subblock_codes(v, hv, s, five, &lo, &hi);
                const __m256 d0 = _mm256_set1_ps(d * s0), o0 = _mm256_set1_ps(-dmin * m0);
                const __m256 d1 = _mm256_set1_ps(d * s1), o1 = _mm256_set1_ps(-dmin * m1);
                cvt32(out + 32 * s, lo, d0, o0, d0, o0);
                cvt32(out + 32 * s + 32, hi, d1, o1, d1, o1);
            }
        }
        return 1;
    }
    case T_Q6_K:
        for (int64_t b = 0; b < nb; b++, p += 210, out += 256) {
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *sc = (const int8_t *)(p + 192);
            const float d = half_to_float(rd16(p + 208));
            for (int h = 0; h < 2; h++) {
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
                for (int s = 0; s < 4; s++) {
                    const __m256i codes = q6k_codes(ql, hb, h, s);
                    const float da = d * (float)sc[8 * h + 2 * s];
                    const float db = d * (float)sc[8 * h + 2 * s + 1];
                    cvt32(out + 128 * h + 32 * s, codes,
                          _mm256_set1_ps(da), _mm256_set1_ps(-32.f * da),
                          _mm256_set1_ps(db), _mm256_set1_ps(-32.f * db));
                }
            }
        }
        return 1;
    default:
        return 0;
    }
}
#endif

/* nb blocks starting at p (the first block's bytes) -> nb * values floats. */
static int force_portable; /* tests: check the portable code on an AVX2 machine too */

int hkv_quant_force_portable(int on) {
    force_portable = on;
#ifdef HAVE_FAST_DEQUANT
    return 1; /* whether there is a fast path to switch off */
#else
    return 0;
#endif
}

static void dequant_blocks(int type, const uint8_t *p, int64_t nb, float *out) {
#ifdef HAVE_FAST_DEQUANT
    if (!force_portable && dequant_blocks_avx2(type, p, nb, out)) return;
#endif
    dequant_blocks_portable(type, p, nb, out);
}

/* out [n, cols] (row stride ldo) = the dequantized rows ids[0..n) (or 0..n when ids is
   NULL) of data (row stride ldw bytes). Returns -1 for a type not handled here. */
int hkv_quant_dequantize(const uint8_t *data, int64_t ldw, int type, int64_t cols,
                         const int64_t *ids, int64_t n, float *out, int64_t ldo) {
    int64_t bv, bb;
    block_shape(type, &bv, &bb);
    if (bv == 0) return -1;
    const int64_t nb = cols / bv;
    const int parallel = n * cols >= (1 << 16);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t r = 0; r < n; r++) {
        const int64_t src = ids == NULL ? r : ids[r];
        dequant_blocks(type, data + src * ldw, nb, out + r * ldo);
    }
    return 0;
}

/* ---- 8-bit activations, integer dot products ----
   Each x row is quantized once per call, in groups of 32 values (256 for the K-quants,
   llama.cpp's Q8_K: x_group): d = max |x| / 127 over the group and q = round(x / d) (so
   |x - d q| <= d / 2), plus each 32 values' float sum. A weight block's integers then dot
   with x's in int32 (exactly): converted to float once per 32 values and scaled by both
   blocks' scales, or for the K-quants each sub-block's sum times its integer scale added
   up over the whole 256-value block first; the offsets of the types with a min (Q4_1,
   Q5_1, Q4_K, Q5_K) go through x's exact float sums per 32.
   The byte products multiply unsigned by signed bytes (AVX2's maddubs, VNNI's dpbusd):
   the signed types' codes go in as unsigned (Q4_0 n, Q5_0 q, Q6_K q, Q8_0 w + 128 with
   VNNI), their offset taken back through x's byte sums; Q8_0 without VNNI takes |w| and x
   with w's sign (w + 128 would saturate maddubs's int16 pairs).
   The error against float activations is sum over x groups of (max |x| in the group / 254)
   times sum |d q| over the group's weights (d q: the weight without its min), plus float
   rounding; linear/quant.py states and the tests check it. */

#ifndef INT_PREFETCH
#define INT_PREFETCH 2048
#endif
#ifndef INT_ROWS
#define INT_ROWS 4 /* x rows per pass over a weight row */
#endif
static int float_activations; /* A/B tests: keep x in float (the kernels above) */

int hkv_quant_float_activations(int on) {
    const int was = float_activations;
    if (on >= 0) float_activations = on;
    return was;
}

/* Q4_K / Q5_K: the eight 6-bit scales and mins as integers. */
static inline void scales_mins_k4(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0f) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

#if defined(__AVX2__)
/* Q4_K / Q5_K's twelve scale bytes as scales_mins_k4 reads them, by 32-bit words: bytes
   0-7 the eight 6-bit scales, 8-15 the eight mins (a dozen integer operations where the
   byte loop took ~40, a K-quant decode's largest cost after the dot products). */
static inline __m128i scales_mins_k4_v(const uint8_t *s) {
    const uint32_t a = rd32(s), b = rd32(s + 4), c = rd32(s + 8);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    const uint32_t sc_hi = (c & m4) | (((a >> 6) & m2) << 4);   /* sc[4 + j] */
    const uint32_t mn_hi = ((c >> 4) & m4) | (((b >> 6) & m2) << 4); /* mn[4 + j] */
    return _mm_set_epi32((int)mn_hi, (int)(b & m6), (int)sc_hi, (int)(a & m6));
}

/* The byte shuffle that copies 16-bit lane j (of each 128-bit half) to all its lanes. */
static inline __m256i lane16(int j) { return _mm256_set1_epi16((short)((2 * j + 1) << 8 | 2 * j)); }
#endif

/* Blocks of 32 x values that share one 8-bit scale for `type`: 8 (256 values, llama.cpp's
   Q8_K) for the K-quants, whose integer sums then run a whole weight block before a float
   is touched, else 1. */
static inline int x_group(int type) {
    return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K ? 8 : 1;
}

/* A group of g 32-value x blocks' scale from their largest |x| and sums: every block
   gets d = amax / 127 (0 for zeros; NaN for all of them where any block holds a NaN or an
   infinity, so those reach y as with float activations) and its own sum; returns the
   reciprocal that rounds them (q = round(x / d)), 0 where d is 0 or not finite. */
static inline float finish_group(const float *amax, const float *sum, int g, float *d,
                                 float *s) {
    float mx = 0.f;
    int finite = 1;
    for (int j = 0; j < g; j++) {
        mx = fmaxf(mx, amax[j]);
        finite &= isfinite(sum[j]) != 0;
    }
    const float dd = mx / 127.f;
    for (int j = 0; j < g; j++) {
        d[j] = finite ? dd : NAN;
        s[j] = sum[j];
    }
    return dd != 0.f && isfinite(dd) ? 1.f / dd : 0.f;
}

static void quantize_x_portable(const float *x, int64_t m, int64_t ldx, int64_t cols,
                                int8_t *q, float *d, float *s, int g) {
    const int64_t nb = cols / 32;
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b += g) {
            float amax[8], sum[8];
            for (int j = 0; j < g; j++) {
                const float *v = x + i * ldx + 32 * (b + j);
                amax[j] = 0.f, sum[j] = 0.f;
                for (int k = 0; k < 32; k++) {
                    amax[j] = fmaxf(amax[j], fabsf(v[k]));
                    sum[j] += v[k];
                }
            }
            const float id = finish_group(amax, sum, g, d + i * nb + b, s + i * nb + b);
            int8_t *o = q + i * cols + 32 * b;
            const float *v = x + i * ldx + 32 * b;
            for (int k = 0; k < 32 * g; k++) o[k] = (int8_t)(int)nearbyintf(v[k] * id);
        }
}

/* The portable kernel: a weight row decoded to int8 values w (their dot with x's bytes
   exact in int32), a float scale per 16 values and the coefficient of each x block's sum
   (the min term) per 32; every x row then dots with it (loops GCC vectorises). */
static void int_decode_row_portable(int type, const uint8_t *p, int64_t cols, int8_t *w,
                                    float *sc, float *mn) {
    const int64_t nb = cols / 32;
    switch (type) {
    case T_Q4_0:
    case T_Q4_1:
    case T_Q5_0:
    case T_Q5_1: {
        const int five = type == T_Q5_0 || type == T_Q5_1;
        const int min = type == T_Q4_1 || type == T_Q5_1;
        const int64_t size = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
        const int bias = min ? 0 : five ? 16 : 8;
        for (int64_t b = 0; b < nb; b++, p += size, w += 32) {
            const float dd = half_to_float(rd16(p));
            const uint32_t qh = five ? rd32(p + (min ? 4 : 2)) : 0;
            const uint8_t *q = p + (min ? 4 : 2) + (five ? 4 : 0);
            for (int j = 0; j < 16; j++) {
                w[j] = (int8_t)(((q[j] & 15) | (int)(((qh >> j) & 1) << 4)) - bias);
                w[j + 16] = (int8_t)(((q[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4)) - bias);
            }
            sc[2 * b] = sc[2 * b + 1] = dd;
            mn[b] = min ? half_to_float(rd16(p + 2)) : 0.f;
        }
        break;
    }
    case T_Q8_0:
        for (int64_t b = 0; b < nb; b++, p += 34, w += 32) {
            memcpy(w, p + 2, 32);
            sc[2 * b] = sc[2 * b + 1] = half_to_float(rd16(p));
            mn[b] = 0.f;
        }
        break;
    case T_Q4_K:
    case T_Q5_K: {
        const int five = type == T_Q5_K;
        for (int64_t b = 0; b < nb; b += 8, p += five ? 176 : 144, w += 256) {
            const float dd = half_to_float(rd16(p)), dmin = half_to_float(rd16(p + 2));
            const uint8_t *qh = p + 16, *q = p + (five ? 48 : 16);
            uint8_t scs[8], mns[8];
            scales_mins_k4(p + 4, scs, mns);
            for (int s = 0; s < 8; s++) {
                const uint8_t *qq = q + 32 * (s >> 1);
                const int shift = 4 * (s & 1);
                for (int i = 0; i < 32; i++)
                    w[32 * s + i] = (int8_t)(((qq[i] >> shift) & 15) |
                                             (five ? ((qh[i] >> s) & 1) << 4 : 0));
                sc[2 * (b + s)] = sc[2 * (b + s) + 1] = dd * (float)scs[s];
                mn[b + s] = -dmin * (float)mns[s];
            }
        }
        break;
    }
    case T_Q6_K:
        for (int64_t b = 0; b < nb; b += 8, p += 210, w += 256) {
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *scs = (const int8_t *)(p + 192);
            const float dd = half_to_float(rd16(p + 208));
            for (int h = 0; h < 2; h++)
                for (int s = 0; s < 4; s++) {
                    const uint8_t *l = ql + 64 * h + 32 * (s & 1), *hb = qh + 32 * h;
                    const int shift = 4 * (s >> 1);
                    int8_t *o = w + 128 * h + 32 * s;
                    for (int i = 0; i < 32; i++)
                        o[i] = (int8_t)((((l[i] >> shift) & 15) |
                                         (((hb[i] >> (2 * s)) & 3) << 4)) - 32);
                    const int64_t g = b + 4 * h + s;
                    sc[2 * g] = dd * (float)scs[8 * h + 2 * s];
                    sc[2 * g + 1] = dd * (float)scs[8 * h + 2 * s + 1];
                    mn[g] = 0.f;
                }
        }
        break;
    default:
        break;
    }
}

/* (Measured: products of a stretch of blocks into int16 first (|w x| <= 128 127), then
   their sums by 16, vectorise better than a sum per block.) */
static float int_dot_portable(const int8_t *w, const float *sc, const float *mn,
                              const int8_t *xq, const float *xd, const float *xs, int64_t nb) {
    float t = 0.f;
    int16_t pr[32 * 32];
    int32_t is[64];
    for (int64_t b0 = 0; b0 < nb; b0 += 32) {
        const int64_t n = nb - b0 < 32 ? nb - b0 : 32;
        const int8_t *wc = w + 32 * b0, *xc = xq + 32 * b0;
        for (int64_t j = 0; j < 32 * n; j++) pr[j] = (int16_t)(wc[j] * xc[j]);
        for (int64_t g = 0; g < 2 * n; g++) {
            int32_t v = 0;
            for (int j = 0; j < 16; j++) v += pr[16 * g + j];
            is[g] = v;
        }
        for (int64_t b = 0; b < n; b++) {
            const int64_t bb = b0 + b;
            t += xd[bb] * (sc[2 * bb] * (float)is[2 * b] + sc[2 * bb + 1] * (float)is[2 * b + 1]) +
                 mn[bb] * xs[bb];
        }
    }
    return t;
}

#if defined(HAVE_FAST_DEQUANT)
#define HAVE_INT_AVX2 1

static void quantize_x_avx2(const float *x, int64_t m, int64_t ldx, int64_t cols, int8_t *q,
                            float *d, float *s, int g) {
    const int64_t nb = cols / 32;
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b += g) {
            float amax[8], sum[8];
            for (int j = 0; j < g; j++) {
                const float *v = x + i * ldx + 32 * (b + j);
                const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
                const __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
                const __m256 mx = _mm256_max_ps(
                    _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                    _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
                __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
                h = _mm_max_ps(h, _mm_movehl_ps(h, h));
                h = _mm_max_ss(h, _mm_movehdup_ps(h));
                const __m256 sv = _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3));
                __m128 t = _mm_add_ps(_mm256_castps256_ps128(sv), _mm256_extractf128_ps(sv, 1));
                t = _mm_add_ps(t, _mm_movehl_ps(t, t));
                t = _mm_add_ss(t, _mm_movehdup_ps(t));
                amax[j] = _mm_cvtss_f32(h), sum[j] = _mm_cvtss_f32(t);
            }
            const __m256 idv = _mm256_set1_ps(
                finish_group(amax, sum, g, d + i * nb + b, s + i * nb + b));
            for (int j = 0; j < g; j++) {
                const float *v = x + i * ldx + 32 * (b + j);
                /* Rounded to nearest even, as nearbyintf in the portable code. */
                const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), idv));
                const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), idv));
                const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), idv));
                const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), idv));
                const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1),
                                                     _mm256_packs_epi32(i2, i3));
                _mm256_storeu_si256((__m256i *)(q + i * cols + 32 * (b + j)),
                                    _mm256_permutevar8x32_epi32(p, perm));
            }
        }
}

/* 16 bytes -> their 16 low nibbles, then their 16 high nibbles (one load, one shift). */
static inline __m256i nibbles32_v(const uint8_t *q) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                            _mm256_set1_epi8(0x0f));
}
/* Bit j of `bits` -> byte j = 0xff, else 0 (j < 32). */
static inline __m256i bits_to_ff(const uint8_t *bits) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i others = _mm256_set1_epi64x((long long)0x7fbfdfeff7fbfdfeULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)rd32(bits)), shuf);
    return _mm256_cmpeq_epi8(_mm256_or_si256(v, others), _mm256_set1_epi8(-1));
}

/* Sums of pairs of u8 x s8 products (into int16: at most 2 128 127 < 2^15), then of
   their pairs: eight int32 sums of four products each. */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* The same int32 sums in one instruction (no pair of products reaches 2^15, so
       maddubs never saturated them). */
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Eight floats summed in the one order the panels (quant_panels.h) repeat lane by lane:
   ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)). */
static inline float tree8(__m256 p) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(p), _mm256_extractf128_ps(p, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
/* The K-quants' one order, which every kernel keeps so a result never depends on which
   kernel, how many x rows or threads computed it. Per 256-value block kb: its exact
   integer sum T (each sub-block's byte dot times its integer scale, in int32) and
   A[kb % 8] = fma(xd, dw * T, A[kb % 8]) in block order (x's scale xd, the weight's dw);
   for Q4_K/Q5_K the min terms M[s] = fma(dmin * min_s, x's sum over sub-block s, M[s]),
   also in block order. The output is tree8(A) - tree8(M). Eight partial sums keep both
   kernels vectorized: int_row's lanes are A's eight (blocks) and M's eight (sub-blocks),
   the panels' lanes are eight outputs, each with its own A and M. Every multiply that
   meets an add is an explicit fma, so the compiler's contraction cannot make two kernels
   differ. k_group folds int_row's blocks kb0 .. kb0 + n - 1 (n <= 8; S[j], dw[j],
   xd[i][j] block kb0 + j's) into A; lanes past n stay as they are. */
static inline __attribute__((always_inline)) void k_group(
    __m256i S[8][INT_ROWS], const float *dw, float xd[INT_ROWS][8], int n, __m256 *A,
    const int NX) {
    const __m256 dwv = _mm256_loadu_ps(dw);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256i z = _mm256_setzero_si256();
    for (int i = 0; i < NX; i++) {
        /* block j's eight lanes summed into lane j (exact: any order) */
        const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(S[0][i], n > 1 ? S[1][i] : z),
                                            _mm256_hadd_epi32(n > 2 ? S[2][i] : z,
                                                              n > 3 ? S[3][i] : z));
        const __m256i b = _mm256_hadd_epi32(
            _mm256_hadd_epi32(n > 4 ? S[4][i] : z, n > 5 ? S[5][i] : z),
            _mm256_hadd_epi32(n > 6 ? S[6][i] : z, n > 7 ? S[7][i] : z));
        const __m256i t = _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                                           _mm256_permute2x128_si256(a, b, 0x31));
        const __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(xd[i]),
                                         _mm256_mul_ps(dwv, _mm256_cvtepi32_ps(t)), A[i]);
        A[i] = _mm256_blendv_ps(A[i], v, keep);
    }
}

/* One Q4_K/Q5_K block (p) against x's 256 values from k: sum[i] gets x row i's
   sub-block byte dots times their integer scales (int32 lanes; their total is the block's
   T); returns dmin times the eight mins. */
static inline __attribute__((always_inline)) __m256 k45_block(
    const uint8_t *p, const int five, int64_t k, int64_t cols, const int8_t *xq,
    __m256i *sum, const int NX) {
    const float dmin = half_to_float(rd16(p + 2));
    const uint8_t *qh = p + 16, *q = p + (five ? 48 : 16);
    const __m128i sm = scales_mins_k4_v(p + 4);
    const __m256 mv = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
    /* the eight scales as 16-bit lanes, in both halves (shuffled to each one) */
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    const __m256i hv = five ? _mm256_loadu_si256((const __m256i *)qh)
                            : _mm256_setzero_si256();
    /* x's 256 values share one scale (x_group): the sub-blocks' integer sums,
       each times its integer scale, add up in int32 (at most 8 x 2 x 31 x 127 x 63
       a lane), one conversion and one scaling a block. */
    for (int i = 0; i < NX; i++) sum[i] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int s = 0; s < 8; s += 2) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 * s));
        __m256i lo, hi;
        k_subblock_codes(v, hv, s, five, &lo, &hi);
        const __m256i s0 = _mm256_shuffle_epi8(sc, lane16(s));
        const __m256i s1 = _mm256_shuffle_epi8(sc, lane16(s + 1));
        for (int i = 0; i < NX; i++) {
            const int8_t *xi = xq + i * cols + k + 32 * s;
            const __m256i t0 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xi)), s0);
            const __m256i t1 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xi + 32))),
                s1);
            sum[i] = _mm256_add_epi32(sum[i], _mm256_add_epi32(t0, t1));
        }
    }
    return mv;
}

/* One Q6_K block (p) against x's 256 values from k: as k45_block, the codes' 32 taken
   back. The codes are unsigned bytes (0..63: value + 32), so no sign juggling per 32
   values; the 32 in each is taken back once a block, from x's sums per 16 (bs) times
   the 16 scales: sum (q - 32) x = sum q x - 32 sum x, exactly in int32. */
static inline __attribute__((always_inline)) void q6k_block(
    const uint8_t *p, int64_t k, int64_t cols, const int8_t *xq, const int16_t *bs,
    __m256i *sum, const int NX) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
    const uint8_t *ql = p, *qh = p + 128;
    const int8_t *scs = (const int8_t *)(p + 192);
    /* at most 8 x 2 x 63 x 127 x 128 a lane */
    for (int i = 0; i < NX; i++) sum[i] = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        /* this half's eight int8 scales as 16-bit lanes, in both 128-bit halves */
        const __m256i sc8 = _mm256_broadcastsi128_si256(
            _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(scs + 8 * h))));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        const __m256i lows[4] = {
            _mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
            _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
            _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
        const __m256i highs[4] = {
            _mm256_slli_epi16(_mm256_and_si256(hb, three), 4),
            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), three), 4),
            _mm256_and_si256(hb, _mm256_set1_epi8(0x30)),
            _mm256_and_si256(_mm256_srli_epi16(hb, 2), _mm256_set1_epi8(0x30))};
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            const __m256i q = _mm256_or_si256(lows[s], highs[s]);
            /* values 0-15 of the 32 take scale 2 s, 16-31 scale 2 s + 1 */
            const __m256i sv = _mm256_shuffle_epi8(
                sc8, _mm256_blend_epi32(lane16(2 * s), lane16(2 * s + 1), 0xf0));
            const int64_t kk = k + 128 * h + 32 * s;
            for (int i = 0; i < NX; i++) {
                const __m256i xv =
                    _mm256_loadu_si256((const __m256i *)(xq + i * cols + kk));
                sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(q, xv), sv));
            }
        }
    }
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scs));
    for (int i = 0; i < NX; i++) {
        const __m256i xsum = _mm256_loadu_si256((const __m256i *)(bs + i * (cols / 16) + k / 16));
        const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(xsum, sc16), 5);
        sum[i] = _mm256_sub_epi32(sum[i], corr);
    }
}

/* y_i = W row . x_i for the NX x rows of a K-quant matrix (k_group's order): q, d, s, bs
   as quantize_x wrote them (row strides cols, nb). */
static inline __attribute__((always_inline)) void int_row(
    int type, const uint8_t *p, int64_t cols, const int8_t *xq, const float *xd,
    const float *xs, const int16_t *bs, float *y, int64_t ldy, const int NX) {
    const int64_t nb = cols / 32;
    /* acc is A, acc2 M; a group of eight blocks' sums waits here */
    __m256 acc[INT_ROWS], acc2[INT_ROWS];
    for (int i = 0; i < NX; i++) acc[i] = acc2[i] = _mm256_setzero_ps();
    __m256i S8[8][INT_ROWS];
    float dw8[8] = {0}, xd8[INT_ROWS][8] = {{0}};
    const int64_t nkb = cols / 256;
    const int five = type == T_Q5_K;
#define K_LOOP(Q6, SIZE)                                                                  \
    for (int64_t kb = 0; kb < nkb; kb++, p += (SIZE)) {                                   \
        const int j = (int)(kb & 7);                                                      \
        const int64_t k = 256 * kb, b = 8 * kb;                                           \
        if (Q6) {                                                                         \
            q6k_block(p, k, cols, xq, bs, S8[j], NX);                                     \
            dw8[j] = half_to_float(rd16(p + 208));                                        \
        } else {                                                                          \
            const __m256 mv = k45_block(p, five, k, cols, xq, S8[j], NX);                 \
            dw8[j] = half_to_float(rd16(p));                                              \
            for (int i = 0; i < NX; i++)                                                  \
                acc2[i] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + i * nb + b), acc2[i]); \
        }                                                                                 \
        for (int i = 0; i < NX; i++) xd8[i][j] = xd[i * nb + b];                          \
        if (j == 7 || kb + 1 == nkb) k_group(S8, dw8, xd8, j + 1, acc, NX);               \
    }
    if (type == T_Q6_K)
        K_LOOP(1, 210)
    else if (five)
        K_LOOP(0, 176)
    else
        K_LOOP(0, 144)
#undef K_LOOP
    for (int i = 0; i < NX; i++) y[i * ldy] = tree8(acc[i]) - tree8(acc2[i]);
}

/* The 32-value types, eight weight rows at a time: one order of arithmetic for every
   row count. Per block b and weight row j, the exact integer sum T_j of its 32 products
   with x row i, then A_i = fma(dw * xd_b, T, A_i) in block order with the eight rows in
   the lanes (and the min terms M_i = fma(mw, xs_b, M_i) of Q4_1 / Q5_1): y = A + M. A
   block's scaling and conversion serve eight rows, where one row at a time paid them per
   row and block (the kernel was compute-bound at one x row on SmolLM2's Q4_1 and spent
   ~60% of a step again per x row). The values are decoded as unsigned bytes for the
   products, the offset taken off in int32 through x's byte sums per block (xsum):
   Q4_0 n - 8, Q5_0 q - 16, Q8_0 (with VNNI) w + 128 - 128. */
static inline __attribute__((always_inline)) __m256i u8_codes(const int type,
                                                              const uint8_t *p) {
    switch (type) {
    case T_Q8_0:
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 2)),
                                _mm256_set1_epi8((char)0x80));
#else
        return _mm256_loadu_si256((const __m256i *)(p + 2)); /* signed: see rows8_dot */
#endif
    case T_Q4_0: return nibbles32_v(p + 2);
    case T_Q5_0:
        return _mm256_or_si256(nibbles32_v(p + 6),
                               _mm256_and_si256(bits_to_ff(p + 2), _mm256_set1_epi8(0x10)));
    case T_Q4_1: return nibbles32_v(p + 4);
    default:
        return _mm256_or_si256(nibbles32_v(p + 8),
                               _mm256_and_si256(bits_to_ff(p + 4), _mm256_set1_epi8(0x10)));
    }
}

/* What u8_codes' bytes carry over the values: T = sum codes x - offset sum x. */
static inline int code_offset(const int type) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
    if (type == T_Q8_0) return 128;
#endif
    return type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 0;
}

static inline __attribute__((always_inline)) __m256i rows8_dot(const int type, __m256i w,
                                                               __m256i x) {
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__))
    /* Q8_0 as signed bytes: w + 128 would saturate maddubs's int16 pairs */
    if (type == T_Q8_0) return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
#endif
    (void)type;
    return dot_u8s8(w, x);
}

/* Eight vectors' lane sums into the lanes of one, in order (exact: integers). */
static inline __m256i lane_totals(const __m256i d[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]),
                                        _mm256_hadd_epi32(d[2], d[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]),
                                        _mm256_hadd_epi32(d[6], d[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* y[i][j] for the NX x rows and the R <= 8 weight rows at p[j] (the 32-value types). */
static inline __attribute__((always_inline)) void int_rows8(
    const int type, const uint8_t *const *p, const int R, int64_t cols, const int8_t *xq,
    const float *xd, const float *xs, const int32_t *xsum, float *y, int64_t ldy,
    const int NX) {
    const int64_t nb = cols / 32;
    const int64_t size = type == T_Q8_0 ? 34 : type == T_Q4_0 ? 18 : type == T_Q5_0 ? 22
                         : type == T_Q4_1 ? 20 : 24;
    const int offset = code_offset(type), with_min = type == T_Q4_1 || type == T_Q5_1;
    __m256 A[INT_ROWS], M[INT_ROWS];
    for (int i = 0; i < NX; i++) A[i] = M[i] = _mm256_setzero_ps();
    /* Each row's first four bytes of a block (its half scale, then Q4_1/Q5_1's half min)
       in one gather; the rows past R read row 0's. */
    int32_t at[8];
    for (int j = 0; j < 8; j++) at[j] = (int32_t)(p[j < R ? j : 0] - p[0]);
    const __m256i offsets = _mm256_loadu_si256((const __m256i *)at);
    const __m256i low = _mm256_set1_epi32(0xffff);
    for (int64_t b = 0; b < nb; b++) {
        __m256i w[8];
        for (int j = 0; j < 8; j++)
            w[j] = j < R ? u8_codes(type, p[j] + b * size) : _mm256_setzero_si256();
        const __m256i heads = _mm256_i32gather_epi32((const int *)(p[0] + b * size),
                                                     offsets, 1);
        const __m256i dh = _mm256_and_si256(heads, low);
        const __m256 dw = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(dh),
                                                           _mm256_extracti128_si256(dh, 1)));
        __m256 mw = _mm256_setzero_ps();
        if (with_min) {
            const __m256i mh = _mm256_srli_epi32(heads, 16);
            mw = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(mh),
                                                  _mm256_extracti128_si256(mh, 1)));
        }
        for (int i = 0; i < NX; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * cols + 32 * b));
            __m256i d[8];
            for (int j = 0; j < 8; j++) d[j] = rows8_dot(type, w[j], xv);
            __m256i t = lane_totals(d);
            if (offset) t = _mm256_sub_epi32(t, _mm256_set1_epi32(offset * xsum[i * nb + b]));
            A[i] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xd[i * nb + b])),
                                   _mm256_cvtepi32_ps(t), A[i]);
            if (with_min) M[i] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[i * nb + b]), M[i]);
        }
    }
    for (int i = 0; i < NX; i++) {
        float out[8];
        _mm256_storeu_ps(out, _mm256_add_ps(A[i], M[i]));
        for (int j = 0; j < R; j++) y[i * ldy + j] = out[j];
    }
}

/* int_rows8 with its type and x rows known to the compiler. */
static void rows8_call(int type, const uint8_t *const *p, int R, int64_t cols,
                       const int8_t *xq, const float *xd, const float *xs,
                       const int32_t *xsum, float *y, int64_t ldy, int nx) {
#define ROWS8_NX(T)                                                                       \
    switch (nx) {                                                                         \
    case 4: int_rows8(T, p, R, cols, xq, xd, xs, xsum, y, ldy, 4); break;                 \
    case 3: int_rows8(T, p, R, cols, xq, xd, xs, xsum, y, ldy, 3); break;                 \
    case 2: int_rows8(T, p, R, cols, xq, xd, xs, xsum, y, ldy, 2); break;                 \
    default: int_rows8(T, p, R, cols, xq, xd, xs, xsum, y, ldy, 1); break;                \
    }
    switch (type) {
    case T_Q8_0: ROWS8_NX(T_Q8_0) break;
    case T_Q4_0: ROWS8_NX(T_Q4_0) break;
    case T_Q5_0: ROWS8_NX(T_Q5_0) break;
    case T_Q4_1: ROWS8_NX(T_Q4_1) break;
    default: ROWS8_NX(T_Q5_1) break;
    }
#undef ROWS8_NX
}

#include "quant_panels.h"
#endif

static int int_type(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 ||
           type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

/* x rows up to which the integer path runs once 8-bit activations are asked for: every
   row count on AVX2, so a row's result never depends on its batch (each x row is
   quantized alone and each (x row, weight row) dot runs the same instructions however
   many x rows int_row takes at once). Without AVX2 the portable integer kernel (measured
   with SSE2 and AVX2 code) was slower than the float kernels: x stays in float there, at
   every row count too. */
#ifndef INT_MAX_ROWS_PORTABLE
#define INT_MAX_ROWS_PORTABLE 0
#endif
static int64_t int_rows_max(int type) {
    (void)type;
#if defined(HAVE_INT_AVX2)
    return INT64_MAX; /* the tests' portable mode too (its kernels take the same rows) */
#else
    return INT_MAX_ROWS_PORTABLE;
#endif
}

/* Whether `type` takes 8-bit activations where they are on (1) or stays float (0). */
int hkv_quant_int8_capable(int type) { return int_type(type) && int_rows_max(type) > 0; }

/* x rows up to which y = x W^T of `type` takes 8-bit activations (0: never). */
int64_t hkv_quant_int8_rows(int type) {
    return !float_activations && int_type(type) ? int_rows_max(type) : 0;
}

/* y = x W^T through 8-bit x rows (the caller checked the type). -2: no memory. */
static int int_matmul(const float *x, int64_t m, int64_t ldx, const uint8_t *w, int64_t ldw,
                      int type, int64_t rows, int64_t cols, float *y, int64_t ldy) {
    const int64_t nb = cols / 32;
    /* One buffer: x's bytes [m, cols], then scales and sums [m, nb] each. */
    const size_t qbytes = ((size_t)(m * cols) + 63) & ~(size_t)63;
    /* Q6_K also takes x's byte sums per 16 values [m, cols / 16] (int_row). */
    const size_t sbytes = type == T_Q6_K ? (size_t)(m * (cols / 16)) * sizeof(int16_t) : 0;
    uint8_t *buf = malloc(qbytes + sbytes + 2 * (size_t)(m * nb + 1) * sizeof(float));
    if (buf == NULL) return -2;
    int8_t *xq = (int8_t *)buf;
    int16_t *bs = (int16_t *)(buf + qbytes);
    float *xd = (float *)(buf + qbytes + sbytes), *xs = xd + m * nb;
    const int fast =
#if defined(HAVE_INT_AVX2)
        !force_portable;
#else
        0;
#endif
#if defined(HAVE_INT_AVX2)
    if (fast)
        quantize_x_avx2(x, m, ldx, cols, xq, xd, xs, x_group(type));
    else
#endif
        quantize_x_portable(x, m, ldx, cols, xq, xd, xs, x_group(type));
    for (int64_t g = 0; sbytes && g < m * (cols / 16); g++) {
        int s16 = 0;
        for (int j = 0; j < 16; j++) s16 += xq[16 * g + j];
        bs[g] = (int16_t)s16;
    }
    const int parallel = m * rows * cols >= (1 << 17) && rows > 1;
    int failed = 0;
#if defined(HAVE_INT_AVX2)
    if (fast && m >= PANEL_MIN_ROWS && x_group(type) == 8) {
        panel_matmul(type, xq, xd, xs, bs, m, w, ldw, rows, cols, y, ldy, parallel, &failed);
    } else
#endif
    if (fast && x_group(type) == 1) {
#if defined(HAVE_INT_AVX2)
        /* x's byte sums per block, for the codes' offset (int_rows8) */
        int32_t *xsum = malloc(sizeof(int32_t) * (size_t)(m * nb + 1));
        if (xsum == NULL) {
            free(buf);
            return -2;
        }
        block_byte_sums(xq, m * nb, 1, xsum);
        int64_t bv, bb;
        block_shape(type, &bv, &bb);
        const int64_t rbytes = cols / bv * bb, groups = (rows + 7) / 8;
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t r0 = 8 * g;
            const int R = rows - r0 < 8 ? (int)(rows - r0) : 8;
            const uint8_t *pr[8];
            for (int j = 0; j < 8; j++) pr[j] = w + (r0 + (j < R ? j : 0)) * ldw;
            /* the next group's rows are fetched while these are read */
            for (int j = 0; j < 8 && r0 + 8 + j < rows; j++)
                for (int64_t o = 0; o < rbytes; o += 64)
                    __builtin_prefetch(w + (r0 + 8 + j) * ldw + o);
            for (int64_t i = 0; i < m; i += INT_ROWS) {
                const int nx = m - i < INT_ROWS ? (int)(m - i) : INT_ROWS;
                rows8_call(type, pr, R, cols, xq + i * cols, xd + i * nb, xs + i * nb,
                           xsum + i * nb, y + i * ldy + r0, ldy, nx);
            }
        }
        free(xsum);
#endif
    } else if (fast) {
#if defined(HAVE_INT_AVX2)
        /* The weight row INT_PREFETCH bytes ahead is fetched while this one is read
           (measured: the hardware's prefetch alone left ~25% of the bandwidth unused). */
        int64_t bv, bb;
        block_shape(type, &bv, &bb);
        const int64_t rbytes = cols / bv * bb;
        const int64_t ahead = (INT_PREFETCH + rbytes - 1) / (rbytes > 0 ? rbytes : 1);
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *p = w + r * ldw;
            if (r + ahead < rows)
                for (int64_t o = 0; o < rbytes; o += 64) __builtin_prefetch(p + ahead * ldw + o);
            for (int64_t i = 0; i < m; i += INT_ROWS) {
                const int nx = m - i < INT_ROWS ? (int)(m - i) : INT_ROWS;
                const int8_t *qi = xq + i * cols;
                const float *di = xd + i * nb, *si = xs + i * nb;
                const int16_t *bi = bs + i * (cols / 16);
                float *yi = y + i * ldy + r;
                switch (nx) {
                case 4: int_row(type, p, cols, qi, di, si, bi, yi, ldy, 4); break;
                case 3: int_row(type, p, cols, qi, di, si, bi, yi, ldy, 3); break;
                case 2: int_row(type, p, cols, qi, di, si, bi, yi, ldy, 2); break;
                default: int_row(type, p, cols, qi, di, si, bi, yi, ldy, 1); break;
                }
            }
        }
#endif
    } else {
#pragma omp parallel if (parallel)
        {
            /* A thread's decoded weight row: bytes, scales per 16 values, mins per 32. */
            int8_t *wq = malloc((size_t)cols + 3 * (size_t)(nb + 1) * sizeof(float));
            if (wq == NULL) {
#pragma omp atomic write
                failed = 1;
            }
            float *sc = wq == NULL ? NULL : (float *)(wq + ((cols + 15) & ~(int64_t)15));
            float *mn = sc == NULL ? NULL : sc + 2 * nb;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                if (wq == NULL) continue;
                int_decode_row_portable(type, w + r * ldw, cols, wq, sc, mn);
                for (int64_t i = 0; i < m; i++)
                    y[i * ldy + r] = int_dot_portable(wq, sc, mn, xq + i * cols, xd + i * nb,
                                                      xs + i * nb, nb);
            }
            free(wq);
        }
    }
    free(buf);
    return failed ? -2 : 0;
}

/* y [m, rows] (row stride ldy) = x [m, cols] (row stride ldx) times W^T, W [rows, cols]
   in blocks of `type` (row stride ldw bytes). Returns -1 for a type not handled here, -2
   when a buffer cannot be allocated. */
int hkv_quant_matmul(const float *x, int64_t m, int64_t ldx, const uint8_t *w, int64_t ldw,
                     int type, int64_t rows, int64_t cols, float *y, int64_t ldy) {
    int64_t bv, bb;
    block_shape(type, &bv, &bb);
    if (bv == 0) return -1;
    if (m <= 0 || rows <= 0) return 0;
    if (!float_activations && int_type(type) && m <= int_rows_max(type))
        return int_matmul(x, m, ldx, w, ldw, type, rows, cols, y, ldy);
    /* Float activations: quant_gemm.c (one order of arithmetic for every row count). */
    return -1;
}

/* hkv_quant_gemm's call (decode_layers.c's matmul_fn) with 8-bit activations: mode 0,
   y [m, n] = x W^T; a gated mode (1 SiLU, 2 GELU-tanh, 3 ReLU), y = act(x G^T) * (x U^T)
   with G = W's n rows and U = u's (W's next n rows where u is NULL), through simd.h's
   gated_row. The operator path computes the same with these activations (the gate and up
   products, then linear/quant.py gated_rows), so a decode step gets its bytes. -1: a type
   this path does not take or 8-bit activations off; -2: no memory. */
int hkv_quant_gemm_int8(const float *x, int64_t m, int64_t ldx, const uint8_t *w, int64_t ldw,
                        int type, int64_t n, int64_t cols, float *y, int64_t ldy, int mode,
                        const uint8_t *u) {
    if (float_activations || !int_type(type) || m > int_rows_max(type) || cols % 32)
        return -1;
    if (m <= 0 || n <= 0) return 0;
    if (!mode) return int_matmul(x, m, ldx, w, ldw, type, n, cols, y, ldy);
    if (u == NULL) u = w + n * ldw;
    float *g = malloc(2 * (size_t)(m * n) * sizeof(float));
    if (g == NULL) return -2;
    float *up = g + m * n;
    int rc = int_matmul(x, m, ldx, w, ldw, type, n, cols, g, n);
    if (rc == 0) rc = int_matmul(x, m, ldx, u, ldw, type, n, cols, up, n);
    if (rc == 0)
        for (int64_t i = 0; i < m; i++) gated_row(g + i * n, up + i * n, n, mode, y + i * ldy);
    free(g);
    return rc;
}
