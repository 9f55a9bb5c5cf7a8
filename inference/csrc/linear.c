/* Float32 and bf16 linear layers on the CPU: y = x @ w.T (+ b), batch-invariant by
 * construction.
 *
 * Every output y[r, n] is one fused multiply-add chain over k = 0, 1, ..., K - 1, started from
 * zero, with the bias (if any) added after the last term. In bf16 (AVX512-BF16) the chain's
 * terms are pairs of inputs: vdpbf16ps adds x[2k'] w[2k'] and x[2k' + 1] w[2k' + 1] to a
 * float32 sum, k' = 0 .. K/2 - 1 in order; the sum plus the float32 bias is rounded once to
 * bf16 (nearest even). Which rows share a call, how many
 * there are, which register tile or thread computes a row: none of it changes that chain, so a
 * row's bits depend only on the row and the weight (prefill chunking and decode batching give
 * equal results without padding calls or running them in fixed slabs).
 *
 * The weight is packed once into panels of 16 output features: panel p holds w[16p + j][k] at
 * packed[(p * K + k) * 16 + j], features past N zero (in bf16, k counts pairs of inputs and a
 * packed element is the pair as 32 bits, the even input in the low half). Register tiles are MR rows x NP panels
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
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16 1
/* acc + x pair . w pair for each lane: a broadcast input pair against 16 features' pairs */
#define VDOT(acc, x, w) _mm512_dpbf16_ps(acc, (__m512bh)(x), (__m512bh)(w))
/* cnt (1 .. 16) floats to bf16, rounded to nearest even */
static inline void STORE_BF16(uint16_t *dst, const float *src, int cnt) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src));
    _mm256_mask_storeu_epi16(dst, (__mmask16)((1u << cnt) - 1), h);
}
#endif
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
#ifndef HAVE_BF16 /* never called: the bf16 entry point refuses without AVX512-BF16 */
#define VDOT(acc, x, w) (acc)
#define STORE_BF16(dst, src, cnt) ((void)(dst), (void)(src), (void)(cnt))
#endif
#define VLANES (PANEL / PV)
#define ROW_BLOCK 96
#ifndef K_BLOCK
#define K_BLOCK 384 /* terms per pass over a panel: a panel chunk stays in L1 */
#endif

/* rows [0, MR) of x against panels [0, NP) of `packed`, terms k0 .. k1 - 1 of each output's
 * chain (pairs of inputs when BF): started from zero (k0 == 0) or from the partial sums in
 * `part` (row stride ldp, padded to whole panels); left in `part` unless k1 == k, when they go
 * to y (outputs of features >= n dropped) plus the bias, rounded to bf16 when BF. k counts
 * terms (pairs when BF), ldx bytes, ldy outputs. */
static inline __attribute__((always_inline)) void tile(
    const void *xv, int64_t ldx, const float *packed, int k, int k0, int k1, const float *bias,
    void *yv, int64_t ldy, float *part, int64_t ldp, int n0, int n, const int MR, const int NP,
    const int BF) {
    const char *x = (const char *)xv;
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
            /* a bf16 pair is read as the 32 bits of a float */
            vec xr = VBCAST((const float *)(x + r * ldx) + kk);
#pragma GCC unroll 8
            for (int v = 0; v < NP * PV; v++)
                acc[r][v] = BF ? VDOT(acc[r][v], xr, w[v]) : VFMA(xr, w[v], acc[r][v]);
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
            if (cnt <= 0) continue;
            if (bias)
                for (int j = 0; j < cnt; j++) out[j] += bias[f0 + j];
            if (BF)
                STORE_BF16((uint16_t *)yv + r * ldy + f0, out, cnt);
            else
                memcpy((float *)yv + r * ldy + f0, out, sizeof(float) * cnt);
        }
    }
}

typedef void (*tile_fn)(const void *, int64_t, const float *, int, int, int, const float *,
                        void *, int64_t, float *, int64_t, int, int);

#define TILE(MR, NP)                                                                          \
    static void tile_##MR##_##NP(const void *x, int64_t ldx, const float *packed, int k,     \
                                 int k0, int k1, const float *bias, void *y, int64_t ldy,    \
                                 float *part, int64_t ldp, int n0, int n) {                  \
        tile(x, ldx, packed, k, k0, k1, bias, y, ldy, part, ldp, n0, n, MR, NP, 0);          \
    }
#ifdef HAVE_BF16
#define BF_TILE(MR, NP)                                                                       \
    static void bf_tile_##MR##_##NP(const void *x, int64_t ldx, const float *packed, int k,  \
                                    int k0, int k1, const float *bias, void *y, int64_t ldy, \
                                    float *part, int64_t ldp, int n0, int n) {               \
        tile(x, ldx, packed, k, k0, k1, bias, y, ldy, part, ldp, n0, n, MR, NP, 1);          \
    }
