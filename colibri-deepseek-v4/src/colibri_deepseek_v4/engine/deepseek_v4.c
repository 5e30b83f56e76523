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
 * A recipe over the runtime's decoder (decoder.h) for loading (its tables below) and the embedding, norms and LM
 * head; the forward pass is V4's own, since the residual is hc_mult streams rather than one.
 *
 * Tensor names: as transformers saves them (model.layers.N..., model.embed_tokens, model.hc_head.hc_fn, head)
 * or as DeepSeek ships them (layers.N..., embed, hc_head_fn, head): every name below lists both, and the decoder
 * takes the one whose embedding the checkpoint stores.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compressor.h"
#include "decoder.h"
#include "engine.h"
#include "hyperconn.h"
#include "sink_attn.h"
#include "softplus_router.h"

typedef struct {
    char kind;                 /* 'S', 'H', 'C' */
    int rate;
    float *q_norm, *kv_norm, *sinks;
    float *hc_attn[3], *hc_ffn[3];     /* fn, base, scale */
    cb_linear wq_a, wq_b, wkv, wo_a, wo_b;
    cb_linear c_wkv, c_wgate;  /* compressor */
    float *c_ape, *c_norm;
    cb_linear i_wkv, i_wgate, i_wq_b, i_wproj;   /* indexer */
    float *i_ape, *i_norm;
    int32_t *tid2eid;          /* hash-routed layers */
    float *bias;               /* the others */
    cb_linear sh_gate, sh_up, sh_down;
} v4_layer;

typedef struct {
    cb_decoder d;
    int n_heads, head_dim, q_lora, o_groups, o_lora, window, csa_rate, hca_rate;
    int ix_heads, ix_dim, ix_topk, n_shared;
    float scaling, swiglu_limit;
    cb_hc_shape hc;
    const char *layer_kinds, *mlp_layers;              /* --set strings */
    const char *main_theta, *main_partial;               /* the sliding-window layers' RoPE */
    /* derived widths (the tables' shapes) */
    int qw, wo_in, wo_rows, d2, di2, ixw, hcw, hc_mix, hc_sq, one, three, sh_w, has_shared;
    int kv_dim;
    int off_cmp, off_rkv;      /* row offsets: key at 0 */
    float *hc_head[3];
    v4_layer *layers;
    cb_rope main_rope, comp_rope;
    /* activations: max_batch rows (the decoder's x holds the collapsed streams, h the normed block input, proj the
     * block output) */
    float *X, *pre, *post, *comb, *qa, *q, *kvp, *ckv, *cg, *ikv, *ig, *o, *ga, *iw, *sh_g, *sh_u, *sh_o;
    /* one row at a time */
    float *hc_scratch, *hc_tmp, *iq, *entry, *scores, *ix_scores, *route_scores;
    const float **rows, **slot_kv, **slot_g;
    int *picked;
    unsigned char *taken;
} v4;

static const cb_hp_spec HPARAMS[] = {
    CB_DECODER_HPARAMS(v4, d, 1e-6),
    CB_HP_REQ("num_attention_heads", v4, n_heads), CB_HP_REQ("head_dim", v4, head_dim),
    CB_HP_REQ("q_lora_rank", v4, q_lora), CB_HP_REQ("o_groups", v4, o_groups), CB_HP_REQ("o_lora_rank", v4, o_lora),
    CB_HP_REQ("sliding_window", v4, window), CB_HP_REQ("csa_rate", v4, csa_rate), CB_HP_REQ("hca_rate", v4, hca_rate),
    CB_HP_REQ("index_n_heads", v4, ix_heads), CB_HP_REQ("index_head_dim", v4, ix_dim),
    CB_HP_REQ("index_topk", v4, ix_topk), CB_HP_REQ("moe_intermediate_size", v4, d.moe.inter),
    CB_HP_REQ("n_routed_experts", v4, d.moe.n_experts), CB_HP_REQ("num_experts_per_tok", v4, d.moe.top_k),
    CB_HP_OPT("n_shared_experts", v4, n_shared, 1, CB_HP_NONNEG),
    CB_HP_NUM("routed_scaling_factor", v4, scaling, 1.5, CB_HP_ANY),
    CB_HP_NUM("swiglu_limit", v4, swiglu_limit, 10.0, CB_HP_ANY),
    CB_HP_REQ("hc_mult", v4, hc.hc), CB_HP_REQ("hc_sinkhorn_iters", v4, hc.sinkhorn_iters),
    {"hc_eps", CB_HP_FLOAT, offsetof(v4, hc.hc_eps), 0, CB_HP_ANY, NULL, 0},
    CB_HP_PER_LAYER("layer_kinds", v4, layer_kinds, "SHC", d.n_layers),   /* S sliding, H HCA, C CSA */
    CB_HP_PER_LAYER("mlp_layers", v4, mlp_layers, "HM", d.n_layers),      /* H hash-routed, M MoE */
    CB_HP_TEXT("main_rope_theta", v4, main_theta, "10000.0"),
    CB_HP_TEXT("partial_rotary_factor", v4, main_partial, "1.0"), CB_HP_END,
};

