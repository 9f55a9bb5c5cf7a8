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
 * (prefill) 6-row (AVX2) or 8-row by 3-panel (AVX-512) tiles that reuse each panel from cache
 * for a block of rows.
 *
 * Threads split the panels; rows are taken in blocks of ROW_BLOCK so a block of x stays in the
 * core's cache while the panels stream past it.
 *
 * A float32 weight is packed behind a 64-byte header (PackHeader) naming its format. Besides
 * plain panels (FMT_F32), a weight whose every block of 32 inputs of a feature is exactly a
 * llama.cpp Q4_1 block (d * q + m, q in 0..15, d and m half floats) or Q8_0 block (d * q, q in
 * -127..127; Q4_0 blocks are Q8_0 ones with q in -8..8) is kept in that form: 0.75 or 1.125 bytes a weight instead of 4. docqa_pack_f32
 * checks every value bit for bit (it refuses a weight that is not exactly of the format). Calls
 * of up to QFUSED_ROWS rows (4, or 16 with AVX2) expand each weight vector in registers right
 * before its products (qtile); larger calls expand each panel's chunk of terms once into a
 * per-thread float32 buffer, then the same register tiles run on it. d * q is exact in
 * float32 (at most 11 + 8 significant bits), so the expanded values are the weight's own
 * float32 values, and every output is the plain panels' chain: the quantized forms change how
 * many bytes a step reads, never a result.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "scratch.h"

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
#define MAX_MR 8
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
 * terms (pairs when BF), ldx bytes, ldy outputs. t: the tile's place among the nt tiles of
 * this call's rows that fetch the next panels (below). */
static inline __attribute__((always_inline)) void tile(
    const void *xv, int64_t ldx, const float *packed, int64_t pstride, int k, int k0, int k1,
    const float *bias, void *yv, int64_t ldy, float *part, int64_t ldp, int n0, int n, int t,
    int nt, const int MR, const int NP, const int BF) {
    const char *x = (const char *)xv;
    vec acc[MAX_MR][4 * PV];
#pragma GCC unroll 12
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NP * PV; v++)
            acc[r][v] = k0 == 0 ? VZERO() : VLOAD(part + r * ldp + n0 + v * VLANES);
    int turn = t; /* this tile fetches at the steps kk - k0 = t (mod nt), from kk = k0 */
    for (int kk = k0; kk < k1; kk++) {
        vec w[4 * PV];
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++)
#pragma GCC unroll 2
            for (int v = 0; v < PV; v++)
                w[p * PV + v] = VLOAD(packed + p * pstride + (int64_t)kk * PANEL + v * VLANES);
        /* tiles of many rows, which compute longer than their panels take to read, fetch
         * the next panels' lines (a thread's panels are consecutive), so the weight streams
         * from memory while they compute. The nt such tiles that take these panels in turn
         * share the fetching, tile t the lines of the steps kk - k0 = t (mod nt): the memory
         * streams at an even pace through all of them, where the first alone would fetch
         * every line in a burst that stalls it and leaves the memory idle during the others
         * (5-9% faster for 16-55 rows on 2 Zen 5 cores). Where one or two tiles take each
         * group, the lines go to L2 only: fetched into L1 as well, they pushed out the lines
         * of the group the tiles were computing on (2 Zen 4 cores, bf16, the 30 layers: 4-16
         * rows 0.88-0.95x the time, the output layer 0.83-0.93x; from three tiles on, L1 as
         * before, where L2 only was up to 1.05x slower). Tiles of a few rows stream at the
         * memory's pace: each of their panels' line 24 steps ahead goes to L2 (left to the
         * hardware prefetcher, one row read the 30 layers' weights at 31 GB/s where those two
         * cores read 55; with it, 1-3 rows took 0.83-0.97x the time over six runs, the
         * output layer 0.90-0.97x; 8 and 16 steps ahead gained less, fetching into L1
         * lost). */
        if (MR < 4) {
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++)
                __builtin_prefetch(packed + p * pstride + (int64_t)(kk + 24) * PANEL, 0, 2);
        } else {
            if (turn == 0)
#pragma GCC unroll 4
                for (int p = 0; p < NP; p++) {
                    const float *line = packed + (p + NP) * pstride + (int64_t)kk * PANEL;
                    if (nt <= 2)
                        __builtin_prefetch(line, 0, 2);
                    else
                        __builtin_prefetch(line, 0, 3);
                }
            turn = turn == 0 ? nt - 1 : turn - 1;
        }
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

