/* blocks.c: see blocks.h. */
#include "blocks.h"
#include "expert_remote.h"
#include "qlinear.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* ---- weights ---- */

int cb_load_linear(cb_linear *l, const cb_st_index *idx, const char *name, int rows, int cols, size_t *bytes,
                   char *err, size_t errlen) {
    memset(l, 0, sizeof *l);
    l->m.rows = rows;
    l->m.cols = cols;
    int qrc = cb_qlinear_load(&l->w, &l->m.q, idx, name, rows, cols, bytes, err, errlen);
    if (qrc <= 0) {   /* loaded quantized from a container, or refused */
        l->m.kind = CB_MAT_INT;
        return qrc;
    }
    int frc = cb_fp8_load(&l->w, &l->m.f8, idx, name, rows, cols, bytes, err, errlen);
    if (frc <= 0) {   /* block-quantized fp8 (a scale companion exists), or refused */
        l->m.kind = CB_MAT_FP8;
        return frc;
    }
    int64_t dims[2] = {rows, cols};
    const cb_tensor *t = cb_st_expect(idx, name, 2, dims, err, errlen);
    if (!t) return -1;
    if (!(l->w = cb_st_load(idx, t, err, errlen))) return -1;
    l->m = cb_matrix_float(l->w, t->dtype, rows, cols);
    if (bytes) *bytes += t->nbytes;
    return 0;
}

int cb_map_linear(cb_linear *l, const cb_st_index *idx, const char *name, int rows, int cols, size_t *bytes,
                  char *err, size_t errlen) {
    memset(l, 0, sizeof *l);
    l->m.rows = rows;
    l->m.cols = cols;
    int qrc = cb_qlinear_map(&l->w, &l->map, &l->map_len, &l->m.q, idx, name, rows, cols, bytes, err, errlen);
    if (qrc <= 0) {
        l->m.kind = CB_MAT_INT;
        return qrc;
    }
    if (cb_fp8_companion(idx, name)) return cb_load_linear(l, idx, name, rows, cols, bytes, err, errlen);
    int64_t dims[2] = {rows, cols};
    const cb_tensor *t = cb_st_expect(idx, name, 2, dims, err, errlen);
    if (!t) return -1;
    const void *at;
    if (t->offset % CB_MAP_ALIGN || cb_st_map(idx, t, &at, &l->map, &l->map_len, err, errlen))
        return cb_load_linear(l, idx, name, rows, cols, bytes, err, errlen);
    l->m = cb_matrix_float(at, t->dtype, rows, cols);
    return 0;
}

int cb_load_vector(float **out, const cb_st_index *idx, const char *name, int n, size_t *bytes, char *err,
                   size_t errlen) {
    int64_t dims[1] = {n};
    const cb_tensor *t = cb_st_expect(idx, name, 1, dims, err, errlen);
    if (!t) return -1;
    return cb_load_f32(out, idx, t, (size_t)n, bytes, err, errlen);
}

int cb_read_f32(float *dst, const cb_st_index *idx, const cb_tensor *t, size_t n, char *err, size_t errlen) {
    void *raw = cb_st_load(idx, t, err, errlen);
    if (!raw) return -1;
    cb_convert_to_f32(dst, raw, t->dtype, n);
    free(raw);
    return 0;
}

int cb_load_f32(float **out, const cb_st_index *idx, const cb_tensor *t, size_t n, size_t *bytes, char *err,
                size_t errlen) {
    *out = malloc(n * sizeof(float));
    if (!*out) {
        snprintf(err, errlen, "out of memory loading %s", t->name);
        return -1;
    }
    if (cb_read_f32(*out, idx, t, n, err, errlen)) {
        free(*out);
        *out = NULL;
        return -1;
    }
    if (bytes) *bytes += n * sizeof(float);
    return 0;
}

static void unmap(cb_linear *l) {
    if (l->map) munmap(l->map, l->map_len);
    l->map = NULL;
    l->map_len = 0;
}

void cb_linear_free(cb_linear *l) {
    free(l->w);
    l->w = NULL;
    unmap(l);
}

int cb_linear_dequantize(cb_linear *l, char *err, size_t errlen) {
    if (l->m.kind == CB_MAT_FLOAT) return 0;
    int rows = l->m.rows, cols = l->m.cols;
    float *w = malloc((size_t)rows * (size_t)cols * sizeof(float) + 1);
    if (!w) {
        snprintf(err, errlen, "out of memory dequantizing a [%d, %d] matrix", rows, cols);
        return -1;
    }
    for (int r = 0; r < rows; r++) cb_matrix_row(w + (size_t)r * (size_t)cols, &l->m, r);
    free(l->w);
    unmap(l);
    l->w = w;
    l->m = cb_matrix_float(w, CB_F32, rows, cols);
    return 0;
}

void cb_linear_apply(const cb_linear *l, float *Y, const float *X, int n) { cb_matrix_apply(&l->m, Y, X, n); }

