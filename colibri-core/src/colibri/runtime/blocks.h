/* blocks.h: the pieces a transformer family engine is composed of: weight loading, linear layers, RoPE,
 * causal attention over a slot's KV cache, and the routed MoE block (router + expert store).
 *
 * Every block processes n rows (tokens) at once and gives each row exactly the bits it would get alone, so
 * batching a prefill never changes a token.
 */
#ifndef COLIBRI_BLOCKS_H
#define COLIBRI_BLOCKS_H

#include <stddef.h>

#include "experts.h"
#include "fp8.h"
#include "hparams.h"
#include "kernels.h"
#include "kv.h"
#include "matrix.h"
#include "quant.h"
#include "safetensors.h"

/* ---- weights ---- */

/* A linear layer's weight [rows, cols] in its stored form (matrix.h: float, colibri-quant integer levels, fp8 with
 * block scales; m.kind says which, and cb_linear_apply / cb_embed dispatch on it). w owns the bytes m points into
 * (NULL for a borrowed matrix such as a tied LM head; only the scales of a mapped one). Code that reads the elements directly must first call
 * cb_linear_dequantize and then reads m.f.w / m.f.dt. */
typedef struct {
    void *w;
    cb_matrix m;
    void *map;           /* cb_map_linear: the read-only file mapping m's rows live in (NULL when loaded) */
    size_t map_len;
} cb_linear;

/* Load a [rows, cols] matrix (shape checked), adding its bytes to *bytes. Whatever the family, the stored form
 * is picked from the checkpoint, never from a name list: a colibri-quant container's int8/int4 entry; else, when
 * the checkpoint has a scale companion `<name>_scale_inv` (or `P.scale` for `P.weight`), an F8_E4M3 matrix with
 * 128x128 block scales (fp8.h: cb_fp8_locate checks dtype, shape and the scale grid [ceil(rows/128),
 * ceil(cols/128)], F32/BF16/F8_E8M0); else the float tensor (F32/BF16/F16). cb_linear_apply then computes
 * exactly what the float path computes on the dequantized f32 weights (e4m3 * scale, one f32 rounding). */
int cb_load_linear(cb_linear *l, const cb_st_index *idx, const char *name, int rows, int cols, size_t *bytes,
                   char *err, size_t errlen);
/* cb_load_linear for a matrix only ever read a row at a time (an untied input embedding: a token reads one row):
 * its rows stay in the file, mapped read-only and paged in as cb_embed touches them, and only scales (held) add to
 * *bytes. A matrix that cannot be mapped (fp8 block scales, misaligned in its file, mmap refused) is loaded. */
int cb_map_linear(cb_linear *l, const cb_st_index *idx, const char *name, int rows, int cols, size_t *bytes,
                  char *err, size_t errlen);
/* Load a vector of n weights converted to f32 (norm weights, biases). */
int cb_load_vector(float **out, const cb_st_index *idx, const char *name, int n, size_t *bytes, char *err,
                   size_t errlen);
/* Load the n elements of tensor t (F32/BF16/F16, shape checked by the caller) converted to f32. */
int cb_load_f32(float **out, const cb_st_index *idx, const cb_tensor *t, size_t n, size_t *bytes, char *err,
                size_t errlen);
/* The same into dst (n floats the caller owns): 0, or -1 with a message. */
int cb_read_f32(float *dst, const cb_st_index *idx, const cb_tensor *t, size_t n, char *err, size_t errlen);
void cb_linear_free(cb_linear *l);
/* Turn a quantized (or fp8) linear into a float (F32) one holding level * scale (e4m3 * block scale) exactly (a no-op
 * for a float one), for the blocks that read weights directly instead of through cb_linear_apply (MLA's
 * absorbed kv_b). 0 or -1. */
int cb_linear_dequantize(cb_linear *l, char *err, size_t errlen);

/* Y[i] = W X[i] for n rows (X: n x cols, Y: n x rows). */
void cb_linear_apply(const cb_linear *l, float *Y, const float *X, int n);
/* out = row `token` of an embedding matrix, as f32. */
void cb_embed(float *out, const cb_linear *emb, int token);
/* Each of n rows of width values += b (a bias; NULL: none). */
void cb_add_bias(float *y, const float *b, int n, int width);
/* y[i] += x[i] */
void cb_add(float *y, const float *x, size_t n);
/* Clamp every element to [-limit, limit]. */
void cb_clamp(float *x, size_t n, float limit);
/* The clamped SwiGLU's inputs (DeepSeek-V4): gate[i] = min(gate[i], limit), up[i] clamped to [-limit, limit]. */
void cb_swiglu_clamp(float *gate, float *up, size_t n, float limit);

/* ---- rotary position embedding ---- */

typedef struct {
    int neox;                  /* pairs (i, i + rot/2); else interleaved pairs (2i, 2i+1) */
    int rot_dim;               /* 2 * ceil(d / 2) for d = int(head_dim * partial_rotary_factor), as transformers */
    float *inv_freq;           /* rot_dim / 2 entries, 1 / theta^(2i / d) before scaling */
    float attention_factor;    /* scales cos and sin (YaRN-style types); 1 otherwise */
} cb_rope;

/* Read rope_theta (required), rope_type (default|linear|llama3|yarn), rope_factor, rope_low_freq_factor,
 * rope_high_freq_factor, rope_original_max_position and partial_rotary_factor from the hyperparameters; yarn also
 * reads rope_beta_fast, rope_beta_slow, rope_truncate and rope_attention_factor (the cos/sin scale, resolved by
 * the plugin). */
int cb_rope_init(cb_rope *r, cb_hparams *hp, int head_dim, int neox, char *err, size_t errlen);
void cb_rope_free(cb_rope *r);
void cb_rope_apply(const cb_rope *r, float *x, int n_heads, int head_dim, int pos);

