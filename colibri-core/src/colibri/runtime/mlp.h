/* mlp.h: the dense SwiGLU feed-forward block, down(silu(gate x) * up x), optionally scaled per row by a learned
 * sigmoid gate, sigmoid(w . x) (Qwen's shared expert and its `shared_expert_gate`).
 *
 * Used for dense layers between MoE layers and for always-on shared experts. Like every block, it gives each of
 * n rows exactly the bits that row would get alone.
 */
#ifndef COLIBRI_MLP_H
#define COLIBRI_MLP_H

#include <stddef.h>

#include "blocks.h"

typedef struct {
    int hidden, inter, max_batch;
    cb_linear gate, up, down;
    cb_linear scale;           /* [1, hidden] sigmoid gate, or rows == 0 when the block has none */
    float *g, *u, *s;          /* scratch: max_batch x inter, max_batch x inter, max_batch */
} cb_mlp;

/* Load "<prefix>gate_proj.weight", "<prefix>up_proj.weight" and "<prefix>down_proj.weight"; with a non-NULL
 * scale_name also that [1, hidden] gate vector. */
int cb_mlp_init(cb_mlp *m, const cb_st_index *idx, const char *prefix, const char *scale_name, int hidden, int inter,
                int max_batch, size_t *dense_bytes, char *err, size_t errlen);
void cb_mlp_free(cb_mlp *m);
/* out[i] = (scale ? sigmoid(scale . x[i]) : 1) * down(silu(gate x[i]) * up x[i]) for n rows. */
void cb_mlp_forward(cb_mlp *m, float *out, const float *x, int n);

#endif