/* Dequantized per row: level * scale (e4m3 * block scale) is exact in f32. */
void cb_embed(float *out, const cb_linear *emb, int token) { cb_matrix_row(out, &emb->m, token); }

void cb_add_bias(float *y, const float *b, int n, int width) {
    for (int i = 0; b && i < n; i++) cb_add(y + (size_t)i * (size_t)width, b, (size_t)width);
}

void cb_add(float *y, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

void cb_swiglu_clamp(float *gate, float *up, size_t n, float limit) {
    for (size_t i = 0; i < n; i++) {
        gate[i] = gate[i] > limit ? limit : gate[i];
        up[i] = up[i] < -limit ? -limit : up[i] > limit ? limit : up[i];
    }
}

void cb_clamp(float *x, size_t n, float limit) {
    for (size_t i = 0; i < n; i++) x[i] = x[i] < -limit ? -limit : x[i] > limit ? limit : x[i];
}

/* ---- rotary position embedding ---- */

/* YaRN, as transformers' _compute_yarn_parameters: frequencies rotating fewer than beta_slow times over the
 * original context are interpolated (divided by factor), those rotating more than beta_fast times are kept, with
 * a linear ramp between. The cos/sin scale (rope_attention_factor) is resolved by the plugin from the config's
 * attention_factor / mscale / mscale_all_dim, since models disagree on how to derive it. */
static int cb_rope_yarn(cb_rope *r, cb_hparams *hp, int dim, float theta, float factor, int orig_max, char *err,
                        size_t errlen) {
    float beta_fast = 32.0f, beta_slow = 1.0f, attention_factor = 1.0f;
    int truncate = 1;
    if (cb_hp_float_opt(hp, "rope_beta_fast", &beta_fast, err, errlen) ||
        cb_hp_float_opt(hp, "rope_beta_slow", &beta_slow, err, errlen) ||
        cb_hp_bool_opt(hp, "rope_truncate", &truncate, err, errlen) ||
        cb_hp_float_opt(hp, "rope_attention_factor", &attention_factor, err, errlen))
        return -1;
    if (orig_max < 1 || beta_fast <= 0 || beta_slow <= 0 || attention_factor <= 0) {
        snprintf(err, errlen, "--set rope_original_max_position / rope_beta_* / rope_attention_factor out of range");
        return -1;
    }
    /* transformers' ramp has dim/2 entries against ceil(dim/2) frequencies: an odd dim fails there, so here too */
    if (dim % 2) {
        snprintf(err, errlen, "--set partial_rotary_factor: yarn needs an even number of rotary dimensions, "
                              "this one is %d", dim);
        return -1;
    }
    /* the dimension index whose frequency completes `rotations` turns over the original context (in double) */
#define CORRECTION_DIM(rotations) \
    ((double)dim * log((double)orig_max / ((double)(rotations) * 2.0 * M_PI)) / (2.0 * log((double)theta)))
    double low = CORRECTION_DIM(beta_fast), high = CORRECTION_DIM(beta_slow);
#undef CORRECTION_DIM
    if (truncate) {
        low = floor(low);
        high = ceil(high);
    }
    if (low < 0) low = 0;
    if (high > dim - 1) high = dim - 1;
    if (low == high) high += 0.001;
    for (int i = 0; i < dim / 2; i++) {
        float pos_freq = powf(theta, (float)(2 * i) / (float)dim);
        float extrapolated = 1.0f / pos_freq, interpolated = 1.0f / (factor * pos_freq);
        float ramp = ((float)i - (float)low) / (float)(high - low);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        float keep = 1.0f - ramp;
        r->inv_freq[i] = interpolated * (1.0f - keep) + extrapolated * keep;
    }
    r->attention_factor = attention_factor;
    return 0;
}

/* partial_rotary_factor as the double Python holds, so head_dim * partial truncates exactly as int() does there
 * (in float, e.g. 0.7 * 10 and similar products can land on the other side of an integer). */
static int rope_partial(cb_hparams *hp, double *out, char *err, size_t errlen) {
    const char *s = cb_hp_str_opt(hp, "partial_rotary_factor", NULL);
    *out = 1.0;
    if (!s) return 0;
    char *end;
    *out = strtod(s, &end);
    if (end == s || *end || !(*out > 0 && *out <= 1)) {
        snprintf(err, errlen, "--set partial_rotary_factor=%.40s: expected a number in (0, 1]", s);
        return -1;
    }
    return 0;
}

int cb_rope_init(cb_rope *r, cb_hparams *hp, int head_dim, int neox, char *err, size_t errlen) {
    memset(r, 0, sizeof *r);
    float theta = 0, factor = 1.0f, low = 1.0f, high = 4.0f;
    double partial = 1.0;
    int orig_max = 8192;
    if (cb_hp_float(hp, "rope_theta", &theta, err, errlen) || rope_partial(hp, &partial, err, errlen) ||
        cb_hp_float_opt(hp, "rope_factor", &factor, err, errlen) ||
        cb_hp_float_opt(hp, "rope_low_freq_factor", &low, err, errlen) ||
        cb_hp_float_opt(hp, "rope_high_freq_factor", &high, err, errlen) ||
        cb_hp_int_opt(hp, "rope_original_max_position", &orig_max, err, errlen))
        return -1;
    const char *type = cb_hp_str_opt(hp, "rope_type", "default");
    if (theta <= 0 || factor <= 0) {
        snprintf(err, errlen, "--set rope_theta/rope_factor out of range");
        return -1;
    }
    /* transformers: dim = int(head_dim * partial_rotary_factor) sets the frequencies, 1 / theta^(2i / dim) for the
     * even 2i < dim, i.e. ceil(dim / 2) of them; cos/sin are those repeated twice, so 2 * ceil(dim / 2) dims rotate
     * (one more than dim when it is odd), paired (i, i + ceil(dim / 2)) by rotate_half. */
    int dim = (int)((double)head_dim * partial);
    int rot = dim + dim % 2;
    if (dim < 1) {
        snprintf(err, errlen, "--set partial_rotary_factor leaves no dimensions to rotate");
        return -1;
    }
    if (rot > head_dim) {
        snprintf(err, errlen, "--set partial_rotary_factor: %d rotary dimensions rotate %d, more than head_dim %d",
                 dim, rot, head_dim);
        return -1;
    }
    r->neox = neox;
    r->rot_dim = rot;
    r->attention_factor = 1.0f;
    r->inv_freq = malloc((size_t)(rot / 2) * sizeof(float));
    if (!r->inv_freq) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    /* As transformers: inv_freq = 1 / theta^(2i/dim) computed in f32. */
    for (int i = 0; i < rot / 2; i++) {
        float expo = (float)(2 * i) / (float)dim;
        r->inv_freq[i] = 1.0f / powf(theta, expo);
    }
    if (strcmp(type, "default") == 0) return 0;
    if (strcmp(type, "linear") == 0) {
        for (int i = 0; i < rot / 2; i++) r->inv_freq[i] /= factor;
        return 0;
    }
    if (strcmp(type, "llama3") == 0) {
        if (high <= low) {
            snprintf(err, errlen, "--set rope_high_freq_factor must exceed rope_low_freq_factor");
            cb_rope_free(r);
            return -1;
        }
        float low_wavelen = (float)orig_max / low, high_wavelen = (float)orig_max / high;
        for (int i = 0; i < rot / 2; i++) {
            float f = r->inv_freq[i], wavelen = 2.0f * (float)M_PI / f;
            float scaled = wavelen > low_wavelen ? f / factor : f;
            if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
                float smooth = ((float)orig_max / wavelen - low) / (high - low);
                scaled = (1.0f - smooth) * scaled / factor + smooth * scaled;
            }
            r->inv_freq[i] = scaled;
        }
        return 0;
    }
    if (strcmp(type, "yarn") == 0) {
        if (cb_rope_yarn(r, hp, dim, theta, factor, orig_max, err, errlen)) {
            cb_rope_free(r);
            return -1;
        }
        return 0;
    }
    snprintf(err, errlen, "--set rope_type=%s is not supported (default, linear, llama3, yarn)", type);
    cb_rope_free(r);
    return -1;
}

