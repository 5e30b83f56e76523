/* sampler.c: see sampler.h. */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float p;
    int i;
} cand;

uint32_t cb_pcg32(cb_sampler *s) {
    uint64_t old = s->state;
    s->state = old * 6364136223846793005ULL + s->inc;
    uint32_t xorshifted = (uint32_t)(((old >> 18u) ^ old) >> 27u);
    uint32_t rot = (uint32_t)(old >> 59u);
    return (xorshifted >> rot) | (xorshifted << ((32u - rot) & 31u));
}

void cb_sampler_init(cb_sampler *s, float temperature, float top_p, int top_k, uint64_t seed) {
    s->temperature = temperature;
    s->top_p = top_p;
    s->top_k = top_k;
    s->min_p = 0.0f;
    s->state = 0;
    s->inc = (seed << 1u) | 1u;
    cb_pcg32(s);
    s->state += seed;
    cb_pcg32(s);
}

int cb_argmax(const float *logits, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

/* Descending probability, ascending index on ties, so the order (and the draw) is deterministic. */
static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->p != y->p) return x->p < y->p ? 1 : -1;
    return x->i - y->i;
}

int cb_sample(cb_sampler *s, const float *logits, int n, void *work) {
    return cb_sample_dist(s, logits, n, work, NULL);
}

int cb_sample_dist(cb_sampler *s, const float *logits, int n, void *work, float *probs) {
    if (s->temperature <= 0.0f) {
        int best = cb_argmax(logits, n);
        if (probs) {
            memset(probs, 0, (size_t)n * sizeof *probs);
            probs[best] = 1.0f;
        }
        return best;
    }
    cand *c = work;
    float max = logits[cb_argmax(logits, n)];
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        c[i].i = i;
        c[i].p = expf((logits[i] - max) / s->temperature);   /* a masked (-inf) logit gives 0 */
        sum += c[i].p;
    }
    int m = n;
    int truncate = (s->top_k > 0 && s->top_k < n) || (s->top_p > 0.0f && s->top_p < 1.0f) || s->min_p > 0.0f;
    if (truncate) {
        qsort(c, (size_t)n, sizeof *c, cand_cmp);
        if (s->top_k > 0 && s->top_k < m) m = s->top_k;
        sum = 0.0;
        for (int i = 0; i < m; i++) sum += c[i].p;
        if (s->top_p > 0.0f && s->top_p < 1.0f) {
            double acc = 0.0;
            int keep = m;
            for (int i = 0; i < m; i++) {
                acc += c[i].p;
                if (acc >= s->top_p * sum) { keep = i + 1; break; }
            }
            m = keep;
        }
        if (s->min_p > 0.0f) {
            /* c[0].p is exp(0) = 1, the likeliest token's weight: the ratio test needs no normalisation. */
            int keep = 1;
            while (keep < m && c[keep].p >= s->min_p * c[0].p) keep++;
            m = keep;
        }
        sum = 0.0;
        for (int i = 0; i < m; i++) sum += c[i].p;
    }
    if (probs) {
        memset(probs, 0, (size_t)n * sizeof *probs);
        for (int i = 0; i < m; i++) probs[c[i].i] = (float)(c[i].p / sum);
    }
    /* 24 random bits give a uniform float in [0, 1). */
    double r = (double)(cb_pcg32(s) >> 8) / 16777216.0 * sum, acc = 0.0;
    int last = -1;   /* rounding can leave r past the sum: fall back to the last token that has any weight */
    for (int i = 0; i < m; i++) {
        if (c[i].p <= 0.0f) continue;
        last = i;
        acc += c[i].p;
        if (r < acc) return c[i].i;
    }
    return c[last >= 0 ? last : 0].i;
}
