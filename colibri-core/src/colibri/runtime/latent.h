/* latent.h: the attention of the DeepSeek-V3 line (DeepSeek V3/R1/V3.2, Kimi K2, GLM-4.5 to GLM-5, Kimi Linear's
 * full layers): MLA over the compressed cache (mla.h), optionally restricted to the DSA indexer's top-k positions
 * (dsa.h), or (GLM-4.5) grouped-query attention (gqa.h), as a runtime block (cb_attention) a recipe declares:
 *
 *     static const cb_attention_spec ATTENTION = {.kinds = "mla,dsa", .index_neox = 1};
 *     static const cb_recipe RECIPE = {CB_ATTENTION_RECIPE(my_model, attn, ATTENTION), ...};
 *
 * The block reads `attention` (one of the spec's kinds, the first the default) and that kind's keys, builds the
 * RoPE tables, loads every layer's attention, and reports the KV geometry; the family's mixer composes the forward
 * from the blocks (cb_mla_project, cb_dsa_select, cb_mla_attend, cb_gqa_forward) over the layer's cb_attention_layer.
 *
 * Cache row per token and layer: [kv_lora latent | rope key | (DSA) index key], kv_width floats (MLA / DSA);
 * k then v, n_kv_heads x head_dim each (GQA).
 */
#ifndef COLIBRI_LATENT_H
#define COLIBRI_LATENT_H

#include <stddef.h>

#include "blocks.h"
#include "decoder.h"
#include "dsa.h"
#include "gqa.h"
#include "hparams.h"
#include "mla.h"

typedef struct {
    cb_mla_shape mla;
    cb_dsa_shape dsa;
    int sparse;                /* DSA: attend to the indexer's selection */
    int kv_width, index_col;   /* the cache row, and where the index key starts in it */
} cb_latent_shape;

typedef struct {
    cb_mla mla;
    int has_indexer;           /* DSA layers without one reuse the selection of the last layer that ran its own */
    cb_dsa dsa;
} cb_latent;

/* The selection carried across layers (DSA). */
typedef struct {
    int *sel, *n_sel;
} cb_latent_sel;

/* ---- the attention block a recipe declares ---- */

typedef enum { CB_ATTN_MLA = 0, CB_ATTN_DSA = 1, CB_ATTN_GQA = 2 } cb_attn_kind;

/* What a family's attention may be, stated once. */
typedef struct {
    const char *kinds;         /* the attention= values it accepts, comma-separated (mla, dsa, gqa), the first the default */
    int index_neox;            /* DSA: the indexer rotates half-split pairs while the attention's stay interleaved
                                  (DeepSeek V3.2; else the indexer shares the attention's table, as GLM-5) */
    int shared_indexers;       /* DSA: indexer_layers (one letter per layer: F runs its own indexer, S reuses the
                                  previous one's selection), else every layer runs its own */
    int nope;                  /* MLA without RoPE (Kimi Linear): no RoPE keys are read */
    const char *on;            /* NULL: every layer; else only the layers whose letter in the model's per-layer
                                  string at `letters` (a CB_HP_PER_LAYER field) is in on, numbered on the KV cache */
    size_t letters;
} cb_attention_spec;

typedef struct {
    cb_latent lat;             /* MLA / DSA */
    cb_gqa gqa;                /* GQA */
    int kv_layer;              /* its layer of the KV cache */
} cb_attention_layer;

typedef struct {
    const cb_attention_spec *spec;
    const char *attention;     /* --set attention */
    cb_attn_kind kind;
    int bias;                  /* attention_bias: MLA's q_a / kv_a / o biases, GQA's q / k / v biases */
    int interleave;            /* MLA: rope_interleave (default on); DSA always interleaves the attention's pairs */
    cb_latent_shape s;         /* MLA / DSA */
    cb_gqa_config gqa;         /* GQA (use_qk_norm: per-head q/k RMSNorm) */
    const char *indexer_layers;
    int n_layers, n_kv;
    cb_attention_layer *layers;
    cb_rope rope, index_rope;  /* index_rope: spec->index_neox only */
    cb_latent_sel sel;         /* DSA: the current selection, carried across layers that reuse it */
    cb_gqa_scratch scratch;    /* GQA */
} cb_attention;

extern const cb_block_type cb_attention_block;

/* A recipe's fields for a cb_attention at field f of the model struct MT, declared by the cb_attention_spec spec. */
#define CB_ATTENTION_RECIPE(MT, f, spec) \
    .block = &cb_attention_block, .block_at = offsetof(MT, f), .block_spec = &(spec)

/* MLA's keys into a cb_latent_shape field s of struct T (attention_bias and attention_scale are the family's:
 * not every model has them). */
#define CB_MLA_HPARAMS(T, s)                                                                                \
    CB_HP_REQ("num_attention_heads", T, s.mla.n_heads), CB_HP_OPT("q_lora_rank", T, s.mla.q_lora, 0, CB_HP_NONNEG), \
    CB_HP_REQ("kv_lora_rank", T, s.mla.kv_lora),                                                            \
    {"qk_nope_head_dim", CB_HP_INT, offsetof(T, s.mla.nope), 0, CB_HP_NONNEG, NULL, 0},                     \
    {"qk_rope_head_dim", CB_HP_INT, offsetof(T, s.mla.rope), 0, CB_HP_NONNEG, NULL, 0},                     \
    CB_HP_REQ("v_head_dim", T, s.mla.v_dim)
#define CB_MLA_SCALE_HPARAM(T, s) CB_HP_NUM("attention_scale", T, s.mla.scale, 0, CB_HP_NONNEG)
/* The DSA indexer's keys (read only for a sparse model). */
#define CB_DSA_HPARAMS(T, s)                                                                                \
    CB_HP_REQ("index_n_heads", T, s.dsa.n_heads), CB_HP_REQ("index_head_dim", T, s.dsa.head_dim),          \
    CB_HP_REQ("index_topk", T, s.dsa.topk)

/* After the keys: the derived fields (softmax scale (nope + rope)^-0.5 unless attention_scale gave one, the lora
 * norms' eps, the cache row). */
void cb_latent_shape_finish(cb_latent_shape *s, int hidden);
/* Layer l's attention under model.layers.<l>.self_attn. (and its indexer. when indexer is set). */
int cb_latent_init(cb_latent *a, const cb_st_index *idx, int l, const cb_latent_shape *s, int indexer, int max_batch,
                   int ctx, size_t *bytes, char *err, size_t errlen);
void cb_latent_free(cb_latent *a);
/* out = attention of rows h[0..n) at positions pos0.. on cache layer kv_layer. rope rotates the queries and keys
 * (NULL: NoPE), index_rope the indexer's (DSA models may rotate it differently). */
void cb_latent_forward(cb_latent *a, const cb_latent_shape *s, float *out, const float *h, int n, int pos0, cb_kv *kv,
                       int kv_layer, const cb_rope *rope, const cb_rope *index_rope, cb_latent_sel *sel);

/* out = layer l's attention of the rows h[0..n) at positions pos0.. on its KV layer, as the block's kind says; the
 * DSA indexer rotates with index_rope (the family's: &a->index_rope with spec->index_neox, else &a->rope). */
void cb_attention_forward(cb_attention *a, int l, float *out, const float *h, int n, int pos0, cb_kv *kv,
                          const cb_rope *index_rope);

#endif
