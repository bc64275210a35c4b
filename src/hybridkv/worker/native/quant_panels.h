/* 8-bit activations against K-quant weights, many x rows at once: quant.c's int_matmul
   takes this path from PANEL_MIN_ROWS x rows (included there, inside its AVX2 part).

   int_row streams one weight row against at most four x rows, so a 512-token prompt
   decodes every weight row 128 times and spends two byte-product instructions per 32
   values and x row. Here a panel of PANEL weight rows is decoded once per chunk of x
   rows into the layout of the byte dot product (VNNI's dpbusd, or maddubs + madd): for
   each 4 values of a block, the PANEL rows' 4 codes side by side, so one 32-byte vector
   holds 4 values of 8 rows and a 4-byte broadcast of x meets all 8 at once. Each lane
   is then one output, and every output takes exactly the arithmetic of int_row's
   K-quant code: per block the exact integer sum T (sub-block byte dots times their
   integer scales, in int32), then k_group's float order (quant.c). So a row's result is the same bytes from either kernel, at any number of
   rows and threads. */

#ifndef PANEL_MIN_ROWS
#define PANEL_MIN_ROWS 8
#endif
#ifndef PANEL_X_CHUNK
#define PANEL_X_CHUNK 64 /* x rows per pass over a decoded panel (x's bytes stay cached) */
#endif
#define PANEL 8 /* weight rows per panel: one 32-bit lane each */
#define PANEL_NX 4 /* x rows per tile */

/* One 256-value block of a panel: codes[g][r][j] is value 4 g + j of row r (unsigned:
   0..31 for Q4_K/Q5_K, 0..63 for Q6_K, whose 32 comes back through x's byte sums), sc the
   integer scales per sub-block (8 of 32 values, or Q6_K's 16 of 16), mn dmin times the
   mins, dw the rows' scales. */
typedef struct {
    uint8_t codes[64][PANEL][4];
    int32_t sc[16][PANEL];
    float mn[8][PANEL];
    float dw[PANEL];
} panel_block;

/* rows[r] (32 bytes each: 8 groups of 4 codes) -> out[g] = group g of rows 0..7. */
static inline void transpose8x8_epi32(const __m256i *a, __m256i *out) {
    __m256i t[8], u[8];
    for (int r = 0; r < 8; r += 2) {
        t[r] = _mm256_unpacklo_epi32(a[r], a[r + 1]);
        t[r + 1] = _mm256_unpackhi_epi32(a[r], a[r + 1]);
    }
    for (int h = 0; h < 8; h += 4) {
        u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
        u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
        u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
        u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    for (int g = 0; g < 4; g++) {
        out[g] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x20);
        out[g + 4] = _mm256_permute2x128_si256(u[g], u[g + 4], 0x31);
    }
}

/* Block kb of the n (<= PANEL) weight rows at w (stride ldw) into *o; rows past n are
   zeros (their lanes are computed and dropped). */
