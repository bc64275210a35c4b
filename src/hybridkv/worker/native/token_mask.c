/* Structured output's token mask applied to logits in place: -inf where a row's bitmask
   (bit t of the little-endian 32-bit words = token t allowed) has a 0, and for every id past
   the mask's words. Unpacking the mask into a [rows, vocab] bool tensor first costs more
   than the whole argmax at a 262k vocabulary; here a word of all-ones (most of a JSON mask's
   words are all-zeros or all-ones) costs one compare. */

#include <math.h>
#include <stdint.h>

void hkv_mask_logits(float *logits, int64_t row_stride, const uint32_t *words,
                     int64_t word_stride, int64_t num_words, int64_t rows, int64_t vocab) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = logits + r * row_stride;
        const uint32_t *mask = words + r * word_stride;
        for (int64_t w = 0; w < num_words && 32 * w < vocab; w++) {
            const uint32_t bits = mask[w];
            if (bits == 0xffffffffu) continue;
            const int64_t end = 32 * w + 32 < vocab ? 32 * w + 32 : vocab;
            for (int64_t t = 32 * w; t < end; t++)
                if (!((bits >> (t - 32 * w)) & 1u)) row[t] = -INFINITY;
        }
        for (int64_t t = 32 * num_words; t < vocab; t++) row[t] = -INFINITY;
    }
}
