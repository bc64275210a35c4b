/* GGML-quantized weights on the CPU: dequantization, row gathers (embeddings) and
   y = x W^T with W kept in its GGUF blocks (worker/quant_linear.py calls these).

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

   The product, for the quantized types with AVX2, quantizes a small batch of x rows (up to
   8-24 rows by type: int_rows_max) to 8 bits once per call and takes integer dot products
   with each weight block (the integer kernel below; no float copy of the weights, so decode
   streams the quantized rows once, near memory bandwidth). Otherwise x stays in float (it
   then matches a float matmul on the dequantized weights to float rounding): one to four
   x rows (eight for Q8_0; six with AVX-512: FUSED_MAX) take the fused kernel: each
   block's integers become 8-float vectors in registers, dotted with every x row, the
   block's scale applied once per block (a min, through the x block's sum); with AVX-512
   16-float vectors widened straight from the blocks' bytes (rows_512). More rows
   take panels: a thread dequantizes a few weight rows (24 KiB) once and reuses them for
   every x row through 4 x 3 register tiles of 8-float dot products.
   (worker/quant_linear.py sends 16 to 127 rows, from 7 with AVX-512 (Q8_0: 9), to
   hkv_quant_matmul_packed below, linear.c's float tiles on dequantized panels, and from 128
   rows dequantizes chunks of rows for torch's GEMM.) hkv_quant_float_activations(1) keeps x
   in float on every path. Work is split over torch's OpenMP threads. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

/* (values, bytes) per block, or 0 values for a type not handled here. */
static void block_shape(int type, int64_t *values, int64_t *bytes) {
    *values = 0;
    *bytes = 0;
    switch (type) {
    case T_F32: *values = 1; *bytes = 4; break;
    case T_F16: *values = 1; *bytes = 2; break;
    case T_BF16: *values = 1; *bytes = 2; break;
    case T_Q4_0: *values = 32; *bytes = 18; break;
    case T_Q4_1: *values = 32; *bytes = 20; break;
    case T_Q5_0: *values = 32; *bytes = 22; break;
    case T_Q5_1: *values = 32; *bytes = 24; break;
    case T_Q8_0: *values = 32; *bytes = 34; break;
    case T_Q4_K: *values = 256; *bytes = 144; break;
    case T_Q5_K: *values = 256; *bytes = 176; break;
    case T_Q6_K: *values = 256; *bytes = 210; break;
    default: break;
    }
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* Q4_K / Q5_K: sub-block s's 6-bit scale and min from the 12 packed bytes. */
static inline void scale_min_k4(const uint8_t *s, int j, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

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
/* Bit j of `bits` -> byte j = 0x10 (j < 32). */
static inline __m256i bits_to_0x10(uint32_t bits) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i mask = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}
static inline __m256i nibbles32(const uint8_t *q) { /* 16 bytes: low nibbles, high nibbles */
    const __m128i v = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
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

/* ---- y = x W^T ---- */

#define XT 4          /* x rows per register tile */
#define WT 3          /* weight rows per register tile: 12 accumulators + 4 x + ... */
#define PANEL_FLOATS (6 * 1024) /* a thread's panel of weight rows: 24 KiB, L1-resident */
#ifndef FUSED_MAX
/* x rows up to which the fused kernel runs (Q8_0: twice as many). With AVX-512 (its codes
   made floats once for 4 rows a pass) two passes still beat the panels at 5 and 6 rows:
   all of Gemma 3 270M's quantized matrices 25.0 / 27.6 ms against the packed float tiles'
   30.4 / 32.0, SmolLM2's 25.5 / 29.8 against 34.6 / 44.2; at 8, level or behind. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FUSED_MAX 6
#else
#define FUSED_MAX 4
#endif
#endif
#define X_BLOCK 64    /* x rows per work item */

#if defined(__AVX2__) || defined(__AVX__)
/* (sum a, sum b, sum c, sum d) of four 8-float vectors. */
static inline void hsum4(v8 a, v8 b, v8 c, v8 d, float *out) {
    const __m256 ab = _mm256_hadd_ps((__m256)a, (__m256)b);
    const __m256 cd = _mm256_hadd_ps((__m256)c, (__m256)d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
    _mm_storeu_ps(out, s);
}
#else
static inline void hsum4(v8 a, v8 b, v8 c, v8 d, float *out) {
    float t[4] = {0, 0, 0, 0};
    for (int l = 0; l < 8; l++) {
        t[0] += a[l];
        t[1] += b[l];
        t[2] += c[l];
        t[3] += d[l];
    }
    memcpy(out, t, sizeof t);
}
#endif

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

/* y[i, j] = dot(x row i, w row j) for i < NX, j < NW, over k floats (k8 of them by
   vectors). x rows: stride ldx; w rows: stride ldp (the panel); y: stride ldy. */
static inline __attribute__((always_inline)) void dot_tile(
    const float *x, int64_t ldx, const float *w, int64_t ldp, int64_t k, float *y,
    int64_t ldy, const int NX, const int NW) {
    v8 acc[XT][WT];
    for (int i = 0; i < NX; i++)
        for (int j = 0; j < NW; j++) acc[i][j] = (v8){0};
    const int64_t k8 = k & ~(int64_t)7;
    for (int64_t kk = 0; kk < k8; kk += 8) {
        v8 wv[WT];
        for (int j = 0; j < NW; j++) wv[j] = load8(w + j * ldp + kk);
        for (int i = 0; i < NX; i++) {
            const v8 xv = load8(x + i * ldx + kk);
            for (int j = 0; j < NW; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < NX; i++) {
        float s[4];
        hsum4(acc[i][0], NW > 1 ? acc[i][1] : (v8){0}, NW > 2 ? acc[i][2] : (v8){0},
              (v8){0}, s);
        for (int j = 0; j < NW; j++) {
            float t = s[j];
            for (int64_t kk = k8; kk < k; kk++) t += x[i * ldx + kk] * w[j * ldp + kk];
            y[i * ldy + j] = t;
        }
    }
}

static void dot_tile_any(const float *x, int64_t ldx, const float *w, int64_t ldp,
                         int64_t k, float *y, int64_t ldy, int nx, int nw) {
#define T(A, B) case (A) * 4 + (B): dot_tile(x, ldx, w, ldp, k, y, ldy, A, B); break;
    switch (nx * 4 + nw) {
    T(4, 3) T(4, 2) T(4, 1) T(3, 3) T(3, 2) T(3, 1) T(2, 3) T(2, 2) T(2, 1)
    T(1, 3) T(1, 2) T(1, 1)
    default: break;
    }
#undef T
}

#if defined(HAVE_FAST_DEQUANT)
/* ---- A few x rows: dequantize in registers, scales folded per block ----
   For each block of 32 values, the integer values become four 8-float vectors (shared by
   the x rows); each x row takes their dot product t with its 32 values and adds d t to its
   accumulator (offsets of the types with a min, m, are added as m times the x block's sum,
   computed once per call). No float copy of the weights is written. */

#define FUSED_ROWS 4

/* 32 signed bytes -> four 8-float vectors. */
static inline void bytes_to_floats(__m256i q, __m256 f[4]) {
    const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

/* acc[i] += d0 (f . x_i[0:16]) + d1 (f . x_i[16:32]) for the NX rows. */
static inline __attribute__((always_inline)) void accum32(
    const __m256 f[4], const float *x, int64_t ldx, __m256 d0, __m256 d1, __m256 *acc,
    const int NX) {
    for (int i = 0; i < NX; i++) {
        const float *xi = x + i * ldx;
        __m256 t0 = _mm256_mul_ps(f[0], _mm256_loadu_ps(xi));
        __m256 t1 = _mm256_mul_ps(f[2], _mm256_loadu_ps(xi + 16));
        t0 = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xi + 8), t0);
        t1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xi + 24), t1);
        acc[i] = _mm256_fmadd_ps(d0, t0, acc[i]);
        acc[i] = _mm256_fmadd_ps(d1, t1, acc[i]);
    }
}

/* y_i = W row . x_i for NX rows; xs: the x rows' sums per 32 values (row stride nb32). */
static inline __attribute__((always_inline)) void fused_row(
    int type, const uint8_t *p, int64_t cols, const float *x, int64_t ldx, const float *xs,
    int64_t ldxs, float *y, int64_t ldy, const int NX) {
    __m256 acc[FUSED_ROWS];
    float off[FUSED_ROWS];
    for (int i = 0; i < NX; i++) {
        acc[i] = _mm256_setzero_ps();
        off[i] = 0.f;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 f[4];
    switch (type) {
    case T_Q4_0:
    case T_Q5_0: {
        const int five = type == T_Q5_0;
        const int64_t size = five ? 22 : 18;
        const __m256i bias = _mm256_set1_epi8(five ? 16 : 8);
        for (int64_t k = 0; k < cols; k += 32, p += size) {
            __m256i q = nibbles32(p + (five ? 6 : 2));
            if (five) q = _mm256_or_si256(q, bits_to_0x10(rd32(p + 2)));
            bytes_to_floats(_mm256_sub_epi8(q, bias), f);
            const __m256 d = _mm256_set1_ps(half_to_float(rd16(p)));
            accum32(f, x + k, ldx, d, d, acc, NX);
        }
        break;
    }
    case T_Q4_1:
    case T_Q5_1: {
        const int five = type == T_Q5_1;
        const int64_t size = five ? 24 : 20;
        for (int64_t k = 0, b = 0; k < cols; k += 32, b++, p += size) {
            __m256i q = nibbles32(p + (five ? 8 : 4));
            if (five) q = _mm256_or_si256(q, bits_to_0x10(rd32(p + 4)));
            bytes_to_floats(q, f);
            const __m256 d = _mm256_set1_ps(half_to_float(rd16(p)));
            const float m = half_to_float(rd16(p + 2));
            accum32(f, x + k, ldx, d, d, acc, NX);
            for (int i = 0; i < NX; i++) off[i] += m * xs[i * ldxs + b];
        }
        break;
    }
    case T_Q8_0:
        for (int64_t k = 0; k < cols; k += 32, p += 34) {
            bytes_to_floats(_mm256_loadu_si256((const __m256i *)(p + 2)), f);
            const __m256 d = _mm256_set1_ps(half_to_float(rd16(p)));
            accum32(f, x + k, ldx, d, d, acc, NX);
        }
        break;
    case T_Q4_K:
    case T_Q5_K: {
        const int five = type == T_Q5_K;
        const int64_t size = five ? 176 : 144;
        for (int64_t k = 0, b = 0; k < cols; k += 256, b += 8, p += size) {
            const float d = half_to_float(rd16(p)), dmin = half_to_float(rd16(p + 2));
            const uint8_t *sc = p + 4, *qh = p + 16, *q = p + (five ? 48 : 16);
            const __m256i hv = five ? _mm256_loadu_si256((const __m256i *)qh)
                                    : _mm256_setzero_si256();
            float mins[8];
            for (int s = 0; s < 8; s += 2) {
                float s0, s1;
                scale_min_k4(sc, s, &s0, &mins[s]);
                scale_min_k4(sc, s + 1, &s1, &mins[s + 1]);
                const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 * s));
                __m256i lo, hi;
                k_subblock_codes(v, hv, s, five, &lo, &hi);
                const __m256 d0 = _mm256_set1_ps(d * s0), d1 = _mm256_set1_ps(d * s1);
                bytes_to_floats(lo, f);
                accum32(f, x + k + 32 * s, ldx, d0, d0, acc, NX);
                bytes_to_floats(hi, f);
                accum32(f, x + k + 32 * s + 32, ldx, d1, d1, acc, NX);
            }
            for (int i = 0; i < NX; i++) {
                float t = 0.f;
                for (int s = 0; s < 8; s++) t += mins[s] * xs[i * ldxs + b + s];
                off[i] -= dmin * t;
            }
        }
        break;
    }
    case T_Q6_K: {
        const __m256i x32 = _mm256_set1_epi8(32), three = _mm256_set1_epi8(3);
        for (int64_t k = 0; k < cols; k += 256, p += 210) {
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *sc = (const int8_t *)(p + 192);
            const float d = half_to_float(rd16(p + 208));
            for (int h = 0; h < 2; h++) {
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
                for (int s = 0; s < 4; s++) {
                    bytes_to_floats(_mm256_sub_epi8(_mm256_or_si256(lows[s], highs[s]), x32), f);
                    const __m256 da = _mm256_set1_ps(d * (float)sc[8 * h + 2 * s]);
                    const __m256 db = _mm256_set1_ps(d * (float)sc[8 * h + 2 * s + 1]);
                    accum32(f, x + k + 128 * h + 32 * s, ldx, da, db, acc, NX);
                }
            }
        }
        break;
    }
    default:
        break;
    }
    for (int i = 0; i < NX; i++) {
        float s[4];
        hsum4(acc[i], _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), s);
        y[i * ldy] = s[0] + off[i];
    }
}

