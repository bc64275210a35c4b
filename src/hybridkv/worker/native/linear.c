/* Linear layers on the CPU, float32: y = x W^T + b, and a gated MLP's act(x G^T) * (x U^T)
   as one pass over its weights.

   At decode a step is a few dozen rows, so a linear layer is bound by streaming its weights
   from memory: each weight is read once and used for every row. The weights are packed once
   into panels of 64 output columns, [panels, K, 64] (worker/cpu_linear.py packs them), so a
   panel is one forward stream; a register tile of 6 rows x 64 columns (24 accumulators)
   walks down it, with the panel's next lines prefetched on the tile that brings it in. The
   other tiles of the same rows re-read the panel from L2. At prefill (hundreds of rows) the
   same tiles are compute-bound and run at about the GEMM library's speed.

   A gated panel holds 32 gate columns then the 32 up columns of the same outputs, so the
   activation and the product are applied in registers and the [rows, 2 x intermediate]
   pre-activations are never written.

   Work items (a panel x a block of rows) are split over torch's OpenMP threads. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define PANEL 64     /* output columns per panel: four 16-float vectors */
#define TILE_ROWS 6  /* 6 x 4 accumulators + 4 weight vectors of the 32 registers */
#define ROW_BLOCK 96 /* rows per work item: its x rows stay in L2 while a panel passes */
#define PREFETCH_K 8 /* how many rows of the panel (256 bytes each) ahead to fetch */

/* Epilogues: plain, or one of the gated MLP's activations of the gate times the up. */
enum { PLAIN = 0, GATED_SILU = 1, GATED_GELU_TANH = 2, GATED_RELU = 3 };

/* act(g) * u over 16 lanes, each lane's exp through exp_nonpositive (vectorises). */
static inline v16 gated16(v16 g, v16 u, int mode) {
    float gs[16], us[16], out[16];
    store16(gs, g);
    store16(us, u);
    for (int l = 0; l < 16; l++) {
        const float x = gs[l];
        float a;
        if (mode == GATED_SILU) { /* x * sigmoid(x), from exp(-|x|) so nothing overflows */
            const float e = exp_nonpositive(-fabsf(x));
            a = x * (x >= 0.f ? 1.f : e) / (1.f + e);
        } else if (mode == GATED_GELU_TANH) { /* x/2 (1 + tanh(sqrt(2/pi)(x + 0.044715x^3))) */
            const float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
            const float e = exp_nonpositive(-2.f * fabsf(z));
            const float t = (1.f - e) / (1.f + e);
            a = 0.5f * x * (1.f + (z >= 0.f ? t : -t));
        } else {
            a = x > 0.f ? x : 0.f;
        }
        out[l] = a * us[l];
    }
    return load16(out);
}

/* `rows` (<= TILE_ROWS) rows of x times one panel, written to y (cols valid columns). */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t ldx, const float *panel, int64_t k, const float *bias, float *y,
    int64_t ldy, int64_t cols, const int rows, int mode, int prefetch) {
    v16 acc[TILE_ROWS][4];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = (v16){0};
    for (int64_t kk = 0; kk < k; kk++) {
        const float *w = panel + kk * PANEL;
        if (prefetch)
            for (int j = 0; j < 4; j++) __builtin_prefetch(w + PREFETCH_K * PANEL + 16 * j, 0, 3);
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
    for (int i = 0; i < rows; i++) {
        float out[PANEL];
        if (bias != NULL)
            for (int j = 0; j < 4; j++) acc[i][j] += load16(bias + 16 * j);
        if (mode == PLAIN) {
            for (int j = 0; j < 4; j++) store16(out + 16 * j, acc[i][j]);
        } else {
            store16(out, gated16(acc[i][0], acc[i][2], mode));
            store16(out + 16, gated16(acc[i][1], acc[i][3], mode));
        }
        memcpy(y + i * ldy, out, (size_t)cols * sizeof(float));
    }
}

/* y[m, n] for rows [r0, r1) and one panel: tiles of TILE_ROWS rows, the first prefetching. */
static void rows_times_panel(const float *x, int64_t ldx, const float *panel, int64_t k,
                             const float *bias, float *y, int64_t ldy, int64_t cols, int64_t r0,
                             int64_t r1, int mode) {
    for (int64_t r = r0; r < r1; r += TILE_ROWS) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        const int first = r == r0;
        switch (r1 - r < TILE_ROWS ? r1 - r : TILE_ROWS) {
        case 6: tile(xr, ldx, panel, k, bias, yr, ldy, cols, 6, mode, first); break;
        case 5: tile(xr, ldx, panel, k, bias, yr, ldy, cols, 5, mode, first); break;
        case 4: tile(xr, ldx, panel, k, bias, yr, ldy, cols, 4, mode, first); break;
        case 3: tile(xr, ldx, panel, k, bias, yr, ldy, cols, 3, mode, first); break;
        case 2: tile(xr, ldx, panel, k, bias, yr, ldy, cols, 2, mode, first); break;
        default: tile(xr, ldx, panel, k, bias, yr, ldy, cols, 1, mode, first); break;
        }
    }
}

/* y [m, n] (row stride ldy) = epilogue(x [m, k] (row stride ldx) times the packed weights
   [panels, k, 64] + bias [panels * 64] or NULL). n: output columns (the intermediate size
   for a gated mode, whose panels give 32 outputs each). */
void hkv_linear_f32(const float *x, int64_t m, int64_t ldx, const float *packed, int64_t k,
                    const float *bias, float *y, int64_t n, int64_t ldy, int mode) {
    const int64_t width = mode == PLAIN ? PANEL : PANEL / 2;
    const int64_t panels = (n + width - 1) / width;
    const int64_t blocks = (m + ROW_BLOCK - 1) / ROW_BLOCK;
    /* A thread team costs a few microseconds: not worth it for a tiny model's projections. */
    const int parallel = m * n * k >= (1 << 18);
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t cols = n - p * width < width ? n - p * width : width;
            const int64_t r1 = (b + 1) * ROW_BLOCK < m ? (b + 1) * ROW_BLOCK : m;
            rows_times_panel(x, ldx, packed + p * k * PANEL, k,
                             bias == NULL ? NULL : bias + p * PANEL, y + p * width, ldy, cols,
                             b * ROW_BLOCK, r1, mode);
        }
}
