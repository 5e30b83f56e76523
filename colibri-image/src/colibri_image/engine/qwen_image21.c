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
    int layers, dim, heads, head_dim, in_ch, out_ch, joint, ffn, axes[3], causal;
    float eps;
    linear_t t1, t2, txt_in1, txt_in2, img_in, modulation, norm_out, proj_out;
    float *txt_norm;   /* the zero-centred weight plus one */
    dit21_block_t *B;
} dit21_t;

static int load_dit21(dit21_t *m, const args_t *a) {
    int mlp_ratio;
    if (arg_int(a, "layers", &m->layers) || arg_int(a, "heads", &m->heads) || arg_int(a, "head_dim", &m->head_dim) ||
        arg_int(a, "in_channels", &m->in_ch) || arg_int(a, "out_channels", &m->out_ch) ||
        arg_int(a, "joint_dim", &m->joint) || arg_int(a, "mlp_ratio", &mlp_ratio) || arg_float(a, "eps", &m->eps) ||
        arg_int(a, "axes0", &m->axes[0]) || arg_int(a, "axes1", &m->axes[1]) || arg_int(a, "axes2", &m->axes[2]))
        return -1;
    m->causal = arg_int_or(a, "causal_condition", 1);
    int D = m->dim = m->heads * m->head_dim;
    int F = m->ffn = D * mlp_ratio;
    if (m->axes[0] + m->axes[1] + m->axes[2] != m->head_dim) {
        snprintf(g_err, sizeof g_err, "axes_dims_rope must sum to attention_head_dim %d", m->head_dim);
        return -1;
    }
    if (load_linear(&m->t1, "time_text_embed.timestep_embedder.linear_1", D, 256, 0) ||
        load_linear(&m->t2, "time_text_embed.timestep_embedder.linear_2", D, D, 0) ||
        load_linear(&m->txt_in1, "txt_in.in_layer", D, m->joint, 0) ||
        load_linear(&m->txt_in2, "txt_in.out_layer", D, D, 0) || load_linear(&m->img_in, "img_in", D, m->in_ch, 0) ||
        load_linear(&m->modulation, "modulation.1", 4 * D, D, 0) ||
        load_linear(&m->norm_out, "norm_out.linear", D, D, 0) || load_linear(&m->proj_out, "proj_out", m->out_ch, D, 0))
        return -1;
    if (!(m->txt_norm = load_f32("txt_in.text_norm.weight", (size_t)m->joint))) return -1;
    for (int i = 0; i < m->joint; i++) m->txt_norm[i] += 1.0f;
    m->B = xalloc(sizeof(dit21_block_t) * (size_t)m->layers);
    for (int l = 0; l < m->layers; l++) {
        dit21_block_t *b = &m->B[l];
        char p[200];
#define BL(field, sub, r, c) \
        snprintf(p, sizeof p, "transformer_blocks.%d.%s", l, sub); \
        if (load_linear(&b->field, p, r, c, 0)) return -1;
        BL(to_q, "attn.to_q", D, D) BL(to_k, "attn.to_k", D, D) BL(to_v, "attn.to_v", D, D)
        BL(to_out, "attn.to_out.0", D, D)
        BL(proj, "img_mlp.proj", F, D) BL(gate, "img_mlp.gate_layer", F, D) BL(out, "img_mlp.out", D, F)
#undef BL
        snprintf(p, sizeof p, "transformer_blocks.%d.attn.norm_q.weight", l);
        if (!(b->norm_q = load_f32(p, (size_t)m->head_dim))) return -1;
        snprintf(p, sizeof p, "transformer_blocks.%d.attn.norm_k.weight", l);
        if (!(b->norm_k = load_f32(p, (size_t)m->head_dim))) return -1;
    }
    return 0;
}

