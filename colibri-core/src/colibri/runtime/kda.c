/* kda.c: see kda.h. The conv, l2norm, softplus and delta-rule step are deltanet.c's. */
#include "kda.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "deltanet.h"

size_t cb_kda_state_floats(const cb_kda_config *c) {
    size_t width = (size_t)c->n_heads * (size_t)c->head_dim;
    return 3 * width * (size_t)(c->kernel - 1) + width * (size_t)c->head_dim;
}

/* Load a tensor of exactly `n` floats whatever its shape, as long as only one dimension is not 1 (A_log is saved
 * [1, 1, n_heads, 1] by Kimi's code and transformers, [n_heads] by others). */
static int load_flat(float **out, const cb_st_index *idx, const char *name, int n, size_t *bytes, char *err,
                     size_t errlen) {
    const cb_tensor *t = cb_st_find(idx, name);
    if (!t) {
        snprintf(err, errlen, "tensor %s is missing from the checkpoint", name);
        return -1;
    }
    int64_t count = 1, big = 0;
    for (int i = 0; i < t->ndim; i++) {
        count *= t->shape[i];
        big += t->shape[i] != 1;
    }
    if (!t->supported || count != n || big > 1) {
        snprintf(err, errlen, "tensor %s: expected %d values in one dimension (dtype %s)", name, n, t->dtype_name);
        return -1;
    }
    return cb_load_f32(out, idx, t, (size_t)n, bytes, err, errlen);
}

static int load_convs(cb_kda *d, const cb_st_index *idx, const char *prefix, size_t *bytes, char *err,
                      size_t errlen) {
    size_t per = (size_t)d->width * (size_t)d->c.kernel;
    d->conv_w = malloc(3 * per * sizeof(float));
    if (!d->conv_w) {
        snprintf(err, errlen, "out of memory loading the convolutions of %s", prefix);
        return -1;
    }
    static const char *const which[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; i++) {
        char name[320];
        snprintf(name, sizeof name, "%s%s_conv1d.weight", prefix, which[i]);
        int64_t dims[3] = {d->width, 1, d->c.kernel};
        const cb_tensor *t = cb_st_expect(idx, name, 3, dims, err, errlen);
        if (!t || cb_read_f32(d->conv_w + (size_t)i * per, idx, t, per, err, errlen)) return -1;
    }
    if (bytes) *bytes += 3 * per * sizeof(float);
    return 0;
}

int cb_kda_init(cb_kda *d, const cb_st_index *idx, const char *prefix, const cb_kda_config *c, size_t *dense_bytes,
                char *err, size_t errlen) {
    memset(d, 0, sizeof *d);
    d->c = *c;
    if (c->n_heads < 1 || c->head_dim < 1 || c->head_dim > CB_DELTANET_MAX_VDIM || c->kernel < 1 ||
        c->kernel > CB_DELTANET_MAX_KERNEL || c->eps <= 0) {
        snprintf(err, errlen, "--set linear_* hyperparameters out of range (positive head count, head dim 1..%d, "
                              "conv kernel 1..%d)", CB_DELTANET_MAX_VDIM, CB_DELTANET_MAX_KERNEL);
        return -1;
    }
    d->width = c->n_heads * c->head_dim;
    char name[320];
#define NAME(leaf) (snprintf(name, sizeof name, "%s%s", prefix, leaf), name)
    if (load_convs(d, idx, prefix, dense_bytes, err, errlen) ||
        load_flat(&d->neg_A, idx, NAME("A_log"), c->n_heads, dense_bytes, err, errlen) ||
        cb_load_vector(&d->dt_bias, idx, NAME("dt_bias"), d->width, dense_bytes, err, errlen) ||
        cb_load_vector(&d->norm, idx, NAME("o_norm.weight"), c->head_dim, dense_bytes, err, errlen)) {
        cb_kda_free(d);
        return -1;
    }
#undef NAME
    for (int h = 0; h < c->n_heads; h++) d->neg_A[h] = -expf(d->neg_A[h]);
    return 0;
}

void cb_kda_free(cb_kda *d) {
    free(d->conv_w);
    free(d->neg_A);
    free(d->dt_bias);
    free(d->norm);
    memset(d, 0, sizeof *d);
}

typedef struct {
    const cb_kda *d;
    float *memory, *out, *f;
    const float *x, *b, *g;
    int n;
} head_job;

/* One head over all n tokens: heads never interact, so the thread split cannot change a bit. */
static void run_head(void *ctx, int h) {
    const head_job *j = ctx;
    const cb_kda *d = j->d;
    int D = d->c.head_dim, W = d->width, H = d->c.n_heads;
    float *S = j->memory + (size_t)h * (size_t)D * (size_t)D;
    for (int t = 0; t < j->n; t++) {
        const float *row = j->x + (size_t)t * 3 * (size_t)W + (size_t)h * (size_t)D;
        float *decay = j->f + (size_t)t * (size_t)W + (size_t)h * (size_t)D;
        const float *bias = d->dt_bias + (size_t)h * (size_t)D;
        for (int i = 0; i < D; i++) decay[i] = expf(d->neg_A[h] * cb_softplus(decay[i] + bias[i]));
        float beta = 1.0f / (1.0f + expf(-j->b[(size_t)t * (size_t)H + h]));
        float *o = j->out + (size_t)t * (size_t)W + (size_t)h * (size_t)D;
        cb_delta_rule_step(S, D, D, decay, 1, row + W, row + 2 * (size_t)W, beta, row, o);
        cb_rmsnorm(o, o, d->norm, D, d->c.eps);
        const float *gate = j->g + (size_t)t * (size_t)W + (size_t)h * (size_t)D;
        for (int e = 0; e < D; e++) o[e] *= 1.0f / (1.0f + expf(-gate[e]));
    }
}

void cb_kda_forward(const cb_kda *d, float *state, float *out, float *x, float *f, const float *b, const float *g,
                    int n) {
    const cb_kda_config *c = &d->c;
    int W = d->width;
    float *window = state, *memory = state + 3 * (size_t)W * (size_t)(c->kernel - 1);
    cb_short_conv_silu(d->conv_w, 3 * W, c->kernel, window, x, n);
    float scale = 1.0f / sqrtf((float)c->head_dim);
    for (int t = 0; t < n; t++) {
        float *row = x + (size_t)t * 3 * (size_t)W;
        for (int h = 0; h < 2 * c->n_heads; h++) cb_l2norm(row + (size_t)h * (size_t)c->head_dim, c->head_dim);
        for (int i = 0; i < W; i++) row[i] *= scale;
    }
    head_job job = {d, memory, out, f, x, b, g, n};
    cb_parallel_for(c->n_heads, run_head, &job);
}
