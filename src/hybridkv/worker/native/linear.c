/* Linear layers on the CPU, float32: y = x W^T + b, and a gated MLP's act(x G^T) * (x U^T)
   as one pass over its weights.

   At decode a step is a few dozen rows, so a linear layer is bound by streaming its weights
   from memory: each weight is read once and used for every row. The weights are packed once
   into panels of 64 output columns, [panels, K, 64] (worker/linear/cpu.py packs them), so a
   panel is one forward stream; register tiles of 6 rows x 64 columns (24 accumulators)
   walk down it. A decode step's rows (12 to 96) take each panel 256 rows of K at a time,
   every tile in turn, while the next 64 KiB of the stream is prefetched a few lines per
   step of every tile: the memory traffic then overlaps all the arithmetic (with one pass per
   tile it overlapped only the first tile's, the others re-reading the panel from L2: 1.12x
   slower at 16 rows). At prefill (from PACKED_X_ROWS rows) the tiles are compute-bound:
   x is packed per tile so their broadcasts stream, and they run at about torch's GEMM
   speed.

   A gated panel holds 32 gate columns then the 32 up columns of the same outputs, so the
   activation and the product are applied in registers and the [rows, 2 x intermediate]
   pre-activations are never written.

   Work items (a panel x a block of rows) are split over torch's OpenMP threads. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PANEL 64     /* output columns per panel: four 16-float vectors */
#define TILE_ROWS 6  /* 6 x 4 accumulators + 4 weight vectors of the 32 registers */
#define ROW_BLOCK 96 /* rows per work item: its x rows stay in L2 while a panel passes */
#ifndef PACKED_X_ROWS
#define PACKED_X_ROWS 128 /* rows from which x is packed per tile (prefill) */
#endif
#ifndef K_BLOCK
#define K_BLOCK 256 /* rows of a panel (64 KiB) a prefill pass takes at a time */
#endif
/* K from which prefill blocks it: a panel of 1,024 rows (256 KiB) is half the L2 of the
   AVX2 cores measured (512 rows x K 2,048: 83 -> 88 GFLOP/s blocked; K 640 unblocked). */
#define K_BLOCKED 1024
#define PREFETCH_K 8 /* how many rows of the panel (256 bytes each) ahead to fetch */
#ifndef K_CHUNK
#define K_CHUNK 256 /* rows of a panel (64 KiB) a few-row product takes at a time */
#endif

/* Epilogues: plain, or one of the gated MLP's activations of the gate times the up. */
enum { PLAIN = 0, GATED_SILU = 1, GATED_GELU_TANH = 2, GATED_RELU = 3 };

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* exp_nonpositive over 8 lanes (the same steps, so the same values to the FMA's rounding):
   GCC left the scalar form unvectorised in the epilogue below, where it made the gated MLP
   1.3x slower than its plain product plus torch's activation. */
static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 c = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), c);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 q = _mm256_set1_ps(1.f / 720.f);
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f / 120.f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f / 24.f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f / 6.f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.5f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(q, _mm256_castsi256_ps(bits));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ), e);
}

static inline __m256 gated8(__m256 x, __m256 u, int mode) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    if (mode == GATED_SILU) { /* x * sigmoid(x), from exp(-|x|): nothing overflows */
        const __m256 e = exp_nonpositive8(_mm256_or_ps(x, sign));
        const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(x, _mm256_setzero_ps(),
                                                                  _CMP_GE_OQ));
        return _mm256_mul_ps(_mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, e))), u);
    }
    if (mode == GATED_GELU_TANH) { /* x/2 (1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) */
        const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                       _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
        const __m256 e = exp_nonpositive8(_mm256_mul_ps(_mm256_set1_ps(2.f),
                                                        _mm256_or_ps(z, sign)));
        __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
        t = _mm256_or_ps(t, _mm256_and_ps(z, sign)); /* tanh's sign is z's (t >= 0) */
        return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x),
                                           _mm256_add_ps(one, t)), u);
    }
    return _mm256_mul_ps(_mm256_max_ps(x, _mm256_setzero_ps()), u);
}
#endif

