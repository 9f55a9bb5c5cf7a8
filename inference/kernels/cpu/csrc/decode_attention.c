/* Paged attention on the CPU, read in place from the paged KV pool (no gather):
 *   - docqa_decode_attention: each decode token's query heads against its context, in float32
 *     from bf16 or float32 K/V (this part; float32 K/V register-tiled on x86 with FMA);
 *   - docqa_attention_bf16: every token of a step, prompt and decode, in bf16 products with
 *     float32 sums on AVX512-BF16 (the second part of this file).
 *
 * Layout (docs/interfaces.md, "Paged KV layout"): k_cache/v_cache are
 * [num_blocks, block_size, num_kv_heads, head_dim]; a token's block table row lists its blocks.
 *
 * Each query row (one query head of one token) walks its context from key 0 in rounds of ROUND
 * keys: its scores against the round's keys, one online-softmax rescale, then the weighted
 * values key by key. A work unit is one KV head of a group of tokens whose contexts start with
 * the same blocks (answers about one manual): the rounds of that shared part run once for all
 * the group's rows, each K/V row read once for all of them; then each token's own rounds run
 * for its rows alone. Every row does the same operations in the same order whichever rows
 * share its unit, and units are independent (threads only decide where a unit runs), so a
 * row's result depends only on its query, its context and the block size: never on how many
 * tokens share the call or a unit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_DIM 256
#define MAX_GROUP 16
#define MAX_ROWS 16 /* query rows in one unit */
#define MAX_UNIT_ROWS 48 /* the same on the register-tiled float32 path */
#define ROUND 64 /* keys per online-softmax round, from key 0 */

enum { DT_F32 = 0, DT_BF16 = 1 };

/* GCC/Clang vector extensions as wide as the target's vectors: 16 float lanes with AVX-512,
 * else 8 (vectors wider than the target's are split, and their shuffles and compares
 * lowered lane by lane). */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));
/* the same for unaligned loads: one vector load each (a memcpy may be split into halves
 * through the stack, which cost decode attention a third of its time on Zen 3) */
typedef float vf_u __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint32_t vu_u __attribute__((vector_size(LANES * 4), aligned(4)));
#if LANES == 16
#define LANE_IDS {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#else
#define LANE_IDS {0, 1, 2, 3, 4, 5, 6, 7}
#endif