static void free_dit21(dit21_t *m) {
    linear_t *top[] = {&m->t1, &m->t2, &m->txt_in1, &m->txt_in2, &m->img_in, &m->modulation, &m->norm_out,
                       &m->proj_out};
    for (size_t i = 0; i < sizeof top / sizeof *top; i++) free_linear(top[i]);
    for (int l = 0; l < m->layers; l++) {
        dit21_block_t *b = &m->B[l];
        linear_t *ls[] = {&b->to_q, &b->to_k, &b->to_v, &b->to_out, &b->proj, &b->gate, &b->out};
        for (size_t i = 0; i < sizeof ls / sizeof *ls; i++) free_linear(ls[i]);
        free(b->norm_q); free(b->norm_k);
    }
    free(m->B);
    free(m->txt_norm);
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* The conditioning of one timestep (t in [0, 1] as the pipeline passes it): temb, and the shared modulation
 * [scale1, gate1, scale2, gate2] of silu(temb). */
typedef struct {
    float *temb, *mod;
} cond_t;

static void condition(const dit21_t *m, cond_t *c, float t) {
    int D = m->dim;
    float proj[256], *h = FALLOC(D), *s = FALLOC(D);
    float scaled = 1000.0f * t;   /* QwenImage21TemporalTimesteps: cos half first, then sin */
    for (int j = 0; j < 128; j++) {
        float arg = scaled * expf(-logf(10000.0f) * (float)j / 128.0f);
        proj[j] = cosf(arg);
        proj[128 + j] = sinf(arg);
    }
    linear(&m->t1, h, proj, 1);
    for (int d = 0; d < D; d++) h[d] = silu(h[d]);
    linear(&m->t2, c->temb, h, 1);
    for (int d = 0; d < D; d++) s[d] = silu(c->temb[d]);
    linear(&m->modulation, c->mod, s, 1);
    free(h);
    free(s);
}

/* The activations one block pass needs, for up to n tokens (and S keys). */
typedef struct {
    float *nrm, *q, *k, *v, *att, *tmp, *g, *u, *zero;
} scratch21_t;

static void scratch21_init(scratch21_t *s, const dit21_t *m, int n, int S) {
    int D = m->dim;
    s->nrm = FALLOC((size_t)n * D); s->q = FALLOC((size_t)n * D); s->att = FALLOC((size_t)n * D);
    s->k = FALLOC((size_t)S * D); s->v = FALLOC((size_t)S * D); s->tmp = FALLOC((size_t)n * D);
    s->g = FALLOC((size_t)n * m->ffn); s->u = FALLOC((size_t)n * m->ffn); s->zero = FALLOC(D);
}

static void scratch21_free(scratch21_t *s) {
    float *all[] = {s->nrm, s->q, s->k, s->v, s->att, s->tmp, s->g, s->u, s->zero};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) free(all[i]);
}

/* x += tanh(gate) * y over n rows of D */
static void tanh_gated_add(float *x, const float *gate, const float *y, int n, int D) {
    for (int i = 0; i < n; i++)
        for (int d = 0; d < D; d++) x[(size_t)i * D + d] += tanhf(gate[d]) * y[(size_t)i * D + d];
}

/* One block over n tokens x [n, D] whose keys and values go to rows [past, past + n) of s->k / s->v, the rows before
 * them already holding the prefix's. causal: text (attends to its own past), else the image (attends to all).
 * Text keys/values of this block are also copied to kv_out when given (the prefix cache). */
static void block21(const dit21_t *m, const dit21_block_t *b, float *x, int n, int past, const float *mod,
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
    if (causal) attention(s->att, s->q, k, v, n, n, H, H, hd, D, D, 1);
    else attention(s->att, s->q, s->k, s->v, n, past + n, H, H, hd, D, D, 0);
    linear(&b->to_out, s->tmp, s->att, n);
    tanh_gated_add(x, mod + D, s->tmp, n, D);
    if (!mlp) return;   /* the text's last block feeds nothing the image reads */
    norm_modulate(s->nrm, x, n, D, s->zero, mod + 2 * D, m->eps);
    linear(&b->gate, s->g, s->nrm, n);
    linear(&b->proj, s->u, s->nrm, n);
    cb_silu_mul(s->g, s->u, (size_t)n * F);
    linear(&b->out, s->tmp, s->g, n);
    tanh_gated_add(x, mod + 3 * D, s->tmp, n, D);
}

/* One text's per-block keys and values (post norm and rotation), [layers][T][D] each. */
typedef struct {
    int T;
    float *proj;       /* txt_in(text): the prefix's input, kept to recompute it without causal_condition */
    float *cs;         /* rotations [T][head_dim] */
    float *k, *v;
} prefix21_t;

static void prefix21_fill(const dit21_t *m, prefix21_t *p, const float *mod, scratch21_t *s) {
    int D = m->dim;
    size_t per = (size_t)p->T * D;
    float *x = FALLOC(per);
    memcpy(x, p->proj, sizeof(float) * per);
    for (int l = 0; l < m->layers; l++)
        block21(m, &m->B[l], x, p->T, 0, mod, p->cs, 1, s, p->k + l * per, p->v + l * per, l + 1 < m->layers);
    free(x);
}

