/* decoder.c: see decoder.h. */
#include "decoder.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NAME_LEN 384
#define PREFIX_LEN 256      /* a formatted prefix, with room left in NAME_LEN for the leaf after it */

int cb_oom(char *err, size_t errlen, const char *what) {
    snprintf(err, errlen, "out of memory for %s", what);
    return -1;
}

/* ---- names in the checkpoint's layout ---- */

static const char *format_in(const char *fmt, int layout, const char *prefix, char *buf, size_t size) {
    const char *seg = fmt, *bar;
    for (int i = 0; i < layout && (bar = strchr(seg, '|')); i++) seg = bar + 1;
    bar = strchr(seg, '|');
    int len = bar ? (int)(bar - seg) : (int)strlen(seg);
    if (prefix && !strncmp(seg, "model.", 6)) snprintf(buf, size, "%s%.*s", prefix, len - 6, seg + 6);
    else snprintf(buf, size, "%.*s", len, seg);
    return buf;
}

const char *cb_decoder_format(const cb_decoder *d, char *buf, size_t size, const char *fmt) {
    return format_in(fmt, d->layout, d->prefix, buf, size);
}

const char *cb_decoder_name(const cb_decoder *d, char *buf, size_t size, const char *fmt, int l) {
    char f[NAME_LEN];
    snprintf(buf, size, cb_decoder_format(d, f, sizeof f, fmt), l);
    return buf;
}

/* Stored as a float / fp8 tensor, or quantized in a colibri-quant container (P.qweight for P.weight). */
static int stored(const cb_st_index *idx, const char *name) {
    if (cb_st_find(idx, name)) return 1;
    size_t n = strlen(name);
    if (n < 7 || strcmp(name + n - 7, ".weight")) return 0;
    char q[NAME_LEN];
    snprintf(q, sizeof q, "%.*s.qweight", (int)(n - 7), name);
    return cb_st_find(idx, q) != NULL;
}

/* The first alternative of the embedding's name that is stored decides the layout (0 when none is: the load
 * error then names the first). */
static void pick_layout(cb_decoder *d, const char *embed) {
    char name[NAME_LEN];
    int n = 1;
    for (const char *c = embed; *c; c++) n += *c == '|';
    for (int i = 0; i < n; i++)
        if (stored(&d->idx, format_in(embed, i, d->prefix, name, sizeof name))) {
            d->layout = i;
            return;
        }
}

/* ---- declared tensors ---- */

static int field_int(const void *model, size_t at) { return *(const int *)((const char *)model + at); }

static int wanted(const cb_tensor_spec *t, const void *model, int l) {
    if (t->when != CB_ALWAYS && !field_int(model, t->when)) return 0;
    if (!t->on) return 1;
    const char *letters = *(const char *const *)((const char *)model + t->letters);
    return letters && strchr(t->on, letters[l]) != NULL;
}

/* An f32/bf16/f16 tensor of exactly [rows, cols], as f32. */
static int load_table(float **out, const cb_st_index *idx, const char *name, int rows, int cols, size_t *bytes,
                      char *err, size_t errlen) {
    int64_t dims[2] = {rows, cols};
    const cb_tensor *t = cb_st_expect(idx, name, 2, dims, err, errlen);
    if (!t) return -1;
    if (!t->supported) {
        snprintf(err, errlen, "%s: dtype %s where f32/bf16/f16 is expected", name, t->dtype_name);
        return -1;
    }
    return cb_load_f32(out, idx, t, (size_t)rows * (size_t)cols, bytes, err, errlen);
}

/* An I64/I32 tensor of exactly [rows, cols], as int32 (values outside int32 refused). */
static int load_index(int32_t **out, const cb_st_index *idx, const char *name, int rows, int cols, char *err,
                      size_t errlen) {
    const cb_tensor *t = cb_st_find(idx, name);
    if (!t) {
        snprintf(err, errlen, "tensor %s not found in the checkpoint", name);
        return -1;
    }
    int wide = !strcmp(t->dtype_name, "I64");
    if ((!wide && strcmp(t->dtype_name, "I32")) || t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) {
        snprintf(err, errlen, "%s: expected I64/I32 [%d, %d], found %s with %d dims", name, rows, cols, t->dtype_name,
                 t->ndim);
        return -1;
    }
    void *raw = cb_st_load(idx, t, err, errlen);
    if (!raw) return -1;
    size_t n = (size_t)rows * (size_t)cols;
    if (!(*out = malloc(n * sizeof(int32_t)))) {
        free(raw);
        return cb_oom(err, errlen, name);
    }
    for (size_t i = 0; i < n; i++) {
        int64_t v = wide ? ((const int64_t *)raw)[i] : ((const int32_t *)raw)[i];
        if (v < INT32_MIN || v > INT32_MAX) {
            free(raw);
            snprintf(err, errlen, "%s: value %lld outside int32", name, (long long)v);
            return -1;
        }
        (*out)[i] = (int32_t)v;
    }
    free(raw);
    return 0;
}