static inline vf load16(const void *base, int64_t index, int dtype) {
    if (dtype == DT_BF16) {
        vh h;
        memcpy(&h, (const uint16_t *)base + index, sizeof h);
        vu u = __builtin_convertvector(h, vu) << 16;
        vf f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    vf f;
    memcpy(&f, (const float *)base + index, sizeof f);
    return f;
}

/* Lanes of a where mask is set, else lanes of b. */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* A K or V row of `chunks` * 16 values as float vectors, in the kernel's lane layout:
 * float32 rows in order (vector c holds values LANES * c .. LANES * c + LANES - 1); bf16 rows
 * with each 2 * LANES values split into their even (vector 2c) and odd (vector 2c + 1) ones,
 * which one vector load and a shift or a mask give. Dot products and weighted sums do not care how values map
 * to lanes as long as q and the output use the same map (to_layout, from_layout). */
static inline void load_row(const void *base, int64_t index, int dtype, int chunks, vf *out) {
    if (dtype == DT_BF16) {
        const uint16_t *p = (const uint16_t *)base + index;
        for (int c = 0; c < chunks; c += 2) {
            const vu u = *(const vu_u *)(p + c * LANES);
            vu even = u << 16, odd = u & 0xffff0000u;
            memcpy(&out[c], &even, sizeof even);
            memcpy(&out[c + 1], &odd, sizeof odd);
        }
    } else {
        const float *p = (const float *)base + index;
        for (int c = 0; c < chunks; c++) out[c] = *(const vf_u *)(p + c * LANES);
    }
}

/* Position in the layout of value i of a row. */
static inline int layout_pos(int i, int dtype) {
    if (dtype != DT_BF16) return i;
    const int chunk = i / (2 * LANES), k = i % (2 * LANES);
    return chunk * 2 * LANES + (k % 2) * LANES + k / 2;
}

/* lo > x ? lo : x, lane by lane (a NaN x stays), and floor(x): one instruction each where
 * the target has them, the same values either way */
#if LANES == 16 && defined(__AVX512F__)
static inline vf at_least(vf x, vf lo) { return (vf)_mm512_max_ps((__m512)lo, (__m512)x); }
static inline vf vfloor(vf x) { return (vf)_mm512_floor_ps((__m512)x); }
#elif LANES == 8 && defined(__AVX__)
static inline vf at_least(vf x, vf lo) { return (vf)_mm256_max_ps((__m256)lo, (__m256)x); }
static inline vf vfloor(vf x) { return (vf)_mm256_floor_ps((__m256)x); }
#else
static inline vf at_least(vf x, vf lo) { return vselect(x < lo, lo, x); }
static inline vf vfloor(vf x) {
    const vf n = __builtin_convertvector(__builtin_convertvector(x, vi), vf); /* toward zero */
    return n + __builtin_convertvector(n > x, vf);
}
#endif

/* exp(x) for x <= 0 (a score minus the running maximum), relative error about 2e-7:
 * x = n ln2 + r, exp(r) by a degree-6 polynomial (Cephes' expf), times 2^n. */
static inline vf exp_nonpositive(vf x) {
    const vf lo = (vf){0} - 87.0f;
    x = at_least(x, lo);
    const vf y0 = x * 1.44269504088896341f + 0.5f;
    const vf n = vfloor(y0);
    vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf z = r * r;
    vf y = r * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* Lanes [a0+a1, a2+a3, ..., b0+b1, b2+b3, ...]. */
static inline vf pair_sums(vf a, vf b) {
#if LANES == 16
    const vi even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
#else
    const vi even = {0, 2, 4, 6, 8, 10, 12, 14};
    const vi odd = {1, 3, 5, 7, 9, 11, 13, 15};
#endif
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* p[j] holds key j's LANES partial products; lane j of the result is their sum (a fixed
 * tree: pairs of lanes, then pairs of pairs, ...). */
static inline vf reduce16(const vf *p) {
    vf t[LANES];
#pragma GCC unroll 16
    for (int j = 0; j < LANES; j++) t[j] = p[j];
#pragma GCC unroll 4
    for (int w = LANES; w > 1; w /= 2)
#pragma GCC unroll 8
        for (int i = 0; i < w / 2; i++) t[i] = pair_sums(t[2 * i], t[2 * i + 1]);
    return t[0];
}

/* Lane l combined with lane l + LANES/2, then l + LANES/4, ... (rotations within halves). */
#if LANES == 16
#define HALVES(apply)                                                                          \
    apply(((vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));                       \
    apply(((vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));                       \
    apply(((vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));                       \
    apply(((vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}))
#else
#define HALVES(apply)                                                                          \
    apply(((vi){4, 5, 6, 7, 0, 1, 2, 3}));                                                     \
    apply(((vi){2, 3, 0, 1, 6, 7, 4, 5}));                                                     \
    apply(((vi){1, 0, 3, 2, 5, 4, 7, 6}))
#endif

/* Sum and maximum of the lanes, by a fixed tree. */
static inline float hsum(vf v) {
#define ADD_HALF(idx) v += __builtin_shuffle(v, idx)
    HALVES(ADD_HALF);
#undef ADD_HALF
    return v[0];
}

static inline float hmax(vf v) {
    vf w;
#define MAX_HALF(idx) (w = __builtin_shuffle(v, idx), v = vselect(v > w, v, w))
    HALVES(MAX_HALF);
#undef MAX_HALF
    return v[0];
}

/* One row's online-softmax step over a round: its first nv scores in s (nv >= 1; vectors of
 * LANES keys) become the round's weights, the rest of `vecs` vectors zero; its running maximum
 * m and sum l take the round in. Returns the factor its output is rescaled by. */
static inline __attribute__((always_inline)) float round_softmax_of(float *s, int nv, int vecs,
                                                                     float *m, float *l,
                                                                     const int FULL) {
    const vi lane_ids = LANE_IDS;
    const vf zero = {0};
    const int groups = (nv + LANES - 1) / LANES;
    vf mx = FULL ? *(const vf_u *)s : vselect(lane_ids < nv, *(const vf_u *)s, zero + s[0]);
    for (int q16 = 1; q16 < groups; q16++) {
        const vf v = *(const vf_u *)(s + q16 * LANES);
        const vf x = FULL ? v : vselect(lane_ids < nv - q16 * LANES, v, mx);
        mx = vselect(x > mx, x, mx);
    }
    const float bm = hmax(mx);
    const float mn = *m > bm ? *m : bm;
    vf sum = zero;
    for (int q16 = 0; q16 < groups; q16++) {
        vf w = exp_nonpositive(*(const vf_u *)(s + q16 * LANES) - mn);
        if (!FULL) w = (vf)((vi)w & (lane_ids < nv - q16 * LANES));
        *(vf_u *)(s + q16 * LANES) = w;
        sum += w;
    }
    for (int q16 = groups; q16 < vecs; q16++) *(vf_u *)(s + q16 * LANES) = zero;
    const float alpha = exp_nonpositive(zero + (*m - mn))[0];
    *l = *l * alpha + hsum(sum);
    *m = mn;
    return alpha;
}

/* round_softmax_of, its masks left out when every lane of the round holds a key (the same
 * values: a full round's masks keep every lane) */
static inline float round_softmax(float *s, int nv, int vecs, float *m, float *l) {
    return nv % LANES == 0 ? round_softmax_of(s, nv, vecs, m, l, 1)
                           : round_softmax_of(s, nv, vecs, m, l, 0);
}

/* A unit's query rows and their running softmax state. */
typedef struct {
    vf q[MAX_ROWS][MAX_DIM / LANES];
    vf acc[MAX_ROWS][MAX_DIM / LANES];
    float m[MAX_ROWS], l[MAX_ROWS];
} Rows;

/* Element offsets of the next `count` keys of a block table, from the running block position
 * (blk, in_blk; advanced past them): each key's row of KV head kv_head, head size `dim`. */
#define KEY_ROWS(dst, count, dim)                                                              \
    for (int j = 0; j < (count); j++) {                                                        \
        (dst)[j] = ((int64_t)table[blk] * block_size + in_blk) * key_stride +                 \
                   (int64_t)kv_head * (dim);                                                   \
        if (++in_blk == block_size) {                                                          \
            in_blk = 0;                                                                        \
            blk++;                                                                             \
        }                                                                                      \
    }

/* Keys [from, to) of one context (from a multiple of ROUND) for rows [lo, hi). */
static inline __attribute__((always_inline)) void run_keys(
    Rows *st, int lo, int hi, const void *k_cache, const void *v_cache, int kv_dtype,
    const int32_t *table, int from, int to, int kv_head, int num_kv_heads, int chunks,
    int block_size) {
    const int dim = chunks * LANES;
    const int64_t key_stride = (int64_t)num_kv_heads * dim;
    const vf zero = {0};
    const vf neg_inf = zero - INFINITY;
    const vi lane_ids = LANE_IDS;
    vf part[MAX_ROWS][LANES];
    vf kv[MAX_DIM / LANES];
    vf s[MAX_ROWS][ROUND / LANES];
    int64_t at[2][ROUND]; /* element offset of each key's row: this round, the next */
    const int esize = kv_dtype == DT_BF16 ? 2 : 4;
    const int row_bytes = dim * esize;
    int blk = from / block_size, in_blk = from % block_size;
    /* a context's blocks lie anywhere in a pool far larger than the caches, and a KV head's
     * row is a few lines of each key's: the hardware prefetcher does not follow them. The
     * next round's K and V rows are fetched while this one computes (the first round's V
     * rows while its scores are computed); prefetches change no result. */
    KEY_ROWS(at[0], to - from < ROUND ? to - from : ROUND, dim);
    for (int r0 = from, cur = 0; r0 < to; r0 += ROUND, cur ^= 1) {
        const int n = to - r0 < ROUND ? to - r0 : ROUND;
        const int groups = (n + LANES - 1) / LANES;
        const int64_t *row_at = at[cur];
        const int n2 = r0 + ROUND < to ? (to - r0 - ROUND < ROUND ? to - r0 - ROUND : ROUND) : 0;
        KEY_ROWS(at[cur ^ 1], n2, dim);
        const int64_t *next_at = at[cur ^ 1];
        /* scores of the rows against the round's keys, LANES keys per vector */
        for (int q16 = 0; q16 < groups; q16++) {
            const int j0 = q16 * LANES;
            const int nj = n - j0 < LANES ? n - j0 : LANES;
            for (int j = 0; j < nj; j++) {
                /* the next round's rows of this key, spread over the round's work */
                if (j0 + j < n2)
                    for (int c = 0; c < row_bytes; c += 64) {
                        __builtin_prefetch((const char *)k_cache + next_at[j0 + j] * esize + c, 0, 2);
                        __builtin_prefetch((const char *)v_cache + next_at[j0 + j] * esize + c, 0, 2);
                    }
                if (r0 == from)
                    for (int c = 0; c < row_bytes; c += 64)
                        __builtin_prefetch((const char *)v_cache + row_at[j0 + j] * esize + c, 0, 2);
                load_row(k_cache, row_at[j0 + j], kv_dtype, chunks, kv);
                for (int g = lo; g < hi; g++) {
                    vf d = st->q[g][0] * kv[0];
                    for (int c = 1; c < chunks; c++) d += st->q[g][c] * kv[c];
                    part[g][j] = d;
                }
            }
            for (int j = nj; j < LANES; j++)
                for (int g = lo; g < hi; g++) part[g][j] = zero;
            const vi valid = lane_ids < nj;
            for (int g = lo; g < hi; g++) s[g][q16] = vselect(valid, reduce16(part[g]), neg_inf);
        }
        /* online softmax, once per round: the round's maximum, its weights, the rescale */
        for (int g = lo; g < hi; g++) {
            const float alpha = round_softmax((float *)s[g], n, groups, &st->m[g], &st->l[g]);
            for (int c = 0; c < chunks; c++) st->acc[g][c] *= alpha;
        }
        for (int j = 0; j < n; j++) {
            load_row(v_cache, row_at[j], kv_dtype, chunks, kv);
            for (int g = lo; g < hi; g++) {
                const float pj = s[g][j / LANES][j % LANES];
                for (int c = 0; c < chunks; c++) st->acc[g][c] += pj * kv[c];
            }
        }
    }
}

/* One KV head of a group of tokens: token i's query heads are rows i * group .. + group. */
static inline __attribute__((always_inline)) void attend_unit(
    const void *q, int q_dtype, const int64_t *q_rows, int members, const int32_t *tables,
    int64_t table_stride, const int32_t *ctx, int shared, int kv_head, int group,
    int num_kv_heads, int chunks, const void *k_cache, const void *v_cache, int kv_dtype,
    int block_size, float scale, float *out) {
    const int dim = chunks * LANES;
    const int num_heads = group * num_kv_heads;
    const vf zero = {0};
    Rows st;
    for (int i = 0; i < members; i++)
        for (int g = 0; g < group; g++) {
            const int r = i * group + g;
            const int64_t head = q_rows[i] + (int64_t)(kv_head * group + g) * dim;
            float qf[MAX_DIM], ql[MAX_DIM];
            for (int c = 0; c < chunks; c++) {
                vf x = load16(q, head + c * LANES, q_dtype);
                memcpy(&qf[c * LANES], &x, sizeof x);
            }
            for (int d = 0; d < dim; d++) ql[layout_pos(d, kv_dtype)] = qf[d];
            for (int c = 0; c < chunks; c++) {
                memcpy(&st.q[r][c], &ql[c * LANES], sizeof(vf));
                st.q[r][c] *= scale;
                st.acc[r][c] = zero;
            }
            st.m[r] = -INFINITY;
            st.l[r] = 0.0f;
        }
    if (shared > 0)
        run_keys(&st, 0, members * group, k_cache, v_cache, kv_dtype, tables, 0, shared,
                 kv_head, num_kv_heads, chunks, block_size);
    for (int i = 0; i < members; i++)
        run_keys(&st, i * group, (i + 1) * group, k_cache, v_cache, kv_dtype,
                 tables + i * table_stride, shared, ctx[i], kv_head, num_kv_heads, chunks,
                 block_size);
    for (int i = 0; i < members; i++)
        for (int g = 0; g < group; g++) {
            const int r = i * group + g;
            float *o = out + ((int64_t)i * num_heads + kv_head * group + g) * dim;
            const float inv = 1.0f / st.l[r];
            float res[MAX_DIM];
            for (int c = 0; c < chunks; c++) {
                vf x = st.acc[r][c] * inv;
                memcpy(&res[c * LANES], &x, sizeof x);
            }
            for (int d = 0; d < dim; d++) o[d] = res[layout_pos(d, kv_dtype)];
        }
}

/* The unit for the common shapes, with the head size and dtype known to the compiler. */
#define SPECIALIZED(name, CHUNKS, DTYPE)                                                         \
    static void name(const void *q, const int64_t *q_rows, int members, const int32_t *tables,  \
                     int64_t table_stride, const int32_t *ctx, int shared, int kv_head,          \
                     int group, int num_kv_heads, const void *k_cache, const void *v_cache,      \
                     int block_size, float scale, float *out) {                                  \
        attend_unit(q, DTYPE, q_rows, members, tables, table_stride, ctx, shared, kv_head,      \
                    group, num_kv_heads, CHUNKS, k_cache, v_cache, DTYPE, block_size, scale,     \
                    out);                                                                        \
    }
SPECIALIZED(unit_d64_bf16, 64 / LANES, DT_BF16)
SPECIALIZED(unit_d64_f32, 64 / LANES, DT_F32)
SPECIALIZED(unit_d128_bf16, 128 / LANES, DT_BF16)

static void unit_any(const void *q, int q_dtype, const int64_t *q_rows, int members,
                     const int32_t *tables, int64_t table_stride, const int32_t *ctx, int shared,
                     int kv_head, int group, int num_kv_heads, int chunks, const void *k_cache,
                     const void *v_cache, int kv_dtype, int block_size, float scale, float *out) {
    attend_unit(q, q_dtype, q_rows, members, tables, table_stride, ctx, shared, kv_head, group,
                num_kv_heads, chunks, k_cache, v_cache, kv_dtype, block_size, scale, out);
}

/* ---------------------------------------------------------------------------------------------
 * float32 K/V on x86 with FMA: the same rounds, register-tiled.
 *
 * Per round and unit, the round's K rows are transposed into KT[dim][ROUND] (8 x 8 blocks), so
 * a tile of up to TILE_ROWS rows and TILE_VECS vectors of keys keeps its scores in registers:
 * score(r, j) is one fused multiply-add chain over the dims 0 .. dim - 1 in order, from zero.
 * The weighted values go the other way: a tile of rows by TILE_VECS vectors of dims holds its
 * outputs in registers while the round's V rows stream past, out(r, :) first rescaled by the
 * round's alpha and then gaining p(r, j) V(j, :) for j = 0, 1, ... in order. Neither order
 * depends on which rows share the tile or the unit, so a row's bits stay a function of its
 * query, its context and the block size, as above. A unit holds up to MAX_UNIT_ROWS rows (16
 * tokens of 3 query heads per KV head: the K transpose serves them all), and a prompt chunk's
 * tokens walk the chunk's last context together, each row masked at its own.
 * ------------------------------------------------------------------------------------------- */
#if defined(__AVX__) && defined(__FMA__)
#include <immintrin.h>
#include "scratch.h"
#define TILED_F32 1
#define TILE_ROWS 6
#define TILE_VECS 2 /* vectors of keys per score tile, of dims per output tile */

#if LANES == 16
#define VFMA(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#define VBCAST(p) ((vf)_mm512_set1_ps(*(p)))
#else
#define VFMA(a, b, c) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#define VBCAST(p) ((vf)_mm256_broadcast_ss(p))
#endif

static const float zero_row[MAX_DIM];

/* dims c0 .. c0 + 7 of 8 rows -> 8 rows of dst (stride ROUND): dst[i][j] = rows[j][c0 + i] */
static inline void transpose8(const float *const *rows, int c0, float *dst) {
    const __m256 r0 = _mm256_loadu_ps(rows[0] + c0), r1 = _mm256_loadu_ps(rows[1] + c0);
    const __m256 r2 = _mm256_loadu_ps(rows[2] + c0), r3 = _mm256_loadu_ps(rows[3] + c0);
    const __m256 r4 = _mm256_loadu_ps(rows[4] + c0), r5 = _mm256_loadu_ps(rows[5] + c0);
    const __m256 r6 = _mm256_loadu_ps(rows[6] + c0), r7 = _mm256_loadu_ps(rows[7] + c0);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst + 0 * ROUND, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + 1 * ROUND, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * ROUND, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * ROUND, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * ROUND, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * ROUND, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * ROUND, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * ROUND, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* A unit's rows: queries (scaled), outputs and softmax state, dims in order. */
typedef struct {
    float q[MAX_UNIT_ROWS][MAX_DIM];
    float acc[MAX_UNIT_ROWS][MAX_DIM];
    float m[MAX_UNIT_ROWS], l[MAX_UNIT_ROWS];
    float s[MAX_UNIT_ROWS][ROUND]; /* the round's scores, then weights */
    float kt[MAX_DIM * ROUND];     /* the round's K, transposed */
    const float *kt_rows[MAX_DIM]; /* its rows, dim by dim */
    /* the next round's K and V lines, fetched one per step of the round's products */
    const char *ahead[2 * ROUND * (MAX_DIM * 4 / 64)];
    int ahead_at, ahead_n;
    /* 8-bit caches: the round's K and V rows times their scales (kv8_rows) */
    float kq[ROUND][MAX_DIM], vq[ROUND][MAX_DIM];
    float ksc[MAX_DIM], vsc[MAX_DIM]; /* the unit's KV head's scales (fp8's times 2^8) */
} TiledRows;

#if defined(__AVX2__) && defined(__F16C__)
#define TILED_KV8 1
/* 8 values of an 8-bit row as float32: int8 (fmt 1), or fp8 e4m3 (fmt 2) through a half
 * float's bits, which read 2^-8 times the value (the scales carry the 2^8). */
static inline __m256 kv8_load8(const uint8_t *p, int fmt) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    if (fmt == 1) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m128i w = _mm_cvtepu8_epi16(b);
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    const __m128i rest = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7f)), 7);
    return _mm256_cvtph_ps(_mm_or_si128(sign, rest));
}

/* n rows of an 8-bit cache (element offsets at[j]) times their channels' scales: exact, the
 * scales being powers of two (inference/kv_quant.py). */
static inline void kv8_rows(float (*dst)[MAX_DIM], const uint8_t *src, const int64_t *at, int n,
                            const float *sc, int dim, int fmt) {
    for (int j = 0; j < n; j++) {
        const uint8_t *r = src + at[j];
        for (int c = 0; c < dim; c += 8)
            _mm256_storeu_ps(dst[j] + c,
                             _mm256_mul_ps(kv8_load8(r + c, fmt), _mm256_loadu_ps(sc + c)));
    }
}
#endif

static inline __attribute__((always_inline)) void fetch_ahead(TiledRows *st, int *at) {
    if (*at < st->ahead_n) __builtin_prefetch(st->ahead[(*at)++], 0, 2);
}

/* The tiles of both products: for rows r < MR and TILE_VECS vectors v from column col,
 *   out[r][v] = start + sum over i = 0, 1, ..., n - 1 of a[r][i] * b_i[col + v]
 * in that order, one fused multiply-add chain per element, start zero (scale NULL) or
 * out[r][v] * scale[r]: scores (a the queries, b_i the transposed K's dim i, i over the
 * dims) and weighted values (a the weights, b_i key i's V row, i over the round's keys).
 * Every EVERY-th step (1 or 2) also fetches one of the next round's lines. */
static inline __attribute__((always_inline)) void tile_products(
    TiledRows *st, const float *a, int lda, const float *const *b, int col, int n, float *out,
    int ldo, const float *scale, const int MR, const int EVERY) {
    vf acc[TILE_ROWS][TILE_VECS];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < TILE_VECS; v++)
            acc[r][v] = scale ? *(const vf_u *)(out + r * ldo + v * LANES) * scale[r] : (vf){0};
    int ahead = st->ahead_at;
    for (int i = 0; i < n; i++) {
        if (EVERY == 1 || i % EVERY == 0) fetch_ahead(st, &ahead);
        vf x[TILE_VECS];
#pragma GCC unroll 4
        for (int v = 0; v < TILE_VECS; v++) x[v] = *(const vf_u *)(b[i] + col + v * LANES);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            const vf ab = VBCAST(a + r * lda + i);
#pragma GCC unroll 4
            for (int v = 0; v < TILE_VECS; v++) acc[r][v] = VFMA(ab, x[v], acc[r][v]);
        }
    }
    st->ahead_at = ahead;
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < TILE_VECS; v++) *(vf_u *)(out + r * ldo + v * LANES) = acc[r][v];
}

