/* qwen.c: the Qwen MoE engines (qwen2_moe, qwen3_moe, qwen3_next, qwen3_5_moe[_text]), composed from the shared
 * runtime's blocks. Every layer is
 *
 *   x += mixer(norm(x))      mixer: GQA attention (gqa.h), or Gated DeltaNet (deltanet.h) on hybrid layers
 *   x += ffn(norm(x))        ffn: routed MoE (+ sigmoid-gated shared expert), or a dense MLP (mlp_only_layers)
 *
 * What differs between the four types is switched by hyperparameters the plugin resolves: qkv biases (qwen2_moe),
 * per-head q/k norm (qwen3+), zero-centred "1 + w" RMSNorms and the attention output gate (the hybrids), and the
 * linear-attention projection layout (qwen3_next fuses q/k/v/z and b/a per key-head group; qwen3_5 splits them).
 * Only full-attention layers hold KV; each DeltaNet layer keeps its state in the slot's recurrent state.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "deltanet.h"
#include "engine.h"
#include "gqa.h"
#include "mlp.h"

#define NAME_MAX_LEN 320

typedef struct {
    int full, moe;
    float *attn_norm, *ffn_norm;
    cb_gqa attn;               /* full layers */
    int kv_layer;
    cb_deltanet dn;            /* linear layers */
    cb_linear in_qkvz, in_ba;  /* qwen3_next layout */
    cb_linear in_qkv, in_z, in_b, in_a;   /* qwen3_5 layout */
    cb_linear out_proj;
    size_t state_off;          /* floats into the slot state */
    cb_moe moe_block;
    cb_mlp shared, dense;
} qwen_layer;

typedef struct {
    int hidden, n_layers, vocab, n_experts, top_k, expert_inter, dense_inter, shared_inter, norm_topk_prob;
    int tied, sparse_step, norm_offset, fused_linear, max_batch, n_full, n_moe;
    float eps;
    char prefix[64];
    cb_gqa_config attn_cfg;
    cb_deltanet_config dn_cfg;
    cb_st_index idx;
    cb_linear embed, lm_head;
    float *final_norm;
    qwen_layer *layers;
    cb_expert_layer **expert_layers;
    cb_rope rope;
    cb_gqa_scratch attn_scratch;
    float *x, *h, *proj, *tmp, *lx, *lz, *lb, *la, *lo, *qkvz, *ba;
} qwen;

static void qwen_free(void *ptr) {
    qwen *m = ptr;
    if (!m) return;
    if (m->layers)
        for (int l = 0; l < m->n_layers; l++) {
            qwen_layer *L = &m->layers[l];
            free(L->attn_norm); free(L->ffn_norm);
            cb_gqa_free(&L->attn); cb_deltanet_free(&L->dn);
            cb_linear_free(&L->in_qkvz); cb_linear_free(&L->in_ba); cb_linear_free(&L->in_qkv);
            cb_linear_free(&L->in_z); cb_linear_free(&L->in_b); cb_linear_free(&L->in_a);
            cb_linear_free(&L->out_proj);
            if (L->moe) cb_moe_free(&L->moe_block);
            cb_mlp_free(&L->shared); cb_mlp_free(&L->dense);
        }
    free(m->layers);
    free(m->expert_layers);
    cb_linear_free(&m->embed);
    if (!m->tied) cb_linear_free(&m->lm_head);
    free(m->final_norm);
    cb_rope_free(&m->rope);
    cb_gqa_scratch_free(&m->attn_scratch);
    float *bufs[] = {m->x, m->h, m->proj, m->tmp, m->lx, m->lz, m->lb, m->la, m->lo, m->qkvz, m->ba};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    cb_st_close(&m->idx);
    free(m);
}

