/* qwen_image.c: the stages of diffusers' QwenImagePipeline and QwenImage21Pipeline over the shared runtime, one
 * stage per process.
 *
 *   colibri-qwen-image text  DIR key=value...  Qwen2.5-VL / Qwen3-VL language model: token ids in, hidden states out
 *   colibri-qwen-image dit   DIR key=value...  QwenImageTransformer2DModel: (text, timestep, latents) -> velocity
 *   colibri-qwen-image vae   DIR key=value...  AutoencoderKLQwenImage decoder, one frame: latents -> pixels
 *   colibri-qwen-image dit21 DIR key=value...  QwenImage21Transformer2DModel (qwen_image21.c)
 *   colibri-qwen-image vae21 DIR key=value...  AutoencoderKLQwenImage21 decoder (qwen_image21.c)
 *
 * DIR is the component folder (text_encoder/, transformer/, vae/). The Python side (colibri_image.pipeline) runs the
 * scheduler, guidance and the prompt template, and starts one stage at a time, so only one component's weights are
 * ever resident. Messages on stdin/stdout are little-endian int32 headers followed by f32 arrays (pipeline.py's
 * StageProcess is the other end). Matrices stay in their stored dtype and go through cb_matmul, whose rows are
 * independent of the thread count, so the result never depends on --threads.
 *
 * Each stage is a recipe: its key=value hyperparameters (cb_hp_spec) and tensors (img_tensor_spec) in tables, a
 * load that walks them, and the forward pass over one session (image_ops.h's img_stage).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image_ops.h"
#include "kernels.h"

/* ====================================================================== text: Qwen2.5-VL / Qwen3-VL LM */

/* Qwen3-VL differs from Qwen2.5-VL by bias-free q/k/v (bias=0) and an RMSNorm over each head of q and k before the
 * rotation (qk_norm=1); QwenImage21Pipeline reads the last layer's output before the final norm (final_norm=0).
 * Text-only prompts give M-RoPE (interleaved or not) the same position on all three axes: plain RoPE. */
typedef struct {
    float *in_norm, *post_norm, *q_norm, *k_norm;
    linear_t q, k, v, o, gate, up, down;
} text_layer_t;

typedef struct {
    int layers, hidden, heads, kv_heads, head_dim, inter, vocab, bias, qk_norm, final_norm;
    float theta, eps;
    const char *prefix;
    int qd, kvd;       /* heads * head_dim, kv_heads * head_dim */
    const cb_tensor *emb;
    float *norm, *inv_freq;
    text_layer_t *L;
} text_t;

static const cb_hp_spec text_hparams[] = {
    CB_HP_REQ("layers", text_t, layers), CB_HP_REQ("hidden", text_t, hidden), CB_HP_REQ("heads", text_t, heads),
    CB_HP_REQ("kv_heads", text_t, kv_heads), CB_HP_REQ("head_dim", text_t, head_dim),
    CB_HP_REQ("intermediate", text_t, inter), CB_HP_REQ("vocab", text_t, vocab),
    IMG_HP_REAL("rope_theta", text_t, theta), IMG_HP_REAL("eps", text_t, eps),
    CB_HP_TEXT("prefix", text_t, prefix, "model.language_model."),
    CB_HP_FLAG("bias", text_t, bias, 1), CB_HP_FLAG("qk_norm", text_t, qk_norm, 0),
    CB_HP_FLAG("final_norm", text_t, final_norm, 1),
    CB_HP_END,
};

/* Under the checkpoint's prefix= (model.language_model. for Qwen2.5-VL's layout). */
static const img_tensor_spec text_tensors[] = {
    IMG_MAT("embed_tokens.weight", text_t, emb, text_t, vocab, hidden),
    IMG_VEC("norm.weight", text_t, norm, text_t, hidden),
    IMG_TENSORS_END,
};