static int fused_type(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 ||
           type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_FUSED_ROWS_512 1
/* fused_row with AVX-512: 16 codes widen from 16 bytes straight to a 16-lane vector, and
   Q5's fifth bits and Q5_K's come from mask registers, where the AVX2 code builds 32 byte
   codes first and widens them in four pieces. Same sums as fused_row: per block the scale
   times the codes' dot product with each x row, the mins through x's block sums. */
static inline __m512 codes_ps(__m512i q) { return _mm512_cvtepi32_ps(q); }
static inline __m512i widen_u8(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

/* fused_row's sums for NX (1 .. 4) x rows (x row i at x + i ldx, its 32-value sums at
   xs + i ldxs) of one weight row; `type` and NX constants (one loop each, no branch
   inside): a block's codes become floats once and serve every row. */
static inline __attribute__((always_inline)) void rows_512(
    const int type, const uint8_t *p, int64_t cols, const float *x, int64_t ldx,
    const float *xs, int64_t ldxs, float *y, int64_t ldy, const int NX) {
    __m512 acc0[4], acc1[4];
    float off[4];
    for (int i = 0; i < NX; i++) {
        acc0[i] = acc1[i] = _mm512_setzero_ps();
        off[i] = 0.f;
    }
    const __m512i m15 = _mm512_set1_epi32(15), s16 = _mm512_set1_epi32(16);
    if (type == T_Q8_0) {
        for (int64_t k = 0, b = 0; k < cols; k += 32, b++, p += 34) {
            const __m512 flo = codes_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2))));
            const __m512 fhi = codes_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18))));
            const __m512 d = _mm512_set1_ps(half_to_float(rd16(p)));
            for (int i = 0; i < NX; i++) {
                const float *xi = x + i * ldx + k;
                const __m512 t = _mm512_fmadd_ps(fhi, _mm512_loadu_ps(xi + 16),
                                                 _mm512_mul_ps(flo, _mm512_loadu_ps(xi)));
                if (b & 1) acc1[i] = _mm512_fmadd_ps(d, t, acc1[i]);
                else acc0[i] = _mm512_fmadd_ps(d, t, acc0[i]);
            }
        }
    } else if (type == T_Q4_K || type == T_Q5_K) {
        const int five = type == T_Q5_K;
        const int64_t size = five ? 176 : 144;
        for (int64_t k = 0, b = 0; k < cols; k += 256, b += 8, p += size) {
            const float d = half_to_float(rd16(p)), dmin = half_to_float(rd16(p + 2));
            const uint8_t *sc = p + 4, *qh = p + 16, *q = p + (five ? 48 : 16);
            float mins[4] = {0.f, 0.f, 0.f, 0.f};
            for (int s = 0; s < 8; s += 2) {
                float s0, s1, m0, m1;
                scale_min_k4(sc, s, &s0, &m0);
                scale_min_k4(sc, s + 1, &s1, &m1);
                __m512 t0[4], t1[4];
                for (int i = 0; i < NX; i++) {
                    mins[i] += m0 * xs[i * ldxs + b + s] + m1 * xs[i * ldxs + b + s + 1];
                    t0[i] = t1[i] = _mm512_setzero_ps();
                }
                for (int h = 0; h < 32; h += 16) { /* values h .. h + 15 of both sub-blocks */
                    const __m512i v = widen_u8(q + 16 * s + h);
                    __m512i lo = _mm512_and_si512(v, m15), hi = _mm512_srli_epi32(v, 4);
                    if (five) {
                        const __m128i hb = _mm_loadu_si128((const __m128i *)(qh + h));
                        lo = _mm512_mask_or_epi32(
                            lo, _mm_test_epi8_mask(hb, _mm_set1_epi8((char)(1 << s))), lo, s16);
                        hi = _mm512_mask_or_epi32(
                            hi, _mm_test_epi8_mask(hb, _mm_set1_epi8((char)(2 << s))), hi, s16);
                    }
                    const __m512 flo = codes_ps(lo), fhi = codes_ps(hi);
                    for (int i = 0; i < NX; i++) {
                        const float *xk = x + i * ldx + k + 32 * s + h;
                        t0[i] = _mm512_fmadd_ps(flo, _mm512_loadu_ps(xk), t0[i]);
                        t1[i] = _mm512_fmadd_ps(fhi, _mm512_loadu_ps(xk + 32), t1[i]);
                    }
                }
                const __m512 d0 = _mm512_set1_ps(d * s0), d1 = _mm512_set1_ps(d * s1);
                for (int i = 0; i < NX; i++) {
                    acc0[i] = _mm512_fmadd_ps(d0, t0[i], acc0[i]);
                    acc1[i] = _mm512_fmadd_ps(d1, t1[i], acc1[i]);
                }
            }
            for (int i = 0; i < NX; i++) off[i] -= dmin * mins[i];
        }
    } else { /* the types with 32-value blocks */
        const int five = type == T_Q5_0 || type == T_Q5_1;
        const int with_min = type == T_Q4_1 || type == T_Q5_1;
        const int64_t size =
            type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
        const int64_t qs = 2 + 2 * with_min + 4 * five;
        for (int64_t k = 0, b = 0; k < cols; k += 32, b++, p += size) {
            const __m512i v = widen_u8(p + qs);
            __m512i lo = _mm512_and_si512(v, m15), hi = _mm512_srli_epi32(v, 4);
            if (five) {
                const uint32_t bits = rd32(p + 2 + 2 * with_min);
                if (with_min) {
                    lo = _mm512_mask_or_epi32(lo, (__mmask16)bits, lo, s16);
                    hi = _mm512_mask_or_epi32(hi, (__mmask16)(bits >> 16), hi, s16);
                } else { /* minus 16 where the fifth bit is clear: or-ing it in, minus 16 */
                    lo = _mm512_mask_sub_epi32(lo, (__mmask16)~bits, lo, s16);
                    hi = _mm512_mask_sub_epi32(hi, (__mmask16)~(bits >> 16), hi, s16);
                }
            } else if (!with_min) { /* Q4_0: minus 8 */
                lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
                hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
            }
            const __m512 flo = codes_ps(lo), fhi = codes_ps(hi);
            const __m512 d = _mm512_set1_ps(half_to_float(rd16(p)));
            const float dmin = with_min ? half_to_float(rd16(p + 2)) : 0.f;
            for (int i = 0; i < NX; i++) {
                const float *xi = x + i * ldx + k;
                const __m512 t = _mm512_fmadd_ps(fhi, _mm512_loadu_ps(xi + 16),
                                                 _mm512_mul_ps(flo, _mm512_loadu_ps(xi)));
                if (b & 1) acc1[i] = _mm512_fmadd_ps(d, t, acc1[i]);
                else acc0[i] = _mm512_fmadd_ps(d, t, acc0[i]);
                if (with_min) off[i] += dmin * xs[i * ldxs + b];
            }
        }
    }
    for (int i = 0; i < NX; i++)
        y[i * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i])) + off[i];
}

