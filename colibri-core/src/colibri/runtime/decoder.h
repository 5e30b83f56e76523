/* decoder.h: the scaffolding every pre-norm MoE decoder shares, so a family engine is a recipe.
 *
 *     x = embed(tokens)
 *     per layer:  x += mixer(rmsnorm(x, input_layernorm))          the family's own block (GQA, MLA, DeltaNet, ...)
 *                 x += ffn(rmsnorm(x, post_attention_layernorm))   dense SwiGLU, softmax MoE or grouped MoE
 *     logits = lm_head(rmsnorm(x, norm))                           of the last row, or of every row
 *
 * The decoder owns the checkpoint index, the embedding, the final norm, the (tied) LM head, both norms and the
 * FFN of every layer, the expert-store registry the process reads for stats, and the activations x, h, proj. A
 * family puts a cb_decoder first in its model struct, describes its hyperparameters in a cb_hp_spec table (starting
 * with CB_DECODER_HPARAMS and, for a routed FFN, CB_DECODER_MOE_HPARAMS or CB_DECODER_GROUPED_HPARAMS) and its
 * per-layer tensors in a cb_tensor_spec table, and writes the mixer; its cb_recipe ties them together, and
 *
 *     static const cb_family fam = {"name", my_load, cb_decoder_forward, cb_decoder_unload};
 *
 * with my_load calling cb_decoder_load(out, &recipe, ...). Tensor names are the
 * Hugging Face Llama layout (model.embed_tokens, model.layers.<l>.input_layernorm, ..., lm_head) unless the recipe
 * names its own (other checkpoint layouts: cb_decoder_name); the FFN prefixes are the recipe's. A family whose
 * residual differs (several streams, say) loads through the decoder and writes its own forward from the pieces
 * below (cb_decoder_embed, the per-layer norms, cb_decoder_logits).
 */
#ifndef COLIBRI_DECODER_H
#define COLIBRI_DECODER_H

#include <stddef.h>

#include "blocks.h"
#include "family.h"
#include "grouped_moe.h"
#include "hparams.h"
#include "mlp.h"
#include "swiglu.h"

/* ---- per-layer tensors, declared ---- */

typedef enum {
    CB_TENSOR_LINEAR = 0,      /* a cb_linear [rows, cols] in its stored form */
    CB_TENSOR_VECTOR = 1,      /* a float * of rows f32 values */
    CB_TENSOR_TABLE = 2,       /* a float * of an f32/bf16/f16 [rows, cols] tensor (mixing maps, position tables) */
    CB_TENSOR_INDEX = 3,       /* an int32_t * of an I64/I32 [rows, cols] tensor (token -> expert tables) */
} cb_tensor_kind;

#define CB_ALWAYS ((size_t)-1)

/* One tensor of a layer. The name is a printf format of the layer index; rows and cols are the offsets of int fields
 * of the model struct (a vector has rows elements); `when` is the offset of an int flag of the model struct (the
 * tensor is loaded only when it is non-zero), or CB_ALWAYS; with `on` set, the tensor is loaded only on layers whose
 * letter in the model struct's per-layer string at `letters` (a const char *, e.g. a CB_HP_PER_LAYER key) is one of
 * `on`'s letters. Names follow the decoder's layout rules (cb_decoder_name). */
typedef struct {
    const char *name;          /* NULL ends a table */
    cb_tensor_kind kind;
    size_t at;                 /* offset of the cb_linear / float * in the layer struct */
    size_t rows, cols;
    size_t when;
    size_t letters;
    const char *on;
} cb_tensor_spec;

#define CB_LINEAR(name, LT, f, MT, rows, cols) \
    {name, CB_TENSOR_LINEAR, offsetof(LT, f), offsetof(MT, rows), offsetof(MT, cols), CB_ALWAYS, 0, NULL}
#define CB_LINEAR_IF(name, LT, f, MT, rows, cols, flag) \
    {name, CB_TENSOR_LINEAR, offsetof(LT, f), offsetof(MT, rows), offsetof(MT, cols), offsetof(MT, flag), 0, NULL}