static const img_tensor_spec text_layer_tensors[] = {
    IMG_LIN("layers.%d.self_attn.q_proj", text_layer_t, q, text_t, qd, hidden, offsetof(text_t, bias)),
    IMG_LIN("layers.%d.self_attn.k_proj", text_layer_t, k, text_t, kvd, hidden, offsetof(text_t, bias)),
    IMG_LIN("layers.%d.self_attn.v_proj", text_layer_t, v, text_t, kvd, hidden, offsetof(text_t, bias)),
    IMG_LIN("layers.%d.self_attn.o_proj", text_layer_t, o, text_t, hidden, qd, IMG_NEVER),
    IMG_LIN("layers.%d.mlp.gate_proj", text_layer_t, gate, text_t, inter, hidden, IMG_NEVER),
    IMG_LIN("layers.%d.mlp.up_proj", text_layer_t, up, text_t, inter, hidden, IMG_NEVER),
    IMG_LIN("layers.%d.mlp.down_proj", text_layer_t, down, text_t, hidden, inter, IMG_NEVER),
    IMG_VEC("layers.%d.input_layernorm.weight", text_layer_t, in_norm, text_t, hidden),
    IMG_VEC("layers.%d.post_attention_layernorm.weight", text_layer_t, post_norm, text_t, hidden),
    IMG_VEC_IF("layers.%d.self_attn.q_norm.weight", text_layer_t, q_norm, text_t, head_dim, qk_norm),
    IMG_VEC_IF("layers.%d.self_attn.k_norm.weight", text_layer_t, k_norm, text_t, head_dim, qk_norm),
    IMG_TENSORS_END,
};

static int text_load(img_ctx *c, void *model) {
    text_t *m = model;
    m->qd = m->heads * m->head_dim;
    m->kvd = m->kv_heads * m->head_dim;
    m->L = img_alloc(c, sizeof(text_layer_t) * (size_t)m->layers);
    if (img_load(c, m, m, text_tensors, m->prefix, 0, 0) ||
        img_load_layers(c, m->L, m, text_layer_tensors, m->prefix, m->layers, sizeof *m->L) ||
        !(m->inv_freq = img_floats(c, (size_t)m->head_dim / 2)))
        return -1;
    for (int i = 0; i < m->head_dim / 2; i++)
        m->inv_freq[i] = 1.0f / powf(m->theta, (float)(2 * i) / (float)m->head_dim);
    return 0;
}

static void text_free(void *model) {
    text_t *m = model;
    img_free_layers(m->L, m, text_layer_tensors, m->layers, sizeof *m->L);
    img_free(m, m, text_tensors);
    free(m->inv_freq);
}