#define TILE_FN(MR, EVERY)                                                                     \
    static void products_##MR##_##EVERY(TiledRows *st, const float *a, int lda,                 \
                                        const float *const *b, int col, int n, float *out,      \
                                        int ldo, const float *scale) {                          \
        tile_products(st, a, lda, b, col, n, out, ldo, scale, MR, EVERY);                      \
    }
TILE_FN(1, 1) TILE_FN(2, 1) TILE_FN(3, 1) TILE_FN(4, 1) TILE_FN(5, 1) TILE_FN(6, 1)
TILE_FN(1, 2) TILE_FN(2, 2) TILE_FN(3, 2) TILE_FN(4, 2) TILE_FN(5, 2) TILE_FN(6, 2)
typedef void (*products_fn)(TiledRows *, const float *, int, const float *const *, int, int,
                            float *, int, const float *);
/* by rows, fetching a line of the next round every step or every other step */
static const products_fn products[2][TILE_ROWS + 1] = {
    {0, products_1_1, products_2_1, products_3_1, products_4_1, products_5_1, products_6_1},
    {0, products_1_2, products_2_2, products_3_2, products_4_2, products_5_2, products_6_2}};

/* A unit's walk over keys: the group's shared ones for all its rows, or a token's own. */
typedef struct {
    int lo, hi;           /* its rows */
    const int32_t *table; /* its block table */
    int from, to;         /* its keys */
} Walk;

/* A walk's keys [from, to) of one context (from a multiple of ROUND) for its rows [lo, hi),
 * row g seeing the keys before lim[g - lo] only: a masked key weighs exactly zero and a round without a
 * key for a row leaves its state as it was, so a row walked with keys past its context gets
 * the bits of its own walk (a prompt chunk's tokens walk the chunk's last context together).
 * `next` is the unit's next walk, if any: its first round is fetched during this one's last;
 * `fetched`: this walk's first round was fetched so, by the walk before it. */
static void tiled_keys(TiledRows *st, const Walk *walk, const Walk *next, int fetched,
                       const int *lim, const void *k_cache, const void *v_cache, int kv_head,
                       int num_kv_heads, int dim, int block_size, int fmt) {
    const int esz = fmt ? 1 : 4; /* bytes per cache element: float32, or 8-bit (fmt 1, 2) */
    const int lo = walk->lo, hi = walk->hi, from = walk->from, to = walk->to;
    const int32_t *const table = walk->table;
    const int64_t key_stride = (int64_t)num_kv_heads * dim;
    int64_t at[2][ROUND];
    const float *krows[ROUND], *vrows[ROUND];
    float alpha[MAX_UNIT_ROWS];
    int blk = from / block_size, in_blk = from % block_size;
    KEY_ROWS(at[0], to - from < ROUND ? to - from : ROUND, dim);
    for (int r0 = from, cur = 0; r0 < to; r0 += ROUND, cur ^= 1) {
        const int n = to - r0 < ROUND ? to - r0 : ROUND;
        const int n2 = r0 + ROUND < to ? (to - r0 - ROUND < ROUND ? to - r0 - ROUND : ROUND) : 0;
        KEY_ROWS(at[cur ^ 1], n2, dim);
        /* the round's key vectors, whole tiles of them (keys past n read a row of zeros) */
        const int kvecs = (n + TILE_VECS * LANES - 1) / (TILE_VECS * LANES) * TILE_VECS;
#ifdef TILED_KV8
        if (fmt) { /* the round's rows dequantized: the products read them as float32 rows */
            kv8_rows(st->kq, (const uint8_t *)k_cache, at[cur], n, st->ksc, dim, fmt);
            kv8_rows(st->vq, (const uint8_t *)v_cache, at[cur], n, st->vsc, dim, fmt);
        }
#endif
        for (int j = 0; j < kvecs * LANES; j++) {
            if (j >= n) {
                krows[j] = vrows[j] = zero_row;
            } else if (fmt) {
                krows[j] = st->kq[j];
                vrows[j] = st->vq[j];
            } else {
                krows[j] = (const float *)k_cache + at[cur][j];
                vrows[j] = (const float *)v_cache + at[cur][j];
            }
        }
        /* the next round's K and V rows are fetched while this one computes, a line per
         * step of the score and value tiles (a context's blocks lie anywhere in the pool,
         * the hardware prefetcher does not follow them, and a whole round's lines at once
         * fill the core's miss queue); what the tiles leave goes after them */
        st->ahead_n = st->ahead_at = 0;
        for (int j = 0; j < n2; j++)
            for (int c = 0; c < dim * esz; c += 64) {
                st->ahead[st->ahead_n++] = (const char *)k_cache + at[cur ^ 1][j] * esz + c;
                st->ahead[st->ahead_n++] = (const char *)v_cache + at[cur ^ 1][j] * esz + c;
            }
        if (n2 == 0 && next != NULL) { /* the last round: the next walk's first one */
            const int32_t *table = next->table; /* KEY_ROWS over the next walk's table */
            int blk = next->from / block_size, in_blk = next->from % block_size;
            const int m = next->to - next->from < ROUND ? next->to - next->from : ROUND;
            int64_t first[ROUND];
            KEY_ROWS(first, m, dim);
            for (int j = 0; j < m; j++)
                for (int c = 0; c < dim * esz; c += 64) {
                    st->ahead[st->ahead_n++] = (const char *)k_cache + first[j] * esz + c;
                    st->ahead[st->ahead_n++] = (const char *)v_cache + first[j] * esz + c;
                }
        }
        /* a line every other step where the round's tile steps (the score tiles' over the
         * dims, the value tiles' over the keys) are twice its lines or more, else every step */
        const int tiles = (hi - lo + TILE_ROWS - 1) / TILE_ROWS;
        const int spread =
            tiles * (kvecs / TILE_VECS * dim + dim / LANES / TILE_VECS * n) >= 2 * st->ahead_n;
        if (r0 == from && !fetched) /* the first round's V rows, while its K rows are read */
            for (int j = 0; j < n; j++)
                for (int c = 0; c < dim * 4; c += 64)
                    __builtin_prefetch((const char *)vrows[j] + c, 0, 2);
        for (int j = 0; j < kvecs * LANES; j += 8)
            for (int c = 0; c < dim; c += 8) transpose8(krows + j, c, st->kt + c * ROUND + j);
        for (int kv = 0; kv < kvecs; kv += TILE_VECS)
            for (int r = lo; r < hi; r += TILE_ROWS)
                products[spread][hi - r < TILE_ROWS ? hi - r : TILE_ROWS](
                    st, st->q[r], MAX_DIM, st->kt_rows, kv * LANES, dim, st->s[r] + kv * LANES,
                    ROUND, NULL);
        /* online softmax, once per round: the round's maximum, its weights, the rescale */
        for (int g = lo; g < hi; g++) {
            const int nv = lim[g - lo] - r0 < n ? lim[g - lo] - r0 : n; /* the row's keys */
            if (nv > 0) {
                alpha[g - lo] = round_softmax(st->s[g], nv, kvecs, &st->m[g], &st->l[g]);
            } else { /* no key for this row: its state stays as it was */
                memset(st->s[g], 0, sizeof st->s[g]);
                alpha[g - lo] = 1.0f;
            }
        }
        for (int c = 0; c < dim / LANES; c += TILE_VECS)
            for (int r = lo; r < hi; r += TILE_ROWS)
                products[spread][hi - r < TILE_ROWS ? hi - r : TILE_ROWS](
                    st, st->s[r], ROUND, vrows, c * LANES, n, st->acc[r] + c * LANES, MAX_DIM,
                    alpha + (r - lo));
        while (st->ahead_at < st->ahead_n) fetch_ahead(st, &st->ahead_at);
    }
}

/* A thread's TiledRows (too large for a worker thread's stack), its transposed K's row
 * pointers set when it is allocated. */
THREAD_SCRATCH(tiled_rows, sizeof(TiledRows))

static TiledRows *tiled_scratch(void) {
    int fresh;
    TiledRows *st = tiled_rows(&fresh);
    if (fresh)
        for (int d = 0; d < MAX_DIM; d++) st->kt_rows[d] = st->kt + d * ROUND;
    return st;
}

/* attend_unit on the register-tiled path (docqa_decode_attention_tiled): 0, or -1 when the
 * thread's scratch cannot be allocated. */
static int tiled_unit(const float *q, const int64_t *q_rows, int members, const int32_t *tables,
                       int64_t table_stride, const int32_t *ctx, int shared, int kv_head,
                       int group, int num_kv_heads, int dim, const void *k_cache,
                       const void *v_cache, int block_size, float scale, float *out, int fmt,
                       const float *k_scale, const float *v_scale) {
    const int num_heads = group * num_kv_heads;
    TiledRows *const st = tiled_scratch();
    if (st == NULL) return -1;
    for (int d = 0; fmt && d < dim; d++) { /* 8-bit caches: this KV head's scales */
        const float unit = fmt == 2 ? 256.0f : 1.0f;
        st->ksc[d] = k_scale[kv_head * dim + d] * unit;
        st->vsc[d] = v_scale[kv_head * dim + d] * unit;
    }
    for (int i = 0; i < members; i++)
        for (int g = 0; g < group; g++) {
            const int r = i * group + g;
            const float *src = q + q_rows[i] + (int64_t)(kv_head * group + g) * dim;
            for (int d = 0; d < dim; d++) {
                st->q[r][d] = src[d] * scale;
                st->acc[r][d] = 0.0f;
            }
            st->m[r] = -INFINITY;
            st->l[r] = 0.0f;
        }
    int lim[MAX_UNIT_ROWS];
    for (int r = 0; r < members * group; r++) lim[r] = ctx[r / group];
    /* the group's shared keys for all its rows, then each token's own for its rows; each walk
     * fetches the next one's first round during its last */
    Walk walks[MAX_UNIT_ROWS + 1];
    int nw = 0;
    if (shared > 0) walks[nw++] = (Walk){0, members * group, tables, 0, shared};
    for (int i = 0; i < members; i++)
        if (ctx[i] > shared)
            walks[nw++] = (Walk){i * group, (i + 1) * group, tables + i * table_stride, shared,
                                 ctx[i]};
    for (int w = 0; w < nw; w++)
        tiled_keys(st, &walks[w], w + 1 < nw ? &walks[w + 1] : NULL, w > 0, lim + walks[w].lo,
                   k_cache, v_cache, kv_head, num_kv_heads, dim, block_size, fmt);
    for (int i = 0; i < members; i++)
        for (int g = 0; g < group; g++) {
            const int r = i * group + g;
            float *o = out + ((int64_t)i * num_heads + kv_head * group + g) * dim;
            const float inv = 1.0f / st->l[r];
            for (int d = 0; d < dim; d++) o[d] = st->acc[r][d] * inv;
        }
    return 0;
}
#endif

