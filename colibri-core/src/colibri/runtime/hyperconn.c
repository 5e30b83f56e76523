/* hyperconn.c: see hyperconn.h. */
#include "hyperconn.h"

#include <math.h>
#include <string.h>

#include "kernels.h"

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

int cb_hc_scratch_floats(const cb_hc_shape *s) { return s->hc * s->hidden + (2 + s->hc) * s->hc; }

/* mix = fn (rmsnorm(X)) for `rows` rows of fn. */
static float *mix_of(const cb_hc_shape *s, const float *fn, int rows, const float *X, float *scratch) {
    int flat = s->hc * s->hidden;
    float *normed = scratch, *mix = scratch + flat;
    cb_rmsnorm(normed, X, NULL, flat, s->norm_eps);
    cb_matvec(mix, fn, CB_F32, normed, rows, flat);
    return mix;
}

void cb_hc_weights(const cb_hc_shape *s, const float *fn, const float *base, const float *scale, const float *X,
                   float *pre, float *post, float *comb, float *scratch) {
    int hc = s->hc;
    const float *mix = mix_of(s, fn, (2 + hc) * hc, X, scratch);
    for (int j = 0; j < hc; j++) {
        pre[j] = sigmoidf(mix[j] * scale[0] + base[j]) + s->hc_eps;
        post[j] = 2.0f * sigmoidf(mix[hc + j] * scale[1] + base[hc + j]);
    }
    for (int j = 0; j < hc; j++) {   /* row j: softmax over k */
        float *row = comb + (size_t)j * hc;
        for (int k = 0; k < hc; k++) row[k] = mix[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k];
        cb_softmax(row, hc);
        for (int k = 0; k < hc; k++) row[k] += s->hc_eps;
    }
    /* Sinkhorn-Knopp: columns first, then (rows, columns) iters - 1 more times, as transformers does. */
    for (int it = 0; it < s->sinkhorn_iters; it++) {
        if (it > 0)
            for (int j = 0; j < hc; j++) {
                float sum = 0;
                for (int k = 0; k < hc; k++) sum += comb[j * hc + k];
                for (int k = 0; k < hc; k++) comb[j * hc + k] /= sum + s->hc_eps;
            }
        for (int k = 0; k < hc; k++) {
            float sum = 0;
            for (int j = 0; j < hc; j++) sum += comb[j * hc + k];
            for (int j = 0; j < hc; j++) comb[j * hc + k] /= sum + s->hc_eps;
        }
    }
}

void cb_hc_head_weights(const cb_hc_shape *s, const float *fn, const float *base, const float *scale,
                        const float *X, float *pre, float *scratch) {
    const float *mix = mix_of(s, fn, s->hc, X, scratch);
    for (int j = 0; j < s->hc; j++) pre[j] = sigmoidf(mix[j] * scale[0] + base[j]) + s->hc_eps;
}

void cb_hc_collapse(float *out, const float *X, const float *pre, int hc, int hidden) {
    for (int d = 0; d < hidden; d++) {
        float acc = 0;
        for (int j = 0; j < hc; j++) acc += pre[j] * X[(size_t)j * hidden + d];
        out[d] = acc;
    }
}

void cb_hc_expand(float *X, const float *y, const float *post, const float *comb, int hc, int hidden, float *tmp) {
    memcpy(tmp, X, (size_t)hc * (size_t)hidden * sizeof(float));
    for (int k = 0; k < hc; k++)
        for (int d = 0; d < hidden; d++) {
            float acc = 0;
            for (int j = 0; j < hc; j++) acc += comb[j * hc + k] * tmp[(size_t)j * hidden + d];
            X[(size_t)k * hidden + d] = post[k] * y[d] + acc;
        }
}