/* A layer tensor in both layouts (transformers' model.layers.N. and DeepSeek's layers.N.). */
#define LT(leaf) "model.layers.%d." leaf "|layers.%d." leaf
static const cb_tensor_spec TENSORS[] = {
    CB_VECTOR(LT("attn.q_norm.weight"), v4_layer, q_norm, v4, q_lora),
    CB_VECTOR(LT("attn.norm.weight"), v4_layer, kv_norm, v4, head_dim),
    CB_VECTOR(LT("attn.attn_sink"), v4_layer, sinks, v4, n_heads),
    CB_LINEAR(LT("attn.wq_a.weight"), v4_layer, wq_a, v4, q_lora, d.hidden),
    CB_LINEAR(LT("attn.wq_b.weight"), v4_layer, wq_b, v4, qw, q_lora),
    CB_LINEAR(LT("attn.wkv.weight"), v4_layer, wkv, v4, head_dim, d.hidden),
    CB_LINEAR(LT("attn.wo_a.weight"), v4_layer, wo_a, v4, wo_rows, wo_in),
    CB_LINEAR(LT("attn.wo_b.weight"), v4_layer, wo_b, v4, d.hidden, wo_rows),
    CB_TABLE(LT("hc_attn_fn"), v4_layer, hc_attn[0], v4, hc_mix, hcw),
    CB_VECTOR(LT("hc_attn_base"), v4_layer, hc_attn[1], v4, hc_mix),
    CB_VECTOR(LT("hc_attn_scale"), v4_layer, hc_attn[2], v4, three),
    CB_TABLE(LT("hc_ffn_fn"), v4_layer, hc_ffn[0], v4, hc_mix, hcw),
    CB_VECTOR(LT("hc_ffn_base"), v4_layer, hc_ffn[1], v4, hc_mix),
    CB_VECTOR(LT("hc_ffn_scale"), v4_layer, hc_ffn[2], v4, three),
    /* the compressor: CSA windows overlap, so their rows are twice as wide */
    CB_LINEAR_ON(LT("attn.compressor.wkv.weight"), v4_layer, c_wkv, v4, d2, d.hidden, layer_kinds, "C"),
    CB_LINEAR_ON(LT("attn.compressor.wgate.weight"), v4_layer, c_wgate, v4, d2, d.hidden, layer_kinds, "C"),
    CB_TABLE_ON(LT("attn.compressor.ape"), v4_layer, c_ape, v4, csa_rate, d2, layer_kinds, "C"),
    CB_LINEAR_ON(LT("attn.compressor.wkv.weight"), v4_layer, c_wkv, v4, head_dim, d.hidden, layer_kinds, "H"),
    CB_LINEAR_ON(LT("attn.compressor.wgate.weight"), v4_layer, c_wgate, v4, head_dim, d.hidden, layer_kinds, "H"),
    CB_TABLE_ON(LT("attn.compressor.ape"), v4_layer, c_ape, v4, hca_rate, head_dim, layer_kinds, "H"),
    CB_VECTOR_ON(LT("attn.compressor.norm.weight"), v4_layer, c_norm, v4, head_dim, layer_kinds, "HC"),
    /* the lightning indexer (CSA) */
    CB_LINEAR_ON(LT("attn.indexer.compressor.wkv.weight"), v4_layer, i_wkv, v4, di2, d.hidden, layer_kinds, "C"),
    CB_LINEAR_ON(LT("attn.indexer.compressor.wgate.weight"), v4_layer, i_wgate, v4, di2, d.hidden, layer_kinds, "C"),
    CB_TABLE_ON(LT("attn.indexer.compressor.ape"), v4_layer, i_ape, v4, csa_rate, di2, layer_kinds, "C"),
    CB_VECTOR_ON(LT("attn.indexer.compressor.norm.weight"), v4_layer, i_norm, v4, ix_dim, layer_kinds, "C"),
    CB_LINEAR_ON(LT("attn.indexer.wq_b.weight"), v4_layer, i_wq_b, v4, ixw, q_lora, layer_kinds, "C"),
    CB_LINEAR_ON(LT("attn.indexer.weights_proj.weight"), v4_layer, i_wproj, v4, ix_heads, d.hidden, layer_kinds, "C"),
    /* the routing beside the router (the decoder loads it and the experts under ffn.), and the shared expert */
    CB_VECTOR_ON(LT("ffn.gate.bias"), v4_layer, bias, v4, d.moe.n_experts, mlp_layers, "M"),
    CB_INDEX_ON(LT("ffn.gate.tid2eid"), v4_layer, tid2eid, v4, d.vocab, d.moe.top_k, mlp_layers, "H"),
    CB_LINEAR_IF(LT("ffn.shared_experts.w1.weight"), v4_layer, sh_gate, v4, sh_w, d.hidden, has_shared),
    CB_LINEAR_IF(LT("ffn.shared_experts.w3.weight"), v4_layer, sh_up, v4, sh_w, d.hidden, has_shared),
    CB_LINEAR_IF(LT("ffn.shared_experts.w2.weight"), v4_layer, sh_down, v4, d.hidden, sh_w, has_shared),
    CB_TENSORS_END,
};
static const cb_tensor_spec MODEL_TENSORS[] = {
    CB_TABLE("model.hc_head.hc_fn|hc_head_fn", v4, hc_head[0], v4, hc.hc, hcw),
    CB_VECTOR("model.hc_head.hc_base|hc_head_base", v4, hc_head[1], v4, hc.hc),
    CB_VECTOR("model.hc_head.hc_scale|hc_head_scale", v4, hc_head[2], v4, one),
    CB_TENSORS_END,
};
/* The routed experts under ffn.experts.<e>.: w1 = gate, w3 = up, w2 = down. */
static const char *const EXPERT_MATS[3] = {"w1", "w3", "w2"};

