/* test_kda.c: the Kimi Delta Attention block against a direct double-precision transcription of kda.h's
 * recurrence (per-key-channel decay, sigmoid-gated output norm), over a sequence several times the conv kernel;
 * state carried across calls (prefill in pieces == one prefill == token by token, bit for bit); zeroed state ==
 * fresh sequence; the decay really is per channel; and the geometry checks of init. */
#include <string.h>

#include "deltanet.h"
#include "kda.h"
#include "qwen_blocks_common.h"

enum { NH = 3, D = 8, KERNEL = 4, T = 13 };
#define W (NH * D)

static double silu(double x) { return x / (1.0 + exp(-x)); }
static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }
static double softplus(double x) { return x > 20 ? x : log1p(exp(x)); }

/* out[T][W] by the definition in kda.h, in double, from a zero state. */
static void reference(const cb_kda *d, const float *x, const float *f, const float *b, const float *g,
                      double *out) {
    static double conv[T][3 * W], S[NH][D][D];
    memset(S, 0, sizeof S);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < 3 * W; c++) {
            double acc = 0;
            for (int j = 0; j < KERNEL; j++) {
                int src = t - (KERNEL - 1) + j;
                if (src >= 0) acc += (double)d->conv_w[c * KERNEL + j] * x[src * 3 * W + c];
            }
            conv[t][c] = silu(acc);
        }
    for (int t = 0; t < T; t++)
        for (int h = 0; h < NH; h++) {
            double q[D], k[D], v[D], sq = 0, sk = 0;
            for (int i = 0; i < D; i++) {
                q[i] = conv[t][h * D + i];
                k[i] = conv[t][W + h * D + i];
                v[i] = conv[t][2 * W + h * D + i];
                sq += q[i] * q[i];
                sk += k[i] * k[i];
            }
            for (int i = 0; i < D; i++) {
                q[i] /= sqrt(sq + 1e-6) * sqrt((double)D);
                k[i] /= sqrt(sk + 1e-6);
            }
            double beta = sigm(b[t * NH + h]), mem[D] = {0}, o[D], ss = 0;
            for (int i = 0; i < D; i++) {
                double decay = exp((double)d->neg_A[h] * softplus((double)f[t * W + h * D + i] + d->dt_bias[h * D + i]));
                for (int e = 0; e < D; e++) {
                    S[h][i][e] *= decay;
                    mem[e] += S[h][i][e] * k[i];
                }
            }
            for (int e = 0; e < D; e++) {
                double delta = (v[e] - mem[e]) * beta;
                for (int i = 0; i < D; i++) S[h][i][e] += k[i] * delta;
            }
            for (int e = 0; e < D; e++) {
                o[e] = 0;
                for (int i = 0; i < D; i++) o[e] += S[h][i][e] * q[i];
                ss += o[e] * o[e];
            }
            double inv = 1.0 / sqrt(ss / D + d->c.eps);
            for (int e = 0; e < D; e++)
                out[t * W + h * D + e] = o[e] * inv * d->norm[e] * sigm(g[t * W + h * D + e]);
        }
}

/* Tokens [from, from + n) on `state`; the block overwrites x and f, so it gets copies. */
static void run(const cb_kda *d, float *state, float *out, const float *x0, const float *f0, const float *b,
                const float *g, int from, int n) {
    float *x = malloc((size_t)n * 3 * W * sizeof(float)), *f = malloc((size_t)n * W * sizeof(float));
    memcpy(x, x0 + (size_t)from * 3 * W, (size_t)n * 3 * W * sizeof(float));
    memcpy(f, f0 + (size_t)from * W, (size_t)n * W * sizeof(float));
    cb_kda_forward(d, state, out + (size_t)from * W, x, f, b + from * NH, g + (size_t)from * W, n);
    free(x);
    free(f);
}

