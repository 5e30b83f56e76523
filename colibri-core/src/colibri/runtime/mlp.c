/* mlp.c: see mlp.h. */
#include "mlp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cb_mlp_init(cb_mlp *m, const cb_st_index *idx, const char *prefix, const char *scale_name, int hidden, int inter,
                int max_batch, size_t *dense_bytes, char *err, size_t errlen) {
    memset(m, 0, sizeof *m);
    m->hidden = hidden;
    m->inter = inter;
    m->max_batch = max_batch;
    char name[512];
#define NAME(leaf) (snprintf(name, sizeof name, "%s%s", prefix, leaf), name)
    if (cb_load_linear(&m->gate, idx, NAME("gate_proj.weight"), inter, hidden, dense_bytes, err, errlen) ||
        cb_load_linear(&m->up, idx, NAME("up_proj.weight"), inter, hidden, dense_bytes, err, errlen) ||
        cb_load_linear(&m->down, idx, NAME("down_proj.weight"), hidden, inter, dense_bytes, err, errlen) ||
        (scale_name && cb_load_linear(&m->scale, idx, scale_name, 1, hidden, dense_bytes, err, errlen))) {
        cb_mlp_free(m);
        return -1;
    }
#undef NAME
    size_t B = (size_t)max_batch;
    m->g = malloc(B * (size_t)inter * sizeof(float));
    m->u = malloc(B * (size_t)inter * sizeof(float));
    m->s = malloc(B * sizeof(float));
    if (!m->g || !m->u || !m->s) {
        snprintf(err, errlen, "out of memory for the MLP scratch of %s", prefix);
        cb_mlp_free(m);
        return -1;
    }
    return 0;
}

void cb_mlp_free(cb_mlp *m) {
    cb_linear_free(&m->gate);
    cb_linear_free(&m->up);
    cb_linear_free(&m->down);
    cb_linear_free(&m->scale);
    free(m->g);
    free(m->u);
    free(m->s);
    memset(m, 0, sizeof *m);
}

void cb_mlp_forward(cb_mlp *m, float *out, const float *x, int n) {
    cb_linear_apply(&m->gate, m->g, x, n);
    cb_linear_apply(&m->up, m->u, x, n);
    cb_silu_mul(m->g, m->u, n * m->inter);
    cb_linear_apply(&m->down, out, m->g, n);
    if (!m->scale.w) return;
    cb_linear_apply(&m->scale, m->s, x, n);
    for (int i = 0; i < n; i++) {
        float s = 1.0f / (1.0f + expf(-m->s[i]));
        float *o = out + (size_t)i * (size_t)m->hidden;
        for (int c = 0; c < m->hidden; c++) o[c] *= s;
    }
}
