/* deltanet.c: see deltanet.h. */
#include "deltanet.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t cb_deltanet_state_floats(const cb_deltanet_config *c) {
    size_t conv_dim = 2 * (size_t)c->n_k_heads * (size_t)c->k_dim + (size_t)c->n_v_heads * (size_t)c->v_dim;
    return conv_dim * (size_t)(c->kernel - 1) + (size_t)c->n_v_heads * (size_t)c->k_dim * (size_t)c->v_dim;
}

static int load_conv(cb_deltanet *d, const cb_st_index *idx, const char *name, size_t *bytes, char *err,
                     size_t errlen) {
    int64_t dims[3] = {d->conv_dim, 1, d->c.kernel};
    const cb_tensor *t = cb_st_expect(idx, name, 3, dims, err, errlen);
    return t ? cb_load_f32(&d->conv_w, idx, t, (size_t)d->conv_dim * (size_t)d->c.kernel, bytes, err, errlen) : -1;
}

int cb_deltanet_init(cb_deltanet *d, const cb_st_index *idx, const char *prefix, const cb_deltanet_config *c,
                     size_t *dense_bytes, char *err, size_t errlen) {
    memset(d, 0, sizeof *d);
    d->c = *c;
    if (c->n_k_heads < 1 || c->n_v_heads < 1 || c->k_dim < 1 || c->v_dim < 1 || c->n_v_heads % c->n_k_heads ||
        c->kernel < 1 || c->kernel > CB_DELTANET_MAX_KERNEL || c->v_dim > CB_DELTANET_MAX_VDIM || c->eps <= 0) {
        snprintf(err, errlen, "--set linear_* hyperparameters out of range (positive sizes, linear_num_value_heads "
                              "a multiple of linear_num_key_heads, conv kernel 1..%d, value head dim <= %d)",
                 CB_DELTANET_MAX_KERNEL, CB_DELTANET_MAX_VDIM);
        return -1;
    }
    d->conv_dim = 2 * c->n_k_heads * c->k_dim + c->n_v_heads * c->v_dim;
    char name[320];
    float *A_log = NULL;
#define NAME(leaf) (snprintf(name, sizeof name, "%s%s", prefix, leaf), name)
    if (load_conv(d, idx, NAME("conv1d.weight"), dense_bytes, err, errlen) ||
        cb_load_vector(&A_log, idx, NAME("A_log"), c->n_v_heads, dense_bytes, err, errlen) ||
        cb_load_vector(&d->dt_bias, idx, NAME("dt_bias"), c->n_v_heads, dense_bytes, err, errlen) ||
        cb_load_vector(&d->norm, idx, NAME("norm.weight"), c->v_dim, dense_bytes, err, errlen)) {
        free(A_log);
        cb_deltanet_free(d);
        return -1;
    }
#undef NAME
    for (int h = 0; h < c->n_v_heads; h++) A_log[h] = -expf(A_log[h]);
    d->neg_A = A_log;
    return 0;
}

void cb_deltanet_free(cb_deltanet *d) {
    free(d->conv_w);
    free(d->neg_A);
    free(d->dt_bias);
    free(d->norm);
    memset(d, 0, sizeof *d);
}

float cb_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

