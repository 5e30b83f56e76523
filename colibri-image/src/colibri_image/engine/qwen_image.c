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
 */
#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image_ops.h"
#include "kernels.h"

int run_dit21(const args_t *a);
int run_vae21(const args_t *a);

/* ====================================================================== text: Qwen2.5-VL / Qwen3-VL LM */

/* Qwen3-VL differs from Qwen2.5-VL by bias-free q/k/v (bias=0) and an RMSNorm over each head of q and k before the
 * rotation (qk_norm=1); QwenImage21Pipeline reads the last layer's output before the final norm (final_norm=0).
 * Text-only prompts give M-RoPE (interleaved or not) the same position on all three axes: plain RoPE. */
typedef struct {
    float *in_norm, *post_norm, *q_norm, *k_norm;
    linear_t q, k, v, o, gate, up, down;
} text_layer_t;

static int run_text(const args_t *a) {
    int layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    float theta, eps;
    const char *prefix = arg_str(a, "prefix");
    if (!prefix) prefix = "model.language_model.";
    if (arg_int(a, "layers", &layers) || arg_int(a, "hidden", &hidden) || arg_int(a, "heads", &heads) ||
        arg_int(a, "kv_heads", &kv_heads) || arg_int(a, "head_dim", &head_dim) || arg_int(a, "intermediate", &inter) ||
        arg_int(a, "vocab", &vocab) || arg_float(a, "rope_theta", &theta) || arg_float(a, "eps", &eps))
        return -1;
    int qkv_bias = arg_int_or(a, "bias", 1), qk_norm = arg_int_or(a, "qk_norm", 0);
    int with_final_norm = arg_int_or(a, "final_norm", 1);
    char name[256];
    snprintf(name, sizeof name, "%sembed_tokens.weight", prefix);
    const cb_tensor *emb_t = find_matrix(name, vocab, hidden);
    if (!emb_t) return -1;
    text_layer_t *L = xalloc(sizeof(text_layer_t) * (size_t)layers);
    for (int l = 0; l < layers; l++) {
        char p[200];
#define TL(field, sub, r, c, b) \
        snprintf(p, sizeof p, "%slayers.%d.%s", prefix, l, sub); \
        if (load_linear(&L[l].field, p, r, c, b)) return -1;
        TL(q, "self_attn.q_proj", heads * head_dim, hidden, qkv_bias)
        TL(k, "self_attn.k_proj", kv_heads * head_dim, hidden, qkv_bias)
        TL(v, "self_attn.v_proj", kv_heads * head_dim, hidden, qkv_bias)
        TL(o, "self_attn.o_proj", hidden, heads * head_dim, 0)
        TL(gate, "mlp.gate_proj", inter, hidden, 0)
        TL(up, "mlp.up_proj", inter, hidden, 0)
        TL(down, "mlp.down_proj", hidden, inter, 0)
#undef TL
        snprintf(name, sizeof name, "%slayers.%d.input_layernorm.weight", prefix, l);
        if (!(L[l].in_norm = load_f32(name, (size_t)hidden))) return -1;
        snprintf(name, sizeof name, "%slayers.%d.post_attention_layernorm.weight", prefix, l);
        if (!(L[l].post_norm = load_f32(name, (size_t)hidden))) return -1;
        L[l].q_norm = L[l].k_norm = NULL;
        if (qk_norm) {
            snprintf(name, sizeof name, "%slayers.%d.self_attn.q_norm.weight", prefix, l);
            if (!(L[l].q_norm = load_f32(name, (size_t)head_dim))) return -1;
            snprintf(name, sizeof name, "%slayers.%d.self_attn.k_norm.weight", prefix, l);
            if (!(L[l].k_norm = load_f32(name, (size_t)head_dim))) return -1;
        }
    }
    snprintf(name, sizeof name, "%snorm.weight", prefix);
    float *final_norm = load_f32(name, (size_t)hidden);
    if (!final_norm) return -1;
    float *inv_freq = FALLOC(head_dim / 2);
    for (int i = 0; i < head_dim / 2; i++) inv_freq[i] = 1.0f / powf(theta, (float)(2 * i) / (float)head_dim);

    fputs("ready\n", stderr);
    int32_t n;
    while (read_i32(&n) == 0) {
        if (n <= 0 || n > (1 << 16)) { snprintf(g_err, sizeof g_err, "bad token count %d", n); return -1; }
        int32_t *ids = xalloc(sizeof(int32_t) * (size_t)n);
        if (read_all(ids, sizeof(int32_t) * (size_t)n)) { snprintf(g_err, sizeof g_err, "short input"); return -1; }
        size_t qd = (size_t)heads * head_dim, kvd = (size_t)kv_heads * head_dim;
        float *x = FALLOC((size_t)n * hidden), *h = FALLOC((size_t)n * hidden);
        float *q = FALLOC(n * qd), *k = FALLOC(n * kvd), *v = FALLOC(n * kvd), *att = FALLOC(n * qd);
        float *g = FALLOC((size_t)n * inter), *u = FALLOC((size_t)n * inter);
        size_t row_bytes = (size_t)hidden * cb_dtype_size(emb_t->dtype);
        void *row = xalloc(row_bytes);
        for (int i = 0; i < n; i++) {
            if (ids[i] < 0 || ids[i] >= vocab) { snprintf(g_err, sizeof g_err, "token id %d out of range", ids[i]);
                                                 return -1; }
            if (cb_st_pread(&g_idx, emb_t->shard, row, row_bytes, emb_t->offset + (uint64_t)ids[i] * row_bytes,
                            g_err, sizeof g_err)) return -1;
            cb_convert_to_f32(x + (size_t)i * hidden, row, emb_t->dtype, (size_t)hidden);
        }
        for (int l = 0; l < layers; l++) {
            for (int i = 0; i < n; i++) cb_rmsnorm(h + (size_t)i * hidden, x + (size_t)i * hidden, L[l].in_norm,
                                                   hidden, eps);
            linear(&L[l].q, q, h, n);
            linear(&L[l].k, k, h, n);
            linear(&L[l].v, v, h, n);
            if (qk_norm)
                for (int i = 0; i < n; i++) {
                    for (int hh = 0; hh < heads; hh++) {
                        float *qh = q + i * qd + (size_t)hh * head_dim;
                        cb_rmsnorm(qh, qh, L[l].q_norm, head_dim, eps);
                    }
                    for (int hh = 0; hh < kv_heads; hh++) {
                        float *kh = k + i * kvd + (size_t)hh * head_dim;
                        cb_rmsnorm(kh, kh, L[l].k_norm, head_dim, eps);
                    }
                }
            for (int i = 0; i < n; i++) {
                /* text-only positions: M-RoPE's three sections all see position i, which is plain RoPE */
                cb_rope_neox(q + i * qd, heads, head_dim, head_dim, i, inv_freq);
                cb_rope_neox(k + i * kvd, kv_heads, head_dim, head_dim, i, inv_freq);
            }
            attention(att, q, k, v, n, n, heads, kv_heads, head_dim, qd, kvd, 1);
            linear(&L[l].o, h, att, n);
            for (size_t i = 0; i < (size_t)n * hidden; i++) x[i] += h[i];
            for (int i = 0; i < n; i++) cb_rmsnorm(h + (size_t)i * hidden, x + (size_t)i * hidden, L[l].post_norm,
                                                   hidden, eps);
            linear(&L[l].gate, g, h, n);
            linear(&L[l].up, u, h, n);
            cb_silu_mul(g, u, n * inter);
            linear(&L[l].down, h, g, n);
            for (size_t i = 0; i < (size_t)n * hidden; i++) x[i] += h[i];
        }
        if (with_final_norm)
            for (int i = 0; i < n; i++) cb_rmsnorm(h + (size_t)i * hidden, x + (size_t)i * hidden, final_norm, hidden,
                                                   eps);
        else
            memcpy(h, x, sizeof(float) * (size_t)n * hidden);
        int32_t hdr[2] = {n, hidden};
        if (write_all(hdr, sizeof hdr) || write_all(h, sizeof(float) * (size_t)n * hidden)) return -1;
        fflush(stdout);
        free(ids); free(x); free(h); free(q); free(k); free(v); free(att); free(g); free(u); free(row);
    }
    for (int l = 0; l < layers; l++) {
        free_linear(&L[l].q); free_linear(&L[l].k); free_linear(&L[l].v); free_linear(&L[l].o);
        free_linear(&L[l].gate); free_linear(&L[l].up); free_linear(&L[l].down);
        free(L[l].in_norm); free(L[l].post_norm); free(L[l].q_norm); free(L[l].k_norm);
    }
    free(L); free(final_norm); free(inv_freq);
    return 0;
}

