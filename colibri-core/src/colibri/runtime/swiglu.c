/* swiglu.c: see swiglu.h. */
#include "swiglu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cb_swiglu_init(cb_swiglu *m, const cb_st_index *idx, const char *prefix, int hidden, int inter, int max_batch,
                   size_t *bytes, char *err, size_t errlen) {
    memset(m, 0, sizeof *m);
    m->hidden = hidden;
    m->inter = inter;
    m->max_batch = max_batch;
    char name[512];
    snprintf(name, sizeof name, "%sgate_proj.weight", prefix);
    if (cb_load_linear(&m->gate, idx, name, inter, hidden, bytes, err, errlen)) goto fail;
    snprintf(name, sizeof name, "%sup_proj.weight", prefix);
    if (cb_load_linear(&m->up, idx, name, inter, hidden, bytes, err, errlen)) goto fail;
    snprintf(name, sizeof name, "%sdown_proj.weight", prefix);
    if (cb_load_linear(&m->down, idx, name, hidden, inter, bytes, err, errlen)) goto fail;
    m->g = malloc((size_t)max_batch * (size_t)inter * sizeof(float));
    m->u = malloc((size_t)max_batch * (size_t)inter * sizeof(float));
    if (!m->g || !m->u) {
        snprintf(err, errlen, "out of memory for the MLP scratch of %s", prefix);
        goto fail;
    }
    return 0;
fail:
    cb_swiglu_free(m);
    return -1;
}

void cb_swiglu_free(cb_swiglu *m) {
    cb_linear_free(&m->gate);
    cb_linear_free(&m->up);
    cb_linear_free(&m->down);
    free(m->g);
    free(m->u);
    memset(m, 0, sizeof *m);
}

void cb_swiglu_forward(cb_swiglu *m, float *out, const float *x, int n) {
    cb_linear_apply(&m->gate, m->g, x, n);
    cb_linear_apply(&m->up, m->u, x, n);
    cb_silu_mul(m->g, m->u, n * m->inter);
    cb_linear_apply(&m->down, out, m->g, n);
}
