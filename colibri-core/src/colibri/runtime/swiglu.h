/* swiglu.h: the dense gated MLP  down(silu(gate x) * up x)  (dense layers, shared experts).
 *
 * It is mlp.h's block without the sigmoid row gate, one implementation under the name its call sites use. */
#ifndef COLIBRI_SWIGLU_H
#define COLIBRI_SWIGLU_H

#include <stddef.h>

#include "mlp.h"

typedef cb_mlp cb_swiglu;

/* Load <prefix>gate_proj.weight, up_proj.weight, down_proj.weight (prefix e.g. "model.layers.0.mlp."). */
int cb_swiglu_init(cb_swiglu *m, const cb_st_index *idx, const char *prefix, int hidden, int inter, int max_batch,
                   size_t *bytes, char *err, size_t errlen);
void cb_swiglu_free(cb_swiglu *m);
/* out[i] = down(silu(gate x[i]) * up x[i]) for n <= max_batch rows; out must not alias x. */
void cb_swiglu_forward(cb_swiglu *m, float *out, const float *x, int n);

#endif