/* Whether rows_512 takes `type` (Q6_K measured level with the AVX2 code, which builds
   its codes from high bits shared by four sub-blocks: it stays there). */
static int fused_rows_512_type(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 ||
           type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K;
}

/* rows_512 for each type it takes, constant. */
static inline __attribute__((always_inline)) void fused_rows_512_n(
    int type, const uint8_t *p, int64_t cols, const float *x, int64_t ldx, const float *xs,
    int64_t ldxs, float *y, int64_t ldy, const int NX) {
    switch (type) {
    case T_Q4_0: rows_512(T_Q4_0, p, cols, x, ldx, xs, ldxs, y, ldy, NX); return;
    case T_Q4_1: rows_512(T_Q4_1, p, cols, x, ldx, xs, ldxs, y, ldy, NX); return;
    case T_Q5_0: rows_512(T_Q5_0, p, cols, x, ldx, xs, ldxs, y, ldy, NX); return;
    case T_Q5_1: rows_512(T_Q5_1, p, cols, x, ldx, xs, ldxs, y, ldy, NX); return;
    case T_Q8_0: rows_512(T_Q8_0, p, cols, x, ldx, xs, ldxs, y, ldy, NX); return;
    case T_Q4_K: rows_512(T_Q4_K, p, cols, x, ldx, xs, ldxs, y, ldy, NX); return;
    case T_Q5_K: rows_512(T_Q5_K, p, cols, x, ldx, xs, ldxs, y, ldy, NX); return;
    default: return;
    }
}

