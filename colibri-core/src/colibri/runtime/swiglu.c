/* swiglu.c: see swiglu.h. */
#include "swiglu.h"

int cb_swiglu_init(cb_swiglu *m, const cb_st_index *idx, const char *prefix, int hidden, int inter, int max_batch,
                   size_t *bytes, char *err, size_t errlen) {
    return cb_mlp_init(m, idx, prefix, NULL, hidden, inter, max_batch, bytes, err, errlen);
}

void cb_swiglu_free(cb_swiglu *m) { cb_mlp_free(m); }

void cb_swiglu_forward(cb_swiglu *m, float *out, const float *x, int n) { cb_mlp_forward(m, out, x, n); }
