/* dsa.c: see dsa.h. */
#include "dsa.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LN_EPS 1e-6f           /* the indexer's k_norm is nn.LayerNorm(head_dim, eps=1e-6) in every checkpoint */

int cb_dsa_init(cb_dsa *x, const cb_st_index *idx, const char *prefix, const cb_dsa_shape *s, int max_batch, int ctx,
                size_t *bytes, char *err, size_t errlen) {
    memset(x, 0, sizeof *x);
    x->s = *s;
    x->max_batch = max_batch;
    x->ctx = ctx;
    if (s->n_heads < 1 || s->head_dim < s->rope_dim || s->topk < 1 || s->q_lora < 1) {
        snprintf(err, errlen, "--set index_n_heads / index_head_dim (>= qk_rope_head_dim) / index_topk out of range "
                              "(DSA also needs q_lora_rank)");
        return -1;
    }
    char name[512];
#define NAME(what) (snprintf(name, sizeof name, "%s%s", prefix, what), name)
    if (cb_load_linear(&x->wq_b, idx, NAME("wq_b.weight"), s->n_heads * s->head_dim, s->q_lora, bytes, err, errlen) ||
        cb_load_linear(&x->wk, idx, NAME("wk.weight"), s->head_dim, s->hidden, bytes, err, errlen) ||
        cb_load_linear(&x->weights_proj, idx, NAME("weights_proj.weight"), s->n_heads, s->hidden, bytes, err, errlen) ||
        cb_load_vector(&x->k_norm_w, idx, NAME("k_norm.weight"), s->head_dim, bytes, err, errlen) ||
        cb_load_vector(&x->k_norm_b, idx, NAME("k_norm.bias"), s->head_dim, bytes, err, errlen))
        goto fail;
#undef NAME
    size_t B = (size_t)max_batch;
    x->q = malloc(B * (size_t)s->n_heads * (size_t)s->head_dim * sizeof(float));
    x->k = malloc(B * (size_t)s->head_dim * sizeof(float));
    x->w = malloc(B * (size_t)s->n_heads * sizeof(float));
    x->scores = malloc(B * (size_t)ctx * sizeof(float));
    x->heap = malloc(B * (size_t)s->topk * sizeof(int));
    if (!x->q || !x->k || !x->w || !x->scores || !x->heap) {
        snprintf(err, errlen, "out of memory for the DSA indexer of %s", prefix);
        goto fail;
    }
    return 0;
fail:
    cb_dsa_free(x);
    return -1;
}

void cb_dsa_free(cb_dsa *x) {
    cb_linear_free(&x->wq_b);
    cb_linear_free(&x->wk);
    cb_linear_free(&x->weights_proj);
    free(x->k_norm_w); free(x->k_norm_b);
    if (!x->borrowed) free(x->q), free(x->k), free(x->w), free(x->scores), free(x->heap);
    memset(x, 0, sizeof *x);
}

void cb_dsa_share_scratch(cb_dsa *x, const cb_dsa *owner) {
    if (x == owner || x->borrowed || memcmp(&x->s, &owner->s, sizeof x->s) || x->max_batch != owner->max_batch ||
        x->ctx != owner->ctx)
        return;
    free(x->q), free(x->k), free(x->w), free(x->scores), free(x->heap);
    x->q = owner->q;
    x->k = owner->k;
    x->w = owner->w;
    x->scores = owner->scores;
    x->heap = owner->heap;
    x->borrowed = 1;
}

static void layer_norm(float *v, int n, const float *w, const float *b) {
    float mean = 0, var = 0;
    for (int i = 0; i < n; i++) mean += v[i];
    mean /= (float)n;
    for (int i = 0; i < n; i++) var += (v[i] - mean) * (v[i] - mean);
    var /= (float)n;
    float inv = 1.0f / sqrtf(var + LN_EPS);
    for (int i = 0; i < n; i++) v[i] = (v[i] - mean) * inv * w[i] + b[i];
}