/* One prompt of n token ids (read here) -> its hidden states [n, hidden] on stdout. */
static int text_request(img_ctx *c, const text_t *m, int n, img_bufs *b) {
    int hidden = m->hidden, heads = m->heads, kv_heads = m->kv_heads, head_dim = m->head_dim, inter = m->inter;
    float eps = m->eps;
    size_t qd = (size_t)m->qd, kvd = (size_t)m->kvd, row_bytes = (size_t)hidden * cb_dtype_size(m->emb->dtype);
    int32_t *ids = img_keep(c, b, sizeof(int32_t) * (size_t)n);
    float *x = img_buf(c, b, (size_t)n * hidden), *h = img_buf(c, b, (size_t)n * hidden);
    float *q = img_buf(c, b, n * qd), *k = img_buf(c, b, n * kvd), *v = img_buf(c, b, n * kvd);
    float *att = img_buf(c, b, n * qd), *g = img_buf(c, b, (size_t)n * inter), *u = img_buf(c, b, (size_t)n * inter);
    void *row = img_keep(c, b, row_bytes);
    if (!ids || !x || !h || !q || !k || !v || !att || !g || !u || !row) return -1;
    if (read_all(ids, sizeof(int32_t) * (size_t)n)) return img_fail(c, "short input");
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= m->vocab) return img_fail(c, "token id %d out of range", ids[i]);
        if (cb_st_pread(&c->idx, m->emb->shard, row, row_bytes, m->emb->offset + (uint64_t)ids[i] * row_bytes,
                        c->err, sizeof c->err))
            return -1;
        cb_convert_to_f32(x + (size_t)i * hidden, row, m->emb->dtype, (size_t)hidden);
    }
    for (int l = 0; l < m->layers; l++) {
        const text_layer_t *L = &m->L[l];
        for (int i = 0; i < n; i++) cb_rmsnorm(h + (size_t)i * hidden, x + (size_t)i * hidden, L->in_norm, hidden, eps);
        linear(&L->q, q, h, n);
        linear(&L->k, k, h, n);
        linear(&L->v, v, h, n);
        if (m->qk_norm)
            for (int i = 0; i < n; i++) {
                for (int hh = 0; hh < heads; hh++) {
                    float *qh = q + i * qd + (size_t)hh * head_dim;
                    cb_rmsnorm(qh, qh, L->q_norm, head_dim, eps);
                }
                for (int hh = 0; hh < kv_heads; hh++) {
                    float *kh = k + i * kvd + (size_t)hh * head_dim;
                    cb_rmsnorm(kh, kh, L->k_norm, head_dim, eps);
                }
            }
        for (int i = 0; i < n; i++) {
            /* text-only positions: M-RoPE's three sections all see position i, which is plain RoPE */
            cb_rope_neox(q + i * qd, heads, head_dim, head_dim, i, m->inv_freq);
            cb_rope_neox(k + i * kvd, kv_heads, head_dim, head_dim, i, m->inv_freq);
        }
        if (attention(c, att, q, k, v, n, n, heads, kv_heads, head_dim, qd, kvd, 1)) return -1;
        linear(&L->o, h, att, n);
        for (size_t i = 0; i < (size_t)n * hidden; i++) x[i] += h[i];
        for (int i = 0; i < n; i++)
            cb_rmsnorm(h + (size_t)i * hidden, x + (size_t)i * hidden, L->post_norm, hidden, eps);
        linear(&L->gate, g, h, n);
        linear(&L->up, u, h, n);
        cb_silu_mul(g, u, n * inter);
        linear(&L->down, h, g, n);
        for (size_t i = 0; i < (size_t)n * hidden; i++) x[i] += h[i];
    }
    if (m->final_norm)
        for (int i = 0; i < n; i++) cb_rmsnorm(h + (size_t)i * hidden, x + (size_t)i * hidden, m->norm, hidden, eps);
    else
        memcpy(h, x, sizeof(float) * (size_t)n * hidden);
    int32_t hdr[2] = {n, hidden};
    return img_reply(c, hdr, 2, h, (size_t)n * hidden);
}

static int text_forward(img_ctx *c, void *model) {
    int32_t n;
    while (read_i32(&n) == 0) {
        if (n <= 0 || n > (1 << 16)) return img_fail(c, "bad token count %d", n);
        img_bufs b = {0};
        int rc = text_request(c, model, n, &b);
        img_bufs_free(&b);
        if (rc) return -1;
    }
    return 0;
}

/* ============================================================================ dit: QwenImageTransformer2DModel */

typedef struct {
    linear_t img_mod, txt_mod, to_q, to_k, to_v, add_q, add_k, add_v, to_out, to_add_out;
    linear_t img_fc1, img_fc2, txt_fc1, txt_fc2;
    float *norm_q, *norm_k, *norm_added_q, *norm_added_k;
} dit_block_t;

typedef struct {
    int layers, heads, head_dim, in_ch, out_ch, joint, axes[3];
    int dim, ffn, dim2, dim6, out4, time_proj;   /* D, 4D, 2D, 6D, 4 * out_channels, 256 */
    linear_t t1, t2, img_in, txt_in, norm_out, proj_out;
    float *txt_norm;
    dit_block_t *B;
} dit_t;

