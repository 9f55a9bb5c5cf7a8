/* The decoder layers of one engine step in one call: the CPU fast path of LlamaModel.forward.
 *
 * Per layer it makes the calls LlamaModel._fused_layers makes, in the same order and with the
 * same arguments: RMSNorm (with the last layer's MLP output added to the residual first), the
 * qkv product, rotary embedding and the K/V store, attention, the output product, RMSNorm with
 * the attention output added, the gate/up product, SiLU times up, the down product. So its
 * results are the same bits as that loop's; what it saves is the interpreter's work around
 * each of those 270 calls of a 30-layer step (argument checks, views, allocations, ctypes
 * conversions: 2.5-6 ms a step on a Zen 4, a fifth of a one-token decode step).
 *
 * The kernels are the entry points of linear.c (or linear_amx.c), elementwise.c and
 * decode_attention.c, passed in as function pointers (each library is built on its own), and
 * each spreads its own work over the threads. Buffers are the caller's: nothing is allocated.
 */
#include <stdint.h>
#include <string.h>

typedef int (*linear_fn)(const void *x, int m, int64_t ldx, const void *packed, int n, int k,
                         const float *bias, void *y, int64_t ldy, float *part, int num_threads);
typedef int (*linear_amx_fn)(const void *x, int m, int64_t ldx, const void *packed, int n,
                             int k, const float *bias, void *y, int64_t ldy, int num_threads);
typedef int (*norm_fn)(void *h, int64_t ldh, const void *delta, int64_t ldd, const void *w,
                       void *x, int64_t ldx, int rows, int dim, float eps, int num_threads);
typedef int (*silu_fn)(const void *gu, int64_t ldg, int rows, int inter, void *out,
                       int64_t ldo, int num_threads);
typedef int (*rotary_fn)(void *qkv, int64_t ldq, int n, int num_heads, int num_kv_heads,
                         int dim, const int64_t *positions, const void *cos, const void *sin,
                         const int64_t *slots, void *k_cache, void *v_cache, int num_threads);
typedef int (*attn_bf16_fn)(const void *q, const int64_t *q_rows, int num_tokens,
                            const int32_t *group_start, const int32_t *group_shared,
                            int num_groups, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, int64_t table_stride,
                            const int32_t *ctx_lens, int num_heads, int num_kv_heads, int dim,
                            int block_size, float scale, void *out, const int64_t *out_rows,
                            int num_threads);
typedef int (*rotary_kv8_fn)(void *qkv, int64_t ldq, int n, int num_heads, int num_kv_heads,
                             int dim, const int64_t *positions, const void *cos,
                             const void *sin, const int64_t *slots, void *k_cache,
                             void *v_cache, const float *k_inv, const float *v_inv, int format,
                             int num_threads);
typedef int (*attn_kv8_fn)(const void *q, const int64_t *q_rows, int num_tokens,
                           const int32_t *group_start, const int32_t *group_shared,
                           int num_groups, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t table_stride,
                           const int32_t *ctx_lens, int num_heads, int num_kv_heads, int dim,
                           int block_size, float scale, void *out, const int64_t *out_rows,
                           int num_threads, int kv_format, const float *k_scale,
                           const float *v_scale);
typedef int (*attn_f32_kv8_fn)(const void *q, const int64_t *q_rows, int num_tokens,
                               const int32_t *group_start, const int32_t *group_shared,
                               int num_groups, const void *k_cache, const void *v_cache,
                               const int32_t *block_tables, int64_t table_stride,
                               const int32_t *ctx_lens, int num_heads, int num_kv_heads,
                               int dim, int block_size, float scale, float *out,
                               int num_threads, int kv_format, const float *k_scale,
                               const float *v_scale);
typedef int (*attn_f32_fn)(const void *q, int q_dtype, const int64_t *q_rows, int num_tokens,
                           const int32_t *group_start, const int32_t *group_shared,
                           int num_groups, const void *k_cache, const void *v_cache,
                           int kv_dtype, const int32_t *block_tables, int64_t table_stride,
                           const int32_t *ctx_lens, int num_heads, int num_kv_heads, int dim,
                           int block_size, float scale, float *out, int num_threads);