/* The table's tensors of layer l, shapes (flags, letters) from the struct `shapes`, names in d's layout. */
static int load_tensors(void *layer, const void *shapes, const cb_decoder *d, const cb_tensor_spec *table, int l,
                        const cb_st_index *idx, size_t *bytes, char *err, size_t errlen) {
    char name[NAME_LEN];
    for (const cb_tensor_spec *t = table; t->name; t++) {
        if (!wanted(t, shapes, l)) continue;
        cb_decoder_name(d, name, sizeof name, t->name, l);
        void *at = (char *)layer + t->at;
        int rows = field_int(shapes, t->rows), rc;
        if (t->kind == CB_TENSOR_LINEAR)
            rc = cb_load_linear(at, idx, name, rows, field_int(shapes, t->cols), bytes, err, errlen);
        else if (t->kind == CB_TENSOR_TABLE)
            rc = load_table(at, idx, name, rows, field_int(shapes, t->cols), bytes, err, errlen);
        else if (t->kind == CB_TENSOR_INDEX)
            rc = load_index(at, idx, name, rows, field_int(shapes, t->cols), err, errlen);
        else
            rc = cb_load_vector(at, idx, name, rows, bytes, err, errlen);
        if (rc) return -1;
    }
    return 0;
}

int cb_load_tensors(void *layer, const void *model, const cb_tensor_spec *table, int l, const cb_st_index *idx,
                    size_t *bytes, char *err, size_t errlen) {
    return load_tensors(layer, model, model, table, l, idx, bytes, err, errlen);
}

int cb_load_block_tensors(void *layer, const void *shapes, cb_decoder *d, const cb_tensor_spec *table, int l,
                          char *err, size_t errlen) {
    return load_tensors(layer, shapes, d, table, l, &d->idx, &d->dense_bytes, err, errlen);
}

int cb_alloc_scratch(void *owner, const cb_scratch_spec *table, int max_batch, char *err, size_t errlen) {
    for (const cb_scratch_spec *s = table; s && s->at; s++) {
        float **buf = (float **)((char *)owner + s->at);
        size_t floats = (size_t)max_batch * (size_t)s->mult * (size_t)field_int(owner, s->width);
        if (floats && !(*buf = malloc(floats * sizeof(float)))) return cb_oom(err, errlen, "activations");
    }
    return 0;
}

void cb_free_scratch(void *owner, const cb_scratch_spec *table) {
    for (const cb_scratch_spec *s = table; s && s->at; s++) {
        free(*(float **)((char *)owner + s->at));
        *(float **)((char *)owner + s->at) = NULL;
    }
}

size_t cb_decoder_state(cb_decoder *d, size_t floats) {
    size_t at = d->state_floats;
    d->state_floats += floats;
    return at;
}

void cb_free_tensors(void *layer, const cb_tensor_spec *table) {
    for (const cb_tensor_spec *t = table; t->name; t++) {
        void *at = (char *)layer + t->at;
        if (t->kind == CB_TENSOR_LINEAR) {
            cb_linear_free(at);
        } else {
            free(*(float **)at);
            *(float **)at = NULL;
        }
    }
}

/* ---- loading ---- */

/* A decoder norm (1 + w when zero-centred). */
static int load_norm(float **out, cb_decoder *d, const char *fmt, int l, char *err, size_t errlen) {
    char name[NAME_LEN];
    if (cb_load_vector(out, &d->idx, cb_decoder_name(d, name, sizeof name, fmt, l), d->hidden, &d->dense_bytes, err,
                       errlen))
        return -1;
    if (d->norm_offset)
        for (int i = 0; i < d->hidden; i++) (*out)[i] += 1.0f;
    return 0;
}

