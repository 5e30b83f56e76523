/* deepseek_v4.c: the DeepSeek-V4 engine (model_type deepseek_v4), composed from the shared runtime's blocks; its
 * own binary (colibri-deepseek-v4), apart from the MLA engine of V3 / V3.2 (deepseek.c).
 *
 * Residual: hc_mult parallel streams mixed around every block by hyper-connections (hyperconn.h).
 * Attention, one shared key=value head, low-rank query, per-head sinks (sink_attn.h), grouped low-rank output;
 * every layer attends to a sliding window of its own keys, and, by layer kind (--set layer_kinds, one letter
 * per layer):
 *   S  sliding window only
 *   H  heavily compressed (HCA): plus every compressed entry so far (one per hca_rate tokens)
 *   C  compressed sparse (CSA): plus the index_topk compressed entries (one per csa_rate tokens, overlapping
 *      windows of 2 x rate) the lightning indexer scores highest
 * MoE: sqrt(softplus) routing with a selection bias, or hash routing (tid2eid) in the layers --set mlp_layers
 * marks H (else M); clamped SwiGLU experts plus a shared expert.
 *
 * KV rows: everything is per position, so prefix reuse and chunked prefill need nothing else. A layer's row
 * holds the key (= value) of the position, the compressor's raw value and gate rows of the position (position
 * bias added), and, at the position that closes a window, the compressed entry of that window; CSA layers hold
 * the same for the indexer. Entries are computed when their window's last position arrives, before any row of
 * the call attends.
 *
 * Tensor names: as transformers saves them (model.layers.N..., model.embed_tokens, model.hc_head.hc_fn, head)
 * or as DeepSeek ships them (layers.N..., embed, hc_head_fn, head); the layer-level names are the same.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "compressor.h"
#include "engine.h"
#include "hyperconn.h"
#include "sink_attn.h"
#include "softplus_router.h"

typedef struct {
    char kind;                 /* 'S', 'H', 'C' */
    int rate;
    float *attn_norm, *ffn_norm, *q_norm, *kv_norm, *sinks;
    float *hc_attn[3], *hc_ffn[3];     /* fn, base, scale */
    cb_linear wq_a, wq_b, wkv, wo_a, wo_b;
    cb_linear c_wkv, c_wgate;  /* compressor */
    float *c_ape, *c_norm;
    cb_linear i_wkv, i_wgate, i_wq_b, i_wproj;   /* indexer */
    float *i_ape, *i_norm;
    int is_hash;
    int32_t *tid2eid;
    float *bias;
    cb_moe moe;
    cb_linear sh_gate, sh_up, sh_down;
    int has_shared;
} v4_layer;

typedef struct {
    int hidden, n_layers, vocab, tied, max_batch, ctx;
    int n_heads, head_dim, q_lora, o_groups, o_lora, window, csa_rate, hca_rate;
    int ix_heads, ix_dim, ix_topk;
    int n_experts, top_k, inter, n_shared;
    float eps, scaling, swiglu_limit;
    cb_hc_shape hc;
    int kv_dim;
    int off_cmp, off_rkv;      /* row offsets: key at 0 */
    char prefix[32];           /* "model.layers." or "layers." */
    cb_st_index idx;
    cb_linear embed, head;
    float *final_norm, *hc_head[3];
    v4_layer *layers;
    cb_expert_layer **expert_layers;
    int n_expert_layers;
    cb_rope main_rope, comp_rope;
    /* activations, max_batch rows */
    float *X, *c, *h, *y, *pre, *post, *comb, *hc_scratch, *hc_tmp;
    float *qa, *q, *kvp, *ckv, *cg, *ikv, *ig, *o, *ga, *iq, *iw, *entry;
    float *scores, *ix_scores, *sh_g, *sh_u, *sh_o, *route_scores;
    const float **rows, **slot_kv, **slot_g;
    int *picked;
    unsigned char *taken;
    const char *layer_kinds, *mlp_layers;              /* --set strings */
    const char *main_theta, *main_partial;               /* the sliding-window layers' RoPE */
} v4;

static void free_layer(v4_layer *L) {
    float *vecs[] = {L->attn_norm, L->ffn_norm, L->q_norm, L->kv_norm, L->sinks, L->hc_attn[0], L->hc_attn[1],
                     L->hc_attn[2], L->hc_ffn[0], L->hc_ffn[1], L->hc_ffn[2], L->c_ape, L->c_norm, L->i_ape,
                     L->i_norm, L->bias};
    for (size_t i = 0; i < sizeof vecs / sizeof *vecs; i++) free(vecs[i]);
    cb_linear *lins[] = {&L->wq_a, &L->wq_b, &L->wkv, &L->wo_a, &L->wo_b, &L->c_wkv, &L->c_wgate, &L->i_wkv,
                         &L->i_wgate, &L->i_wq_b, &L->i_wproj, &L->sh_gate, &L->sh_up, &L->sh_down};
    for (size_t i = 0; i < sizeof lins / sizeof *lins; i++) cb_linear_free(lins[i]);
    free(L->tid2eid);
    if (L->moe.n_experts) cb_moe_free(&L->moe);
}

