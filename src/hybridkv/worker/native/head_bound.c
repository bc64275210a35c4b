/* The tokens that can still be a row's argmax, given approximate logits and a bound on
   each one's error (worker/head/bound.py: a greedy step's 8-bit pre-pass of the LM head),
   and likewise those that can be among its k largest.

   Row r's logit of token v is known to lie in approx[r][v] -+ bound, with
       bound = a[r] * wn[v] + b[r] * dn[v]
   (a, b: the row's activation error and norm terms; wn, dn: token v's head-row norm and
   quantization-error norm, dn may be absent). The argmax's logit is at least the largest
   lower end, lo = max_v (approx - bound); a token whose upper end is below lo cannot be
   the argmax. Two passes per row: lo, then the tokens whose upper end reaches it. */

#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Keeps best[0..k) the k largest values seen, descending. */
static void keep(float *best, int64_t k, float v) {
    int64_t at = k - 1;
    while (at > 0 && best[at - 1] < v) {
        best[at] = best[at - 1];
        at--;
    }
    best[at] = v;
}

/* Row r's k-th largest lower end (-inf for fewer than k tokens): at least k tokens have a
   logit of at least that, so each of the k best has its upper end there or above. */
static float lower_kth(const float *y, int64_t vocab, float a, float b, const float *wn,
                       const float *dn, int64_t k) {
    float best[64];
    for (int64_t j = 0; j < k; j++) best[j] = -__builtin_inff();
    int64_t v = 0;
#if defined(__AVX2__)
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    for (; v + 8 <= vocab; v += 8) {
        __m256 bound = _mm256_mul_ps(va, _mm256_loadu_ps(wn + v));
        if (dn) bound = _mm256_fmadd_ps(vb, _mm256_loadu_ps(dn + v), bound);
        const __m256 low = _mm256_sub_ps(_mm256_loadu_ps(y + v), bound);
        int bits = _mm256_movemask_ps(_mm256_cmp_ps(low, _mm256_set1_ps(best[k - 1]),
                                                    _CMP_GT_OQ));
        if (!bits) continue;
        float lanes[8];
        _mm256_storeu_ps(lanes, low);
        while (bits) {
            const int j = __builtin_ctz(bits);
            bits &= bits - 1;
            if (lanes[j] > best[k - 1]) keep(best, k, lanes[j]);
        }
    }
#endif
    for (; v < vocab; v++) {
        const float low = y[v] - (a * wn[v] + (dn ? b * dn[v] : 0.f));
        if (low > best[k - 1]) keep(best, k, low);
    }
    return best[k - 1];
}

/* Row r's finer bound for token v, from the error and norms of each 32-value block:
   |x . w - x_hat . w_hat| <= sum_b ||e_b|| ||w_hat_b|| + ||x_b|| ||w_b - w_hat_b||, at most
   the whole-row bound (Cauchy-Schwarz over the blocks) and often far below it: where x's
   energy sits in a few blocks, so does its bound. */
static inline float fine_bound(int64_t nb, const float *eb, const float *xb, const float *wb,
                               const float *db, float slack, float wn, float dn) {
    float s = slack * (wn + dn);
    for (int64_t j = 0; j < nb; j++) s += eb[j] * wb[j] + (db ? xb[j] * db[j] : 0.f);
    return s;
}

/* For each of n rows (approx row stride ld): the ids of the tokens whose upper end reaches
   the row's k-th largest lower end (k <= 64; 1: the argmax's candidates), ascending, into
   ids[r * cap ...], their number into counts[r] (which may exceed cap: then only the
   first cap are written, and the caller asks again with more room).

   Two stages per row: the whole-row bound (a, b with wn, dn) over the vocabulary, then
   the block bound (eb, xb [n][nb] with wb, db [vocab][nb]; slack the rounding term) over
   the tokens the first stage keeps. The k-th largest block-bound lower end among them is
   the row's: each of the k tokens that set the first stage's one is kept, with a lower
   end at least as high, and a token left out has its upper end below that one. wb NULL:
   the first stage alone. Returns 0, or -1 where a row's scratch could not be allocated. */