#define CB_VECTOR(name, LT, f, MT, n) {name, CB_TENSOR_VECTOR, offsetof(LT, f), offsetof(MT, n), 0, CB_ALWAYS, 0, NULL}
#define CB_VECTOR_IF(name, LT, f, MT, n, flag) \
    {name, CB_TENSOR_VECTOR, offsetof(LT, f), offsetof(MT, n), 0, offsetof(MT, flag), 0, NULL}
#define CB_TABLE(name, LT, f, MT, rows, cols) \
    {name, CB_TENSOR_TABLE, offsetof(LT, f), offsetof(MT, rows), offsetof(MT, cols), CB_ALWAYS, 0, NULL}
/* Loaded only on the layers whose letter in the model's string field `letters` is in `on` (e.g. "HC"). */
#define CB_LINEAR_ON(name, LT, f, MT, rows, cols, letters, on) \
    {name, CB_TENSOR_LINEAR, offsetof(LT, f), offsetof(MT, rows), offsetof(MT, cols), CB_ALWAYS, offsetof(MT, letters), on}
/* Both: the flag set and the layer's letter in `on`. */
#define CB_LINEAR_IF_ON(name, LT, f, MT, rows, cols, flag, letters, on) \
    {name, CB_TENSOR_LINEAR, offsetof(LT, f), offsetof(MT, rows), offsetof(MT, cols), offsetof(MT, flag), \
     offsetof(MT, letters), on}
#define CB_VECTOR_ON(name, LT, f, MT, n, letters, on) \
    {name, CB_TENSOR_VECTOR, offsetof(LT, f), offsetof(MT, n), 0, CB_ALWAYS, offsetof(MT, letters), on}
#define CB_INDEX_ON(name, LT, f, MT, rows, cols, letters, on) \
    {name, CB_TENSOR_INDEX, offsetof(LT, f), offsetof(MT, rows), offsetof(MT, cols), CB_ALWAYS, offsetof(MT, letters), on}
#define CB_TABLE_ON(name, LT, f, MT, rows, cols, letters, on) \
    {name, CB_TENSOR_TABLE, offsetof(LT, f), offsetof(MT, rows), offsetof(MT, cols), CB_ALWAYS, offsetof(MT, letters), on}
#define CB_TENSORS_END {NULL, CB_TENSOR_LINEAR, 0, 0, 0, 0, 0, NULL}

/* Load the table's tensors of layer l into the layer struct (shapes from the model struct: a recipe's, whose
 * cb_decoder names them), adding their bytes to *bytes. 0, or -1 naming the tensor. */
int cb_load_tensors(void *layer, const void *model, const cb_tensor_spec *table, int l, const cb_st_index *idx,
                    size_t *bytes, char *err, size_t errlen);
struct cb_decoder;
/* The same for a block's table: shapes, flags and letters are fields of the block struct `shapes`; names are in d's
 * layout, bytes counted in d's dense bytes. */
int cb_load_block_tensors(void *layer, const void *shapes, struct cb_decoder *d, const cb_tensor_spec *table, int l,
                          char *err, size_t errlen);
/* Free what cb_load_tensors loaded (or any part of it). */
void cb_free_tensors(void *layer, const cb_tensor_spec *table);

/* ---- per-model scratch, declared ---- */

/* A float buffer of max_batch x mult x (the int field at width) the decoder allocates after the layers and frees
 * (none when that is 0). */
typedef struct {
    size_t at;                 /* offset of the float * in the model struct; 0 ends a table (the decoder is there) */
    size_t width;
    int mult;
} cb_scratch_spec;

#define CB_SCRATCH(MT, f, width_field, mult) {offsetof(MT, f), offsetof(MT, width_field), mult}
#define CB_SCRATCH_END {0, 0, 0}

/* The table's buffers of `owner` (a model or a block struct) for max_batch rows: 0, or -1 (out of memory). */
int cb_alloc_scratch(void *owner, const cb_scratch_spec *table, int max_batch, char *err, size_t errlen);
void cb_free_scratch(void *owner, const cb_scratch_spec *table);

/* ---- the feed-forward half of a layer ---- */

/* CB_FFN_NONE as a recipe's `routed`: the family loads and runs its routed layers' FFN itself (its own router);
 * CB_FFN_DENSE: every layer is a dense SwiGLU. */