/* ============================================================================ dit: QwenImageTransformer2DModel */

typedef struct {
    linear_t img_mod, txt_mod, to_q, to_k, to_v, add_q, add_k, add_v, to_out, to_add_out;
    linear_t img_fc1, img_fc2, txt_fc1, txt_fc2;
    float *norm_q, *norm_k, *norm_added_q, *norm_added_k;
} dit_block_t;

typedef struct {
    int layers, dim, heads, head_dim, in_ch, out_ch, joint, axes[3];
    linear_t t1, t2, img_in, txt_in, norm_out, proj_out;
    float *txt_norm;
    dit_block_t *B;
} dit_t;

static int load_dit(dit_t *m, const args_t *a) {
    if (arg_int(a, "layers", &m->layers) || arg_int(a, "heads", &m->heads) || arg_int(a, "head_dim", &m->head_dim) ||
        arg_int(a, "in_channels", &m->in_ch) || arg_int(a, "out_channels", &m->out_ch) ||
        arg_int(a, "joint_dim", &m->joint) || arg_int(a, "axes0", &m->axes[0]) || arg_int(a, "axes1", &m->axes[1]) ||
        arg_int(a, "axes2", &m->axes[2]))
        return -1;
    int D = m->dim = m->heads * m->head_dim, F = 4 * D;
    if (m->axes[0] + m->axes[1] + m->axes[2] != m->head_dim) {
        snprintf(g_err, sizeof g_err, "axes_dims_rope must sum to attention_head_dim %d", m->head_dim);
        return -1;
    }
    if (load_linear(&m->t1, "time_text_embed.timestep_embedder.linear_1", D, 256, 1) ||
        load_linear(&m->t2, "time_text_embed.timestep_embedder.linear_2", D, D, 1) ||
        load_linear(&m->img_in, "img_in", D, m->in_ch, 1) || load_linear(&m->txt_in, "txt_in", D, m->joint, 1) ||
        load_linear(&m->norm_out, "norm_out.linear", 2 * D, D, 1) ||
        load_linear(&m->proj_out, "proj_out", 4 * m->out_ch, D, 1))
        return -1;
    if (!(m->txt_norm = load_f32("txt_norm.weight", (size_t)m->joint))) return -1;
    m->B = xalloc(sizeof(dit_block_t) * (size_t)m->layers);
    for (int l = 0; l < m->layers; l++) {
        dit_block_t *b = &m->B[l];
        char p[200];
#define BL(field, sub, r, c) \
        snprintf(p, sizeof p, "transformer_blocks.%d.%s", l, sub); \
        if (load_linear(&b->field, p, r, c, 1)) return -1;
        BL(img_mod, "img_mod.1", 6 * D, D) BL(txt_mod, "txt_mod.1", 6 * D, D)
        BL(to_q, "attn.to_q", D, D) BL(to_k, "attn.to_k", D, D) BL(to_v, "attn.to_v", D, D)
        BL(add_q, "attn.add_q_proj", D, D) BL(add_k, "attn.add_k_proj", D, D) BL(add_v, "attn.add_v_proj", D, D)
        BL(to_out, "attn.to_out.0", D, D) BL(to_add_out, "attn.to_add_out", D, D)
        BL(img_fc1, "img_mlp.net.0.proj", F, D) BL(img_fc2, "img_mlp.net.2", D, F)
        BL(txt_fc1, "txt_mlp.net.0.proj", F, D) BL(txt_fc2, "txt_mlp.net.2", D, F)
#undef BL
#define BN(field, sub) \
        snprintf(p, sizeof p, "transformer_blocks.%d.attn.%s.weight", l, sub); \
        if (!(b->field = load_f32(p, (size_t)m->head_dim))) return -1;
        BN(norm_q, "norm_q") BN(norm_k, "norm_k") BN(norm_added_q, "norm_added_q") BN(norm_added_k, "norm_added_k")
#undef BN
    }
    return 0;
}