/* act(g) * u over 16 lanes, each lane's exp through exp_nonpositive. */
static inline v16 gated16(v16 g, v16 u, int mode) {
    float gs[16], us[16], out[16];
    store16(gs, g);
    store16(us, u);
#if defined(__AVX2__) && defined(__FMA__)
    for (int h = 0; h < 16; h += 8)
        _mm256_storeu_ps(out + h, gated8(_mm256_loadu_ps(gs + h), _mm256_loadu_ps(us + h),
                                         mode));
#else
    for (int l = 0; l < 16; l++) out[l] = gated_act(gs[l], us[l], mode);
#endif
    return load16(out);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* Without AVX-512 a 16-float value is two 8-float registers, and GCC lowers arrays of them
   (the 6 x 4 tile below) through the stack: measured 3 GFLOP/s on an AVX2 core, 20x below
   torch's GEMM. Here the tile walks the panel in strips of W 8-float columns (R rows x W
   vectors: at most 12 accumulators, the 16 registers' share left for the weights and the
   broadcast x), each strip's sums kept in registers over the whole K range. */
#define HAVE_STRIPS 1

/* acc rows [R][8 W] at `out` (row stride PANEL) = (start ? 0 : src) + x rows times the
   panel's columns w[0 .. 8 W) (row stride PANEL) over k. */
static inline __attribute__((always_inline)) void strip(
    const float *x, int64_t ldx, const float *w, int64_t k, const float *src, float *out,
    const int R, const int W, int prefetch, const float *pfw, const char *pf,
    int64_t pf_lines, const char *pf_end) {
    __m256 acc[6][8];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < W; j++)
            acc[i][j] = src ? _mm256_loadu_ps(src + i * PANEL + 8 * j) : _mm256_setzero_ps();
#define STEP(kk)                                                                          \
    do {                                                                                  \
        const float *wk = w + (kk) * PANEL;                                               \
        __m256 wv[8];                                                                     \
        for (int j = 0; j < W; j++) wv[j] = _mm256_loadu_ps(wk + 8 * j);                   \
        for (int i = 0; i < R; i++) {                                                     \
            const __m256 xv = _mm256_broadcast_ss(x + i * ldx + (kk));                    \
            for (int j = 0; j < W; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]); \
        }                                                                                 \
    } while (0)
    if (prefetch || pf_lines) {
        for (int64_t kk = 0; kk < k; kk++) {
            if (prefetch)
                for (int j = 0; j < 4; j++)
                    __builtin_prefetch(pfw + (kk + PREFETCH_K) * PANEL + 16 * j, 0, 3);
            for (int64_t c = 0; c < pf_lines; c++) {
                const char *line = pf + (kk * pf_lines + c) * 64;
                if (line < pf_end) __builtin_prefetch(line, 0, 2);
            }
            STEP(kk);
        }
    } else {
        /* The other strips: the loop unrolled, no prefetch tests (the loop overhead and
           the x row pointers' increments cost as much as the FMAs at 4-6 rows). */
        int64_t kk = 0;
        for (; kk + 4 <= k; kk += 4) {
            STEP(kk);
            STEP(kk + 1);
            STEP(kk + 2);
            STEP(kk + 3);
        }
        for (; kk < k; kk++) STEP(kk);
    }
#undef STEP
    for (int i = 0; i < R; i++)
        for (int j = 0; j < W; j++) _mm256_storeu_ps(out + i * PANEL + 8 * j, acc[i][j]);
}

/* Prefill (hundreds of rows): x packed once per call into tiles of TILE_ROWS rows, [k][6]
   each, so a strip's broadcasts read one sequential stream instead of six rows' strided
   ones, as BLAS GEMMs pack their operands (measured on an AVX2 core, 512 rows against
   640 x 2,048 and 2,048 x 640 weights: 71-78 -> 83-88 GFLOP/s, torch's GEMM 85-90). acc
   rows [R][16] at `out` (row stride PANEL) = xp's rows times the panel's 16 columns
   w[0 .. 16) over k. */