typedef enum { CB_FFN_NONE = 0, CB_FFN_DENSE, CB_FFN_MOE, CB_FFN_GROUPED } cb_ffn_kind;

typedef struct {
    cb_ffn_kind kind;
    cb_swiglu dense;           /* CB_FFN_DENSE */
    cb_moe moe;                /* CB_FFN_MOE: softmax over all experts, top-k (OLMoE) */
    cb_mlp shared;             /* CB_FFN_MOE with shared_inter: an always-on shared expert, optionally sigmoid-gated */
    cb_grouped_moe grouped;    /* CB_FFN_GROUPED: grouped sigmoid routing + shared experts (DeepSeek-V3 style) */
} cb_ffn;

/* ---- the decoder ---- */

typedef struct cb_decoder {
    /* hyperparameters (CB_DECODER_*_HPARAMS) */
    int hidden, n_layers, vocab, tied;
    float eps;
    int inter;                 /* a dense layer's SwiGLU width */
    cb_grouped_moe_shape moe;  /* routed experts: count, top-k, width and routing */
    const char *ffn_layers;    /* one letter per layer, D dense / M MoE; NULL: every layer routed */
    int sparse_step;           /* CB_DECODER_SPARSE_HPARAMS: every sparse_step-th layer routes (0: not used) */
    const char *mlp_only;      /* ... unless this list of layer indices makes it dense */
    char *sparse_letters;      /* the ffn_layers they make */
    size_t state_floats;       /* the slot's recurrent state per sequence, as cb_decoder_state hands it out */
    int shared_inter;          /* CB_FFN_MOE: the shared expert's width (0: none) */
    int norm_offset;           /* every decoder norm is stored zero-centred: its scale is 1 + w (Qwen3-Next) */
    const char *prefix;        /* the checkpoint's text-model prefix in place of "model." (NULL: model.) */
    /* A decision head in place of the LM head (CB_DECODER_HEAD_HPARAMS): head_rows scores of each normed row,
     * head_weight [head_rows, hidden] plus head_bias, soft-capped when softcap > 0 (softcap * tanh(x / softcap)),
     * written into the first head_rows logits of the row (the rest -inf). The model then only decides. */
    int head_rows;
    const char *head_weight, *head_bias;
    const char *head_file;     /* a file of the model directory holding the head, added to a sharded index */
    float softcap;
    float *head_bias_v;
    int layout;                /* which alternative of every '|'-separated name the checkpoint uses (cb_decoder_name) */
    float expert_limit;        /* > 0: the routed experts' SwiGLU is clamped (cb_moe.swiglu_limit) */
    const int *tokens;         /* the current forward call's tokens (cb_decoder_embed), for token-routed layers */
    /* from the load arguments */
    int max_batch, ctx, cap;
    cb_st_index idx;
    cb_linear embed, lm_head;
    float *final_norm;
    float **attn_norm, **ffn_norm;      /* per layer */
    cb_ffn *ffn;                        /* per layer */
    cb_expert_layer **expert_layers;
    int n_expert_layers;
    size_t dense_bytes, cache_bytes;
    float *x, *h, *proj;                /* max_batch x hidden */
    float *shared_out;                  /* max_batch x hidden, with a shared expert */
    const struct cb_recipe *recipe;
} cb_decoder;

/* The decoder's keys, for a family struct T holding its cb_decoder as field d (eps: the family's default). */
#define CB_DECODER_HPARAMS(T, d, eps_default)                                 \
    CB_HP_REQ("hidden_size", T, d.hidden), CB_HP_REQ("num_hidden_layers", T, d.n_layers), \
    CB_HP_REQ("vocab_size", T, d.vocab), CB_HP_NUM("rms_norm_eps", T, d.eps, eps_default, CB_HP_POSITIVE), \
    CB_HP_FLAG("tie_word_embeddings", T, d.tied, 0)
/* A softmax-routed FFN on every layer (OLMoE names). */
#define CB_DECODER_MOE_HPARAMS(T, d)                                                                        \
    CB_HP_REQ("intermediate_size", T, d.moe.inter), CB_HP_REQ("num_experts", T, d.moe.n_experts),           \
    CB_HP_REQ("num_experts_per_tok", T, d.moe.top_k), CB_HP_FLAG("norm_topk_prob", T, d.moe.norm_topk_prob, 0)
