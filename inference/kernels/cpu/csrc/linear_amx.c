/* bf16 linear layers on CPUs with AMX: y = x @ w.T (+ b), batch-invariant by construction.
 *
 * Every output y[r, n] is a float32 sum built by TDPBF16PS over k-blocks of 32 inputs, in
 * order kb = 0, 1, ..., started from zero, with the bias (if any) added after the last block
 * and one rounding to bf16. TDPBF16PS computes each element of its output tile from that
 * element's row of A and column of B alone, so which rows share a call or a tile, how many
 * there are and which thread computes them never change a row's bits: prefill chunks and decode
 * batches of any size give equal results, at the tile unit's speed for every call size (no
 * slabs, no padding of calls).
 *
 * The weight is packed once into tiles of 16 output features by 32 inputs: tile (nb, kb) is
 * 1 KiB at packed + (nb * KB + kb) * 512, row p (64 bytes) holding, for feature j = 0..15,
 * the pair w[16 nb + j][32 kb + 2p], w[16 nb + j][32 kb + 2p + 1] (the layout TDPBF16PS reads
 * B in); features past N are zero. x is read in place, 16 rows a tile, when K is a multiple of
 * 32. A call of fewer than 16 rows (decode) configures its row and sum tiles to that many rows
 * and reads x in place too, so the unit computes no padding rows; in a longer call, the last
 * rows short of 16 are first copied to a zeroed scratch tile (the unit must not read past x).
 *
 * Threads split the feature tiles in groups: three against a call of one row tile (16 rows
 * or fewer), else two, against every pair of row tiles in turn. Three or four independent
 * sums keep the unit busy while each waits on its last product, and every weight tile loaded
 * serves the pass's row tiles; after a group's first pair its weights come from the caches, so
 * the weight streams from memory once a call. Measured on a 2-core Xeon with AMX (about 25 GB/s
 * from memory), the 30 layers and the output of SmolLM2 from Python, two interleaved runs: 1 row
 * 12.1-12.8 ms (the weight's 270 MB from memory), 32 rows 14.1-14.8, 48 rows 16.0-16.9, 128
 * rows 27.0, 512 rows 94-98; one feature tile against up to five row tiles at a time took
 * 13.9-14.4, 17.4-17.7, 20.9-21.4, 37.2-39.6 and 117-122 ms.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) &&             \
    defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>

#include "amx.h"

/* Asks Linux for the AMX tile state. Returns 0 when this process may use AMX. */
int docqa_amx_init(void) { return amx_request(); }

/* C tile -> bf16 rows of y (bias added in float32 first, one rounding to nearest even) */
static inline void store_tile(const float *c, int rows, float *bias16, uint16_t *y,
                              int64_t ldy, int n0, int n) {
    const int cnt = n - n0 < 16 ? n - n0 : 16;
    const __mmask16 keep = (__mmask16)((1u << cnt) - 1u);
    const __m512 b = bias16 ? _mm512_loadu_ps(bias16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + 16 * r), b);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
        _mm256_mask_storeu_epi16(y + r * ldy + n0, keep, h);
    }
}

/* the bias of features [n0, n0 + 16), zero past n (NULL without a bias) */
static inline float *bias_of(const float *bias, int n0, int n, float *buf) {
    if (!bias) return NULL;
    for (int j = 0; j < 16; j++) buf[j] = n0 + j < n ? bias[n0 + j] : 0.0f;
    return buf;
}

/* A row tile's rows: where its first row starts, the row stride in bytes, and how many. */
typedef struct {
    const uint16_t *x;
    int64_t stride;
    int rows;
} RowTile;

/* Row tile r of a call: 16 rows of x in place, or its last rows: in place when they are the
 * whole call (short tiles), else the zero-padded copy `tail`. */
static inline RowTile row_tile(const uint16_t *x, int64_t ldx, int full, const uint16_t *tail,
                               int k, int rest, int r) {
    if (r < full) return (RowTile){x + (int64_t)r * 16 * ldx, ldx * 2, 16};
    return full ? (RowTile){tail, (int64_t)k * 2, rest} : (RowTile){x, ldx * 2, rest};
}

/* Row tiles t[0 .. rn) (rn 1 or 2) against feature tiles nb0 .. nb0 + fc of the packed
 * weight w (fc up to 3 for one row tile, up to 2 for two), every sum over the k-blocks in
 * order from zero. With one row tile, the sums of feature tile f live in tile register f,
 * its rows load into 3 and 7 by turns and the weights into 4, 5, 6; with two, the sums of row
 * tile r and feature tile f in 2 r + f, rows into 4, 5 and weights into 6, 7. Three or four
 * independent sums hide the product's latency, and each weight tile loaded serves every row
 * tile of the pass. */
/* With one row tile, rows_pass's tiles that hold rows: the sums (0-2) and the rows (3, 7) */
#define ONE_ROW_TILE_SHORT (1u << 0 | 1u << 1 | 1u << 2 | 1u << 3 | 1u << 7)