static void panel_decode(int type, const uint8_t *w, int64_t ldw, int n, int64_t kb,
                         panel_block *o) {
    const int64_t size = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
    const uint8_t *p[PANEL];
    for (int r = 0; r < PANEL; r++) p[r] = r < n ? w + r * ldw + kb * size : NULL;
    __m256i v[8][PANEL]; /* v[s][r]: sub-block s's 32 codes of row r */
    for (int r = 0; r < PANEL; r++) {
        if (p[r] == NULL) {
            for (int s = 0; s < 8; s++) v[s][r] = _mm256_setzero_si256();
            for (int s = 0; s < 16; s++) o->sc[s][r] = 0;
            for (int s = 0; s < 8; s++) o->mn[s][r] = 0.f;
            o->dw[r] = 0.f;
            continue;
        }
        if (type == T_Q6_K) {
            const uint8_t *ql = p[r], *qh = p[r] + 128;
            for (int h = 0; h < 2; h++) {
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
                for (int s = 0; s < 4; s++) v[4 * h + s][r] = q6k_codes(ql, hb, h, s);
            }
            const int8_t *scs = (const int8_t *)(p[r] + 192);
            for (int s = 0; s < 16; s++) o->sc[s][r] = scs[s];
            for (int s = 0; s < 8; s++) o->mn[s][r] = 0.f;
            o->dw[r] = half_to_float(rd16(p[r] + 208));
        } else {
            const int five = type == T_Q5_K;
            const uint8_t *q = p[r] + (five ? 48 : 16);
            const __m256i hv = five ? _mm256_loadu_si256((const __m256i *)(p[r] + 16))
                                    : _mm256_setzero_si256();
            for (int s = 0; s < 8; s += 2)
                k_subblock_codes(_mm256_loadu_si256((const __m256i *)(q + 16 * s)), hv, s, five,
                                 &v[s][r], &v[s + 1][r]);
            uint8_t scs[8], mns[8];
            scales_mins_k4(p[r] + 4, scs, mns);
            const float dmin = half_to_float(rd16(p[r] + 2));
            for (int s = 0; s < 8; s++) {
                o->sc[s][r] = scs[s];
                o->mn[s][r] = dmin * (float)mns[s]; /* int_row's mv, lane s */
            }
            o->dw[r] = half_to_float(rd16(p[r]));
        }
    }
    for (int s = 0; s < 8; s++) transpose8x8_epi32(v[s], (__m256i *)o->codes[8 * s]);
}

/* The panel's NX x rows (xq, stride cols; xd, xs per 32 values, stride nb; Q6_K's x byte
   sums per 16, bs, stride cols / 16) -> y[i][0..n) (stride ldy). */
static inline __attribute__((always_inline)) void panel_tile(
    const int q6, const panel_block *pb, int64_t nkb, const int8_t *xq, int64_t cols,
    const float *xd, const float *xs, const int16_t *bs, int64_t nb, float *y, int64_t ldy,
    int n, const int NX) {
    /* k_group's partial sums, each lane one output: A[kb % 8], M[sub-block] */
    __m256 A[8][PANEL_NX], M[8][PANEL_NX];
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < NX; i++) A[j][i] = M[j][i] = _mm256_setzero_ps();
    for (int64_t kb = 0; kb < nkb; kb++) {
        const panel_block *B = pb + kb;
        const int8_t *xk = xq + 256 * kb;
        __m256i T[PANEL_NX];
        for (int i = 0; i < NX; i++) T[i] = _mm256_setzero_si256();
        /* sub-blocks of `span` values (32, Q6_K's 16), span / 4 groups each */
        const int span = q6 ? 16 : 32, nsub = 256 / span;
        for (int s = 0; s < nsub; s++) {
            __m256i S[PANEL_NX];
            for (int i = 0; i < NX; i++) S[i] = _mm256_setzero_si256();
            for (int g = 0; g < span / 4; g++) {
                const __m256i W = _mm256_loadu_si256((const __m256i *)B->codes[s * span / 4 + g]);
                for (int i = 0; i < NX; i++) {
                    const __m256i X = _mm256_set1_epi32((int)rd32(
                        (const uint8_t *)(xk + i * cols + s * span + 4 * g)));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                    S[i] = _mm256_dpbusd_epi32(S[i], W, X);
#elif defined(__AVXVNNI__)
                    S[i] = _mm256_dpbusd_avx_epi32(S[i], W, X);
#else
                    S[i] = _mm256_add_epi32(S[i], dot_u8s8(W, X));
#endif
                }
            }
            const __m256i sc = _mm256_loadu_si256((const __m256i *)B->sc[s]);
            for (int i = 0; i < NX; i++) {
                __m256i t = S[i];
                if (q6) /* the codes' 32: 32 x's byte sum of these 16 */
                    t = _mm256_sub_epi32(
                        t, _mm256_set1_epi32(32 * (int)bs[i * (cols / 16) + 16 * kb + s]));
                T[i] = _mm256_add_epi32(T[i], _mm256_mullo_epi32(t, sc));
            }
        }
        const __m256 dw = _mm256_loadu_ps(B->dw);
        const int j = (int)(kb & 7);
        for (int i = 0; i < NX; i++) {
            const int64_t b = 8 * kb; /* x's 32-value block; its scale holds for 256 */
            A[j][i] = _mm256_fmadd_ps(_mm256_set1_ps(xd[i * nb + b]),
                                      _mm256_mul_ps(dw, _mm256_cvtepi32_ps(T[i])), A[j][i]);
            if (!q6) {
                const float *xsb = xs + i * nb + b;
                for (int s = 0; s < 8; s++)
                    M[s][i] = _mm256_fmadd_ps(_mm256_loadu_ps(B->mn[s]), _mm256_set1_ps(xsb[s]),
                                              M[s][i]);
            }
        }
    }
    for (int i = 0; i < NX; i++) {
        /* tree8's order, lane by lane */
#define TREE8(P)                                                                          \
    _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(P[0][i], P[4][i]), _mm256_add_ps(P[2][i], P[6][i])), \
                  _mm256_add_ps(_mm256_add_ps(P[1][i], P[5][i]), _mm256_add_ps(P[3][i], P[7][i])))
        float t[PANEL];
        _mm256_storeu_ps(t, _mm256_sub_ps(TREE8(A), TREE8(M)));