int run_dit21(const args_t *a) {
    dit21_t m;
    memset(&m, 0, sizeof m);
    if (load_dit21(&m, a)) return -1;
    int D = m.dim, hd = m.head_dim;
    fputs("ready\n", stderr);
    /* session header: latent grid h, w (one token per latent pixel), number of texts, each text (len, floats) */
    int32_t gh, gw, ntext;
    if (read_i32(&gh) || read_i32(&gw) || read_i32(&ntext) || gh <= 0 || gw <= 0 || gh > 1024 || gw > 1024 ||
        ntext <= 0 || ntext > 2) {
        snprintf(g_err, sizeof g_err, "bad session header");
        return -1;
    }
    int N = gh * gw, maxT = 0;
    prefix21_t P[2];
    memset(P, 0, sizeof P);
    for (int t = 0; t < ntext; t++) {
        int32_t T;
        if (read_i32(&T) || T <= 0 || T > 8192) { snprintf(g_err, sizeof g_err, "bad text"); return -1; }
        P[t].T = T;
        maxT = T > maxT ? T : maxT;
        float *raw = FALLOC((size_t)T * m.joint), *h = FALLOC((size_t)T * D);
        if (read_all(raw, sizeof(float) * (size_t)T * m.joint)) { snprintf(g_err, sizeof g_err, "short text");
                                                                  return -1; }
        for (int i = 0; i < T; i++) cb_rmsnorm(raw + (size_t)i * m.joint, raw + (size_t)i * m.joint, m.txt_norm,
                                               m.joint, m.eps);
        linear(&m.txt_in1, h, raw, T);
        for (size_t i = 0; i < (size_t)T * D; i++) h[i] = gelu_tanh(h[i]);
        P[t].proj = FALLOC((size_t)T * D);
        linear(&m.txt_in2, P[t].proj, h, T);
        free(raw); free(h);
        P[t].cs = FALLOC((size_t)T * hd);
        rope_text(P[t].cs, T, 0, m.axes);   /* text advances one shared position on all three axes */
        P[t].k = FALLOC((size_t)m.layers * T * D);
        P[t].v = FALLOC((size_t)m.layers * T * D);
    }
    int S = maxT + N, rows = maxT > N ? maxT : N;
    scratch21_t s;
    scratch21_init(&s, &m, rows, S);
    cond_t c0 = {FALLOC(D), FALLOC(4 * D)}, ct = {FALLOC(D), FALLOC(4 * D)};
    condition(&m, &c0, 0.0f);
    if (m.causal)
        for (int t = 0; t < ntext; t++) prefix21_fill(&m, &P[t], c0.mod, &s);
    /* image rotations depend on the text length (the frame axis sits where the text ends) */
    float *img_cs[2] = {NULL, NULL};
    for (int t = 0; t < ntext; t++) {
        img_cs[t] = FALLOC((size_t)N * hd);
        rope_image(img_cs[t], gh, gw, P[t].T, m.axes);
    }
    float *lat = FALLOC((size_t)N * m.in_ch), *img = FALLOC((size_t)N * D), *sc = FALLOC(D),
          *out = FALLOC((size_t)N * m.out_ch);
    int32_t which;
    float timestep;
    int got;
    while ((got = read_step(ntext, (size_t)N * m.in_ch, lat, &which, &timestep)) == 1) {
        prefix21_t *p = &P[which];
        condition(&m, &ct, timestep);
        if (!m.causal) prefix21_fill(&m, p, ct.mod, &s);
        linear(&m.img_in, img, lat, N);
        size_t per = (size_t)p->T * D;
        for (int l = 0; l < m.layers; l++) {
            memcpy(s.k, p->k + l * per, sizeof(float) * per);
            memcpy(s.v, p->v + l * per, sizeof(float) * per);
            block21(&m, &m.B[l], img, N, p->T, ct.mod, img_cs[which], 0, &s, NULL, NULL, 1);
        }
        /* QwenImage21AdaLayerNormContinuous: scale only */
        float *st = FALLOC(D);
        for (int d = 0; d < D; d++) st[d] = silu(ct.temb[d]);
        linear(&m.norm_out, sc, st, 1);
        free(st);
        norm_modulate(s.nrm, img, N, D, s.zero, sc, m.eps);
        linear(&m.proj_out, out, s.nrm, N);
        if (write_all(out, sizeof(float) * (size_t)N * m.out_ch)) return -1;
        fflush(stdout);
    }
    if (got < 0) return -1;
    for (int t = 0; t < ntext; t++) {
        free(P[t].proj); free(P[t].cs); free(P[t].k); free(P[t].v); free(img_cs[t]);
    }
    free(c0.temb); free(c0.mod); free(ct.temb); free(ct.mod);
    free(lat); free(img); free(sc); free(out);
    scratch21_free(&s);
    free_dit21(&m);
    return 0;
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
    int in, out, up, ft;
    resblock_t *res;
    conv_t upconv;
} upblock21_t;