static inline __attribute__((always_inline)) void rows_pass(
    const RowTile *t, int rn, const uint16_t *w, int64_t wstep, int kb_n, int nb0, int fc,
    const float *bias, uint16_t *y, int64_t ldy, int n, float *c, float *bias_buf) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t *a0 = t[0].x, *a1 = rn > 1 ? t[1].x : t[0].x;
    const int64_t s0 = t[0].stride, s1 = rn > 1 ? t[1].stride : t[0].stride;
    if (rn == 1) {
        for (int kb = 0; kb < kb_n; kb++) {
            const uint16_t *wk = w + kb * 512;
#define AMX_ONE_ROW(areg)                                                                      \
    _tile_loadd(areg, a0 + kb * 32, s0);                                                       \
    _tile_loadd(4, wk, 64);                                                                    \
    _tile_dpbf16ps(0, areg, 4);                                                                \
    if (fc > 1) {                                                                              \
        _tile_loadd(5, wk + wstep, 64);                                                        \
        _tile_dpbf16ps(1, areg, 5);                                                            \
    }                                                                                          \
    if (fc > 2) {                                                                              \
        _tile_loadd(6, wk + 2 * wstep, 64);                                                    \
        _tile_dpbf16ps(2, areg, 6);                                                            \
    }
            if (kb & 1) {
                AMX_ONE_ROW(7)
            } else {
                AMX_ONE_ROW(3)
            }
#undef AMX_ONE_ROW
        }
    } else {
        for (int kb = 0; kb < kb_n; kb++) {
            const uint16_t *wk = w + kb * 512;
            _tile_loadd(4, a0 + kb * 32, s0);
            _tile_loadd(6, wk, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, a1 + kb * 32, s1);
            _tile_dpbf16ps(2, 5, 6);
            if (fc > 1) {
                _tile_loadd(7, wk + wstep, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
#define AMX_STORE(reg, r, f)                                                                   \
    if (rn > r && fc > f) {                                                                    \
        const int nb = nb0 + f;                                                                \
        _tile_stored(reg, c, 64);                                                              \
        store_tile(c, t[r].rows, bias_of(bias, nb * 16, n, bias_buf),                          \
                   y + (int64_t)r * 16 * ldy, ldy, nb * 16, n);                                \
    }
    if (rn == 1) {
        AMX_STORE(0, 0, 0)
        AMX_STORE(1, 0, 1)
        AMX_STORE(2, 0, 2)
    } else {
        AMX_STORE(0, 0, 0)
        AMX_STORE(1, 0, 1)
        AMX_STORE(2, 1, 0)
        AMX_STORE(3, 1, 1)
    }
#undef AMX_STORE
}

int docqa_linear_bf16_amx(const uint16_t *x, int m, int64_t ldx, const uint16_t *packed, int n,
                          int k, const float *bias, uint16_t *y, int64_t ldy, int num_threads) {
    if (m < 0 || n <= 0 || k <= 0 || k % 32 || ldx < k || ldy < n) return -1;
    if (m == 0) return 0;
    const int kb_n = k / 32, nb_n = (n + 15) / 16;
    const int full = m / 16, rest = m % 16;
    uint16_t *tail = NULL; /* the last rows of a longer call, zero-padded to a whole tile */
    if (rest && full) {
        tail = (uint16_t *)aligned_alloc(64, (size_t)16 * k * sizeof(uint16_t));
        if (!tail) return -1;
        memset(tail, 0, (size_t)16 * k * sizeof(uint16_t));
        for (int r = 0; r < rest; r++)
            memcpy(tail + (int64_t)r * k, x + (int64_t)(full * 16 + r) * ldx, (size_t)k * 2);
    }
    const int blocks = full + (rest ? 1 : 0); /* row tiles */
    /* feature tiles a group: three against one row tile, else two, every pair of row tiles
     * in turn (after the first pair, the group's weights come from the caches) */
    const int per = blocks == 1 ? 3 : 2;
    const int groups = (nb_n + per - 1) / per;
    const int64_t wstep = (int64_t)kb_n * 512; /* the next feature tile's weights */
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        /* a call of fewer than 16 rows: its sums (tiles 0-2) and rows (3, 7) only that many
         * rows, so the unit computes no padding rows (each row's sums are the same) */
        if (!full)
            amx_configure_tiles_rows(ONE_ROW_TILE_SHORT, rest);
        else
            amx_configure_tiles();
        float c[256] __attribute__((aligned(64)));
        float bias_buf[16];
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            const int nb0 = g * per;
            const int fc = nb_n - nb0 < per ? nb_n - nb0 : per;
            const uint16_t *w = packed + (int64_t)nb0 * wstep;
            for (int r = 0; r < blocks; r += 2) {
                const int rn = blocks - r < 2 ? blocks - r : 2;
                const RowTile t[2] = {row_tile(x, ldx, full, tail, k, rest, r),
                                      row_tile(x, ldx, full, tail, k, rest, r + 1)};
                rows_pass(t, rn, w, wstep, kb_n, nb0, fc, bias, y + (int64_t)r * 16 * ldy, ldy,
                          n, c, bias_buf);
            }
        }
        _tile_release();
    }
    free(tail);
    return 0;
}

int docqa_linear_bf16_amx_available(void) { return 1; }

#else /* no AMX: the caller uses its torch path */

int docqa_amx_init(void) { return -1; }

int docqa_linear_bf16_amx(const uint16_t *x, int m, int64_t ldx, const uint16_t *packed, int n,
                          int k, const float *bias, uint16_t *y, int64_t ldy, int num_threads) {
    (void)x; (void)m; (void)ldx; (void)packed; (void)n; (void)k; (void)bias; (void)y;
    (void)ldy; (void)num_threads;
    return -1;
}

int docqa_linear_bf16_amx_available(void) { return 0; }

#endif