/* A dense layer's prefix: the first candidate whose gate_proj is stored (as float, or quantized in a container),
 * else the last (whose missing tensor the load error then names). */
static const char *dense_prefix(const cb_decoder *d, const cb_recipe *r, int l, char *out, size_t size) {
    const char *last = "model.layers.%d.mlp.";
    for (int i = 0; i < 3 && r->dense_prefixes[i]; i++) {
        last = r->dense_prefixes[i];
        char name[NAME_LEN];
        cb_decoder_name(d, out, size, last, l);
        snprintf(name, sizeof name, "%sgate_proj.weight", out);
        if (stored(&d->idx, name)) return out;
    }
    return cb_decoder_name(d, out, size, last, l);
}

void cb_decoder_add_experts(cb_decoder *d, cb_expert_layer *store) {
    d->expert_layers[d->n_expert_layers++] = store;
    d->cache_bytes += cb_experts_cache_bytes(store);
}

/* OLMoE-style softmax routing over <prefix>experts.<e>.<leaf>.weight. */
static int load_moe(cb_decoder *d, cb_ffn *f, int l, const char *moe_fmt, char *err, size_t errlen) {
    char prefix[PREFIX_LEN], router[NAME_LEN], mats[3][NAME_LEN];
    static const char *const default_leaves[3] = {"gate_proj", "up_proj", "down_proj"};
    const char *const *leaves = d->moe.expert_mats ? d->moe.expert_mats : default_leaves;
    snprintf(prefix, sizeof prefix, moe_fmt, l);
    snprintf(router, sizeof router, "%sgate.weight", prefix);
    for (int m = 0; m < 3; m++) snprintf(mats[m], sizeof mats[m], "%sexperts.%%d.%s.weight", moe_fmt, leaves[m]);
    const char *const names[3] = {mats[0], mats[1], mats[2]};
    const cb_grouped_moe_shape *s = &d->moe;
    if (cb_moe_init(&f->moe, &d->idx, l, router, names, s->n_experts, s->top_k, s->norm_topk_prob, d->hidden,
                    s->inter, d->cap, d->max_batch, &d->dense_bytes, err, errlen))
        return -1;
    f->moe.swiglu_limit = d->expert_limit;
    return 0;
}

/* The recipe's always-on shared expert beside a softmax-routed layer (Qwen's, under a sigmoid gate). */
static int load_shared(cb_decoder *d, const cb_recipe *r, cb_ffn *f, int l, char *err, size_t errlen) {
    char prefix[PREFIX_LEN], gate[NAME_LEN];
    cb_decoder_name(d, prefix, sizeof prefix, r->shared_prefix ? r->shared_prefix : "model.layers.%d.mlp.shared_expert.",
                    l);
    if (r->shared_gate) cb_decoder_name(d, gate, sizeof gate, r->shared_gate, l);
    return cb_mlp_init(&f->shared, &d->idx, prefix, r->shared_gate ? gate : NULL, d->hidden, d->shared_inter,
                       d->max_batch, &d->dense_bytes, err, errlen);
}

static cb_moe *routed_of(cb_ffn *f) {
    return f->kind == CB_FFN_MOE ? &f->moe : f->kind == CB_FFN_GROUPED ? &f->grouped.moe : NULL;
}

/* Every MoE layer computes its experts in the first MoE layer's scratch: layers run one at a time, and per-layer
 * copies would cost n_layers x max_batch x top_k x hidden floats that the RAM plan gives the expert cache. */
static void share_moe_scratch(cb_decoder *d) {
    cb_moe *owner = NULL;
    for (int l = 0; l < d->n_layers; l++) {
        cb_moe *m = routed_of(&d->ffn[l]);
        if (m && owner) cb_moe_share_scratch(m, owner);
        else if (m) owner = m;
    }
}

