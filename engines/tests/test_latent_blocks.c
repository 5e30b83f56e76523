/* test_latent_blocks.c: the blocks DeepSeek-lineage engines share (GLM, DeepSeek, Kimi):
 *   router.h  grouped sigmoid routing, against a sort-based reference and hand-made cases;
 *   mla.h     absorbed latent attention over the compressed cache, against the expanded (per-head K/V) form;
 *   dsa.h     the indexer's top-k selection and scores, against a direct computation.
 * Weights come from a safetensors file written here, so the real loading path is exercised too. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "blocks.h"
#include "dsa.h"
#include "mla.h"
#include "router.h"

#define TEST_SEED 0x9E3779B97F4A7C15ULL
#include "check.h"
static float urand(void) { return (float)(rnd() >> 40) / (float)(1 << 24) * 2.0f - 1.0f; }   /* [-1, 1) */

static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* ---- router ---- */

/* Reference: rank groups by sorting, then experts by sorting (stable: ties to the lower index). */
static void ref_route(const cb_grouped_router *r, const float *logits, int *idx, float *w) {
    int E = r->n_experts, G = r->n_group, per = E / G;
    float biased[256], gs[64];
    int gorder[64], eorder[256], keep[256] = {0};
    for (int e = 0; e < E; e++) biased[e] = sigmoid(logits[e]) + (r->bias ? r->bias[e] : 0);
    for (int g = 0; g < G; g++) {
        float best = -INFINITY, second = -INFINITY;
        for (int i = 0; i < per; i++) {
            float v = biased[g * per + i];
            if (v > best) { second = best; best = v; }
            else if (v > second) second = v;
        }
        gs[g] = G == 1 ? 0 : best + second;
        gorder[g] = g;
    }
    for (int a = 1; a < G; a++)   /* insertion sort, descending, stable */
        for (int b = a; b > 0 && gs[gorder[b]] > gs[gorder[b - 1]]; b--) {
            int t = gorder[b]; gorder[b] = gorder[b - 1]; gorder[b - 1] = t;
        }
    for (int j = 0; j < r->topk_group; j++)
        for (int i = 0; i < per; i++) keep[gorder[j] * per + i] = 1;
    int n = 0;
    for (int e = 0; e < E; e++) if (keep[e]) eorder[n++] = e;
    for (int a = 1; a < n; a++)
        for (int b = a; b > 0 && biased[eorder[b]] > biased[eorder[b - 1]]; b--) {
            int t = eorder[b]; eorder[b] = eorder[b - 1]; eorder[b - 1] = t;
        }
    double sum = 0;
    for (int j = 0; j < r->top_k; j++) { idx[j] = eorder[j]; sum += sigmoid(logits[eorder[j]]); }
    for (int j = 0; j < r->top_k; j++)
        w[j] = (float)((r->norm_topk_prob ? sigmoid(logits[idx[j]]) / sum : sigmoid(logits[idx[j]])) * r->scaling);
}