#endif

/* One weight row against NX (constant) x rows: the AVX-512 code for the types it takes,
   else fused_row. */
static inline __attribute__((always_inline)) void fused_rows_n(
    int type, const uint8_t *p, int64_t cols, const float *x, int64_t ldx, const float *xs,
    int64_t ldxs, float *y, int64_t ldy, const int NX) {
#if defined(HAVE_FUSED_ROWS_512)
    if (fused_rows_512_type(type)) {
        fused_rows_512_n(type, p, cols, x, ldx, xs, ldxs, y, ldy, NX);
        return;
    }
#endif
    fused_row(type, p, cols, x, ldx, xs, ldxs, y, ldy, NX);
}

static void fused_matmul(const float *x, int64_t m, int64_t ldx, const uint8_t *w,
                         int64_t ldw, int type, int64_t rows, int64_t cols, float *y,
                         int64_t ldy, const float *xs, int64_t ldxs) {
    const int parallel = m * rows * cols >= (1 << 17) && rows > 1;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < m; i += FUSED_ROWS) {
            const int nx = m - i < FUSED_ROWS ? (int)(m - i) : FUSED_ROWS;
            const float *xi = x + i * ldx, *si = xs + i * ldxs;
            float *yi = y + i * ldy + r;
            const uint8_t *p = w + r * ldw;
            switch (nx) {
            case 4: fused_rows_n(type, p, cols, xi, ldx, si, ldxs, yi, ldy, 4); break;
            case 3: fused_rows_n(type, p, cols, xi, ldx, si, ldxs, yi, ldy, 3); break;
            case 2: fused_rows_n(type, p, cols, xi, ldx, si, ldxs, yi, ldy, 2); break;
            default: fused_rows_n(type, p, cols, xi, ldx, si, ldxs, yi, ldy, 1); break;
            }
        }
    }
}
#endif

/* ---- A few x rows: 8-bit activations, integer dot products ----
   Each x row is quantized once per call, in blocks of 32 values: d = max |x| / 127 and
   q = round(x / d) (so |x - d q| <= d / 2), plus the block's float sum. A weight block's
   integers then dot with the x block's in int32 (exactly), converted to float once per
   32 values (16 for Q6_K's scales) and scaled by the two blocks' scales; the offsets of
   the types with a min (Q4_1, Q5_1, Q4_K, Q5_K) go through the x block's exact float sum.
   The signed types (Q4_0, Q5_0, Q8_0, Q6_K) take |w| as the unsigned operand of the
   byte products and x with w's sign (AVX2's maddubs multiplies unsigned by signed bytes).
   The error against float activations is sum over blocks of (max |x| in the block / 254)
   times sum |d q| over the block's weights (d q: the weight without its min), plus float
   rounding; quant_linear.py states and the tests check it. */

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

/* One 32-value x block: its scale d (0 for zeros; NaN where x holds a NaN or an infinity,
   so those reach y as with float activations) and sum; q[j] = round(v[j] / d). */
static inline void finish_block(float amax, float sum, float *d, float *id, float *s) {
    const float dd = amax / 127.f;
    *id = dd != 0.f && isfinite(dd) ? 1.f / dd : 0.f;
    *d = isfinite(sum) ? dd : NAN;
    *s = sum;
}

static void quantize_x_portable(const float *x, int64_t m, int64_t ldx, int64_t cols,
                                int8_t *q, float *d, float *s) {
    const int64_t nb = cols / 32;
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + i * ldx + 32 * b;
            float amax = 0.f, sum = 0.f, id;
            for (int j = 0; j < 32; j++) {
                amax = fmaxf(amax, fabsf(v[j]));
                sum += v[j];
            }
            finish_block(amax, sum, d + i * nb + b, &id, s + i * nb + b);
            int8_t *o = q + i * cols + 32 * b;
            for (int j = 0; j < 32; j++) o[j] = (int8_t)(int)nearbyintf(v[j] * id);
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
                            float *d, float *s) {
    const int64_t nb = cols / 32;
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + i * ldx + 32 * b;
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
            float id;
            finish_block(_mm_cvtss_f32(h), _mm_cvtss_f32(t), d + i * nb + b, &id,
                         s + i * nb + b);
            const __m256 idv = _mm256_set1_ps(id);
            /* Rounded to nearest even, as nearbyintf in the portable code. */
            const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, idv));
            const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, idv));
            const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, idv));
            const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, idv));
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1),
                                                 _mm256_packs_epi32(i2, i3));
            _mm256_storeu_si256((__m256i *)(q + i * cols + 32 * b),
                                _mm256_permutevar8x32_epi32(p, perm));
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
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* One 32-value block b of the types with 32-value blocks into A[i] (and O[i], the min
   terms) for the NX x rows. */
static inline __attribute__((always_inline)) void int_block32(
    const int type, const uint8_t *p, int64_t b, int64_t cols, const int8_t *xq,
    const float *xd, const float *xs, __m256 *A, float *O, const int NX) {
    const int64_t nb = cols / 32, k = 32 * b;
    __m256i w;
    switch (type) {
    case T_Q8_0: w = _mm256_loadu_si256((const __m256i *)(p + 2)); break;
    case T_Q4_0: w = _mm256_sub_epi8(nibbles32_v(p + 2), _mm256_set1_epi8(8)); break;
    case T_Q5_0: /* q - 16: the nibble, or the nibble - 16 (0xf0 | nibble) without bit 5 */
        w = _mm256_or_si256(nibbles32_v(p + 6),
                            _mm256_andnot_si256(bits_to_ff(p + 2), _mm256_set1_epi8((char)0xf0)));
        break;
    case T_Q4_1: w = nibbles32_v(p + 4); break;
    default:
        w = _mm256_or_si256(nibbles32_v(p + 8),
                            _mm256_and_si256(bits_to_ff(p + 4), _mm256_set1_epi8(0x10)));
        break;
    }
    const float dw = half_to_float(rd16(p));
    if (type == T_Q4_1 || type == T_Q5_1) { /* unsigned values, the min through x's sums */
        const float mw = half_to_float(rd16(p + 2));
        for (int i = 0; i < NX; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * cols + k));
            A[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[i * nb + b]),
                                   _mm256_cvtepi32_ps(dot_u8s8(w, xv)), A[i]);
            O[i] += mw * xs[i * nb + b];
        }
    } else { /* signed values: |w| times x with w's sign */
        const __m256i wa = _mm256_sign_epi8(w, w);
        for (int i = 0; i < NX; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * cols + k));
            const __m256i t = dot_u8s8(wa, _mm256_sign_epi8(xv, w));
            A[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[i * nb + b]), _mm256_cvtepi32_ps(t),
                                   A[i]);
        }
    }
}

