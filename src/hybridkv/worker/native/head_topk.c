/* The k largest logits of each batch row, merged a block of the LM head at a time.

   A block is y = W[r0:r0 + rows] x^T, [rows, cols] with the batch's rows as its columns
   (the layout the blocked head produces). Each column keeps a list of k (value, token id)
   pairs sorted by value, descending, and among equal values by id, ascending: blocks come in
   id order and a new value goes after the equal ones already there, so k = 1 is torch's
   argmax (the first index of the maximum). A value enters only when it beats the list's
   last one, which after the first block is rare: the scan is one compare per logit, eight
   columns at a time. A NaN is never listed; the column is flagged instead (the caller then
   takes the full logits, where NaN handling is torch's). */

#include <math.h>
#include <stdint.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

static void insert(float *vals, int64_t *ids, int64_t k, float v, int64_t id) {
    int64_t at = k - 1;
    while (at > 0 && vals[at - 1] < v) {  /* strictly: equal values keep their order */
        vals[at] = vals[at - 1];
        ids[at] = ids[at - 1];
        at--;
    }
    vals[at] = v;
    ids[at] = id;
}

static void visit(const float *row, int64_t c, int64_t id, int64_t k, float *vals,
                  int64_t *ids, uint8_t *nan_seen, float *last) {
    const float v = row[c];
    if (isnan(v)) {
        nan_seen[c] = 1;
        return;
    }
    if (v > last[c]) {
        insert(vals + c * k, ids + c * k, k, v, id);
        last[c] = vals[c * k + k - 1];
    }
}

/* vals, ids: [cols, k], filled by the caller with -inf and -1 before the first block;
   last: [cols] scratch, vals[c][k - 1] on entry (the caller keeps it between blocks). */
void hkv_head_topk(const float *y, int64_t rows, int64_t cols, int64_t ld, int64_t r0,
                   int64_t k, float *vals, int64_t *ids, uint8_t *nan_seen, float *last) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = y + r * ld;
        int64_t c = 0;
#if defined(__AVX2__)
        for (; c + 8 <= cols; c += 8) {
            const __m256 v = _mm256_loadu_ps(row + c);
            const __m256 t = _mm256_loadu_ps(last + c);
            /* v > t, or v is NaN: either needs a look; otherwise nothing changes. */
            const __m256 hit = _mm256_or_ps(_mm256_cmp_ps(v, t, _CMP_GT_OQ),
                                            _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            int bits = _mm256_movemask_ps(hit);
            while (bits) {
                const int j = __builtin_ctz(bits);
                bits &= bits - 1;
                visit(row, c + j, r0 + r, k, vals, ids, nan_seen, last);
            }
        }
#endif
        for (; c < cols; c++) visit(row, c, r0 + r, k, vals, ids, nan_seen, last);
    }
}