/* A decision head over the decoder (the decoder fields head_rows, head_weight, head_bias, softcap); its row count
 * (the head's num_verbalizers) is required. */
#define CB_DECODER_HEAD_HPARAMS(T, d)                                                                       \
    CB_HP_REQ("decision_head_rows", T, d.head_rows),                                                        \
    CB_HP_TEXT("decision_head_weight", T, d.head_weight, "proj.weight"),                                    \
    CB_HP_TEXT("decision_head_bias", T, d.head_bias, ""),                                                   \
    CB_HP_TEXT("decision_head_file", T, d.head_file, ""),                                                   \
    CB_HP_NUM("logit_softcap", T, d.softcap, 0.0, CB_HP_NONNEG)
/* Which layers route, for a softmax-routed FFN (Qwen MoE names): every decoder_sparse_step-th layer, except the
 * layer indices mlp_only_layers lists (comma-separated). */
#define CB_DECODER_SPARSE_HPARAMS(T, d)                                                                     \
    CB_HP_OPT("decoder_sparse_step", T, d.sparse_step, 1, CB_HP_POSITIVE),                                  \
    CB_HP_TEXT("mlp_only_layers", T, d.mlp_only, "")
/* Dense leading layers and grouped-routed MoE layers (DeepSeek-V3 names; mlp_layers: D or M per layer). */
#define CB_DECODER_GROUPED_HPARAMS(T, d)                                                                    \
    CB_HP_REQ("intermediate_size", T, d.inter), CB_HP_REQ("moe_intermediate_size", T, d.moe.inter),        \
    CB_HP_REQ("n_routed_experts", T, d.moe.n_experts), CB_HP_REQ("num_experts_per_tok", T, d.moe.top_k),   \
    CB_HP_OPT("n_shared_experts", T, d.moe.n_shared, 0, CB_HP_NONNEG),                                      \
    CB_HP_OPT("n_group", T, d.moe.n_group, 1, CB_HP_POSITIVE),                                              \
    CB_HP_OPT("topk_group", T, d.moe.topk_group, 1, CB_HP_POSITIVE),                                        \
    CB_HP_FLAG("norm_topk_prob", T, d.moe.norm_topk_prob, 1),                                               \
    CB_HP_NUM("routed_scaling_factor", T, d.moe.routed_scaling_factor, 1.0, CB_HP_ANY),                     \
    CB_HP_PER_LAYER("mlp_layers", T, d.ffn_layers, "DM", d.n_layers)

/* A runtime block a recipe's model embeds (latent.h's attention, say): its keys, shapes, per-layer tensors, scratch
 * and KV geometry are the block's to load, so the family declares it in its recipe (block, block_at, block_spec)
 * instead of writing load hooks. The decoder runs each hook just before the recipe's hook of the same name; d is
 * the model (its cb_decoder first), so a spec may name the model's own fields by offset. */
typedef struct cb_block_type {
    /* after the recipe's keys (and before its setup): the block's keys, derived shapes, RoPE */
    int (*setup)(void *block, const void *spec, cb_decoder *d, cb_hparams *hp, char *err, size_t errlen);
    /* layer l's part of the block, after the recipe's tensors of the layer */
    int (*load_layer)(void *block, cb_decoder *d, int l, char *err, size_t errlen);
    /* after every layer: scratch, and the KV geometry into info */
    int (*finish)(void *block, cb_decoder *d, cb_model_info *info, char *err, size_t errlen);
    /* everything the block holds (safe on a block that failed half-way) */
    void (*free)(void *block, cb_decoder *d);
} cb_block_type;

/* A family's recipe. The model struct's FIRST member is its cb_decoder (so the decoder's calls take the model),
 * and it holds a pointer to an array of its own layer structs at layers_at. */