void cb_rope_free(cb_rope *r) {
    free(r->inv_freq);
    r->inv_freq = NULL;
}

void cb_rope_apply(const cb_rope *r, float *x, int n_heads, int head_dim, int pos) {
    if (r->neox) cb_rope_neox(x, n_heads, head_dim, r->rot_dim, pos, r->inv_freq);
    else cb_rope_interleaved(x, n_heads, head_dim, r->rot_dim, pos, r->inv_freq);
    /* The factor scales cos and sin, so only the rotated dimensions of each head (the first rot_dim, in both
     * layouts); a partially rotated head keeps its pass-through part as is. */
    if (r->attention_factor != 1.0f)
        for (int h = 0; h < n_heads; h++)
            for (int i = 0; i < r->rot_dim; i++) x[(size_t)h * (size_t)head_dim + (size_t)i] *= r->attention_factor;
}

/* ---- attention ---- */

void cb_qkv_apply(const cb_qkvo *p, float *q, float *k, float *v, const float *h, int n) {
    cb_linear_apply(&p->wq, q, h, n);
    cb_linear_apply(&p->wk, k, h, n);
    cb_linear_apply(&p->wv, v, h, n);
    cb_add_bias(q, p->bq, n, p->wq.m.rows);
    cb_add_bias(k, p->bk, n, p->wk.m.rows);
    cb_add_bias(v, p->bv, n, p->wv.m.rows);
}

