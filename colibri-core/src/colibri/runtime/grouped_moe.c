/* grouped_moe.c: see grouped_moe.h. */
#include "grouped_moe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cb_grouped_moe_init(cb_grouped_moe *m, const cb_st_index *idx, int layer, const char *prefix_fmt,
                        const cb_grouped_moe_shape *s, int has_bias, int cap, int max_batch, size_t *dense_bytes,
                        char *err, size_t errlen) {
    memset(m, 0, sizeof *m);
    m->route = (cb_grouped_router){s->n_experts, s->top_k, s->n_group, s->topk_group, s->norm_topk_prob,
                                   s->routed_scaling_factor, NULL};
    if (cb_grouped_router_check(&m->route, err, errlen)) return -1;
    char prefix[448], name[512], fmts[3][512];
    snprintf(prefix, sizeof prefix, prefix_fmt, layer);
    static const char *const default_mats[3] = {"gate_proj", "up_proj", "down_proj"};
    const char *const *mats = s->expert_mats ? s->expert_mats : default_mats;
    /* The store formats (layer, expert): keep the layer's %d in the prefix format and add the expert's. */
    for (int i = 0; i < 3; i++) snprintf(fmts[i], sizeof fmts[i], "%sexperts.%%d.%s.weight", prefix_fmt, mats[i]);
    const char *const expert_names[3] = {fmts[0], fmts[1], fmts[2]};
    snprintf(name, sizeof name, "%sgate.weight", prefix);
    if (cb_moe_init(&m->moe, idx, layer, name, expert_names, s->n_experts, s->top_k, s->norm_topk_prob, s->hidden,
                    s->inter, cap, max_batch, dense_bytes, err, errlen))
        return -1;
    if (has_bias) {
        snprintf(name, sizeof name, "%sgate.e_score_correction_bias", prefix);
        if (cb_load_vector(&m->bias, idx, name, s->n_experts, dense_bytes, err, errlen)) goto fail;
        m->route.bias = m->bias;
    }
    if (s->n_shared > 0) {
        snprintf(name, sizeof name, "%sshared_experts.", prefix);
        if (cb_swiglu_init(&m->shared, idx, name, s->hidden, s->n_shared * s->inter, max_batch, dense_bytes, err,
                           errlen))
            goto fail;
        m->has_shared = 1;
    }
    m->route_scratch = malloc((size_t)2 * (size_t)(s->n_experts + s->n_group) * sizeof(float));
    m->shared_out = malloc((size_t)max_batch * (size_t)s->hidden * sizeof(float));
    if (!m->route_scratch || !m->shared_out) {
        snprintf(err, errlen, "out of memory for the MoE scratch of layer %d", layer);
        goto fail;
    }
    return 0;
fail:
    cb_grouped_moe_free(m);
    return -1;
}

void cb_grouped_moe_free(cb_grouped_moe *m) {
    cb_moe_free(&m->moe);
    if (m->has_shared) cb_swiglu_free(&m->shared);
    free(m->bias);
    free(m->route_scratch);
    free(m->shared_out);
    memset(m, 0, sizeof *m);
}

int cb_grouped_moe_forward(cb_grouped_moe *m, float *out, const float *x, int n, char *err, size_t errlen) {
    cb_moe *moe = &m->moe;
    int E = moe->n_experts, K = moe->top_k;
    /* Router logits in f32 whatever the checkpoint dtype of x (transformers upcasts both sides). */
    cb_linear_apply(&moe->router, moe->logits, x, n);
    for (int i = 0; i < n; i++)
        cb_grouped_route(&m->route, moe->logits + (size_t)i * (size_t)E, moe->chosen + (size_t)i * (size_t)K,
                         moe->weight + (size_t)i * (size_t)K, m->route_scratch);
    if (cb_moe_experts_forward(moe, out, x, n, err, errlen)) return -1;
    if (m->has_shared) {
        cb_swiglu_forward(&m->shared, m->shared_out, x, n);
        cb_add(out, m->shared_out, (size_t)n * (size_t)moe->hidden);
    }
    return 0;
}