typedef void (*tile_fn)(const void *, int64_t, const float *, int64_t, int, int, int,
                        const float *, void *, int64_t, float *, int64_t, int, int, int, int);

#define TILE(MR, NP)                                                                          \
    static void tile_##MR##_##NP(const void *x, int64_t ldx, const float *packed,            \
                                 int64_t pstride, int k, int k0, int k1, const float *bias,  \
                                 void *y, int64_t ldy, float *part, int64_t ldp, int n0,     \
                                 int n, int t, int nt) {                                     \
        tile(x, ldx, packed, pstride, k, k0, k1, bias, y, ldy, part, ldp, n0, n, t, nt, MR, NP, \
             0);                                                                             \
    }
#ifdef HAVE_BF16
#define BF_TILE(MR, NP)                                                                       \
    static void bf_tile_##MR##_##NP(const void *x, int64_t ldx, const float *packed,         \
                                    int64_t pstride, int k, int k0, int k1,                  \
                                    const float *bias, void *y, int64_t ldy, float *part,    \
                                    int64_t ldp, int n0, int n, int t, int nt) {             \
        tile(x, ldx, packed, pstride, k, k0, k1, bias, y, ldy, part, ldp, n0, n, t, nt, MR, NP, \
             1);                                                                             \
    }
#endif
#ifdef __AVX512F__
/* the tiles of both dtypes' families (pick): one panel, the widest per row count, the rest */
#define SHAPES(T)                                                                             \
    T(1, 1) T(2, 1) T(3, 1) T(4, 1) T(5, 1) T(6, 1) T(7, 1) T(8, 1)                          \
    T(1, 4) T(2, 4) T(3, 4) T(4, 3) T(5, 3) T(6, 3) T(7, 3) T(8, 3)                          \
    T(1, 3) T(2, 3) T(3, 3)
SHAPES(TILE)
#ifdef HAVE_BF16
SHAPES(BF_TILE)
#endif
#else
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(5, 1) TILE(6, 1)
TILE(1, 4) TILE(2, 3) TILE(3, 2)
#endif

/* Rows per full tile. With AVX-512, 8 rows x 3 panels in both dtypes: 24 sums, and three
 * panels per broadcast keep the loads (3 panels + 8 broadcasts) below the 24 products. bf16
 * on 2 Zen 4 cores: 412 GFLOP/s, 94% of their vdpbf16ps peak, against 301 for 12 x 1 tiles;
 * float32 on 2 Xeon cores: 1.4-1.7x faster than 12 x 1 tiles (13 loads for 12 products).
 * With AVX2 (16 registers), float32 takes MAX_MR rows x 1 panel. */
#ifdef __AVX512F__
#define FULL_MR 8
#else
#define FULL_MR MAX_MR
#endif

/* the tiles for `rows` rows (1 .. the family's full rows), `with_full` when they are the last
 * rows of a call that has full tiles too: the widest one's panel count, it, and one panel */