int cb_attn_shape_init(cb_attn_shape *s, int hidden, int n_heads, int n_kv_heads, int head_dim, char *err,
                       size_t errlen) {
    if (!n_kv_heads) n_kv_heads = n_heads;
    if (!head_dim && n_heads > 0) head_dim = hidden / n_heads;
    if (n_heads < 1 || n_kv_heads < 1 || n_heads % n_kv_heads || head_dim < 2) {
        snprintf(err, errlen, "--set num_key_value_heads must divide num_attention_heads, and head_dim be >= 2");
        return -1;
    }
    *s = (cb_attn_shape){n_heads, n_kv_heads, head_dim, 1.0f / sqrtf((float)head_dim)};
    return 0;
}

float *cb_attn_scratch(int max_batch, int n_heads, int ctx) {
    return malloc((size_t)max_batch * (size_t)n_heads * (size_t)ctx * sizeof(float));
}

void cb_kv_store(cb_kv *kv, int layer, int pos0, int n, const float *k, const float *v) {
    size_t w = (size_t)kv->kv_dim;
    for (int i = 0; i < n; i++) {
        memcpy(cb_kv_k(kv, layer, pos0 + i), k + (size_t)i * w, w * sizeof(float));
        memcpy(cb_kv_v(kv, layer, pos0 + i), v + (size_t)i * w, w * sizeof(float));
    }
}

/* Attention is memory-bound, not arithmetic-bound: one position's K (or V) row holds every KV head, kv_dim floats
 * in a row, and the next position's row of the same head is kv_dim floats further (8 KB at OLMoE's geometry, a new
 * page each time, which the hardware prefetcher does not follow). So a task is a block of query rows x a block of
 * KV heads that walks the positions once in chunks: the next chunk's slice of those heads is prefetched while this
 * one, already in cache, serves every (row, head) of the block; then the same over V. A score is one cb_dots call
 * per (row, head, chunk) with the query as the row and the chunk's keys as the inputs: fmaf(k, q, acc) and
 * fmaf(q, k, acc) are the same number, so each (row, head, position) score is cb_dot's bits, and each out[d] still
 * sums p_t * v_t[d] over t in order (cb_axpy_rows: cb_axpy's steps, a chunk of positions per call). Neither the
 * blocking nor the split across threads changes a bit. */

/* Query rows per task: each K/V chunk loaded is used by this many rows of a prefill. */
#define ATTEND_ROW_BLOCK 32
/* Prefill tasks per thread, as cb_matmul: enough to even out causal row blocks of unequal length. */
#define ATTEND_TASKS_PER_THREAD 4
/* Positions per chunk: a chunk of every head (16 x 8 KB at OLMoE's geometry) stays well inside L2. */
#define ATTEND_CHUNK 16

typedef struct {
    float *out, *scores;
    const float *q;
    const cb_kv *kv;
    const cb_attn_shape *s;
    int layer, pos0, n;
    int row_block, row_blocks, kv_block;
} attend_job;

/* Positions [t0, t1) of one head slice (span floats at each position's row of kv_dim). */
static void prefetch_chunk(const float *at, size_t kv_dim, size_t span, int t0, int t1) {
#if defined(__GNUC__) || defined(__clang__)
    for (int t = t0; t < t1; t++)
        for (size_t i = 0; i < span; i += 64 / sizeof(float)) __builtin_prefetch(at + (size_t)t * kv_dim + i);
#else
    (void)at, (void)kv_dim, (void)span, (void)t0, (void)t1;
#endif
}

/* One pass of a task over positions [0, end), a chunk at a time with the next one prefetched: the scores (each
 * (row, head) query against the chunk's keys) or, `values` set, the value sums (each (row, head) output plus its
 * probabilities times the chunk's values, in order of position). Causal: row i sees the positions t <= pos0 + i, so
 * the chunk [t0, t1) is used by the rows from max(r0, t0 - pos0), each up to min(t1, pos0 + i + 1). */
static void attend_pass(const attend_job *j, int r0, int r1, int h0, int h1, int values) {
    const cb_kv *kv = j->kv;
    int hd = j->s->head_dim, group = j->s->n_heads / j->s->n_kv_heads, pos0 = j->pos0, end = pos0 + r1;
    size_t q_width = (size_t)j->s->n_heads * (size_t)hd, ctx_len = (size_t)kv->ctx, kv_dim = (size_t)kv->kv_dim;
    size_t row_scores = (size_t)j->s->n_heads * ctx_len, span = (size_t)(h1 - h0) / (size_t)group * (size_t)hd;
    const float *rows = (values ? cb_kv_v(kv, j->layer, 0) : cb_kv_k(kv, j->layer, 0)) + (size_t)(h0 / group) * hd;
    prefetch_chunk(rows, kv_dim, span, 0, end < ATTEND_CHUNK ? end : ATTEND_CHUNK);
    for (int t0 = 0; t0 < end; t0 += ATTEND_CHUNK) {
        int t1 = t0 + ATTEND_CHUNK < end ? t0 + ATTEND_CHUNK : end;
        prefetch_chunk(rows, kv_dim, span, t1, t1 + ATTEND_CHUNK < end ? t1 + ATTEND_CHUNK : end);
        for (int i = t0 - pos0 > r0 ? t0 - pos0 : r0; i < r1; i++) {
            int seen = (pos0 + i + 1 < t1 ? pos0 + i + 1 : t1) - t0;
            for (int h = h0; h < h1; h++) {
                float *sc = j->scores + (size_t)i * row_scores + (size_t)h * ctx_len + (size_t)t0;
                size_t at = (size_t)i * q_width + (size_t)h * (size_t)hd;
                const float *chunk = rows + (size_t)t0 * kv_dim + (size_t)(h - h0) / (size_t)group * (size_t)hd;
                if (values) cb_axpy_rows(j->out + at, sc, 1, chunk, kv_dim, seen, (size_t)hd);
                else cb_dots(sc, 1, j->q + at, chunk, kv_dim, seen, hd);
            }
        }
    }
}

