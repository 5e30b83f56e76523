/* latent.h: the latent-attention layer the DeepSeek-V3 line shares (DeepSeek V3/R1/V3.2, Kimi K2, GLM-4.7-Flash,
 * GLM-5, Kimi Linear's full layers): MLA over the compressed cache (mla.h), optionally restricted to the DSA
 * indexer's top-k positions (dsa.h), with its hyperparameters declared once.
 *
 * Cache row per token and layer: [kv_lora latent | rope key | (DSA) index key], kv_width floats.
 */
#ifndef COLIBRI_LATENT_H
#define COLIBRI_LATENT_H

#include <stddef.h>

#include "blocks.h"
#include "dsa.h"
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
/* A cb_recipe free_layer for recipes whose layers are cb_latent. */
void cb_latent_free_layer(void *model, void *layer);
int cb_latent_sel_init(cb_latent_sel *sel, const cb_latent_shape *s, int max_batch);
void cb_latent_sel_free(cb_latent_sel *sel);
/* out = attention of rows h[0..n) at positions pos0.. on cache layer kv_layer. rope rotates the queries and keys
 * (NULL: NoPE), index_rope the indexer's (DSA models may rotate it differently). */
void cb_latent_forward(cb_latent *a, const cb_latent_shape *s, float *out, const float *h, int n, int pos0, cb_kv *kv,
                       int kv_layer, const cb_rope *rope, const cb_rope *index_rope, cb_latent_sel *sel);

#endif
