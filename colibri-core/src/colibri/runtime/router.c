/* router.c: see router.h. */
#include "router.h"

#include <math.h>
#include <stdio.h>

int cb_grouped_router_check(const cb_grouped_router *r, char *err, size_t errlen) {
    int E = r->n_experts, G = r->n_group;
    if (E < 1 || r->top_k < 1 || r->top_k > E) {
        snprintf(err, errlen, "--set num_experts_per_tok=%d must be between 1 and n_routed_experts=%d", r->top_k, E);
        return -1;
    }
    if (G < 1 || E % G || r->topk_group < 1 || r->topk_group > G) {
        snprintf(err, errlen, "--set n_group=%d / topk_group=%d: groups must divide the %d experts and "
                              "1 <= topk_group <= n_group", G, r->topk_group, E);
        return -1;
    }
    if (G > 1 && E / G < 2) {
        snprintf(err, errlen, "--set n_group=%d leaves fewer than 2 experts per group (a group scores its best two)",
                 G);
        return -1;
    }
    if (r->top_k > r->topk_group * (E / G)) {
        snprintf(err, errlen, "--set num_experts_per_tok=%d exceeds the %d experts of the topk_group=%d kept groups",
                 r->top_k, r->topk_group * (E / G), r->topk_group);
        return -1;
    }
    return 0;
}

/* Index of the largest v[i] among i < n with keep[i] != 0 (strictly greater wins: ties go to the lowest index). */
static int argmax_kept(const float *v, const float *keep, int n) {
    int best = -1;
    for (int i = 0; i < n; i++)
        if (keep[i] != 0.0f && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

void cb_grouped_route(const cb_grouped_router *r, const float *logits, int *idx, float *w, float *scratch) {
    int E = r->n_experts, G = r->n_group, per = E / G;
    float *biased = scratch, *eligible = scratch + E, *group_score = scratch + 2 * E;
    for (int e = 0; e < E; e++) {
        float s = 1.0f / (1.0f + expf(-logits[e]));
        biased[e] = s + (r->bias ? r->bias[e] : 0.0f);
        eligible[e] = 0.0f;
    }
    if (G == 1) {
        for (int e = 0; e < E; e++) eligible[e] = 1.0f;
    } else {
        for (int g = 0; g < G; g++) {
            const float *b = biased + g * per;
            int first = 0;
            for (int i = 1; i < per; i++) if (b[i] > b[first]) first = i;
            int second = first == 0 ? 1 : 0;
            for (int i = 0; i < per; i++) if (i != first && b[i] > b[second]) second = i;
            group_score[g] = b[first] + b[second];
        }
        float *open = group_score + G;   /* 1 while a group is not yet kept */
        for (int g = 0; g < G; g++) open[g] = 1.0f;
        for (int j = 0; j < r->topk_group; j++) open[argmax_kept(group_score, open, G)] = 0.0f;
        for (int e = 0; e < E; e++) eligible[e] = open[e / per] == 0.0f ? 1.0f : 0.0f;
    }
    float sum = 0.0f;
    for (int j = 0; j < r->top_k; j++) {
        int e = argmax_kept(biased, eligible, E);
        eligible[e] = 0.0f;
        idx[j] = e;
        w[j] = 1.0f / (1.0f + expf(-logits[e]));
        sum += w[j];
    }
    /* As transformers: the denominator carries 1e-20 so an all-zero selection cannot divide by zero. */
    for (int j = 0; j < r->top_k; j++) w[j] = (r->norm_topk_prob ? w[j] / (sum + 1e-20f) : w[j]) * r->scaling;
}
