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
 * 32; a call's last rows short of 16 are first copied to a zeroed scratch tile (the unit must
 * not read past x).
 *
 * Threads split the feature tiles. Each weight tile is read once per 80 rows: its k-blocks
 * stream in order while up to five row tiles (five accumulators) take their product with each.
 * The weight thus streams from memory once for calls of up to 80 rows; each further row tile
 * adds its products (measured on a 2-core Xeon with AMX, the 30 layers of SmolLM2: 1 row
 * 11-14 ms, 16 rows the same, 48 rows 18-22 ms, 512 rows 96 ms; oneDNN's packed products
 * 17-20, 17-20, 20-25 and 91 ms in the same runs).
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

int docqa_linear_bf16_amx(const uint16_t *x, int m, int64_t ldx, const uint16_t *packed, int n,
                          int k, const float *bias, uint16_t *y, int64_t ldy, int num_threads) {
    if (m < 0 || n <= 0 || k <= 0 || k % 32 || ldx < k || ldy < n) return -1;
    if (m == 0) return 0;
    const int kb_n = k / 32, nb_n = (n + 15) / 16;
    const int full = m / 16, rest = m % 16;
    uint16_t *tail = NULL; /* the last rows, zero-padded to a whole tile */
    if (rest) {
        tail = (uint16_t *)aligned_alloc(64, (size_t)16 * k * sizeof(uint16_t));
        if (!tail) return -1;
        memset(tail, 0, (size_t)16 * k * sizeof(uint16_t));
        for (int r = 0; r < rest; r++)
            memcpy(tail + (int64_t)r * k, x + (int64_t)(full * 16 + r) * ldx, (size_t)k * 2);
    }
    const int blocks = full + (rest ? 1 : 0); /* row tiles */
    const int64_t tile_elems = 512;           /* bf16 per packed tile */
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        amx_configure_tiles();
        float c[256] __attribute__((aligned(64)));
        float bias_buf[16];
#pragma omp for schedule(static)
        for (int nb = 0; nb < nb_n; nb++) {
            const uint16_t *w = packed + (int64_t)nb * kb_n * tile_elems;
            float *bs = bias_of(bias, nb * 16, n, bias_buf);
            for (int t0 = 0; t0 < blocks; t0 += 5) {
                const int tn = blocks - t0 < 5 ? blocks - t0 : 5;
                const uint16_t *a[5];
                int64_t lda[5];
                for (int t = 0; t < tn; t++) {
                    const int tt = t0 + t;
                    a[t] = tt < full ? x + (int64_t)tt * 16 * ldx : tail;
                    lda[t] = (tt < full ? ldx : k) * 2;
                }
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                _tile_zero(4);
                for (int kb = 0; kb < kb_n; kb++) {
                    _tile_loadd(7, w + kb * tile_elems, 64);
                    /* row tiles load into two registers in turn, so a load need not wait for
                     * the product reading the last one */
#define AMX_ROW_TILE(t, reg)                                                                   \
    if (tn > t) {                                                                              \
        _tile_loadd(reg, a[t] + kb * 32, lda[t]);                                              \
        _tile_dpbf16ps(t, reg, 7);                                                             \
    }
                    AMX_ROW_TILE(0, 5)
                    AMX_ROW_TILE(1, 6)
                    AMX_ROW_TILE(2, 5)
                    AMX_ROW_TILE(3, 6)
                    AMX_ROW_TILE(4, 5)
#undef AMX_ROW_TILE
                }
#define AMX_STORE(t)                                                                           \
    if (tn > t) {                                                                              \
        _tile_stored(t, c, 64);                                                                \
        store_tile(c, t0 + t < full ? 16 : rest, bs, y + (int64_t)(t0 + t) * 16 * ldy, ldy,    \
                   nb * 16, n);                                                                \
    }
                AMX_STORE(0)
                AMX_STORE(1)
                AMX_STORE(2)
                AMX_STORE(3)
                AMX_STORE(4)
#undef AMX_STORE
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