static void pick(int rows, int bf, int with_full, int *np, tile_fn *wide, tile_fn *narrow) {
#ifdef __AVX512F__
    /* 8 rows x 3 panels in both dtypes (24 sums; 11 loads for 24 products); fewer rows take
     * more panels at once, and the last 1-3 rows of a call with full tiles, whose work items
     * are groups of three panels, take three (one panel at a time, their few sums waited on
     * the products' latency) */
    typedef struct {
        tile_fn one[FULL_MR + 1], wide[FULL_MR + 1], rest[4];
    } Family;
#define FAMILY(t)                                                                             \
    {{0, t##1_1, t##2_1, t##3_1, t##4_1, t##5_1, t##6_1, t##7_1, t##8_1},                     \
     {0, t##1_4, t##2_4, t##3_4, t##4_3, t##5_3, t##6_3, t##7_3, t##8_3},                     \
     {0, t##1_3, t##2_3, t##3_3}}
    static const Family families[] = {FAMILY(tile_)
#ifdef HAVE_BF16
                                       , FAMILY(bf_tile_)
#endif
    };
    static const int np_of[FULL_MR + 1] = {0, 4, 4, 4, 3, 3, 3, 3, 3};
    const Family *f = &families[bf ? 1 : 0]; /* bf only where HAVE_BF16 (the entry points) */
    const int rest = rows < 4 && with_full;
    *narrow = f->one[rows];
    *wide = rest ? f->rest[rows] : f->wide[rows];
    *np = rest ? 3 : np_of[rows];
#else
    (void)bf, (void)with_full;
    static const tile_fn one[] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};
    static const tile_fn wide_f32[] = {0, tile_1_4, tile_2_3, tile_3_2};
    static const int np_f32[] = {0, 4, 3, 2};
    *narrow = one[rows];
    *wide = rows < 4 ? wide_f32[rows] : one[rows];
    *np = rows < 4 ? np_f32[rows] : 1;
#endif
}

/* ------------------------------------------------------------------------------------------
 * Packed float32 weights: a header, then plain panels or quantized blocks.
 *
 * FMT_Q4_1 and FMT_Q8_0 keep panels of 16 features too; panel p holds, for each block b of 32
 * consecutive inputs in order, at ((p * (k / 32) + b) * block bytes):
 *   Q4_1: float d[16], float m[16], then 32 inputs, 8 bytes each: byte j of input i is
 *         q(j) | q(j + 8) << 4, q(f) of feature f, the weight d[f] * q + m[f] (128 + 256 bytes)
 *   Q8_0: float d[16], then 32 inputs, 16 int8 each: byte j of input i is q(i) of feature j,
 *         the weight d[j] * q (64 + 512 bytes)
 * Features past n are blocks of zeros (weight 0, as in the plain panels).
 * ---------------------------------------------------------------------------------------- */
#define PACK_MAGIC 0x31574451 /* "QDW1" */
enum { FMT_F32 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2 };
#define QBLOCK 32 /* inputs per quantized block */
typedef struct {
    int32_t magic, format, n, k;
    int32_t reserved[12];
} PackHeader; /* 64 bytes: the data after it stays 64-byte aligned */

static int64_t block_bytes(int format) {
    return format == FMT_Q4_1 ? 2 * PANEL * 4 + QBLOCK / 2 * PANEL
                              : PANEL * 4 + QBLOCK * PANEL; /* FMT_Q8_0 */
}

/* Bytes of a weight [n, k] packed as `format`; -1 where that format cannot hold the shape. */
int64_t docqa_pack_f32_bytes(int n, int k, int format) {
    if (n <= 0 || k <= 0) return -1;
    const int64_t panels = (n + PANEL - 1) / PANEL;
    if (format == FMT_F32) return (int64_t)sizeof(PackHeader) + panels * k * PANEL * 4;
    if ((format != FMT_Q4_1 && format != FMT_Q8_0) || k % QBLOCK) return -1;
#ifndef __F16C__
    return -1; /* the checks round to half floats */
#endif
    return (int64_t)sizeof(PackHeader) + panels * (k / QBLOCK) * block_bytes(format);
}

#ifdef __F16C__
static inline float half_round(float x) { return _cvtsh_ss(_cvtss_sh(x, 0)); }
/* a == b bit for bit (a -0.0 weight is not a +0.0 one) */
static inline int same_bits(float a, float b) {
    uint32_t ua, ub;
    memcpy(&ua, &a, 4), memcpy(&ub, &b, 4);
    return ua == ub;
}
/* the half float `steps` representable values above (below, when negative) positive x */
static inline float half_step(float x, int steps) {
    return _cvtsh_ss((unsigned short)(_cvtss_sh(x, 0) + steps));
}

/* 32 values as d * q + m exactly (q in 0..15, d and m half floats): 1 with d, m and q set */
static int as_q4_1(const float *v, float *d_out, float *m_out, uint8_t *q) {
    float lo = v[0], hi = v[0];
    for (int i = 0; i < QBLOCK; i++) {
        if (!(v[i] == v[i]) || v[i] - v[i] != 0.0f) return 0; /* NaN or infinite */
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
    }
    if (!same_bits(half_round(lo), lo)) return 0; /* the lowest value is m (its q is 0) */
    *m_out = lo;
    if (hi == lo) { /* d = 0: every value is 0 * 0 + m */
        for (int i = 0; i < QBLOCK; i++)
            if (!same_bits(0.0f + lo, v[i])) return 0;
        *d_out = 0.0f;
        memset(q, 0, QBLOCK);
        return 1;
    }
    const float guess = half_round((hi - lo) / 15.0f);
    for (int c = 0; c < 5; c++) { /* the guess, then its neighbours */
        const float d = half_step(guess, (c + 1) / 2 * (c % 2 ? 1 : -1));
        if (!(d > 0.0f) || d - d != 0.0f) continue;
        int ok = 1;
        for (int i = 0; i < QBLOCK && ok; i++) {
            const float t = rintf((v[i] - lo) / d);
            ok = t >= 0.0f && t <= 15.0f && same_bits(d * t + lo, v[i]); /* d * t exact */
            q[i] = (uint8_t)t;
        }
        if (ok) {
            *d_out = d;
            return 1;
        }
    }
    return 0;
}

/* 32 values as d * q exactly (q in -127..127, d a half float): 1 with d and q set */
static int as_q8_0(const float *v, float *d_out, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < QBLOCK; i++) {
        if (!(v[i] == v[i]) || v[i] - v[i] != 0.0f) return 0;
        amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    }
    if (amax == 0.0f) { /* d = 0: every value is +0 */
        for (int i = 0; i < QBLOCK; i++)
            if (!same_bits(0.0f, v[i])) return 0;
        *d_out = 0.0f;
        memset(q, 0, QBLOCK);
        return 1;
    }
    /* the largest value is 127 d in a Q8_0 block, 8 |d| in a Q4_0 one (d * (q - 8), q in
     * 0..15: the same values as a Q8_0 block's, at 1.125 bytes a weight instead of 4) */
    static const float top[2] = {127.0f, 8.0f};
    for (int g = 0; g < 2; g++) {
        const float guess = half_round(amax / top[g]);
        for (int c = 0; c < 5; c++) {
            const float d = half_step(guess, (c + 1) / 2 * (c % 2 ? 1 : -1));
            if (!(d > 0.0f) || d - d != 0.0f) continue;
            int ok = 1;
            for (int i = 0; i < QBLOCK && ok; i++) {
                const float t = rintf(v[i] / d);
                ok = t >= -127.0f && t <= 127.0f && same_bits(d * t, v[i]);
                q[i] = (int8_t)t;
            }
            if (ok) {
                *d_out = d;
                return 1;
            }
        }
    }
    return 0;
}
#endif

/* Packs w [n, k] (row-major float32) into `out` (docqa_pack_f32_bytes(n, k, format) bytes,
 * 64-byte aligned). Returns 0; -1 for a shape the format cannot hold, or a weight that is not
 * exactly of the format (then `out` holds nothing useful). */
int docqa_pack_f32(const float *w, int n, int k, int format, void *out, int num_threads) {
    if (docqa_pack_f32_bytes(n, k, format) < 0) return -1;
    PackHeader *h = (PackHeader *)out;
    memset(h, 0, sizeof *h);
    h->magic = PACK_MAGIC, h->format = format, h->n = n, h->k = k;
    char *data = (char *)out + sizeof *h;
    const int panels = (n + PANEL - 1) / PANEL;
    if (format == FMT_F32) {
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
        for (int p = 0; p < panels; p++) {
            float *dst = (float *)data + (int64_t)p * k * PANEL;
            for (int kk = 0; kk < k; kk++)
                for (int j = 0; j < PANEL; j++) {
                    const int f = p * PANEL + j;
                    dst[(int64_t)kk * PANEL + j] = f < n ? w[(int64_t)f * k + kk] : 0.0f;
                }
        }
        return 0;
    }
#ifdef __F16C__
    const int blocks = k / QBLOCK;
    const int64_t bb = block_bytes(format);
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) \
    reduction(| : bad)
    for (int p = 0; p < panels; p++) {
        if (bad) continue;
        for (int b = 0; b < blocks && !bad; b++) {
            char *blk = data + ((int64_t)p * blocks + b) * bb;
            memset(blk, 0, bb);
            float *d = (float *)blk, *m = d + PANEL;
            for (int j = 0; j < PANEL && !bad; j++) {
                const int f = p * PANEL + j;
                if (f >= n) break;
                const float *v = w + (int64_t)f * k + b * QBLOCK;
                if (format == FMT_Q4_1) {
                    uint8_t q[QBLOCK];
                    if (!as_q4_1(v, &d[j], &m[j], q)) {
                        bad = 1;
                        break;
                    }
                    uint8_t *qs = (uint8_t *)(m + PANEL);
                    for (int i = 0; i < QBLOCK; i++)
                        qs[i * (PANEL / 2) + j % 8] |= (uint8_t)(q[i] << (j < 8 ? 0 : 4));
                } else {
                    int8_t q[QBLOCK];
                    if (!as_q8_0(v, &d[j], q)) {
                        bad = 1;
                        break;
                    }
                    int8_t *qs = (int8_t *)(d + PANEL);
                    for (int i = 0; i < QBLOCK; i++) qs[i * PANEL + j] = q[i];
                }
            }
        }
    }
    return bad ? -1 : 0;
#else
    return -1;
#endif
}

/* The packed weight's format (FMT_*), or -1 when `packed` is not a packed float32 weight. */
int docqa_pack_f32_format(const void *packed) {
    const PackHeader *h = (const PackHeader *)packed;
    return h->magic == PACK_MAGIC ? h->format : -1;
}

/* A Q4_1 input's 16 features: its 8 bytes, each widened to a 32-bit lane (features j and
 * j + 8 in lane j), then features 0-7 and 8-15 as d * q + m (d * q exact: one rounding). */
#define Q4_LOAD(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define Q4_LOW(q, d, m)                                                                          \
    _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15))), m)