static const cb_hp_spec dit_hparams[] = {
    CB_HP_REQ("layers", dit_t, layers), CB_HP_REQ("heads", dit_t, heads), CB_HP_REQ("head_dim", dit_t, head_dim),
    CB_HP_REQ("in_channels", dit_t, in_ch), CB_HP_REQ("out_channels", dit_t, out_ch),
    CB_HP_REQ("joint_dim", dit_t, joint), IMG_HP_AXES(dit_t, axes),
    CB_HP_END,
};

static const img_tensor_spec dit_tensors[] = {
    IMG_LIN("time_text_embed.timestep_embedder.linear_1", dit_t, t1, dit_t, dim, time_proj, IMG_ALWAYS),
    IMG_LIN("time_text_embed.timestep_embedder.linear_2", dit_t, t2, dit_t, dim, dim, IMG_ALWAYS),
    IMG_LIN("img_in", dit_t, img_in, dit_t, dim, in_ch, IMG_ALWAYS),
    IMG_LIN("txt_in", dit_t, txt_in, dit_t, dim, joint, IMG_ALWAYS),
    IMG_LIN("norm_out.linear", dit_t, norm_out, dit_t, dim2, dim, IMG_ALWAYS),
    IMG_LIN("proj_out", dit_t, proj_out, dit_t, out4, dim, IMG_ALWAYS),
    IMG_VEC("txt_norm.weight", dit_t, txt_norm, dit_t, joint),
    IMG_TENSORS_END,
};

#define DIT_LIN(name, f, r, c) IMG_LIN("transformer_blocks.%d." name, dit_block_t, f, dit_t, r, c, IMG_ALWAYS)
#define DIT_NORM(name, f) IMG_VEC("transformer_blocks.%d.attn." name ".weight", dit_block_t, f, dit_t, head_dim)
static const img_tensor_spec dit_block_tensors[] = {
    DIT_LIN("img_mod.1", img_mod, dim6, dim), DIT_LIN("txt_mod.1", txt_mod, dim6, dim),
    DIT_LIN("attn.to_q", to_q, dim, dim), DIT_LIN("attn.to_k", to_k, dim, dim), DIT_LIN("attn.to_v", to_v, dim, dim),
    DIT_LIN("attn.add_q_proj", add_q, dim, dim), DIT_LIN("attn.add_k_proj", add_k, dim, dim),
    DIT_LIN("attn.add_v_proj", add_v, dim, dim),
    DIT_LIN("attn.to_out.0", to_out, dim, dim), DIT_LIN("attn.to_add_out", to_add_out, dim, dim),
    DIT_LIN("img_mlp.net.0.proj", img_fc1, ffn, dim), DIT_LIN("img_mlp.net.2", img_fc2, dim, ffn),
    DIT_LIN("txt_mlp.net.0.proj", txt_fc1, ffn, dim), DIT_LIN("txt_mlp.net.2", txt_fc2, dim, ffn),
    DIT_NORM("norm_q", norm_q), DIT_NORM("norm_k", norm_k), DIT_NORM("norm_added_q", norm_added_q),
    DIT_NORM("norm_added_k", norm_added_k),
    IMG_TENSORS_END,
};

static int dit_load(img_ctx *c, void *model) {
    dit_t *m = model;
    int D = m->dim = m->heads * m->head_dim;
    m->ffn = 4 * D;
    m->dim2 = 2 * D;
    m->dim6 = 6 * D;
    m->out4 = 4 * m->out_ch;
    m->time_proj = 256;
    if (m->axes[0] + m->axes[1] + m->axes[2] != m->head_dim)
        return img_fail(c, "axes_dims_rope must sum to attention_head_dim %d", m->head_dim);
    m->B = img_alloc(c, sizeof(dit_block_t) * (size_t)m->layers);
    return img_load(c, m, m, dit_tensors, "", 0, 0) ||
           img_load_layers(c, m->B, m, dit_block_tensors, "", m->layers, sizeof *m->B) ? -1 : 0;
}

