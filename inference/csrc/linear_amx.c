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
 * B in); features past N and inputs past K are zero. x is read in place, 16 rows a tile, when
 * K is a multiple of 32; a call's last rows short of 16 are first copied to a zeroed scratch
 * tile (the unit must not read past x).
 *
 * Work items are groups of 64 output features (4 tiles, wide enough for the weight to stream
 * at the memory's pace when there is one row) split over the threads; each walks every row
 * block against its group while the group's weight stays in cache. Row blocks of 32 use two A
 * tiles against two B tiles (four accumulators), of 16 one A tile against four B tiles.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) &&             \
    defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Asks the kernel for the AMX tile state (Linux keeps it off until a process asks).
 * Returns 0 when this process may use AMX. */
int docqa_amx_init(void) {
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return -1;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits)) return -1;
    return (bits & (1ul << XFEATURE_XTILEDATA)) ? 0 : -1;
}

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

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
    const int groups = (nb_n + 3) / 4;        /* 64-feature work items */
    const int64_t tile_elems = 512;           /* bf16 per packed tile */
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        configure_tiles();
        float c[4][256] __attribute__((aligned(64)));
        float bias_buf[4][16];
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            const int nb0 = g * 4, nbs = nb_n - nb0 < 4 ? nb_n - nb0 : 4;
            const uint16_t *w = packed + (int64_t)nb0 * kb_n * tile_elems;
            const int64_t wstride = (int64_t)kb_n * tile_elems; /* next feature tile */
            float *bs[4];
            for (int j = 0; j < nbs; j++) bs[j] = bias_of(bias, (nb0 + j) * 16, n, bias_buf[j]);
            int t = 0;
            /* pairs of full row tiles against pairs of feature tiles */
            for (; t + 1 < full; t += 2) {
                const uint16_t *a0 = x + (int64_t)t * 16 * ldx;
                const uint16_t *a1 = a0 + 16 * ldx;
                for (int j = 0; j < nbs; j += 2) {
                    const uint16_t *b0 = w + j * wstride;
                    const uint16_t *b1 = j + 1 < nbs ? b0 + wstride : b0;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int kb = 0; kb < kb_n; kb++) {
                        _tile_loadd(4, a0 + kb * 32, ldx * 2);
                        _tile_loadd(5, a1 + kb * 32, ldx * 2);
                        _tile_loadd(6, b0 + kb * tile_elems, 64);
                        _tile_loadd(7, b1 + kb * tile_elems, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    _tile_stored(2, c[2], 64);
                    _tile_stored(3, c[3], 64);
                    uint16_t *y0 = y + (int64_t)t * 16 * ldy;
                    store_tile(c[0], 16, bs[j], y0, ldy, (nb0 + j) * 16, n);
                    store_tile(c[2], 16, bs[j], y0 + 16 * ldy, ldy, (nb0 + j) * 16, n);
                    if (j + 1 < nbs) {
                        store_tile(c[1], 16, bs[j + 1], y0, ldy, (nb0 + j + 1) * 16, n);
                        store_tile(c[3], 16, bs[j + 1], y0 + 16 * ldy, ldy, (nb0 + j + 1) * 16,
                                   n);
                    }
                }
            }
            /* single row tiles (the last full one, the tail) against four feature tiles */
            for (; t < blocks; t++) {
                const int rows = t < full ? 16 : rest;
                const uint16_t *a = t < full ? x + (int64_t)t * 16 * ldx : tail;
                const int64_t lda = t < full ? ldx : k;
                const uint16_t *b0 = w, *b1 = w + wstride, *b2 = w + 2 * wstride,
                               *b3 = w + 3 * wstride;
                if (nbs < 4) b3 = b0;
                if (nbs < 3) b2 = b0;
                if (nbs < 2) b1 = b0;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int kb = 0; kb < kb_n; kb++) {
                    _tile_loadd(4, a + kb * 32, lda * 2);
                    _tile_loadd(6, b0 + kb * tile_elems, 64);
                    _tile_loadd(7, b1 + kb * tile_elems, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_loadd(6, b2 + kb * tile_elems, 64);
                    _tile_loadd(7, b3 + kb * tile_elems, 64);
                    _tile_dpbf16ps(2, 4, 6);
                    _tile_dpbf16ps(3, 4, 7);
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                _tile_stored(2, c[2], 64);
                _tile_stored(3, c[3], 64);
                uint16_t *yr = y + (int64_t)t * 16 * ldy;
                for (int j = 0; j < nbs; j++) store_tile(c[j], rows, bs[j], yr, ldy, (nb0 + j) * 16, n);
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