typedef struct cb_recipe {
    const cb_hp_spec *hparams; /* the family's keys (with the decoder's), read into the model struct */
    size_t model_size;         /* sizeof the model struct */
    size_t layer_size;         /* sizeof the family's layer struct; the decoder allocates n_layers of them (0: none) */
    size_t layers_at;          /* offset of the model struct's pointer to them */
    const cb_tensor_spec *tensors;   /* every layer's own tensors, loaded after its norms (may be NULL) */
    const cb_scratch_spec *scratch;  /* the mixer's activations (may be NULL) */
    cb_ffn_kind routed;        /* CB_FFN_MOE or CB_FFN_GROUPED for the layers that route (all, or mlp_layers M) */
    const char *moe_prefix;    /* printf format of the layer (NULL: "model.layers.%d.mlp.") */
    /* dense layers: the first prefix (printf of the layer) whose gate_proj exists, else the last (none given:
     * "model.layers.%d.mlp.") */
    const char *dense_prefixes[3];
    /* after the hyperparameters: derived shapes, further tables, RoPE (may be NULL) */
    int (*setup)(void *model, cb_hparams *hp, char *err, size_t errlen);
    /* the rest of layer l's mixer, after its tensors (may be NULL) */
    int (*load_layer)(void *model, int l, char *err, size_t errlen);
    /* after every layer: scratch, and KV geometry / recurrent state into info (vocab, n_layers, bytes and experts
     * are filled already) */
    int (*finish)(void *model, cb_model_info *info, char *err, size_t errlen);
    /* the mixer of layer l: reads d->h (the normed rows), writes d->proj; 0 or -1 with a message */
    int (*mixer)(void *model, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen);
    /* free what the family allocated beyond the tensors table: per layer, then the model's own (may be NULL) */
    void (*free_layer)(void *model, void *layer);
    void (*free_model)(void *model);
    /* The decoder's own names, printf formats of the layer where per layer (NULL: the Llama layout's
     * model.embed_tokens.weight, model.norm.weight, lm_head.weight, model.layers.%d.input_layernorm.weight,
     * model.layers.%d.post_attention_layernorm.weight). */
    const char *embed_name, *norm_name, *lm_head_name, *attn_norm_name, *ffn_norm_name;
    const cb_tensor_spec *model_tensors;   /* tensors of the model as a whole, into the model struct (may be NULL) */
    /* CB_FFN_MOE with shared_inter > 0: the shared expert's prefix and its [1, hidden] sigmoid gate (NULL: none);
     * printf formats of the layer */
    const char *shared_prefix, *shared_gate;
    /* CB_FFN_MOE: the family's router, in place of softmax top-k: fill moe->chosen and moe->weight (n rows x top_k)
     * for the normed rows h of layer l (d->tokens are their tokens); 0 or -1 with a message (may be NULL) */
    int (*route)(void *model, int l, cb_moe *moe, const float *h, int n, char *err, size_t errlen);
    /* the runtime block the model struct holds at block_at, with the family's declaration of it (may be NULL) */
    const cb_block_type *block;
    size_t block_at;
    const void *block_spec;
    /* the routed experts' gate, up and down leaves under experts.<e>. (NULL: gate_proj, up_proj, down_proj) */
    const char *expert_mats[3];
} cb_recipe;

/* The end of a family file whose forward is cb_decoder_forward: its recipe (model struct MT; the other cb_recipe
 * fields as designated initializers), its cb_family under the family's name, and main (the file includes engine.h
 * for cb_engine_main):
 *
 *     CB_DECODER_ENGINE(kimi, "kimi", .hparams = HPARAMS, .routed = CB_FFN_GROUPED, .mixer = attention);
 */
#define CB_DECODER_ENGINE(MT, family_name, ...) CB_DECODER_ENGINE_BATCH(MT, family_name, NULL, __VA_ARGS__)
/* The same, with slots that decode together sharing one forward pass (cb_decoder_forward_batch): only for a recipe
 * whose per-call model state (a selection carried across layers, say) is per sequence. */
#define CB_DECODER_BATCHED_ENGINE(MT, family_name, ...)                                                       \
    CB_DECODER_ENGINE_BATCH(MT, family_name, cb_decoder_forward_batch, __VA_ARGS__)
