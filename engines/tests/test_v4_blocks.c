/* test_v4_blocks.c: DeepSeek-V4's shared blocks against double-precision transcriptions of transformers'
 * formulas: hyper-connections (hyperconn.h), sink attention (sink_attn.h), the window compressor
 * (compressor.h) and sqrt(softplus) / hash routing (softplus_router.h). */
#include <string.h>

#include "compressor.h"
#include "hyperconn.h"
#include "qwen_blocks_common.h"
#include "sink_attn.h"
#include "softplus_router.h"

enum { HC = 4, HID = 24, MIX = (2 + HC) * HC };

static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }

static void test_hyperconn(void) {
    cb_hc_shape s = {HC, HID, 5, 1e-6f, 1e-6f};
    float *fn = rand_floats((size_t)MIX * HC * HID, 0.2f, 0), *base = rand_floats(MIX, 0.3f, 0);
    float scale[3] = {0.7f, 1.3f, 0.9f};
    float *X = rand_floats(HC * HID, 1.0f, 0), *y = rand_floats(HID, 1.0f, 0);
    float pre[HC], post[HC], comb[HC * HC], *scratch = malloc((size_t)cb_hc_scratch_floats(&s) * sizeof(float));
    cb_hc_weights(&s, fn, base, scale, X, pre, post, comb, scratch);
    /* reference */
    double ms = 0, mix[MIX], rpre[HC], rpost[HC], rc[HC][HC];
    for (int i = 0; i < HC * HID; i++) ms += (double)X[i] * X[i];
    double inv = 1.0 / sqrt(ms / (HC * HID) + 1e-6);
    for (int o = 0; o < MIX; o++) {
        double acc = 0;
        for (int i = 0; i < HC * HID; i++) acc += (double)fn[(size_t)o * HC * HID + i] * X[i] * inv;
        mix[o] = acc;
    }
    for (int j = 0; j < HC; j++) {
        rpre[j] = sigm(mix[j] * scale[0] + base[j]) + 1e-6;
        rpost[j] = 2 * sigm(mix[HC + j] * scale[1] + base[HC + j]);
        double mx = -1e300, sum = 0;
        for (int k = 0; k < HC; k++) {
            rc[j][k] = mix[2 * HC + j * HC + k] * scale[2] + base[2 * HC + j * HC + k];
            mx = fmax(mx, rc[j][k]);
        }
        for (int k = 0; k < HC; k++) sum += (rc[j][k] = exp(rc[j][k] - mx));
        for (int k = 0; k < HC; k++) rc[j][k] = rc[j][k] / sum + 1e-6;
    }
    for (int it = 0; it < 5; it++) {
        if (it)
            for (int j = 0; j < HC; j++) {
                double sum = 0;
                for (int k = 0; k < HC; k++) sum += rc[j][k];
                for (int k = 0; k < HC; k++) rc[j][k] /= sum + 1e-6;
            }
        for (int k = 0; k < HC; k++) {
            double sum = 0;
            for (int j = 0; j < HC; j++) sum += rc[j][k];
            for (int j = 0; j < HC; j++) rc[j][k] /= sum + 1e-6;
        }
    }
    double e = 0;
    for (int j = 0; j < HC; j++) {
        e = fmax(e, fabs(pre[j] - rpre[j]));
        e = fmax(e, fabs(post[j] - rpost[j]));
        for (int k = 0; k < HC; k++) e = fmax(e, fabs(comb[j * HC + k] - rc[j][k]));
    }
    CHECK(e < 1e-5, "hyper-connection weights vs double reference: %g", e);
    double colsum = 0;
    for (int j = 0; j < HC; j++) colsum += comb[j * HC + 1];
    CHECK(fabs(colsum - 1) < 1e-4, "Sinkhorn leaves columns summing to 1: %g", colsum);
    /* collapse and expand */
    float c[HID], *tmp = malloc(HC * HID * sizeof(float)), *Xo = malloc(HC * HID * sizeof(float));
    memcpy(Xo, X, HC * HID * sizeof(float));
    cb_hc_collapse(c, X, pre, HC, HID);
    cb_hc_expand(X, y, post, comb, HC, HID, tmp);
    double ec = 0, ex = 0;
    for (int d = 0; d < HID; d++) {
        double acc = 0;
        for (int j = 0; j < HC; j++) acc += rpre[j] * Xo[j * HID + d];
        ec = fmax(ec, fabs(c[d] - acc));
        for (int k = 0; k < HC; k++) {
            double v = rpost[k] * y[d];
            for (int j = 0; j < HC; j++) v += rc[j][k] * Xo[j * HID + d];
            ex = fmax(ex, fabs(X[k * HID + d] - v));
        }
    }
    CHECK(ec < 1e-5 && ex < 1e-5, "collapse %g / expand %g vs double reference", ec, ex);
    /* head: pre only */
    float hpre[HC];
    cb_hc_head_weights(&s, fn, base, scale, Xo, hpre, scratch);
    CHECK(fabs(hpre[2] - rpre[2]) < 1e-5, "head pre vs the block's pre from the same map: %g", hpre[2] - rpre[2]);
    free(fn); free(base); free(X); free(y); free(scratch); free(tmp); free(Xo);
}

enum { NH = 3, D = 16, ROWS = 7 };