/* One task: query rows [r0, r1) x KV heads [g0, g1), with every query head reading them. */
static void attend_block(void *ctx, int task) {
    const attend_job *j = ctx;
    const cb_attn_shape *s = j->s;
    int hd = s->head_dim, group = s->n_heads / s->n_kv_heads;
    int r0 = (task % j->row_blocks) * j->row_block, g0 = (task / j->row_blocks) * j->kv_block;
    int r1 = r0 + j->row_block < j->n ? r0 + j->row_block : j->n;
    int g1 = g0 + j->kv_block < s->n_kv_heads ? g0 + j->kv_block : s->n_kv_heads;
    int h0 = g0 * group, h1 = g1 * group;
    size_t q_width = (size_t)s->n_heads * (size_t)hd, ctx_len = (size_t)j->kv->ctx;
    attend_pass(j, r0, r1, h0, h1, 0);
    for (int i = r0; i < r1; i++) {
        int len = j->pos0 + i + 1;
        for (int h = h0; h < h1; h++) {
            float *sc = j->scores + ((size_t)i * (size_t)s->n_heads + (size_t)h) * ctx_len;
            for (int t = 0; t < len; t++) sc[t] *= s->scale;
            cb_softmax(sc, len);
        }
        memset(j->out + (size_t)i * q_width + (size_t)h0 * (size_t)hd, 0,
               (size_t)(h1 - h0) * (size_t)hd * sizeof *j->out);
    }
    attend_pass(j, r0, r1, h0, h1, 1);
}

void cb_attend(float *out, const float *q, const cb_kv *kv, int layer, int pos0, int n, const cb_attn_shape *s,
               float *scores) {
    if (n <= 0) return;
    double t0 = cb_now_s();
    attend_job j = {out, scores, q, kv, s, layer, pos0, n, n < ATTEND_ROW_BLOCK ? n : ATTEND_ROW_BLOCK, 0, 0};
    j.row_blocks = (n + j.row_block - 1) / j.row_block;
    /* One row (decode): one KV-head block per thread, so each reads the widest contiguous slice per position. */
    int wanted = cb_threads_count() * (j.row_blocks > 1 ? ATTEND_TASKS_PER_THREAD : 1);
    int kv_splits = (wanted + j.row_blocks - 1) / j.row_blocks;
    if (kv_splits > s->n_kv_heads) kv_splits = s->n_kv_heads;
    j.kv_block = (s->n_kv_heads + kv_splits - 1) / kv_splits;
    int kv_blocks = (s->n_kv_heads + j.kv_block - 1) / j.kv_block;
    cb_parallel_for(j.row_blocks * kv_blocks, attend_block, &j);
    cb_prof.attention_s += cb_now_s() - t0;
}

/* ---- MoE ---- */

/* MoE blocks by layer number: the lookahead of layer L needs layer L+1's router. */
static cb_moe **moe_by_layer;
static int moe_by_layer_n;

static void register_moe(cb_moe *m, int layer) {
    if (layer >= moe_by_layer_n) {
        int n = layer + 1 > 2 * moe_by_layer_n ? layer + 1 : 2 * moe_by_layer_n;
        cb_moe **p = realloc(moe_by_layer, (size_t)n * sizeof *p);
        if (!p) return;   /* no lookahead for this layer; nothing else depends on the registry */
        for (int i = moe_by_layer_n; i < n; i++) p[i] = NULL;
        moe_by_layer = p;
        moe_by_layer_n = n;
    }
    moe_by_layer[layer] = m;
}

static void unregister_moe(cb_moe *m) {
    int live = 0;
    for (int i = 0; i < moe_by_layer_n; i++) {
        if (moe_by_layer[i] == m) moe_by_layer[i] = NULL;
        live |= moe_by_layer[i] != NULL;
    }
    if (!live) {
        free(moe_by_layer);
        moe_by_layer = NULL;
        moe_by_layer_n = 0;
    }
}

