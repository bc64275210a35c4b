/* What the C kernels share: 16-float SIMD values through GCC/Clang vector extensions
   (AVX-512 here, two AVX2 or four NEON registers elsewhere) and a vectorisable exp. */

#ifndef HYBRIDKV_SIMD_H
#define HYBRIDKV_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

/* IEEE half -> float, subnormals, infinities and NaNs included. */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: man 2^-24 */
        float f = (float)man * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
#endif
}

/* exp(x) for x <= 0 (scores minus their running max), written so loops over it vectorise:
   x = n ln2 + r with |r| <= ln2/2, exp(r) by its Taylor series to r^6 (relative error
   below 2e-7, as expf's last bit), times 2^n built in the exponent bits. Below -87 the
   result is flushed to 0 (exp(-87) is 1.6e-38; such keys weigh nothing next to the max). */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.f ? -87.f : x;
    const float n = nearbyintf(clamped * 1.44269504088896341f);
    const float r = clamped - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return x < -87.f ? 0.f : p * scale.f;
}

/* act(x) * u for the gated MLPs' activations (mode 1: SiLU, 2: GELU with tanh, else ReLU),
   each exp through exp_nonpositive so nothing overflows. */
static inline float gated_act(float x, float u, int mode) {
    float a;
    if (mode == 1) { /* x * sigmoid(x), from exp(-|x|) */
        const float e = exp_nonpositive(-fabsf(x));
        a = x * (x >= 0.f ? 1.f : e) / (1.f + e);
    } else if (mode == 2) { /* x/2 (1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) */
        const float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        const float e = exp_nonpositive(-2.f * fabsf(z));
        const float t = (1.f - e) / (1.f + e);
        a = 0.5f * x * (1.f + (z >= 0.f ? t : -t));
    } else {
        a = x > 0.f ? x : 0.f;
    }
    return a * u;
}

/* out[j] = gated_act(g[j], u[j], mode) for j < n: the one loop every gated epilogue on
   quantized weights runs (quant_gemm.c, decode_layers.c), so a row's activation is the same
   bits on every path. */
static inline void gated_row(const float *g, const float *u, int64_t n, int mode, float *out) {
    /* One loop per mode: with the mode a constant inside, each vectorizes (a branch on it
       per value kept the loop scalar, ~6x torch's silu(g) * u). */
    if (mode == 1) {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) out[j] = gated_act(g[j], u[j], 1);
    } else if (mode == 2) {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) out[j] = gated_act(g[j], u[j], 2);
    } else {
#pragma omp simd
        for (int64_t j = 0; j < n; j++) out[j] = gated_act(g[j], u[j], mode);
    }
}

/* 16 floats as one SIMD value; unaligned loads and stores through memcpy. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 load16(const float *p) { v16 x; memcpy(&x, p, sizeof x); return x; }
static inline void store16(float *p, v16 x) { memcpy(p, &x, sizeof x); }

/* out[b] = times * (sum of q's 32 bytes of block b), for `blocks` blocks: what codes stored
   with an offset (unsigned bytes into u8 x s8 products) add to each block's products. */
static inline void block_byte_sums(const int8_t *q, int64_t blocks, int32_t times,
                                   int32_t *out) {
    for (int64_t b = 0; b < blocks; b++) {
        int32_t t = 0;
        for (int j = 0; j < 32; j++) t += q[32 * b + j];
        out[b] = times * t;
    }
}

#endif