/* The sliding-window layers' RoPE: --set main_rope_theta, default type, the same rotated width. */
static int main_rope_init(cb_rope *r, const v4 *m, int head_dim, char *err, size_t errlen) {
    char *keys[2] = {"rope_theta", "partial_rotary_factor"};
    char *values[2] = {(char *)m->main_theta, (char *)m->main_partial};
    int used[2] = {0, 0};
    cb_hparams sub = {2, keys, values, used};
    return cb_rope_init(r, &sub, head_dim, 0, err, errlen);
}

static int setup(void *ptr, cb_hparams *hp, char *err, size_t errlen) {
    v4 *m = ptr;
    int D = m->head_dim, H = m->d.hidden, hc = m->hc.hc;
    if (D < 2 || m->n_heads % m->o_groups || m->ix_dim < 2 || m->d.moe.top_k > m->d.moe.n_experts) {
        snprintf(err, errlen, "--set hyperparameters out of range (head_dim and index_head_dim >= 2, o_groups "
                              "divides the heads, top_k <= experts)");
        return -1;
    }
    m->hc.hidden = H;
    m->hc.norm_eps = m->d.eps;
    m->qw = m->n_heads * D;
    m->wo_in = m->qw / m->o_groups;
    m->wo_rows = m->o_groups * m->o_lora;
    m->d2 = 2 * D;
    m->di2 = 2 * m->ix_dim;
    m->ixw = m->ix_heads * m->ix_dim;
    m->hcw = hc * H;
    m->hc_mix = (2 + hc) * hc;
    m->hc_sq = hc * hc;
    m->one = 1;
    m->three = 3;
    m->has_shared = m->n_shared > 0;
    m->sh_w = m->n_shared * m->d.moe.inter;
    m->d.moe.expert_mats = EXPERT_MATS;
    m->d.moe.norm_topk_prob = 1;
    m->d.expert_limit = m->swiglu_limit;
    if (main_rope_init(&m->main_rope, m, D, err, errlen) || cb_rope_init(&m->comp_rope, hp, D, 0, err, errlen))
        return -1;
    if (m->comp_rope.rot_dim > m->ix_dim || m->main_rope.rot_dim != m->comp_rope.rot_dim) {
        snprintf(err, errlen, "--set partial_rotary_factor: the rotated width %d must fit index_head_dim %d",
                 m->comp_rope.rot_dim, m->ix_dim);
        return -1;
    }
    return 0;
}