static void v4_free(void *ptr) {
    v4 *m = ptr;
    if (!m) return;
    if (m->layers)
        for (int l = 0; l < m->n_layers; l++) free_layer(&m->layers[l]);
    free(m->layers);
    free(m->expert_layers);
    cb_linear_free(&m->embed);
    if (!m->tied) cb_linear_free(&m->head);
    free(m->final_norm);
    for (int i = 0; i < 3; i++) free(m->hc_head[i]);
    cb_rope_free(&m->main_rope);
    cb_rope_free(&m->comp_rope);
    float *bufs[] = {m->X, m->c, m->h, m->y, m->pre, m->post, m->comb, m->hc_scratch, m->hc_tmp, m->qa, m->q,
                     m->kvp, m->ckv, m->cg, m->ikv, m->ig, m->o, m->ga, m->iq, m->iw, m->entry, m->scores,
                     m->ix_scores, m->sh_g, m->sh_u, m->sh_o, m->route_scores};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    free(m->rows); free(m->slot_kv); free(m->slot_g); free(m->picked); free(m->taken);
    cb_st_close(&m->idx);
    free(m);
}

/* A float tensor of any rank with `n` elements, as f32 (hyper-connection maps, position biases). */
static int load_f32(float **out, const cb_st_index *idx, const char *name, int ndim, const int64_t *dims,
                    size_t *bytes, char *err, size_t errlen) {
    const cb_tensor *t = cb_st_expect(idx, name, ndim, dims, err, errlen);
    if (!t) return -1;
    if (!t->supported) {
        snprintf(err, errlen, "%s: dtype %s where f32/bf16/f16 is expected", name, t->dtype_name);
        return -1;
    }
    size_t n = 1;
    for (int i = 0; i < ndim; i++) n *= (size_t)dims[i];
    return cb_load_f32(out, idx, t, n, bytes, err, errlen);
}

/* The hash-routing table [vocab, top_k] (I64 or I32 on disk), checked against the expert count. */
static int load_tid2eid(int32_t **out, const v4 *m, const char *name, char *err, size_t errlen) {
    const cb_tensor *t = cb_st_find(&m->idx, name);
    if (!t) {
        snprintf(err, errlen, "tensor %s not found (a hash-routed layer needs its token -> experts table)", name);
        return -1;
    }
    int wide = !strcmp(t->dtype_name, "I64");
    if ((!wide && strcmp(t->dtype_name, "I32")) || t->ndim != 2 || t->shape[0] != m->vocab ||
        t->shape[1] != m->top_k) {
        snprintf(err, errlen, "%s: expected I64/I32 [%d, %d], found %s with %d dims", name, m->vocab, m->top_k,
                 t->dtype_name, t->ndim);
        return -1;
    }
    void *raw = cb_st_load(&m->idx, t, err, errlen);
    if (!raw) return -1;
    size_t n = (size_t)m->vocab * (size_t)m->top_k;
    *out = malloc(n * sizeof(int32_t));
    if (!*out) {
        free(raw);
        snprintf(err, errlen, "out of memory loading %s", name);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        int64_t e = wide ? ((const int64_t *)raw)[i] : ((const int32_t *)raw)[i];
        if (e < 0 || e >= m->n_experts) {
            free(raw);
            snprintf(err, errlen, "%s: expert id %lld out of range [0, %d)", name, (long long)e, m->n_experts);
            return -1;
        }
        (*out)[i] = (int32_t)e;
    }
    free(raw);
    return 0;
}

static const cb_hp_spec HPARAMS[] = {
    CB_HP_REQ("hidden_size", v4, hidden), CB_HP_REQ("num_hidden_layers", v4, n_layers),
    CB_HP_REQ("num_attention_heads", v4, n_heads), CB_HP_REQ("vocab_size", v4, vocab),
    CB_HP_REQ("head_dim", v4, head_dim), CB_HP_REQ("q_lora_rank", v4, q_lora), CB_HP_REQ("o_groups", v4, o_groups),
    CB_HP_REQ("o_lora_rank", v4, o_lora), CB_HP_REQ("sliding_window", v4, window), CB_HP_REQ("csa_rate", v4, csa_rate),
    CB_HP_REQ("hca_rate", v4, hca_rate), CB_HP_REQ("index_n_heads", v4, ix_heads),
    CB_HP_REQ("index_head_dim", v4, ix_dim), CB_HP_REQ("index_topk", v4, ix_topk),
    CB_HP_REQ("moe_intermediate_size", v4, inter), CB_HP_REQ("n_routed_experts", v4, n_experts),
    CB_HP_REQ("num_experts_per_tok", v4, top_k), CB_HP_OPT("n_shared_experts", v4, n_shared, 1, CB_HP_NONNEG),
    CB_HP_NUM("routed_scaling_factor", v4, scaling, 1.5, CB_HP_ANY),
    CB_HP_NUM("swiglu_limit", v4, swiglu_limit, 10.0, CB_HP_ANY),
    CB_HP_NUM("rms_norm_eps", v4, eps, 1e-6, CB_HP_POSITIVE), CB_HP_FLAG("tie_word_embeddings", v4, tied, 0),
    CB_HP_REQ("hc_mult", v4, hc.hc), CB_HP_REQ("hc_sinkhorn_iters", v4, hc.sinkhorn_iters),
    {"hc_eps", CB_HP_FLOAT, offsetof(v4, hc.hc_eps), 0, CB_HP_ANY, NULL, 0},
    CB_HP_PER_LAYER("layer_kinds", v4, layer_kinds, "SHC", n_layers),   /* S sliding, H HCA, C CSA */
    CB_HP_PER_LAYER("mlp_layers", v4, mlp_layers, "HM", n_layers),      /* H hash-routed, M MoE */
    CB_HP_TEXT("main_rope_theta", v4, main_theta, "10000.0"),
    CB_HP_TEXT("partial_rotary_factor", v4, main_partial, "1.0"), CB_HP_END,
};