/* y_i = W row . x_i for the NX x rows: q, d, s as quantize_x wrote them (row strides
   cols, nb). Two sets of accumulators take alternate blocks (or halves of a K-quant
   block): with one x row a single chain of FMAs would bound the speed. */
static inline __attribute__((always_inline)) void int_row(
    int type, const uint8_t *p, int64_t cols, const int8_t *xq, const float *xd,
    const float *xs, float *y, int64_t ldy, const int NX) {
    const int64_t nb = cols / 32;
    __m256 acc[INT_ROWS], acc2[INT_ROWS];
    float off[INT_ROWS];
    for (int i = 0; i < NX; i++) {
        acc[i] = acc2[i] = _mm256_setzero_ps();
        off[i] = 0.f;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0f);
#define LOOP32(T, SIZE)                                                                   \
    do {                                                                                  \
        int64_t b = 0;                                                                    \
        for (; b + 2 <= nb; b += 2, p += 2 * (SIZE)) {                                    \
            int_block32(T, p, b, cols, xq, xd, xs, acc, off, NX);                         \
            int_block32(T, p + (SIZE), b + 1, cols, xq, xd, xs, acc2, off, NX);           \
        }                                                                                 \
        if (b < nb) int_block32(T, p, b, cols, xq, xd, xs, acc, off, NX);                 \
    } while (0)
    switch (type) {
    case T_Q8_0: LOOP32(T_Q8_0, 34); break;
    case T_Q4_0: LOOP32(T_Q4_0, 18); break;
    case T_Q5_0: LOOP32(T_Q5_0, 22); break;
    case T_Q4_1: LOOP32(T_Q4_1, 20); break;
    case T_Q5_1: LOOP32(T_Q5_1, 24); break;
#undef LOOP32
    case T_Q4_K:
    case T_Q5_K: {
        const int five = type == T_Q5_K;
        const int64_t size = five ? 176 : 144;
        for (int64_t k = 0, b = 0; k < cols; k += 256, b += 8, p += size) {
            const float dw = half_to_float(rd16(p)), dmin = half_to_float(rd16(p + 2));
            const uint8_t *qh = p + 16, *q = p + (five ? 48 : 16);
            uint8_t scs[8], mns[8];
            scales_mins_k4(p + 4, scs, mns);
            const __m256 mv = _mm256_mul_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mns))));
            const __m256i hv = five ? _mm256_loadu_si256((const __m256i *)qh)
                                    : _mm256_setzero_si256();
            __m256 sb[INT_ROWS], sb2[INT_ROWS];
            for (int i = 0; i < NX; i++) sb[i] = sb2[i] = _mm256_setzero_ps();
            for (int s = 0; s < 8; s += 2) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 * s));
                __m256i lo, hi;
                k_subblock_codes(v, hv, s, five, &lo, &hi);
                const __m256i s0 = _mm256_set1_epi16(scs[s]), s1 = _mm256_set1_epi16(scs[s + 1]);
                for (int i = 0; i < NX; i++) {
                    const int8_t *xi = xq + i * cols + k + 32 * s;
                    const float *di = xd + i * nb + b + s;
                    const __m256i t0 = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xi)), s0);
                    const __m256i t1 = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xi + 32))),
                        s1);
                    sb[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t0), _mm256_set1_ps(di[0]), sb[i]);
                    sb2[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t1), _mm256_set1_ps(di[1]), sb2[i]);
                }
            }
            const __m256 dv = _mm256_set1_ps(dw);
            for (int i = 0; i < NX; i++) {
                acc[i] = _mm256_fmadd_ps(dv, _mm256_add_ps(sb[i], sb2[i]), acc[i]);
                acc2[i] = _mm256_fnmadd_ps(mv, _mm256_loadu_ps(xs + i * nb + b), acc2[i]);
            }
        }
        break;
    }
    case T_Q6_K: {
        const __m256i x32 = _mm256_set1_epi8(32), three = _mm256_set1_epi8(3);
        for (int64_t k = 0, b = 0; k < cols; k += 256, b += 8, p += 210) {
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *scs = (const int8_t *)(p + 192);
            __m256 sb[2][INT_ROWS];
            for (int i = 0; i < NX; i++) sb[0][i] = sb[1][i] = _mm256_setzero_ps();
            for (int h = 0; h < 2; h++) {
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
                for (int s = 0; s < 4; s++) {
                    const __m256i w = _mm256_sub_epi8(_mm256_or_si256(lows[s], highs[s]), x32);
                    const __m256i wa = _mm256_sign_epi8(w, w);
                    const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(scs[8 * h + 2 * s + 1]),
                                                        _mm_set1_epi16(scs[8 * h + 2 * s]));
                    const int64_t kk = k + 128 * h + 32 * s, bb = b + 4 * h + s;
                    for (int i = 0; i < NX; i++) {
                        const __m256i xv =
                            _mm256_loadu_si256((const __m256i *)(xq + i * cols + kk));
                        const __m256i t = _mm256_madd_epi16(
                            _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, w)), sv);
                        sb[s & 1][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t),
                                                       _mm256_set1_ps(xd[i * nb + bb]),
                                                       sb[s & 1][i]);
                    }
                }
            }
            const __m256 dv = _mm256_set1_ps(half_to_float(rd16(p + 208)));
            for (int i = 0; i < NX; i++)
                acc[i] = _mm256_fmadd_ps(dv, _mm256_add_ps(sb[0][i], sb[1][i]), acc[i]);
        }
        break;
    }
    default:
        break;
    }
    for (int i = 0; i < NX; i++) {
        float t[4];
        hsum4(_mm256_add_ps(acc[i], acc2[i]), _mm256_setzero_ps(), _mm256_setzero_ps(),
              _mm256_setzero_ps(), t);
        y[i * ldy] = t[0] + off[i];
    }
}
#endif