/* Parse a comma-separated per-layer list: full/linear attention kinds, or the mlp_only layer indices. */
static int parse_layer_types(qwen *m, const char *s, char *err, size_t errlen) {
    for (int l = 0; l < m->n_layers; l++) {
        const char *end = strchr(s, ',');
        size_t len = end ? (size_t)(end - s) : strlen(s);
        if (len == 14 && !strncmp(s, "full_attention", len)) m->layers[l].full = 1;
        else if (!(len == 16 && !strncmp(s, "linear_attention", len))) {
            snprintf(err, errlen, "--set layer_types: entry %d must be full_attention or linear_attention", l);
            return -1;
        }
        if (!end && l + 1 < m->n_layers) {
            snprintf(err, errlen, "--set layer_types: %d entries for %d layers", l + 1, m->n_layers);
            return -1;
        }
        s = end ? end + 1 : s + len;
    }
    return 0;
}

static int parse_mlp_only(qwen *m, const char *s, char *err, size_t errlen) {
    for (int l = 0; l < m->n_layers; l++) m->layers[l].moe = m->n_experts > 0 && (l + 1) % m->sparse_step == 0;
    while (*s) {
        char *end;
        long l = strtol(s, &end, 10);
        if (end == s || l < 0 || l >= m->n_layers || (*end && *end != ',')) {
            snprintf(err, errlen, "--set mlp_only_layers: expected comma-separated layer indices below %d",
                     m->n_layers);
            return -1;
        }
        m->layers[l].moe = 0;
        s = *end ? end + 1 : end;
    }
    return 0;
}

static int read_hparams(qwen *m, cb_hparams *hp, char *err, size_t errlen) {
    cb_gqa_config *a = &m->attn_cfg;
    cb_deltanet_config *d = &m->dn_cfg;
    m->eps = 1e-6f;
    m->sparse_step = 1;
    a->head_dim = 0;
    d->kernel = 4;
    if (cb_hp_int(hp, "hidden_size", &m->hidden, err, errlen) ||
        cb_hp_int(hp, "num_hidden_layers", &m->n_layers, err, errlen) ||
        cb_hp_int(hp, "num_attention_heads", &a->n_heads, err, errlen) ||
        cb_hp_int(hp, "num_key_value_heads", &a->n_kv_heads, err, errlen) ||
        cb_hp_int(hp, "vocab_size", &m->vocab, err, errlen) ||
        cb_hp_int(hp, "num_experts", &m->n_experts, err, errlen) ||
        cb_hp_int(hp, "num_experts_per_tok", &m->top_k, err, errlen) ||
        cb_hp_int(hp, "moe_intermediate_size", &m->expert_inter, err, errlen) ||
        cb_hp_int_opt(hp, "intermediate_size", &m->dense_inter, err, errlen) ||
        cb_hp_int_opt(hp, "shared_expert_intermediate_size", &m->shared_inter, err, errlen) ||
        cb_hp_int_opt(hp, "head_dim", &a->head_dim, err, errlen) ||
        cb_hp_int_opt(hp, "decoder_sparse_step", &m->sparse_step, err, errlen) ||
        cb_hp_float_opt(hp, "rms_norm_eps", &m->eps, err, errlen) ||
        cb_hp_bool_opt(hp, "norm_topk_prob", &m->norm_topk_prob, err, errlen) ||
        cb_hp_bool_opt(hp, "tie_word_embeddings", &m->tied, err, errlen) ||
        cb_hp_bool_opt(hp, "qkv_bias", &a->qkv_bias, err, errlen) ||
        cb_hp_bool_opt(hp, "attention_bias", &a->o_bias, err, errlen) ||
        cb_hp_bool_opt(hp, "qk_norm", &a->head_norm, err, errlen) ||
        cb_hp_bool_opt(hp, "zero_centered_norm", &m->norm_offset, err, errlen) ||
        cb_hp_bool_opt(hp, "attn_output_gate", &a->output_gate, err, errlen))
        return -1;
    /* attention_bias biases all four projections (Qwen3); qkv_bias only q/k/v (Qwen2). */
    a->qkv_bias |= a->o_bias;
    if (m->hidden < 1 || m->n_layers < 1 || a->n_heads < 1 || a->n_kv_heads < 1 || m->vocab < 1 ||
        m->n_experts < 1 || m->expert_inter < 1 || m->sparse_step < 1 || a->n_heads % a->n_kv_heads ||
        m->dense_inter < 0 || m->shared_inter < 0 || m->eps <= 0) {
        snprintf(err, errlen, "--set hyperparameters out of range (positive sizes, num_attention_heads a multiple "
                              "of num_key_value_heads)");
        return -1;
    }
    if (!a->head_dim) a->head_dim = m->hidden / a->n_heads;
    a->hidden = m->hidden;
    a->eps = m->eps;
    a->norm_offset = m->norm_offset;
    const char *prefix = cb_hp_str_opt(hp, "weight_prefix", "model.");
    if (strlen(prefix) >= sizeof m->prefix || strchr(prefix, '%')) {
        snprintf(err, errlen, "--set weight_prefix=%s: too long or contains %%", prefix);
        return -1;
    }
    strcpy(m->prefix, prefix);
    m->layers = calloc((size_t)m->n_layers, sizeof *m->layers);
    if (!m->layers) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    const char *types = cb_hp_str_opt(hp, "layer_types", NULL);
    if (types) {
        if (parse_layer_types(m, types, err, errlen)) return -1;
    } else {
        for (int l = 0; l < m->n_layers; l++) m->layers[l].full = 1;
    }
    if (parse_mlp_only(m, cb_hp_str_opt(hp, "mlp_only_layers", ""), err, errlen)) return -1;
    int any_linear = 0, any_dense = 0;
    for (int l = 0; l < m->n_layers; l++) {
        any_linear |= !m->layers[l].full;
        any_dense |= !m->layers[l].moe;
    }
    if (any_dense && m->dense_inter < 1) {
        snprintf(err, errlen, "--set intermediate_size is required: the model has dense (non-MoE) layers");
        return -1;
    }
    if (any_linear) {
        const char *layout = cb_hp_str_opt(hp, "linear_projection", "fused");
        m->fused_linear = !strcmp(layout, "fused");
        if (!m->fused_linear && strcmp(layout, "split")) {
            snprintf(err, errlen, "--set linear_projection=%s: use fused (qwen3_next) or split (qwen3_5)", layout);
            return -1;
        }
        if (cb_hp_int(hp, "linear_num_key_heads", &d->n_k_heads, err, errlen) ||
            cb_hp_int(hp, "linear_num_value_heads", &d->n_v_heads, err, errlen) ||
            cb_hp_int(hp, "linear_key_head_dim", &d->k_dim, err, errlen) ||
            cb_hp_int(hp, "linear_value_head_dim", &d->v_dim, err, errlen) ||
            cb_hp_int_opt(hp, "linear_conv_kernel_dim", &d->kernel, err, errlen))
            return -1;
        d->eps = m->eps;
    }
    return 0;
}