/* ---- causal attention with a KV cache ---- */

typedef struct {
    int n_heads, n_kv_heads, head_dim;
    float scale;               /* usually head_dim^-0.5 */
} cb_attn_shape;

/* GQA's projections; the biases are NULL when the model has none. */
typedef struct {
    cb_linear wq, wk, wv, wo;
    float *bq, *bk, *bv, *bo;
} cb_qkvo;

/* q, k, v = the biased projections of n rows h. */
void cb_qkv_apply(const cb_qkvo *p, float *q, float *k, float *v, const float *h, int n);
/* The shape of GQA over `hidden`: head_dim 0 means hidden / n_heads, n_kv_heads 0 means n_heads; scale
 * head_dim^-0.5. 0, or -1 with a message naming the --set keys out of range. */
int cb_attn_shape_init(cb_attn_shape *s, int hidden, int n_heads, int n_kv_heads, int head_dim, char *err,
                       size_t errlen);
/* Scratch for cb_attend: scores for max_batch rows x n_heads x ctx. */
float *cb_attn_scratch(int max_batch, int n_heads, int ctx);

/* Store k/v of rows [0, n) (each n_kv_heads * head_dim) at positions pos0.. of `layer`. */
void cb_kv_store(cb_kv *kv, int layer, int pos0, int n, const float *k, const float *v);
/* out[i] = softmax(q[i] K^T * scale) V over positions [0, pos0 + i], per head (GQA: query head h reads KV head
 * h / (n_heads / n_kv_heads)). q and out are n x (n_heads * head_dim). */
void cb_attend(float *out, const float *q, const cb_kv *kv, int layer, int pos0, int n, const cb_attn_shape *s,
               float *scores);

/* ---- routed mixture of experts ---- */

typedef struct {
    int n_experts, top_k, norm_topk_prob, hidden, inter, max_batch;
    float swiglu_limit;        /* > 0: clamp gate to <= limit and up to [-limit, limit] before silu (DeepSeek-V4) */
    cb_linear router;          /* [n_experts, hidden] */
    cb_expert_layer store;
    /* scratch */
    float *logits;             /* max_batch x n_experts */
    int *chosen;               /* max_batch x top_k */
    float *weight;             /* max_batch x top_k */
    int *rows;                 /* rows that chose the current expert */
    int *n_rows;               /* per expert: how many rows chose it */
    float *weight_of_row;
    float *xs, *gate, *up, *down;
    float *y;                  /* max_batch x top_k x hidden: each (row, choice)'s expert output */
    int *pair_of_row;          /* row of the current expert -> its (row, choice) index */
    float *next_logits;        /* lookahead: the next layer's router applied to this layer's input */
    int borrowed;              /* xs, gate, up, down and y are another layer's (cb_moe_share_scratch) */
} cb_moe;

/* down row r = expert(x row rows[r]) for r < n_rows: the one computation of a routed expert's output, whichever
 * process runs it (the MoE block here and an expert worker both call it, so their bits agree). Scratch: xs n_rows x
 * hidden, gate and up n_rows x inter. A colibri-quant expert reads the input cb_qexperts_begin quantized instead of
 * x. swiglu_limit as cb_moe's. 0, or -1 with a message. */
int cb_expert_apply(const cb_expert_view *ex, float *down, float *xs, float *gate, float *up, const float *x,
                    const int *rows, int n_rows, int hidden, int inter, float swiglu_limit, char *err,
                    size_t errlen);

/* Load the router and locate the layer's experts (names: printf formats of (layer, expert), gate/up/down). */
int cb_moe_init(cb_moe *m, const cb_st_index *idx, int layer, const char *router_name,
                const char *const expert_names[3], int n_experts, int top_k, int norm_topk_prob, int hidden,
                int inter, int cap, int max_batch, size_t *dense_bytes, char *err, size_t errlen);
void cb_moe_free(cb_moe *m);
/* Point m's expert-compute scratch (xs, gate, up, down, y: the large buffers, max_batch x top_k x hidden for y) at
 * owner's and free m's own. A model's MoE layers run one after another, so one set serves them all instead of one
 * per layer; the router's buffers stay per layer (lookahead routes the next layer while this one computes). Does
 * nothing unless both have the same shape. */
void cb_moe_share_scratch(cb_moe *m, const cb_moe *owner);
/* out[i] = sum over the top-k experts of row i of weight * down(silu(gate x) * up x). Softmax over all
 * experts in f32, top-k (lowest index first on ties), renormalised when norm_topk_prob. Experts are visited
 * in ascending index, each read at most once per call and applied to every row that chose it; each row's sum
 * is accumulated in ascending expert order, which is what makes batching exact. */
int cb_moe_forward(cb_moe *m, float *out, const float *x, int n, char *err, size_t errlen);
/* The expert half of cb_moe_forward, for families that route differently (router.h): runs the experts already
 * written to m->chosen / m->weight (n rows x top_k) with the same summation order.
 *
 * Streaming: resident experts compute first while the I/O pool reads the missing ones (urgent, in file
 * order); each (row, choice) output lands in m->y and every row sums its experts in ascending expert index at
 * the end, so the visiting order never changes a bit. With prefetching on, a one-token call also applies the
 * NEXT MoE layer's router to this layer's input (the post-attention normed hidden state: the nearest stand-in
 * for the next layer's input, available one layer early) and stages its top-k as predictions.
 * The option moe_union = 0 (cb_stream_opts) computes row by row with matvecs instead (the test of batching). The
 * opt-in lossy knobs experts_k / experts_top_p drop a row's lowest-weight choices here (never by default). */
int cb_moe_experts_forward(cb_moe *m, float *out, const float *x, int n, char *err, size_t errlen);

#endif