static inline __attribute__((always_inline)) void strip_packed(
    const float *xp, const float *w, int64_t k, float *out, const int R, int add) {
    __m256 acc[TILE_ROWS][2];
    for (int i = 0; i < R; i++) {
        acc[i][0] = add ? _mm256_loadu_ps(out + i * PANEL) : _mm256_setzero_ps();
        acc[i][1] = add ? _mm256_loadu_ps(out + i * PANEL + 8) : _mm256_setzero_ps();
    }
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256 w0 = _mm256_loadu_ps(w + kk * PANEL), w1 = _mm256_loadu_ps(w + kk * PANEL + 8);
        for (int i = 0; i < R; i++) {
            const __m256 xv = _mm256_broadcast_ss(xp + kk * TILE_ROWS + i);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < R; i++) {
        _mm256_storeu_ps(out + i * PANEL, acc[i][0]);
        _mm256_storeu_ps(out + i * PANEL + 8, acc[i][1]);
    }
}

/* The sums of `rows` rows [rows][PANEL] plus bias, through the epilogue, into y. */
static inline void finish_rows(const float *sums, int rows, const float *bias, int mode,
                               float *y, int64_t ldy, int64_t cols) {
    for (int i = 0; i < rows; i++) {
        float out[PANEL];
        v16 a[4];
        for (int j = 0; j < 4; j++) {
            a[j] = load16(sums + i * PANEL + 16 * j);
            if (bias != NULL) a[j] += load16(bias + 16 * j);
        }
        if (mode == PLAIN) {
            for (int j = 0; j < 4; j++) store16(out + 16 * j, a[j]);
        } else {
            store16(out, gated16(a[0], a[2], mode));
            store16(out + 16, gated16(a[1], a[3], mode));
        }
        memcpy(y + i * ldy, out, (size_t)cols * sizeof(float));
    }
}

/* `rows` (<= TILE_ROWS) rows of x times one panel, written to y (cols valid columns), or
   their partial sums to `partial` (finish == 0). Strip widths by rows: 1 row takes the
   whole panel (8 vectors), 2-3 rows 32 columns at a time, 4-6 rows 16. The first strip
   issues the prefetches (it walks every K row of the panel, as the others do). */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t ldx, const float *panel, int64_t k, const float *bias, float *y,
    int64_t ldy, int64_t cols, const int rows, int mode, int prefetch, const char *pf,
    int64_t pf_lines, const char *pf_end, float *partial, int start, int finish) {
    float sums[TILE_ROWS * PANEL];
    float *dst = finish ? sums : partial;
    const float *src = start ? NULL : partial;
    const int W = rows == 1 ? 8 : rows <= 3 ? 4 : 2;
    for (int c = 0; c < PANEL; c += 8 * W) {
        const int first = c == 0;
        strip(x, ldx, panel + c, k, src ? src + c : NULL, dst + c, rows, W,
              first && prefetch, panel, pf, first ? pf_lines : 0, pf_end);
    }
    if (!finish) return;
    finish_rows(sums, rows, bias, mode, y, ldy, cols);
}