static int load_linear_mixer(qwen *m, qwen_layer *L, const char p[128], size_t *dense, char *err, size_t errlen) {
    const cb_deltanet_config *d = &m->dn_cfg;
    int kd = d->n_k_heads * d->k_dim, vd = d->n_v_heads * d->v_dim, H = m->hidden;
    char name[NAME_MAX_LEN];
#define NAME(leaf) (snprintf(name, sizeof name, "%slinear_attn.%s", p, leaf), name)
    if (m->fused_linear) {
        if (cb_load_linear(&L->in_qkvz, &m->idx, NAME("in_proj_qkvz.weight"), 2 * kd + 2 * vd, H, dense, err,
                           errlen) ||
            cb_load_linear(&L->in_ba, &m->idx, NAME("in_proj_ba.weight"), 2 * d->n_v_heads, H, dense, err, errlen))
            return -1;
    } else if (cb_load_linear(&L->in_qkv, &m->idx, NAME("in_proj_qkv.weight"), 2 * kd + vd, H, dense, err, errlen) ||
               cb_load_linear(&L->in_z, &m->idx, NAME("in_proj_z.weight"), vd, H, dense, err, errlen) ||
               cb_load_linear(&L->in_b, &m->idx, NAME("in_proj_b.weight"), d->n_v_heads, H, dense, err, errlen) ||
               cb_load_linear(&L->in_a, &m->idx, NAME("in_proj_a.weight"), d->n_v_heads, H, dense, err, errlen)) {
        return -1;
    }
    if (cb_load_linear(&L->out_proj, &m->idx, NAME("out_proj.weight"), H, vd, dense, err, errlen)) return -1;
#undef NAME
    snprintf(name, sizeof name, "%slinear_attn.", p);
    return cb_deltanet_init(&L->dn, &m->idx, name, d, dense, err, errlen);
}