static int read_hparams(v4 *m, cb_hparams *hp, char *err, size_t errlen) {
    m->hc = (cb_hc_shape){4, 0, 20, 1e-6f, 1e-6f};
    if (cb_hp_read(hp, HPARAMS, m, err, errlen)) return -1;
    if (m->head_dim < 2 || m->n_heads % m->o_groups || m->ix_dim < 2 || m->top_k > m->n_experts) {
        snprintf(err, errlen, "--set hyperparameters out of range (head_dim and index_head_dim >= 2, o_groups "
                              "divides the heads, top_k <= experts)");
        return -1;
    }
    m->hc.hidden = m->hidden;
    m->hc.norm_eps = m->eps;
    return 0;
}

/* The sliding-window layers' RoPE: --set main_rope_theta, default type, the same rotated width. */
static int main_rope_init(cb_rope *r, const v4 *m, int head_dim, char *err, size_t errlen) {
    char *keys[2] = {"rope_theta", "partial_rotary_factor"};
    char *values[2] = {(char *)m->main_theta, (char *)m->main_partial};
    int used[2] = {0, 0};
    cb_hparams sub = {2, keys, values, used};
    return cb_rope_init(r, &sub, head_dim, 0, err, errlen);
}

static int load_layer(v4 *m, int l, char kind, char mlp, int cap, size_t *dense, char *err, size_t errlen) {
    v4_layer *L = &m->layers[l];
    int H = m->hidden, D = m->head_dim, Di = m->ix_dim, hc = m->hc.hc;
    char p[96], n[256];
    snprintf(p, sizeof p, "%s%d.", m->prefix, l);
    L->kind = kind;
    L->rate = kind == 'C' ? m->csa_rate : kind == 'H' ? m->hca_rate : 0;
#define NAME(...) (snprintf(n, sizeof n, __VA_ARGS__), n)
    if (cb_load_vector(&L->attn_norm, &m->idx, NAME("%sattn_norm.weight", p), H, dense, err, errlen) ||
        cb_load_vector(&L->ffn_norm, &m->idx, NAME("%sffn_norm.weight", p), H, dense, err, errlen) ||
        cb_load_vector(&L->q_norm, &m->idx, NAME("%sattn.q_norm.weight", p), m->q_lora, dense, err, errlen) ||
        cb_load_vector(&L->kv_norm, &m->idx, NAME("%sattn.norm.weight", p), D, dense, err, errlen) ||
        cb_load_vector(&L->sinks, &m->idx, NAME("%sattn.attn_sink", p), m->n_heads, dense, err, errlen) ||
        cb_load_linear(&L->wq_a, &m->idx, NAME("%sattn.wq_a.weight", p), m->q_lora, H, dense, err, errlen) ||
        cb_load_linear(&L->wq_b, &m->idx, NAME("%sattn.wq_b.weight", p), m->n_heads * D, m->q_lora, dense, err,
                       errlen) ||
        cb_load_linear(&L->wkv, &m->idx, NAME("%sattn.wkv.weight", p), D, H, dense, err, errlen) ||
        cb_load_linear(&L->wo_a, &m->idx, NAME("%sattn.wo_a.weight", p), m->o_groups * m->o_lora,
                       m->n_heads * D / m->o_groups, dense, err, errlen) ||
        cb_linear_dequantize(&L->wo_a, err, errlen) ||   /* read per group below, straight from its rows */
        cb_load_linear(&L->wo_b, &m->idx, NAME("%sattn.wo_b.weight", p), H, m->o_groups * m->o_lora, dense, err,
                       errlen))
        return -1;
    const char *blocks[2] = {"attn", "ffn"};
    for (int b = 0; b < 2; b++) {
        float **w = b ? L->hc_ffn : L->hc_attn;
        int64_t fn_dims[2] = {(2 + hc) * hc, (int64_t)hc * H}, base_dims[1] = {(2 + hc) * hc}, sc[1] = {3};
        if (load_f32(&w[0], &m->idx, NAME("%shc_%s_fn", p, blocks[b]), 2, fn_dims, dense, err, errlen) ||
            load_f32(&w[1], &m->idx, NAME("%shc_%s_base", p, blocks[b]), 1, base_dims, dense, err, errlen) ||
            load_f32(&w[2], &m->idx, NAME("%shc_%s_scale", p, blocks[b]), 1, sc, dense, err, errlen))
            return -1;
    }
    if (kind != 'S') {
        int cw = kind == 'C' ? 2 * D : D;
        int64_t ape[2] = {L->rate, cw};
        if (cb_load_linear(&L->c_wkv, &m->idx, NAME("%sattn.compressor.wkv.weight", p), cw, H, dense, err,
                           errlen) ||
            cb_load_linear(&L->c_wgate, &m->idx, NAME("%sattn.compressor.wgate.weight", p), cw, H, dense, err,
                           errlen) ||
            load_f32(&L->c_ape, &m->idx, NAME("%sattn.compressor.ape", p), 2, ape, dense, err, errlen) ||
            cb_load_vector(&L->c_norm, &m->idx, NAME("%sattn.compressor.norm.weight", p), D, dense, err, errlen))
            return -1;
    }
    if (kind == 'C') {
        int64_t ape[2] = {L->rate, 2 * Di};
        if (cb_load_linear(&L->i_wkv, &m->idx, NAME("%sattn.indexer.compressor.wkv.weight", p), 2 * Di, H, dense,
                           err, errlen) ||
            cb_load_linear(&L->i_wgate, &m->idx, NAME("%sattn.indexer.compressor.wgate.weight", p), 2 * Di, H,
                           dense, err, errlen) ||
            load_f32(&L->i_ape, &m->idx, NAME("%sattn.indexer.compressor.ape", p), 2, ape, dense, err, errlen) ||
            cb_load_vector(&L->i_norm, &m->idx, NAME("%sattn.indexer.compressor.norm.weight", p), Di, dense, err,
                           errlen) ||
            cb_load_linear(&L->i_wq_b, &m->idx, NAME("%sattn.indexer.wq_b.weight", p), m->ix_heads * Di,
                           m->q_lora, dense, err, errlen) ||
            cb_load_linear(&L->i_wproj, &m->idx, NAME("%sattn.indexer.weights_proj.weight", p), m->ix_heads, H,
                           dense, err, errlen))
            return -1;
    }
    /* MoE: the store formats take (layer, expert); w1 = gate, w3 = up, w2 = down. */
    char fmts[3][160];
    static const char *const mats[3] = {"w1", "w3", "w2"};
    for (int i = 0; i < 3; i++)
        snprintf(fmts[i], sizeof fmts[i], "%s%%d.ffn.experts.%%d.%s.weight", m->prefix, mats[i]);
    const char *const expert_names[3] = {fmts[0], fmts[1], fmts[2]};
    if (cb_moe_init(&L->moe, &m->idx, l, NAME("%sffn.gate.weight", p), expert_names, m->n_experts, m->top_k, 1, H,
                    m->inter, cap, m->max_batch, dense, err, errlen))
        return -1;
    L->moe.swiglu_limit = m->swiglu_limit;
    m->expert_layers[m->n_expert_layers++] = &L->moe.store;
    L->is_hash = mlp == 'H';
    if (L->is_hash ? load_tid2eid(&L->tid2eid, m, NAME("%sffn.gate.tid2eid", p), err, errlen)
                   : cb_load_vector(&L->bias, &m->idx, NAME("%sffn.gate.bias", p), m->n_experts, dense, err, errlen))
        return -1;
    if (m->n_shared > 0) {
        int I = m->n_shared * m->inter;
        if (cb_load_linear(&L->sh_gate, &m->idx, NAME("%sffn.shared_experts.w1.weight", p), I, H, dense, err,
                           errlen) ||
            cb_load_linear(&L->sh_up, &m->idx, NAME("%sffn.shared_experts.w3.weight", p), I, H, dense, err,
                           errlen) ||
            cb_load_linear(&L->sh_down, &m->idx, NAME("%sffn.shared_experts.w2.weight", p), H, I, dense, err,
                           errlen))
            return -1;
        L->has_shared = 1;
    }
#undef NAME
    return 0;
}

