/* softplus_router.c: see softplus_router.h. */
#include "softplus_router.h"

#include <math.h>

float cb_sqrtsoftplus(float x) { return sqrtf(x > 20.0f ? x : log1pf(expf(x))); }

static void renormalise(float *w, int k, float scaling) {
    float sum = 0;
    for (int j = 0; j < k; j++) sum += w[j];
    for (int j = 0; j < k; j++) w[j] = w[j] / (sum + 1e-20f) * scaling;
}

void cb_sqrtsoftplus_route(const float *logits, const float *bias, int n_experts, int top_k, float scaling,
                           int *idx, float *w, float *scores) {
    for (int e = 0; e < n_experts; e++) scores[e] = cb_sqrtsoftplus(logits[e]);
    for (int j = 0; j < top_k; j++) {
        int best = -1;
        float best_v = 0;
        for (int e = 0; e < n_experts; e++) {
            int taken = 0;
            for (int t = 0; t < j; t++) taken |= idx[t] == e;
            float v = scores[e] + (bias ? bias[e] : 0.0f);
            if (!taken && (best < 0 || v > best_v)) {
                best = e;
                best_v = v;
            }
        }
        idx[j] = best;
        w[j] = scores[best];
    }
    renormalise(w, top_k, scaling);
}

void cb_hash_route(const float *logits, const int32_t *table, int top_k, float scaling, int *idx, float *w) {
    for (int j = 0; j < top_k; j++) {
        idx[j] = table[j];
        w[j] = cb_sqrtsoftplus(logits[table[j]]);
    }
    renormalise(w, top_k, scaling);
}