static int load_ffn(qwen *m, qwen_layer *L, int l, const char p[128], int cap, size_t *dense, char *err, size_t errlen) {
    char name[NAME_MAX_LEN], gate[NAME_MAX_LEN], fmt[3][NAME_MAX_LEN];
    snprintf(name, sizeof name, "%smlp.", p);
    if (!L->moe) return cb_mlp_init(&L->dense, &m->idx, name, NULL, m->hidden, m->dense_inter, m->max_batch, dense,
                                    err, errlen);
    static const char *const mats[3] = {"gate", "up", "down"};
    for (int i = 0; i < 3; i++)
        snprintf(fmt[i], sizeof fmt[i], "%slayers.%%d.mlp.experts.%%d.%s_proj.weight", m->prefix, mats[i]);
    const char *const names[3] = {fmt[0], fmt[1], fmt[2]};
    snprintf(gate, sizeof gate, "%smlp.gate.weight", p);
    if (cb_moe_init(&L->moe_block, &m->idx, l, gate, names, m->n_experts, m->top_k, m->norm_topk_prob, m->hidden,
                    m->expert_inter, cap, m->max_batch, dense, err, errlen))
        return -1;
    if (!m->shared_inter) return 0;
    snprintf(name, sizeof name, "%smlp.shared_expert.", p);
    snprintf(gate, sizeof gate, "%smlp.shared_expert_gate.weight", p);
    return cb_mlp_init(&L->shared, &m->idx, name, gate, m->hidden, m->shared_inter, m->max_batch, dense, err, errlen);
}

static int load_layer(qwen *m, int l, int cap, size_t *state, size_t *dense, char *err, size_t errlen) {
    qwen_layer *L = &m->layers[l];
    char p[128], name[NAME_MAX_LEN];
    snprintf(p, sizeof p, "%slayers.%d.", m->prefix, l);
    snprintf(name, sizeof name, "%sinput_layernorm.weight", p);
    if (cb_load_vector(&L->attn_norm, &m->idx, name, m->hidden, dense, err, errlen)) return -1;
    snprintf(name, sizeof name, "%spost_attention_layernorm.weight", p);
    if (cb_load_vector(&L->ffn_norm, &m->idx, name, m->hidden, dense, err, errlen)) return -1;
    if (m->norm_offset)
        for (int i = 0; i < m->hidden; i++) {
            L->attn_norm[i] += 1.0f;
            L->ffn_norm[i] += 1.0f;
        }
    if (L->full) {
        L->kv_layer = m->n_full++;
        snprintf(name, sizeof name, "%sself_attn.", p);
        if (cb_gqa_init(&L->attn, &m->idx, name, &m->attn_cfg, dense, err, errlen)) return -1;
    } else {
        if (load_linear_mixer(m, L, p, dense, err, errlen)) return -1;
        L->state_off = *state;
        *state += cb_deltanet_state_floats(&m->dn_cfg);
    }
    if (load_ffn(m, L, l, p, cap, dense, err, errlen)) return -1;
    if (L->moe) m->expert_layers[m->n_moe++] = &L->moe_block.store;
    return 0;
}

