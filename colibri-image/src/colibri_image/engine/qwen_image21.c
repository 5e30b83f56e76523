/* qwen_image21.c: the transformer and VAE stages of diffusers' QwenImage21Pipeline (its text stage is qwen_image.c's
 * run_text with qk_norm=1 bias=0 final_norm=0).
 *
 * dit21: QwenImage21Transformer2DModel, a single-stream transformer over [text tokens, image tokens] with a
 * block-causal mask: text attends causally to text only, the image attends to everything. With causal_condition the
 * text tokens are modulated from t = 0, so their keys and values do not depend on the step: they are computed once
 * per text at the start of the session (diffusers' KV cache) and each step runs the image tokens only. Without
 * causal_condition the text prefix is recomputed with the step's modulation.
 *
 * vae21: AutoencoderKLQwenImage21's decoder on one frame: 2-D convolutions, residual up blocks whose shortcut
 * duplicates channels into space (DupUp3D), an optional unpatchify, RGBA out.
 *
 * Both are recipes as in qwen_image.c: hyperparameter and tensor tables, a load that walks them, the forward pass.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image_ops.h"
#include "kernels.h"

/* ====================================================================== dit21: QwenImage21Transformer2DModel */

typedef struct {
    linear_t to_q, to_k, to_v, to_out, proj, gate, out;
    float *norm_q, *norm_k;
} dit21_block_t;

typedef struct {
    int layers, heads, head_dim, in_ch, out_ch, joint, mlp_ratio, axes[3], causal;
    float eps;
    int dim, ffn, dim4, time_proj;   /* D, D * mlp_ratio, 4D, 256 */
    linear_t t1, t2, txt_in1, txt_in2, img_in, modulation, norm_out, proj_out;
    float *txt_norm;   /* the zero-centred weight plus one */
    dit21_block_t *B;
} dit21_t;

static const cb_hp_spec dit21_hparams[] = {
    CB_HP_REQ("layers", dit21_t, layers), CB_HP_REQ("heads", dit21_t, heads),
    CB_HP_REQ("head_dim", dit21_t, head_dim), CB_HP_REQ("in_channels", dit21_t, in_ch),
    CB_HP_REQ("out_channels", dit21_t, out_ch), CB_HP_REQ("joint_dim", dit21_t, joint),
    CB_HP_REQ("mlp_ratio", dit21_t, mlp_ratio), IMG_HP_REAL("eps", dit21_t, eps),
    CB_HP_FLAG("causal_condition", dit21_t, causal, 1), IMG_HP_AXES(dit21_t, axes),
    CB_HP_END,
};

#define DIT21_LIN(name, f, rows, cols) IMG_LIN(name, dit21_t, f, dit21_t, rows, cols, IMG_NEVER)
static const img_tensor_spec dit21_tensors[] = {
    DIT21_LIN("time_text_embed.timestep_embedder.linear_1", t1, dim, time_proj),
    DIT21_LIN("time_text_embed.timestep_embedder.linear_2", t2, dim, dim),
    DIT21_LIN("txt_in.in_layer", txt_in1, dim, joint), DIT21_LIN("txt_in.out_layer", txt_in2, dim, dim),
    DIT21_LIN("img_in", img_in, dim, in_ch), DIT21_LIN("modulation.1", modulation, dim4, dim),
    DIT21_LIN("norm_out.linear", norm_out, dim, dim), DIT21_LIN("proj_out", proj_out, out_ch, dim),
    IMG_VEC("txt_in.text_norm.weight", dit21_t, txt_norm, dit21_t, joint),
    IMG_TENSORS_END,
};

#define B21_LIN(name, f, r, c) IMG_LIN("transformer_blocks.%d." name, dit21_block_t, f, dit21_t, r, c, IMG_NEVER)
static const img_tensor_spec dit21_block_tensors[] = {
    B21_LIN("attn.to_q", to_q, dim, dim), B21_LIN("attn.to_k", to_k, dim, dim),
    B21_LIN("attn.to_v", to_v, dim, dim), B21_LIN("attn.to_out.0", to_out, dim, dim),
    B21_LIN("img_mlp.proj", proj, ffn, dim), B21_LIN("img_mlp.gate_layer", gate, ffn, dim),
    B21_LIN("img_mlp.out", out, dim, ffn),
    IMG_VEC("transformer_blocks.%d.attn.norm_q.weight", dit21_block_t, norm_q, dit21_t, head_dim),
    IMG_VEC("transformer_blocks.%d.attn.norm_k.weight", dit21_block_t, norm_k, dit21_t, head_dim),
    IMG_TENSORS_END,
};