#undef TREE8
        for (int r = 0; r < n; r++) y[i * ldy + r] = t[r];
    }
}

/* y [m, rows] = x W^T for a K-quant W through panels, x as int_matmul quantized it. */
static void panel_matmul(int type, const int8_t *xq, const float *xd, const float *xs,
                         const int16_t *bs, int64_t m, const uint8_t *w, int64_t ldw,
                         int64_t rows, int64_t cols, float *y, int64_t ldy, int parallel,
                         int *failed) {
    const int64_t nb = cols / 32, nkb = cols / 256, npanels = (rows + PANEL - 1) / PANEL;
#pragma omp parallel if (parallel)
    {
        panel_block *pb = aligned_alloc(64, ((size_t)nkb * sizeof(panel_block) + 63) & ~(size_t)63);
        if (pb == NULL) {
#pragma omp atomic write
            *failed = 1;
        }
        for (int64_t i0 = 0; i0 < m; i0 += PANEL_X_CHUNK) {
            const int64_t i1 = m - i0 < PANEL_X_CHUNK ? m : i0 + PANEL_X_CHUNK;
#pragma omp for schedule(static) nowait
            for (int64_t pn = 0; pn < npanels; pn++) {
                if (pb == NULL) continue;
                const int64_t r0 = pn * PANEL;
                const int n = rows - r0 < PANEL ? (int)(rows - r0) : PANEL;
                for (int64_t kb = 0; kb < nkb; kb++)
                    panel_decode(type, w + r0 * ldw, ldw, n, kb, pb + kb);
                for (int64_t i = i0; i < i1; i += PANEL_NX) {
                    const int nx = i1 - i < PANEL_NX ? (int)(i1 - i) : PANEL_NX;
                    const int8_t *qi = xq + i * cols;
                    const float *di = xd + i * nb, *si = xs + i * nb;
                    const int16_t *bi = bs + i * (cols / 16);
                    float *yi = y + i * ldy + r0;
#define PANEL_TILE(Q6, NXV) panel_tile(Q6, pb, nkb, qi, cols, di, si, bi, nb, yi, ldy, n, NXV)
                    if (type == T_Q6_K)
                        switch (nx) {
                        case 4: PANEL_TILE(1, 4); break;
                        case 3: PANEL_TILE(1, 3); break;
                        case 2: PANEL_TILE(1, 2); break;
                        default: PANEL_TILE(1, 1); break;
                        }
                    else
                        switch (nx) {
                        case 4: PANEL_TILE(0, 4); break;
                        case 3: PANEL_TILE(0, 3); break;
                        case 2: PANEL_TILE(0, 2); break;
                        default: PANEL_TILE(0, 1); break;
                        }
#undef PANEL_TILE
                }
            }
        }
        free(pb);
    }
}
