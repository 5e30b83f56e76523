/* test_gqa.c: the GQA attention block in its Qwen3-Next form (per-head zero-centred q/k norm, partial RoPE,
 * sigmoid output gate interleaved in q_proj, q/k/v/o biases, 2 query heads per KV head) against a direct
 * double-precision transcription, and batched rows == one row at a time, bit for bit. */
#include <string.h>

#include "gqa.h"
#include "qwen_blocks_common.h"

enum { HID = 24, NH = 4, NKV = 2, HD = 8, ROT = 4, T = 9, CTX = 16 };

static cb_linear lin(int rows, int cols) {
    cb_linear l = {.w = rand_floats((size_t)rows * cols, 1.0f / sqrtf((float)cols), 0)};
    l.m = cb_matrix_float(l.w, CB_F32, rows, cols);
    return l;
}

static void matvec_d(double *y, const cb_linear *l, const double *x, const float *bias) {
    const float *w = l->w;
    for (int r = 0; r < l->m.rows; r++) {
        double acc = bias ? bias[r] : 0;
        for (int c = 0; c < l->m.cols; c++) acc += (double)w[r * l->m.cols + c] * x[c];
        y[r] = acc;
    }
}

static void norm_rope(double *v, const float *w, int pos, const float *inv_freq) {
    double ss = 0;
    for (int i = 0; i < HD; i++) ss += v[i] * v[i];
    double inv = 1.0 / sqrt(ss / HD + 1e-6);
    for (int i = 0; i < HD; i++) v[i] *= inv * w[i];
    for (int i = 0; i < ROT / 2; i++) {
        double ang = (double)((float)pos * inv_freq[i]), x0 = v[i], x1 = v[i + ROT / 2];
        v[i] = x0 * cos(ang) - x1 * sin(ang);
        v[i + ROT / 2] = x1 * cos(ang) + x0 * sin(ang);
    }
}

static void reference(const cb_gqa *a, const float *h, const float *inv_freq, double *out) {
    static double K[T][NKV * HD], V[T][NKV * HD];
    for (int t = 0; t < T; t++) {
        double x[HID], qg[2 * NH * HD], att[NH * HD];
        for (int c = 0; c < HID; c++) x[c] = h[t * HID + c];
        matvec_d(qg, &a->wq, x, a->bq);
        matvec_d(K[t], &a->wk, x, a->bk);
        matvec_d(V[t], &a->wv, x, a->bv);
        for (int g = 0; g < NKV; g++) norm_rope(K[t] + g * HD, a->k_norm, t, inv_freq);
        for (int hh = 0; hh < NH; hh++) {
            double *q = qg + hh * 2 * HD, *gate = q + HD, sc[T], mx = -1e300, sum = 0;
            norm_rope(q, a->q_norm, t, inv_freq);
            int g = hh / (NH / NKV);
            for (int s = 0; s <= t; s++) {
                sc[s] = 0;
                for (int i = 0; i < HD; i++) sc[s] += q[i] * K[s][g * HD + i];
                sc[s] /= sqrt((double)HD);
                mx = fmax(mx, sc[s]);
            }
            for (int s = 0; s <= t; s++) sum += (sc[s] = exp(sc[s] - mx));
            for (int i = 0; i < HD; i++) {
                double acc = 0;
                for (int s = 0; s <= t; s++) acc += sc[s] / sum * V[s][g * HD + i];
                att[hh * HD + i] = acc / (1.0 + exp(-gate[i]));
            }
        }
        matvec_d(out + t * HID, &a->wo, att, a->bo);
    }
}

int main(void) {
    cb_gqa a;
    memset(&a, 0, sizeof a);
    a.c = (cb_gqa_config){HID, NH, NKV, HD, 1, 1, 1, 1, 1, 1e-6f};
    a.wq = lin(2 * NH * HD, HID);
    a.wk = lin(NKV * HD, HID);
    a.wv = lin(NKV * HD, HID);
    a.wo = lin(HID, NH * HD);
    a.bq = rand_floats(2 * NH * HD, 0.1f, 0);
    a.bk = rand_floats(NKV * HD, 0.1f, 0);
    a.bv = rand_floats(NKV * HD, 0.1f, 0);
    a.bo = rand_floats(HID, 0.1f, 0);
    a.q_norm = rand_floats(HD, 0.2f, 1.0f);   /* already 1 + w, as cb_gqa_init leaves them */
    a.k_norm = rand_floats(HD, 0.2f, 1.0f);
    float inv_freq[ROT / 2] = {1.0f, 0.01f};
    cb_rope rope = {1, ROT, inv_freq, 1.0f};

    char err[256];
    cb_gqa_scratch s;
    CHECK(cb_gqa_scratch_init(&s, &a.c, T, CTX, err, sizeof err) == 0, "%s", err);
    cb_kv kv1 = {1, CTX, NKV * HD, calloc(CTX * NKV * HD, 4), calloc(CTX * NKV * HD, 4), NULL};
    cb_kv kv2 = {1, CTX, NKV * HD, calloc(CTX * NKV * HD, 4), calloc(CTX * NKV * HD, 4), NULL};
    float *h = rand_floats(T * HID, 1.0f, 0), *batched = malloc(T * HID * 4), *single = malloc(T * HID * 4);
    double *ref = malloc(T * HID * sizeof(double));

    cb_gqa_forward(&a, &s, batched, h, T, &kv1, 0, 0, &rope);
    for (int t = 0; t < T; t++) cb_gqa_forward(&a, &s, single + t * HID, h + t * HID, 1, &kv2, 0, t, &rope);
    reference(&a, h, inv_freq, ref);
    double e = max_abs_diff(batched, ref, T * HID);
    CHECK(e < 1e-5, "block vs double reference: %g", e);
    CHECK(!memcmp(batched, single, T * HID * 4), "batched rows differ from one row at a time");
    /* The gate matters: without it the same block gives a different answer. */
    a.c.output_gate = 0;
    a.wq.m.rows = NH * HD;     /* first half of the rows as a plain q_proj */
    cb_gqa_forward(&a, &s, single, h, T, &kv2, 0, 0, &rope);
    CHECK(memcmp(batched, single, T * HID * 4) != 0, "output gate had no effect");

    cb_gqa_free(&a);
    cb_gqa_scratch_free(&s);
    free(kv1.k); free(kv1.v); free(kv2.k); free(kv2.v);
    free(h); free(batched); free(single); free(ref);
    printf("test_gqa: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