/* Heap order: a is "worse" than b when it scores lower, or equal and sits later (so ties keep the earlier). */
static int worse(const float *sc, int a, int b) { return sc[a] < sc[b] || (sc[a] == sc[b] && a > b); }

static void sift_down(int *heap, int n, int i, const float *sc) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && worse(sc, heap[l], heap[m])) m = l;
        if (r < n && worse(sc, heap[r], heap[m])) m = r;
        if (m == i) return;
        int t = heap[i]; heap[i] = heap[m]; heap[m] = t;
        i = m;
    }
}

static int cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int cb_dsa_top_positions(const float *scores, int n, int k, int *heap, int *out) {
    if (k >= n) {
        for (int i = 0; i < n; i++) out[i] = i;
        return n;
    }
    /* A min-heap (worst on top) of the best k seen so far: O(n log k), fine for 100k-token contexts. */
    for (int i = 0; i < k; i++) heap[i] = i;
    for (int i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i, scores);
    for (int t = k; t < n; t++)
        if (worse(scores, heap[0], t)) {
            heap[0] = t;
            sift_down(heap, k, 0, scores);
        }
    memcpy(out, heap, (size_t)k * sizeof(int));
    qsort(out, (size_t)k, sizeof(int), cmp_int);
    return k;
}

typedef struct {
    cb_dsa *x;
    const cb_kv *kv;
    int layer, col, pos0;
    int *sel, *n_sel;
} select_job;

static void select_row(void *ctx, int i) {
    const select_job *j = ctx;
    cb_dsa *x = j->x;
    const cb_dsa_shape *s = &x->s;
    int pos = j->pos0 + i, nh = s->n_heads, D = s->head_dim;
    int *sel = j->sel + (size_t)i * (size_t)s->topk;
    if (s->topk >= pos + 1) {  /* every position fits: no scores needed */
        for (int t = 0; t <= pos; t++) sel[t] = t;
        j->n_sel[i] = pos + 1;
        return;
    }
    float *sc = x->scores + (size_t)i * (size_t)x->ctx, scale = 1.0f / sqrtf((float)D);
    const float *q = x->q + (size_t)i * (size_t)nh * (size_t)D, *w = x->w + (size_t)i * (size_t)nh;
    for (int t = 0; t <= pos; t++) {
        const float *k = cb_kv_k(j->kv, j->layer, t) + j->col;
        float acc = 0;
        for (int h = 0; h < nh; h++) {
            float d = cb_dot(k, CB_F32, q + (size_t)h * (size_t)D, D) * scale;
            acc += w[h] * (d > 0 ? d : 0);
        }
        sc[t] = acc;
    }
    j->n_sel[i] = cb_dsa_top_positions(sc, pos + 1, s->topk, x->heap + (size_t)i * (size_t)s->topk, sel);
}

void cb_dsa_select(cb_dsa *x, const float *h, const float *q_resid, int n, int pos0, cb_kv *kv, int layer, int col,
                   const cb_rope *rope, int *sel, int *n_sel) {
    const cb_dsa_shape *s = &x->s;
    int nh = s->n_heads, D = s->head_dim;
    cb_linear_apply(&x->wk, x->k, h, n);
    cb_linear_apply(&x->wq_b, x->q, q_resid, n);
    cb_linear_apply(&x->weights_proj, x->w, h, n);
    float wscale = 1.0f / sqrtf((float)nh);
    for (int i = 0; i < n; i++) {
        float *k = x->k + (size_t)i * (size_t)D;
        layer_norm(k, D, x->k_norm_w, x->k_norm_b);
        cb_rope_apply(rope, k, 1, D, pos0 + i);
        cb_rope_apply(rope, x->q + (size_t)i * (size_t)nh * (size_t)D, nh, D, pos0 + i);
        for (int hh = 0; hh < nh; hh++) x->w[(size_t)i * (size_t)nh + (size_t)hh] *= wscale;
        memcpy(cb_kv_k(kv, layer, pos0 + i) + col, k, (size_t)D * sizeof(float));
    }
    select_job j = {x, kv, layer, col, pos0, sel, n_sel};
    cb_parallel_for(n, select_row, &j);
}