/* Whether float32 queries over 8-bit caches of this head size take the register-tiled path
 * (docqa_decode_attention_kv8; AVX2 with F16C): 1, else 0. */
int docqa_decode_attention_kv8_tiled(int dim) {
#if defined(TILED_F32) && defined(TILED_KV8)
    return dim % (TILE_VECS * LANES) == 0 && dim % 8 == 0 && dim <= MAX_DIM;
#else
    (void)dim;
    return 0;
#endif
}

/* Whether float32 units of these dtypes and head size take the register-tiled path: then a
 * unit holds up to 48 query rows, and a group's shared keys may also run past every context of
 * the group, each row masked at its own (a prompt chunk's tokens on one table). */
int docqa_decode_attention_tiled(int q_dtype, int kv_dtype, int dim) {
#ifdef TILED_F32
    return q_dtype == DT_F32 && kv_dtype == DT_F32 && dim % (TILE_VECS * LANES) == 0 &&
           dim <= MAX_DIM;
#else
    (void)q_dtype, (void)kv_dtype, (void)dim;
    return 0;
#endif
}

/* Returns 0, or -1 when a shape is outside the kernel's limits (the caller checks them first).
 *
 * Tokens come in groups: group u holds tokens group_start[u] .. group_start[u + 1] - 1, whose
 * contexts share their first group_shared[u] keys (a multiple of 64, 0 for none; the first
 * token's table is read for them), at most MAX_ROWS / (num_heads / num_kv_heads) tokens. On
 * the tiled path (docqa_decode_attention_tiled) a group holds up to MAX_UNIT_ROWS rows, and
 * group_shared[u] may instead be at least every context of the group (one table for all).
 *
 * q:            query rows, head after head (dim elements each) from element q_rows[t] for token t
 * block_tables: int32 [num_tokens, table_stride], token t's blocks
 * ctx_lens:     int32 [num_tokens], keys each token attends (its own key included, already stored)
 * out:          float32 [num_tokens, num_heads, dim]
 * num_threads:  threads for the units (the caller's torch.get_num_threads())
 */
static int decode_attention(const void *q, int q_dtype, const int64_t *q_rows, int num_tokens,
                            const int32_t *group_start, const int32_t *group_shared,
                            int num_groups, const void *k_cache, const void *v_cache,
                            int kv_dtype, const int32_t *block_tables, int64_t table_stride,
                            const int32_t *ctx_lens, int num_heads, int num_kv_heads, int dim,
                            int block_size, float scale, float *out, int num_threads, int fmt,
                            const float *k_scale, const float *v_scale) {
    if (dim % (2 * LANES) || dim > MAX_DIM || block_size <= 0 || num_kv_heads <= 0 ||
        num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP)
        return -1;
    const int group = num_heads / num_kv_heads;
    const int tiled = fmt ? docqa_decode_attention_kv8_tiled(dim)
                          : docqa_decode_attention_tiled(q_dtype, kv_dtype, dim);
    if (fmt && (!tiled || q_dtype != DT_F32 || !k_scale || !v_scale)) return -1;
    for (int u = 0; u < num_groups; u++) {
        const int members = group_start[u + 1] - group_start[u];
        if (members < 1 || members * group > (tiled ? MAX_UNIT_ROWS : MAX_ROWS) ||
            group_start[u + 1] > num_tokens)
            return -1;
        if (group_shared[u] % ROUND) { /* past every context of the group, tiled only */
            if (!tiled) return -1;
            for (int t = group_start[u]; t < group_start[u + 1]; t++)
                if (ctx_lens[t] > group_shared[u]) return -1;
        }
    }
    const int units = num_groups * num_kv_heads;
    int failed = 0; /* a thread's scratch could not be allocated */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads > 0 ? num_threads : 1) \
    reduction(| : failed)
    for (int u = 0; u < units; u++) {
        const int grp = u / num_kv_heads, h = u % num_kv_heads;
        const int t = group_start[grp], members = group_start[grp + 1] - t;
        const int32_t *tables = block_tables + (int64_t)t * table_stride;
        float *o = out + (int64_t)t * num_heads * dim;
        const int shared = group_shared[grp];
#ifdef TILED_F32
        if (tiled)
            failed |= tiled_unit((const float *)q, q_rows + t, members, tables, table_stride,
                                 ctx_lens + t, shared, h, group, num_kv_heads, dim, k_cache,
                                 v_cache, block_size, scale, o, fmt, k_scale, v_scale);
        else
#endif
        if (dim == 64 && q_dtype == kv_dtype && q_dtype == DT_BF16)
            unit_d64_bf16(q, q_rows + t, members, tables, table_stride, ctx_lens + t, shared, h,
                          group, num_kv_heads, k_cache, v_cache, block_size, scale, o);
        else if (dim == 64 && q_dtype == kv_dtype && q_dtype == DT_F32)
            unit_d64_f32(q, q_rows + t, members, tables, table_stride, ctx_lens + t, shared, h,
                         group, num_kv_heads, k_cache, v_cache, block_size, scale, o);
        else if (dim == 128 && q_dtype == kv_dtype && q_dtype == DT_BF16)
            unit_d128_bf16(q, q_rows + t, members, tables, table_stride, ctx_lens + t, shared,
                           h, group, num_kv_heads, k_cache, v_cache, block_size, scale, o);
        else
            unit_any(q, q_dtype, q_rows + t, members, tables, table_stride, ctx_lens + t, shared,
                     h, group, num_kv_heads, dim / LANES, k_cache, v_cache, kv_dtype, block_size,
                     scale, o);
    }
    return failed ? -1 : 0;
}

int docqa_decode_attention(const void *q, int q_dtype, const int64_t *q_rows, int num_tokens,
                           const int32_t *group_start, const int32_t *group_shared,
                           int num_groups, const void *k_cache, const void *v_cache,
                           int kv_dtype, const int32_t *block_tables, int64_t table_stride,
                           const int32_t *ctx_lens, int num_heads, int num_kv_heads, int dim,
                           int block_size, float scale, float *out, int num_threads) {
    return decode_attention(q, q_dtype, q_rows, num_tokens, group_start, group_shared,
                            num_groups, k_cache, v_cache, kv_dtype, block_tables, table_stride,
                            ctx_lens, num_heads, num_kv_heads, dim, block_size, scale, out,
                            num_threads, 0, NULL, NULL);
}

/* docqa_decode_attention with float32 queries over 8-bit caches (kv_format 1 int8, 2 fp8 e4m3)
 * and their scales [num_kv_heads * dim], on the register-tiled path only (kv8_tiled). */
int docqa_decode_attention_kv8(const void *q, const int64_t *q_rows, int num_tokens,
                               const int32_t *group_start, const int32_t *group_shared,
                               int num_groups, const void *k_cache, const void *v_cache,
                               const int32_t *block_tables, int64_t table_stride,
                               const int32_t *ctx_lens, int num_heads, int num_kv_heads, int dim,
                               int block_size, float scale, float *out, int num_threads,
                               int kv_format, const float *k_scale, const float *v_scale) {
    if (kv_format != 1 && kv_format != 2) return -1;
    return decode_attention(q, DT_F32, q_rows, num_tokens, group_start, group_shared,
                            num_groups, k_cache, v_cache, DT_F32, block_tables, table_stride,
                            ctx_lens, num_heads, num_kv_heads, dim, block_size, scale, out,
                            num_threads, kv_format, k_scale, v_scale);
}

/* ---------------------------------------------------------------------------------------------
 * bf16 attention for every token of a step (prompt and decode), on AVX512-BF16.
 *
 * q, K and V are bf16; products go through vdpbf16ps, which multiplies pairs of bf16 values and
 * adds both products to a float32 lane. Per round of 64 keys and one KV head:
 *   - the round's K rows are transposed into pairs-by-keys (KT[p] holds pair p of 16 keys per
 *     vector), so a row's 16 scores are 32 products of a broadcast q pair against KT, summed
 *     over the pairs in order: no horizontal sums;
 *   - scores are scaled, keys at or past a row's context are masked, one online-softmax
 *     rescale follows; the weights are rounded to bf16 in pairs of consecutive keys;
 *   - the round's V rows are interleaved in pairs of consecutive keys (VP[k2] holds keys 2k2
 *     and 2k2 + 1 of 32 dims per vector) and a row's output gains 32 products of a broadcast
 *     weight pair against VP.
 * Rows go four at a time, their softmax steps too (the four rows' maxima and sums reduced
 * together, by the one-row trees: 16 decodes in 0.90-0.98x the time on Zen 5). A unit is one KV
 * head of a group of tokens: the group's keys in [0, shared) are walked once for all its rows,
 * with the first token's block table, each row masked past its own context (tokens of one
 * prompt chunk share one table and need no more); then each token's keys in [shared, ctx)
 * with its own table (answers that share a manual's blocks). A masked key adds exact zeros
 * and a round a row has no key in leaves its state as it was, so a row's result depends only
 * on its query, its context and the block size: the same bits whether it is a prompt token or
 * a decode token, alone or with any others.
 * ------------------------------------------------------------------------------------------- */
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* exp(x) for x <= 0 on AVX-512: exp_nonpositive's reduction and polynomial (x = n ln2 + r,
 * Cephes' expf), with n rounded by vroundscaleps and the 2^n scaling by vscalefps, in half
 * its instructions. */