int hkv_head_bound_select(const float *approx, int64_t n, int64_t vocab, int64_t ld,
                          const float *a, const float *b, const float *wn, const float *dn,
                          int64_t nb, const float *eb, const float *xb, const float *wb,
                          const float *db, const float *slack,
                          int64_t k, int64_t cap, int64_t *ids, int64_t *counts) {
    int failed = 0;
#pragma omp parallel for schedule(static) if (n > 1 && n * vocab >= (1 << 20))
    for (int64_t r = 0; r < n; r++) {
        const float *y = approx + r * ld;
        const float lo = lower_kth(y, vocab, a[r], b[r], wn, dn, k);
        int32_t *kept = wb ? (int32_t *)malloc((size_t)vocab * sizeof(int32_t)) : 0;
        if (wb && !kept) {
#pragma omp atomic write
            failed = 1;
            counts[r] = 0;
            continue;
        }
        int64_t *out = ids + r * cap, count = 0, v = 0;
#define KEEP(V)                                                                   \
    do {                                                                          \
        if (kept) kept[count] = (int32_t)(V);                                     \
        else if (count < cap) out[count] = (V);                                   \
        count++;                                                                  \
    } while (0)
#if defined(__AVX2__)
        const __m256 va = _mm256_set1_ps(a[r]), vb = _mm256_set1_ps(b[r]);
        const __m256 vlo = _mm256_set1_ps(lo);
        for (; v + 8 <= vocab; v += 8) {
            __m256 bound = _mm256_mul_ps(va, _mm256_loadu_ps(wn + v));
            if (dn) bound = _mm256_fmadd_ps(vb, _mm256_loadu_ps(dn + v), bound);
            const __m256 up = _mm256_add_ps(_mm256_loadu_ps(y + v), bound);
            int bits = _mm256_movemask_ps(_mm256_cmp_ps(up, vlo, _CMP_GE_OQ));
            while (bits) {
                const int j = __builtin_ctz(bits);
                bits &= bits - 1;
                KEEP(v + j);
            }
        }
#endif
        for (; v < vocab; v++) {
            const float up = y[v] + (a[r] * wn[v] + (dn ? b[r] * dn[v] : 0.f));
            if (up >= lo) KEEP(v);
        }
#undef KEEP
        if (kept) {
            const int64_t first = count;
            const float *er = eb + r * nb, *xr = xb + r * nb;
            float best[64];
            for (int64_t j = 0; j < k; j++) best[j] = -__builtin_inff();
            for (int64_t c = 0; c < first; c++) {
                const int64_t t = kept[c];
                const float low = y[t] - fine_bound(nb, er, xr, wb + t * nb,
                                                    db ? db + t * nb : 0, slack[r], wn[t],
                                                    dn ? dn[t] : 0.f);
                if (low > best[k - 1]) keep(best, k, low);
            }
            count = 0;
            for (int64_t c = 0; c < first; c++) {
                const int64_t t = kept[c];
                const float up = y[t] + fine_bound(nb, er, xr, wb + t * nb,
                                                   db ? db + t * nb : 0, slack[r], wn[t],
                                                   dn ? dn[t] : 0.f);
                if (up >= best[k - 1]) {
                    if (count < cap) out[count] = t;
                    count++;
                }
            }
            free(kept);
        }
        counts[r] = count;
    }
    return failed ? -1 : 0;
}

/* What a step needs of its n rows of x before the pre-pass, in one call (the same values
   as worker/head/bound.py's quantize_blocks and error_terms, which take ~15 small tensor
   operations a row; after the head's pass has streamed through the caches they cost more
   than all of this): per 32-value block d = max|x| / 127, q = round(x / d) to nearest even
   (0 for a block of zeros) and the norms of x and of e = x - q d, whole and per block,
   accumulated in double. slack = rounding * cols * (||x|| + ||e||), a = ||e|| + slack,
   b = ||x|| + slack. Returns 1, with nothing else defined, where a value of x is not
   finite (the caller's full logits then report it), else 0. */