static int int_type(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 ||
           type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

/* x rows up to which the integer path runs (measured against the float kernels: see
   quant_linear.py). */
#ifndef INT_MAX_ROWS
#define INT_MAX_ROWS 0 /* a build option (measurements): all types up to this many rows */
#endif
#ifndef INT_MAX_ROWS_PORTABLE
#define INT_MAX_ROWS_PORTABLE 0
#endif
static int64_t int_rows_max(int type) {
#if defined(HAVE_INT_AVX2)
    /* AVX2 (one core of an AMD EPYC): up to these rows the integer kernel beats the float
       ones (the fused kernel to 4 rows, 8 for Q8_0, then the panels); in the tests'
       portable mode the portable kernels take the same rows. */
    if (INT_MAX_ROWS) return INT_MAX_ROWS;
    switch (type) {
    case T_Q8_0: return 24;
    case T_Q4_0: case T_Q4_1: return 20;
    case T_Q5_0: case T_Q6_K: return 16;
    case T_Q5_1: return 12;
    case T_Q4_K: return 10;
    case T_Q5_K: return 8;
    default: return 0;
    }
#else
    /* Without AVX2 the portable integer kernel (measured with SSE2 and AVX2 code) was
       slower than the float panels: x stays in float. */
    (void)type;
    return INT_MAX_ROWS_PORTABLE;
#endif
}

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
    uint8_t *buf = malloc(qbytes + 2 * (size_t)(m * nb + 1) * sizeof(float));
    if (buf == NULL) return -2;
    int8_t *xq = (int8_t *)buf;
    float *xd = (float *)(buf + qbytes), *xs = xd + m * nb;
    const int fast =
#if defined(HAVE_INT_AVX2)
        !force_portable;
#else
        0;
#endif
#if defined(HAVE_INT_AVX2)
    if (fast)
        quantize_x_avx2(x, m, ldx, cols, xq, xd, xs);
    else
#endif
        quantize_x_portable(x, m, ldx, cols, xq, xd, xs);
    const int parallel = m * rows * cols >= (1 << 17) && rows > 1;
    int failed = 0;
    if (fast) {
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
                float *yi = y + i * ldy + r;
                switch (nx) {
                case 4: int_row(type, p, cols, qi, di, si, yi, ldy, 4); break;
                case 3: int_row(type, p, cols, qi, di, si, yi, ldy, 3); break;
                case 2: int_row(type, p, cols, qi, di, si, yi, ldy, 2); break;
                default: int_row(type, p, cols, qi, di, si, yi, ldy, 1); break;
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
    const int64_t nb = cols / bv;
#if defined(HAVE_FAST_DEQUANT)
    /* (Measured: beyond that the panels' one dequantization beats decoding the blocks
       again for every four x rows; Q8_0's blocks decode cheaply enough for eight.) */
    if (m <= (type == T_Q8_0 ? 2 * FUSED_MAX : FUSED_MAX) && !force_portable &&
        fused_type(type)) {
        /* The x rows' sums per 32 values (for the types with a min). */
        const int64_t nb32 = cols / 32;
        float *xs = malloc((size_t)(m * nb32 + 1) * sizeof(float));
        if (xs == NULL) return -2;
        for (int64_t i = 0; i < m; i++)
            for (int64_t b = 0; b < nb32; b++) {
                float t = 0.f;
                for (int j = 0; j < 32; j++) t += x[i * ldx + 32 * b + j];
                xs[i * nb32 + b] = t;
            }
        fused_matmul(x, m, ldx, w, ldw, type, rows, cols, y, ldy, xs, nb32);
        free(xs);
        return 0;
    }
#endif
    /* The panel: as many weight rows (a multiple of WT) as fit the buffer. */
    int64_t prows = PANEL_FLOATS / (cols > 0 ? cols : 1);
    prows = prows < WT ? WT : prows - prows % WT;
    if (prows > 96) prows = 96;
    const int64_t panels = (rows + prows - 1) / prows;
    const int64_t xblocks = (m + X_BLOCK - 1) / X_BLOCK;
    const int64_t items = panels * xblocks;
    const int parallel = m * rows * cols >= (1 << 17) && items > 1;
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        float *panel = malloc((size_t)(prows * cols + 16) * sizeof(float));
        if (panel == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t have = -1;  /* the panel now in the buffer */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            if (panel == NULL) continue;
            /* Panels outer: each dequantized once per thread, every x block passing it. */
            const int64_t b = it % xblocks, p = it / xblocks;
            const int64_t r0 = p * prows;
            const int64_t pr = rows - r0 < prows ? rows - r0 : prows;
            if (have != p) {
                for (int64_t r = 0; r < pr; r++)
                    dequant_blocks(type, w + (r0 + r) * ldw, nb, panel + r * cols);
                have = p;
            }
            const int64_t i0 = b * X_BLOCK, i1 = i0 + X_BLOCK < m ? i0 + X_BLOCK : m;
            /* A tile of weight rows stays in L1 while the block's x rows pass. */
            for (int64_t j = 0; j < pr; j += WT) {
                const int nw = pr - j < WT ? (int)(pr - j) : WT;
                for (int64_t i = i0; i < i1; i += XT) {
                    const int nx = i1 - i < XT ? (int)(i1 - i) : XT;
                    dot_tile_any(x + i * ldx, ldx, panel + j * cols, cols, cols,
                                 y + i * ldy + r0 + j, ldy, nx, nw);
                }
            }
        }
        free(panel);
    }
    return failed ? -2 : 0;
}

/* ---- y = x W^T through the float tiles of linear.c ----

   On weights already in float, linear.c's register tiles (6 rows x 64 columns of broadcast
   FMAs) run 1.2-1.9x the dot tiles above at 8 to 64 rows; with the dequantization and the
   transposes added they are ahead from 16 rows (worker/quant_linear.py: PACKED_ROWS). They
   read weights packed as [panels, cols, 64]: output column j of a panel is weight row j,
   its values running down the panel. So a chunk of W's rows is dequantized straight into that layout
   (8 rows at a time into a scratch, then 8 x 8 transposes into the panel) and the float
   kernel, whose address the caller passes, runs on it while the chunk is still in L2. */

#define PACK_WIDTH 64 /* linear.c's PANEL */

typedef void (*linear_f32_fn)(const float *x, int64_t m, int64_t ldx, const float *packed,
                              int64_t k, const float *bias, float *y, int64_t n, int64_t ldy,
                              int mode);

/* Eight rows' values k .. k + 8 (rows at src + i * cols) into the panel at dst (8 floats of
   8 consecutive panel rows, row stride PACK_WIDTH). */
static inline void transpose8(const float *src, int64_t cols, float *dst) {
#if defined(__AVX2__)
    __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + cols),
           r2 = _mm256_loadu_ps(src + 2 * cols), r3 = _mm256_loadu_ps(src + 3 * cols),
           r4 = _mm256_loadu_ps(src + 4 * cols), r5 = _mm256_loadu_ps(src + 5 * cols),
           r6 = _mm256_loadu_ps(src + 6 * cols), r7 = _mm256_loadu_ps(src + 7 * cols);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
           t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
           t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
           t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    r0 = _mm256_shuffle_ps(t0, t2, 0x44); r1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    r2 = _mm256_shuffle_ps(t1, t3, 0x44); r3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    r4 = _mm256_shuffle_ps(t4, t6, 0x44); r5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    r6 = _mm256_shuffle_ps(t5, t7, 0x44); r7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst + 0 * PACK_WIDTH, _mm256_permute2f128_ps(r0, r4, 0x20));
    _mm256_storeu_ps(dst + 1 * PACK_WIDTH, _mm256_permute2f128_ps(r1, r5, 0x20));
    _mm256_storeu_ps(dst + 2 * PACK_WIDTH, _mm256_permute2f128_ps(r2, r6, 0x20));
    _mm256_storeu_ps(dst + 3 * PACK_WIDTH, _mm256_permute2f128_ps(r3, r7, 0x20));
    _mm256_storeu_ps(dst + 4 * PACK_WIDTH, _mm256_permute2f128_ps(r0, r4, 0x31));
    _mm256_storeu_ps(dst + 5 * PACK_WIDTH, _mm256_permute2f128_ps(r1, r5, 0x31));
    _mm256_storeu_ps(dst + 6 * PACK_WIDTH, _mm256_permute2f128_ps(r2, r6, 0x31));
    _mm256_storeu_ps(dst + 7 * PACK_WIDTH, _mm256_permute2f128_ps(r3, r7, 0x31));
