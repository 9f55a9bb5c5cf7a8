/* Float32 linear layers on the CPU: y = x @ w.T (+ b), batch-invariant by construction.
 *
 * Every output y[r, n] is one fused multiply-add chain over k = 0, 1, ..., K - 1, started from
 * zero, with the bias (if any) added after the last term. Which rows share a call, how many
 * there are, which register tile or thread computes a row: none of it changes that chain, so a
 * row's bits depend only on the row and the weight (prefill chunking and decode batching give
 * equal results without padding calls or running them in fixed slabs).
 *
 * The weight is packed once into panels of 16 output features: panel p holds w[16p + j][k] at
 * packed[(p * K + k) * 16 + j], features past N zero. Register tiles are MR rows x NP panels
 * (one broadcast of x per row and k, one or two vector loads per panel and k); small calls
 * (decode) take wide tiles so a single row still streams several panels at once, large calls
 * (prefill) 6- or 12-row tiles that reuse each panel from cache for a block of rows.
 *
 * Threads split the panels; rows are taken in blocks of ROW_BLOCK so a block of x stays in the
 * core's cache while the panels stream past it.
 */
#include <stdint.h>
#include <string.h>

#if defined(__FMA__) && (defined(__AVX2__) || defined(__AVX512F__))
#include <immintrin.h>

#define PANEL 16 /* output features per panel */

#ifdef __AVX512F__
typedef __m512 vec;
#define PV 1 /* vectors per panel row */
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VBCAST(p) _mm512_set1_ps(*(p))
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define MAX_MR 12
#else
typedef __m256 vec;
#define PV 2
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VBCAST(p) _mm256_broadcast_ss(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define MAX_MR 6
#endif
#define VLANES (PANEL / PV)
#define ROW_BLOCK 96
#ifndef K_BLOCK
#define K_BLOCK 384 /* terms per pass over a panel: a panel chunk stays in L1 */
#endif

/* rows [0, MR) of x against panels [0, NP) of `packed`, terms k0 .. k1 - 1 of each output's
 * chain: started from zero (k0 == 0) or from the partial sums in `part` (row stride ldp,
 * padded to whole panels); left in `part` unless k1 == k, when they go to y (outputs of
 * features >= n dropped) plus the bias. */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t ldx, const float *packed, int k, int k0, int k1, const float *bias,
    float *y, int64_t ldy, float *part, int64_t ldp, int n0, int n, const int MR, const int NP) {
    vec acc[MAX_MR][4 * PV];
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NP * PV; v++)
            acc[r][v] = k0 == 0 ? VZERO() : VLOAD(part + r * ldp + n0 + v * VLANES);
    const int64_t pstride = (int64_t)k * PANEL;
    for (int kk = k0; kk < k1; kk++) {
        vec w[4 * PV];
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++)
#pragma GCC unroll 2
            for (int v = 0; v < PV; v++)
                w[p * PV + v] = VLOAD(packed + p * pstride + (int64_t)kk * PANEL + v * VLANES);
        /* tiles of many rows, which compute longer than their panels take to read, fetch
         * the next panels' line for this k (a thread's panels are consecutive), so the
         * weight streams from memory while they compute; tiles of a few rows stream at the
         * memory's pace and are left to the hardware prefetcher */
        if (MR >= 4)
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++)
                __builtin_prefetch(packed + (p + NP) * pstride + (int64_t)kk * PANEL);
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++) {
            vec xr = VBCAST(x + r * ldx + kk);
#pragma GCC unroll 8
            for (int v = 0; v < NP * PV; v++) acc[r][v] = VFMA(xr, w[v], acc[r][v]);
        }
    }
    if (k1 < k) {
#pragma GCC unroll 12
        for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
            for (int v = 0; v < NP * PV; v++) VSTORE(part + r * ldp + n0 + v * VLANES, acc[r][v]);
        return;
    }
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++) {
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++) {
            float out[PANEL];
#pragma GCC unroll 2
            for (int v = 0; v < PV; v++) VSTORE(out + v * VLANES, acc[r][p * PV + v]);
            int f0 = n0 + p * PANEL;
            int cnt = n - f0 < PANEL ? n - f0 : PANEL;
            float *dst = y + r * ldy + f0;
            if (bias)
                for (int j = 0; j < cnt; j++) dst[j] = out[j] + bias[f0 + j];
            else
                memcpy(dst, out, sizeof(float) * (cnt > 0 ? cnt : 0));
        }
    }
}

typedef void (*tile_fn)(const float *, int64_t, const float *, int, int, int, const float *,
                        float *, int64_t, float *, int64_t, int, int);

