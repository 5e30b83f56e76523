/* bench_attention.c: cb_attend at the OLMoE-1B-7B attention geometry (16 layers, 16 heads x head_dim 128, no GQA,
 * f32 KV cache): seconds per decode token (one query row against `ctx` cached positions, every layer) and per
 * prefill of `ctx` rows from position 0 (every layer). Not a test: it never asserts, and the numbers are only
 * meaningful on an otherwise idle machine.
 *
 *   bench_attention [threads] [ctx] [kv_heads]      (defaults: 2 threads, ctx 512, 16 KV heads)
 *
 * It uses only blocks.h's public API, so it builds against an older runtime for before/after. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "blocks.h"
#include "kernels.h"

enum { LAYERS = 16, HEADS = 16, HEAD_DIM = 128 };

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void fill(float *x, size_t n, unsigned *seed) {
    for (size_t i = 0; i < n; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        x[i] = (float)((*seed >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
}

/* Every layer once: one token's (or one prompt's) attention. */
static double attend_all_layers(float *out, const float *q, const cb_kv *kv, int pos0, int n, const cb_attn_shape *s,
                                float *scores) {
    double start = now();
    for (int layer = 0; layer < LAYERS; layer++) cb_attend(out, q, kv, layer, pos0, n, s, scores);
    return now() - start;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2, ctx = argc > 2 ? atoi(argv[2]) : 512;
    int kv_heads = argc > 3 ? atoi(argv[3]) : HEADS;
    if (ctx < 1 || kv_heads < 1 || HEADS % kv_heads) {
        fprintf(stderr, "usage: bench_attention [threads] [ctx >= 1] [kv_heads dividing %d]\n", HEADS);
        return 2;
    }
    cb_threads_init(threads);
    cb_attn_shape s;
    char err[200];
    if (cb_attn_shape_init(&s, HEADS * HEAD_DIM, HEADS, kv_heads, HEAD_DIM, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 2;
    }
    cb_kv kv = {LAYERS, ctx + 1, kv_heads * HEAD_DIM, NULL, NULL, NULL};
    size_t cache = (size_t)LAYERS * (size_t)kv.ctx * (size_t)kv.kv_dim, width = (size_t)HEADS * HEAD_DIM;
    kv.k = malloc(cache * sizeof(float));
    kv.v = malloc(cache * sizeof(float));
    float *q = malloc((size_t)ctx * width * sizeof(float)), *out = malloc((size_t)ctx * width * sizeof(float));
    float *scores = cb_attn_scratch(ctx, HEADS, kv.ctx);
    if (!kv.k || !kv.v || !q || !out || !scores) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    unsigned seed = 1;
    fill(kv.k, cache, &seed);
    fill(kv.v, cache, &seed);
    fill(q, (size_t)ctx * width, &seed);

    double decode = 1e30, prefill = 1e30;
    for (int trial = 0; trial < 20; trial++) {
        double t = attend_all_layers(out, q, &kv, ctx, 1, &s, scores);
        if (t < decode) decode = t;
    }
    for (int trial = 0; trial < 3; trial++) {
        double t = attend_all_layers(out, q, &kv, 0, ctx, &s, scores);
        if (t < prefill) prefill = t;
    }
    printf("threads %d ctx %d kv_heads %d: decode %.3f ms/token, prefill %.1f ms (%d rows), best of 20 / 3\n",
           cb_threads_count(), ctx, kv_heads, decode * 1e3, prefill * 1e3, ctx);
    return 0;
}
