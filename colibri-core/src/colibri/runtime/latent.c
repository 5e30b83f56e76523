/* latent.c: see latent.h. */
#include "latent.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

void cb_latent_shape_finish(cb_latent_shape *s, int hidden) {
    cb_mla_shape *m = &s->mla;
    m->hidden = hidden;
    m->lora_eps = 1e-6f;       /* q_a_layernorm / kv_a_layernorm keep the RMSNorm default */
    if (!(m->scale > 0)) m->scale = 1.0f / sqrtf((float)(m->nope + m->rope));
    s->kv_width = m->kv_lora + m->rope;
    if (!s->sparse) return;
    s->dsa.hidden = hidden;
    s->dsa.q_lora = m->q_lora;
    s->dsa.rope_dim = m->rope;
    s->index_col = s->kv_width;
    s->kv_width += s->dsa.head_dim;
}

int cb_latent_init(cb_latent *a, const cb_st_index *idx, int l, const cb_latent_shape *s, int indexer, int max_batch,
                   int ctx, size_t *bytes, char *err, size_t errlen) {
    char prefix[128];
    snprintf(prefix, sizeof prefix, "model.layers.%d.self_attn.", l);
    if (cb_mla_init(&a->mla, idx, prefix, &s->mla, max_batch, ctx, bytes, err, errlen)) return -1;
    if (!s->sparse || !indexer) return 0;
    snprintf(prefix, sizeof prefix, "model.layers.%d.self_attn.indexer.", l);
    if (cb_dsa_init(&a->dsa, idx, prefix, &s->dsa, max_batch, ctx, bytes, err, errlen)) return -1;
    a->has_indexer = 1;
    return 0;
}

void cb_latent_free(cb_latent *a) {
    cb_mla_free(&a->mla);
    if (a->has_indexer) cb_dsa_free(&a->dsa);
    a->has_indexer = 0;
}

void cb_latent_free_layer(void *model, void *layer) {
    (void)model;
    cb_latent_free(layer);
}

int cb_latent_sel_init(cb_latent_sel *sel, const cb_latent_shape *s, int max_batch) {
    if (!s->sparse) return 0;
    sel->sel = malloc((size_t)max_batch * (size_t)s->dsa.topk * sizeof(int));
    sel->n_sel = malloc((size_t)max_batch * sizeof(int));
    return sel->sel && sel->n_sel ? 0 : -1;
}

void cb_latent_sel_free(cb_latent_sel *sel) {
    free(sel->sel);
    free(sel->n_sel);
    sel->sel = sel->n_sel = NULL;
}

void cb_latent_forward(cb_latent *a, const cb_latent_shape *s, float *out, const float *h, int n, int pos0, cb_kv *kv,
                       int kv_layer, const cb_rope *rope, const cb_rope *index_rope, cb_latent_sel *sel) {
    cb_mla_project(&a->mla, h, n, pos0, kv, kv_layer, rope);
    if (!s->sparse) {
        cb_mla_attend(&a->mla, out, n, pos0, kv, kv_layer, NULL, NULL, 0);
        return;
    }
    if (a->has_indexer)
        cb_dsa_select(&a->dsa, h, a->mla.q_resid, n, pos0, kv, kv_layer, s->index_col, index_rope, sel->sel,
                      sel->n_sel);
    cb_mla_attend(&a->mla, out, n, pos0, kv, kv_layer, sel->sel, sel->n_sel, s->dsa.topk);
}