#define Q4_HIGH(q, d, m) _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), m)
/* A Q8_0 input's features 0-7 and 8-15 as d * q (exact) */
#define Q8_HALF(p, d) _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(                  \
                                          _mm_loadl_epi64((const __m128i *)(p)))))

/* Inputs [i0, i0 + 32 * nb) of one panel's blocks `blk` as float32 rows of 16 features: dst
 * [input - i0][feature]. Each value is the block's d * q (+ m), exact as packed. */
static void expand(const char *blk, int format, int nb, float *dst) {
    const int64_t bb = block_bytes(format);
    for (int b = 0; b < nb; b++, blk += bb, dst += QBLOCK * PANEL) {
        const float *d = (const float *)blk;
        const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
        if (format == FMT_Q4_1) {
            const __m256 m0 = _mm256_loadu_ps(d + 16), m1 = _mm256_loadu_ps(d + 24);
            const uint8_t *qs = (const uint8_t *)(d + 32);
            for (int i = 0; i < QBLOCK; i++) {
                const __m256i q = Q4_LOAD(qs + i * (PANEL / 2));
                _mm256_storeu_ps(dst + i * PANEL, Q4_LOW(q, d0, m0));
                _mm256_storeu_ps(dst + i * PANEL + 8, Q4_HIGH(q, d1, m1));
            }
        } else {
            const int8_t *qs = (const int8_t *)(d + 16);
            for (int i = 0; i < QBLOCK; i++) {
                _mm256_storeu_ps(dst + i * PANEL, Q8_HALF(qs + i * PANEL, d0));
                _mm256_storeu_ps(dst + i * PANEL + 8, Q8_HALF(qs + i * PANEL + 8, d1));
            }
        }
    }
}