static inline __m512 bf_exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    const __m512 z = _mm512_mul_ps(r, r);
    __m512 y = _mm512_fmadd_ps(r, _mm512_set1_ps(1.9875691500e-4f), _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, z, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

#define BF_MAX_ROWS 96 /* query rows per unit: 32 tokens of 3 query heads per KV head */
/* walks of at least this many query rows take them in lanes (bf_run_keys): there the scores'
 * idle lanes (16 lanes, however many rows) cost less than the K transpose and the per-row
 * softmax they save. Measured on Zen 4: prompt groups (30 rows) 10% faster in lanes, decode
 * groups of 18 and 30 rows faster, of 12 rows (4 answers about a manual) slower. */
#define BF_WIDE_ROWS 16
#define BF_FETCH_PAIRS 8 /* pairs of the 4-row scores between two fetches of the next round */
#define BF_WIDE_BLOCKS 3 /* blocks of 16 rows whose scores share each K broadcast */
#define BF_MAX_DIM 128
#define BF_AMX_SPOTS 18 /* places in a block of 16 rows on the tile unit that fetch ahead */
/* blocks of more rows than this on the tile unit take the softmax with the rows in lanes
 * (bf_softmax_rows), fewer row by row (bf_softmax_row: the same bits). Measured on a 2-core
 * Xeon: prompt chunks (blocks of 16 rows) 15-20% faster in lanes; 12 rows (4 answers about
 * a manual) no faster, the lanes computing 16 exponentials a key where the rows compute 12 */
#define BF_AMX_LANES 12
#define BF_QT_W (BF_MAX_ROWS + 16) /* columns of the queries by pairs (rows, then zeros) */

typedef struct {
    __m512 acc[BF_MAX_ROWS][BF_MAX_DIM / 16];
    float m[BF_MAX_ROWS], l[BF_MAX_ROWS];
    const uint32_t *q[BF_MAX_ROWS]; /* each row's query as bf16 pairs */
    int ctx[BF_MAX_ROWS];
} BfRows;

/* 16 vectors of 16 uint32 -> their transpose (vector p lane j = input j lane p). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
            t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
    }
}

/* The round's K rows transposed into pairs by keys (kt[p][kb] lane j: pair p of key
 * 16 kb + j) and its V rows interleaved in pairs of consecutive keys (vp[k2][v]: keys 2 k2 and
 * 2 k2 + 1 of 16 dims, v = 2c + h, lane 4L + e holding dim 32c + 8L + 4h + e); keys at or past
 * n are zero. The K rows only when with_k (walks with their rows in lanes, and the tile unit,
 * read K in place). */
static inline __attribute__((always_inline)) void bf_stage(
    __m512i kt[][ROUND / 16], __m512i vp[][BF_MAX_DIM / 16], const uint16_t *k_cache,
    const uint16_t *v_cache, const int64_t *row_at, int n, const int DIM, int with_k) {
    const int CH = DIM / 32; /* 64-byte chunks of a K/V row */
    for (int kb = 0; kb < ROUND / 16 && with_k; kb++)
        for (int c = 0; c < CH; c++) {
            if (kb * 16 >= n) { /* no key here: zeros, as a transpose of zeros gives */
                for (int p = 0; p < 16; p++) kt[c * 16 + p][kb] = _mm512_setzero_si512();
                continue;
            }
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                const int key = kb * 16 + j;
                r[j] = key < n ? _mm512_loadu_si512(k_cache + row_at[key] + c * 32)
                               : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int p = 0; p < 16; p++) kt[c * 16 + p][kb] = r[p];
        }
    for (int k2 = 0; k2 < ROUND / 2; k2++) {
        const int a = 2 * k2, b = 2 * k2 + 1;
        if (a >= n) {
            for (int v = 0; v < 2 * CH; v++) vp[k2][v] = _mm512_setzero_si512();
            continue;
        }
        for (int c = 0; c < CH; c++) {
            const __m512i va = a < n ? _mm512_loadu_si512(v_cache + row_at[a] + c * 32)
                                     : _mm512_setzero_si512();
            const __m512i vb = b < n ? _mm512_loadu_si512(v_cache + row_at[b] + c * 32)
                                     : _mm512_setzero_si512();
            vp[k2][2 * c] = _mm512_unpacklo_epi16(va, vb);
            vp[k2][2 * c + 1] = _mm512_unpackhi_epi16(va, vb);
        }
    }
}

/* A row's output rescaled by its round's factor (when not 1). */
static inline __attribute__((always_inline)) void bf_rescale(BfRows *st, int row, float alpha,
                                                              const int NV) {
    if (alpha != 1.0f)
        for (int v = 0; v < NV; v++)
            st->acc[row][v] = _mm512_mul_ps(st->acc[row][v], _mm512_set1_ps(alpha));
}

/* A row's 64 weights (16 per vector) to pw as bf16 pairs of consecutive keys. */
static inline __attribute__((always_inline)) void bf_store_weights(const __m512 s[ROUND / 16],
                                                                    uint32_t *pw) {
    for (int kb = 0; kb < ROUND / 16; kb += 2) {
        const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(s[kb + 1], s[kb]);
        _mm512_storeu_si512(&pw[kb * 8], w);
    }
}

/* One row's online-softmax step over a round: its 64 raw scores s (16 per vector) are scaled
 * and masked past the row's context, the running max, sum and output rescaled, and the
 * weights written to pw as bf16 pairs of consecutive keys. */
static inline __attribute__((always_inline)) void bf_softmax_row(BfRows *st, int row,
                                                                  __m512 s[ROUND / 16], int r0,
                                                                  float scale, uint32_t *pw,
                                                                  const int NV) {
    const __m512i lane_ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const int valid_n = st->ctx[row] - r0; /* keys of the round the row sees */
    vf mx = (vf)neg_inf;
    for (int kb = 0; kb < ROUND / 16; kb++) {
        const __mmask16 ok =
            _mm512_cmplt_epi32_mask(lane_ids, _mm512_set1_epi32(valid_n - kb * 16));
        s[kb] = _mm512_mask_mul_ps(neg_inf, ok, s[kb], _mm512_set1_ps(scale));
        mx = (vf)_mm512_max_ps((__m512)mx, s[kb]);
    }
    const float bm = hmax(mx);
    const float mn = st->m[row] > bm ? st->m[row] : bm;
    vf sum = {0};
    for (int kb = 0; kb < ROUND / 16; kb++) {
        const __mmask16 ok =
            _mm512_cmplt_epi32_mask(lane_ids, _mm512_set1_epi32(valid_n - kb * 16));
        vf e = (vf)bf_exp(_mm512_sub_ps(s[kb], _mm512_set1_ps(mn)));
        s[kb] = _mm512_maskz_mov_ps(ok, (__m512)e);
        sum += (vf)s[kb];
    }
    const float alpha =
        st->m[row] == mn ? 1.0f : bf_exp(_mm512_set1_ps(st->m[row] - mn))[0];
    st->l[row] = fmaf(st->l[row], alpha, hsum(sum)); /* one rounding, as bf_softmax_rows */
    st->m[row] = mn;
    bf_rescale(st, row, alpha, NV);
    bf_store_weights(s, pw);
}

/* Four rows' vectors reduced by hsum's tree (lane l with l + 8, then l + 4, l + 2, l + 1),
 * added (SUM) or by their maximum (hmax's), all four at once: lanes 4r .. 4r + 3 hold row r's
 * result, the bits hsum or hmax give that row. */
static inline __attribute__((always_inline)) __m512 bf_tree4(__m512 a, __m512 b, __m512 c,
                                                             __m512 d, const int SUM) {
#define BF_OP(x, y) (SUM ? _mm512_add_ps(x, y) : _mm512_max_ps(x, y))
    const __m512 ab = BF_OP(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    const __m512 cd = BF_OP(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
    __m512 w = BF_OP(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
    w = BF_OP(w, _mm512_permute_ps(w, 0x4e));
    return BF_OP(w, _mm512_permute_ps(w, 0xb1));
#undef BF_OP
}

/* bf_softmax_row for rows g0 .. g0 + 3 (those below hi) together, with the same bits: each
 * row's scores, weights and sum as there, and the four rows' maxima, sums and rescale
 * factors in one vector (bf_tree4; lane-wise the same arithmetic). s[i] holds row
 * min(g0 + i, hi - 1)'s scores: rows past hi are worked on and dropped. */
static inline __attribute__((always_inline)) void bf_softmax_row4(BfRows *st, int g0, int hi,
                                                                   __m512 s[4][ROUND / 16],
                                                                   int r0, float scale,
                                                                   uint32_t pw[][ROUND / 2],
                                                                   const int NV) {
    const __m512i lane_ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i by_row = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const int rows = hi - g0 < 4 ? hi - g0 : 4;
    float mv[4], lv[4];
    __m512 mx[4];
    __mmask16 ok[4][ROUND / 16];
    for (int i = 0; i < 4; i++) {
        const int row = g0 + (i < rows ? i : rows - 1);
        mv[i] = st->m[row], lv[i] = st->l[row];
        const int valid_n = st->ctx[row] - r0; /* keys of the round the row sees */
        mx[i] = neg_inf;
        for (int kb = 0; kb < ROUND / 16; kb++) {
            ok[i][kb] = _mm512_cmplt_epi32_mask(lane_ids, _mm512_set1_epi32(valid_n - kb * 16));
            s[i][kb] = _mm512_mask_mul_ps(neg_inf, ok[i][kb], s[i][kb], _mm512_set1_ps(scale));
            mx[i] = _mm512_max_ps(mx[i], s[i][kb]);
        }
    }
    const __m512 bm = bf_tree4(mx[0], mx[1], mx[2], mx[3], 0);
    const __m512 m = _mm512_permutexvar_ps(by_row, _mm512_castps128_ps512(_mm_loadu_ps(mv)));
    const __m512 mn = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, bm, _CMP_GT_OQ), bm, m);
    __m512 sum[4];
    for (int i = 0; i < 4; i++) {
        const __m512 mi = _mm512_permutexvar_ps(_mm512_set1_epi32(4 * i), mn);
        vf acc = {0};
        for (int kb = 0; kb < ROUND / 16; kb++) {
            s[i][kb] = _mm512_maskz_mov_ps(ok[i][kb], bf_exp(_mm512_sub_ps(s[i][kb], mi)));
            acc += (vf)s[i][kb];
        }
        sum[i] = (__m512)acc;
    }
    const __m512 total = bf_tree4(sum[0], sum[1], sum[2], sum[3], 1);
    const __m512 alpha = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, mn, _CMP_EQ_OQ),
                                              bf_exp(_mm512_sub_ps(m, mn)), _mm512_set1_ps(1.0f));
    const __m512 l = _mm512_permutexvar_ps(by_row, _mm512_castps128_ps512(_mm_loadu_ps(lv)));
    float lo[16], mo[16], al[16];
    _mm512_storeu_ps(lo, _mm512_fmadd_ps(l, alpha, total)); /* one rounding, as fmaf */
    _mm512_storeu_ps(mo, mn);
    _mm512_storeu_ps(al, alpha);
    for (int i = 0; i < rows; i++) {
        const int row = g0 + i;
        st->l[row] = lo[4 * i];
        st->m[row] = mo[4 * i];
        bf_rescale(st, row, al[4 * i], NV);
        bf_store_weights(s[i], pw[row]);
    }
}

/* The same step for up to 16 rows at once, the rows in lanes: S[j] holds key j's raw scores
 * (rows lo16 .. lo16 + 15, lanes past `rows` ignored). Every lane gets the bits
 * bf_softmax_row gives its row: maxima are exact in any order, the exponentials are the same
 * lane-wise function, and the weights are summed in bf_softmax_row's order (keys j, 16 + j,
 * 32 + j, 48 + j of each of 16 columns, then the columns by the tree of hsum). The weights go
 * to pwt[k2] as bf16 pairs of keys 2 k2 and 2 k2 + 1, lane r for row lo16 + r. */
static inline __attribute__((always_inline)) void bf_softmax_rows(BfRows *st, int lo16,
                                                                   int rows, __m512 S[ROUND],
                                                                   int r0, float scale,
                                                                   uint32_t pwt[][16],
                                                                   const int NV) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const __mmask16 live = (__mmask16)((1u << rows) - 1);
    const __m512i valid_n = _mm512_sub_epi32(
        _mm512_maskz_loadu_epi32(live, &st->ctx[lo16]), _mm512_set1_epi32(r0));
    /* a round every row sees whole (a prompt's rounds but its last) takes no masks: the rows'
     * lanes get the same values, and lanes past `rows` finite ones that are dropped */
    const int whole = !_mm512_mask_cmplt_epi32_mask(live, valid_n, _mm512_set1_epi32(ROUND));
    __mmask16 ok[ROUND];
    __m512 mx = neg_inf;
    for (int j = 0; j < ROUND; j++) {
        if (whole) {
            S[j] = _mm512_mul_ps(S[j], _mm512_set1_ps(scale));
        } else {
            ok[j] = _mm512_cmpgt_epi32_mask(valid_n, _mm512_set1_epi32(j));
            S[j] = _mm512_mask_mul_ps(neg_inf, ok[j], S[j], _mm512_set1_ps(scale));
        }
        mx = _mm512_max_ps(mx, S[j]);
    }
    const __m512 m = _mm512_mask_loadu_ps(neg_inf, live, &st->m[lo16]);
    const __m512 mn = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, mx, _CMP_GT_OQ), mx, m);
    for (int j = 0; j < ROUND; j++) {
        S[j] = bf_exp(_mm512_sub_ps(S[j], mn));
        if (!whole) S[j] = _mm512_maskz_mov_ps(ok[j], S[j]); /* ok is set only then */
    }
    __m512 col[16];
    for (int j = 0; j < 16; j++)
        col[j] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(S[j], S[16 + j]), S[32 + j]),
                               S[48 + j]);
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) col[j] = _mm512_add_ps(col[j], col[j + w]);
    const __mmask16 same = _mm512_cmp_ps_mask(m, mn, _CMP_EQ_OQ);
    const __m512 alpha = _mm512_mask_blend_ps(
        same, bf_exp(_mm512_sub_ps(m, mn)), _mm512_set1_ps(1.0f));
    const __m512 l = _mm512_maskz_loadu_ps(live, &st->l[lo16]);
    _mm512_mask_storeu_ps(&st->l[lo16], live, _mm512_fmadd_ps(l, alpha, col[0]));
    _mm512_mask_storeu_ps(&st->m[lo16], live, mn);
    float al[16];
    _mm512_storeu_ps(al, alpha);
    for (int r = 0; r < rows; r++) bf_rescale(st, lo16 + r, al[r], NV);
    const __m512i pair_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                              9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                              17, 1, 16, 0);
    for (int k2 = 0; k2 < ROUND / 2; k2++) {
        const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(S[2 * k2 + 1], S[2 * k2]);
        _mm512_store_si512(pwt[k2], _mm512_permutexvar_epi16(pair_idx, w));
    }
}