static int alloc_all(v4 *m) {
    size_t B = (size_t)m->max_batch, H = (size_t)m->hidden, hc = (size_t)m->hc.hc, D = (size_t)m->head_dim;
    size_t NH = (size_t)m->n_heads, Di = (size_t)m->ix_dim, ctx = (size_t)m->ctx;
    size_t I = (size_t)(m->n_shared > 0 ? m->n_shared : 1) * (size_t)m->inter;
    size_t slots = 2 * (size_t)(m->csa_rate > m->hca_rate ? m->csa_rate : m->hca_rate);
    struct { float **p; size_t n; } want[] = {
        {&m->X, B * hc * H}, {&m->c, B * H}, {&m->h, B * H}, {&m->y, B * H}, {&m->pre, B * hc},
        {&m->post, B * hc}, {&m->comb, B * hc * hc}, {&m->hc_scratch, (size_t)cb_hc_scratch_floats(&m->hc)},
        {&m->hc_tmp, hc * H}, {&m->qa, B * (size_t)m->q_lora}, {&m->q, B * NH * D}, {&m->kvp, B * D},
        {&m->ckv, B * 2 * D}, {&m->cg, B * 2 * D}, {&m->ikv, B * 2 * Di}, {&m->ig, B * 2 * Di},
        {&m->o, B * NH * D}, {&m->ga, B * (size_t)m->o_groups * (size_t)m->o_lora},
        {&m->iq, (size_t)m->ix_heads * Di}, {&m->iw, B * (size_t)m->ix_heads}, {&m->entry, 2 * D + Di},
        {&m->scores, 2 * ctx + 1}, {&m->ix_scores, ctx + 1}, {&m->sh_g, B * I}, {&m->sh_u, B * I},
        {&m->sh_o, B * H}, {&m->route_scores, (size_t)m->n_experts},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        if (!(*want[i].p = malloc(want[i].n * sizeof(float)))) return -1;
    m->rows = malloc((2 * ctx + 1) * sizeof *m->rows);   /* a window of keys + compressed entries */
    m->taken = malloc(ctx + 1);
    m->slot_kv = malloc(slots * sizeof *m->slot_kv);
    m->slot_g = malloc(slots * sizeof *m->slot_g);
    m->picked = malloc((ctx + 1) * sizeof *m->picked);
    return m->rows && m->slot_kv && m->slot_g && m->picked && m->taken ? 0 : -1;
}

static int v4_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    v4 *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    m->max_batch = a->max_batch;
    m->ctx = a->ctx;
    if (read_hparams(m, a->hp, err, errlen)) goto fail;
    const char *kinds = m->layer_kinds, *mlps = m->mlp_layers;
    if (main_rope_init(&m->main_rope, m, m->head_dim, err, errlen) ||
        cb_rope_init(&m->comp_rope, a->hp, m->head_dim, 0, err, errlen))
        goto fail;
    if (m->comp_rope.rot_dim > m->ix_dim || m->main_rope.rot_dim != m->comp_rope.rot_dim) {
        snprintf(err, errlen, "--set partial_rotary_factor: the rotated width %d must fit index_head_dim %d",
                 m->comp_rope.rot_dim, m->ix_dim);
        goto fail;
    }
    if (cb_st_open(&m->idx, a->model_dir, err, errlen)) goto fail;
    int hf = cb_st_find(&m->idx, "model.embed_tokens.weight") != NULL;   /* transformers' save, else DeepSeek's */
    snprintf(m->prefix, sizeof m->prefix, "%s", hf ? "model.layers." : "layers.");
    size_t dense = 0;
    int hc = m->hc.hc, H = m->hidden;
    int64_t head_fn[2] = {hc, (int64_t)hc * H}, head_base[1] = {hc}, head_scale[1] = {1};
    if (cb_load_linear(&m->embed, &m->idx, hf ? "model.embed_tokens.weight" : "embed.weight", m->vocab, H, &dense,
                       err, errlen) ||
        cb_load_vector(&m->final_norm, &m->idx, hf ? "model.norm.weight" : "norm.weight", H, &dense, err, errlen) ||
        load_f32(&m->hc_head[0], &m->idx, hf ? "model.hc_head.hc_fn" : "hc_head_fn", 2, head_fn, &dense, err,
                 errlen) ||
        load_f32(&m->hc_head[1], &m->idx, hf ? "model.hc_head.hc_base" : "hc_head_base", 1, head_base, &dense, err,
                 errlen) ||
        load_f32(&m->hc_head[2], &m->idx, hf ? "model.hc_head.hc_scale" : "hc_head_scale", 1, head_scale, &dense,
                 err, errlen))
        goto fail;
    if (m->tied) m->head = m->embed;
    else if (cb_load_linear(&m->head, &m->idx, "head.weight", m->vocab, H, &dense, err, errlen)) goto fail;
    m->layers = calloc((size_t)m->n_layers, sizeof *m->layers);
    m->expert_layers = calloc((size_t)m->n_layers, sizeof *m->expert_layers);
    if (!m->layers || !m->expert_layers) goto oom;
    size_t cache = 0;
    int D = m->head_dim, Di = m->ix_dim, widest = D;
    for (int l = 0; l < m->n_layers; l++) {
        if (load_layer(m, l, kinds[l], mlps[l], a->cap, &dense, err, errlen)) goto fail;
        cache += cb_experts_cache_bytes(&m->layers[l].moe.store);
        int w = kinds[l] == 'C' ? 6 * D + 5 * Di : kinds[l] == 'H' ? 4 * D : D;
        if (w > widest) widest = w;
    }
    m->kv_dim = widest;
    m->off_cmp = D;
    m->off_rkv = 2 * D;
    if (alloc_all(m)) goto oom;
    info->vocab = m->vocab;
    info->n_layers = m->n_layers;
    info->kv_dim = m->kv_dim;
    info->kv_k_only = 1;
    info->dense_bytes = dense;
    info->expert_cache_bytes = cache + cb_experts_staging_bytes();
    info->n_expert_layers = m->n_expert_layers;
    info->expert_layers = m->expert_layers;
    *out = m;
    return 0;
oom:
    snprintf(err, errlen, "out of memory for the model or its activations");
fail:
    v4_free(m);
    return -1;
}