static int alloc_activations(qwen *m, int ctx, char *err, size_t errlen) {
    size_t B = (size_t)m->max_batch, H = (size_t)m->hidden;
    const cb_deltanet_config *d = &m->dn_cfg;
    size_t kd = (size_t)(d->n_k_heads * d->k_dim), vd = (size_t)(d->n_v_heads * d->v_dim), nv = (size_t)d->n_v_heads;
    m->x = malloc(B * H * sizeof(float));
    m->h = malloc(B * H * sizeof(float));
    m->proj = malloc(B * H * sizeof(float));
    m->tmp = malloc(B * H * sizeof(float));
    m->lx = malloc(B * (2 * kd + vd + 1) * sizeof(float));
    m->lz = malloc(B * (vd + 1) * sizeof(float));
    m->lo = malloc(B * (vd + 1) * sizeof(float));
    m->lb = malloc(B * (nv + 1) * sizeof(float));
    m->la = malloc(B * (nv + 1) * sizeof(float));
    m->qkvz = malloc(B * (2 * kd + 2 * vd + 1) * sizeof(float));
    m->ba = malloc(B * (2 * nv + 1) * sizeof(float));
    if (!m->x || !m->h || !m->proj || !m->tmp || !m->lx || !m->lz || !m->lo || !m->lb || !m->la || !m->qkvz ||
        !m->ba) {
        snprintf(err, errlen, "out of memory for activations");
        return -1;
    }
    return m->n_full ? cb_gqa_scratch_init(&m->attn_scratch, &m->attn_cfg, m->max_batch, ctx, err, errlen) : 0;
}

static int qwen_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    qwen *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    m->max_batch = a->max_batch;
    if (read_hparams(m, a->hp, err, errlen) || cb_rope_init(&m->rope, a->hp, m->attn_cfg.head_dim, 1, err, errlen) ||
        cb_st_open(&m->idx, a->model_dir, err, errlen))
        goto fail;
    size_t dense = 0, state = 0, cache = 0;
    char name[NAME_MAX_LEN];
    snprintf(name, sizeof name, "%sembed_tokens.weight", m->prefix);
    if (cb_load_linear(&m->embed, &m->idx, name, m->vocab, m->hidden, &dense, err, errlen)) goto fail;
    snprintf(name, sizeof name, "%snorm.weight", m->prefix);
    if (cb_load_vector(&m->final_norm, &m->idx, name, m->hidden, &dense, err, errlen)) goto fail;
    if (m->norm_offset)
        for (int i = 0; i < m->hidden; i++) m->final_norm[i] += 1.0f;
    if (m->tied) m->lm_head = m->embed;
    else if (cb_load_linear(&m->lm_head, &m->idx, "lm_head.weight", m->vocab, m->hidden, &dense, err, errlen))
        goto fail;
    m->expert_layers = calloc((size_t)m->n_layers, sizeof *m->expert_layers);
    if (!m->expert_layers) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    for (int l = 0; l < m->n_layers; l++) {
        if (load_layer(m, l, a->cap, &state, &dense, err, errlen)) goto fail;
        if (m->layers[l].moe) cache += cb_experts_cache_bytes(&m->layers[l].moe_block.store);
    }
    if (alloc_activations(m, a->ctx, err, errlen)) goto fail;
    info->vocab = m->vocab;
    info->n_layers = m->n_full;
    info->kv_dim = m->attn_cfg.n_kv_heads * m->attn_cfg.head_dim;
    info->state_bytes = state * sizeof(float);
    info->dense_bytes = dense;
    info->expert_cache_bytes = cache + cb_experts_staging_bytes();
    info->n_expert_layers = m->n_moe;
    info->expert_layers = m->expert_layers;
    *out = m;
    return 0;
fail:
    qwen_free(m);
    return -1;
}

/* Qwen3-Next's in_proj_qkvz / in_proj_ba interleave per key-head group g: [q k v(r heads) z(r heads)] and
 * [b(r) a(r)], r = value heads per key head. Regroup into the conv input [q | k | v] and z, b, a. */