/* Rows [g0, min(g0 + 4, hi)) gain the round's weighted values: weight pair k2 of row g at
 * w[(g - wrow0) * rs + k2 * ks]. */
static inline __attribute__((always_inline)) void bf_weighted_values(
    BfRows *st, int g0, int hi, const uint32_t *w, int wrow0, int rs, int ks,
    __m512i vp[][BF_MAX_DIM / 16], int n, const int NV) {
    int g[4];
    for (int i = 0; i < 4; i++) g[i] = g0 + i < hi ? g0 + i : hi - 1;
    for (int v0 = 0; v0 < NV; v0 += 4) {
        __m512 a[4][4];
        for (int i = 0; i < 4; i++)
            for (int v = 0; v < 4; v++) a[i][v] = st->acc[g[i]][v0 + v];
        const int pairs = (n + 1) / 2;
        for (int k2 = 0; k2 < pairs; k2++) {
            __m512bh wb[4];
            for (int i = 0; i < 4; i++)
                wb[i] = (__m512bh)_mm512_set1_epi32((int)w[(g[i] - wrow0) * rs + k2 * ks]);
            for (int v = 0; v < 4; v++) {
                const __m512bh vv = (__m512bh)vp[k2][v0 + v];
                for (int i = 0; i < 4; i++) a[i][v] = _mm512_dpbf16_ps(a[i][v], vv, wb[i]);
            }
        }
        for (int i = 0; i < 4 && g0 + i < hi; i++)
            for (int v = 0; v < 4; v++) st->acc[g0 + i][v0 + v] = a[i][v];
    }
}

/* the pool is far larger than the caches and a context's blocks lie anywhere in it: the next
 * round's K and V rows are fetched while this one computes, a few keys at a time spread over
 * the round's products (a burst of a whole round's lines fills the core's miss queue and
 * stalls it), and the first round's V rows while its K rows are staged. BF_NEXT_ROUND works
 * out the next round's row offsets; BF_FETCH(i, of) fetches its keys up to the end of the
 * i-th of `of` equal shares (share of - 1 ends with the last). Prefetches change no
 * result. */
#define BF_NEXT_ROUND()                                                                        \
    const int n2 = r0 + ROUND < to ? (to - r0 - ROUND < ROUND ? to - r0 - ROUND : ROUND) : 0;  \
    KEY_ROWS(at[cur ^ 1], n2, DIM);                                                            \
    const int64_t *next_at = at[cur ^ 1];                                                      \
    int pf = 0; /* next-round keys fetched so far */                                           \
    if (r0 == from)                                                                            \
        for (int j = 0; j < n; j++)                                                            \
            for (int c = 0; c < DIM * ESZ; c += 64)                                            \
                _mm_prefetch((const char *)v_cache + row_at[j] * ESZ + c, _MM_HINT_T1);
#define BF_FETCH(i, of)                                                                        \
    for (; pf < n2 && pf * (of) < ((i) + 1) * n2; pf++)                                        \
        for (int c = 0; c < DIM * ESZ; c += 64) {                                              \
            _mm_prefetch((const char *)k_cache + next_at[pf] * ESZ + c, _MM_HINT_T1);          \
            _mm_prefetch((const char *)v_cache + next_at[pf] * ESZ + c, _MM_HINT_T1);          \
        }

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define BF_AMX 1
#include "amx.h"

static int amx_ok; /* docqa_attention_amx_init succeeded: every bf16 token takes the tiles */

/* Asks Linux for the AMX tile state; from then on every bf16 token's products run on the
 * tile unit. Returns 0 when they do. */
int docqa_attention_amx_init(void) {
    if (amx_request()) return -1;
    amx_ok = 1;
    return 0;
}

/* A round's K rows as the A operands of four tiles of 16 keys each: in place where the 16 keys
 * are one block's run (blocks of a multiple of 16 tokens), else copied to a buffer; keys at or
 * past n read zeros. Set once per round, read by every block of rows. */
typedef struct {
    const uint16_t *at[4];
    int64_t stride[4]; /* bytes */
    uint16_t buf[4][16][BF_MAX_DIM] __attribute__((aligned(64)));
} BfKeyTiles;

static inline __attribute__((always_inline)) void bf_key_tiles(
    BfKeyTiles *kt, const uint16_t *k_cache, const int64_t *row_at, int n, int64_t key_stride,
    int block_size, const int DIM) {
    static const uint16_t no_keys[16][BF_MAX_DIM] __attribute__((aligned(64)));
    const int in_place = block_size % 16 == 0; /* 16 keys from a multiple of 16: one block */
    for (int kb = 0; kb < 4; kb++) {
        const int j0 = 16 * kb;
        if (j0 >= n) { /* no key: a tile of zero rows */
            kt->at[kb] = &no_keys[0][0];
            kt->stride[kb] = BF_MAX_DIM * 2;
        } else if (in_place) {
            kt->at[kb] = k_cache + row_at[j0];
            kt->stride[kb] = key_stride * 2;
        } else {
            for (int i = 0; i < 16; i++) {
                if (j0 + i < n)
                    memcpy(kt->buf[kb][i], k_cache + row_at[j0 + i], DIM * 2);
                else
                    memset(kt->buf[kb][i], 0, DIM * 2);
            }
            kt->at[kb] = &kt->buf[kb][0][0];
            kt->stride[kb] = BF_MAX_DIM * 2;
        }
    }
}

/* Keys by rows: sc_t[j][r] = the raw score of the round's key j against row b0 + r, from
 * tile products of the round's K tiles and the queries by pairs (qtt[p][row]: 16 rows' pair p
 * in a tile row). Each element is the key's pairs against the row's, summed in order, as a
 * tile of rows by keys would sum them (the same bits), and the K rows need no transpose. Keys
 * at or past n score zero: the softmax masks them. */
static inline __attribute__((always_inline)) void bf_key_scores(
    float sc_t[][16], const uint32_t *qtt, int b0, const BfKeyTiles *kt, const int DIM) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < DIM / 32; c++) {
        _tile_loadd(6, qtt + (int64_t)(16 * c) * BF_QT_W + b0, BF_QT_W * 4);
        _tile_loadd(4, kt->at[0] + c * 32, kt->stride[0]);
        _tile_loadd(5, kt->at[1] + c * 32, kt->stride[1]);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(4, kt->at[2] + c * 32, kt->stride[2]);
        _tile_loadd(5, kt->at[3] + c * 32, kt->stride[3]);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 5, 6);
    }
    _tile_stored(0, &sc_t[0][0], 64);
    _tile_stored(1, &sc_t[16][0], 64);
    _tile_stored(2, &sc_t[32][0], 64);
    _tile_stored(3, &sc_t[48][0], 64);
}

#else
int docqa_attention_amx_init(void) { return -1; }
#endif

/* 8-bit caches (inference/kv_quant.py): 16 elements of a row as float32, int8 (FMT 1) or
 * fp8 e4m3 (FMT 2; its bits placed in a half float's, which reads 2^-8 times the value: the
 * scales carry the 2^8). */
static inline __attribute__((always_inline)) __m512 bf_kv8_load16(const uint8_t *p,
                                                                  const int FMT) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (FMT == 1) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m256i w = _mm256_cvtepu8_epi16(b);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}

/* A round's n rows of an 8-bit cache times their channels' scales (powers of two, so the bf16
 * values are exact) into dst, row j at j * DIM; rows n up to the next multiple of 16 zero. */