/* Row offsets of a layer: compressor raw value / gate (cw wide each), then the indexer's entry, raw value, gate. */
typedef struct { int cw, rkv, rg, icmp, ikv, ig; } v4_row;

static v4_row row_of(const v4 *m, const v4_layer *L) {
    v4_row r;
    int D = m->head_dim, Di = m->ix_dim;
    r.cw = L->kind == 'C' ? 2 * D : D;
    r.rkv = m->off_rkv;
    r.rg = r.rkv + r.cw;
    r.icmp = r.rg + r.cw;
    r.ikv = r.icmp + Di;
    r.ig = r.ikv + 2 * Di;
    return r;
}

/* Rotate the trailing rot_dim channels of n_heads heads of width dim (V4 lays each head out [nope | rope]). */
static void rope_tail(const cb_rope *r, float *x, int n_heads, int dim, int pos) {
    cb_rope_apply(r, x + (dim - r->rot_dim), n_heads, dim, pos);
}

/* The compressed entry of window w (kind H: rate slots; C: the previous window's first halves, then this
 * window's second halves), normalised and rotated to the window's first position, into `entry`. */
static void compress(const v4 *m, const cb_kv *kv, int layer, int w, int rate, int overlap, int off_kv, int off_g,
                     int dim, const float *norm, float *entry) {
    int slot = 0;
    if (overlap)
        for (int j = 0; j < rate; j++, slot++) {
            int p = (w - 1) * rate + j;
            m->slot_kv[slot] = w > 0 ? cb_kv_k(kv, layer, p) + off_kv : NULL;
            m->slot_g[slot] = w > 0 ? cb_kv_k(kv, layer, p) + off_g : NULL;
        }
    for (int j = 0; j < rate; j++, slot++) {
        int p = w * rate + j;
        m->slot_kv[slot] = cb_kv_k(kv, layer, p) + off_kv + (overlap ? dim : 0);
        m->slot_g[slot] = cb_kv_k(kv, layer, p) + off_g + (overlap ? dim : 0);
    }
    cb_compress_window(entry, m->slot_kv, m->slot_g, slot, dim);
    cb_rmsnorm(entry, entry, norm, dim, m->eps);
    rope_tail(&m->comp_rope, entry, 1, dim, w * rate);
}

