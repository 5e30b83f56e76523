/* hybrid.h: the token mixer of the Qwen-style hybrid decoders (Qwen3-Next, Qwen3.5, and the models built on them),
 * a runtime block (cb_hybrid) for recipes over decoder.h. Per layer it is
 *
 *   F  gated GQA attention (gqa.h) on the slot's KV: optional qkv biases, per-head q/k norm, output gate
 *   L  Gated DeltaNet (deltanet.h) on the slot's recurrent state, its inputs projected by in_proj_qkv / z / b / a
 *      ("split", qwen3_5) or, with linear_projection=fused (qwen3_next), by the family's own fused projections,
 *      which it regroups into lx / lz / lb / la before cb_hybrid_deltanet
 *
 * chosen by layer_types (default: every layer full attention, so the non-hybrid Qwen MoEs run on it too). A family
 * holds a cb_hybrid after its cb_decoder, declares it with CB_HYBRID_RECIPE, and its mixer calls cb_hybrid_forward.
 * The block reads its own --set keys (attention shape and biases, layer_types, linear_projection, the linear_*
 * geometry), builds RoPE, loads every layer's mixer, and reports the KV geometry and the recurrent state.
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
    cb_linear in_qkv, in_z, in_b, in_a;   /* split layout */
    cb_linear out_proj;
    size_t state_off;          /* floats into the slot state */
} cb_hybrid_layer;

/* What a family's hybrid may be. */
typedef struct {
    int fused;                 /* the family runs linear_projection=fused itself (its tensors, its regrouping) */
} cb_hybrid_spec;

typedef struct {
    const cb_hybrid_spec *spec;
    int hidden, n_layers, n_full;
    const char *layer_types;   /* --set string */
    char *mixers;              /* per layer: F full attention / L DeltaNet */
    int split, fused;          /* the DeltaNet projections' layout */
    cb_gqa_config attn_cfg;
    cb_deltanet_config dn_cfg;
    int kd, vd, nv, conv_w, qkvz_w, ba_w;   /* DeltaNet widths (0 without linear layers); qkvz_w, ba_w fused */
    cb_hybrid_layer *layers;
    cb_rope rope;
    cb_gqa_scratch attn_scratch;
    float *lx, *lz, *lb, *la, *lo;          /* the DeltaNet's inputs and output for max_batch rows */
} cb_hybrid;

extern const cb_block_type cb_hybrid_block;

/* A recipe's fields for a cb_hybrid at field f of the model struct MT, declared by the cb_hybrid_spec spec. */
#define CB_HYBRID_RECIPE(MT, f, spec) .block = &cb_hybrid_block, .block_at = offsetof(MT, f), .block_spec = &(spec)

/* Layer l's mixer: reads d->h, writes d->proj (decoder.h runs the norms, residuals, FFN and logits around it). */
void cb_hybrid_forward(cb_hybrid *h, cb_decoder *d, int l, cb_kv *kv, int n, int pos0);
/* A linear layer's DeltaNet on h->lx (conv input [q | k | v]), lz, lb, la, then out_proj into d->proj. */
void cb_hybrid_deltanet(cb_hybrid *h, cb_decoder *d, int l, cb_kv *kv, int n);

#endif