/* A thread's buffer of expanded panels: the widest group of panels (4) x K_BLOCK inputs. */
THREAD_SCRATCH(expand_buffer, 4 * (K_BLOCK + QBLOCK) * PANEL * sizeof(float))

/* Calls of a few rows (decode; up to QFUSED_ROWS) on a quantized weight: rows [0, MR), at most
 * 6, against NP consecutive panels of blocks (panel stride pbytes), every term at once, each
 * weight vector expanded in registers right before its products (no buffer: a step of one row
 * reads 0.75 bytes a weight and writes nothing). The chains are the tiles' own: acc + x * w
 * over k in order from zero, then the bias. */
static inline __attribute__((always_inline)) void qtile(
    const char *x, int64_t ldx, const char *blocks, int64_t pbytes, int k, const int format,
    const float *bias, float *y, int64_t ldy, int n0, int n, const int MR, const int NP) {
    __m256 acc[6][8];
    const int64_t bb = block_bytes(format);
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int v = 0; v < 2 * NP; v++) acc[r][v] = _mm256_setzero_ps();
    for (int b = 0; b < k / QBLOCK; b++) {
        const char *blk = blocks + b * bb;
        const float *xb = (const float *)x + b * QBLOCK;
        __m256 d0[4], d1[4], m0[4], m1[4];
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++) {
            const float *d = (const float *)(blk + p * pbytes);
            d0[p] = _mm256_loadu_ps(d), d1[p] = _mm256_loadu_ps(d + 8);
            if (format == FMT_Q4_1) m0[p] = _mm256_loadu_ps(d + 16), m1[p] = _mm256_loadu_ps(d + 24);
        }
        for (int i = 0; i < QBLOCK; i++) {
#pragma GCC unroll 4
            for (int p = 0; p < NP; p++) {
                const char *qs = blk + p * pbytes + (format == FMT_Q4_1 ? 128 : 64);
                __m256 w0, w1;
                if (format == FMT_Q4_1) {
                    const __m256i q = Q4_LOAD(qs + i * (PANEL / 2));
                    w0 = Q4_LOW(q, d0[p], m0[p]);
                    w1 = Q4_HIGH(q, d1[p], m1[p]);
                } else {
                    w0 = Q8_HALF(qs + i * PANEL, d0[p]);
                    w1 = Q8_HALF(qs + i * PANEL + 8, d1[p]);
                }
#pragma GCC unroll 6
                for (int r = 0; r < MR; r++) {
                    const __m256 xr = _mm256_broadcast_ss(xb + r * ldx / 4 + i);
                    acc[r][2 * p] = _mm256_fmadd_ps(xr, w0, acc[r][2 * p]);
                    acc[r][2 * p + 1] = _mm256_fmadd_ps(xr, w1, acc[r][2 * p + 1]);
                }
            }
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int p = 0; p < NP; p++) {
            float out[PANEL];
            _mm256_storeu_ps(out, acc[r][2 * p]);
            _mm256_storeu_ps(out + 8, acc[r][2 * p + 1]);
            const int f0 = n0 + p * PANEL;
            const int cnt = n - f0 < PANEL ? n - f0 : PANEL;
            if (cnt <= 0) continue;
            if (bias)
                for (int j = 0; j < cnt; j++) out[j] += bias[f0 + j];
            memcpy(y + r * ldy + f0, out, sizeof(float) * cnt);
        }
}