#else
    for (int kk = 0; kk < 8; kk++)
        for (int i = 0; i < 8; i++) dst[kk * PACK_WIDTH + i] = src[i * cols + kk];
#endif
}

#if defined(HAVE_FAST_DEQUANT)
/* One weight row's nb blocks as codes and per-16-value scales: value k = d[s] q[k] + o[s]
   with s = k / 16, q[k] an unsigned byte (Q8_0's values offset by 128). d and o are
   written every 8 floats (d[8 s]): the 8 rows of a panel group interleave there, so the
   8 rows' scales of one 16-value stretch are one vector. Returns 0 for a type without
   codes here. */
static int row_codes_avx2(int type, const uint8_t *p, int64_t nb, uint8_t *q, float *d,
                          float *o) {
    switch (type) {
    case T_Q4_0:
    case T_Q4_1:
    case T_Q5_0:
    case T_Q5_1: {
        const int64_t size = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q5_0 ? 22 : 24;
        for (int64_t b = 0; b < nb; b++, p += size, q += 32, d += 16, o += 16) {
            const float dv = half_to_float(rd16(p));
            __m256i v;
            float ov;
            switch (type) {
            case T_Q4_0: v = nibbles32(p + 2); ov = -8.f * dv; break;
            case T_Q4_1: v = nibbles32(p + 4); ov = half_to_float(rd16(p + 2)); break;
            case T_Q5_0:
                v = _mm256_or_si256(nibbles32(p + 6), bits_to_0x10(rd32(p + 2)));
                ov = -16.f * dv;
                break;
            default:
                v = _mm256_or_si256(nibbles32(p + 8), bits_to_0x10(rd32(p + 4)));
                ov = half_to_float(rd16(p + 2));
                break;
            }
            _mm256_storeu_si256((__m256i *)q, v);
            d[0] = d[8] = dv;
            o[0] = o[8] = ov;
        }
        return 1;
    }
    case T_Q8_0:
        for (int64_t b = 0; b < nb; b++, p += 34, q += 32, d += 16, o += 16) {
            const float dv = half_to_float(rd16(p));
            _mm256_storeu_si256((__m256i *)q, _mm256_xor_si256(
                _mm256_loadu_si256((const __m256i *)(p + 2)), _mm256_set1_epi8((char)0x80)));
            d[0] = d[8] = dv;
            o[0] = o[8] = -128.f * dv;
        }
        return 1;
    case T_Q4_K:
    case T_Q5_K: {
        const int five = type == T_Q5_K;
        const int64_t size = five ? 176 : 144;
        for (int64_t b = 0; b < nb; b++, p += size, q += 256, d += 128, o += 128) {
            const float dd = half_to_float(rd16(p)), dmin = half_to_float(rd16(p + 2));
            const uint8_t *sc = p + 4, *qh = p + 16, *qs = p + (five ? 48 : 16);
            const __m256i hv = five ? _mm256_loadu_si256((const __m256i *)qh)
                                    : _mm256_setzero_si256();
            for (int s = 0; s < 8; s += 2) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 16 * s));
                __m256i lo, hi;
                k_subblock_codes(v, hv, s, five, &lo, &hi);
                _mm256_storeu_si256((__m256i *)(q + 32 * s), lo);
                _mm256_storeu_si256((__m256i *)(q + 32 * s + 32), hi);
                for (int h = 0; h < 2; h++) {
                    float sv, mv;
                    scale_min_k4(sc, s + h, &sv, &mv);
                    /* sub-block s + h: values 32 (s + h) ..: 16-value stretches 2 (s + h) and
                       2 (s + h) + 1 */
                    float *ds = d + 16 * (s + h), *os = o + 16 * (s + h);
                    ds[0] = ds[8] = dd * sv;
                    os[0] = os[8] = -dmin * mv;
                }
            }
        }
        return 1;
    }
    case T_Q6_K:
        for (int64_t b = 0; b < nb; b++, p += 210, q += 256, d += 128, o += 128) {
            const uint8_t *ql = p, *qh = p + 128;
            const int8_t *sc = (const int8_t *)(p + 192);
            const float dd = half_to_float(rd16(p + 208));
            for (int h = 0; h < 2; h++) {
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
                for (int s = 0; s < 4; s++) {
                    const __m256i codes = q6k_codes(ql, hb, h, s);
                    _mm256_storeu_si256((__m256i *)(q + 128 * h + 32 * s), codes);
                    for (int e = 0; e < 2; e++) {
                        /* 16-value stretch 8 h + 2 s + e, its own scale */
                        const float dv = dd * (float)sc[8 * h + 2 * s + e];
                        d[8 * (8 * h + 2 * s + e)] = dv;
                        o[8 * (8 * h + 2 * s + e)] = -32.f * dv;
                    }
                }
            }
        }
        return 1;
    default:
        return 0;
    }
}

/* 8 unsigned bytes (the low half of `bytes`) -> 8 floats d q + o at dst. */
static inline void emit8(float *dst, __m128i bytes, __m256 d, __m256 o) {
    _mm256_storeu_ps(dst, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), o));
}

/* Eight rows' codes (row i at q + i * cols; cols a multiple of 32) with their interleaved
   scales (row_codes_avx2) -> the panel's 8 columns at `panel` (row stride PACK_WIDTH).
   The bytes are transposed, not the floats: a 32-value stretch of 8 rows is 8 registers
   of bytes through three rounds of unpacks, then each value position's 8 rows become one
   8-float vector with the rows' scales as a vector. */