static void dit_free(void *model) {
    dit_t *m = model;
    img_free_layers(m->B, m, dit_block_tensors, m->layers, sizeof *m->B);
    img_free(m, m, dit_tensors);
}

/* x[i] += gate * y[i] for n rows of D (the blocks' gated residuals). */
static void gated_add(float *x, const float *gate, const float *y, int n, int D) {
    for (int i = 0; i < n; i++)
        for (int d = 0; d < D; d++) x[(size_t)i * D + d] += gate[d] * y[(size_t)i * D + d];
}

/* One stream's feed-forward: x += gate * fc2(gelu_tanh(fc1(norm(x) * (1 + scale) + shift))), with mod pointing
 * at that stream's (shift, scale, gate) for the second half of the block. */
static void feed_forward(float *x, int n, int D, int F, const float *mod, const linear_t *fc1, const linear_t *fc2,
                         float *nrm, float *ff, float *tmp) {
    norm_modulate(nrm, x, n, D, mod, mod + D, 1e-6f);
    linear(fc1, ff, nrm, n);
    for (size_t i = 0; i < (size_t)n * F; i++) ff[i] = gelu_tanh(ff[i]);
    linear(fc2, tmp, ff, n);
    gated_add(x, mod + 2 * D, tmp, n, D);
}