typedef void (*qtile_fn)(const char *, int64_t, const char *, int64_t, int, const float *,
                         float *, int64_t, int, int);
#define QTILE(FMT, MR, NP)                                                                   \
    static void qtile_##FMT##_##MR##_##NP(const char *x, int64_t ldx, const char *blocks,   \
                                          int64_t pbytes, int k, const float *bias, float *y, \
                                          int64_t ldy, int n0, int n) {                      \
        qtile(x, ldx, blocks, pbytes, k, FMT, bias, y, ldy, n0, n, MR, NP);                  \
    }
QTILE(1, 1, 1) QTILE(1, 1, 4) QTILE(1, 2, 1) QTILE(1, 2, 2) QTILE(1, 3, 1) QTILE(1, 4, 1)
QTILE(2, 1, 1) QTILE(2, 1, 4) QTILE(2, 2, 1) QTILE(2, 2, 2) QTILE(2, 3, 1) QTILE(2, 4, 1)
QTILE(1, 5, 1) QTILE(1, 6, 1) QTILE(2, 5, 1) QTILE(2, 6, 1)
/* Calls of up to QFUSED_ROWS rows expand weights in registers (qtile). With AVX2, up to 16
 * rows: past 4 rows each panel takes the rows in tiles of at most 6 (12 chains), as even as
 * the count allows, expanding each weight vector once per tile. That beats expanding each
 * panel once into a buffer for the register tiles (below) up to about 16 rows on 2 Zen 3
 * cores: the 30 layers and the output layer of SmolLM2 in 0.66-0.74x the time at 5-7 rows,
 * 0.79-0.91x at 8-13 rows, 0.94-0.99x at 16 and about 1.0-1.1x past 18. A 6-row
 * tile's broadcasts each feed two products; tiles of half panels (8 features, one product
 * per broadcast, up to 8 rows) ran 1.1-1.2x slower than the buffer from 16 rows. With
 * AVX-512 the buffer's wider tiles take every call past 4 rows. */
#ifdef __AVX512F__
#define QFUSED_ROWS 4
#else
#define QFUSED_ROWS 16
#endif
#define QTILE_ROWS 6 /* rows per tile past 4 */