/* The lightning indexer of one query row at position t: the chosen compressed entries (ascending), how many. */
static int index_select(v4 *m, const v4_layer *L, const cb_kv *kv, int layer, const v4_row *r, const float *q_resid,
                        const float *h, int t) {
    int rate = L->rate, T = (t + 1) / rate, nh = m->ix_heads, Di = m->ix_dim;
    if (T <= m->ix_topk) {
        for (int w = 0; w < T; w++) m->picked[w] = w;
        return T;
    }
    cb_linear_apply(&L->i_wq_b, m->iq, q_resid, 1);
    rope_tail(&m->comp_rope, m->iq, nh, Di, t);
    float *wts = m->iw;
    cb_linear_apply(&L->i_wproj, wts, h, 1);
    float head_scale = 1.0f / sqrtf((float)nh), softmax_scale = 1.0f / sqrtf((float)Di);
    for (int w = 0; w < T; w++) {
        const float *key = cb_kv_k(kv, layer, w * rate + rate - 1) + r->icmp;
        float s = 0;
        for (int hh = 0; hh < nh; hh++) {
            float d = cb_dot(key, CB_F32, m->iq + (size_t)hh * Di, Di);
            s += (d > 0 ? d : 0) * softmax_scale * (wts[hh] * head_scale);
        }
        m->ix_scores[w] = s;
    }
    /* top-k by score (ties: lowest index), then ascending, the order attention visits them in */
    unsigned char *taken = m->taken;
    memset(taken, 0, (size_t)T);
    for (int k = 0; k < m->ix_topk; k++) {
        int best = -1;
        for (int w = 0; w < T; w++)
            if (!taken[w] && (best < 0 || m->ix_scores[w] > m->ix_scores[best])) best = w;
        taken[best] = 1;
    }
    int n = 0;
    for (int w = 0; w < T; w++)
        if (taken[w]) m->picked[n++] = w;
    return n;
}

