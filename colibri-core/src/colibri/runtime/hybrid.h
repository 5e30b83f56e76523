/* hybrid.h: the token mixer of the Qwen-style hybrid decoders (Qwen3-Next, Qwen3.5, and the models built on them),
 * for recipes over decoder.h. Per layer it is
 *
 *   F  gated GQA attention (gqa.h) on the slot's KV: optional qkv biases, per-head q/k norm, output gate
 *   L  Gated DeltaNet (deltanet.h) on the slot's recurrent state, with its input and output projections in one of
 *      two layouts: qwen3_next fuses q/k/v/z and b/a per key-head group ("fused"), qwen3_5 splits them ("split")
 *
 * chosen by layer_types (default: every layer full attention, so the non-hybrid Qwen MoEs run on it too). A family
 * puts a cb_hybrid first in its model struct (its own cb_decoder first inside it), gives its recipe the tables and
 * hooks below, and calls cb_hybrid_setup from its setup. The hybrid's own --set keys (attention shape and biases,
 * layer_types, zero_centered_norm, weight_prefix, the linear_* geometry) are read there.
 */
#ifndef COLIBRI_HYBRID_H
#define COLIBRI_HYBRID_H

#include <stddef.h>

#include "decoder.h"
#include "deltanet.h"
#include "gqa.h"

typedef struct {
    cb_gqa attn;               /* full layers */
    int kv_layer;
    cb_deltanet dn;            /* linear layers */
    cb_linear in_qkvz, in_ba;  /* fused layout */
    cb_linear in_qkv, in_z, in_b, in_a;   /* split layout */
    cb_linear out_proj;
    size_t state_off;          /* floats into the slot state */
} cb_hybrid_layer;

typedef struct {
    cb_decoder d;              /* first: the decoder's calls take the model */
    int n_full;
    const char *layer_types;   /* --set string */
    char *mixers;              /* per layer: F full attention / L DeltaNet */
    int split, fused;          /* the DeltaNet projections' layout */
    cb_gqa_config attn_cfg;
    cb_deltanet_config dn_cfg;
    int kd, vd, nv, conv_w, qkvz_w, ba_w;   /* DeltaNet widths (0 without linear layers) */
    size_t state;
    cb_hybrid_layer *layers;
    cb_rope rope;
    cb_gqa_scratch attn_scratch;
    float *lx, *lz, *lb, *la, *lo, *qkvz, *ba;
} cb_hybrid;

/* The recipe's per-layer tensors (the DeltaNet projections) and scratch: a model struct starting with a cb_hybrid. */
extern const cb_tensor_spec cb_hybrid_tensors[];
extern const cb_scratch_spec cb_hybrid_scratch[];

/* Read the hybrid's --set keys, the layer kinds, the widths and RoPE (after the decoder's keys). 0 or -1. */
int cb_hybrid_setup(cb_hybrid *h, cb_hparams *hp, char *err, size_t errlen);

/* The recipe's hooks (load_layer, finish, mixer, free_layer); a family's free_model calls cb_hybrid_free. */
int cb_hybrid_load_layer(void *model, int l, char *err, size_t errlen);
int cb_hybrid_finish(void *model, cb_model_info *info, char *err, size_t errlen);
int cb_hybrid_mixer(void *model, int l, cb_kv *kv, int n, int pos0, char *err, size_t errlen);
void cb_hybrid_free_layer(void *model, void *layer);
void cb_hybrid_free(cb_hybrid *h);

/* The recipe fields every hybrid shares: spell a family's recipe as {CB_HYBRID_RECIPE, .hparams = ..., ...}. */
#define CB_HYBRID_RECIPE                                                                                         \
    .layer_size = sizeof(cb_hybrid_layer), .layers_at = offsetof(cb_hybrid, layers), .tensors = cb_hybrid_tensors, \
    .scratch = cb_hybrid_scratch, .load_layer = cb_hybrid_load_layer, .finish = cb_hybrid_finish,                  \
    .mixer = cb_hybrid_mixer, .free_layer = cb_hybrid_free_layer

#endif
