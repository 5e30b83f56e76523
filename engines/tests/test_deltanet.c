/* test_deltanet.c: the Gated DeltaNet block against a direct double-precision transcription of the recurrence,
 * with value heads sharing key heads (GQA), a sequence several times the conv kernel, state carried across calls
 * (prefill in pieces == one prefill == token by token, bit for bit), zeroed state == fresh sequence, and the
 * geometry checks of init. */
#include <string.h>

#include "deltanet.h"
#include "qwen_blocks_common.h"

enum { NK = 2, NV = 4, DK = 8, DV = 6, KERNEL = 4, T = 13 };
#define CONV_DIM (2 * NK * DK + NV * DV)

static double silu(double x) { return x / (1.0 + exp(-x)); }
static double softplus(double x) { return x > 20 ? x : log1p(exp(x)); }

/* out[T][NV*DV] by the definition in deltanet.h, in double, from a zero state. */
static void reference(const cb_deltanet *d, const float *x, const float *z, const float *b, const float *a,
                      double *out) {
    static double conv[T][CONV_DIM], S[NV][DK][DV];
    memset(S, 0, sizeof S);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < CONV_DIM; c++) {
            double acc = 0;
            for (int j = 0; j < KERNEL; j++) {
                int src = t - (KERNEL - 1) + j;
                if (src >= 0) acc += (double)d->conv_w[c * KERNEL + j] * x[src * CONV_DIM + c];
            }
            conv[t][c] = silu(acc);
        }
    for (int t = 0; t < T; t++) {
        double q[NK][DK], k[NK][DK];
        for (int h = 0; h < NK; h++) {
            double sq = 0, sk = 0;
            for (int i = 0; i < DK; i++) {
                q[h][i] = conv[t][h * DK + i];
                k[h][i] = conv[t][NK * DK + h * DK + i];
                sq += q[h][i] * q[h][i];
                sk += k[h][i] * k[h][i];
            }
            for (int i = 0; i < DK; i++) {
                q[h][i] /= sqrt(sq + 1e-6) * sqrt((double)DK);
                k[h][i] /= sqrt(sk + 1e-6);
            }
        }
        for (int h = 0; h < NV; h++) {
            int kh = h / (NV / NK);
            double beta = 1.0 / (1.0 + exp(-(double)b[t * NV + h]));
            double decay = exp((double)d->neg_A[h] * softplus((double)a[t * NV + h] + d->dt_bias[h]));
            double o[DV], mem[DV] = {0}, ss = 0;
            for (int i = 0; i < DK; i++)
                for (int e = 0; e < DV; e++) {
                    S[h][i][e] *= decay;
                    mem[e] += S[h][i][e] * k[kh][i];
                }
            for (int e = 0; e < DV; e++) {
                double delta = ((double)conv[t][2 * NK * DK + h * DV + e] - mem[e]) * beta;
                for (int i = 0; i < DK; i++) S[h][i][e] += k[kh][i] * delta;
            }
            for (int e = 0; e < DV; e++) {
                o[e] = 0;
                for (int i = 0; i < DK; i++) o[e] += S[h][i][e] * q[kh][i];
                ss += o[e] * o[e];
            }
            double inv = 1.0 / sqrt(ss / DV + d->c.eps);
            for (int e = 0; e < DV; e++) {
                double g = z[t * NV * DV + h * DV + e];
                out[t * NV * DV + h * DV + e] = o[e] * inv * d->norm[e] * silu(g);
            }
        }
    }
}

static void run(const cb_deltanet *d, float *state, float *out, const float *x0, const float *z, const float *b,
                const float *a, int from, int n) {
    float *x = malloc((size_t)n * CONV_DIM * sizeof(float));
    memcpy(x, x0 + (size_t)from * CONV_DIM, (size_t)n * CONV_DIM * sizeof(float));
    cb_deltanet_forward(d, state, out + (size_t)from * NV * DV, x, z + (size_t)from * NV * DV, b + from * NV,
                        a + from * NV, n);
    free(x);
}