int cb_moe_init(cb_moe *m, const cb_st_index *idx, int layer, const char *router_name,
                const char *const expert_names[3], int n_experts, int top_k, int norm_topk_prob, int hidden,
                int inter, int cap, int max_batch, size_t *dense_bytes, char *err, size_t errlen) {
    memset(m, 0, sizeof *m);
    m->n_experts = n_experts;
    m->top_k = top_k;
    m->norm_topk_prob = norm_topk_prob;
    m->hidden = hidden;
    m->inter = inter;
    m->max_batch = max_batch;
    if (top_k < 1 || top_k > n_experts) {
        snprintf(err, errlen, "--set top_k=%d must be between 1 and the expert count %d", top_k, n_experts);
        return -1;
    }
    if (cb_load_linear(&m->router, idx, router_name, n_experts, hidden, dense_bytes, err, errlen)) return -1;
    if (cb_experts_init(&m->store, idx, layer, n_experts, cap, hidden, inter, expert_names, err, errlen)) {
        cb_linear_free(&m->router);
        return -1;
    }
    size_t B = (size_t)max_batch;
    m->logits = malloc(B * (size_t)n_experts * sizeof(float));
    m->chosen = malloc(B * (size_t)top_k * sizeof(int));
    m->weight = malloc(B * (size_t)top_k * sizeof(float));
    m->rows = malloc(B * sizeof(int));
    m->n_rows = malloc((size_t)n_experts * sizeof(int));
    m->weight_of_row = malloc(B * sizeof(float));
    m->xs = malloc(B * (size_t)hidden * sizeof(float));
    m->gate = malloc(B * (size_t)inter * sizeof(float));
    m->up = malloc(B * (size_t)inter * sizeof(float));
    m->down = malloc(B * (size_t)hidden * sizeof(float));
    m->y = malloc(B * (size_t)top_k * (size_t)hidden * sizeof(float));
    m->pair_of_row = malloc(B * (size_t)top_k * sizeof(int));
    m->next_logits = malloc((size_t)(n_experts > 4096 ? n_experts : 4096) * sizeof(float));
    if (!m->logits || !m->chosen || !m->weight || !m->rows || !m->n_rows || !m->weight_of_row || !m->xs || !m->gate ||
        !m->up || !m->down || !m->y || !m->pair_of_row || !m->next_logits) {
        snprintf(err, errlen, "out of memory for the MoE scratch of layer %d", layer);
        cb_moe_free(m);
        return -1;
    }
    cb_experts_hint_top_k(top_k);
    register_moe(m, layer);
    return 0;
}

void cb_moe_free(cb_moe *m) {
    unregister_moe(m);
    cb_linear_free(&m->router);
    cb_experts_free(&m->store);
    free(m->logits);
    free(m->chosen);
    free(m->weight);
    free(m->rows);
    free(m->n_rows);
    free(m->weight_of_row);
    if (!m->borrowed) {
        free(m->xs);
        free(m->gate);
        free(m->up);
        free(m->down);
        free(m->y);
    }
    free(m->pair_of_row);
    free(m->next_logits);
    memset(m, 0, sizeof *m);
}

void cb_moe_share_scratch(cb_moe *m, const cb_moe *owner) {
    if (m == owner || m->borrowed || m->hidden != owner->hidden || m->inter != owner->inter ||
        m->top_k != owner->top_k || m->max_batch != owner->max_batch)
        return;
    free(m->xs);
    free(m->gate);
    free(m->up);
    free(m->down);
    free(m->y);
    m->xs = owner->xs;
    m->gate = owner->gate;
    m->up = owner->up;
    m->down = owner->down;
    m->y = owner->y;
    m->borrowed = 1;
}

/* Top-k of probs: repeated selection of the largest remaining (strictly greater wins, so ties go to the
 * lowest index). k is small, so O(k * E) beats sorting. */
static void top_k_select(const float *probs, int n, int k, int *idx, float *val) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            int taken = 0;
            for (int t = 0; t < j; t++) taken |= idx[t] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        idx[j] = best;
        val[j] = probs[best];
    }
}

int cb_moe_forward(cb_moe *m, float *out, const float *x, int n, char *err, size_t errlen) {
    int E = m->n_experts, K = m->top_k;
    cb_linear_apply(&m->router, m->logits, x, n);
    for (int i = 0; i < n; i++) {
        float *p = m->logits + (size_t)i * (size_t)E;
        cb_softmax(p, E);
        int *idx = m->chosen + (size_t)i * (size_t)K;
        float *w = m->weight + (size_t)i * (size_t)K;
        top_k_select(p, E, K, idx, w);
        if (m->norm_topk_prob) {
            float sum = 0;
            for (int j = 0; j < K; j++) sum += w[j];
            for (int j = 0; j < K; j++) w[j] /= sum;
        }
    }
    return cb_moe_experts_forward(m, out, x, n, err, errlen);
}

/* The opt-in lossy knobs: drop each row's lowest-weight choices (chosen = -1) beyond experts_k, and beyond
 * the fewest whose weights reach experts_top_p of the row's total. Weights are left as they are. */