static void ungroup_qkvz(const qwen *m, int n) {
    const cb_deltanet_config *d = &m->dn_cfg;
    int r = d->n_v_heads / d->n_k_heads, kd = d->n_k_heads * d->k_dim, vd = d->n_v_heads * d->v_dim;
    int gw = 2 * d->k_dim + 2 * r * d->v_dim, rv = r * d->v_dim;
    size_t fsz = sizeof(float);
    for (int i = 0; i < n; i++) {
        const float *src = m->qkvz + (size_t)i * (size_t)(2 * kd + 2 * vd), *ba = m->ba + (size_t)i * (size_t)(2 * d->n_v_heads);
        float *x = m->lx + (size_t)i * (size_t)(2 * kd + vd), *z = m->lz + (size_t)i * (size_t)vd;
        for (int g = 0; g < d->n_k_heads; g++) {
            const float *s = src + (size_t)g * (size_t)gw;
            memcpy(x + (size_t)g * d->k_dim, s, (size_t)d->k_dim * fsz);
            memcpy(x + kd + (size_t)g * d->k_dim, s + d->k_dim, (size_t)d->k_dim * fsz);
            memcpy(x + 2 * kd + (size_t)g * rv, s + 2 * d->k_dim, (size_t)rv * fsz);
            memcpy(z + (size_t)g * rv, s + 2 * d->k_dim + rv, (size_t)rv * fsz);
            memcpy(m->lb + (size_t)i * d->n_v_heads + (size_t)g * r, ba + (size_t)g * 2 * r, (size_t)r * fsz);
            memcpy(m->la + (size_t)i * d->n_v_heads + (size_t)g * r, ba + (size_t)g * 2 * r + r, (size_t)r * fsz);
        }
    }
}

static void linear_mixer(qwen *m, qwen_layer *L, cb_kv *kv, int n) {
    if (m->fused_linear) {
        cb_linear_apply(&L->in_qkvz, m->qkvz, m->h, n);
        cb_linear_apply(&L->in_ba, m->ba, m->h, n);
        ungroup_qkvz(m, n);
    } else {
        cb_linear_apply(&L->in_qkv, m->lx, m->h, n);
        cb_linear_apply(&L->in_z, m->lz, m->h, n);
        cb_linear_apply(&L->in_b, m->lb, m->h, n);
        cb_linear_apply(&L->in_a, m->la, m->h, n);
    }
    cb_deltanet_forward(&L->dn, kv->state + L->state_off, m->lo, m->lx, m->lz, m->lb, m->la, n);
    cb_linear_apply(&L->out_proj, m->proj, m->lo, n);
}

static int qwen_forward(void *ptr, cb_kv *kv, const int *tokens, int n, int pos0, float *logits, int all_logits,
                        char *err, size_t errlen) {
    qwen *m = ptr;
    int H = m->hidden;
    for (int i = 0; i < n; i++) cb_embed(m->x + (size_t)i * H, &m->embed, tokens[i]);
    for (int l = 0; l < m->n_layers; l++) {
        qwen_layer *L = &m->layers[l];
        for (int i = 0; i < n; i++) cb_rmsnorm(m->h + (size_t)i * H, m->x + (size_t)i * H, L->attn_norm, H, m->eps);
        if (L->full) cb_gqa_forward(&L->attn, &m->attn_scratch, m->proj, m->h, n, kv, L->kv_layer, pos0, &m->rope);
        else linear_mixer(m, L, kv, n);
        cb_add(m->x, m->proj, (size_t)n * H);
        for (int i = 0; i < n; i++) cb_rmsnorm(m->h + (size_t)i * H, m->x + (size_t)i * H, L->ffn_norm, H, m->eps);
        if (!L->moe) {
            cb_mlp_forward(&L->dense, m->proj, m->h, n);
        } else {
            if (cb_moe_forward(&L->moe_block, m->proj, m->h, n, err, errlen)) return -1;
            if (m->shared_inter) {
                cb_mlp_forward(&L->shared, m->tmp, m->h, n);
                cb_add(m->proj, m->tmp, (size_t)n * H);
            }
        }
        cb_add(m->x, m->proj, (size_t)n * H);
    }
    int first = all_logits ? 0 : n - 1, rows = n - first;
    for (int i = first; i < n; i++)
        cb_rmsnorm(m->h + (size_t)(i - first) * H, m->x + (size_t)i * H, m->final_norm, H, m->eps);
    cb_linear_apply(&m->lm_head, logits, m->h, rows);
    return 0;
}

static const cb_family qwen_family = {"qwen", qwen_load, qwen_forward, qwen_free};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &qwen_family); }