static void test_router_cases(void) {
    char err[256];
    float scratch[2 * (16 + 4)];
    int idx[4];
    float w[4];
    /* 8 experts in 4 groups of 2, keep 2 groups, top 2. Group 0 has the single best expert but a weak partner;
     * groups 1 and 2 win on the sum of their best two, so expert 0 is never eligible. */
    float logits[8] = {4.0f, -4.0f, 1.0f, 1.0f, 0.9f, 0.9f, -1.0f, -1.0f};
    cb_grouped_router r = {8, 2, 4, 2, 1, 2.5f, NULL};
    CHECK(cb_grouped_router_check(&r, err, sizeof err) == 0, "%s", err);
    cb_grouped_route(&r, logits, idx, w, scratch);
    CHECK(idx[0] == 2 && idx[1] == 3, "group-limited pick: %d %d", idx[0], idx[1]);
    CHECK(fabsf(w[0] - 1.25f) < 1e-6f && fabsf(w[1] - 1.25f) < 1e-6f, "equal scores renormalise to scale/2");
    /* The correction bias changes the choice but never the weight: expert 5 overtakes 2 by its bias. */
    float bias[8] = {0, 0, 0, 0, 0, 0.5f, 0, 0};
    r.bias = bias;
    cb_grouped_route(&r, logits, idx, w, scratch);
    CHECK(idx[0] == 5, "bias promotes expert 5, got %d", idx[0]);
    float s5 = sigmoid(0.9f), s2 = sigmoid(1.0f);
    CHECK(idx[1] == 2 && fabsf(w[0] - 2.5f * s5 / (s5 + s2)) < 1e-6f, "weights are unbiased: %g", w[0]);
    /* Without renormalisation the weights are scaled raw sigmoid scores. */
    r.norm_topk_prob = 0;
    cb_grouped_route(&r, logits, idx, w, scratch);
    CHECK(fabsf(w[0] - 2.5f * s5) < 1e-6f, "raw weight %g", w[0]);
    /* Geometry errors name the hyperparameter. */
    cb_grouped_router bad = {8, 2, 3, 2, 1, 1, NULL};
    CHECK(cb_grouped_router_check(&bad, err, sizeof err) && strstr(err, "n_group"), "%s", err);
    bad = (cb_grouped_router){8, 2, 8, 2, 1, 1, NULL};
    CHECK(cb_grouped_router_check(&bad, err, sizeof err) && strstr(err, "fewer than 2"), "%s", err);
    bad = (cb_grouped_router){8, 5, 4, 2, 1, 1, NULL};
    CHECK(cb_grouped_router_check(&bad, err, sizeof err) && strstr(err, "num_experts_per_tok"), "%s", err);
}

static void test_router_random(void) {
    static const int geo[][4] = {{16, 4, 4, 2}, {16, 4, 1, 1}, {32, 8, 8, 4}, {64, 6, 8, 3}};
    float logits[64], bias[64], scratch[2 * (64 + 8)], w[8], rw[8];
    int idx[8], ridx[8];
    for (size_t g = 0; g < sizeof geo / sizeof geo[0]; g++)
        for (int trial = 0; trial < 500; trial++) {
            cb_grouped_router r = {geo[g][0], geo[g][1], geo[g][2], geo[g][3], trial % 2, 1.8f,
                                   trial % 3 ? bias : NULL};
            for (int e = 0; e < r.n_experts; e++) { logits[e] = 3 * urand(); bias[e] = 0.25f * urand(); }
            cb_grouped_route(&r, logits, idx, w, scratch);
            ref_route(&r, logits, ridx, rw);
            int same = 1;
            for (int j = 0; j < r.top_k; j++) same &= idx[j] == ridx[j] && fabsf(w[j] - rw[j]) < 1e-6f;
            CHECK(same, "geometry %zu trial %d differs from the sort-based reference", g, trial);
        }
}

/* ---- safetensors fixture ---- */

typedef struct {
    char name[96];
    int ndim;
    int64_t shape[2];
    float *data;
} fx;

static char tmpdir[256];
static fx tensors[32];
static int n_tensors;

static float *add_tensor(const char *name, int rows, int cols, float scale, float offset) {
    fx *t = &tensors[n_tensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = cols ? 2 : 1;
    t->shape[0] = rows;
    t->shape[1] = cols;
    size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
    t->data = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) t->data[i] = offset + scale * urand();
    return t->data;
}

static void write_fixture(void) {
    char header[16384], path[512];
    size_t hl = 0, off = 0;
    hl += (size_t)snprintf(header + hl, sizeof header - hl, "{");
    for (int i = 0; i < n_tensors; i++) {
        fx *t = &tensors[i];
        size_t nb = (size_t)t->shape[0] * (size_t)(t->ndim == 2 ? t->shape[1] : 1) * 4;
        if (t->ndim == 2)
            hl += (size_t)snprintf(header + hl, sizeof header - hl, "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%lld,%lld],"
                                   "\"data_offsets\":[%zu,%zu]}", i ? "," : "", t->name, (long long)t->shape[0],
                                   (long long)t->shape[1], off, off + nb);
        else
            hl += (size_t)snprintf(header + hl, sizeof header - hl, "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%lld],"
                                   "\"data_offsets\":[%zu,%zu]}", i ? "," : "", t->name, (long long)t->shape[0],
                                   off, off + nb);
        off += nb;
    }
    hl += (size_t)snprintf(header + hl, sizeof header - hl, "}");
    while (hl % 8) header[hl++] = ' ';
    snprintf(path, sizeof path, "%s/model.safetensors", tmpdir);
    FILE *f = fopen(path, "wb");
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    fwrite(len, 1, 8, f);
    fwrite(header, 1, hl, f);
    for (int i = 0; i < n_tensors; i++) {
        fx *t = &tensors[i];
        fwrite(t->data, 4, (size_t)t->shape[0] * (size_t)(t->ndim == 2 ? t->shape[1] : 1), f);
    }
    fclose(f);
}