/* A tile of packed x rows (prefill) times one panel, finished into y. */
static inline __attribute__((always_inline)) void tile_packed(
    const float *xp, const float *panel, int64_t k, const float *bias, float *y, int64_t ldy,
    int64_t cols, const int rows, int mode) {
    float sums[TILE_ROWS * PANEL];
    for (int c = 0; c < PANEL; c += 16) strip_packed(xp, panel + c, k, sums + c, rows, 0);
    finish_rows(sums, rows, bias, mode, y, ldy, cols);
}
#else
/* `rows` (<= TILE_ROWS) rows of x times one panel, written to y (cols valid columns). */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t ldx, const float *panel, int64_t k, const float *bias, float *y,
    int64_t ldy, int64_t cols, const int rows, int mode, int prefetch, const char *pf,
    int64_t pf_lines, const char *pf_end, float *partial, int start, int finish) {
    v16 acc[TILE_ROWS][4];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4; j++)
            acc[i][j] = start ? (v16){0} : load16(partial + i * PANEL + 16 * j);
    for (int64_t kk = 0; kk < k; kk++) {
        const float *w = panel + kk * PANEL;
        if (prefetch)
            for (int j = 0; j < 4; j++) __builtin_prefetch(w + PREFETCH_K * PANEL + 16 * j, 0, 3);
        for (int64_t c = 0; c < pf_lines; c++) {
            const char *line = pf + (kk * pf_lines + c) * 64;
            if (line < pf_end) __builtin_prefetch(line, 0, 2);
        }
        const v16 w0 = load16(w), w1 = load16(w + 16), w2 = load16(w + 32), w3 = load16(w + 48);
#pragma GCC unroll 6
        for (int i = 0; i < rows; i++) {
            const float xv = x[i * ldx + kk];
            acc[i][0] += xv * w0;
            acc[i][1] += xv * w1;
            acc[i][2] += xv * w2;
            acc[i][3] += xv * w3;
        }
    }
    if (!finish) {
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < 4; j++) store16(partial + i * PANEL + 16 * j, acc[i][j]);
        return;
    }
    for (int i = 0; i < rows; i++) {
        if (bias != NULL)
            for (int j = 0; j < 4; j++) acc[i][j] += load16(bias + 16 * j);
        v16 res[4];
        int vectors = 4;
        if (mode == PLAIN) {
            for (int j = 0; j < 4; j++) res[j] = acc[i][j];
        } else {
            res[0] = gated16(acc[i][0], acc[i][2], mode);
            res[1] = gated16(acc[i][1], acc[i][3], mode);
            vectors = 2;
        }
        /* Whole vectors straight into y; a partial last panel's columns through a buffer.
           (A libc memcpy a row from a stack buffer was ~1% of a prefill's time.) */
        float *yi = y + i * ldy;
        if (cols == 16 * vectors) {
            for (int j = 0; j < vectors; j++) store16(yi + 16 * j, res[j]);
        } else {
            float out[PANEL];
            for (int j = 0; j < vectors; j++) store16(out + 16 * j, res[j]);
            memcpy(yi, out, (size_t)cols * sizeof(float));
        }
    }
}

#endif

/* tile() specialised for each row count (the switch picks a fully unrolled body). */
static void tile_rows(int64_t rows, const float *x, int64_t ldx, const float *panel,
                      int64_t k, const float *bias, float *y, int64_t ldy, int64_t cols,
                      int mode, int prefetch, const char *pf, int64_t pf_lines,
                      const char *pf_end, float *partial, int start, int finish) {
#define TILE(R) tile(x, ldx, panel, k, bias, y, ldy, cols, R, mode, prefetch, pf, pf_lines, \
                     pf_end, partial, start, finish)
    switch (rows) {
    case 6: TILE(6); break;
    case 5: TILE(5); break;
    case 4: TILE(4); break;
    case 3: TILE(3); break;
    case 2: TILE(2); break;
    default: TILE(1); break;
    }
#undef TILE
}

/* y[m, n] for rows [r0, r1) and one panel: tiles of TILE_ROWS rows, the first prefetching. */
static void rows_times_panel(const float *x, int64_t ldx, const float *panel, int64_t k,
                             const float *bias, float *y, int64_t ldy, int64_t cols, int64_t r0,
                             int64_t r1, int mode) {
    for (int64_t r = r0; r < r1; r += TILE_ROWS) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        const int first = r == r0;
        tile_rows(r1 - r < TILE_ROWS ? r1 - r : TILE_ROWS, xr, ldx, panel, k, bias, yr, ldy,
                  cols, mode, first, NULL, 0, NULL, NULL, 1, 1);
    }
}