static void trim_choices(cb_moe *m, int n) {
    const cb_stream_opts *o = cb_experts_options();
    int K = m->top_k, keep_k = o->experts_k > 0 && o->experts_k < K ? o->experts_k : K;
    float p = o->experts_top_p;
    if (keep_k == K && !(p > 0 && p < 1)) return;
    for (int i = 0; i < n; i++) {
        int *c = m->chosen + (size_t)i * (size_t)K;
        const float *w = m->weight + (size_t)i * (size_t)K;
        int order[256], k = K < 256 ? K : 256;
        float total = 0;
        for (int j = 0; j < k; j++) {
            order[j] = j;
            total += w[j];
        }
        for (int a = 0; a < k; a++)   /* by weight, heaviest first (stable: lower choice index on ties) */
            for (int b = a + 1; b < k; b++)
                if (w[order[b]] > w[order[a]]) { int t = order[a]; order[a] = order[b]; order[b] = t; }
        float cum = 0;
        for (int r = 0; r < k; r++) {
            int drop = r >= keep_k || (p > 0 && p < 1 && total > 0 && cum >= p * total);
            cum += w[order[r]];
            if (drop) c[order[r]] = -1;
        }
    }
}

/* Lookahead: the next MoE layer's router on this layer's input predicts the next layer's experts. The guesses are
 * always scored (lookahead_recall); they are read ahead only with the lookahead option (coli tune decides whether
 * the disk has the idle time for them), because a wrong guess costs a whole expert read. */
static void predict_next(cb_moe *m, const float *x) {
    int next_layer = m->store.layer + 1;
    cb_moe *nx = next_layer < moe_by_layer_n ? moe_by_layer[next_layer] : NULL;
    if (!nx || !nx->router.w || nx->hidden != m->hidden || nx->n_experts > 4096) return;
    int E = nx->n_experts, K = nx->top_k;
    cb_linear_apply(&nx->router, m->next_logits, x, 1);
    cb_expert_layer *S = &nx->store;
    memset(S->predicted, 0, (size_t)E);
    for (int j = 0; j < K; j++) {   /* top-k of the logits = top-k of the softmax */
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!S->predicted[e] && (best < 0 || m->next_logits[e] > m->next_logits[best])) best = e;
        S->predicted[best] = 1;
        cb_prof.lookahead_predicted++;
        if (cb_experts_options()->lookahead) cb_experts_predict(S, best);
    }
    S->has_prediction = 1;
}

/* Score the previous layer's prediction against the experts this one-token call actually routed to. */
static void score_prediction(cb_moe *m) {
    cb_expert_layer *S = &m->store;
    if (!S->has_prediction) return;
    for (int j = 0; j < m->top_k; j++) {
        int e = m->chosen[j];
        if (e < 0) continue;
        cb_prof.lookahead_actual++;
        cb_prof.lookahead_hits += S->predicted[e];
    }
    S->has_prediction = 0;
}

int cb_expert_apply(const cb_expert_view *ex, float *down, float *xs, float *gate, float *up, const float *x,
                    const int *rows, int n_rows, int hidden, int inter, float swiglu_limit, char *err,
                    size_t errlen) {
    int H = hidden, I = inter;
    if (ex->m[CB_GATE].kind == CB_MAT_INT)   /* colibri-quant: integer kernels on the layer input quantized once (qlinear.c) */
        return cb_qexpert_run(down, gate, up, ex, rows, n_rows, err, errlen);
    for (int r = 0; r < n_rows; r++)
        memcpy(xs + (size_t)r * (size_t)H, x + (size_t)rows[r] * (size_t)H, (size_t)H * sizeof(float));
    cb_matrix_apply(&ex->m[CB_GATE], gate, xs, n_rows);
    cb_matrix_apply(&ex->m[CB_UP], up, xs, n_rows);
    if (swiglu_limit > 0) cb_swiglu_clamp(gate, up, (size_t)n_rows * (size_t)I, swiglu_limit);
    cb_silu_mul(gate, up, n_rows * I);
    cb_matrix_apply(&ex->m[CB_DOWN], down, gate, n_rows);
    return 0;
}

/* Run expert e on the given rows (their (row, choice) pairs in m->pair_of_row) into m->y. */
static int run_expert(cb_moe *m, int e, const float *x, int rows, char *err, size_t errlen) {
    int H = m->hidden;
    cb_expert_view ex;
    if (cb_experts_serve(&m->store, e, &ex, err, errlen)) return -1;
    double t0 = cb_now_s();
    if (cb_expert_apply(&ex, m->down, m->xs, m->gate, m->up, x, m->rows, rows, H, m->inter, m->swiglu_limit, err,
                        errlen))
        return -1;
    for (int r = 0; r < rows; r++)
        memcpy(m->y + (size_t)m->pair_of_row[r] * (size_t)H, m->down + (size_t)r * (size_t)H,
               (size_t)H * sizeof(float));
    cb_prof.expert_s += cb_now_s() - t0;
    return 0;
}

