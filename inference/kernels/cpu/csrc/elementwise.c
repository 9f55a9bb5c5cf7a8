/* The model's element-wise steps, fused: one pass over a row where torch takes one call (and,
 * in bf16, one rounding) per operation. In bf16:
 *
 *   docqa_add_rms_norm_bf16: h += delta (rounded to bf16, the residual stream), then
 *       x = w * bf16(h * rsqrt(mean(h^2) + eps)), as Llama's RMSNorm (float32 inside, the
 *       normalized row rounded to bf16 before the weight);
 *   docqa_silu_mul_bf16: out = bf16(silu(g) * u) for the gate and up halves of a row;
 *   docqa_rotary_store_bf16: rotary embedding of the query and key heads in place, and the
 *       key and value heads written to the paged caches.
 *
 * and the same three in float32 (docqa_add_rms_norm_f32, docqa_silu_mul_f32,
 * docqa_rotary_store_f32), with no rounding between the operations.
 *
 * Each row is computed from that row alone, its sum of squares in a fixed order (16 partial
 * sums over the row, then added in order): rows are batch-invariant.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* Loops over a row vectorize as wide as the target's vectors (GCC's default for -march of
 * AVX-512 CPUs is 256 bits): each lane's arithmetic is the same, so are the results. */
#pragma GCC target("prefer-vector-width=512")

/* Calls of at least this many rows (tokens) split them over the threads (each row is
 * computed alone: the same bits). With the wider vectors, on a 2-core Xeon, a layer's
 * rotary, two norms and SiLU took 22.9 against 31.2 us at 12 rows, 37.0 against 45.7 at
 * 27 and 58.3 against 90.4 at 55 (one thread below 16 or 64 rows, 256-bit vectors). */
#define PARALLEL_ROWS 8

static inline float bf2f(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) { /* to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* exp(x) for x <= 0 (float32, relative error about 2e-7; 0 below -87) */
static inline float exp_nonpositive(float x) {
    const float under = x < -87.0f ? 0.0f : 1.0f;
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s * under;
}

int docqa_add_rms_norm_bf16(uint16_t *h, int64_t ldh, const uint16_t *delta, int64_t ldd,
                            const uint16_t *w, uint16_t *x, int64_t ldx, int rows, int dim,
                            float eps, int num_threads) {
    if (rows < 0 || dim <= 0 || dim % 16) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        uint16_t *hr = h + (int64_t)r * ldh;
        if (delta) {
            const uint16_t *dr = delta + (int64_t)r * ldd;
            for (int i = 0; i < dim; i++) hr[i] = f2bf(bf2f(hr[i]) + bf2f(dr[i]));
        }
        float part[16] = {0};
        for (int i = 0; i < dim; i += 16)
            for (int j = 0; j < 16; j++) {
                const float v = bf2f(hr[i + j]);
                part[j] += v * v;
            }
        float ss = 0.0f;
        for (int j = 0; j < 16; j++) ss += part[j];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        uint16_t *xr = x + (int64_t)r * ldx;
        for (int i = 0; i < dim; i++)
            xr[i] = f2bf(bf2f(w[i]) * bf2f(f2bf(bf2f(hr[i]) * inv)));
    }
    return 0;
}