static void free_fixture(void) {
    for (int i = 0; i < n_tensors; i++) free(tensors[i].data);
    n_tensors = 0;
}

/* A RoPE from hyperparameters, as an engine gets it. */
static int make_rope(cb_rope *rope, int dim, int neox) {
    char *keys[] = {"rope_theta"}, *values[] = {"10000"};
    int used[1] = {0};
    cb_hparams hp = {1, keys, values, used};
    char err[256];
    return cb_rope_init(rope, &hp, dim, neox, err, sizeof err);
}

/* ---- MLA ---- */

enum { HID = 24, NH = 3, QL = 12, KVL = 10, NOPE = 6, ROPE = 4, VD = 5, CTX = 16, NTOK = 9 };

static void rmsnorm_ref(double *out, const float *x, const float *w, int n, double eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    double inv = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

static void matvec_ref(double *y, const float *W, const double *x, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        double acc = 0;
        for (int c = 0; c < cols; c++) acc += (double)W[(size_t)r * cols + c] * x[c];
        y[r] = acc;
    }
}

static void rope_ref(double *x, int dim, int pos) {   /* interleaved pairs */
    for (int i = 0; i < dim / 2; i++) {
        double f = 1.0 / pow(10000.0, (double)(2 * i) / dim), a = pos * f, c = cos(a), s = sin(a);
        double x0 = x[2 * i], x1 = x[2 * i + 1];
        x[2 * i] = x0 * c - x1 * s;
        x[2 * i + 1] = x1 * c + x0 * s;
    }
}

/* The expanded form, in double: K_h = [W_UK_h latent, k_rope], V_h = W_UV_h latent, softmax over the allowed
 * positions. Writes o_proj(attention) of token `row` (whose inputs are h[row]). */
static void mla_reference(double *out, const float *h, int row, const int *allowed, int n_allowed, float *qa,
                          float *qan, float *qb, float *kva, float *kvan, float *kvb, float *o) {
    double lat[NTOK][KVL], kr[NTOK][ROPE], tmp[KVL + ROPE], qr[QL], q[NH * (NOPE + ROPE)];
    float f[KVL + ROPE], fq[QL];
    for (int t = 0; t <= row; t++) {
        double hv[HID];
        for (int i = 0; i < HID; i++) hv[i] = h[t * HID + i];
        matvec_ref(tmp, kva, hv, KVL + ROPE, HID);
        for (int i = 0; i < KVL + ROPE; i++) f[i] = (float)tmp[i];
        rmsnorm_ref(lat[t], f, kvan, KVL, 1e-6);
        for (int i = 0; i < ROPE; i++) kr[t][i] = tmp[KVL + i];
        rope_ref(kr[t], ROPE, t);
    }
    double hv[HID];
    for (int i = 0; i < HID; i++) hv[i] = h[row * HID + i];
    matvec_ref(qr, qa, hv, QL, HID);
    for (int i = 0; i < QL; i++) fq[i] = (float)qr[i];
    rmsnorm_ref(qr, fq, qan, QL, 1e-6);
    matvec_ref(q, qb, qr, NH * (NOPE + ROPE), QL);
    double att[NH * VD];
    for (int hd = 0; hd < NH; hd++) {
        double *qh = q + hd * (NOPE + ROPE), sc[NTOK], mx = -1e300, sum = 0;
        rope_ref(qh + NOPE, ROPE, row);
        for (int a = 0; a < n_allowed; a++) {
            int t = allowed[a];
            double k[NOPE];
            for (int d = 0; d < NOPE; d++) {
                k[d] = 0;
                for (int c = 0; c < KVL; c++) k[d] += (double)kvb[(size_t)(hd * (NOPE + VD) + d) * KVL + c] * lat[t][c];
            }
            double s = 0;
            for (int d = 0; d < NOPE; d++) s += qh[d] * k[d];
            for (int d = 0; d < ROPE; d++) s += qh[NOPE + d] * kr[t][d];
            sc[a] = s / sqrt((double)(NOPE + ROPE));
            if (sc[a] > mx) mx = sc[a];
        }
        for (int a = 0; a < n_allowed; a++) { sc[a] = exp(sc[a] - mx); sum += sc[a]; }
        for (int d = 0; d < VD; d++) {
            double acc = 0;
            for (int a = 0; a < n_allowed; a++) {
                double v = 0;
                for (int c = 0; c < KVL; c++)
                    v += (double)kvb[(size_t)(hd * (NOPE + VD) + NOPE + d) * KVL + c] * lat[allowed[a]][c];
                acc += sc[a] / sum * v;
            }
            att[hd * VD + d] = acc;
        }
    }
    matvec_ref(out, o, att, HID, NH * VD);
}