static void codes_to_panel(const uint8_t *q, const float *d, const float *o, int64_t cols,
                           float *panel) {
    for (int64_t k0 = 0; k0 < cols; k0 += 32) {
        __m256i r[8];
        for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(q + i * cols + k0));
        /* bytes: (r0 r1) pairs per value, then 4 rows per value, then 8 */
        const __m256i t0 = _mm256_unpacklo_epi8(r[0], r[1]), t1 = _mm256_unpackhi_epi8(r[0], r[1]);
        const __m256i t2 = _mm256_unpacklo_epi8(r[2], r[3]), t3 = _mm256_unpackhi_epi8(r[2], r[3]);
        const __m256i t4 = _mm256_unpacklo_epi8(r[4], r[5]), t5 = _mm256_unpackhi_epi8(r[4], r[5]);
        const __m256i t6 = _mm256_unpacklo_epi8(r[6], r[7]), t7 = _mm256_unpackhi_epi8(r[6], r[7]);
        const __m256i u0 = _mm256_unpacklo_epi16(t0, t2), u1 = _mm256_unpackhi_epi16(t0, t2);
        const __m256i u2 = _mm256_unpacklo_epi16(t1, t3), u3 = _mm256_unpackhi_epi16(t1, t3);
        const __m256i u4 = _mm256_unpacklo_epi16(t4, t6), u5 = _mm256_unpackhi_epi16(t4, t6);
        const __m256i u6 = _mm256_unpacklo_epi16(t5, t7), u7 = _mm256_unpackhi_epi16(t5, t7);
        /* v[j]: low lane values 2j, 2j + 1 (8 rows each), high lane 16 + 2j, 17 + 2j */
        const __m256i v[8] = {
            _mm256_unpacklo_epi32(u0, u4), _mm256_unpackhi_epi32(u0, u4),
            _mm256_unpacklo_epi32(u1, u5), _mm256_unpackhi_epi32(u1, u5),
            _mm256_unpacklo_epi32(u2, u6), _mm256_unpackhi_epi32(u2, u6),
            _mm256_unpacklo_epi32(u3, u7), _mm256_unpackhi_epi32(u3, u7)};
        const int64_t s = k0 / 16;
        const __m256 dl = _mm256_loadu_ps(d + 8 * s), ol = _mm256_loadu_ps(o + 8 * s);
        const __m256 dh = _mm256_loadu_ps(d + 8 * s + 8), oh = _mm256_loadu_ps(o + 8 * s + 8);
        float *dst = panel + k0 * PACK_WIDTH;
        for (int j = 0; j < 8; j++) {
            const __m128i lo = _mm256_castsi256_si128(v[j]), hi = _mm256_extracti128_si256(v[j], 1);
            emit8(dst + (2 * j) * PACK_WIDTH, lo, dl, ol);
            emit8(dst + (2 * j + 1) * PACK_WIDTH, _mm_srli_si128(lo, 8), dl, ol);
            emit8(dst + (16 + 2 * j) * PACK_WIDTH, hi, dh, oh);
            emit8(dst + (17 + 2 * j) * PACK_WIDTH, _mm_srli_si128(hi, 8), dh, oh);
        }
    }
}
#endif

static int panel_codes = 1; /* panels built from codes (tests switch it off: the float path) */

int hkv_quant_panel_codes(int on) {
    panel_codes = on;
#if defined(HAVE_FAST_DEQUANT)
    return 1;
#else
    return 0;
#endif
}

/* out [panels, cols, 64] = W's rows as linear.c's panels for n outputs, columns past n
   zero. Plain (up < 0): panel p's column c is row 64 p + c. Gated (linear.c's gated
   panels, 32 outputs each): column c < 32 is gate row j = 32 p + c, column 32 + c the up
   row j, at row up + j of W. cols: a multiple of 8 (every block size is). Returns -2 when
   a thread's scratch (8 dequantized rows) cannot be allocated. */
static int dequantize_panels(const uint8_t *w, int64_t ldw, int type, int64_t cols,
                             int64_t nb, int64_t n, int64_t up, float *out) {
    const int64_t width = up >= 0 ? PACK_WIDTH / 2 : PACK_WIDTH;
    /* Whole 8-column groups, the padding up to the last panel's 64 columns included. */
    const int64_t groups = (n + width - 1) / width * (PACK_WIDTH / 8);
    int failed = 0;
    /* Codes (8 cols bytes, 8 cols / 16 scales and offsets) fit the float scratch (8 cols
       floats) whenever cols is a multiple of 32, which every code type's block size is. */
    int codes = 0;
#if defined(HAVE_FAST_DEQUANT)
    codes = panel_codes && !force_portable && cols % 32 == 0 &&
            (type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 ||
             type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K);
#endif
#pragma omp parallel if (n * cols >= (1 << 18))
    {
        float *scratch = malloc((size_t)(8 * cols) * sizeof(float));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (scratch == NULL) continue;
            const int64_t p = g / (PACK_WIDTH / 8), c = g % (PACK_WIDTH / 8) * 8;
            float *panel = out + p * cols * PACK_WIDTH + c;
            const int64_t j = p * width + c % width; /* the group's first output */
            const int64_t row = up >= 0 && c >= width ? up + j : j;
            if (j >= n) {
                for (int64_t k = 0; k < cols; k++)
                    memset(panel + k * PACK_WIDTH, 0, 8 * sizeof(float));
                continue;
            }
#if defined(HAVE_FAST_DEQUANT)
            if (codes) {
                /* scratch: 8 rows of codes, then their scales and offsets */
                uint8_t *q = (uint8_t *)scratch;
                float *ds = scratch + 2 * cols, *os = ds + cols / 2;
                for (int64_t i = 0; i < 8; i++) {
                    if (j + i < n) {
                        row_codes_avx2(type, w + (row + i) * ldw, nb, q + i * cols, ds + i,
                                       os + i);
                    } else {
                        memset(q + i * cols, 0, (size_t)cols);
                        for (int64_t t = 0; t < cols / 16; t++) ds[8 * t + i] = os[8 * t + i] = 0.f;
                    }
                }
                codes_to_panel(q, ds, os, cols, panel);
                continue;
            }
#endif
            for (int64_t i = 0; i < 8; i++) {
                if (j + i < n) dequant_blocks(type, w + (row + i) * ldw, nb, scratch + i * cols);
                else memset(scratch + i * cols, 0, (size_t)cols * sizeof(float));
            }
            for (int64_t k = 0; k < cols; k += 8)
                transpose8(scratch + k, cols, panel + k * PACK_WIDTH);
        }
        free(scratch);
    }
    return failed ? -2 : 0;
}

/* Floats of the buffer hkv_quant_matmul_packed needs for chunks of `panels` panels. */
int64_t hkv_quant_packed_floats(int64_t panels, int64_t cols) {
    return panels * PACK_WIDTH * cols;
}

/* y [m, n] (row stride ldy) = x [m, cols] times W^T as hkv_quant_matmul (mode 0; W: n
   rows), or linear.c's gated epilogue act(x G^T) * (x U^T) (mode: one of its GATED_*; W:
   the n gate rows, then the n up rows). `panels` panels of W at a time are dequantized
   into buf (hkv_quant_packed_floats floats) and multiplied by `linear` (the address of
   linear.c's hkv_linear_f32). Returns -1 for a type not handled here, a bad chunk or cols
   not a multiple of 8, -2 when a scratch cannot be allocated. */
int hkv_quant_matmul_packed(const float *x, int64_t m, int64_t ldx, const uint8_t *w,
                            int64_t ldw, int type, int64_t n, int64_t cols, float *y,
                            int64_t ldy, int mode, float *buf, int64_t panels, void *linear) {
    int64_t bv, bb;
    block_shape(type, &bv, &bb);
    if (bv == 0 || panels <= 0 || cols % 8) return -1;
    if (m <= 0 || n <= 0) return 0;
    const int64_t nb = cols / bv;
    const int64_t step = panels * (mode ? PACK_WIDTH / 2 : PACK_WIDTH);
    const linear_f32_fn fn = (linear_f32_fn)linear;
    for (int64_t r0 = 0; r0 < n; r0 += step) {
        const int64_t count = n - r0 < step ? n - r0 : step;
        /* (Gated: the up rows sit n rows past the gate rows, wherever the chunk starts.) */
        if (dequantize_panels(w + r0 * ldw, ldw, type, cols, nb, count, mode ? n : -1, buf))
            return -2;
        fn(x, m, ldx, buf, cols, NULL, y + r0, count, ldy, mode);
    }
    return 0;
}
