/* int8 KV rows written on the CPU: the bytes worker/attention/kv_quant.py writes, without its ~20
   torch operations per call (a decode step writes one token a layer, where those cost more
   than the layer's attention). Row: [fp16 scale per group of 32 | int8 values | zero pad
   to even]; scale = max|x| / 127 rounded to fp16 (to nearest even), values x / scale rounded
   half to even and clamped to [-127, 127] in float32: exactly torch's operations, so both
   paths write the same bytes. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
static inline uint16_t to_half(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
static inline float from_half(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline uint16_t to_half(float x) {
    _Float16 h = (_Float16)x; /* round to nearest even */
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}
static inline float from_half(uint16_t bits) {
    _Float16 h;
    memcpy(&h, &bits, 2);
    return (float)h;
}
#endif

#define GROUP 32

/* A group's scale, max|x| / qmax clamped to fp16's largest and rounded to fp16 (to nearest
   even), stored at dst; returns it as the float the values are divided by. */
static float group_scale(const float *x, int64_t n, float qmax, uint8_t *dst) {
    float amax = 0.f;
    for (int64_t d = 0; d < n; d++) amax = fmaxf(amax, fabsf(x[d]));
    float scale = amax / qmax;
    if (scale > 65504.f) scale = 65504.f;
    const uint16_t bits = to_half(scale);
    memcpy(dst, &bits, 2);
    return from_half(bits);
}

/* One row of head_size values into its row_bytes at dst. */
static void quantize_row(const float *src, int64_t head_size, uint8_t *dst, int64_t row_bytes) {
    const int64_t groups = (head_size + GROUP - 1) / GROUP;
    int8_t *values = (int8_t *)(dst + 2 * groups);
    for (int64_t g = 0; g < groups; g++) {
        const int64_t d0 = g * GROUP, n = head_size - d0 < GROUP ? head_size - d0 : GROUP;
        const float s = group_scale(src + d0, n, 127.f, dst + 2 * g);
        for (int64_t d = 0; d < n; d++) {
            float q = s > 0.f ? nearbyintf(src[d0 + d] / s) : 0.f;
            q = q < -127.f ? -127.f : (q > 127.f ? 127.f : q);
            values[d0 + d] = (int8_t)q;
        }
    }
    for (int64_t b = 2 * groups + head_size; b < row_bytes; b++) dst[b] = 0;
}

/* x: [rows, head_size] float32 (row stride x_stride floats); out: [rows, row_bytes]. */
void hkv_quantize_int8_rows(const float *x, int64_t rows, int64_t x_stride, int64_t head_size,
                            uint8_t *out, int64_t row_bytes) {
    for (int64_t r = 0; r < rows; r++)
        quantize_row(x + r * x_stride, head_size, out + r * row_bytes, row_bytes);
}

/* k/v [T, Hk, head_size] (strides in floats) quantized straight into their slots of the
   pages [pages, per_page, 2, block, Hk, row_bytes] (strides in bytes). */
void hkv_write_kv_int8(const float *k, int64_t k_stride0, int64_t k_stride1, const float *v,
                       int64_t v_stride0, int64_t v_stride1, int64_t n0, int64_t n1,
                       int64_t head_size, int64_t row_bytes, const int64_t *slots,
                       uint8_t *cache, int64_t page_stride, int64_t slot_stride,
                       int64_t kv_stride, int64_t token_stride, int64_t head_stride,
                       int64_t block_size, int64_t blocks_per_page) {
    for (int64_t t = 0; t < n0; t++) {
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        uint8_t *base = cache + (block / blocks_per_page) * page_stride
                        + (block % blocks_per_page) * slot_stride + offset * token_stride;
        for (int64_t h = 0; h < n1; h++) {
            quantize_row(k + t * k_stride0 + h * k_stride1, head_size, base + h * head_stride,
                         row_bytes);
            quantize_row(v + t * v_stride0 + h * v_stride1, head_size,
                         base + kv_stride + h * head_stride, row_bytes);
        }
    }
}

/* q4 V rows (kv/spec.py q4_kv_layout), given the values already rotated (torch's matmul by
   the Hadamard matrix, so both paths round the rotation alike): [fp16 scale per group of
   32 | nibbles], scale = max|x| / 7 in fp16, nibble round(x / scale) + 8 clamped to [0, 15],
   in a group of n values byte i holding value i (low) and i + ceil(n / 2) (high). Only the
   row's own bytes are written: its tail holds its key group's share. */
static void quantize_v_q4_row(const float *src, int64_t head_size, uint8_t *dst) {
    const int64_t groups = (head_size + GROUP - 1) / GROUP;
    uint8_t *values = dst + 2 * groups;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t d0 = g * GROUP, n = head_size - d0 < GROUP ? head_size - d0 : GROUP;
        const float s = group_scale(src + d0, n, 7.f, dst + 2 * g);
        uint8_t nib[GROUP];
        for (int64_t d = 0; d < n; d++) {
            float q = s > 0.f ? nearbyintf(src[d0 + d] / s) : 0.f;
            q = q < -8.f ? -8.f : (q > 7.f ? 7.f : q);
            nib[d] = (uint8_t)(q + 8.f);
        }
        const int64_t half = n == GROUP ? 16 : (n + 1) / 2;
        uint8_t *out = values + d0 / 2;
        for (int64_t d = 0; d < half; d++)
            out[d] = (uint8_t)(nib[d] | (d + half < n ? nib[d + half] << 4 : 0));
    }
}

/* rotated v [T, Hk, head_size] (contiguous float32) into the V rows of their slots of the
   pages [pages, per_page, 2, block, Hk, row_bytes] (strides in bytes). */
void hkv_write_v_q4(const float *v, int64_t n0, int64_t n1, int64_t head_size,
                    const int64_t *slots, uint8_t *cache, int64_t page_stride,
                    int64_t slot_stride, int64_t kv_stride, int64_t token_stride,
                    int64_t head_stride, int64_t block_size, int64_t blocks_per_page) {
    for (int64_t t = 0; t < n0; t++) {
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        uint8_t *base = cache + (block / blocks_per_page) * page_stride
                        + (block % blocks_per_page) * slot_stride + offset * token_stride
                        + kv_stride;
        for (int64_t h = 0; h < n1; h++)
            quantize_v_q4_row(v + (t * n1 + h) * head_size, head_size, base + h * head_stride);
    }
}