int run_vae21(const args_t *a) {
    /* out_channels counts the patchified channels (diffusers unpatchifies conv_out's output) */
    int rows, out_ch, patch = arg_int_or(a, "patch", 1);
    if (arg_int(a, "out_channels", &rows)) return -1;
    if (patch < 1 || patch > 8 || rows < 1 || rows % (patch * patch)) {
        snprintf(g_err, sizeof g_err, "out_channels=%d is not a multiple of patch_size^2 (patch %d)", rows, patch);
        return -1;
    }
    out_ch = rows / (patch * patch);
    vae_frame_t v;
    if (vae_frame_load(&v, a, 0, rows)) return -1;
    upblock21_t U[8];
    for (int i = 0; i < v.levels; i++) {
        upblock21_t *u = &U[i];
        char key[32], p[128];
        u->in = v.dims[i];
        u->out = v.dims[i + 1];
        u->up = i != v.levels - 1;
        snprintf(key, sizeof key, "tup%d", i);
        u->ft = u->up && arg_int_or(a, key, 0) ? 2 : 1;
        if (u->up && (u->out * u->ft * 4) % u->in) {
            snprintf(g_err, sizeof g_err, "up block %d: %d channels cannot repeat into %d", i, u->in, u->out);
            return -1;
        }
        u->res = xalloc(sizeof(resblock_t) * (size_t)(v.nres + 1));
        for (int r = 0; r <= v.nres; r++) {
            snprintf(p, sizeof p, "decoder.up_blocks.%d.resnets.%d", i, r);
            if (load_res(&u->res[r], p, r == 0 ? u->in : u->out, u->out, 0)) return -1;
        }
        snprintf(p, sizeof p, "decoder.up_blocks.%d.upsampler.resample.1", i);
        if (u->up && load_conv(&u->upconv, p, u->out, u->out, 0)) return -1;
    }
    fputs("ready\n", stderr);
    int32_t h, w;
    float *y;
    int got;
    while ((got = vae_frame_next(&v, &h, &w, &y)) == 1) {
        for (int i = 0; i < v.levels; i++) {
            upblock21_t *u = &U[i];
            float *copy = NULL;
            if (u->up) {
                copy = FALLOC((size_t)u->in * h * w);
                memcpy(copy, y, sizeof(float) * (size_t)u->in * h * w);
            }
            for (int r = 0; r <= v.nres; r++) y = res_forward(&u->res[r], y, h, w);
            if (!u->up) continue;
            float *big = upsample2x(y, u->out, h, w);   /* nearest-exact x2, then the 3x3 conv */
            y = FALLOC((size_t)u->out * 4 * h * w);
            conv(&u->upconv, y, big, 2 * h, 2 * w);
            free(big);
            dup_up_add(y, copy, u->in, u->out, u->ft, h, w);
            free(copy);
            h *= 2; w *= 2;
        }
        float *raw = vae_frame_tail(&v, y, h, w), *img = FALLOC((size_t)rows * h * w);
        /* unpatchify: channel c * p * p + a * p + b at (y, x) -> channel c at (y * p + b, x * p + a) */
        int H = h * patch, W = w * patch;
        for (int c = 0; c < out_ch; c++)
            for (int pa = 0; pa < patch; pa++)
                for (int pb = 0; pb < patch; pb++)
                    for (int yy = 0; yy < h; yy++)
                        for (int xx = 0; xx < w; xx++)
                            img[((size_t)c * H + yy * patch + pb) * W + xx * patch + pa] =
                                raw[((size_t)((c * patch + pa) * patch + pb) * h + yy) * w + xx];
        free(raw);
        int32_t hdr[3] = {H, W, out_ch};
        if (write_all(hdr, sizeof hdr) || write_all(img, sizeof(float) * (size_t)out_ch * H * W)) return -1;
        fflush(stdout);
        free(img);
    }
    if (got < 0) return -1;
    for (int i = 0; i < v.levels; i++) {
        for (int r = 0; r <= v.nres; r++) free_res(&U[i].res[r]);
        free(U[i].res);
        if (U[i].up) free_conv(&U[i].upconv);
    }
    vae_frame_free(&v);
    return 0;
}