#endif
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1)
TILE(1, 4) TILE(2, 3) TILE(3, 2)
#ifdef __AVX512F__
TILE(7, 1) TILE(8, 1) TILE(9, 1) TILE(10, 1) TILE(11, 1) TILE(12, 1)
TILE(4, 2) TILE(5, 2) TILE(6, 2)
#endif
#ifdef HAVE_BF16
BF_TILE(1, 1) BF_TILE(2, 1) BF_TILE(3, 1) BF_TILE(4, 1) BF_TILE(5, 1) BF_TILE(6, 1)
BF_TILE(7, 1) BF_TILE(8, 1) BF_TILE(1, 4) BF_TILE(2, 4) BF_TILE(3, 4) BF_TILE(4, 3) BF_TILE(5, 3) BF_TILE(6, 3) BF_TILE(7, 3)
BF_TILE(8, 3) BF_TILE(1, 3) BF_TILE(2, 3) BF_TILE(3, 3)
#endif

/* Rows per full tile: float32 takes MAX_MR rows x 1 panel (one FMA per broadcast); bf16
 * 8 rows x 3 panels (24 sums: a vdpbf16ps does twice an FMA's work, and three panels per
 * broadcast keep the loads below the products: 412 GFLOP/s on 2 Zen 4 cores, 94% of their
 * vdpbf16ps peak, against 301 for 12 x 1 tiles). */
#define BF_MR 8

/* the tiles for `rows` rows (1 .. the family's full rows), `with_full` when they are the last
 * rows of a call that has full tiles too: the widest one's panel count, it, and one panel */
static void pick(int rows, int bf, int with_full, int *np, tile_fn *wide, tile_fn *narrow) {
    static const tile_fn one[] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1
#ifdef __AVX512F__
                                  , tile_7_1, tile_8_1, tile_9_1, tile_10_1, tile_11_1, tile_12_1
#endif
    };
    static const tile_fn wide_f32[] = {0, tile_1_4, tile_2_3, tile_3_2
#ifdef __AVX512F__
                                       , tile_4_2, tile_5_2, tile_6_2
#endif
    };
    static const int np_f32[] = {0, 4, 3, 2, 2, 2, 2};
    const int n_wide = (int)(sizeof wide_f32 / sizeof wide_f32[0]);
#ifdef HAVE_BF16
    static const tile_fn one_bf[] = {0, bf_tile_1_1, bf_tile_2_1, bf_tile_3_1, bf_tile_4_1,
                                     bf_tile_5_1, bf_tile_6_1, bf_tile_7_1, bf_tile_8_1};
    static const tile_fn wide_bf[] = {0, bf_tile_1_4, bf_tile_2_4, bf_tile_3_4, bf_tile_4_3,
                                      bf_tile_5_3, bf_tile_6_3, bf_tile_7_3, bf_tile_8_3};
    static const int np_bf[] = {0, 4, 4, 4, 3, 3, 3, 3, 3};
    /* the last 1-3 rows of a call that also has full tiles, whose work items are groups of
     * three panels: they take three panels at once too (one panel at a time, their few
     * sums waited on the products' latency) */
    static const tile_fn rest_bf[] = {0, bf_tile_1_3, bf_tile_2_3, bf_tile_3_3};
    if (bf) {
        *narrow = one_bf[rows];
        *wide = rows < 4 && with_full ? rest_bf[rows] : wide_bf[rows];
        *np = rows < 4 && with_full ? 3 : np_bf[rows];
        return;
    }
#endif
    (void)bf, (void)with_full;
    *narrow = one[rows];
    *wide = rows < n_wide ? wide_f32[rows] : one[rows];
    *np = rows < n_wide ? np_f32[rows] : 1;
}

int docqa_linear_f32_panel(void) { return PANEL; }

/* y = x @ w.T + bias for m rows, k terms (pairs when bf), the elements of x and y floats,
 * or bf16 when bf (ldx and ldy in elements); see docqa_linear_f32. */
