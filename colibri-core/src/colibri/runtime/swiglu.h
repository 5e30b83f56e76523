/* swiglu.h: the dense gated MLP  down(silu(gate x) * up x)  (dense layers, shared experts). */
#ifndef COLIBRI_SWIGLU_H
#define COLIBRI_SWIGLU_H

#include <stddef.h>

#include "blocks.h"

typedef struct {
    int hidden, inter, max_batch;
    cb_linear gate, up, down;
    float *g, *u;              /* scratch: max_batch x inter each */
} cb_swiglu;

/* Load <prefix>gate_proj.weight, up_proj.weight, down_proj.weight (prefix e.g. "model.layers.0.mlp."). */
int cb_swiglu_init(cb_swiglu *m, const cb_st_index *idx, const char *prefix, int hidden, int inter, int max_batch,
                   size_t *bytes, char *err, size_t errlen);
void cb_swiglu_free(cb_swiglu *m);
/* out[i] = down(silu(gate x[i]) * up x[i]) for n <= max_batch rows; out must not alias x. */
void cb_swiglu_forward(cb_swiglu *m, float *out, const float *x, int n);

#endif