/* The session: header (grid h, w in 2x2 patches, number of texts, each text: len, joint floats), then steps. */
static int dit_forward(img_ctx *c, void *model) {
    const dit_t *m = model;
    img_bufs *b = &c->session;
    int D = m->dim, F = m->ffn, H = m->heads, hd = m->head_dim;
    int32_t gh, gw, ntext;
    if (read_i32(&gh) || read_i32(&gw) || read_i32(&ntext) || gh <= 0 || gw <= 0 || gh > 4096 || gw > 4096 ||
        ntext <= 0 || ntext > 2)
        return img_fail(c, "bad session header");
    int N = gh * gw;
    int32_t tlen[2];
    float *txt[2] = {NULL, NULL}, *txt_cs[2] = {NULL, NULL};
    tlen[1] = 0;
    int max_vid = gh / 2 > gw / 2 ? gh / 2 : gw / 2;
    for (int t = 0; t < ntext; t++) {
        if (read_i32(&tlen[t]) || tlen[t] <= 0 || tlen[t] > 4096) return img_fail(c, "bad text");
        float *raw = img_buf(c, b, (size_t)tlen[t] * m->joint);
        if (!raw) return -1;
        if (read_all(raw, sizeof(float) * (size_t)tlen[t] * m->joint)) return img_fail(c, "short text");
        for (int i = 0; i < tlen[t]; i++)
            cb_rmsnorm(raw + (size_t)i * m->joint, raw + (size_t)i * m->joint, m->txt_norm, m->joint, 1e-6f);
        if (!(txt[t] = img_buf(c, b, (size_t)tlen[t] * D)) || !(txt_cs[t] = img_buf(c, b, (size_t)tlen[t] * hd)))
            return -1;
        linear(&m->txt_in, txt[t], raw, tlen[t]);
        rope_text(txt_cs[t], tlen[t], max_vid, m->axes);
    }
    int maxT = tlen[0] > tlen[1] ? tlen[0] : tlen[1];
    int S = maxT + N;
    float *img_cs = img_buf(c, b, (size_t)N * hd), *lat = img_buf(c, b, (size_t)N * m->in_ch);
    float *img = img_buf(c, b, (size_t)N * D), *tx = img_buf(c, b, (size_t)maxT * D);
    float *nrm = img_buf(c, b, (size_t)S * D), *q = img_buf(c, b, (size_t)S * D), *k = img_buf(c, b, (size_t)S * D),
          *v = img_buf(c, b, (size_t)S * D), *att = img_buf(c, b, (size_t)S * D), *tmp = img_buf(c, b, (size_t)S * D),
          *ff = img_buf(c, b, (size_t)S * F);
    float *tproj = img_buf(c, b, 256), *temb = img_buf(c, b, D), *stemb = img_buf(c, b, D),
          *imod = img_buf(c, b, 6 * D), *tmod = img_buf(c, b, 6 * D), *omod = img_buf(c, b, 2 * D),
          *out = img_buf(c, b, (size_t)N * 4 * m->out_ch);
    if (!img_cs || !lat || !img || !tx || !nrm || !q || !k || !v || !att || !tmp || !ff || !tproj || !temb ||
        !stemb || !imod || !tmod || !omod || !out)
        return -1;
    rope_image(img_cs, gh, gw, 0, m->axes);
    int32_t which;
    float timestep;
    int got;
    while ((got = read_step(c, ntext, (size_t)N * m->in_ch, lat, &which, &timestep)) == 1) {
        int T = tlen[which];
        memcpy(tx, txt[which], sizeof(float) * (size_t)T * D);
        /* Timesteps(256, flip_sin_to_cos, shift 0, scale 1000) of the t/1000 the pipeline passes */
        for (int j = 0; j < 128; j++) {
            float freq = expf(-logf(10000.0f) * (float)j / 128.0f);
            float arg = 1000.0f * (timestep * freq);
            tproj[j] = cosf(arg);
            tproj[128 + j] = sinf(arg);
        }
        linear(&m->t1, temb, tproj, 1);
        for (int d = 0; d < D; d++) temb[d] = temb[d] / (1.0f + expf(-temb[d]));
        linear(&m->t2, stemb, temb, 1);
        for (int d = 0; d < D; d++) temb[d] = stemb[d] / (1.0f + expf(-stemb[d]));   /* silu(temb) feeds mods */
        linear(&m->img_in, img, lat, N);
        for (int l = 0; l < m->layers; l++) {
            const dit_block_t *bl = &m->B[l];
            linear(&bl->img_mod, imod, temb, 1);
            linear(&bl->txt_mod, tmod, temb, 1);
            /* chunks: [shift1, scale1, gate1, shift2, scale2, gate2] */
            norm_modulate(nrm, tx, T, D, tmod, tmod + D, 1e-6f);
            norm_modulate(nrm + (size_t)T * D, img, N, D, imod, imod + D, 1e-6f);
            linear(&bl->add_q, q, nrm, T); linear(&bl->add_k, k, nrm, T); linear(&bl->add_v, v, nrm, T);
            linear(&bl->to_q, q + (size_t)T * D, nrm + (size_t)T * D, N);
            linear(&bl->to_k, k + (size_t)T * D, nrm + (size_t)T * D, N);
            linear(&bl->to_v, v + (size_t)T * D, nrm + (size_t)T * D, N);
            qk_norm_rope(q, T, H, hd, bl->norm_added_q, txt_cs[which], 1e-6f);
            qk_norm_rope(k, T, H, hd, bl->norm_added_k, txt_cs[which], 1e-6f);
            qk_norm_rope(q + (size_t)T * D, N, H, hd, bl->norm_q, img_cs, 1e-6f);
            qk_norm_rope(k + (size_t)T * D, N, H, hd, bl->norm_k, img_cs, 1e-6f);
            if (attention(c, att, q, k, v, T + N, T + N, H, H, hd, D, D, 0)) return -1;
            linear(&bl->to_add_out, tmp, att, T);
            gated_add(tx, tmod + 2 * D, tmp, T, D);
            linear(&bl->to_out, tmp, att + (size_t)T * D, N);
            gated_add(img, imod + 2 * D, tmp, N, D);
            feed_forward(img, N, D, F, imod + 3 * D, &bl->img_fc1, &bl->img_fc2, nrm, ff, tmp);
            feed_forward(tx, T, D, F, tmod + 3 * D, &bl->txt_fc1, &bl->txt_fc2, nrm, ff, tmp);
        }
        /* AdaLayerNormContinuous: chunks (scale, shift) */
        linear(&m->norm_out, omod, temb, 1);
        norm_modulate(nrm, img, N, D, omod + D, omod, 1e-6f);
        linear(&m->proj_out, out, nrm, N);
        if (img_reply(c, NULL, 0, out, (size_t)N * 4 * m->out_ch)) return -1;
    }
    return got < 0 ? -1 : 0;
}