/* y = x @ w.T + bias for m <= QFUSED_ROWS rows of a quantized weight (see qtile) */
static void linear_q_rows(const char *x, int m, int64_t ldxb, const char *data, int format,
                          int n, int k, const float *bias, float *y, int64_t ldy,
                          int num_threads) {
    static const qtile_fn wide[3][5] = {
        {0},
        {0, qtile_1_1_4, qtile_1_2_2, qtile_1_3_1, qtile_1_4_1},
        {0, qtile_2_1_4, qtile_2_2_2, qtile_2_3_1, qtile_2_4_1}};
    static const qtile_fn one[3][QTILE_ROWS + 1] = {
        {0},
        {0, qtile_1_1_1, qtile_1_2_1, qtile_1_3_1, qtile_1_4_1, qtile_1_5_1, qtile_1_6_1},
        {0, qtile_2_1_1, qtile_2_2_1, qtile_2_3_1, qtile_2_4_1, qtile_2_5_1, qtile_2_6_1}};
    static const int np_of[5] = {0, 4, 2, 1, 1};
    const int panels = (n + PANEL - 1) / PANEL;
    const int64_t pbytes = (int64_t)(k / QBLOCK) * block_bytes(format);
    if (m > 4) {
        const int tiles = (m + QTILE_ROWS - 1) / QTILE_ROWS;
#pragma omp parallel for schedule(guided) num_threads(num_threads > 0 ? num_threads : 1)
        for (int p = 0; p < panels; p++)
            for (int t = 0, r0 = 0; t < tiles; t++) {
                const int rows = (m - r0 + tiles - t - 1) / (tiles - t); /* ceil */
                one[format][rows](x + r0 * ldxb, ldxb, data + p * pbytes, pbytes, k, bias,
                                  y + r0 * ldy, ldy, p * PANEL, n);
                r0 += rows;
            }
        return;
    }
    const int np = np_of[m];
    const int groups = (panels + np - 1) / np;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
    for (int g = 0; g < groups; g++) {
        const int p0 = g * np, pn = panels - p0 < np ? panels - p0 : np;
        if (pn == np)
            wide[format][m](x, ldxb, data + p0 * pbytes, pbytes, k, bias, y, ldy, p0 * PANEL, n);
        else
            for (int p = p0; p < p0 + pn; p++)
                one[format][m](x, ldxb, data + p * pbytes, pbytes, k, bias, y, ldy, p * PANEL,
                               n);
    }
}

int docqa_linear_f32_panel(void) { return PANEL; }

/* y = x @ w.T + bias for m rows, k terms (pairs when bf), the elements of x and y floats,
 * or bf16 when bf (ldx and ldy in elements); see docqa_linear_f32. */