/* Gather the rows of [r0, r1) that chose expert e; returns how many. */
static int gather_rows(cb_moe *m, int e, int r0, int r1) {
    int K = m->top_k, rows = 0;
    for (int i = r0; i < r1; i++)
        for (int j = 0; j < K; j++)
            if (m->chosen[(size_t)i * (size_t)K + (size_t)j] == e) {
                m->rows[rows] = i;
                m->pair_of_row[rows] = i * K + j;
                rows++;
            }
    return rows;
}

/* Queue the reads of this call's missing experts from index `from` on, in the order the block will take them,
 * until the pool has no free buffer (those left are queued by a later call, or read when their turn comes). */
static void stage_misses(cb_moe *m, int from) {
    for (int e = from; e < m->n_experts; e++)
        if (m->n_rows[e] && m->store.slot_of[e] < 0 && !cb_experts_prefetch(&m->store, e)) return;
}

/* Every expert with rows left in m->n_rows: the resident ones first, then the misses in ascending index. */
static int run_local(cb_moe *m, const float *x, int n, char *err, size_t errlen) {
    for (int pass = 0; pass < 2; pass++)
        for (int e = 0; e < m->n_experts; e++) {
            if (!m->n_rows[e] || (m->store.slot_of[e] >= 0) != (pass == 0)) continue;
            /* A prefill chunk can miss more experts than the pool has buffers: each one taken frees a
             * buffer, which the next misses fill, so the reads stay ahead of the compute. */
            if (pass == 1) stage_misses(m, e + 1);
            int rows = gather_rows(m, e, 0, n);
            if (run_expert(m, e, x, rows, err, errlen)) {
                cb_experts_prefetch_cancel(&m->store);
                return -1;
            }
            m->n_rows[e] = 0;   /* done: a later miss may evict it, and it must not run twice */
        }
    return 0;
}

int cb_moe_experts_forward(cb_moe *m, float *out, const float *x, int n, char *err, size_t errlen) {
    int E = m->n_experts, K = m->top_k, H = m->hidden;
    trim_choices(m, n);
    if (m->store.n_experts && m->store.loc[0].kind == CB_MAT_INT && cb_qexperts_begin(x, n, H)) {
        snprintf(err, errlen, "out of memory quantizing the layer %d MoE input", m->store.layer);
        return -1;
    }
    memset(m->n_rows, 0, (size_t)E * sizeof(int));
    for (size_t j = 0; j < (size_t)n * (size_t)K; j++)
        if (m->chosen[j] >= 0) m->n_rows[m->chosen[j]]++;
    cb_experts_note_routing(&m->store, m->chosen, n * K);
    if (n == 1) score_prediction(m);
    if (!cb_experts_options()->moe_union) {
        /* One row at a time, each expert by matvec: what batching must reproduce bit for bit. */
        for (int i = 0; i < n; i++)
            for (int e = 0; e < E; e++) {
                int rows = gather_rows(m, e, i, i + 1);
                if (rows && run_expert(m, e, x, rows, err, errlen)) return -1;
            }
    } else {
        /* Experts an expert worker holds (and this process does not) go out first, so the workers compute
         * while the local ones do; their outputs land in m->y like the local ones. A worker that fails hands its
         * experts back, and the local path reads them from disk: slower, never different. */
        cb_remote_send(&m->store, m->n_rows, m->chosen, n, K, x, m->swiglu_limit);
        /* The misses go to the I/O pool first (it reads them in file order), the next layer's predictions
         * after them; resident experts compute while they load, the misses follow in ascending index. */
        stage_misses(m, 0);
        /* The previous layer's guesses this router did not choose, if still waiting, are dropped: the pool would
         * read them before this layer's own guesses for the next layer (they sort earlier in file order). */
        if (cb_experts_options()->lookahead) cb_experts_drop_guesses(&m->store, m->n_rows);
        if (n == 1) predict_next(m, x);
        if (run_local(m, x, n, err, errlen)) {
            cb_remote_recv(&m->store, m->n_rows, m->y);
            return -1;
        }
        if (cb_remote_recv(&m->store, m->n_rows, m->y) > 0) {
            stage_misses(m, 0);
            if (run_local(m, x, n, err, errlen)) return -1;
        }
    }
    if (!cb_experts_options()->moe_union && n == 1) predict_next(m, x);
    /* Each row sums its experts in ascending index, as transformers' index_add_ loop does. */
    memset(out, 0, (size_t)n * (size_t)H * sizeof(float));
    for (int i = 0; i < n; i++) {
        float *o = out + (size_t)i * (size_t)H;
        const int *c = m->chosen + (size_t)i * (size_t)K;
        for (int e = 0, taken = 0; taken < K && e < E; e++)
            for (int j = 0; j < K; j++) {
                if (c[j] != e) continue;
                const float *d = m->y + ((size_t)i * (size_t)K + (size_t)j) * (size_t)H;
                float w = m->weight[(size_t)i * (size_t)K + (size_t)j];
                for (int col = 0; col < H; col++) o[col] += d[col] * w;
                taken++;
            }
    }
    return 0;
}