static void attention(v4 *m, v4_layer *L, int layer, cb_kv *kv, const float *h, int n, int pos0, float *out) {
    int D = m->head_dim, NH = m->n_heads, Di = m->ix_dim, G = m->o_groups, R = m->o_lora;
    const cb_rope *rope = L->kind == 'S' ? &m->main_rope : &m->comp_rope;
    v4_row r = row_of(m, L);
    cb_linear_apply(&L->wq_a, m->qa, h, n);
    for (int i = 0; i < n; i++) cb_rmsnorm(m->qa + (size_t)i * m->q_lora, m->qa + (size_t)i * m->q_lora, L->q_norm,
                                           m->q_lora, m->eps);
    cb_linear_apply(&L->wq_b, m->q, m->qa, n);
    cb_linear_apply(&L->wkv, m->kvp, h, n);
    if (L->kind != 'S') {
        cb_linear_apply(&L->c_wkv, m->ckv, h, n);
        cb_linear_apply(&L->c_wgate, m->cg, h, n);
    }
    if (L->kind == 'C') {
        cb_linear_apply(&L->i_wkv, m->ikv, h, n);
        cb_linear_apply(&L->i_wgate, m->ig, h, n);
    }
    /* Store every row of the call first: keys, raw compressor rows (gate + position bias). */
    for (int i = 0; i < n; i++) {
        int t = pos0 + i;
        float *q = m->q + (size_t)i * NH * D, *row = cb_kv_k(kv, layer, t);
        for (int hh = 0; hh < NH; hh++) cb_rmsnorm(q + (size_t)hh * D, q + (size_t)hh * D, NULL, D, m->eps);
        rope_tail(rope, q, NH, D, t);
        cb_rmsnorm(row, m->kvp + (size_t)i * D, L->kv_norm, D, m->eps);
        rope_tail(rope, row, 1, D, t);
        if (L->kind == 'S') continue;
        const float *ape = L->c_ape + (size_t)(t % L->rate) * r.cw;
        for (int c = 0; c < r.cw; c++) {
            row[r.rkv + c] = m->ckv[(size_t)i * r.cw + c];
            row[r.rg + c] = m->cg[(size_t)i * r.cw + c] + ape[c];
        }
        if (L->kind != 'C') continue;
        const float *iape = L->i_ape + (size_t)(t % L->rate) * 2 * Di;
        for (int c = 0; c < 2 * Di; c++) {
            row[r.ikv + c] = m->ikv[(size_t)i * 2 * Di + c];
            row[r.ig + c] = m->ig[(size_t)i * 2 * Di + c] + iape[c];
        }
    }
    /* Then the compressed entries of the windows this call closes. */
    if (L->kind != 'S')
        for (int i = 0; i < n; i++) {
            int t = pos0 + i;
            if ((t + 1) % L->rate) continue;
            int w = (t + 1) / L->rate - 1, overlap = L->kind == 'C';
            float *row = cb_kv_k(kv, layer, t);
            compress(m, kv, layer, w, L->rate, overlap, r.rkv, r.rg, D, L->c_norm, m->entry);
            memcpy(row + m->off_cmp, m->entry, (size_t)D * sizeof(float));
            if (overlap) {
                compress(m, kv, layer, w, L->rate, 1, r.ikv, r.ig, Di, L->i_norm, m->entry);
                memcpy(row + r.icmp, m->entry, (size_t)Di * sizeof(float));
            }
        }
    /* Attend: the sliding window of keys, then the compressed entries this row may see. */
    float scale = 1.0f / sqrtf((float)D);
    for (int i = 0; i < n; i++) {
        int t = pos0 + i, nrows = 0;
        for (int p = t - m->window + 1 < 0 ? 0 : t - m->window + 1; p <= t; p++) m->rows[nrows++] = cb_kv_k(kv, layer, p);
        int n_entries = 0;
        if (L->kind == 'H') {
            n_entries = (t + 1) / L->rate;
            for (int w = 0; w < n_entries; w++) m->picked[w] = w;
        } else if (L->kind == 'C') {
            n_entries = index_select(m, L, kv, layer, &r, m->qa + (size_t)i * m->q_lora, h + (size_t)i * m->hidden,
                                     t);
        }
        for (int k = 0; k < n_entries; k++)
            m->rows[nrows++] = cb_kv_k(kv, layer, m->picked[k] * L->rate + L->rate - 1) + m->off_cmp;
        float *o = m->o + (size_t)i * NH * D;
        cb_sink_attend(o, m->q + (size_t)i * NH * D, NH, D, m->rows, nrows, L->sinks, scale, m->scores);
        rope_tail(rope, o, NH, D, -t);   /* values carry their keys' rotation: undo it at the query position */
        /* Grouped low-rank output: group g of heads through rows [g R, (g + 1) R) of wo_a. */
        int gin = NH * D / G;
        for (int g = 0; g < G; g++)
            cb_matvec(m->ga + (size_t)i * G * R + (size_t)g * R,
                      (const char *)L->wo_a.m.f.w + (size_t)g * R * gin * cb_dtype_size(L->wo_a.m.f.dt), L->wo_a.m.f.dt,
                      o + (size_t)g * gin, R, gin);
    }
    cb_linear_apply(&L->wo_b, out, m->ga, n);
}