static int linear(const void *x, int m, int64_t ldx, const float *packed, int n, int k,
                  const float *bias, void *y, int64_t ldy, float *part, int num_threads,
                  int bf) {
    const int esize = bf ? 2 : 4; /* bytes of an element of x and y */
    if (m < 0 || n <= 0 || k <= 0 || ldx * esize < k * 4 || ldy < n) return -1;
    if (m == 0) return 0;
    const int64_t ldxb = ldx * esize;
    const int panels = (n + PANEL - 1) / PANEL;
    const int64_t pstride = (int64_t)k * PANEL;
    const int64_t ldp = (int64_t)panels * PANEL;
    const int chunks = (k + K_BLOCK - 1) / K_BLOCK;
    if (chunks > 1 && part == NULL) return -1;
    const int kc = (k + chunks - 1) / chunks;
    for (int r0 = 0; r0 < m; r0 += ROW_BLOCK) {
        const int rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
        /* the block's tiles: full MR-row tiles, then one of the rest */
#ifdef HAVE_BF16
        const int MR = bf ? BF_MR : MAX_MR;
#else
        const int MR = MAX_MR;
#endif
        const int full = rows / MR, rest = rows % MR;
        int np_full = 1, np_rest = 1;
        tile_fn wide_full = 0, narrow_full = 0, wide_rest = 0, narrow_rest = 0;
        if (full) pick(MR, bf, 0, &np_full, &wide_full, &narrow_full);
        if (rest) pick(rest, bf, full > 0, &np_rest, &wide_rest, &narrow_rest);
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
                    const int rr = t < full ? MR : rest;
                    if (rr == 0) continue;
                    const int np = t < full ? np_full : np_rest;
                    tile_fn wide = t < full ? wide_full : wide_rest;
                    tile_fn narrow = t < full ? narrow_full : narrow_rest;
                    const int row = r0 + t * MR;
                    const char *xr = (const char *)x + (int64_t)row * ldxb;
                    char *yr = (char *)y + (int64_t)row * ldy * esize;
                    float *pr = part ? part + (int64_t)(t * MR) * ldp : NULL;
                    int p = p0;
                    for (; p + np <= p0 + pn; p += np)
                        wide(xr, ldxb, packed + p * pstride, k, k0, k1, bias, yr, ldy, pr, ldp,
                             p * PANEL, n);
                    for (; p < p0 + pn; p++)
                        narrow(xr, ldxb, packed + p * pstride, k, k0, k1, bias, yr, ldy, pr, ldp,
                               p * PANEL, n);
                }
            }
        }
    }
    return 0;
}

/* y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ w.T + bias, w packed as above;
 * `part` is scratch of ROW_BLOCK x (panels * 16) floats, used when k > K_BLOCK (else NULL is
 * fine). Returns 0, or -1 for bad sizes. */
int docqa_linear_f32(const float *x, int m, int64_t ldx, const float *packed, int n, int k,
                     const float *bias, float *y, int64_t ldy, float *part, int num_threads) {
    return linear(x, m, ldx, packed, n, k, bias, y, ldy, part, num_threads, 0);
}

/* Output features per panel of docqa_linear_bf16 here; 0 without AVX512-BF16. */
int docqa_linear_bf16_panel(void) {
#ifdef HAVE_BF16
    return PANEL;
#else
    return 0;
#endif
}

/* The same in bf16: x [m, k] and y [m, n] bf16 (row strides ldx, ldy in elements),
 * w packed in pairs as above, bias float32 (or NULL); `part` as for docqa_linear_f32, used
 * when k / 2 > K_BLOCK. Returns 0, or -1 for bad sizes or without AVX512-BF16. */
int docqa_linear_bf16(const uint16_t *x, int m, int64_t ldx, const uint32_t *packed, int n,
                      int k, const float *bias, uint16_t *y, int64_t ldy, float *part,
                      int num_threads) {
#ifdef HAVE_BF16
    if (k % 2) return -1;
    return linear(x, m, ldx, (const float *)packed, n, k / 2, bias, y, ldy, part,
                  num_threads, 1);
#else
    (void)x; (void)m; (void)ldx; (void)packed; (void)n; (void)k; (void)bias; (void)y;
    (void)ldy; (void)part; (void)num_threads;
    return -1;
#endif
}

#else /* no FMA vectors: the caller uses its torch path */

int docqa_linear_f32_panel(void) { return 0; }
int docqa_linear_bf16_panel(void) { return 0; }

int docqa_linear_bf16(const uint16_t *x, int m, int64_t ldx, const uint32_t *packed, int n,
                      int k, const float *bias, uint16_t *y, int64_t ldy, float *part,
                      int num_threads) {
    (void)x; (void)m; (void)ldx; (void)packed; (void)n; (void)k; (void)bias; (void)y;
    (void)ldy; (void)part; (void)num_threads;
    return -1;
}

int docqa_linear_f32(const float *x, int m, int64_t ldx, const float *packed, int n, int k,
                     const float *bias, float *y, int64_t ldy, float *part, int num_threads) {
    (void)x; (void)m; (void)ldx; (void)packed; (void)n; (void)k; (void)bias; (void)y;
    (void)ldy; (void)part; (void)num_threads;
    return -1;
}

#endif