int main(void) {
    cb_kda d;
    memset(&d, 0, sizeof d);
    d.c = (cb_kda_config){NH, D, KERNEL, 1e-5f};
    d.width = W;
    d.conv_w = rand_floats(3 * W * KERNEL, 0.8f, 0);
    d.neg_A = rand_floats(NH, 0.5f, 0);
    for (int h = 0; h < NH; h++) d.neg_A[h] = -expf(d.neg_A[h]);
    d.dt_bias = rand_floats(W, 0.5f, 0);
    d.norm = rand_floats(D, 0.2f, 1.0f);
    CHECK(cb_kda_state_floats(&d.c) == (size_t)3 * W * (KERNEL - 1) + NH * D * D, "state size");

    float *x = rand_floats(T * 3 * W, 1.5f, 0), *f = rand_floats(T * W, 3.0f, 0);
    float *b = rand_floats(T * NH, 2.0f, 0), *g = rand_floats(T * W, 2.0f, 0);
    size_t sf = cb_kda_state_floats(&d.c);
    float *s1 = calloc(sf, sizeof(float)), *s2 = calloc(sf, sizeof(float)), *s3 = calloc(sf, sizeof(float));
    float *whole = malloc(T * W * sizeof(float)), *pieces = malloc(T * W * sizeof(float));
    float *single = malloc(T * W * sizeof(float));
    double *ref = malloc(T * W * sizeof(double));

    run(&d, s1, whole, x, f, b, g, 0, T);
    reference(&d, x, f, b, g, ref);
    double err = max_abs_diff(whole, ref, T * W);
    CHECK(err < 1e-5, "block vs double reference: %g", err);

    /* The state carries everything across calls: 5 + 1 + 7 tokens and 13 single tokens equal one call. */
    run(&d, s2, pieces, x, f, b, g, 0, 5);
    run(&d, s2, pieces, x, f, b, g, 5, 1);
    run(&d, s2, pieces, x, f, b, g, 6, T - 6);
    for (int t = 0; t < T; t++) run(&d, s3, single, x, f, b, g, t, 1);
    CHECK(!memcmp(whole, pieces, T * W * sizeof(float)), "chunked prefill differs from one call");
    CHECK(!memcmp(whole, single, T * W * sizeof(float)), "token-by-token differs from one call");
    CHECK(!memcmp(s1, s2, sf * sizeof(float)) && !memcmp(s1, s3, sf * sizeof(float)), "final states differ");

    /* A zeroed state is a fresh sequence; a stale one is not (the state really carries information). */
    memset(s2, 0, sf * sizeof(float));
    run(&d, s2, pieces, x, f, b, g, 0, 4);
    CHECK(!memcmp(whole, pieces, 4 * W * sizeof(float)), "zeroed state is not a fresh sequence");
    run(&d, s1, pieces, x, f, b, g, 0, 4);
    CHECK(memcmp(whole, pieces, 4 * W * sizeof(float)) != 0, "state had no effect");

    /* The decay is per key channel: changing one channel's forget logit at t = 2 moves later outputs of its head
     * only (a per-head decay, as in Gated DeltaNet, would not tell the channels apart; the reference does). */
    float *f2 = malloc(T * W * sizeof(float));
    memcpy(f2, f, T * W * sizeof(float));
    f2[2 * W + D + 3] += 4.0f;                    /* head 1, key channel 3 */
    memset(s2, 0, sf * sizeof(float));
    run(&d, s2, pieces, x, f2, b, g, 0, T);
    double *ref2 = malloc(T * W * sizeof(double));
    reference(&d, x, f2, b, g, ref2);
    CHECK(max_abs_diff(pieces, ref2, T * W) < 1e-5, "per-channel decay vs reference");
    int moved = 0, leaked = 0;
    for (int t = 3; t < T; t++)
        for (int i = 0; i < W; i++) {
            int differs = pieces[t * W + i] != whole[t * W + i];
            if (i / D == 1) moved |= differs;
            else leaked |= differs;
        }
    CHECK(moved && !leaked, "one channel's forget gate moved=%d, leaked into other heads=%d", moved, leaked);

    char err_msg[256];
    cb_kda bad;
    cb_kda_config cfg = {NH, D, CB_DELTANET_MAX_KERNEL + 1, 1e-5f};
    CHECK(cb_kda_init(&bad, NULL, "x.", &cfg, NULL, err_msg, sizeof err_msg) == -1 && strstr(err_msg, "kernel"),
          "huge kernel accepted: %s", err_msg);
    cfg = (cb_kda_config){0, D, KERNEL, 1e-5f};
    CHECK(cb_kda_init(&bad, NULL, "x.", &cfg, NULL, err_msg, sizeof err_msg) == -1, "zero heads accepted");

    cb_kda_free(&d);
    free(x); free(f); free(f2); free(b); free(g); free(s1); free(s2); free(s3);
    free(whole); free(pieces); free(single); free(ref); free(ref2);
    printf("test_kda: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