static inline __attribute__((always_inline)) void bf_dequant(uint16_t *dst, const uint8_t *src,
                                                             const int64_t *row_at, int n,
                                                             const __m512 *sc, const int DIM,
                                                             const int FMT) {
    for (int j = 0; j < n; j++) {
        const uint8_t *r = src + row_at[j];
        for (int c = 0; c < DIM / 32; c++) {
            const __m512 lo = _mm512_mul_ps(bf_kv8_load16(r + 32 * c, FMT), sc[2 * c]);
            const __m512 hi = _mm512_mul_ps(bf_kv8_load16(r + 32 * c + 16, FMT), sc[2 * c + 1]);
            _mm512_store_si512(dst + j * DIM + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
    const int tail = (n + 15) / 16 * 16;
    if (tail > n) memset(dst + (int64_t)n * DIM, 0, (size_t)(tail - n) * DIM * 2);
}

/* Raw scores of the round's keys j0 .. j0 + KEYS - 1 for NB blocks of 16 rows in lanes (the
 * rows from b0 on, in the unit's queries by pairs qtt: pair p of row r at qtt[p * BF_QT_W +
 * r]): S[b][j] = the products of key j's pairs with block b's rows, summed over the pairs in
 * order. Each K pair is broadcast once for the NB blocks (NB * KEYS sums in registers). Keys
 * at or past n are left as any key's scores, and lanes past a walk's rows as any row's: the
 * softmax masks both. */
static inline __attribute__((always_inline)) void bf_wide_scores(
    __m512 S[][ROUND], const uint32_t *qtt, int b0, const int NB, const int KEYS,
    const uint16_t *k_cache, const int64_t *row_at, int n, const int NP, int j0) {
    __m512 a[NB][KEYS];
    const uint32_t *kr[KEYS];
    for (int i = 0; i < KEYS; i++) {
        for (int b = 0; b < NB; b++) a[b][i] = _mm512_setzero_ps();
        /* keys past the round's are masked: any row will do */
        kr[i] = (const uint32_t *)(k_cache + row_at[j0 + i < n ? j0 + i : 0]);
    }
    if (j0 < n)
        for (int p = 0; p < NP; p++)
            for (int i = 0; i < KEYS; i++) {
                const __m512bh kb = (__m512bh)_mm512_set1_epi32((int)kr[i][p]);
                for (int b = 0; b < NB; b++)
                    a[b][i] = _mm512_dpbf16_ps(
                        a[b][i], kb,
                        (__m512bh)_mm512_loadu_si512(qtt + (int64_t)p * BF_QT_W + b0 + 16 * b));
            }
    for (int i = 0; i < KEYS; i++)
        for (int b = 0; b < NB; b++) S[b][j0 + i] = a[b][i];
}
_Static_assert(BF_WIDE_BLOCKS == 3, "bf_run_keys calls bf_wide_scores for 3, 2 or 1 blocks");

/* Keys [from, to) of one table for rows [lo, hi); from is a multiple of ROUND. DIM is 64 or
 * 128 and AMX 0 or 1 (compile-time constants in each caller). With AMX the scores and the
 * weighted values are tile products (16 rows a tile, each row's result from its own row
 * alone; the round's values summed in a tile from zero, then added to the row's rescaled
 * output), the scores keys by rows (bf_key_scores, qtt holding the unit's queries by
 * pairs) so that K needs no staging; without, vdpbf16ps products of broadcast query pairs,
 * four rows at a time, or for walks of BF_WIDE_ROWS or more, of broadcast K pairs read in
 * place against the queries by pairs (qtt again), 16 rows in lanes (bf_softmax_rows: the same
 * bits). The V staging and the softmax's arithmetic are the same on every path. */
static inline __attribute__((always_inline)) void bf_run_keys(
    BfRows *st, int lo, int hi, const uint32_t *qtt, const void *k_cache, const void *v_cache,
    const int32_t *table, int from, int to, int kv_head, int num_kv_heads, const int DIM,
    int block_size, float scale, const int AMX, const int FMT, const __m512 *k_sc,
    const __m512 *v_sc) {
    const int ESZ = FMT ? 1 : 2; /* bytes per cache element */
    /* 8-bit caches: each round's K and V rows dequantized (bf_dequant) into kq and vq, which
     * the round reads in place of the pool (key j's row at ident[j]) */
    uint16_t kq[FMT ? ROUND * BF_MAX_DIM : 1] __attribute__((aligned(64)));
    uint16_t vq[FMT ? ROUND * BF_MAX_DIM : 1] __attribute__((aligned(64)));
    int64_t ident[ROUND];
    if (FMT)
        for (int j = 0; j < ROUND; j++) ident[j] = (int64_t)j * DIM;
    const int NP = DIM / 2;    /* bf16 pairs of a row */
    const int NV = DIM / 16;   /* output vectors of a row */
    const int64_t key_stride = (int64_t)num_kv_heads * DIM;
    __m512i kt[BF_MAX_DIM / 2][ROUND / 16];
    __m512i vp[ROUND / 2][BF_MAX_DIM / 16];
    uint32_t pw[BF_MAX_ROWS + 16][ROUND / 2] __attribute__((aligned(64)));
    int64_t at[2][ROUND]; /* element offset of each key's row: this round, the next */
    /* walks of many rows take them in lanes (bf_softmax_rows): the K rows need no transpose,
     * and 16 rows share each softmax instruction (the queries by pairs, qtt) */
    const int wide = !AMX && hi - lo >= BF_WIDE_ROWS;
    uint32_t pwt[ROUND / 2][16] __attribute__((aligned(64)));
    (void)qtt, (void)NP;
    if (AMX) { /* tiles read whole blocks of 16 rows from lo: the rows past hi weigh zero (or,
                * after a round taken whole in lanes, that round's finite weights), and their
                * results are dropped */
        const int end = lo + (hi - lo + 15) / 16 * 16;
        memset(pw[hi], 0, sizeof(pw[0]) * (end - hi));
    }
    int blk = from / block_size, in_blk = from % block_size;
    KEY_ROWS(at[0], to - from < ROUND ? to - from : ROUND, DIM);
    for (int r0 = from, cur = 0; r0 < to; r0 += ROUND, cur ^= 1) {
        const int n = to - r0 < ROUND ? to - r0 : ROUND;
        const int64_t *row_at = at[cur];
        BF_NEXT_ROUND();
        const uint16_t *kc = (const uint16_t *)k_cache, *vc = (const uint16_t *)v_cache;
        const int64_t *rows_at = row_at;
        if (FMT) {
            bf_dequant(kq, (const uint8_t *)k_cache, row_at, n, k_sc, DIM, FMT);
            bf_dequant(vq, (const uint8_t *)v_cache, row_at, n, v_sc, DIM, FMT);
            kc = kq;
            vc = vq;
            rows_at = ident;
        }
        bf_stage(kt, vp, kc, vc, rows_at, n, DIM, !wide && !AMX);
#ifdef BF_AMX
        if (AMX) {
            float sc[16][ROUND] __attribute__((aligned(64)));
            float sc_t[ROUND][16] __attribute__((aligned(64)));
            float ov[16][16] __attribute__((aligned(64)));
            BfKeyTiles ktiles;
            bf_key_tiles(&ktiles, kc, rows_at, n, FMT ? DIM : key_stride, FMT ? 16 : block_size,
                         DIM);
            for (int b0 = lo; b0 < hi; b0 += 16) {
                const int rows = hi - b0 < 16 ? hi - b0 : 16;
                const int bi = (b0 - lo) / 16, nbk = (hi - lo + 15) / 16;
                BF_FETCH(bi * BF_AMX_SPOTS, nbk * BF_AMX_SPOTS);
                /* scores keys by rows: tile kb holds keys 16 kb .. 16 kb + 15 against the block's
                 * rows, each a key's pairs against a row's, summed over the head's 32-dim chunks
                 * in order */
                bf_key_scores(sc_t, qtt, b0, &ktiles, DIM);
                BF_FETCH(bi * BF_AMX_SPOTS + 1, nbk * BF_AMX_SPOTS);
                if (rows > BF_AMX_LANES) {
                    __m512 S[ROUND];
                    for (int j = 0; j < ROUND; j++) S[j] = _mm512_load_ps(sc_t[j]);
                    bf_softmax_rows(st, b0, rows, S, r0, scale, pwt, NV);
                    BF_FETCH(bi * BF_AMX_SPOTS + 9, nbk * BF_AMX_SPOTS);
                    /* the weights by rows for the tile products: pw[row][k2] */
                    for (int h = 0; h < 2; h++) {
                        __m512i t[16];
                        for (int i = 0; i < 16; i++) t[i] = _mm512_load_si512(pwt[16 * h + i]);
                        transpose16(t);
                        for (int r = 0; r < 16; r++) _mm512_store_si512(&pw[b0 + r][16 * h], t[r]);
                    }
                } else { /* the scores back to keys in lanes, then row by row */
                    for (int kb = 0; kb < ROUND / 16; kb++) {
                        __m512i t[16];
                        for (int j = 0; j < 16; j++) t[j] = _mm512_load_si512(sc_t[16 * kb + j]);
                        transpose16(t);
                        for (int r = 0; r < 16; r++) _mm512_store_si512(&sc[r][16 * kb], t[r]);
                    }
                    for (int i = 0; i < rows; i++) {
                        __m512 s[ROUND / 16];
                        for (int kb = 0; kb < ROUND / 16; kb++)
                            s[kb] = _mm512_load_ps(&sc[i][16 * kb]);
                        bf_softmax_row(st, b0 + i, s, r0, scale, pw[b0 + i], NV);
                        BF_FETCH(bi * BF_AMX_SPOTS + 2 + i, nbk * BF_AMX_SPOTS);
                    }
                }
                /* weighted values, four 16-dim vectors at a time: the round's two 32-key halves
                 * summed in order from zero, then added to the outputs */
                for (int v0 = 0; v0 < NV; v0 += 4) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int h = 0; h < 2; h++) {
                        _tile_loadd(4, &pw[b0][16 * h], sizeof(pw[0]));
                        _tile_loadd(6, &vp[16 * h][v0], sizeof(vp[0]));
                        _tile_loadd(7, &vp[16 * h][v0 + 1], sizeof(vp[0]));
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_loadd(6, &vp[16 * h][v0 + 2], sizeof(vp[0]));
                        _tile_loadd(7, &vp[16 * h][v0 + 3], sizeof(vp[0]));
                        _tile_dpbf16ps(2, 4, 6);
                        _tile_dpbf16ps(3, 4, 7);
                    }
#define BF_ADD_TILE(t)                                                                         \
    _tile_stored(t, &ov[0][0], sizeof(ov[0]));                                                 \
    for (int i = 0; i < rows; i++)                                                             \
        st->acc[b0 + i][v0 + t] =                                                              \
            _mm512_add_ps(st->acc[b0 + i][v0 + t], _mm512_load_ps(ov[i]));
                    BF_ADD_TILE(0)
                    BF_ADD_TILE(1)
                    BF_ADD_TILE(2)
                    BF_ADD_TILE(3)
#undef BF_ADD_TILE
                }
                BF_FETCH(bi * BF_AMX_SPOTS + BF_AMX_SPOTS - 1, nbk * BF_AMX_SPOTS);
            }
            continue;
        }
#endif
        if (wide) { /* rows in lanes: scores straight from the pool's K rows */
            const int blocks = (hi - lo + 15) / 16;
            for (int bi0 = 0; bi0 < blocks; bi0 += BF_WIDE_BLOCKS) {
                const int nb = blocks - bi0 < BF_WIDE_BLOCKS ? blocks - bi0 : BF_WIDE_BLOCKS;
                __m512 S[BF_WIDE_BLOCKS][ROUND];
                const int keys = nb == 1 ? 16 : 8, steps = ROUND / keys;
                for (int j0 = 0; j0 < ROUND; j0 += keys) {
                    BF_FETCH(bi0 / BF_WIDE_BLOCKS * steps + j0 / keys,
                             (blocks + BF_WIDE_BLOCKS - 1) / BF_WIDE_BLOCKS * steps);
                    if (nb == 3)
                        bf_wide_scores(S, qtt, lo + 16 * bi0, 3, 8, kc, rows_at, n, NP, j0);
                    else if (nb == 2)
                        bf_wide_scores(S, qtt, lo + 16 * bi0, 2, 8, kc, rows_at, n, NP, j0);
                    else
                        bf_wide_scores(S, qtt, lo + 16 * bi0, 1, 16, kc, rows_at, n, NP, j0);
                }
                for (int b = 0; b < nb; b++) {
                    const int b0 = lo + 16 * (bi0 + b);
                    const int rows = hi - b0 < 16 ? hi - b0 : 16;
                    bf_softmax_rows(st, b0, rows, S[b], r0, scale, pwt, NV);
                    for (int g0 = b0; g0 < b0 + rows; g0 += 4)
                        bf_weighted_values(st, g0, b0 + rows, &pwt[0][0], b0, 1, 16, vp, n, NV);
                }
            }
            continue;
        }
        for (int g0 = lo; g0 < hi; g0 += 4) {
            int g[4];
            for (int i = 0; i < 4; i++) g[i] = g0 + i < hi ? g0 + i : hi - 1;
            /* scores: 4 rows x 64 keys */
            __m512 s[4][ROUND / 16];
            for (int i = 0; i < 4; i++)
                for (int kb = 0; kb < ROUND / 16; kb++) s[i][kb] = _mm512_setzero_ps();
            const uint32_t *qp[4];
            for (int i = 0; i < 4; i++) qp[i] = st->q[g[i]];
            for (int p0 = 0; p0 < NP; p0 += BF_FETCH_PAIRS) {
                BF_FETCH((g0 - lo) / 4 * (NP / BF_FETCH_PAIRS) + p0 / BF_FETCH_PAIRS,
                         (hi - lo + 3) / 4 * (NP / BF_FETCH_PAIRS));
                for (int p = p0; p < p0 + BF_FETCH_PAIRS; p++) {
                    __m512bh qb[4];
                    for (int i = 0; i < 4; i++)
                        qb[i] = (__m512bh)_mm512_set1_epi32((int)qp[i][p]);
                    for (int kb = 0; kb < ROUND / 16; kb++) {
                        const __m512bh kv = (__m512bh)kt[p][kb];
                        for (int i = 0; i < 4; i++)
                            s[i][kb] = _mm512_dpbf16_ps(s[i][kb], kv, qb[i]);
                    }
                }
            }
            bf_softmax_row4(st, g0, hi, s, r0, scale, pw, NV);
            /* weighted values: 4 rows x 4 output vectors at a time */
            bf_weighted_values(st, g0, hi, &pw[0][0], 0, ROUND / 2, 1, vp, n, NV);
        }
    }
}
#undef BF_NEXT_ROUND
#undef BF_FETCH

static inline __attribute__((always_inline)) void bf_unit(
    const uint16_t *q, const int64_t *q_rows, int members, const int32_t *tables,
    int64_t table_stride, const int32_t *ctx, int shared, int kv_head, int group,
    int num_kv_heads, const int DIM, const void *k_cache, const void *v_cache, int block_size,
    float scale, uint16_t *out, const int64_t *out_rows, const int FMT, const float *k_scale,
    const float *v_scale) {
    const int NV = DIM / 16;
    BfRows st;
    /* 8-bit caches: this KV head's scales, fp8's times 2^8 (bf_kv8_load16) */
    __m512 k_sc[BF_MAX_DIM / 16], v_sc[BF_MAX_DIM / 16];
    if (FMT) {
        const __m512 unit = _mm512_set1_ps(FMT == 2 ? 256.0f : 1.0f);
        for (int v = 0; v < NV; v++) {
            k_sc[v] = _mm512_mul_ps(_mm512_loadu_ps(k_scale + kv_head * DIM + 16 * v), unit);
            v_sc[v] = _mm512_mul_ps(_mm512_loadu_ps(v_scale + kv_head * DIM + 16 * v), unit);
        }
    }
    const int rows = members * group;
    for (int i = 0; i < members; i++)
        for (int g = 0; g < group; g++) {
            const int r = i * group + g;
            st.q[r] = (const uint32_t *)(q + q_rows[i] + (int64_t)(kv_head * group + g) * DIM);
            st.ctx[r] = ctx[i];
            st.m[r] = -INFINITY;
            st.l[r] = 0.0f;
            for (int v = 0; v < NV; v++) st.acc[r][v] = _mm512_setzero_ps();
        }
#ifdef BF_AMX
    const int amx = amx_ok;
#else
    const int amx = 0;
#endif
    /* the unit's queries by pairs (pair p of every row in a row of qtbuf), zero past its rows,
     * for the tile unit's score tiles and the walks with their rows in lanes: both read 16
     * rows from a walk's first */
    uint32_t qtbuf[BF_MAX_DIM / 2][BF_QT_W] __attribute__((aligned(64)));
    if (amx || rows >= BF_WIDE_ROWS)
        for (int p = 0; p < DIM / 2; p++) {
            for (int r = 0; r < rows; r++) qtbuf[p][r] = st.q[r][p];
            memset(&qtbuf[p][rows], 0, sizeof(uint32_t) * 16);
        }
    const uint32_t *qtt = &qtbuf[0][0];
    /* the group's shared keys for all its rows, then each token's own (the same arithmetic
     * either way, with or without the tile unit: the flag only picks the compiled copy) */
#define BF_WALK(AMX)                                                                           \
    do {                                                                                       \
        if (shared > 0)                                                                        \
            bf_run_keys(&st, 0, rows, qtt, k_cache, v_cache, tables, 0, shared, kv_head,       \
                        num_kv_heads, DIM, block_size, scale, AMX, FMT, k_sc, v_sc);           \
        for (int i = 0; i < members; i++)                                                      \
            if (ctx[i] > shared)                                                               \
                bf_run_keys(&st, i * group, (i + 1) * group, qtt, k_cache, v_cache,            \
                            tables + i * table_stride, shared, ctx[i], kv_head, num_kv_heads,  \
                            DIM, block_size, scale, AMX, FMT, k_sc, v_sc);                     \
    } while (0)
    if (amx)
        BF_WALK(1);
    else
        BF_WALK(0);
#undef BF_WALK
    /* output vector 2c + h, lane 4L + e holds dim 32c + 8L + 4h + e (the V interleave): both
     * vectors of a chunk rounded to bf16 together (nearest even; vcvtne2ps2bf16 flushes a
     * denormal to zero, as vdpbf16ps does every product's) and put in dim order by one
     * permute */
    static const uint16_t dim_order[32] = {0,  1,  2,  3,  16, 17, 18, 19, 4,  5,  6,
                                           7,  20, 21, 22, 23, 8,  9,  10, 11, 24, 25,
                                           26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
    const __m512i order = _mm512_loadu_si512(dim_order);
    for (int r = 0; r < rows; r++) {
        const int i = r / group, g = r % group;
        uint16_t *o = out + out_rows[i] + (int64_t)(kv_head * group + g) * DIM;
        const __m512 inv = _mm512_set1_ps(1.0f / st.l[r]);
        for (int c = 0; c < NV / 2; c++) {
            const __m512 lo = _mm512_mul_ps(st.acc[r][2 * c], inv);
            const __m512 hi = _mm512_mul_ps(st.acc[r][2 * c + 1], inv);
            const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(o + 32 * c, _mm512_permutexvar_epi16(order, w));
        }
    }
}

/* The unit with the head size and the cache format known to the compiler. */
typedef void (*bf_unit_fn)(const uint16_t *, const int64_t *, int, const int32_t *, int64_t,
                           const int32_t *, int, int, int, int, const void *, const void *, int,
                           float, uint16_t *, const int64_t *, const float *, const float *);
#define BF_SPECIALIZED(name, DIM, FMT)                                                           \
    static void name(const uint16_t *q, const int64_t *q_rows, int members,                     \
                     const int32_t *tables, int64_t table_stride, const int32_t *ctx, int shared, \
                     int kv_head, int group, int num_kv_heads, const void *k_cache,              \
                     const void *v_cache, int block_size, float scale, uint16_t *out,            \
                     const int64_t *out_rows, const float *k_scale, const float *v_scale) {      \
        bf_unit(q, q_rows, members, tables, table_stride, ctx, shared, kv_head, group,          \
                num_kv_heads, DIM, k_cache, v_cache, block_size, scale, out, out_rows, FMT,      \
                k_scale, v_scale);                                                               \
    }
BF_SPECIALIZED(bf_unit_d64, 64, 0)
BF_SPECIALIZED(bf_unit_d128, 128, 0)
BF_SPECIALIZED(bf_unit_d64_i8, 64, 1)
BF_SPECIALIZED(bf_unit_d128_i8, 128, 1)
BF_SPECIALIZED(bf_unit_d64_f8, 64, 2)
BF_SPECIALIZED(bf_unit_d128_f8, 128, 2)
static const bf_unit_fn bf_units[3][2] = {{bf_unit_d64, bf_unit_d128},
                                          {bf_unit_d64_i8, bf_unit_d128_i8},
                                          {bf_unit_d64_f8, bf_unit_d128_f8}};
#else
int docqa_attention_amx_init(void) { return -1; }
#endif

/* The bf16 kernels' exponential of n values (x <= 0), for tests: 0, or -1 where the bf16
 * kernels are not built. */
int docqa_attention_bf16_exp(const float *x, float *out, int64_t n) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 live = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(out + i, live, bf_exp(_mm512_maskz_loadu_ps(live, x + i)));
    }
    return 0;
#else
    (void)x, (void)out, (void)n;
    return -1;
#endif
}