static int moe(v4 *m, v4_layer *L, const int *tokens, const float *h, int n, float *out, char *err, size_t errlen) {
    cb_moe *moe = &L->moe;
    int E = m->n_experts, K = m->top_k;
    cb_linear_apply(&moe->router, moe->logits, h, n);
    for (int i = 0; i < n; i++) {
        const float *logits = moe->logits + (size_t)i * E;
        int *idx = moe->chosen + (size_t)i * K;
        float *w = moe->weight + (size_t)i * K;
        if (L->is_hash) {
            if (tokens[i] < 0 || tokens[i] >= m->vocab) {
                snprintf(err, errlen, "token %d outside the vocabulary (%d)", tokens[i], m->vocab);
                return -1;
            }
            cb_hash_route(logits, L->tid2eid + (size_t)tokens[i] * K, K, m->scaling, idx, w);
        } else {
            cb_sqrtsoftplus_route(logits, L->bias, E, K, m->scaling, idx, w, m->route_scores);
        }
    }
    if (cb_moe_experts_forward(moe, out, h, n, err, errlen)) return -1;
    if (L->has_shared) {
        size_t I = (size_t)m->n_shared * (size_t)m->inter;
        cb_linear_apply(&L->sh_gate, m->sh_g, h, n);
        cb_linear_apply(&L->sh_up, m->sh_u, h, n);
        cb_swiglu_clamp(m->sh_g, m->sh_u, (size_t)n * I, m->swiglu_limit);
        cb_silu_mul(m->sh_g, m->sh_u, (int)((size_t)n * I));
        cb_linear_apply(&L->sh_down, m->sh_o, m->sh_g, n);
        cb_add(out, m->sh_o, (size_t)n * (size_t)m->hidden);
    }
    return 0;
}

/* Per row: the hyper-connection weights of a block, and the normed collapsed input into h. */
static void hc_enter(v4 *m, float *const w[3], const float *norm, int n) {
    int hc = m->hc.hc, H = m->hidden;
    for (int i = 0; i < n; i++) {
        float *X = m->X + (size_t)i * hc * H, *pre = m->pre + (size_t)i * hc;
        cb_hc_weights(&m->hc, w[0], w[1], w[2], X, pre, m->post + (size_t)i * hc, m->comb + (size_t)i * hc * hc,
                      m->hc_scratch);
        cb_hc_collapse(m->c + (size_t)i * H, X, pre, hc, H);
        cb_rmsnorm(m->h + (size_t)i * H, m->c + (size_t)i * H, norm, H, m->eps);
    }
}

static void hc_leave(v4 *m, int n) {
    int hc = m->hc.hc, H = m->hidden;
    for (int i = 0; i < n; i++)
        cb_hc_expand(m->X + (size_t)i * hc * H, m->y + (size_t)i * H, m->post + (size_t)i * hc,
                     m->comb + (size_t)i * hc * hc, hc, H, m->hc_tmp);
}

static int v4_forward(void *ptr, cb_kv *kv, const int *tokens, int n, int pos0, float *logits, int all_logits,
                      char *err, size_t errlen) {
    v4 *m = ptr;
    int H = m->hidden, hc = m->hc.hc;
    for (int i = 0; i < n; i++) {
        float *X = m->X + (size_t)i * hc * H;
        cb_embed(X, &m->embed, tokens[i]);
        for (int k = 1; k < hc; k++) memcpy(X + (size_t)k * H, X, (size_t)H * sizeof(float));
    }
    for (int l = 0; l < m->n_layers; l++) {
        v4_layer *L = &m->layers[l];
        hc_enter(m, L->hc_attn, L->attn_norm, n);
        attention(m, L, l, kv, m->h, n, pos0, m->y);
        hc_leave(m, n);
        hc_enter(m, L->hc_ffn, L->ffn_norm, n);
        if (moe(m, L, tokens, m->h, n, m->y, err, errlen)) return -1;
        hc_leave(m, n);
    }
    int first = all_logits ? 0 : n - 1, rows = n - first;
    for (int i = first; i < n; i++) {
        const float *X = m->X + (size_t)i * hc * H;
        float *out = m->h + (size_t)(i - first) * H;
        cb_hc_head_weights(&m->hc, m->hc_head[0], m->hc_head[1], m->hc_head[2], X, m->pre, m->hc_scratch);
        cb_hc_collapse(out, X, m->pre, hc, H);
        cb_rmsnorm(out, out, m->final_norm, H, m->eps);
    }
    cb_linear_apply(&m->head, logits, m->h, rows);
    return 0;
}

static const cb_family v4_family = {"deepseek-v4", v4_load, v4_forward, v4_free};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &v4_family); }
