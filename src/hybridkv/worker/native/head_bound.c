/* The tokens that can still be a row's argmax, given approximate logits and a bound on
   each one's error (worker/head_bound.py: a greedy step's 8-bit pre-pass of the LM head),
   and likewise those that can be among its k largest.

   Row r's logit of token v is known to lie in approx[r][v] -+ bound, with
       bound = a[r] * wn[v] + b[r] * dn[v]
   (a, b: the row's activation error and norm terms; wn, dn: token v's head-row norm and
   quantization-error norm, dn may be absent). The argmax's logit is at least the largest
   lower end, lo = max_v (approx - bound); a token whose upper end is below lo cannot be
   the argmax. Two passes per row: lo, then the tokens whose upper end reaches it. */

#include <stdint.h>

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

/* For each of n rows (approx row stride ld): the ids of the tokens whose upper end reaches
   the row's k-th largest lower end (k <= 64; 1: the argmax's candidates), ascending, into ids[r * cap ...], their number into counts[r] (which may
   exceed cap: then only the first cap are written, and the caller asks again with more
   room). */
void hkv_head_bound_select(const float *approx, int64_t n, int64_t vocab, int64_t ld,
                           const float *a, const float *b, const float *wn, const float *dn,
                           int64_t k, int64_t cap, int64_t *ids, int64_t *counts) {
#pragma omp parallel for schedule(static) if (n > 1 && n * vocab >= (1 << 20))
    for (int64_t r = 0; r < n; r++) {
        const float *y = approx + r * ld;
        const float lo = lower_kth(y, vocab, a[r], b[r], wn, dn, k);
        int64_t *out = ids + r * cap, count = 0, v = 0;
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
                if (count < cap) out[count] = v + j;
                count++;
            }
        }
#endif
        for (; v < vocab; v++) {
            const float up = y[v] + (a[r] * wn[v] + (dn ? b[r] * dn[v] : 0.f));
            if (up >= lo) {
                if (count < cap) out[count] = v;
                count++;
            }
        }
        counts[r] = count;
    }
}