int docqa_silu_mul_bf16(const uint16_t *gu, int64_t ldg, int rows, int inter, uint16_t *out,
                        int64_t ldo, int num_threads) {
    if (rows < 0 || inter <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gu + (int64_t)r * ldg, *u = g + inter;
        uint16_t *o = out + (int64_t)r * ldo;
        for (int i = 0; i < inter; i++) {
            const float a = bf2f(g[i]);
            const float e = exp_nonpositive(-fabsf(a)); /* exp(-|a|) */
            /* the sigmoid: 1 / (1 + e) for a >= 0, else e / (1 + e) (one division) */
            const float sig = (a >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[i] = f2bf(a * sig * bf2f(u[i]));
        }
    }
    return 0;
}

/* Rotary embedding of each token's query and key heads, in place in the qkv rows (float32
 * inside, one rounding: x1 cos - x2 sin, x2 cos + x1 sin over the two halves of a head), then
 * the token's key and value heads written to its slot of the paged caches (slot < 0: not
 * stored). cos and sin: bf16 tables [positions, dim]. */
/* Rotary embedding of a token's first `rot` heads (its query and key heads) in place, with its
 * position's cos and sin rows (float32 once for all its heads; each result rounded to bf16). */
static inline void rotate_bf16(uint16_t *row, const uint16_t *c, const uint16_t *s, int rot,
                               int dim) {
    const int half = dim / 2;
    float cf[dim], sf[dim];
    for (int i = 0; i < dim; i++) {
        cf[i] = bf2f(c[i]);
        sf[i] = bf2f(s[i]);
    }
    for (int h = 0; h < rot; h++) {
        uint16_t *restrict x1p = row + (int64_t)h * dim, *restrict x2p = x1p + half;
        for (int i = 0; i < half; i++) {
            const float x1 = bf2f(x1p[i]), x2 = bf2f(x2p[i]);
            x1p[i] = f2bf(x1 * cf[i] - x2 * sf[i]);
            x2p[i] = f2bf(x2 * cf[i + half] + x1 * sf[i + half]);
        }
    }
}

int docqa_rotary_store_bf16(uint16_t *qkv, int64_t ldq, int n, int num_heads, int num_kv_heads,
                            int dim, const int64_t *positions, const uint16_t *cos_t,
                            const uint16_t *sin_t, const int64_t *slots, uint16_t *k_cache,
                            uint16_t *v_cache, int num_threads) {
    if (n < 0 || dim <= 0 || dim % 2) return -1;
    const int rot = num_heads + num_kv_heads;
    const int64_t kv_row = (int64_t)num_kv_heads * dim;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (n >= PARALLEL_ROWS)
    for (int t = 0; t < n; t++) {
        uint16_t *row = qkv + (int64_t)t * ldq;
        rotate_bf16(row, cos_t + positions[t] * dim, sin_t + positions[t] * dim, rot, dim);
        if (slots[t] >= 0) {
            memcpy(k_cache + slots[t] * kv_row, row + (int64_t)num_heads * dim, kv_row * 2);
            memcpy(v_cache + slots[t] * kv_row, row + (int64_t)rot * dim, kv_row * 2);
        }
    }
    return 0;
}

/* An 8-bit KV cache (inference/kv_quant.py): each element times its channel's reciprocal
 * scale (a power of two: exact), then int8 (nearest even, clamped to +-127) or fp8 e4m3
 * (clamped to +-448, nearest even), the same bits as torch's conversions. */
static inline uint8_t to_int8(float v) {
    v = __builtin_rintf(v);
    v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
    return (uint8_t)(int8_t)v;
}

static inline uint8_t to_fp8_e4m3(float v) {
    v = v > 448.0f ? 448.0f : v < -448.0f ? -448.0f : v;
    uint32_t u;
    memcpy(&u, &v, 4);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (u < (121u << 23)) { /* below 2^-6: a subnormal of e4m3 (or zero), rounded by the add */
        const uint32_t magic = 141u << 23;
        float f, m;
        memcpy(&f, &u, 4);
        memcpy(&m, &magic, 4);
        f += m;
        memcpy(&u, &f, 4);
        r = (uint8_t)(u - magic);
    } else {
        const uint32_t odd = (u >> 20) & 1u;
        u += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
        r = (uint8_t)(u >> 20);
    }
    return r | (uint8_t)(sign >> 24);
}

static inline void store_kv8(uint8_t *dst, const uint16_t *src, const float *inv, int n,
                             int format) {
    if (format == 1)
        for (int i = 0; i < n; i++) dst[i] = to_int8(bf2f(src[i]) * inv[i]);
    else
        for (int i = 0; i < n; i++) dst[i] = to_fp8_e4m3(bf2f(src[i]) * inv[i]);
}

/* docqa_rotary_store_bf16 into 8-bit caches: format 1 int8, 2 fp8 e4m3; k_inv and v_inv the
 * reciprocal scales [kv heads * dim] of this layer. */
int docqa_rotary_store_bf16_kv8(uint16_t *qkv, int64_t ldq, int n, int num_heads,
                                int num_kv_heads, int dim, const int64_t *positions,
                                const uint16_t *cos_t, const uint16_t *sin_t,
                                const int64_t *slots, uint8_t *k_cache, uint8_t *v_cache,
                                const float *k_inv, const float *v_inv, int format,
                                int num_threads) {
    if (n < 0 || dim <= 0 || dim % 2 || (format != 1 && format != 2)) return -1;
    const int rot = num_heads + num_kv_heads;
    const int kv_row = num_kv_heads * dim;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (n >= PARALLEL_ROWS)
    for (int t = 0; t < n; t++) {
        uint16_t *row = qkv + (int64_t)t * ldq;
        rotate_bf16(row, cos_t + positions[t] * dim, sin_t + positions[t] * dim, rot, dim);
        if (slots[t] >= 0) {
            store_kv8(k_cache + slots[t] * kv_row, row + (int64_t)num_heads * dim, k_inv, kv_row,
                      format);
            store_kv8(v_cache + slots[t] * kv_row, row + (int64_t)rot * dim, v_inv, kv_row,
                      format);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------
 * float32: the same steps as layers.rms_norm, F.silu(g) * u and RotaryTable.apply plus the
 * cache store compute them, within a few units in the last place (the sum of squares and the
 * exponential are this file's, in a fixed order).
 * ------------------------------------------------------------------------------------------ */

int docqa_add_rms_norm_f32(float *h, int64_t ldh, const float *delta, int64_t ldd,
                           const float *w, float *x, int64_t ldx, int rows, int dim, float eps,
                           int num_threads) {
    if (rows < 0 || dim <= 0 || dim % 16) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        float *hr = h + (int64_t)r * ldh;
        if (delta) {
            const float *dr = delta + (int64_t)r * ldd;
            for (int i = 0; i < dim; i++) hr[i] += dr[i];
        }
        float part[16] = {0};
        for (int i = 0; i < dim; i += 16)
            for (int j = 0; j < 16; j++) part[j] += hr[i + j] * hr[i + j];
        float ss = 0.0f;
        for (int j = 0; j < 16; j++) ss += part[j];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *xr = x + (int64_t)r * ldx;
        for (int i = 0; i < dim; i++) xr[i] = w[i] * (hr[i] * inv);
    }
    return 0;
}

/* exp_nonpositive for 8 lanes at once (GCC vector extensions: the compiler does not
 * vectorize the scalar one's selects), the same polynomial; lanes below -87 give exp(-87). */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f v8_select(v8i mask, v8f a, v8f b) {
    return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask));
}

static inline v8f exp_nonpositive8(v8f x) {
    const v8f lo = (v8f){0} - 87.0f;
    x = v8_select(x < lo, lo, x);
    const v8f y0 = x * 1.44269504088896341f + 0.5f;
    v8f n = __builtin_convertvector(__builtin_convertvector(y0, v8i), v8f); /* toward zero */
    n += __builtin_convertvector(n > y0, v8f);                              /* floor */
    const v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    return p * (v8f)bits;
}

/* silu(g) * u = g * u / (1 + exp(-g)), with e = exp(-|g|) so nothing overflows: for g >= 0
 * the sigmoid is 1 / (1 + e), else e / (1 + e). A row's last elements past a multiple of 8
 * go through the same vector arithmetic in a zero-padded vector. */
int docqa_silu_mul_f32(const float *gu, int64_t ldg, int rows, int inter, float *out,
                       int64_t ldo, int num_threads) {
    if (rows < 0 || inter <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (rows >= PARALLEL_ROWS)
    for (int r = 0; r < rows; r++) {
        const float *g = gu + (int64_t)r * ldg, *u = g + inter;
        float *o = out + (int64_t)r * ldo;
        const v8f one = (v8f){0} + 1.0f;
        const v8i sign_bit = (v8i){0} + INT32_MIN;
        for (int i = 0; i < inter; i += 8) {
            v8f a = {0}, b = {0};
            const int m = inter - i < 8 ? inter - i : 8;
            if (m == 8) { /* one vector load each */
                memcpy(&a, g + i, sizeof a);
                memcpy(&b, u + i, sizeof b);
            } else {
                memcpy(&a, g + i, sizeof(float) * m);
                memcpy(&b, u + i, sizeof(float) * m);
            }
            const v8f e = exp_nonpositive8((v8f)((v8i)a | sign_bit)); /* exp(-|a|) */
            const v8f num = v8_select(((v8i)a & sign_bit) != 0, e, one);
            const v8f res = a * (num / (one + e)) * b;
            if (m == 8)
                memcpy(o + i, &res, sizeof res);
            else
                memcpy(o + i, &res, sizeof(float) * m);
        }
    }
    return 0;
}

/* Rotary embedding of a token's first `rot` heads in place, in float32. */
static inline void rotate_f32(float *row, const float *c, const float *s, int rot, int dim) {
    const int half = dim / 2;
    for (int h = 0; h < rot; h++) {
        float *x = row + (int64_t)h * dim;
        for (int i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] - x2 * s[i];
            x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
    }
}

/* As docqa_rotary_store_bf16, in float32: cos and sin float32 tables [positions, dim], the
 * caches float32. */
int docqa_rotary_store_f32(float *qkv, int64_t ldq, int n, int num_heads, int num_kv_heads,
                           int dim, const int64_t *positions, const float *cos_t,
                           const float *sin_t, const int64_t *slots, float *k_cache,
                           float *v_cache, int num_threads) {
    if (n < 0 || dim <= 0 || dim % 2) return -1;
    const int rot = num_heads + num_kv_heads;
    const int64_t kv_row = (int64_t)num_kv_heads * dim;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (n >= PARALLEL_ROWS)
    for (int t = 0; t < n; t++) {
        float *row = qkv + (int64_t)t * ldq;
        rotate_f32(row, cos_t + positions[t] * dim, sin_t + positions[t] * dim, rot, dim);
        if (slots[t] >= 0) {
            memcpy(k_cache + slots[t] * kv_row, row + (int64_t)num_heads * dim, kv_row * 4);
            memcpy(v_cache + slots[t] * kv_row, row + (int64_t)rot * dim, kv_row * 4);
        }
    }
    return 0;
}

/* docqa_rotary_store_f32 into 8-bit caches (docqa_rotary_store_bf16_kv8's quantization). */
int docqa_rotary_store_f32_kv8(float *qkv, int64_t ldq, int n, int num_heads, int num_kv_heads,
                               int dim, const int64_t *positions, const float *cos_t,
                               const float *sin_t, const int64_t *slots, uint8_t *k_cache,
                               uint8_t *v_cache, const float *k_inv, const float *v_inv,
                               int format, int num_threads) {
    if (n < 0 || dim <= 0 || dim % 2 || (format != 1 && format != 2)) return -1;
    const int rot = num_heads + num_kv_heads;
    const int kv_row = num_kv_heads * dim;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (n >= PARALLEL_ROWS)
    for (int t = 0; t < n; t++) {
        float *row = qkv + (int64_t)t * ldq;
        rotate_f32(row, cos_t + positions[t] * dim, sin_t + positions[t] * dim, rot, dim);
        if (slots[t] >= 0) {
            const float *k = row + (int64_t)num_heads * dim, *v = row + (int64_t)rot * dim;
            uint8_t *kd = k_cache + slots[t] * kv_row, *vd = v_cache + slots[t] * kv_row;
            for (int i = 0; i < kv_row; i++) {
                kd[i] = format == 1 ? to_int8(k[i] * k_inv[i]) : to_fp8_e4m3(k[i] * k_inv[i]);
                vd[i] = format == 1 ? to_int8(v[i] * v_inv[i]) : to_fp8_e4m3(v[i] * v_inv[i]);
            }
        }
    }
    return 0;
}

/* Greedy sampling: for each of m rows of n float32 logits (row r at x + r * ldx), the index of
 * its largest value into out[r], the first of equal ones (-0.0 equal to 0.0), or the first NaN
 * where a row has one: torch.argmax's answer. Two passes over a row, 16 lanes wide (8 with
 * AVX2): its maximum (and whether it holds a NaN), then the first index holding it. */
static int64_t row_argmax(const float *p, int n) {
    int j = 0, nan = 0;
    float best = -INFINITY;
#ifdef __AVX512F__
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(p + j);
        mx = _mm512_max_ps(v, mx); /* v > mx ? v : mx */
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    best = _mm512_reduce_max_ps(mx);
    nan = unordered != 0;
#elif defined(__AVX2__)
    __m256 mx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(p + j);
        mx = _mm256_max_ps(v, mx); /* v > mx ? v : mx */
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    best = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    nan = _mm256_movemask_ps(unordered) != 0;
#endif
    for (; j < n; j++) {
        best = p[j] > best ? p[j] : best;
        nan |= p[j] != p[j];
    }
    j = 0;
#ifdef __AVX512F__
    const __m512 b = _mm512_set1_ps(best);
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(p + j);
        const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                  : _mm512_cmp_ps_mask(v, b, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz(hit);
    }
#elif defined(__AVX2__)
    const __m256 b = _mm256_set1_ps(best);
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(p + j);
        const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                               : _mm256_cmp_ps(v, b, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz(hit);
    }
#endif
    for (; j < n; j++)
        if (nan ? p[j] != p[j] : p[j] == best) break;
    return j;
}

int docqa_argmax_f32(const float *x, int m, int n, int64_t ldx, int64_t *out, int num_threads) {
    if (m < 0 || n <= 0 || ldx < n) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (m > 1)
    for (int r = 0; r < m; r++) out[r] = row_argmax(x + (int64_t)r * ldx, n);
    return 0;
}