static int load_ffn(cb_decoder *d, const cb_recipe *r, int l, char *err, size_t errlen) {
    cb_ffn *f = &d->ffn[l];
    char moe_fmt[PREFIX_LEN], name[PREFIX_LEN];
    cb_decoder_format(d, moe_fmt, sizeof moe_fmt, r->moe_prefix ? r->moe_prefix : "model.layers.%d.mlp.");
    if ((d->ffn_layers && d->ffn_layers[l] == 'D') || r->routed == CB_FFN_DENSE) {
        if (cb_swiglu_init(&f->dense, &d->idx, dense_prefix(d, r, l, name, sizeof name), d->hidden, d->inter,
                           d->max_batch, &d->dense_bytes, err, errlen))
            return -1;
        f->kind = CB_FFN_DENSE;
        return 0;
    }
    if (r->routed == CB_FFN_NONE) return 0;
    if (r->routed == CB_FFN_GROUPED) {
        if (cb_grouped_moe_init(&f->grouped, &d->idx, l, moe_fmt, &d->moe, 1, d->cap, d->max_batch,
                                &d->dense_bytes, err, errlen))
            return -1;
        f->kind = CB_FFN_GROUPED;
        cb_decoder_add_experts(d, &f->grouped.moe.store);
        return 0;
    }
    if (load_moe(d, f, l, moe_fmt, err, errlen)) return -1;
    f->kind = CB_FFN_MOE;
    cb_decoder_add_experts(d, &f->moe.store);
    return d->shared_inter ? load_shared(d, r, f, l, err, errlen) : 0;
}

/* A decision head in place of the LM head: its weight (and bias) under the names the --set keys give. */
static int load_head(cb_decoder *d, const char *model_dir, char *err, size_t errlen) {
    if (d->head_rows > d->vocab) {
        snprintf(err, errlen, "--set decision_head_rows=%d: more than the vocabulary's %d rows", d->head_rows,
                 d->vocab);
        return -1;
    }
    if (d->head_file && *d->head_file) {
        char path[4096];
        if (strchr(d->head_file, '/') || snprintf(path, sizeof path, "%s/%s", model_dir, d->head_file) >=
                                             (int)sizeof path) {
            snprintf(err, errlen, "--set decision_head_file=%s: a file name of the model directory", d->head_file);
            return -1;
        }
        if (cb_st_add_file(&d->idx, path, err, errlen)) return -1;
    }
    d->tied = 0;
    if (cb_load_linear(&d->lm_head, &d->idx, d->head_weight, d->head_rows, d->hidden, &d->dense_bytes, err, errlen))
        return -1;
    return d->head_bias && *d->head_bias
               ? cb_load_vector(&d->head_bias_v, &d->idx, d->head_bias, d->head_rows, &d->dense_bytes, err, errlen)
               : 0;
}

/* CB_DECODER_SPARSE_HPARAMS: every sparse_step-th layer routes, unless mlp_only_layers makes it dense. */
static int sparse_layers(cb_decoder *d, char *err, size_t errlen) {
    int n = d->n_layers;
    if (!(d->sparse_letters = calloc((size_t)n + 1, 1))) return cb_oom(err, errlen, "the layer kinds");
    for (int l = 0; l < n; l++) d->sparse_letters[l] = (l + 1) % d->sparse_step ? 'D' : 'M';
    d->ffn_layers = d->sparse_letters;
    return cb_hp_layer_indices("mlp_only_layers", d->mlp_only, n, 'D', d->sparse_letters, err, errlen);
}

