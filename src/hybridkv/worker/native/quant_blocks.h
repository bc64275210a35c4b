/* GGML block types as the quantized kernels read them (quant.c, quant_gemm.c): their ids,
   block shapes and the little-endian fields every layout shares. The layouts themselves are
   described at the top of quant.c. */

#ifndef HYBRIDKV_QUANT_BLOCKS_H
#define HYBRIDKV_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

/* (values, bytes) of one block of `type`; (0, 0) for a type not handled. */
static inline void block_shape(int type, int64_t *values, int64_t *bytes) {
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

/* Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes. */
static inline void scale_min_k4(const uint8_t *s, int j, float *sc, float *mn) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *mn = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
        *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

#if defined(__AVX2__)
#include <immintrin.h>

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
#endif

#endif