int hkv_head_prepare(const float *x, int64_t n, int64_t cols, float rounding, int8_t *q,
                     float *d, float *a, float *b, float *eb, float *xb, float *slack) {
    const int64_t nb = cols / 32;
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * cols;
        double xsum = 0.0, esum = 0.0;
        for (int64_t j = 0; j < nb; j++) {
            const float *v = xr + 32 * j;
            float amax = 0.f;
            for (int t = 0; t < 32; t++) {
                if (!__builtin_isfinite(v[t])) return 1;
                const float m = v[t] < 0.f ? -v[t] : v[t];
                amax = m > amax ? m : amax;
            }
            const float dj = amax / 127.0f, inv = dj != 0.f ? 1.0f / dj : 0.f;
            double xs = 0.0, es = 0.0;
            for (int t = 0; t < 32; t++) {
                float qv = __builtin_rintf(v[t] * inv);
                qv = qv > 127.f ? 127.f : qv < -127.f ? -127.f : qv;
                q[r * cols + 32 * j + t] = (int8_t)qv;
                const double e = (double)v[t] - (double)(qv * dj);
                xs += (double)v[t] * (double)v[t];
                es += e * e;
            }
            d[r * nb + j] = dj;
            xb[r * nb + j] = (float)__builtin_sqrt(xs);
            eb[r * nb + j] = (float)__builtin_sqrt(es);
            xsum += xs;
            esum += es;
        }
        const float xn = (float)__builtin_sqrt(xsum), en = (float)__builtin_sqrt(esum);
        slack[r] = rounding * (float)cols * (xn + en);
        a[r] = en + slack[r];
        b[r] = xn + slack[r];
    }
    return 0;
}

/* The pre-pass logits from 8-bit head rows packed eight tokens at a time, for any number
   of rows of x.

   AVX2 has no 8-bit dot product with one instruction: a u8 x s8 multiply-add into int16
   pairs, then an int16 multiply-add into int32 (plus a sign step, as both sides are
   signed). With one token's row per register, every block's int32 sums must then be
   turned into floats and scaled per token and per x row: more instructions per product
   than float FMAs. Packed, a register holds four values of each of 8 tokens, x's four
   values are broadcast against it, and the int32 lanes are the 8 tokens' block sums: one
   conversion and one FMA per block for 8 tokens at once. On one AVX2 core this computes a
   262k x 640 head at 32 rows ~2x faster than a blocked float GEMM.

   Layout (worker/head/bound.py: pack_rows): group g holds tokens 8g..8g+7; per 32-value
   block b, 8 chunks of 32 bytes, chunk j = the 8 tokens' values 4j..4j+3 in token order,
   each stored as the unsigned byte w + 128 (VNNI's u8 x s8 product takes it as it is);
   scales[g][b][t] the token's block scale, an IEEE half (a batch-1 step reads the copy
   once, bound by memory bandwidth: float scales would add 12% to its bytes). x: int8
   values xq[i][cols] and float block scales xd[i][nb]. y[i][8g + t] = sum_b scales *
   xd[i][b] * (sum of the block's 32 products). */

#define PANEL_GROUPS 16 /* 16 groups x 20 blocks x 256 bytes: 80 KiB, stays in L2 across x */
#define TILE_X 6

static inline int32_t rd_i32(const int8_t *p) { int32_t v; __builtin_memcpy(&v, p, 4); return v; }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* Group g's sums for NX rows of x. With VNNI the packed bytes, w + 128 as unsigned, go
   straight into the u8 x s8 product with x's four values broadcast: one instruction per
   four values of 8 tokens and x row, where w's sign moved onto x took two more; the 128
   sum(x) this adds (x128[i][b], per block and x row: the same for every token) comes off
   in int32, so the block sums are the same integers either way. */