static int load_all(void *m, const cb_recipe *r, const cb_load_args *a, cb_model_info *info, char *err,
                    size_t errlen) {
    cb_decoder *d = m;
    d->recipe = r;
    d->max_batch = a->max_batch;
    d->ctx = a->ctx;
    d->cap = a->cap;
    if (cb_hp_read(a->hp, r->hparams, m, err, errlen)) return -1;
    d->moe.hidden = d->hidden;
    if (d->prefix && (strlen(d->prefix) >= PREFIX_LEN / 4 || strchr(d->prefix, '%'))) {
        snprintf(err, errlen, "--set weight_prefix=%s: over %d characters or contains %%", d->prefix,
                 PREFIX_LEN / 4 - 1);
        return -1;
    }
    if (r->expert_mats[0]) d->moe.expert_mats = r->expert_mats;
    void *block = r->block ? (char *)m + r->block_at : NULL;
    if (block && r->block->setup(block, r->block_spec, d, a->hp, err, errlen)) return -1;
    if (r->setup && r->setup(m, a->hp, err, errlen)) return -1;
    if (d->sparse_step && sparse_layers(d, err, errlen)) return -1;
    if (((d->ffn_layers && strchr(d->ffn_layers, 'D')) || r->routed == CB_FFN_DENSE) && d->inter < 1) {
        snprintf(err, errlen, "--set intermediate_size is required: the model has dense (non-MoE) layers");
        return -1;
    }
    if (cb_st_open(&d->idx, a->model_dir, err, errlen)) return -1;
    const char *embed = r->embed_name ? r->embed_name : "model.embed_tokens.weight";
    pick_layout(d, embed);
    char name[NAME_LEN];
    /* Untied, the embedding is only gathered a row a token, so it stays in the file (mapped, paged in by the row,
     * as llama.cpp's mmap gives it) and its RAM goes to the expert cache; tied, the LM head reads every row. */
    int (*embedding)(cb_linear *, const cb_st_index *, const char *, int, int, size_t *, char *, size_t) =
        d->tied || d->head_rows ? cb_load_linear : cb_map_linear;
    if (embedding(&d->embed, &d->idx, cb_decoder_name(d, name, sizeof name, embed, 0), d->vocab, d->hidden,
                  &d->dense_bytes, err, errlen) ||
        load_norm(&d->final_norm, d, r->norm_name ? r->norm_name : "model.norm.weight", 0, err, errlen) ||
        (r->model_tensors && cb_load_tensors(m, m, r->model_tensors, 0, &d->idx, &d->dense_bytes, err, errlen)))
        return -1;
    if (d->head_rows) {
        if (load_head(d, a->model_dir, err, errlen)) return -1;
        info->decide_only = 1;
    } else if (d->tied) d->lm_head = d->embed;
    else if (cb_load_linear(&d->lm_head, &d->idx,
                            cb_decoder_name(d, name, sizeof name, r->lm_head_name ? r->lm_head_name : "lm_head.weight",
                                            0),
                            d->vocab, d->hidden, &d->dense_bytes, err, errlen))
        return -1;
    size_t L = (size_t)d->n_layers;
    char *layers = NULL;       /* the recipe's own layer structs (none: its layers are a block's) */
    if (r->layer_size) {
        if (!(layers = calloc(L, r->layer_size))) return cb_oom(err, errlen, "layers");
        *(void **)((char *)m + r->layers_at) = layers;
    }
    d->attn_norm = calloc(L, sizeof *d->attn_norm);
    d->ffn_norm = calloc(L, sizeof *d->ffn_norm);
    d->ffn = calloc(L, sizeof *d->ffn);
    d->expert_layers = calloc(L, sizeof *d->expert_layers);
    if (!d->attn_norm || !d->ffn_norm || !d->ffn || !d->expert_layers) return cb_oom(err, errlen, "layers");
    const char *attn_norm = r->attn_norm_name ? r->attn_norm_name : "model.layers.%d.input_layernorm.weight";
    const char *ffn_norm = r->ffn_norm_name ? r->ffn_norm_name : "model.layers.%d.post_attention_layernorm.weight";
    for (int l = 0; l < d->n_layers; l++)
        if (load_norm(&d->attn_norm[l], d, attn_norm, l, err, errlen) ||
            load_norm(&d->ffn_norm[l], d, ffn_norm, l, err, errlen) ||
            (r->tensors && cb_load_tensors(layers + (size_t)l * r->layer_size, m, r->tensors, l, &d->idx,
                                           &d->dense_bytes, err, errlen)) ||
            (block && r->block->load_layer(block, d, l, err, errlen)) ||
            (r->load_layer && r->load_layer(m, l, err, errlen)) || load_ffn(d, r, l, err, errlen))
            return -1;
    share_moe_scratch(d);
    size_t B = (size_t)d->max_batch, H = (size_t)d->hidden;
    d->x = malloc(B * H * sizeof(float));
    d->h = malloc(B * H * sizeof(float));
    d->proj = malloc(B * H * sizeof(float));
    if (d->shared_inter) d->shared_out = malloc(B * H * sizeof(float));
    if (!d->x || !d->h || !d->proj || (d->shared_inter && !d->shared_out)) return cb_oom(err, errlen, "activations");
    if (cb_alloc_scratch(m, r->scratch, d->max_batch, err, errlen)) return -1;
    info->vocab = d->vocab;
    info->n_layers = d->n_layers;
    info->state_bytes = d->state_floats * sizeof(float);
    info->dense_bytes = d->dense_bytes;
    info->expert_cache_bytes = d->cache_bytes + cb_experts_staging_bytes();
    info->n_expert_layers = d->n_expert_layers;
    info->expert_layers = d->expert_layers;
    if (block && r->block->finish(block, d, info, err, errlen)) return -1;
    return r->finish ? r->finish(m, info, err, errlen) : 0;
}