/* After the table: the kind, wo_a as floats (read per group, straight from its rows), the hash table checked. */
static int load_layer(void *ptr, int l, char *err, size_t errlen) {
    v4 *m = ptr;
    v4_layer *L = &m->layers[l];
    L->kind = m->layer_kinds[l];
    L->rate = L->kind == 'C' ? m->csa_rate : L->kind == 'H' ? m->hca_rate : 0;
    if (cb_linear_dequantize(&L->wo_a, err, errlen)) return -1;
    size_t n = L->tid2eid ? (size_t)m->d.vocab * (size_t)m->d.moe.top_k : 0;
    for (size_t i = 0; i < n; i++)
        if (L->tid2eid[i] < 0 || L->tid2eid[i] >= m->d.moe.n_experts) {
            snprintf(err, errlen, "layer %d's ffn.gate.tid2eid: expert id %d out of range [0, %d)", l, L->tid2eid[i],
                     m->d.moe.n_experts);
            return -1;
        }
    return 0;
}

static const cb_scratch_spec SCRATCH[] = {
    CB_SCRATCH(v4, X, hcw, 1), CB_SCRATCH(v4, pre, hc.hc, 1), CB_SCRATCH(v4, post, hc.hc, 1),
    CB_SCRATCH(v4, comb, hc_sq, 1), CB_SCRATCH(v4, qa, q_lora, 1), CB_SCRATCH(v4, q, qw, 1),
    CB_SCRATCH(v4, kvp, head_dim, 1), CB_SCRATCH(v4, ckv, d2, 1), CB_SCRATCH(v4, cg, d2, 1),
    CB_SCRATCH(v4, ikv, di2, 1), CB_SCRATCH(v4, ig, di2, 1), CB_SCRATCH(v4, o, qw, 1), CB_SCRATCH(v4, ga, wo_rows, 1),
    CB_SCRATCH(v4, iw, ix_heads, 1), CB_SCRATCH(v4, sh_g, sh_w, 1), CB_SCRATCH(v4, sh_u, sh_w, 1),
    CB_SCRATCH(v4, sh_o, d.hidden, 1), CB_SCRATCH_END,
};

/* The KV row: the widest layer's (CSA: key, entry, raw value + gate, indexer entry, raw value + gate), and the
 * per-row scratch of attention over a window plus every compressed entry. */
