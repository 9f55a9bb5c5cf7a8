/* Paged decode attention on the CPU: each decode token's query heads against its context,
 * read in place from the paged KV pool (no gather), in float32.
 *
 * Layout (CONTRACTS.md, "Paged KV layout and kernels"): k_cache/v_cache are
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
#include <string.h>

#define MAX_DIM 256
#define MAX_GROUP 16
#define MAX_ROWS 16 /* query rows in one unit */
#define LANES 16
#define ROUND 64 /* keys per online-softmax round, from key 0 */

enum { DT_F32 = 0, DT_BF16 = 1 };

/* GCC/Clang vector extensions: 16 float lanes, lowered to the target's widest vectors. */
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

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
 * float32 rows in order (vector c holds values 16c .. 16c + 15); bf16 rows with each 32
 * values split into their even (vector 2c) and odd (vector 2c + 1) ones, which one 64-byte
 * load and a shift or a mask give. Dot products and weighted sums do not care how values map
 * to lanes as long as q and the output use the same map (to_layout, from_layout). */
static inline void load_row(const void *base, int64_t index, int dtype, int chunks, vf *out) {
    if (dtype == DT_BF16) {
        const uint16_t *p = (const uint16_t *)base + index;
        for (int c = 0; c < chunks; c += 2) {
            vu u;
            memcpy(&u, p + c * LANES, sizeof u);
            vu even = u << 16, odd = u & 0xffff0000u;
            memcpy(&out[c], &even, sizeof even);
            memcpy(&out[c + 1], &odd, sizeof odd);
        }
    } else {
        const float *p = (const float *)base + index;
        for (int c = 0; c < chunks; c++) memcpy(&out[c], p + c * LANES, sizeof(vf));
    }
}

/* Position in the layout of value i of a row. */
static inline int layout_pos(int i, int dtype) {
    if (dtype != DT_BF16) return i;
    const int chunk = i / (2 * LANES), k = i % (2 * LANES);
    return chunk * 2 * LANES + (k % 2) * LANES + k / 2;
}

/* exp(x) for x <= 0 (a score minus the running maximum), relative error about 2e-7:
 * x = n ln2 + r, exp(r) by a degree-6 polynomial (Cephes' expf), times 2^n. */
static inline vf exp_nonpositive(vf x) {
    const vf lo = (vf){0} - 87.0f;
    const vi below = x < lo;
    x = vselect(below, lo, x);
    vf y0 = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(y0, vi), vf);  /* toward zero */
    n += __builtin_convertvector(n > y0, vf);                              /* floor */
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