int main(void) {
    cb_deltanet d;
    memset(&d, 0, sizeof d);
    d.c = (cb_deltanet_config){NK, NV, DK, DV, KERNEL, 1e-6f};
    d.conv_dim = CONV_DIM;
    d.conv_w = rand_floats(CONV_DIM * KERNEL, 0.8f, 0);
    d.neg_A = rand_floats(NV, 0.5f, 0);
    for (int h = 0; h < NV; h++) d.neg_A[h] = -expf(d.neg_A[h]);
    d.dt_bias = rand_floats(NV, 0.3f, 0);
    d.norm = rand_floats(DV, 0.2f, 1.0f);
    CHECK(cb_deltanet_state_floats(&d.c) == (size_t)CONV_DIM * (KERNEL - 1) + NV * DK * DV, "state size");

    float *x = rand_floats(T * CONV_DIM, 1.5f, 0), *z = rand_floats(T * NV * DV, 2.0f, 0);
    float *b = rand_floats(T * NV, 2.0f, 0), *a = rand_floats(T * NV, 2.0f, 0);
    size_t sf = cb_deltanet_state_floats(&d.c);
    float *s1 = calloc(sf, sizeof(float)), *s2 = calloc(sf, sizeof(float)), *s3 = calloc(sf, sizeof(float));
    float *whole = malloc(T * NV * DV * sizeof(float)), *pieces = malloc(T * NV * DV * sizeof(float));
    float *single = malloc(T * NV * DV * sizeof(float));
    double *ref = malloc(T * NV * DV * sizeof(double));

    run(&d, s1, whole, x, z, b, a, 0, T);
    reference(&d, x, z, b, a, ref);
    double err = max_abs_diff(whole, ref, T * NV * DV);
    CHECK(err < 1e-5, "block vs double reference: %g", err);

    /* The state carries everything across calls: 5 + 1 + 7 tokens and 13 single tokens equal one call. */
    run(&d, s2, pieces, x, z, b, a, 0, 5);
    run(&d, s2, pieces, x, z, b, a, 5, 1);
    run(&d, s2, pieces, x, z, b, a, 6, T - 6);
    for (int t = 0; t < T; t++) run(&d, s3, single, x, z, b, a, t, 1);
    CHECK(!memcmp(whole, pieces, T * NV * DV * sizeof(float)), "chunked prefill differs from one call");
    CHECK(!memcmp(whole, single, T * NV * DV * sizeof(float)), "token-by-token differs from one call");
    CHECK(!memcmp(s1, s2, sf * sizeof(float)) && !memcmp(s1, s3, sf * sizeof(float)), "final states differ");

    /* A zeroed state is a fresh sequence: rerunning the first tokens reproduces them. */
    memset(s2, 0, sf * sizeof(float));
    run(&d, s2, pieces, x, z, b, a, 0, 4);
    CHECK(!memcmp(whole, pieces, 4 * NV * DV * sizeof(float)), "zeroed state is not a fresh sequence");
    /* ...and a stale one is not (the state really carries information). */
    run(&d, s1, pieces, x, z, b, a, 0, 4);
    CHECK(memcmp(whole, pieces, 4 * NV * DV * sizeof(float)) != 0, "state had no effect");

    char err_msg[256];
    cb_deltanet bad;
    cb_deltanet_config cfg = {3, 4, DK, DV, KERNEL, 1e-6f};   /* 4 value heads cannot share 3 key heads */
    CHECK(cb_deltanet_init(&bad, NULL, "x.", &cfg, NULL, err_msg, sizeof err_msg) == -1 &&
              strstr(err_msg, "linear_num_value_heads"), "bad head ratio accepted: %s", err_msg);
    cfg = (cb_deltanet_config){NK, NV, DK, DV, CB_DELTANET_MAX_KERNEL + 1, 1e-6f};
    CHECK(cb_deltanet_init(&bad, NULL, "x.", &cfg, NULL, err_msg, sizeof err_msg) == -1, "huge kernel accepted");

    cb_deltanet_free(&d);
    free(x); free(z); free(b); free(a); free(s1); free(s2); free(s3);
    free(whole); free(pieces); free(single); free(ref);
    printf("test_deltanet: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