static inline __attribute__((always_inline)) void i8_group(
    const int8_t *w, const uint16_t *sc, int64_t nb, const int8_t *xq, int64_t cols,
    const float *xd, const int32_t *x128, float *y, int64_t ldy, const int NX) {
    __m256 accf[8];
    for (int i = 0; i < NX; i++) accf[i] = _mm256_setzero_ps();
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
    const __m256i ones = _mm256_set1_epi16(1), high = _mm256_set1_epi8((char)0x80);
    (void)x128;
#endif
    for (int64_t b = 0; b < nb; b++) {
        __m256i acc[8];
        for (int i = 0; i < NX; i++) acc[i] = _mm256_setzero_si256();
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        /* CH independent sums per x row (integers: any order gives the same), so that
           with few rows the products do not wait on one another's latency */
        const int CH = NX >= 6 ? 1 : NX >= 3 ? 2 : 4;
        __m256i part[3][8];
        for (int c = 0; c + 1 < CH; c++)
            for (int i = 0; i < NX; i++) part[c][i] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (b * 8 + j) * 32));
            const int c = j % CH;
            for (int i = 0; i < NX; i++) {
                const __m256i xb = _mm256_set1_epi32(rd_i32(xq + i * cols + 32 * b + 4 * j));
                if (c == 0) acc[i] = _mm256_dpbusd_epi32(acc[i], wv, xb);
                else part[c - 1][i] = _mm256_dpbusd_epi32(part[c - 1][i], wv, xb);
            }
        }
        for (int c = 0; c + 1 < CH; c++)
            for (int i = 0; i < NX; i++) acc[i] = _mm256_add_epi32(acc[i], part[c][i]);
#else
        for (int j = 0; j < 8; j++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (b * 8 + j) * 32));
            /* w itself (signed), its magnitude times x with w's sign: u8 x s8 pairs, at
               most 2 127 127 < 2^15, where w + 128 would saturate the int16 pairs */
            const __m256i ws = _mm256_xor_si256(wv, high);
            const __m256i wa = _mm256_sign_epi8(ws, ws);
            for (int i = 0; i < NX; i++) {
                const __m256i xb = _mm256_set1_epi32(rd_i32(xq + i * cols + 32 * b + 4 * j));
                acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xb, ws)), ones));
            }
        }
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        for (int i = 0; i < NX; i++)
            acc[i] = _mm256_sub_epi32(acc[i], _mm256_set1_epi32(x128[i * nb + b]));
#endif
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + b * 8)));
        for (int i = 0; i < NX; i++)
            accf[i] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(xd[i * nb + b])),
                                      _mm256_cvtepi32_ps(acc[i]), accf[i]);
    }
    for (int i = 0; i < NX; i++) _mm256_storeu_ps(y + i * ldy, accf[i]);
}
#define HAVE_I8_AVX2 1
#endif

#if defined(HAVE_I8_AVX2) && defined(__AVX512F__) && defined(__AVX512VNNI__)
/* i8_group for groups g and g + 1 at once (w, sc: group g's; g + 1's follow them), on
   512-bit registers: each x broadcast feeds 16 tokens. Lane for lane the same integers
   and the same float operations as i8_group, so the same values. */
static inline __attribute__((always_inline)) void i8_pair(
    const int8_t *w, const uint16_t *sc, int64_t nb, const int8_t *xq, int64_t cols,
    const float *xd, const int32_t *x128, float *y, int64_t ldy, const int NX) {
    const int8_t *w1 = w + nb * 256;
    const uint16_t *sc1 = sc + nb * 8;
    const int CH = NX >= 4 ? 1 : 2;
    __m512 accf[8];
    for (int i = 0; i < NX; i++) accf[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i acc[8], part[8];
        for (int i = 0; i < NX; i++) acc[i] = part[i] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            const int64_t at = (b * 8 + j) * 32;
            const __m512i wv = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + at))),
                _mm256_loadu_si256((const __m256i *)(w1 + at)), 1);
            for (int i = 0; i < NX; i++) {
                const __m512i xb = _mm512_set1_epi32(rd_i32(xq + i * cols + 32 * b + 4 * j));
                if (CH == 1 || j % 2 == 0) acc[i] = _mm512_dpbusd_epi32(acc[i], wv, xb);
                else part[i] = _mm512_dpbusd_epi32(part[i], wv, xb);
            }
        }
        const __m512 s = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(sc + b * 8))),
            _mm_loadu_si128((const __m128i *)(sc1 + b * 8)), 1));
        for (int i = 0; i < NX; i++) {
            const __m512i t = _mm512_sub_epi32(_mm512_add_epi32(acc[i], part[i]),
                                               _mm512_set1_epi32(x128[i * nb + b]));
            accf[i] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(xd[i * nb + b])),
                                      _mm512_cvtepi32_ps(t), accf[i]);
        }
    }
    for (int i = 0; i < NX; i++) _mm512_storeu_ps(y + i * ldy, accf[i]);
}
#define HAVE_I8_PAIR 1
#endif