/* Lanes [a0+a1, a2+a3, ..., a14+a15, b0+b1, ..., b14+b15]. */
static inline vf pair_sums(vf a, vf b) {
    const vi even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* p[j] holds key j's 16 partial products; lane j of the result is their sum (a fixed tree). */
static inline vf reduce16(const vf *p) {
    const vf a0 = pair_sums(p[0], p[1]), a1 = pair_sums(p[2], p[3]);
    const vf a2 = pair_sums(p[4], p[5]), a3 = pair_sums(p[6], p[7]);
    const vf a4 = pair_sums(p[8], p[9]), a5 = pair_sums(p[10], p[11]);
    const vf a6 = pair_sums(p[12], p[13]), a7 = pair_sums(p[14], p[15]);
    const vf b0 = pair_sums(a0, a1), b1 = pair_sums(a2, a3);
    const vf b2 = pair_sums(a4, a5), b3 = pair_sums(a6, a7);
    return pair_sums(pair_sums(b0, b1), pair_sums(b2, b3));
}

/* Sum and maximum of the 16 lanes, by a fixed tree (lane l with lane l + 8, then + 4, ...). */
static inline float hsum(vf v) {
    const vi s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const vi s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const vi s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const vi s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    v += __builtin_shuffle(v, s8);
    v += __builtin_shuffle(v, s4);
    v += __builtin_shuffle(v, s2);
    v += __builtin_shuffle(v, s1);
    return v[0];
}

static inline float hmax(vf v) {
    const vi s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const vi s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const vi s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const vi s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    vf w = __builtin_shuffle(v, s8);
    v = vselect(v > w, v, w);
    w = __builtin_shuffle(v, s4);
    v = vselect(v > w, v, w);
    w = __builtin_shuffle(v, s2);
    v = vselect(v > w, v, w);
    w = __builtin_shuffle(v, s1);
    v = vselect(v > w, v, w);
    return v[0];
}

/* A unit's query rows and their running softmax state. */
typedef struct {
    vf q[MAX_ROWS][MAX_DIM / LANES];
    vf acc[MAX_ROWS][MAX_DIM / LANES];
    float m[MAX_ROWS], l[MAX_ROWS];
} Rows;

/* Keys [from, to) of one context (from a multiple of ROUND) for rows [lo, hi). */
static inline __attribute__((always_inline)) void run_keys(
    Rows *st, int lo, int hi, const void *k_cache, const void *v_cache, int kv_dtype,
    const int32_t *table, int from, int to, int kv_head, int num_kv_heads, int chunks,
    int block_size) {
    const int dim = chunks * LANES;
    const int64_t key_stride = (int64_t)num_kv_heads * dim;
    const vf zero = {0};
    const vf neg_inf = zero - INFINITY;
    const vi lane_ids = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vf part[MAX_ROWS][LANES];
    vf kv[MAX_DIM / LANES];
    vf s[MAX_ROWS][ROUND / LANES];
    int64_t row_at[ROUND]; /* element offset of each key of the round */
    int blk = from / block_size, in_blk = from % block_size;
    for (int r0 = from; r0 < to; r0 += ROUND) {
        const int n = to - r0 < ROUND ? to - r0 : ROUND;
        const int groups = (n + LANES - 1) / LANES;
        for (int j = 0; j < n; j++) {
            row_at[j] = ((int64_t)table[blk] * block_size + in_blk) * key_stride +
                        (int64_t)kv_head * dim;
            if (++in_blk == block_size) {
                in_blk = 0;
                blk++;
            }
        }
        /* scores of the rows against the round's keys, 16 keys per vector */
        for (int q16 = 0; q16 < groups; q16++) {
            const int j0 = q16 * LANES;
            const int nj = n - j0 < LANES ? n - j0 : LANES;
            for (int j = 0; j < nj; j++) {
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
            vf mx = s[g][0];
            for (int q16 = 1; q16 < groups; q16++) mx = vselect(s[g][q16] > mx, s[g][q16], mx);
            const float bm = hmax(mx);
            const float mn = st->m[g] > bm ? st->m[g] : bm;
            vf sum = zero;
            for (int q16 = 0; q16 < groups; q16++) {
                const vi valid = lane_ids < n - q16 * LANES;
                s[g][q16] = (vf)((vi)exp_nonpositive(s[g][q16] - mn) & valid);
                sum += s[g][q16];
            }
            const float alpha = exp_nonpositive(zero + (st->m[g] - mn))[0];
            st->l[g] = st->l[g] * alpha + hsum(sum);
            st->m[g] = mn;
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
SPECIALIZED(unit_d64_bf16, 4, DT_BF16)
SPECIALIZED(unit_d64_f32, 4, DT_F32)
SPECIALIZED(unit_d128_bf16, 8, DT_BF16)

static void unit_any(const void *q, int q_dtype, const int64_t *q_rows, int members,
                     const int32_t *tables, int64_t table_stride, const int32_t *ctx, int shared,
                     int kv_head, int group, int num_kv_heads, int chunks, const void *k_cache,
                     const void *v_cache, int kv_dtype, int block_size, float scale, float *out) {
    attend_unit(q, q_dtype, q_rows, members, tables, table_stride, ctx, shared, kv_head, group,
                num_kv_heads, chunks, k_cache, v_cache, kv_dtype, block_size, scale, out);
}

/* Returns 0, or -1 when a shape is outside the kernel's limits (the caller checks them first).
 *
 * Tokens come in groups: group u holds tokens group_start[u] .. group_start[u + 1] - 1, whose
 * contexts share their first group_shared[u] keys (a multiple of 64, 0 for none; the first
 * token's table is read for them), at most MAX_ROWS / (num_heads / num_kv_heads) tokens.
 *
 * q:            query rows, head after head (dim elements each) from element q_rows[t] for token t
 * block_tables: int32 [num_tokens, table_stride], token t's blocks
 * ctx_lens:     int32 [num_tokens], keys each token attends (its own key included, already stored)
 * out:          float32 [num_tokens, num_heads, dim]
 * num_threads:  threads for the units (the caller's torch.get_num_threads())
 */
int docqa_decode_attention(const void *q, int q_dtype, const int64_t *q_rows, int num_tokens,
                           const int32_t *group_start, const int32_t *group_shared,
                           int num_groups, const void *k_cache, const void *v_cache,
                           int kv_dtype, const int32_t *block_tables, int64_t table_stride,
                           const int32_t *ctx_lens, int num_heads, int num_kv_heads, int dim,
                           int block_size, float scale, float *out, int num_threads) {
    if (dim % (2 * LANES) || dim > MAX_DIM || block_size <= 0 || num_kv_heads <= 0 ||
        num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP)
        return -1;
    const int group = num_heads / num_kv_heads;
    for (int u = 0; u < num_groups; u++) {
        const int members = group_start[u + 1] - group_start[u];
        if (members < 1 || members * group > MAX_ROWS || group_shared[u] % ROUND ||
            group_start[u + 1] > num_tokens)
            return -1;
    }
    const int units = num_groups * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads > 0 ? num_threads : 1)
    for (int u = 0; u < units; u++) {
        const int grp = u / num_kv_heads, h = u % num_kv_heads;
        const int t = group_start[grp], members = group_start[grp + 1] - t;
        const int32_t *tables = block_tables + (int64_t)t * table_stride;
        float *o = out + (int64_t)t * num_heads * dim;
        const int shared = group_shared[grp];
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
    return 0;
}