int cb_decoder_load(void **out, const cb_recipe *r, const cb_load_args *a, cb_model_info *info, char *err,
                    size_t errlen) {
    void *m = calloc(1, r->model_size);
    if (!m) return cb_oom(err, errlen, "the model");
    if (load_all(m, r, a, info, err, errlen)) {
        cb_decoder_unload(m);
        return -1;
    }
    *out = m;
    return 0;
}

void cb_decoder_unload(void *model) {
    cb_decoder *d = model;
    if (!d) return;
    const cb_recipe *r = d->recipe;
    char *layers = r->layer_size ? *(char **)((char *)model + r->layers_at) : NULL;
    for (int l = 0; layers && l < d->n_layers; l++) {
        void *layer = layers + (size_t)l * r->layer_size;
        if (r->tensors) cb_free_tensors(layer, r->tensors);
        if (r->free_layer) r->free_layer(model, layer);
    }
    if (r->block) r->block->free((char *)model + r->block_at, d);
    if (r->free_model) r->free_model(model);
    if (r->model_tensors) cb_free_tensors(model, r->model_tensors);
    cb_free_scratch(model, r->scratch);
    free(layers);
    for (int l = 0; l < d->n_layers; l++) {
        if (d->attn_norm) free(d->attn_norm[l]);
        if (d->ffn_norm) free(d->ffn_norm[l]);
        cb_ffn *f = d->ffn ? &d->ffn[l] : NULL;
        if (!f) continue;
        if (f->kind == CB_FFN_DENSE) cb_swiglu_free(&f->dense);
        else if (f->kind == CB_FFN_MOE) cb_moe_free(&f->moe), cb_mlp_free(&f->shared);
        else if (f->kind == CB_FFN_GROUPED) cb_grouped_moe_free(&f->grouped);
    }
    free(d->attn_norm);
    free(d->ffn_norm);
    free(d->ffn);
    free(d->expert_layers);
    cb_linear_free(&d->embed);
    if (!d->tied) cb_linear_free(&d->lm_head);
    free(d->final_norm);
    free(d->head_bias_v);
    free(d->x);
    free(d->h);
    free(d->proj);
    free(d->shared_out);
    free(d->sparse_letters);
    cb_st_close(&d->idx);
    free(model);
}

/* ---- the forward scaffolding ---- */

static void norm_rows(cb_decoder *d, float *out, const float *x, const float *w, int n) {
    size_t H = (size_t)d->hidden;
    for (int i = 0; i < n; i++) cb_rmsnorm(out + (size_t)i * H, x + (size_t)i * H, w, d->hidden, d->eps);
}

void cb_decoder_embed(cb_decoder *d, const int *tokens, int n) {
    d->tokens = tokens;
    for (int i = 0; i < n; i++) cb_embed(d->x + (size_t)i * (size_t)d->hidden, &d->embed, tokens[i]);
}

void cb_decoder_attn_norm(cb_decoder *d, int l, int n) { norm_rows(d, d->h, d->x, d->attn_norm[l], n); }

void cb_decoder_residual(cb_decoder *d, int n) { cb_add(d->x, d->proj, (size_t)n * (size_t)d->hidden); }

static int routed_forward(cb_decoder *d, cb_moe *moe, int l, int n, char *err, size_t errlen) {
    int (*route)(void *, int, cb_moe *, const float *, int, char *, size_t) = d->recipe->route;
    if (!route) return cb_moe_forward(moe, d->proj, d->h, n, err, errlen);
    return route(d, l, moe, d->h, n, err, errlen) ? -1 : cb_moe_experts_forward(moe, d->proj, d->h, n, err, errlen);
}