static void free_dit(dit_t *m) {
    linear_t *top[] = {&m->t1, &m->t2, &m->img_in, &m->txt_in, &m->norm_out, &m->proj_out};
    for (size_t i = 0; i < sizeof top / sizeof *top; i++) free_linear(top[i]);
    for (int l = 0; l < m->layers; l++) {
        dit_block_t *b = &m->B[l];
        linear_t *ls[] = {&b->img_mod, &b->txt_mod, &b->to_q, &b->to_k, &b->to_v, &b->add_q, &b->add_k, &b->add_v,
                          &b->to_out, &b->to_add_out, &b->img_fc1, &b->img_fc2, &b->txt_fc1, &b->txt_fc2};
        for (size_t i = 0; i < sizeof ls / sizeof *ls; i++) free_linear(ls[i]);
        free(b->norm_q); free(b->norm_k); free(b->norm_added_q); free(b->norm_added_k);
    }
    free(m->B);
    free(m->txt_norm);
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

static int run_dit(const args_t *a) {
    dit_t m;
    memset(&m, 0, sizeof m);
    if (load_dit(&m, a)) return -1;
    int D = m.dim, F = 4 * D, H = m.heads, hd = m.head_dim;
    fputs("ready\n", stderr);
    /* session header: grid h, w (in 2x2 patches), number of texts, then each text (len, joint floats) */
    int32_t gh, gw, ntext;
    if (read_i32(&gh) || read_i32(&gw) || read_i32(&ntext) || gh <= 0 || gw <= 0 || gh > 4096 || gw > 4096 ||
        ntext <= 0 || ntext > 2) {
        snprintf(g_err, sizeof g_err, "bad session header");
        return -1;
    }
    int N = gh * gw;
    int32_t tlen[2];
    float *txt[2] = {NULL, NULL}, *txt_cs[2] = {NULL, NULL};
    tlen[1] = 0;
    int max_vid = gh / 2 > gw / 2 ? gh / 2 : gw / 2;
    for (int t = 0; t < ntext; t++) {
        if (read_i32(&tlen[t]) || tlen[t] <= 0 || tlen[t] > 4096) { snprintf(g_err, sizeof g_err, "bad text");
                                                                    return -1; }
        float *raw = FALLOC((size_t)tlen[t] * m.joint);
        if (read_all(raw, sizeof(float) * (size_t)tlen[t] * m.joint)) { snprintf(g_err, sizeof g_err, "short text");
                                                                         return -1; }
        for (int i = 0; i < tlen[t]; i++) cb_rmsnorm(raw + (size_t)i * m.joint, raw + (size_t)i * m.joint,
                                                     m.txt_norm, m.joint, 1e-6f);
        txt[t] = FALLOC((size_t)tlen[t] * D);
        linear(&m.txt_in, txt[t], raw, tlen[t]);
        free(raw);
        txt_cs[t] = FALLOC((size_t)tlen[t] * hd);
        rope_text(txt_cs[t], tlen[t], max_vid, m.axes);
    }
    float *img_cs = FALLOC((size_t)N * hd);
    rope_image(img_cs, gh, gw, 0, m.axes);
    int maxT = tlen[0] > tlen[1] ? tlen[0] : tlen[1];
    int S = maxT + N;
    float *lat = FALLOC((size_t)N * m.in_ch), *img = FALLOC((size_t)N * D), *tx = FALLOC((size_t)maxT * D);
    float *nrm = FALLOC((size_t)S * D), *q = FALLOC((size_t)S * D), *k = FALLOC((size_t)S * D),
          *v = FALLOC((size_t)S * D), *att = FALLOC((size_t)S * D), *tmp = FALLOC((size_t)S * D),
          *ff = FALLOC((size_t)S * F);
    float *tproj = FALLOC(256), *temb = FALLOC(D), *stemb = FALLOC(D), *imod = FALLOC(6 * D),
          *tmod = FALLOC(6 * D), *omod = FALLOC(2 * D), *out = FALLOC((size_t)N * 4 * m.out_ch);
    int32_t which;
    float timestep;
    int got;
    while ((got = read_step(ntext, (size_t)N * m.in_ch, lat, &which, &timestep)) == 1) {
        int T = tlen[which];
        memcpy(tx, txt[which], sizeof(float) * (size_t)T * D);
        /* Timesteps(256, flip_sin_to_cos, shift 0, scale 1000) of the t/1000 the pipeline passes */
        for (int j = 0; j < 128; j++) {
            float freq = expf(-logf(10000.0f) * (float)j / 128.0f);
            float arg = 1000.0f * (timestep * freq);
            tproj[j] = cosf(arg);
            tproj[128 + j] = sinf(arg);
        }
        linear(&m.t1, temb, tproj, 1);
        for (int d = 0; d < D; d++) temb[d] = temb[d] / (1.0f + expf(-temb[d]));
        linear(&m.t2, stemb, temb, 1);
        for (int d = 0; d < D; d++) temb[d] = stemb[d] / (1.0f + expf(-stemb[d]));   /* silu(temb) feeds mods */
        linear(&m.img_in, img, lat, N);
        for (int l = 0; l < m.layers; l++) {
            dit_block_t *b = &m.B[l];
            linear(&b->img_mod, imod, temb, 1);
            linear(&b->txt_mod, tmod, temb, 1);
            /* chunks: [shift1, scale1, gate1, shift2, scale2, gate2] */
            norm_modulate(nrm, tx, T, D, tmod, tmod + D, 1e-6f);
            norm_modulate(nrm + (size_t)T * D, img, N, D, imod, imod + D, 1e-6f);
            linear(&b->add_q, q, nrm, T); linear(&b->add_k, k, nrm, T); linear(&b->add_v, v, nrm, T);
            linear(&b->to_q, q + (size_t)T * D, nrm + (size_t)T * D, N);
            linear(&b->to_k, k + (size_t)T * D, nrm + (size_t)T * D, N);
            linear(&b->to_v, v + (size_t)T * D, nrm + (size_t)T * D, N);
            qk_norm_rope(q, T, H, hd, b->norm_added_q, txt_cs[which], 1e-6f);
            qk_norm_rope(k, T, H, hd, b->norm_added_k, txt_cs[which], 1e-6f);
            qk_norm_rope(q + (size_t)T * D, N, H, hd, b->norm_q, img_cs, 1e-6f);
            qk_norm_rope(k + (size_t)T * D, N, H, hd, b->norm_k, img_cs, 1e-6f);
            attention(att, q, k, v, T + N, T + N, H, H, hd, D, D, 0);
            linear(&b->to_add_out, tmp, att, T);
            gated_add(tx, tmod + 2 * D, tmp, T, D);
            linear(&b->to_out, tmp, att + (size_t)T * D, N);
            gated_add(img, imod + 2 * D, tmp, N, D);
            feed_forward(img, N, D, F, imod + 3 * D, &b->img_fc1, &b->img_fc2, nrm, ff, tmp);
            feed_forward(tx, T, D, F, tmod + 3 * D, &b->txt_fc1, &b->txt_fc2, nrm, ff, tmp);
        }
        /* AdaLayerNormContinuous: chunks (scale, shift) */
        linear(&m.norm_out, omod, temb, 1);
        norm_modulate(nrm, img, N, D, omod + D, omod, 1e-6f);
        linear(&m.proj_out, out, nrm, N);
        if (write_all(out, sizeof(float) * (size_t)N * 4 * m.out_ch)) return -1;
        fflush(stdout);
    }
    if (got < 0) return -1;
    float *scratch[] = {img_cs, lat, img, tx, nrm, q, k, v, att, tmp, ff, tproj, temb, stemb, imod, tmod,
                        omod, out, txt[0], txt[1], txt_cs[0], txt_cs[1]};
    for (size_t i = 0; i < sizeof scratch / sizeof *scratch; i++) free(scratch[i]);
    free_dit(&m);
    return 0;
}

/* ================================================================== vae: AutoencoderKLQwenImage decoder, 1 frame */

static int run_vae(const args_t *a) {
    vae_frame_t v;
    if (vae_frame_load(&v, a, 1, 3)) return -1;
    int L = v.levels, nres = v.nres;
    resblock_t *res = xalloc(sizeof(resblock_t) * (size_t)L * (nres + 1));
    conv_t *ups = xalloc(sizeof(conv_t) * (size_t)L);
    for (int i = 0; i < L; i++) {
        int in = v.dims[i], out = v.dims[i + 1];
        if (i > 0) in /= 2;
        for (int r = 0; r <= nres; r++) {
            char p[128];
            snprintf(p, sizeof p, "decoder.up_blocks.%d.resnets.%d", i, r);
            if (load_res(&res[i * (nres + 1) + r], p, r == 0 ? in : out, out, 1)) return -1;
        }
        if (i != L - 1) {
            char p[128];
            snprintf(p, sizeof p, "decoder.up_blocks.%d.upsamplers.0.resample.1", i);
            if (load_conv(&ups[i], p, out, out / 2, 0)) return -1;
        }
    }
    fputs("ready\n", stderr);
    int32_t h, w;
    float *y;
    int got;
    while ((got = vae_frame_next(&v, &h, &w, &y)) == 1) {
        for (int i = 0; i < L; i++) {
            for (int r = 0; r <= nres; r++) y = res_forward(&res[i * (nres + 1) + r], y, h, w);
            if (i != L - 1) {   /* nearest-exact x2, then the 2-D conv (the time conv skips the first frame) */
                int C = v.dims[i + 1];
                float *big = upsample2x(y, C, h, w);
                h *= 2; w *= 2;
                y = FALLOC((size_t)(C / 2) * h * w);
                conv(&ups[i], y, big, h, w);
                free(big);
            }
        }
        float *img = vae_frame_tail(&v, y, h, w);
        int32_t hdr[2] = {h, w};
        if (write_all(hdr, sizeof hdr) || write_all(img, sizeof(float) * (size_t)3 * h * w)) return -1;
        fflush(stdout);
        free(img);
    }
    if (got < 0) return -1;
    for (int i = 0; i < L; i++) {
        for (int r = 0; r <= nres; r++) free_res(&res[i * (nres + 1) + r]);
        if (i != L - 1) free_conv(&ups[i]);
    }
    free(res); free(ups);
    vae_frame_free(&v);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s text|dit|vae|dit21|vae21 COMPONENT_DIR [key=value...]\n", argv[0]);
        return 2;
    }
    args_t a = {0};
    int threads = 0;
    for (int i = 3; i < argc && a.n < MAX_ARGS; i++) {
        char *eq = strchr(argv[i], '=');
        if (!eq) { fprintf(stderr, "error: argument %s is not key=value\n", argv[i]); return 2; }
        *eq = 0;
        a.key[a.n] = argv[i];
        a.val[a.n++] = eq + 1;
        if (!strcmp(argv[i], "threads")) threads = atoi(eq + 1);
        if (!strcmp(argv[i], "int8")) g_int8 = atoi(eq + 1) != 0;
    }
    if (cb_st_open(&g_idx, argv[2], g_err, sizeof g_err)) { fprintf(stderr, "error: %s\n", g_err); return 1; }
    cb_threads_init(threads);
    /* volatile: read again after a longjmp from oom() */
    volatile int rc = -1;
    if (setjmp(g_oom) == 0) {
        if (!strcmp(argv[1], "text")) rc = run_text(&a);
        else if (!strcmp(argv[1], "dit")) rc = run_dit(&a);
        else if (!strcmp(argv[1], "vae")) { g_int8 = 0; rc = run_vae(&a); }
        else if (!strcmp(argv[1], "dit21")) rc = run_dit21(&a);
        else if (!strcmp(argv[1], "vae21")) { g_int8 = 0; rc = run_vae21(&a); }
        else snprintf(g_err, sizeof g_err, "unknown stage %s", argv[1]);
    }   /* else: out of memory, g_err says how much; the process ends here and the OS takes the stage's memory */
    cb_st_close(&g_idx);
    if (rc) { fprintf(stderr, "error: %s\n", g_err); return 1; }
    report_peak_rss();
    return 0;
}