/* A few rows (one row block, at least two tiles) times one panel, K in chunks of K_CHUNK:
   every tile takes a chunk in turn (partial sums kept in `partial`), while the chunk after
   it, the next bytes of this thread's weight stream (panels are contiguous), is prefetched
   a few lines per step of every tile. Memory then streams behind all the arithmetic, not
   only behind the tile that first touches a panel. */
static void few_rows_times_panel(const float *x, int64_t ldx, const float *panel, int64_t k,
                                 const float *bias, float *y, int64_t ldy, int64_t cols,
                                 int64_t m, int mode, const char *stream_end) {
    float partial[ROW_BLOCK * PANEL];
    const int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    for (int64_t k0 = 0; k0 < k; k0 += K_CHUNK) {
        const int64_t kn = k - k0 < K_CHUNK ? k - k0 : K_CHUNK;
        const float *chunk = panel + k0 * PANEL;
        const char *ahead = (const char *)(chunk + kn * PANEL);
        const int64_t lines = K_CHUNK * PANEL * 4 / 64;     /* the next chunk's lines */
        const int64_t share = (lines + tiles - 1) / tiles;  /* ... per tile */
        const int64_t per_k = (share + kn - 1) / kn;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r = t * TILE_ROWS;
            const float *xr = x + r * ldx + k0;
            float *yr = y + r * ldy, *part = partial + r * PANEL;
            const char *pf = ahead + t * share * 64;
            const int start = k0 == 0, finish = k0 + kn == k;
            tile_rows(m - r < TILE_ROWS ? m - r : TILE_ROWS, xr, ldx, chunk, kn, bias, yr, ldy,
                      cols, mode, 0, pf, per_k, stream_end, part, start, finish);
        }
    }
}

#if defined(HAVE_STRIPS)
/* Prefill over a long K (a down projection's 2,048): a whole panel (K x 64 floats, 512 KiB
   there) no longer stays in L2 while every tile passes it, so K is taken K_BLOCK rows of
   the panel (64 KiB) at a time, every tile adding its share into the panel's partial sums
   ([tiles][6][64]), which are finished once the last block is in. Returns -1 when a
   thread's partial sums cannot be allocated (the caller then takes the unblocked path). */
static int blocked_panels(const float *xp, int64_t tiles, int64_t m, const float *packed,
                          int64_t panels, int64_t k, int64_t ps, const float *bias, float *y,
                          int64_t n, int64_t ldy, int64_t width, int mode, int parallel) {
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        float *part = malloc((size_t)(tiles * TILE_ROWS * PANEL) * sizeof(float));
        if (part == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            if (failed) continue;
            const float *panel = packed + p * ps;
            for (int64_t k0 = 0; k0 < k; k0 += K_BLOCK) {
                const int64_t kn = k - k0 < K_BLOCK ? k - k0 : K_BLOCK;
                for (int64_t t = 0; t < tiles; t++) {
                    const int rows = m - t * TILE_ROWS < TILE_ROWS ? (int)(m - t * TILE_ROWS)
                                                                   : TILE_ROWS;
                    const float *xt = xp + t * k * TILE_ROWS + k0 * TILE_ROWS;
                    float *pt = part + t * TILE_ROWS * PANEL;
                    for (int c = 0; c < PANEL; c += 16) {
                        switch (rows) {
#define SP(R) case R: strip_packed(xt, panel + k0 * PANEL + c, kn, pt + c, R, k0 > 0); break;
                        SP(1) SP(2) SP(3) SP(4) SP(5) SP(6)
#undef SP
                        }
                    }
                }
            }
            const int64_t cols = n - p * width < width ? n - p * width : width;
            for (int64_t t = 0; t < tiles; t++) {
                const int rows = m - t * TILE_ROWS < TILE_ROWS ? (int)(m - t * TILE_ROWS)
                                                               : TILE_ROWS;
                finish_rows(part + t * TILE_ROWS * PANEL, rows,
                            bias == NULL ? NULL : bias + p * PANEL, mode,
                            y + t * TILE_ROWS * ldy + p * width, ldy, cols);
            }
        }
        free(part);
    }
    return failed ? -1 : 0;
}
#endif