int cb_decoder_ffn_block(cb_decoder *d, int l, int n, char *err, size_t errlen) {
    cb_ffn *f = &d->ffn[l];
    int rc = 0;
    if (f->kind == CB_FFN_DENSE) cb_swiglu_forward(&f->dense, d->proj, d->h, n);
    else if (f->kind == CB_FFN_MOE) rc = routed_forward(d, &f->moe, l, n, err, errlen);
    else rc = cb_grouped_moe_forward(&f->grouped, d->proj, d->h, n, err, errlen);
    if (rc) return -1;
    if (f->shared.inter) {
        cb_mlp_forward(&f->shared, d->shared_out, d->h, n);
        cb_add(d->proj, d->shared_out, (size_t)n * (size_t)d->hidden);
    }
    return 0;
}

int cb_decoder_ffn(cb_decoder *d, int l, int n, char *err, size_t errlen) {
    norm_rows(d, d->h, d->x, d->ffn_norm[l], n);
    if (cb_decoder_ffn_block(d, l, n, err, errlen)) return -1;
    cb_decoder_residual(d, n);
    return 0;
}

/* The decision head's rows, computed packed at the front of logits, spread to the vocab-wide rows the engine reads
 * (from the last row back, so no row is overwritten before it moved), biased and soft-capped. */
static void head_logits(cb_decoder *d, float *logits, int rows) {
    size_t V = (size_t)d->vocab, R = (size_t)d->head_rows;
    cb_linear_apply(&d->lm_head, logits, d->h, rows);
    for (int i = rows - 1; i >= 0; i--) {
        float *row = logits + (size_t)i * V;
        memmove(row, logits + (size_t)i * R, R * sizeof(float));
        for (size_t v = 0; v < R; v++) {
            float x = row[v] + (d->head_bias_v ? d->head_bias_v[v] : 0.0f);
            row[v] = d->softcap > 0 ? d->softcap * tanhf(x / d->softcap) : x;
        }
        for (size_t v = R; v < V; v++) row[v] = -INFINITY;
    }
}

void cb_decoder_logits(cb_decoder *d, float *logits, int n, int all_logits) {
    int first = all_logits ? 0 : n - 1;
    norm_rows(d, d->h, d->x + (size_t)first * (size_t)d->hidden, d->final_norm, n - first);
    if (d->head_rows) head_logits(d, logits, n - first);
    else cb_linear_apply(&d->lm_head, logits, d->h, n - first);
}

int cb_decoder_forward(void *model, cb_kv *kv, const int *tokens, int n, int pos0, float *logits, int all_logits,
                       char *err, size_t errlen) {
    cb_decoder *d = model;
    cb_decoder_embed(d, tokens, n);
    for (int l = 0; l < d->n_layers; l++) {
        cb_decoder_attn_norm(d, l, n);
        if (d->recipe->mixer(model, l, kv, n, pos0, err, errlen)) return -1;
        cb_decoder_residual(d, n);
        if (cb_decoder_ffn(d, l, n, err, errlen)) return -1;
    }
    cb_decoder_logits(d, logits, n, all_logits);
    return 0;
}

/* The mixer of layer l on row i alone, the decoder's row buffers pointing at that row for the call. */
static int mixer_on_row(cb_decoder *d, int l, int i, cb_kv *kv, int pos0, char *err, size_t errlen) {
    size_t at = (size_t)i * (size_t)d->hidden;
    float *x = d->x, *h = d->h, *proj = d->proj;
    const int *tokens = d->tokens;
    d->x = x + at, d->h = h + at, d->proj = proj + at, d->tokens = tokens + i;
    int rc = d->recipe->mixer(d, l, kv, 1, pos0, err, errlen);
    d->x = x, d->h = h, d->proj = proj, d->tokens = tokens;
    return rc;
}

int cb_decoder_forward_batch(void *model, cb_kv *const *kvs, const int *tokens, const int *pos0, int n,
                             float *logits, char *err, size_t errlen) {
    cb_decoder *d = model;
    if (n < 1 || n > d->max_batch) {
        snprintf(err, errlen, "a batched step of %d sequences (1..%d)", n, d->max_batch);
        return -1;
    }
    cb_decoder_embed(d, tokens, n);
    for (int l = 0; l < d->n_layers; l++) {
        cb_decoder_attn_norm(d, l, n);
        for (int i = 0; i < n; i++)
            if (mixer_on_row(d, l, i, kvs[i], pos0[i], err, errlen)) return -1;
        cb_decoder_residual(d, n);
        if (cb_decoder_ffn(d, l, n, err, errlen)) return -1;
    }
    cb_decoder_logits(d, logits, n, 1);
    return 0;
}