static void test_mla(void) {
    float *qa = add_tensor("a.q_a_proj.weight", QL, HID, 0.4f, 0);
    float *qan = add_tensor("a.q_a_layernorm.weight", QL, 0, 0.1f, 1);
    float *qb = add_tensor("a.q_b_proj.weight", NH * (NOPE + ROPE), QL, 0.4f, 0);
    float *kva = add_tensor("a.kv_a_proj_with_mqa.weight", KVL + ROPE, HID, 0.4f, 0);
    float *kvan = add_tensor("a.kv_a_layernorm.weight", KVL, 0, 0.1f, 1);
    float *kvb = add_tensor("a.kv_b_proj.weight", NH * (NOPE + VD), KVL, 0.4f, 0);
    float *o = add_tensor("a.o_proj.weight", HID, NH * VD, 0.4f, 0);
    write_fixture();
    char err[256];
    cb_st_index idx;
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) == 0, "%s", err);
    cb_mla_shape s = {HID, NH, QL, KVL, NOPE, ROPE, VD, 0, 1.0f / sqrtf((float)(NOPE + ROPE)), 1e-6f};
    cb_mla m;
    size_t bytes = 0;
    CHECK(cb_mla_init(&m, &idx, "a.", &s, NTOK, CTX, &bytes, err, sizeof err) == 0, "%s", err);
    cb_rope rope;
    CHECK(make_rope(&rope, ROPE, 0) == 0, "rope");
    float h[NTOK * HID], batched[NTOK * HID], single[NTOK * HID];
    for (int i = 0; i < NTOK * HID; i++) h[i] = urand();
    /* The cache row is wider than MLA's part (a family may keep more after it); MLA must touch only its own. */
    int width = KVL + ROPE + 3;
    float *cache = calloc((size_t)CTX * width, sizeof(float));
    cb_kv kv = {.n_layers = 1, .ctx = CTX, .kv_dim = width, .k = cache};
    for (int t = 0; t < CTX; t++) for (int c = KVL + ROPE; c < width; c++) cache[t * width + c] = 7.0f;
    cb_mla_project(&m, h, NTOK, 0, &kv, 0, &rope);
    cb_mla_attend(&m, batched, NTOK, 0, &kv, 0, NULL, NULL, 0);
    int untouched = 1;
    for (int t = 0; t < CTX; t++) for (int c = KVL + ROPE; c < width; c++) untouched &= cache[t * width + c] == 7.0f;
    CHECK(untouched, "MLA wrote outside its columns of the cache row");
    double worst = 0;
    for (int row = 0; row < NTOK; row++) {
        int all[NTOK];
        for (int t = 0; t <= row; t++) all[t] = t;
        double ref[HID];
        mla_reference(ref, h, row, all, row + 1, qa, qan, qb, kva, kvan, kvb, o);
        for (int i = 0; i < HID; i++) worst = fmax(worst, fabs(ref[i] - batched[row * HID + i]));
    }
    CHECK(worst < 1e-5, "absorbed MLA differs from the expanded form by %g", worst);
    /* One token at a time over the same cache gives the same bits as the batch. */
    for (int row = 0; row < NTOK; row++) {
        cb_mla_project(&m, h + row * HID, 1, row, &kv, 0, &rope);
        cb_mla_attend(&m, single + row * HID, 1, row, &kv, 0, NULL, NULL, 0);
    }
    CHECK(memcmp(single, batched, sizeof single) == 0, "batched MLA is not bit-identical to one token at a time");
    /* A sparse selection attends to exactly the listed positions. */
    int sel[NTOK * 3], n_sel[NTOK];
    for (int row = 0; row < NTOK; row++) {
        n_sel[row] = row < 3 ? row + 1 : 3;
        for (int a = 0; a < n_sel[row]; a++) sel[row * 3 + a] = row < 3 ? a : (a == 0 ? 0 : row - 2 + a);
    }
    cb_mla_attend(&m, batched, NTOK, 0, &kv, 0, sel, n_sel, 3);
    worst = 0;
    for (int row = 0; row < NTOK; row++) {
        double ref[HID];
        mla_reference(ref, h, row, sel + row * 3, n_sel[row], qa, qan, qb, kva, kvan, kvb, o);
        for (int i = 0; i < HID; i++) worst = fmax(worst, fabs(ref[i] - batched[row * HID + i]));
    }
    CHECK(worst < 1e-5, "sparse MLA differs from the expanded form over the same positions by %g", worst);
    /* A missing tensor is an error naming it, not a crash. */
    cb_mla_shape no_lora = s;
    no_lora.q_lora = 0;
    cb_mla m2;
    CHECK(cb_mla_init(&m2, &idx, "a.", &no_lora, 1, CTX, NULL, err, sizeof err) != 0 && strstr(err, "a.q_proj.weight"),
          "%s", err);
    free(cache);
    cb_rope_free(&rope);
    cb_mla_free(&m);
    cb_st_close(&idx);
    free_fixture();
}