/* Which bf16 head sizes docqa_attention_bf16 takes on this build (0: none, no AVX512-BF16). */
int docqa_attention_bf16_dims(void) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
    return 64 | 128;
#else
    return 0;
#endif
}

/* Attention of a step's tokens (prompt and decode) in bf16; arguments as for
 * docqa_decode_attention, except: at most BF_MAX_ROWS query rows per group; group_shared[u] either a
 * multiple of 64 or at least every context of its group (one prompt chunk: all its keys,
 * walked with the first token's table); and the output, bf16 [.., num_heads, dim], written
 * from element out_rows[t] for token t (the model's attention output rows, in place).
 * kv_format 0: bf16 caches; 1: int8, 2: fp8 e4m3 caches with their scales
 * [num_kv_heads * dim] (inference/kv_quant.py). Returns 0, or -1 outside the limits. */
static int attention_bf16(const void *q, const int64_t *q_rows, int num_tokens,
                          const int32_t *group_start, const int32_t *group_shared,
                          int num_groups, const void *k_cache, const void *v_cache,
                          const int32_t *block_tables, int64_t table_stride,
                          const int32_t *ctx_lens, int num_heads, int num_kv_heads, int dim,
                          int block_size, float scale, void *out, const int64_t *out_rows,
                          int num_threads, int kv_format, const float *k_scale,
                          const float *v_scale) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
    if ((dim != 64 && dim != 128) || block_size <= 0 || num_kv_heads <= 0 ||
        num_heads % num_kv_heads || kv_format < 0 || kv_format > 2 ||
        (kv_format && (!k_scale || !v_scale)))
        return -1;
    const int group = num_heads / num_kv_heads;
    for (int u = 0; u < num_groups; u++) {
        const int t = group_start[u], members = group_start[u + 1] - t;
        if (members < 1 || members * group > BF_MAX_ROWS || group_start[u + 1] > num_tokens ||
            group_shared[u] < 0)
            return -1;
        if (group_shared[u] % ROUND)
            for (int i = 0; i < members; i++)
                if (ctx_lens[t + i] > group_shared[u]) return -1;
    }
    const int units = num_groups * num_kv_heads;
    const bf_unit_fn unit = bf_units[kv_format][dim == 128];
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
#ifdef BF_AMX
        if (amx_ok) amx_configure_tiles(); /* tile state is per thread */
#endif
#pragma omp for schedule(dynamic, 1)
        for (int u = 0; u < units; u++) {
            const int grp = u / num_kv_heads, h = u % num_kv_heads;
            const int t = group_start[grp];
            unit((const uint16_t *)q, q_rows + t, group_start[grp + 1] - t,
                 block_tables + (int64_t)t * table_stride, table_stride, ctx_lens + t,
                 group_shared[grp], h, group, num_kv_heads, k_cache, v_cache, block_size, scale,
                 (uint16_t *)out, out_rows + t, k_scale, v_scale);
        }
#ifdef BF_AMX
        if (amx_ok) _tile_release();
#endif
    }
    return 0;
#else
    (void)q, (void)q_rows, (void)num_tokens, (void)group_start, (void)group_shared;
    (void)num_groups, (void)k_cache, (void)v_cache, (void)block_tables, (void)table_stride;
    (void)ctx_lens, (void)num_heads, (void)num_kv_heads, (void)dim, (void)block_size;
    (void)scale, (void)out, (void)out_rows, (void)num_threads, (void)kv_format, (void)k_scale;
    (void)v_scale;
    return -1;
#endif
}

int docqa_attention_bf16(const void *q, const int64_t *q_rows, int num_tokens,
                         const int32_t *group_start, const int32_t *group_shared, int num_groups,
                         const void *k_cache, const void *v_cache, const int32_t *block_tables,
                         int64_t table_stride, const int32_t *ctx_lens, int num_heads,
                         int num_kv_heads, int dim, int block_size, float scale, void *out,
                         const int64_t *out_rows, int num_threads) {
    return attention_bf16(q, q_rows, num_tokens, group_start, group_shared, num_groups, k_cache,
                          v_cache, block_tables, table_stride, ctx_lens, num_heads, num_kv_heads,
                          dim, block_size, scale, out, out_rows, num_threads, 0, NULL, NULL);
}

/* docqa_attention_bf16 over 8-bit caches: kv_format 1 int8, 2 fp8 e4m3. */
int docqa_attention_bf16_kv8(const void *q, const int64_t *q_rows, int num_tokens,
                             const int32_t *group_start, const int32_t *group_shared,
                             int num_groups, const void *k_cache, const void *v_cache,
                             const int32_t *block_tables, int64_t table_stride,
                             const int32_t *ctx_lens, int num_heads, int num_kv_heads, int dim,
                             int block_size, float scale, void *out, const int64_t *out_rows,
                             int num_threads, int kv_format, const float *k_scale,
                             const float *v_scale) {
    if (kv_format != 1 && kv_format != 2) return -1;
    return attention_bf16(q, q_rows, num_tokens, group_start, group_shared, num_groups, k_cache,
                          v_cache, block_tables, table_stride, ctx_lens, num_heads, num_kv_heads,
                          dim, block_size, scale, out, out_rows, num_threads, kv_format, k_scale,
                          v_scale);
}