/* y [m, n] (row stride ldy) = epilogue(x [m, k] (row stride ldx) times the packed weights
   [panels, k, 64] + bias [panels * 64] or NULL). n: output columns (the intermediate size
   for a gated mode, whose panels give 32 outputs each). */
void hkv_linear_f32(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t k,
                    const float *bias, float *y, int64_t n, int64_t ldy, int mode) {
    const int64_t ps = k * PANEL; /* floats from one panel to the next */
    const int64_t width = mode == PLAIN ? PANEL : PANEL / 2;
    const int64_t panels = (n + width - 1) / width;
    const int64_t blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
    /* A thread team costs a few microseconds: not worth it for a tiny model's projections. */
    const int parallel = m * n * k >= (1 << 18);
#if defined(HAVE_STRIPS)
    if (m >= PACKED_X_ROWS) {
        const int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
        float *xp = malloc((size_t)(tiles * k * TILE_ROWS) * sizeof(float));
        if (xp != NULL) {
            for (int64_t t = 0; t < tiles; t++)
                for (int i = 0; i < TILE_ROWS; i++) {
                    const int64_t r = t * TILE_ROWS + i;
                    float *dst = xp + t * k * TILE_ROWS + i;
                    for (int64_t kk = 0; kk < k; kk++)
                        dst[kk * TILE_ROWS] = r < m ? x[r * ldx + kk] : 0.f;
                }
            if (k >= K_BLOCKED && blocked_panels(xp, tiles, m, packed, panels, k, ps, bias, y,
                                                 n, ldy, width, mode, parallel) == 0) {
                free(xp);
                return;
            }
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
            for (int64_t p = 0; p < panels; p++)
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t cols = n - p * width < width ? n - p * width : width;
                    const int rows = m - t * TILE_ROWS < TILE_ROWS ? (int)(m - t * TILE_ROWS)
                                                                   : TILE_ROWS;
                    const float *panel = packed + p * ps;
                    const float *b = bias == NULL ? NULL : bias + p * PANEL;
                    float *yt = y + t * TILE_ROWS * ldy + p * width;
                    const float *xt = xp + t * k * TILE_ROWS;
                    switch (rows) {
#define TP(R) case R: tile_packed(xt, panel, k, b, yt, ldy, cols, R, mode); break;
                    TP(1) TP(2) TP(3) TP(4) TP(5) TP(6)
#undef TP
                    }
                }
            free(xp);
            return;
        }
    }
#endif
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t cols = n - p * width < width ? n - p * width : width;
            const int64_t r1 = (b + 1) * ROW_BLOCK < m ? (b + 1) * ROW_BLOCK : m;
            if (blocks == 1 && m >= 2 * TILE_ROWS)
                few_rows_times_panel(x, ldx, packed + p * ps, k,
                                     bias == NULL ? NULL : bias + p * PANEL, y + p * width,
                                     ldy, cols, m, mode,
                                     (const char *)(packed + (panels - 1) * ps + k * PANEL));
            else
                rows_times_panel(x, ldx, packed + p * ps, k,
                                 bias == NULL ? NULL : bias + p * PANEL, y + p * width, ldy,
                                 cols, b * ROW_BLOCK, r1, mode);
        }
}

/* The first key position a query at `pos` sees (keys from k_start on are at hand). */
static inline int64_t first_seen(int64_t pos, int64_t k_start, int64_t window, int64_t chunk) {
    int64_t lo = k_start;
    if (window > 0 && pos - window + 1 > lo) lo = pos - window + 1;
    if (chunk > 0 && pos / chunk * chunk > lo) lo = pos / chunk * chunk;
    return lo;
}