/* ---- DSA ---- */

static void test_top_positions(void) {
    int heap[8], out[64];
    float sc[10] = {0.5f, 2.0f, 0.5f, -1.0f, 2.0f, 0.5f, 3.0f, 0.0f, 0.5f, 0.5f};
    CHECK(cb_dsa_top_positions(sc, 10, 4, heap, out) == 4, "count");
    /* 3.0 (6), 2.0 (1, 4), then the first 0.5 (0): ties go to the earlier position; output ascending. */
    CHECK(out[0] == 0 && out[1] == 1 && out[2] == 4 && out[3] == 6, "got %d %d %d %d", out[0], out[1], out[2], out[3]);
    CHECK(cb_dsa_top_positions(sc, 3, 8, heap, out) == 3 && out[0] == 0 && out[2] == 2, "k >= n keeps all");
    float big[64];
    for (int trial = 0; trial < 300; trial++) {
        int n = 1 + (int)(rnd() % 64), k = 1 + (int)(rnd() % 8);
        for (int i = 0; i < n; i++) big[i] = (float)(int)(urand() * 4);   /* many ties */
        int got = cb_dsa_top_positions(big, n, k, heap, out), want = k < n ? k : n;
        /* Reference: position t is chosen iff fewer than k positions beat it (higher, or equal and earlier). */
        int ok = got == want;
        for (int i = 1; i < got; i++) ok &= out[i - 1] < out[i];
        int chosen[64] = {0};
        for (int i = 0; i < got; i++) chosen[out[i]] = 1;
        for (int t = 0; t < n; t++) {
            int better = 0;
            for (int u = 0; u < n; u++) better += big[u] > big[t] || (big[u] == big[t] && u < t);
            ok &= chosen[t] == (better < k);
        }
        CHECK(ok, "trial %d (n %d, k %d) differs from the rank reference", trial, n, k);
    }
}

enum { IH = 4, ID = 8, ITOPK = 3 };

