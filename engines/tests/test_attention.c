/* test_attention.c: cb_attend (query rows x KV heads blocked, positions streamed) equals the plain per-(row, head)
 * attention it replaced bit for bit: decode (one row) and prefill (rows beyond one row block, from position 0 and
 * from pos0 > 0), with and without GQA, head_dim on and off the 16-lane width, on every ISA this CPU has and at
 * 1, 2 and 3 threads. The reference is written out here with the same kernels (cb_dot, cb_softmax, cb_axpy), so
 * any change of summation order in the blocked version shows up as differing bits. */
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "check.h"
#include "kernels.h"

/* Uniform in [-2, 2): scores of O(1) so the softmax is far from one-hot and every position counts. */
static float random_float(void) { return (float)(rnd() >> 40) * (4.0f / 16777216.0f) - 2.0f; }

static float *random_floats(size_t n) {
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = random_float();
    return x;
}

/* The attention as one (row, head) at a time: each score a cb_dot, then softmax, then cb_axpy over V in order. */
static void reference(float *out, const float *q, const cb_kv *kv, int layer, int pos0, int n, const cb_attn_shape *s,
                      float *sc) {
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads;
    size_t width = (size_t)s->n_heads * (size_t)hd;
    for (int row = 0; row < n; row++)
        for (int h = 0; h < s->n_heads; h++) {
            const float *qh = q + (size_t)row * width + (size_t)h * (size_t)hd;
            float *o = out + (size_t)row * width + (size_t)h * (size_t)hd;
            size_t kv_at = (size_t)(h / group) * (size_t)hd;
            int pos = pos0 + row;
            for (int t = 0; t <= pos; t++) sc[t] = cb_dot(cb_kv_k(kv, layer, t) + kv_at, CB_F32, qh, hd) * s->scale;
            cb_softmax(sc, pos + 1);
            memset(o, 0, (size_t)hd * sizeof *o);
            for (int t = 0; t <= pos; t++) cb_axpy(o, sc[t], cb_kv_v(kv, layer, t) + kv_at, (size_t)hd);
        }
}

static void check_shape(int n_heads, int n_kv_heads, int head_dim, int pos0, int n) {
    enum { LAYERS = 2 };
    cb_attn_shape s;
    char err[160];
    CHECK(cb_attn_shape_init(&s, 0, n_heads, n_kv_heads, head_dim, err, sizeof err) == 0, "%s", err);
    cb_kv kv = {LAYERS, pos0 + n + 3, n_kv_heads * head_dim, NULL, NULL, NULL};
    size_t cache = (size_t)LAYERS * (size_t)kv.ctx * (size_t)kv.kv_dim, width = (size_t)n_heads * (size_t)head_dim;
    kv.k = random_floats(cache);
    kv.v = random_floats(cache);
    float *q = random_floats((size_t)n * width), *want = malloc((size_t)n * width * sizeof *want);
    float *got = malloc((size_t)n * width * sizeof *got), *sc = malloc((size_t)kv.ctx * sizeof *sc);
    float *scores = cb_attn_scratch(n, n_heads, kv.ctx);
    int layer = LAYERS - 1;   /* not layer 0, so a wrong layer stride shows */
    reference(want, q, &kv, layer, pos0, n, &s, sc);
    for (int isa = CB_ISA_SCALAR; isa <= (int)cb_isa_detect(); isa++) {
        cb_set_isa((cb_isa)isa);
        for (int threads = 1; threads <= 3; threads++) {
            cb_threads_init(threads);
            memset(got, 0xff, (size_t)n * width * sizeof *got);   /* NaN: every output must be written */
            cb_attend(got, q, &kv, layer, pos0, n, &s, scores);
            CHECK(memcmp(got, want, (size_t)n * width * sizeof *got) == 0,
                  "%s, %d threads: heads %d/%d x %d, pos0 %d, %d rows differ from the per-(row, head) attention",
                  cb_isa_name((cb_isa)isa), threads, n_heads, n_kv_heads, head_dim, pos0, n);
        }
    }
    cb_set_isa(cb_isa_detect());
    free(kv.k);
    free(kv.v);
    free(q);
    free(want);
    free(got);
    free(sc);
    free(scores);
}

int main(void) {
    /* (heads, KV heads, head_dim): OLMoE's 16 x 128 without GQA, GQA 4:1 and 3:1 (head_dim 20: a 16-lane block and
     * a tail), 2 heads sharing one KV head of 7 (tail only). */
    static const int shapes[][3] = {{16, 16, 128}, {8, 2, 64}, {6, 2, 20}, {2, 1, 7}};
    /* (pos0, rows): decode at a few positions, a prefill from 0 over more than one row block, a prefill after a
     * cached prefix (pos0 > 0), and a short batch. */
    static const int spans[][2] = {{0, 1}, {9, 1}, {70, 1}, {0, 45}, {21, 70}, {5, 3}};
    for (size_t a = 0; a < sizeof shapes / sizeof shapes[0]; a++)
        for (size_t b = 0; b < sizeof spans / sizeof spans[0]; b++)
            check_shape(shapes[a][0], shapes[a][1], shapes[a][2], spans[b][0], spans[b][1]);
    cb_threads_shutdown();
    printf("test_attention: %d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