void cb_l2norm(float *x, int n) {
    double sum = 0;
    for (int i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    float inv = 1.0f / sqrtf((float)sum + 1e-6f);
    for (int i = 0; i < n; i++) x[i] *= inv;
}

/* Channel by channel, sliding each channel's window. */
void cb_short_conv_silu(const float *w, int channels, int kernel, float *window, float *x, int n) {
    int K = kernel, W = K - 1, C = channels;
    for (int c = 0; c < C; c++) {
        float buf[CB_DELTANET_MAX_KERNEL];
        float *win = window + (size_t)c * (size_t)W;
        const float *wc = w + (size_t)c * (size_t)K;
        memcpy(buf, win, (size_t)W * sizeof(float));
        for (int t = 0; t < n; t++) {
            float *xt = x + (size_t)t * (size_t)C + c;
            buf[W] = *xt;
            float acc = 0;
            for (int j = 0; j < K; j++) acc += wc[j] * buf[j];
            memmove(buf, buf + 1, (size_t)W * sizeof(float));
            *xt = acc / (1.0f + expf(-acc));
        }
        memcpy(win, buf, (size_t)W * sizeof(float));
    }
}

void cb_delta_rule_step(float *S, int dk, int dv, const float *decay, int decay_stride, const float *k,
                        const float *v, float beta, const float *q, float *o) {
    /* Dot products accumulate in double: the state carries rounding from every past token, and the
     * tiny-model oracle tests showed f32 accumulation alone costing ~1e-4 on logits. */
    double acc[CB_DELTANET_MAX_VDIM];
    for (int e = 0; e < dv; e++) acc[e] = 0.0;
    for (int i = 0; i < dk; i++) {
        float *Si = S + (size_t)i * (size_t)dv, di = decay[(size_t)i * (size_t)decay_stride];
        for (int e = 0; e < dv; e++) {
            Si[e] *= di;
            acc[e] += (double)Si[e] * (double)k[i];
        }
    }
    for (int e = 0; e < dv; e++) o[e] = (v[e] - (float)acc[e]) * beta;
    for (int i = 0; i < dk; i++) {
        float *Si = S + (size_t)i * (size_t)dv;
        for (int e = 0; e < dv; e++) Si[e] += k[i] * o[e];
    }
    for (int e = 0; e < dv; e++) acc[e] = 0.0;
    for (int i = 0; i < dk; i++) {
        const float *Si = S + (size_t)i * (size_t)dv;
        for (int e = 0; e < dv; e++) acc[e] += (double)Si[e] * (double)q[i];
    }
    for (int e = 0; e < dv; e++) o[e] = (float)acc[e];
}

typedef struct {
    const cb_deltanet *d;
    float *memory, *out;
    const float *x, *z, *b, *a;
    int n;
} head_job;

/* One value head over all n tokens: heads never interact, so the thread split cannot change a bit. */
static void run_head(void *ctx, int h) {
    const head_job *j = ctx;
    const cb_deltanet *d = j->d;
    const cb_deltanet_config *c = &d->c;
    int dk = c->k_dim, dv = c->v_dim, kh = h / (c->n_v_heads / c->n_k_heads), C = d->conv_dim;
    int key_width = c->n_k_heads * dk, value_width = c->n_v_heads * dv;
    float *S = j->memory + (size_t)h * (size_t)dk * (size_t)dv;
    for (int t = 0; t < j->n; t++) {
        const float *row = j->x + (size_t)t * (size_t)C;
        const float *q = row + (size_t)kh * (size_t)dk;
        const float *k = row + (size_t)key_width + (size_t)kh * (size_t)dk;
        const float *v = row + 2 * (size_t)key_width + (size_t)h * (size_t)dv;
        float *o = j->out + (size_t)t * (size_t)value_width + (size_t)h * (size_t)dv;
        float beta = sigmoid(j->b[(size_t)t * (size_t)c->n_v_heads + h]);
        float decay = expf(d->neg_A[h] * cb_softplus(j->a[(size_t)t * (size_t)c->n_v_heads + h] + d->dt_bias[h]));
        cb_delta_rule_step(S, dk, dv, &decay, 0, k, v, beta, q, o);
        cb_rmsnorm(o, o, d->norm, dv, c->eps);
        const float *zt = j->z + (size_t)t * (size_t)value_width + (size_t)h * (size_t)dv;
        for (int e = 0; e < dv; e++) o[e] *= zt[e] * sigmoid(zt[e]);
    }
}

void cb_deltanet_forward(const cb_deltanet *d, float *state, float *out, float *x, const float *z, const float *b,
                         const float *a, int n) {
    const cb_deltanet_config *c = &d->c;
    float *window = state, *memory = state + (size_t)d->conv_dim * (size_t)(c->kernel - 1);
    cb_short_conv_silu(d->conv_w, d->conv_dim, c->kernel, window, x, n);
    float scale = 1.0f / sqrtf((float)c->k_dim);
    for (int t = 0; t < n; t++) {
        float *row = x + (size_t)t * (size_t)d->conv_dim;
        for (int h = 0; h < 2 * c->n_k_heads; h++) cb_l2norm(row + (size_t)h * (size_t)c->k_dim, c->k_dim);
        for (int i = 0; i < c->n_k_heads * c->k_dim; i++) row[i] *= scale;
    }
    head_job job = {d, memory, out, x, z, b, a, n};
    cb_parallel_for(c->n_v_heads, run_head, &job);
}