/* Attention of one KV head's query rows over its keys, float32, each query over the keys
   at its own position and before, back to its window's or chunk's start:
     q         [nq * G, D] rows, row stride D, position-major (row r is the query at position
               q_start + r / G: the G query heads sharing this KV head), the softmax scale
               already applied;
     k_panels  [ceil(lk / 64), D, 64]: keys at positions k_start .. k_start + lk - 1 as the
               panels `pack` makes of K [lk, D] (every query's position is among them);
     v_panels  [ceil(Dv / 64), lv >= lk, 64]: V^T's panels (V[t, 64 p + c] at [p][t][c]);
     window    a sliding window (a query sees the `window` positions up to its own), or 0;
     chunk     chunked attention's chunk (a query sees its chunk's positions up to its
               own), or 0;
     out       [nq * G, Dv] rows, row stride ldo.
   Each tile of TILE_ROWS query rows takes its scores over the key panels its rows can see
   (the products above), a softmax over each row's own range in place (the tile's other
   keys get weight 0), then the values weighted over exactly the tile's range: the causal
   half (or the window's band) is computed, not the square, and no [nq, lk] scores are
   written. Returns -1 when a thread's scratch row cannot be allocated (out is then
   incomplete), else 0. */
int hkv_attention_f32(const float *q, int64_t nq, int64_t G, int64_t D, int64_t q_start,
                      int64_t k_start, int64_t lk, int64_t window, int64_t chunk,
                      const float *k_panels, const float *v_panels, int64_t lv, int64_t dv,
                      float *out, int64_t ldo) {
    const int64_t rows = nq * G, tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t width = (lk + PANEL - 1) / PANEL * PANEL; /* a score row, whole panels */
    const int64_t span = window > 0 && window < lk ? window : lk; /* keys a row can see */
    const int parallel = rows * span * D >= (1 << 20);
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        float *s = malloc((size_t)(TILE_ROWS * width) * sizeof(float));
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        /* Cyclic: later tiles may see more keys, so interleaving them evens the work. */
#pragma omp for schedule(static, 1)
        for (int64_t t = 0; t < tiles; t++) {
            if (failed) continue;
            const int64_t r0 = t * TILE_ROWS;
            const int64_t n = rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS;
            /* Key indices [lo, hi) that some row of the tile sees (lo never falls as the
               position rises, so the first row has the tile's lowest). */
            const int64_t lo = first_seen(q_start + r0 / G, k_start, window, chunk) - k_start;
            const int64_t hi = q_start + (r0 + n - 1) / G + 1 - k_start;
            for (int64_t p = lo / PANEL; p * PANEL < hi; p++)
                tile_rows(n, q + r0 * D, D, k_panels + p * D * PANEL, D, NULL, s + p * PANEL,
                          width, PANEL, PLAIN, 0, NULL, 0, NULL, NULL, 1, 1);
            for (int64_t i = 0; i < n; i++) {
                float *row = s + i * width;
                const int64_t pos = q_start + (r0 + i) / G;
                const int64_t a = first_seen(pos, k_start, window, chunk) - k_start;
                const int64_t b = pos + 1 - k_start;
                float mx = row[a];
#pragma omp simd reduction(max : mx)
                for (int64_t j = a + 1; j < b; j++) mx = row[j] > mx ? row[j] : mx;
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = a; j < b; j++) {
                    row[j] = exp_nonpositive(row[j] - mx);
                    sum += row[j];
                }
                const float inv = 1.f / sum;
#pragma omp simd
                for (int64_t j = a; j < b; j++) row[j] *= inv;
                for (int64_t j = lo; j < a; j++) row[j] = 0.f;
                for (int64_t j = b; j < hi; j++) row[j] = 0.f;
            }
            for (int64_t p = 0; p * PANEL < dv; p++)
                tile_rows(n, s + lo, width, v_panels + (p * lv + lo) * PANEL, hi - lo, NULL,
                          out + r0 * ldo + p * PANEL, ldo,
                          dv - p * PANEL < PANEL ? dv - p * PANEL : PANEL, PLAIN, 0, NULL, 0,
                          NULL, NULL, 1, 1);
        }
        free(s);
    }
    return failed ? -1 : 0;
}
