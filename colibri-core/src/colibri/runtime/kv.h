/* kv.h: the KV cache of one slot, as the process allocates it (engine.c) and the attention blocks read and write
 * it: f32, [layer][position][kv_dim] for K and for V, plus the slot's recurrent state.
 */
#ifndef COLIBRI_KV_H
#define COLIBRI_KV_H

#include <stddef.h>

typedef struct {
    int n_layers, ctx, kv_dim;
    float *k, *v;
    float *state;              /* the slot's recurrent state (cb_model_info.state_bytes), NULL when none */
} cb_kv;

static inline float *cb_kv_k(const cb_kv *kv, int layer, int pos) {
    return kv->k + ((size_t)layer * (size_t)kv->ctx + (size_t)pos) * (size_t)kv->kv_dim;
}
static inline float *cb_kv_v(const cb_kv *kv, int layer, int pos) {
    return kv->v + ((size_t)layer * (size_t)kv->ctx + (size_t)pos) * (size_t)kv->kv_dim;
}

#endif