/* What does not change from step to step (filled once per model). */
typedef struct {
    void *linear;       /* docqa_linear_f32 / docqa_linear_bf16, or docqa_linear_bf16_amx */
    void *add_rms_norm; /* docqa_add_rms_norm_{bf16,f32} */
    void *silu_mul;     /* docqa_silu_mul_{bf16,f32} */
    void *rotary_store; /* docqa_rotary_store_{bf16,f32}, or _bf16_kv8 (8-bit caches) */
    void *attention;    /* docqa_attention_bf16 (bf16), docqa_decode_attention (float32), or
                         * docqa_attention_bf16_kv8 (bf16 over 8-bit caches) */
    int32_t amx;        /* 1: `linear` is the AMX kernel (no partial-sum buffer) */
    int32_t bf16;       /* 1: bf16 activations and caches; 0: float32 */
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, block_size;
    float eps, scale;
    int32_t kv_format; /* 0: caches in the compute dtype; 1: int8, 2: fp8 e4m3 */
} ModelDesc;

/* One layer's weights and caches (filled once per model and pool). */
typedef struct {
    const void *input_norm, *post_norm; /* [hidden], the compute dtype */
    const void *qkv, *o_proj, *gate_up, *down; /* packed for `linear` */
    const float *qkv_bias;              /* [qkv out] float32, or NULL */
    void *k_cache, *v_cache;            /* [blocks, block_size, kv heads, head_dim] */
    const float *k_scale, *v_scale, *k_inv, *v_inv; /* 8-bit caches: [kv heads * head_dim] */
} LayerDesc;

/* One step: its rows, buffers (rows dense, row strides the widths below) and attention plan. */
typedef struct {
    int32_t rows, num_threads;
    void *h;        /* [rows, hidden] the residual stream, updated in place */
    void *x;        /* [rows, hidden] a normed row */
    void *qkv;      /* [rows, (heads + 2 kv heads) * head_dim] */
    void *attn;     /* [rows, heads * head_dim] */
    void *o;        /* [rows, hidden] */
    void *gu;       /* [rows, 2 * inter] */
    void *act;      /* [rows, inter] */
    void *delta;    /* [rows, hidden] the last layer's MLP output, not yet added to h */
    float *part;    /* linear.c's partial sums: ROW_BLOCK x (widest padded output) floats */
    float *attn_f32; /* [tokens, heads * head_dim] the float32 kernel's output, group order */
    const int64_t *positions, *slots; /* [rows] */
    const void *cos, *sin;            /* [positions, head_dim] */
    /* the attention plan (CPUBackend.plan): tokens in group order */
    int32_t num_tokens, num_groups;
    int64_t table_stride;
    const int64_t *q_rows;    /* [tokens] each token's row */
    const int64_t *q_start;   /* [tokens] its first element in qkv */
    const int64_t *out_start; /* [tokens] its first element in attn */
    const int32_t *group_start, *group_shared, *tables, *ctx;
} StepDesc;

static int product(const ModelDesc *md, const StepDesc *sd, const void *x, int64_t ldx,
                   const void *w, int n, int k, const float *bias, void *y) {
    if (md->amx)
        return ((linear_amx_fn)md->linear)(x, sd->rows, ldx, w, n, k, bias, y, n,
                                           sd->num_threads);
    return ((linear_fn)md->linear)(x, sd->rows, ldx, w, n, k, bias, y, n, sd->part,
                                   sd->num_threads);
}

/* Runs every layer. Returns 0, or 1 + (layer * 16 + the call that failed) for a kernel that
 * refused its sizes (the calls numbered 0 to 8 in the order above). */