static int finish(void *ptr, cb_model_info *info, char *err, size_t errlen) {
    v4 *m = ptr;
    size_t D = (size_t)m->head_dim, Di = (size_t)m->ix_dim, ctx = (size_t)m->d.ctx;
    size_t slots = 2 * (size_t)(m->csa_rate > m->hca_rate ? m->csa_rate : m->hca_rate);
    m->kv_dim = (int)D;
    for (int l = 0; l < m->d.n_layers; l++) {
        char kind = m->layer_kinds[l];
        int w = kind == 'C' ? (int)(6 * D + 5 * Di) : kind == 'H' ? (int)(4 * D) : (int)D;
        if (w > m->kv_dim) m->kv_dim = w;
    }
    m->off_cmp = (int)D;
    m->off_rkv = (int)(2 * D);
    struct { float **p; size_t n; } want[] = {
        {&m->hc_scratch, (size_t)cb_hc_scratch_floats(&m->hc)}, {&m->hc_tmp, (size_t)m->hcw},
        {&m->iq, (size_t)m->ixw}, {&m->entry, 2 * D + Di}, {&m->scores, 2 * ctx + 1}, {&m->ix_scores, ctx + 1},
        {&m->route_scores, (size_t)m->d.moe.n_experts},
    };
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        if (!(*want[i].p = malloc(want[i].n * sizeof(float)))) return cb_oom(err, errlen, "activations");
    m->rows = malloc((2 * ctx + 1) * sizeof *m->rows);   /* a window of keys + compressed entries */
    m->taken = malloc(ctx + 1);
    m->slot_kv = malloc(slots * sizeof *m->slot_kv);
    m->slot_g = malloc(slots * sizeof *m->slot_g);
    m->picked = malloc((ctx + 1) * sizeof *m->picked);
    if (!m->rows || !m->slot_kv || !m->slot_g || !m->picked || !m->taken) return cb_oom(err, errlen, "activations");
    info->kv_dim = m->kv_dim;
    info->kv_k_only = 1;
    return 0;
}