static void test_dsa_select(void) {
    float *wq = add_tensor("i.wq_b.weight", IH * ID, QL, 0.5f, 0);
    float *wk = add_tensor("i.wk.weight", ID, HID, 0.5f, 0);
    float *wp = add_tensor("i.weights_proj.weight", IH, HID, 0.5f, 0);
    float *lw = add_tensor("i.k_norm.weight", ID, 0, 0.1f, 1);
    float *lb = add_tensor("i.k_norm.bias", ID, 0, 0.1f, 0);
    write_fixture();
    char err[256];
    cb_st_index idx;
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) == 0, "%s", err);
    cb_dsa_shape s = {HID, QL, IH, ID, ROPE, ITOPK};
    cb_dsa x;
    CHECK(cb_dsa_init(&x, &idx, "i.", &s, NTOK, CTX, NULL, err, sizeof err) == 0, "%s", err);
    cb_rope rope;
    CHECK(make_rope(&rope, ROPE, 0) == 0, "rope");
    float h[NTOK * HID], qr[NTOK * QL];
    for (int i = 0; i < NTOK * HID; i++) h[i] = urand();
    for (int i = 0; i < NTOK * QL; i++) qr[i] = urand();
    int col = 5, width = col + ID;
    float *cache = calloc((size_t)CTX * width, sizeof(float));
    cb_kv kv = {.n_layers = 1, .ctx = CTX, .kv_dim = width, .k = cache};
    int sel[NTOK * ITOPK], n_sel[NTOK];
    cb_dsa_select(&x, h, qr, NTOK, 0, &kv, 0, col, &rope, sel, n_sel);
    /* Direct computation in double: keys, queries, weighted relu scores, then the k best. */
    double keys[NTOK][ID];
    for (int t = 0; t < NTOK; t++) {
        double hv[HID], mean = 0, var = 0;
        for (int i = 0; i < HID; i++) hv[i] = h[t * HID + i];
        matvec_ref(keys[t], wk, hv, ID, HID);
        for (int d = 0; d < ID; d++) mean += keys[t][d] / ID;
        for (int d = 0; d < ID; d++) var += (keys[t][d] - mean) * (keys[t][d] - mean) / ID;
        for (int d = 0; d < ID; d++) keys[t][d] = (keys[t][d] - mean) / sqrt(var + 1e-6) * lw[d] + lb[d];
        rope_ref(keys[t], ROPE, t);
    }
    double worst_key = 0;
    for (int t = 0; t < NTOK; t++)
        for (int d = 0; d < ID; d++) worst_key = fmax(worst_key, fabs(keys[t][d] - cache[t * width + col + d]));
    CHECK(worst_key < 1e-5, "index keys in the cache differ by %g", worst_key);
    for (int row = 0; row < NTOK; row++) {
        double q[IH * ID], qv[QL], hv[HID], w[IH], score[NTOK];
        for (int i = 0; i < QL; i++) qv[i] = qr[row * QL + i];
        for (int i = 0; i < HID; i++) hv[i] = h[row * HID + i];
        matvec_ref(q, wq, qv, IH * ID, QL);
        matvec_ref(w, wp, hv, IH, HID);
        for (int hd = 0; hd < IH; hd++) rope_ref(q + hd * ID, ROPE, row);
        for (int t = 0; t <= row; t++) {
            score[t] = 0;
            for (int hd = 0; hd < IH; hd++) {
                double d = 0;
                for (int e = 0; e < ID; e++) d += q[hd * ID + e] * keys[t][e];
                d /= sqrt((double)ID);
                score[t] += w[hd] / sqrt((double)IH) * (d > 0 ? d : 0);
            }
        }
        int want = row + 1 < ITOPK ? row + 1 : ITOPK, ok = n_sel[row] == want;
        for (int a = 0; a < n_sel[row] && ok; a++) {
            int t = sel[row * ITOPK + a], better = 0;
            for (int u = 0; u <= row; u++) better += score[u] > score[t];
            ok &= better < ITOPK && (a == 0 || sel[row * ITOPK + a - 1] < t);
        }
        CHECK(ok, "row %d: the indexer picked positions outside the top %d", row, ITOPK);
    }
    free(cache);
    cb_rope_free(&rope);
    cb_dsa_free(&x);
    cb_st_close(&idx);
    free_fixture();
}

int main(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/colibri-test-latent-XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_router_cases();
    test_router_random();
    test_top_positions();
    test_mla();
    test_dsa_select();
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmpdir);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", tmpdir);
    printf("test_latent_blocks: %d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