int docqa_forward_layers(const ModelDesc *md, const LayerDesc *layers, const StepDesc *sd) {
    const int rows = sd->rows, t = sd->num_threads;
    const int H = md->hidden, I = md->inter, D = md->head_dim;
    const int qd = md->num_heads * D, qkv_n = (md->num_heads + 2 * md->num_kv_heads) * D;
    const norm_fn norm = (norm_fn)md->add_rms_norm;
    const size_t esize = md->bf16 ? 2 : 4;
    for (int l = 0; l < md->num_layers; l++) {
        const LayerDesc *L = &layers[l];
        int rc, call = 0;
#define STEP(expr)                                                                             \
    if ((rc = (expr)) != 0) return 1 + l * 16 + call;                                          \
    call++;
        STEP(norm(sd->h, H, l ? sd->delta : NULL, H, L->input_norm, sd->x, H, rows, H, md->eps,
                  t))
        STEP(product(md, sd, sd->x, H, L->qkv, qkv_n, H, L->qkv_bias, sd->qkv))
        if (md->kv_format) {
            STEP(((rotary_kv8_fn)md->rotary_store)(
                sd->qkv, qkv_n, rows, md->num_heads, md->num_kv_heads, D, sd->positions, sd->cos,
                sd->sin, sd->slots, L->k_cache, L->v_cache, L->k_inv, L->v_inv, md->kv_format,
                t))
        } else {
            STEP(((rotary_fn)md->rotary_store)(sd->qkv, qkv_n, rows, md->num_heads,
                                               md->num_kv_heads, D, sd->positions, sd->cos,
                                               sd->sin, sd->slots, L->k_cache, L->v_cache, t))
        }
        if (md->kv_format && md->bf16) {
            STEP(((attn_kv8_fn)md->attention)(
                sd->qkv, sd->q_start, sd->num_tokens, sd->group_start, sd->group_shared,
                sd->num_groups, L->k_cache, L->v_cache, sd->tables, sd->table_stride, sd->ctx,
                md->num_heads, md->num_kv_heads, D, md->block_size, md->scale, sd->attn,
                sd->out_start, t, md->kv_format, L->k_scale, L->v_scale))
        } else if (md->bf16) {
            STEP(((attn_bf16_fn)md->attention)(
                sd->qkv, sd->q_start, sd->num_tokens, sd->group_start, sd->group_shared,
                sd->num_groups, L->k_cache, L->v_cache, sd->tables, sd->table_stride, sd->ctx,
                md->num_heads, md->num_kv_heads, D, md->block_size, md->scale, sd->attn,
                sd->out_start, t))
        } else {
            /* float32 activations and kernel output (caches float32 or 8-bit): token i's
             * heads go to its row */
            if (md->kv_format) {
                STEP(((attn_f32_kv8_fn)md->attention)(
                    sd->qkv, sd->q_start, sd->num_tokens, sd->group_start, sd->group_shared,
                    sd->num_groups, L->k_cache, L->v_cache, sd->tables, sd->table_stride,
                    sd->ctx, md->num_heads, md->num_kv_heads, D, md->block_size, md->scale,
                    sd->attn_f32, t, md->kv_format, L->k_scale, L->v_scale))
            } else {
                STEP(((attn_f32_fn)md->attention)(
                    sd->qkv, 0, sd->q_start, sd->num_tokens, sd->group_start, sd->group_shared,
                    sd->num_groups, L->k_cache, L->v_cache, 0, sd->tables, sd->table_stride,
                    sd->ctx, md->num_heads, md->num_kv_heads, D, md->block_size, md->scale,
                    sd->attn_f32, t))
            }
            for (int i = 0; i < sd->num_tokens; i++)
                memcpy((char *)sd->attn + sd->q_rows[i] * qd * esize,
                       sd->attn_f32 + (int64_t)i * qd, qd * esize);
        }
        STEP(product(md, sd, sd->attn, qd, L->o_proj, H, qd, NULL, sd->o))
        STEP(norm(sd->h, H, sd->o, H, L->post_norm, sd->x, H, rows, H, md->eps, t))
        STEP(product(md, sd, sd->x, H, L->gate_up, 2 * I, H, NULL, sd->gu))
        STEP(((silu_fn)md->silu_mul)(sd->gu, 2 * I, rows, I, sd->act, I, t))
        STEP(product(md, sd, sd->act, I, L->down, H, I, NULL, sd->delta))
#undef STEP
    }
    return 0;
}