static int dit21_load(img_ctx *c, void *model) {
    dit21_t *m = model;
    int D = m->dim = m->heads * m->head_dim;
    m->ffn = D * m->mlp_ratio;
    m->dim4 = 4 * D;
    m->time_proj = 256;
    if (m->axes[0] + m->axes[1] + m->axes[2] != m->head_dim)
        return img_fail(c, "axes_dims_rope must sum to attention_head_dim %d", m->head_dim);
    m->B = img_alloc(c, sizeof(dit21_block_t) * (size_t)m->layers);
    if (img_load(c, m, m, dit21_tensors, "", 0, 0) ||
        img_load_layers(c, m->B, m, dit21_block_tensors, "", m->layers, sizeof *m->B))
        return -1;
    for (int i = 0; i < m->joint; i++) m->txt_norm[i] += 1.0f;
    return 0;
}

static void dit21_free(void *model) {
    dit21_t *m = model;
    img_free_layers(m->B, m, dit21_block_tensors, m->layers, sizeof *m->B);
    img_free(m, m, dit21_tensors);
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* The conditioning of one timestep (t in [0, 1] as the pipeline passes it): temb, and the shared modulation
 * [scale1, gate1, scale2, gate2] of silu(temb). */
typedef struct {
    float *temb, *mod;
} cond_t;

static int condition(img_ctx *c, const dit21_t *m, cond_t *cd, float t) {
    int D = m->dim;
    float proj[256], *h = img_floats(c, D), *s = h ? img_floats(c, D) : NULL;
    if (!s) { free(h); return -1; }
    float scaled = 1000.0f * t;   /* QwenImage21TemporalTimesteps: cos half first, then sin */
    for (int j = 0; j < 128; j++) {
        float arg = scaled * expf(-logf(10000.0f) * (float)j / 128.0f);
        proj[j] = cosf(arg);
        proj[128 + j] = sinf(arg);
    }
    linear(&m->t1, h, proj, 1);
    for (int d = 0; d < D; d++) h[d] = silu(h[d]);
    linear(&m->t2, cd->temb, h, 1);
    for (int d = 0; d < D; d++) s[d] = silu(cd->temb[d]);
    linear(&m->modulation, cd->mod, s, 1);
    free(h);
    free(s);
    return 0;
}

/* The activations one block pass needs, for up to n tokens (and S keys). */
typedef struct {
    float *nrm, *q, *k, *v, *att, *tmp, *g, *u, *zero;
} scratch21_t;

static int scratch21_init(img_ctx *c, img_bufs *b, scratch21_t *s, const dit21_t *m, int n, int S) {
    int D = m->dim;
    s->nrm = img_buf(c, b, (size_t)n * D); s->q = img_buf(c, b, (size_t)n * D); s->att = img_buf(c, b, (size_t)n * D);
    s->k = img_buf(c, b, (size_t)S * D); s->v = img_buf(c, b, (size_t)S * D); s->tmp = img_buf(c, b, (size_t)n * D);
    s->g = img_buf(c, b, (size_t)n * m->ffn); s->u = img_buf(c, b, (size_t)n * m->ffn); s->zero = img_buf(c, b, D);
    return s->nrm && s->q && s->att && s->k && s->v && s->tmp && s->g && s->u && s->zero ? 0 : -1;
}

/* x += tanh(gate) * y over n rows of D */
static void tanh_gated_add(float *x, const float *gate, const float *y, int n, int D) {
    for (int i = 0; i < n; i++)
        for (int d = 0; d < D; d++) x[(size_t)i * D + d] += tanhf(gate[d]) * y[(size_t)i * D + d];
}

/* One block over n tokens x [n, D] whose keys and values go to rows [past, past + n) of s->k / s->v, the rows before
 * them already holding the prefix's. causal: text (attends to its own past), else the image (attends to all).
 * Text keys/values of this block are also copied to kv_out when given (the prefix cache). */
static int block21(img_ctx *c, const dit21_t *m, const dit21_block_t *b, float *x, int n, int past, const float *mod,
                   const float *cs, int causal, scratch21_t *s, float *k_out, float *v_out, int mlp) {
    int D = m->dim, H = m->heads, hd = m->head_dim, F = m->ffn;
    float *k = s->k + (size_t)past * D, *v = s->v + (size_t)past * D;
    norm_modulate(s->nrm, x, n, D, s->zero, mod, m->eps);
    linear(&b->to_q, s->q, s->nrm, n);
    linear(&b->to_k, k, s->nrm, n);
    linear(&b->to_v, v, s->nrm, n);
    qk_norm_rope(s->q, n, H, hd, b->norm_q, cs, m->eps);
    qk_norm_rope(k, n, H, hd, b->norm_k, cs, m->eps);
    if (k_out) {
        memcpy(k_out, k, sizeof(float) * (size_t)n * D);
        memcpy(v_out, v, sizeof(float) * (size_t)n * D);
    }
    if (causal ? attention(c, s->att, s->q, k, v, n, n, H, H, hd, D, D, 1)
               : attention(c, s->att, s->q, s->k, s->v, n, past + n, H, H, hd, D, D, 0))
        return -1;
    linear(&b->to_out, s->tmp, s->att, n);
    tanh_gated_add(x, mod + D, s->tmp, n, D);
    if (!mlp) return 0;   /* the text's last block feeds nothing the image reads */
    norm_modulate(s->nrm, x, n, D, s->zero, mod + 2 * D, m->eps);
    linear(&b->gate, s->g, s->nrm, n);
    linear(&b->proj, s->u, s->nrm, n);
    cb_silu_mul(s->g, s->u, (size_t)n * F);
    linear(&b->out, s->tmp, s->g, n);
    tanh_gated_add(x, mod + 3 * D, s->tmp, n, D);
    return 0;
}

/* One text's per-block keys and values (post norm and rotation), [layers][T][D] each. */
typedef struct {
    int T;
    float *proj;       /* txt_in(text): the prefix's input, kept to recompute it without causal_condition */
    float *cs;         /* rotations [T][head_dim] */
    float *k, *v;
} prefix21_t;

static int prefix21_fill(img_ctx *c, const dit21_t *m, prefix21_t *p, const float *mod, scratch21_t *s) {
    int D = m->dim, rc = 0;
    size_t per = (size_t)p->T * D;
    float *x = img_floats(c, per);
    if (!x) return -1;
    memcpy(x, p->proj, sizeof(float) * per);
    for (int l = 0; l < m->layers && !rc; l++)
        rc = block21(c, m, &m->B[l], x, p->T, 0, mod, p->cs, 1, s, p->k + l * per, p->v + l * per,
                     l + 1 < m->layers);
    free(x);
    return rc;
}

/* One text of the session header (len, joint floats) through txt_in into p, its buffers kept in b. */
static int text21_read(img_ctx *c, const dit21_t *m, prefix21_t *p, img_bufs *b) {
    int D = m->dim, hd = m->head_dim;
    int32_t T;
    if (read_i32(&T) || T <= 0 || T > 8192) return img_fail(c, "bad text");
    p->T = T;
    float *raw = img_buf(c, b, (size_t)T * m->joint), *h = img_buf(c, b, (size_t)T * D);
    if (!raw || !h) return -1;
    if (read_all(raw, sizeof(float) * (size_t)T * m->joint)) return img_fail(c, "short text");
    for (int i = 0; i < T; i++)
        cb_rmsnorm(raw + (size_t)i * m->joint, raw + (size_t)i * m->joint, m->txt_norm, m->joint, m->eps);
    linear(&m->txt_in1, h, raw, T);
    for (size_t i = 0; i < (size_t)T * D; i++) h[i] = gelu_tanh(h[i]);
    if (!(p->proj = img_buf(c, b, (size_t)T * D)) || !(p->cs = img_buf(c, b, (size_t)T * hd)) ||
        !(p->k = img_buf(c, b, (size_t)m->layers * T * D)) || !(p->v = img_buf(c, b, (size_t)m->layers * T * D)))
        return -1;
    linear(&m->txt_in2, p->proj, h, T);
    rope_text(p->cs, T, 0, m->axes);   /* text advances one shared position on all three axes */
    return 0;
}

/* The session: header (latent grid h, w: one token per latent pixel, number of texts, each text), then steps. */
static int dit21_forward(img_ctx *c, void *model) {
    const dit21_t *m = model;
    img_bufs *b = &c->session;
    int D = m->dim, hd = m->head_dim;
    int32_t gh, gw, ntext;
    if (read_i32(&gh) || read_i32(&gw) || read_i32(&ntext) || gh <= 0 || gw <= 0 || gh > 1024 || gw > 1024 ||
        ntext <= 0 || ntext > 2)
        return img_fail(c, "bad session header");
    int N = gh * gw, maxT = 0;
    prefix21_t P[2];
    memset(P, 0, sizeof P);
    for (int t = 0; t < ntext; t++) {
        if (text21_read(c, m, &P[t], b)) return -1;
        maxT = P[t].T > maxT ? P[t].T : maxT;
    }
    int S = maxT + N, rows = maxT > N ? maxT : N;
    scratch21_t s;
    cond_t c0 = {img_buf(c, b, D), img_buf(c, b, 4 * D)}, ct = {img_buf(c, b, D), img_buf(c, b, 4 * D)};
    if (scratch21_init(c, b, &s, m, rows, S) || !c0.temb || !c0.mod || !ct.temb || !ct.mod ||
        condition(c, m, &c0, 0.0f))
        return -1;
    for (int t = 0; m->causal && t < ntext; t++)
        if (prefix21_fill(c, m, &P[t], c0.mod, &s)) return -1;
    /* image rotations depend on the text length (the frame axis sits where the text ends) */
    float *img_cs[2] = {NULL, NULL};
    for (int t = 0; t < ntext; t++) {
        if (!(img_cs[t] = img_buf(c, b, (size_t)N * hd))) return -1;
        rope_image(img_cs[t], gh, gw, P[t].T, m->axes);
    }
    float *lat = img_buf(c, b, (size_t)N * m->in_ch), *img = img_buf(c, b, (size_t)N * D), *sc = img_buf(c, b, D),
          *out = img_buf(c, b, (size_t)N * m->out_ch), *st = img_buf(c, b, D);
    if (!lat || !img || !sc || !out || !st) return -1;
    int32_t which;
    float timestep;
    int got;
    while ((got = read_step(c, ntext, (size_t)N * m->in_ch, lat, &which, &timestep)) == 1) {
        prefix21_t *p = &P[which];
        if (condition(c, m, &ct, timestep) || (!m->causal && prefix21_fill(c, m, p, ct.mod, &s))) return -1;
        linear(&m->img_in, img, lat, N);
        size_t per = (size_t)p->T * D;
        for (int l = 0; l < m->layers; l++) {
            memcpy(s.k, p->k + l * per, sizeof(float) * per);
            memcpy(s.v, p->v + l * per, sizeof(float) * per);
            if (block21(c, m, &m->B[l], img, N, p->T, ct.mod, img_cs[which], 0, &s, NULL, NULL, 1)) return -1;
        }
        /* QwenImage21AdaLayerNormContinuous: scale only */
        for (int d = 0; d < D; d++) st[d] = silu(ct.temb[d]);
        linear(&m->norm_out, sc, st, 1);
        norm_modulate(s.nrm, img, N, D, s.zero, sc, m->eps);
        linear(&m->proj_out, out, s.nrm, N);
        if (img_reply(c, NULL, 0, out, (size_t)N * m->out_ch)) return -1;
    }
    return got < 0 ? -1 : 0;
}

/* ============================================================ vae21: AutoencoderKLQwenImage21 decoder, 1 frame */

/* DupUp3D on the first chunk: output channel o at (2y + sy, 2x + sx) repeats input channel
 * (((o * ft + ft - 1) * 2 + sy) * 2 + sx) / repeats at (y, x), added to y_out [cout, 2h, 2w]. */
static void dup_up_add(float *y_out, const float *x, int cin, int cout, int ft, int h, int w) {
    int repeats = cout * ft * 4 / cin, W2 = 2 * w;
    for (int o = 0; o < cout; o++)
        for (int yy = 0; yy < 2 * h; yy++)
            for (int xx = 0; xx < W2; xx++) {
                int j = ((o * ft + ft - 1) * 2 + yy % 2) * 2 + xx % 2;
                y_out[((size_t)o * 2 * h + yy) * W2 + xx] += x[((size_t)(j / repeats) * h + yy / 2) * w + xx / 2];
            }
}

typedef struct {
    int rows, patch, tup[8];   /* conv_out's (patchified) channels, patch_size, each up block's temporal upsample */
    int out_ch;
    vae_frame_t v;
} vae21_t;

static const cb_hp_spec vae21_hparams[] = {
    CB_HP_REQ("out_channels", vae21_t, rows), CB_HP_OPT("patch", vae21_t, patch, 1, CB_HP_ANY),
    CB_HP_FLAG("tup0", vae21_t, tup[0], 0), CB_HP_FLAG("tup1", vae21_t, tup[1], 0),
    CB_HP_FLAG("tup2", vae21_t, tup[2], 0), CB_HP_FLAG("tup3", vae21_t, tup[3], 0),
    CB_HP_FLAG("tup4", vae21_t, tup[4], 0), CB_HP_FLAG("tup5", vae21_t, tup[5], 0),
    CB_HP_FLAG("tup6", vae21_t, tup[6], 0), CB_HP_FLAG("tup7", vae21_t, tup[7], 0),
    CB_HP_END,
};

static const img_tensor_spec up21_tensors[] = {
    IMG_RES_LIST_OF("decoder.up_blocks.%d.resnets.%d", upblock_t, res, upblock_t, out, in, IMG_NEVER, nres1),
    IMG_CONV_IF("decoder.up_blocks.%d.upsampler.resample.1", upblock_t, upconv, upblock_t, up_out, out, IMG_NEVER,
                offsetof(upblock_t, up)),
    IMG_TENSORS_END,
};

static int vae21_load(img_ctx *c, void *model) {
    /* out_channels counts the patchified channels (diffusers unpatchifies conv_out's output) */
    vae21_t *m = model;
    int patch = m->patch;
    if (patch < 1 || patch > 8 || m->rows % (patch * patch))
        return img_fail(c, "out_channels=%d is not a multiple of patch_size^2 (patch %d)", m->rows, patch);
    m->out_ch = m->rows / (patch * patch);
    if (img_hparams(c, vae_frame_hparams, &m->v) || vae_frame_load(c, &m->v, 0, m->rows, up21_tensors, 0, m->tup))
        return -1;
    for (int i = 0; i + 1 < m->v.levels; i++) {
        const upblock_t *u = &m->v.U[i];
        if ((u->out * u->ft * 4) % u->in)
            return img_fail(c, "up block %d: %d channels cannot repeat into %d", i, u->in, u->out);
    }
    return 0;
}

static void vae21_free(void *model) { vae_frame_free(&((vae21_t *)model)->v); }

/* The up blocks of one frame, as vae's with DupUp3D shortcuts around the upsamplers. */
static float *vae21_up(img_ctx *c, const vae21_t *m, float *y, int32_t *h, int32_t *w) {
    for (int i = 0; i < m->v.levels; i++) {
        const upblock_t *u = &m->v.U[i];
        float *copy = NULL;
        if (u->up) {
            if (!(copy = img_floats(c, (size_t)u->in * *h * *w))) { free(y); return NULL; }
            memcpy(copy, y, sizeof(float) * (size_t)u->in * *h * *w);
        }
        for (int r = 0; r < u->nres1 && y; r++) y = res_forward(c, &u->res[r], y, *h, *w);
        if (!y || !u->up) {
            free(copy);
            if (!y) return NULL;
            continue;
        }
        float *big = upsample2x(c, y, u->out, *h, *w);   /* nearest-exact x2, then the 3x3 conv */
        y = big ? img_floats(c, (size_t)u->out * 4 * *h * *w) : NULL;
        if (!y || conv(c, &u->upconv, y, big, 2 * *h, 2 * *w)) { free(big); free(y); free(copy); return NULL; }
        free(big);
        dup_up_add(y, copy, u->in, u->out, u->ft, *h, *w);
        free(copy);
        *h *= 2; *w *= 2;
    }
    return y;
}

static int vae21_forward(img_ctx *c, void *model) {
    const vae21_t *m = model;
    int32_t h, w;
    float *y;
    int got, patch = m->patch, out_ch = m->out_ch;
    while ((got = vae_frame_next(c, &m->v, &h, &w, &y)) == 1) {
        float *raw = (y = vae21_up(c, m, y, &h, &w)) ? vae_frame_tail(c, &m->v, y, h, w) : NULL;
        float *img = raw ? img_floats(c, (size_t)m->rows * h * w) : NULL;
        if (!img) { free(raw); return -1; }
        /* unpatchify: channel c * p * p + a * p + b at (y, x) -> channel c at (y * p + b, x * p + a) */
        int H = h * patch, W = w * patch;
        for (int ch = 0; ch < out_ch; ch++)
            for (int pa = 0; pa < patch; pa++)
                for (int pb = 0; pb < patch; pb++)
                    for (int yy = 0; yy < h; yy++)
                        for (int xx = 0; xx < w; xx++)
                            img[((size_t)ch * H + yy * patch + pb) * W + xx * patch + pa] =
                                raw[((size_t)((ch * patch + pa) * patch + pb) * h + yy) * w + xx];
        free(raw);
        int32_t hdr[3] = {H, W, out_ch};
        int rc = img_reply(c, hdr, 3, img, (size_t)out_ch * H * W);
        free(img);
        if (rc) return -1;
    }
    return got < 0 ? -1 : 0;
}

/* ============================================================================================ the stages */

const img_stage dit21_stage = {
    .name = "dit21", .model_size = sizeof(dit21_t), .hparams = dit21_hparams,
    .load_model = dit21_load, .forward = dit21_forward, .free_model = dit21_free,
};
const img_stage vae21_stage = {
    .name = "vae21", .model_size = sizeof(vae21_t), .hparams = vae21_hparams, .f32_only = 1,
    .load_model = vae21_load, .forward = vae21_forward, .free_model = vae21_free,
};