#define TILE(MR, NP)                                                                          \
    static void tile_##MR##_##NP(const float *x, int64_t ldx, const float *packed, int k,    \
                                 int k0, int k1, const float *bias, float *y, int64_t ldy,   \
                                 float *part, int64_t ldp, int n0, int n) {                  \
        tile(x, ldx, packed, k, k0, k1, bias, y, ldy, part, ldp, n0, n, MR, NP);             \
    }
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1)
TILE(1, 4) TILE(2, 3) TILE(3, 2)
#ifdef __AVX512F__
TILE(7, 1) TILE(8, 1) TILE(9, 1) TILE(10, 1) TILE(11, 1) TILE(12, 1)
TILE(4, 2) TILE(5, 2) TILE(6, 2)
#endif

/* the tiles for `rows` rows (1 .. MAX_MR): the widest one's panel count, it, and one panel */
static void pick(int rows, int *np, tile_fn *wide, tile_fn *narrow) {
    static const tile_fn one[] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1
#ifdef __AVX512F__
                                  , tile_7_1, tile_8_1, tile_9_1, tile_10_1, tile_11_1, tile_12_1
#endif
    };
    *narrow = one[rows];
    *np = 1;
    *wide = one[rows];
    switch (rows) {
    case 1: *np = 4; *wide = tile_1_4; break;
    case 2: *np = 3; *wide = tile_2_3; break;
    case 3: *np = 2; *wide = tile_3_2; break;
#ifdef __AVX512F__
    case 4: *np = 2; *wide = tile_4_2; break;
    case 5: *np = 2; *wide = tile_5_2; break;
    case 6: *np = 2; *wide = tile_6_2; break;
#endif
    default: break;
    }
}

int docqa_linear_f32_panel(void) { return PANEL; }

/* y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ w.T + bias, w packed as above;
 * `part` is scratch of ROW_BLOCK x (panels * 16) floats, used when k > K_BLOCK (else NULL is
 * fine). Returns 0, or -1 for bad sizes. */
int docqa_linear_f32(const float *x, int m, int64_t ldx, const float *packed, int n, int k,
                     const float *bias, float *y, int64_t ldy, float *part, int num_threads) {
    if (m < 0 || n <= 0 || k <= 0 || ldx < k || ldy < n) return -1;
    if (m == 0) return 0;
    const int panels = (n + PANEL - 1) / PANEL;
    const int64_t pstride = (int64_t)k * PANEL;
    const int64_t ldp = (int64_t)panels * PANEL;
    const int chunks = (k + K_BLOCK - 1) / K_BLOCK;
    if (chunks > 1 && part == NULL) return -1;
    const int kc = (k + chunks - 1) / chunks;
    for (int r0 = 0; r0 < m; r0 += ROW_BLOCK) {
        const int rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
        /* the block's tiles: full MAX_MR-row tiles, then one of the rest */
        const int full = rows / MAX_MR, rest = rows % MAX_MR;
        int np_full = 1, np_rest = 1;
        tile_fn wide_full = 0, narrow_full = 0, wide_rest = 0, narrow_rest = 0;
        if (full) pick(MAX_MR, &np_full, &wide_full, &narrow_full);
        if (rest) pick(rest, &np_rest, &wide_rest, &narrow_rest);
        /* a work item is a group of panels as wide as the widest tile used */
        const int group = full ? np_full : np_rest;
        const int groups = (panels + group - 1) / group;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
        for (int g = 0; g < groups; g++) {
            const int p0 = g * group;
            const int pn = panels - p0 < group ? panels - p0 : group;
            for (int k0 = 0; k0 < k; k0 += kc) {
                const int k1 = k - k0 < kc ? k : k0 + kc;
                for (int t = 0; t <= full; t++) {
                    const int rr = t < full ? MAX_MR : rest;
                    if (rr == 0) continue;
                    const int np = t < full ? np_full : np_rest;
                    tile_fn wide = t < full ? wide_full : wide_rest;
                    tile_fn narrow = t < full ? narrow_full : narrow_rest;
                    const int row = r0 + t * MAX_MR;
                    const float *xr = x + (int64_t)row * ldx;
                    float *yr = y + (int64_t)row * ldy;
                    float *pr = part ? part + (int64_t)(t * MAX_MR) * ldp : NULL;
                    int p = p0;
                    for (; p + np <= p0 + pn; p += np)
                        wide(xr, ldx, packed + p * pstride, k, k0, k1, bias, yr, ldy, pr, ldp,
                             p * PANEL, n);
                    for (; p < p0 + pn; p++)
                        narrow(xr, ldx, packed + p * pstride, k, k0, k1, bias, yr, ldy, pr, ldp,
                               p * PANEL, n);
                }
            }
        }
    }
    return 0;
}

#else /* no FMA vectors: the caller uses its torch path */

int docqa_linear_f32_panel(void) { return 0; }

int docqa_linear_f32(const float *x, int m, int64_t ldx, const float *packed, int n, int k,
                     const float *bias, float *y, int64_t ldy, float *part, int num_threads) {
    (void)x; (void)m; (void)ldx; (void)packed; (void)n; (void)k; (void)bias; (void)y;
    (void)ldy; (void)part; (void)num_threads;
    return -1;
}

#endif