static void free_model(void *ptr) {
    v4 *m = ptr;
    cb_rope_free(&m->main_rope);
    cb_rope_free(&m->comp_rope);
    float *bufs[] = {m->hc_scratch, m->hc_tmp, m->iq, m->entry, m->scores, m->ix_scores, m->route_scores};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) free(bufs[i]);
    free(m->rows); free(m->slot_kv); free(m->slot_g); free(m->picked); free(m->taken);
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
    cb_rmsnorm(entry, entry, norm, dim, m->d.eps);
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
                                           m->q_lora, m->d.eps);
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
        for (int hh = 0; hh < NH; hh++) cb_rmsnorm(q + (size_t)hh * D, q + (size_t)hh * D, NULL, D, m->d.eps);
        rope_tail(rope, q, NH, D, t);
        cb_rmsnorm(row, m->kvp + (size_t)i * D, L->kv_norm, D, m->d.eps);
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
            n_entries = index_select(m, L, kv, layer, &r, m->qa + (size_t)i * m->q_lora, h + (size_t)i * m->d.hidden,
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

/* The router: sqrt(softplus) with a selection bias, or the token's row of tid2eid on hash-routed layers. */
static int route(void *ptr, int l, cb_moe *moe, const float *h, int n, char *err, size_t errlen) {
    v4 *m = ptr;
    const v4_layer *L = &m->layers[l];
    const int *tokens = m->d.tokens;
    int E = m->d.moe.n_experts, K = m->d.moe.top_k;
    cb_linear_apply(&moe->router, moe->logits, h, n);
    for (int i = 0; i < n; i++) {
        const float *logits = moe->logits + (size_t)i * E;
        int *idx = moe->chosen + (size_t)i * K;
        float *w = moe->weight + (size_t)i * K;
        if (L->tid2eid) {
            if (tokens[i] < 0 || tokens[i] >= m->d.vocab) {
                snprintf(err, errlen, "token %d outside the vocabulary (%d)", tokens[i], m->d.vocab);
                return -1;
            }
            cb_hash_route(logits, L->tid2eid + (size_t)tokens[i] * K, K, m->scaling, idx, w);
        } else {
            cb_sqrtsoftplus_route(logits, L->bias, E, K, m->scaling, idx, w, m->route_scores);
        }
    }
    return 0;
}

/* d.proj = the routed experts (the decoder's block, through route) + the clamped SwiGLU shared expert. */
static int ffn(v4 *m, v4_layer *L, int l, int n, char *err, size_t errlen) {
    if (cb_decoder_ffn_block(&m->d, l, n, err, errlen)) return -1;
    if (!m->has_shared) return 0;
    size_t I = (size_t)m->sh_w;
    const float *h = m->d.h;
    cb_linear_apply(&L->sh_gate, m->sh_g, h, n);
    cb_linear_apply(&L->sh_up, m->sh_u, h, n);
    cb_swiglu_clamp(m->sh_g, m->sh_u, (size_t)n * I, m->swiglu_limit);
    cb_silu_mul(m->sh_g, m->sh_u, (int)((size_t)n * I));
    cb_linear_apply(&L->sh_down, m->sh_o, m->sh_g, n);
    cb_add(m->d.proj, m->sh_o, (size_t)n * (size_t)m->d.hidden);
    return 0;
}

/* Per row: the hyper-connection weights of a block, the collapsed streams into d.x and their norm into d.h. */
static void hc_enter(v4 *m, float *const w[3], const float *norm, int n) {
    int hc = m->hc.hc, H = m->d.hidden;
    for (int i = 0; i < n; i++) {
        float *X = m->X + (size_t)i * hc * H, *pre = m->pre + (size_t)i * hc, *c = m->d.x + (size_t)i * H;
        cb_hc_weights(&m->hc, w[0], w[1], w[2], X, pre, m->post + (size_t)i * hc, m->comb + (size_t)i * hc * hc,
                      m->hc_scratch);
        cb_hc_collapse(c, X, pre, hc, H);
        cb_rmsnorm(m->d.h + (size_t)i * H, c, norm, H, m->d.eps);
    }
}

/* The block's output d.proj back into the streams. */
static void hc_leave(v4 *m, int n) {
    int hc = m->hc.hc, H = m->d.hidden;
    for (int i = 0; i < n; i++)
        cb_hc_expand(m->X + (size_t)i * hc * H, m->d.proj + (size_t)i * H, m->post + (size_t)i * hc,
                     m->comb + (size_t)i * hc * hc, hc, H, m->hc_tmp);
}

static int v4_forward(void *ptr, cb_kv *kv, const int *tokens, int n, int pos0, float *logits, int all_logits,
                      char *err, size_t errlen) {
    v4 *m = ptr;
    cb_decoder *d = &m->d;
    int H = d->hidden, hc = m->hc.hc;
    cb_decoder_embed(d, tokens, n);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < hc; k++)
            memcpy(m->X + ((size_t)i * hc + k) * H, d->x + (size_t)i * H, (size_t)H * sizeof(float));
    for (int l = 0; l < d->n_layers; l++) {
        v4_layer *L = &m->layers[l];
        hc_enter(m, L->hc_attn, d->attn_norm[l], n);
        attention(m, L, l, kv, d->h, n, pos0, d->proj);
        hc_leave(m, n);
        hc_enter(m, L->hc_ffn, d->ffn_norm[l], n);
        if (ffn(m, L, l, n, err, errlen)) return -1;
        hc_leave(m, n);
    }
    /* The head collapses the streams with its own weights; the decoder norms and projects them. */
    for (int i = all_logits ? 0 : n - 1; i < n; i++) {
        const float *X = m->X + (size_t)i * hc * H;
        cb_hc_head_weights(&m->hc, m->hc_head[0], m->hc_head[1], m->hc_head[2], X, m->pre, m->hc_scratch);
        cb_hc_collapse(d->x + (size_t)i * H, X, m->pre, hc, H);
    }
    cb_decoder_logits(d, logits, n, all_logits);
    return 0;
}

static const cb_recipe RECIPE = {
    .hparams = HPARAMS, .model_size = sizeof(v4), .layer_size = sizeof(v4_layer), .layers_at = offsetof(v4, layers),
    .tensors = TENSORS, .model_tensors = MODEL_TENSORS, .scratch = SCRATCH, .routed = CB_FFN_MOE, .setup = setup,
    .load_layer = load_layer, .finish = finish, .free_model = free_model, .route = route,
    .moe_prefix = LT("ffn."),
    .embed_name = "model.embed_tokens.weight|embed.weight", .norm_name = "model.norm.weight|norm.weight",
    .lm_head_name = "head.weight", .attn_norm_name = LT("attn_norm.weight"), .ffn_norm_name = LT("ffn_norm.weight"),
};

static int v4_load(void **out, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    return cb_decoder_load(out, &RECIPE, a, info, err, errlen);
}

static const cb_family v4_family
    = {.name = "deepseek-v4", .load = v4_load, .forward = v4_forward, .free = cb_decoder_unload};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &v4_family); }