static void test_sink_attention(void) {
    float *q = rand_floats(NH * D, 1.0f, 0), *kv = rand_floats(ROWS * D, 1.0f, 0), sinks[NH] = {0.5f, -1.0f, 3.0f};
    const float *rows[ROWS];
    for (int r = 0; r < ROWS; r++) rows[ROWS - 1 - r] = kv + r * D;   /* any order of row pointers */
    float out[NH * D], scores[ROWS + 1];
    float scale = 1.0f / sqrtf((float)D);
    for (int with_sink = 0; with_sink < 2; with_sink++) {
        cb_sink_attend(out, q, NH, D, rows, ROWS, with_sink ? sinks : NULL, scale, scores);
        double e = 0, mass = 0;
        for (int h = 0; h < NH; h++) {
            double s[ROWS], mx = with_sink ? sinks[h] : -1e300, sum = 0;
            for (int r = 0; r < ROWS; r++) {
                s[r] = 0;
                for (int d = 0; d < D; d++) s[r] += (double)q[h * D + d] * rows[r][d];
                s[r] *= scale;
                mx = fmax(mx, s[r]);
            }
            for (int r = 0; r < ROWS; r++) sum += (s[r] = exp(s[r] - mx));
            if (with_sink) sum += exp(sinks[h] - mx);
            double m = 0;
            for (int d = 0; d < D; d++) {
                double acc = 0;
                for (int r = 0; r < ROWS; r++) acc += s[r] / sum * rows[r][d];
                e = fmax(e, fabs(out[h * D + d] - acc));
            }
            for (int r = 0; r < ROWS; r++) m += s[r] / sum;
            if (h == 2) mass = m;
        }
        CHECK(e < 1e-5, "sink=%d: attention vs double reference: %g", with_sink, e);
        CHECK(with_sink ? mass < 0.9 : fabs(mass - 1) < 1e-9, "sink=%d: the sink takes weight (rows hold %g)",
              with_sink, mass);
    }
    free(q); free(kv);
}

enum { SLOTS = 6, CD = 10 };

static void test_compressor(void) {
    float *kv = rand_floats(SLOTS * CD, 1.0f, 0), *g = rand_floats(SLOTS * CD, 2.0f, 0), entry[CD];
    const float *pk[SLOTS], *pg[SLOTS];
    for (int absent = 0; absent < 2; absent++) {
        for (int s = 0; s < SLOTS; s++) {
            int gone = absent && s < 2;   /* the overlapping window's first half before the sequence starts */
            pk[s] = gone ? NULL : kv + s * CD;
            pg[s] = gone ? NULL : g + s * CD;
        }
        cb_compress_window(entry, pk, pg, SLOTS, CD);
        double e = 0;
        for (int c = 0; c < CD; c++) {
            double mx = -1e300, sum = 0, acc = 0;
            for (int s = absent ? 2 : 0; s < SLOTS; s++) mx = fmax(mx, g[s * CD + c]);
            for (int s = absent ? 2 : 0; s < SLOTS; s++) sum += exp(g[s * CD + c] - mx);
            for (int s = absent ? 2 : 0; s < SLOTS; s++) acc += exp(g[s * CD + c] - mx) / sum * kv[s * CD + c];
            e = fmax(e, fabs(entry[c] - acc));
        }
        CHECK(e < 1e-5, "absent=%d: compressed entry vs double reference: %g", absent, e);
    }
    free(kv); free(g);
}

enum { E = 16, K = 4 };

static void test_routing(void) {
    CHECK(cb_sqrtsoftplus(30.0f) == sqrtf(30.0f), "softplus is the identity above 20 (torch's threshold)");
    CHECK(fabs(cb_sqrtsoftplus(0.0f) - sqrt(log(2.0))) < 1e-6, "sqrt(softplus(0)) = sqrt(ln 2)");
    float *logits = rand_floats(E, 3.0f, 0), *bias = rand_floats(E, 0.5f, 0), w[K], scores[E];
    int idx[K];
    cb_sqrtsoftplus_route(logits, bias, E, K, 1.5f, idx, w, scores);
    double sc[E], sum = 0;
    for (int e = 0; e < E; e++) sc[e] = sqrt(log1p(exp((double)logits[e])));
    int taken[E] = {0};
    for (int j = 0; j < K; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!taken[e] && (best < 0 || sc[e] + bias[e] > sc[best] + bias[best])) best = e;
        taken[best] = 1;
        CHECK(idx[j] == best, "choice %d: expert %d, reference %d (biased selection)", j, idx[j], best);
        sum += sc[best];
    }
    for (int j = 0; j < K; j++)
        CHECK(fabs(w[j] - sc[idx[j]] / sum * 1.5) < 1e-5, "weight %d: %g vs %g", j, w[j], sc[idx[j]] / sum * 1.5);
    int32_t table[K] = {9, 2, 14, 5};
    cb_hash_route(logits, table, K, 2.0f, idx, w);
    sum = 0;
    for (int j = 0; j < K; j++) sum += sc[table[j]];
    for (int j = 0; j < K; j++) {
        CHECK(idx[j] == table[j], "hash choice %d is the table's", j);
        CHECK(fabs(w[j] - sc[table[j]] / sum * 2.0) < 1e-5, "hash weight %d", j);
    }
    free(logits); free(bias);
}

int main(void) {
    (void)max_abs_diff;
    test_hyperconn();
    test_sink_attention();
    test_compressor();
    test_routing();
    printf("test_v4_blocks: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