#define CB_DECODER_ENGINE_BATCH(MT, family_name, batch, ...)                                                  \
    static const cb_recipe MT##_recipe = {.model_size = sizeof(MT), __VA_ARGS__};                             \
    static int MT##_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {  \
        return cb_decoder_load(out, &MT##_recipe, a, info, err, errlen);                                       \
    }                                                                                                         \
    static const cb_family MT##_family = {.name = family_name, .load = MT##_load, .forward = cb_decoder_forward, \
                                          .forward_batch = batch, .free = cb_decoder_unload};                 \
    int main(int argc, char **argv) { return cb_engine_main(argc, argv, &MT##_family); }                     \
    int main(int argc, char **argv)

/* Load a model as the recipe says into *out; on failure everything built is freed and -1 carries the message. */
int cb_decoder_load(void **out, const cb_recipe *r, const cb_load_args *a, cb_model_info *info, char *err,
                    size_t errlen);
/* The whole forward pass of a recipe's model (a cb_family's forward): embed, per layer the norm, the recipe's
 * mixer, the residual and the FFN, then the logits. */
int cb_decoder_forward(void *model, cb_kv *kv, const int *tokens, int n, int pos0, float *logits, int all_logits,
                       char *err, size_t errlen);
/* One decode token of each of n sequences (a cb_family's forward_batch): the rows stacked, per layer the norm over
 * all of them, the recipe's mixer once per sequence on its own row (n = 1, its KV / state and position: the decoder's
 * row buffers x, h, proj and tokens point at that row for the call), then the FFN once over every row, so a routed
 * expert several sequences chose is read once; logits of every row. A recipe whose mixer carries per-call state
 * across layers outside the KV (a DSA selection reused by layers without an indexer) must not use it. */
int cb_decoder_forward_batch(void *model, cb_kv *const *kvs, const int *tokens, const int *pos0, int n,
                             float *logits, char *err, size_t errlen);
/* Free a recipe's model (a cb_family's free). */
void cb_decoder_unload(void *model);

/* x = embedding rows of tokens[0..n); d->tokens = tokens. */
void cb_decoder_embed(cb_decoder *d, const int *tokens, int n);
/* h = rmsnorm(x) with layer l's input_layernorm: the mixer's input. */
void cb_decoder_attn_norm(cb_decoder *d, int l, int n);
/* x += proj: the mixer's output, which it wrote into d->proj. */
void cb_decoder_residual(cb_decoder *d, int n);
/* proj = ffn(h) of layer l, h already normed (a family with its own residual calls this). 0, or -1 with a message. */
int cb_decoder_ffn_block(cb_decoder *d, int l, int n, char *err, size_t errlen);
/* x += ffn(rmsnorm(x)) of layer l. 0, or -1 with a message (an expert read failed). */
int cb_decoder_ffn(cb_decoder *d, int l, int n, char *err, size_t errlen);
/* logits = lm_head(rmsnorm(x)) of every row when all_logits, else of the last (a decision head's scores, with it). */
void cb_decoder_logits(cb_decoder *d, float *logits, int n, int all_logits);

/* Checkpoint layouts. A name (any format the decoder or a table gives) may list alternatives separated by '|', one
 * per layout the recipe reads, in the same order everywhere (e.g. "model.layers.%d.attn_norm.weight|layers.%d.
 * attn_norm.weight"); the layout is the first alternative of the embedding's name that the checkpoint stores, and
 * every name is then taken in that layout (a name with fewer alternatives: its last). A set d->prefix (the family's
 * weight_prefix key, e.g. model.language_model. for a text model inside a multimodal checkpoint) then replaces the
 * leading "model." of the name. */
/* The format fmt in the checkpoint's layout and prefix, into buf (printf arguments untouched). */
const char *cb_decoder_format(const cb_decoder *d, char *buf, size_t size, const char *fmt);
/* cb_decoder_format, then formatted with the layer l. */
const char *cb_decoder_name(const cb_decoder *d, char *buf, size_t size, const char *fmt, int l);
/* Hand out `floats` of the slot's recurrent state per sequence (a DeltaNet / KDA layer's, at load): their offset
 * into cb_kv.state. The decoder reports the total as the model's state_bytes. */
size_t cb_decoder_state(cb_decoder *d, size_t floats);
/* Register an expert store the family loaded itself (CB_FFN_NONE): counted in the stats and the cache bytes. */
void cb_decoder_add_experts(cb_decoder *d, cb_expert_layer *store);

/* An out-of-memory message for what; returns -1. */
int cb_oom(char *err, size_t errlen, const char *what);

#endif