static int linear(const void *x, int m, int64_t ldx, const float *packed, int format, int n,
                  int k, const float *bias, void *y, int64_t ldy, float *part, int num_threads,
                  int bf) {
    const int esize = bf ? 2 : 4; /* bytes of an element of x and y */
    if (m < 0 || n <= 0 || k <= 0 || ldx * esize < k * 4 || ldy < n) return -1;
    if (m == 0) return 0;
    const int64_t ldxb = ldx * esize;
    if (format != FMT_F32 && m <= QFUSED_ROWS) {
        linear_q_rows((const char *)x, m, ldxb, (const char *)packed, format, n, k, bias,
                      (float *)y, ldy, num_threads);
        return 0;
    }
    const int panels = (n + PANEL - 1) / PANEL;
    const int64_t pstride = (int64_t)k * PANEL;
    const int64_t ldp = (int64_t)panels * PANEL;
    const int chunks = (k + K_BLOCK - 1) / K_BLOCK;
    if (chunks > 1 && part == NULL) return -1;
    int kc = (k + chunks - 1) / chunks;
    if (format != FMT_F32) kc = (kc + QBLOCK - 1) / QBLOCK * QBLOCK; /* whole blocks */
    const int qblocks = k / QBLOCK;
    const int64_t qbytes = format != FMT_F32 ? block_bytes(format) : 0;
    int failed = 0; /* a thread's expansion buffer could not be allocated */
    for (int r0 = 0; r0 < m; r0 += ROW_BLOCK) {
        const int rows = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
        /* the block's tiles: full MR-row tiles, then one of the rest */
        const int MR = FULL_MR;
        const int full = rows / MR, rest = rows % MR;
        const int nt = full + (rest >= 4); /* the tiles that fetch the next panels (tile) */
        int np_full = 1, np_rest = 1;
        tile_fn wide_full = 0, narrow_full = 0, wide_rest = 0, narrow_rest = 0;
        if (full) pick(MR, bf, 0, &np_full, &wide_full, &narrow_full);
        if (rest) pick(rest, bf, full > 0, &np_rest, &wide_rest, &narrow_rest);
        /* a work item is a group of panels as wide as the widest tile used */
        const int group = full ? np_full : np_rest;
        const int groups = (panels + group - 1) / group;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(| : failed)
        {
            float *buf = format != FMT_F32 ? expand_buffer(NULL) : NULL; /* once per thread */
            failed |= format != FMT_F32 && buf == NULL;
            /* guided: large runs of consecutive groups first (each thread's prefetches of its
             * next group stay useful), then smaller ones, so a thread the scheduler held
             * back (the server's other threads share these cores) leaves its last groups to
             * the other instead of keeping it waiting */
#pragma omp for schedule(guided)
            for (int g = 0; g < groups; g++) {
                const int p0 = g * group;
                const int pn = panels - p0 < group ? panels - p0 : group;
                if (format != FMT_F32 && buf == NULL) continue;
                for (int k0 = 0; k0 < k; k0 += kc) {
                    const int k1 = k - k0 < kc ? k : k0 + kc;
                    /* the group's panels for these terms: packed, or expanded into buf */
                    const float *src = packed + p0 * pstride;
                    int64_t ps = pstride;
                    if (format != FMT_F32) {
                        ps = (int64_t)kc * PANEL;
                        for (int i = 0; i < pn; i++)
                            expand((const char *)packed +
                                       ((int64_t)(p0 + i) * qblocks + k0 / QBLOCK) * qbytes,
                                   format, (k1 - k0) / QBLOCK, buf + i * ps);
                        src = buf - (int64_t)k0 * PANEL; /* term kk of panel i at src + i * ps */
                    }
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
                            wide(xr, ldxb, src + (p - p0) * ps, ps, k, k0, k1, bias, yr, ldy, pr,
                                 ldp, p * PANEL, n, t, nt);
                        for (; p < p0 + pn; p++)
                            narrow(xr, ldxb, src + (p - p0) * ps, ps, k, k0, k1, bias, yr, ldy, pr,
                                   ldp, p * PANEL, n, t, nt);
                    }
                }
            }
        }
    }
    return failed ? -1 : 0;
}

/* y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ w.T + bias, w packed by
 * docqa_pack_f32 (any format, the same bits from each); `part` is scratch of ROW_BLOCK x
 * (panels * 16) floats, used when k > K_BLOCK (else NULL is fine). Returns 0, or -1 for bad
 * sizes, a weight packed for another shape, or no memory for the expansion buffer. */
int docqa_linear_f32(const float *x, int m, int64_t ldx, const void *packed, int n, int k,
                     const float *bias, float *y, int64_t ldy, float *part, int num_threads) {
    const PackHeader *h = (const PackHeader *)packed;
    if (h->magic != PACK_MAGIC || h->n != n || h->k != k) return -1;
    return linear(x, m, ldx, (const float *)(h + 1), h->format, n, k, bias, y, ldy, part,
                  num_threads, 0);
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
    return linear(x, m, ldx, (const float *)packed, FMT_F32, n, k / 2, bias, y, ldy, part,
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

int docqa_linear_f32(const float *x, int m, int64_t ldx, const void *packed, int n, int k,
                     const float *bias, float *y, int64_t ldy, float *part, int num_threads) {
    (void)x; (void)m; (void)ldx; (void)packed; (void)n; (void)k; (void)bias; (void)y;
    (void)ldy; (void)part; (void)num_threads;
    return -1;
}

int64_t docqa_pack_f32_bytes(int n, int k, int format) {
    (void)n; (void)k; (void)format;
    return -1;
}

int docqa_pack_f32(const float *w, int n, int k, int format, void *out, int num_threads) {
    (void)w; (void)n; (void)k; (void)format; (void)out; (void)num_threads;
    return -1;
}

int docqa_pack_f32_format(const void *packed) {
    (void)packed;
    return -1;
}

#endif