/* A packed byte's value: stored as w + 128 (see hkv_head_i8_matmul). */
static inline int32_t packed_value(int8_t u) { return (int32_t)(int8_t)((uint8_t)u ^ 0x80u); }

static void i8_group_portable(const int8_t *w, const uint16_t *sc, int64_t nb, const int8_t *xq,
                              int64_t cols, const float *xd, float *y, int64_t ldy, int nx) {
    for (int i = 0; i < nx; i++)
        for (int t = 0; t < 8; t++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t sum = 0;
                for (int j = 0; j < 8; j++)
                    for (int e = 0; e < 4; e++)
                        sum += packed_value(w[(b * 8 + j) * 32 + 4 * t + e]) *
                               (int32_t)xq[i * cols + 32 * b + 4 * j + e];
                acc += half_to_float(sc[b * 8 + t]) * xd[i * nb + b] * (float)sum;
            }
            y[i * ldy + t] = acc;
        }
}

static int i8_portable; /* tests: the portable code on an AVX2 machine too */

int hkv_head_i8_portable(int on) {
    i8_portable = on;
#if defined(HAVE_I8_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* y[i][0 .. 8 groups) for the m rows of x (y's row stride ldy). Returns 0, or -1 where its
   scratch could not be allocated. */
int hkv_head_i8_matmul(const int8_t *w, const uint16_t *sc, int64_t groups, int64_t cols,
                       const int8_t *xq, const float *xd, int64_t m, float *y, int64_t ldy) {
    const int64_t nb = cols / 32;
    /* 128 times each x block's sum: what the packed bytes' + 128 adds to its products */
    int32_t *x128 = malloc(sizeof(int32_t) * (size_t)(m * nb + 1));
    if (x128 == NULL) return -1;
    block_byte_sums(xq, m * nb, 128, x128);
#pragma omp parallel for schedule(static) if (groups * m >= 4096)
    for (int64_t g0 = 0; g0 < groups; g0 += PANEL_GROUPS) {
        const int64_t g1 = g0 + PANEL_GROUPS < groups ? g0 + PANEL_GROUPS : groups;
        for (int64_t i = 0; i < m; i += TILE_X) {
            const int nx = m - i < TILE_X ? (int)(m - i) : TILE_X;
            const int8_t *xi = xq + i * cols;
            const float *di = xd + i * nb;
            for (int64_t g = g0; g < g1; g++) {
                const int8_t *wg = w + g * nb * 256;
                const uint16_t *sg = sc + g * nb * 8;
                float *yg = y + i * ldy + 8 * g;
/* KERNEL with this tile's x rows known to the compiler */
#define NX_CASE(KERNEL, N) \
    case N: KERNEL(wg, sg, nb, xi, cols, di, x128 + i * nb, yg, ldy, N); break;
#define NX_SWITCH(KERNEL)                                                  \
    switch (nx) {                                                          \
        NX_CASE(KERNEL, 1) NX_CASE(KERNEL, 2) NX_CASE(KERNEL, 3)           \
        NX_CASE(KERNEL, 4) NX_CASE(KERNEL, 5) NX_CASE(KERNEL, 6)           \
        NX_CASE(KERNEL, 7) NX_CASE(KERNEL, 8)                              \
    }
#if defined(HAVE_I8_PAIR)
                if (!i8_portable && g + 1 < g1) {
                    NX_SWITCH(i8_pair)
                    g++;
                    continue;
                }
#endif
#if defined(HAVE_I8_AVX2)
                if (!i8_portable) {
                    NX_SWITCH(i8_group)
                    continue;
                }
#endif
#undef NX_SWITCH
#undef NX_CASE
                i8_group_portable(wg, sg, nb, xi, cols, di, yg, ldy, nx);
            }
        }
    }
    free(x128);
    return 0;
}