/* ================================================================== vae: AutoencoderKLQwenImage decoder, 1 frame */

static const img_tensor_spec up_tensors[] = {
    IMG_RES_LIST_OF("decoder.up_blocks.%d.resnets.%d", upblock_t, res, upblock_t, out, in, IMG_ALWAYS, nres1),
    IMG_CONV_IF("decoder.up_blocks.%d.upsamplers.0.resample.1", upblock_t, upconv, upblock_t, up_out, out, IMG_NEVER,
                offsetof(upblock_t, up)),
    IMG_TENSORS_END,
};

static int vae_load(img_ctx *c, void *model) { return vae_frame_load(c, model, 1, 3, up_tensors, 1, NULL); }

static void vae_free(void *model) { vae_frame_free(model); }

/* The up blocks of one frame: y [dims[0], h, w] (freed) -> [dims[levels], h * 2^(levels - 1), ...], h and w
 * updated; NULL on failure. */
static float *vae_up(img_ctx *c, const vae_frame_t *v, float *y, int32_t *h, int32_t *w) {
    for (int i = 0; i < v->levels; i++) {
        const upblock_t *u = &v->U[i];
        for (int r = 0; r < u->nres1; r++)
            if (!(y = res_forward(c, &u->res[r], y, *h, *w))) return NULL;
        if (!u->up) continue;
        /* nearest-exact x2, then the 2-D conv (the time conv skips the first frame) */
        float *big = upsample2x(c, y, u->out, *h, *w);
        if (!big) return NULL;
        *h *= 2; *w *= 2;
        y = img_floats(c, (size_t)u->up_out * *h * *w);
        if (!y || conv(c, &u->upconv, y, big, *h, *w)) { free(big); free(y); return NULL; }
        free(big);
    }
    return y;
}

static int vae_forward(img_ctx *c, void *model) {
    const vae_frame_t *v = model;
    int32_t h, w;
    float *y;
    int got;
    while ((got = vae_frame_next(c, v, &h, &w, &y)) == 1) {
        float *img = (y = vae_up(c, v, y, &h, &w)) ? vae_frame_tail(c, v, y, h, w) : NULL;
        if (!img) return -1;
        int32_t hdr[2] = {h, w};
        int rc = img_reply(c, hdr, 2, img, (size_t)3 * h * w);
        free(img);
        if (rc) return -1;
    }
    return got < 0 ? -1 : 0;
}

/* ============================================================================================ the stages */

static const img_stage text_stage = {
    .name = "text", .model_size = sizeof(text_t), .hparams = text_hparams,
    .load_model = text_load, .forward = text_forward, .free_model = text_free,
};
static const img_stage dit_stage = {
    .name = "dit", .model_size = sizeof(dit_t), .hparams = dit_hparams,
    .load_model = dit_load, .forward = dit_forward, .free_model = dit_free,
};
static const img_stage vae_stage = {
    .name = "vae", .model_size = sizeof(vae_frame_t), .hparams = vae_frame_hparams, .f32_only = 1,
    .load_model = vae_load, .forward = vae_forward, .free_model = vae_free,
};

int main(int argc, char **argv) {
    static const img_stage *const stages[] = {&text_stage, &dit_stage, &vae_stage, &dit21_stage, &vae21_stage, NULL};
    return img_main(argc, argv, stages);
}
