/* logits_procs.c: see logits_procs.h. */
#include "logits_procs.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BIAS 100.0
#define MAX_PENALTY 2.0

/* "logit_bias": [[token id, bias], ...], each bias in [-100, 100] as OpenAI allows. */
static int parse_bias(cb_procs *p, const cb_json *req, char *err, size_t errlen) {
    cb_json *v = cb_json_get(req, "logit_bias");
    if (!v || v->type == CB_JNULL) return 0;
    if (v->type != CB_JARR || v->len > (size_t)p->vocab) {
        snprintf(err, errlen, "field \"logit_bias\" must be an array of at most %d [token id, bias] pairs", p->vocab);
        return -1;
    }
    if (!v->len) return 0;
    p->bias_id = malloc(v->len * sizeof *p->bias_id);
    p->bias = malloc(v->len * sizeof *p->bias);
    if (!p->bias_id || !p->bias) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < v->len; i++) {
        const cb_json *e = v->items[i];
        const cb_json *t = e->type == CB_JARR && e->len == 2 ? e->items[0] : NULL;
        const cb_json *b = t ? e->items[1] : NULL;
        if (!t || t->type != CB_JNUM || !t->is_int || t->inum < 0 || t->inum >= p->vocab || b->type != CB_JNUM ||
            !(b->num >= -MAX_BIAS && b->num <= MAX_BIAS)) {
            snprintf(err, errlen, "field \"logit_bias\"[%zu] must be [token id in [0, %d), bias in [-100, 100]]", i,
                     p->vocab);
            return -1;
        }
        p->bias_id[i] = (int)t->inum;
        p->bias[i] = (float)b->num;
    }
    p->n_bias = (int)v->len;
    return 0;
}

static int parse_flags(cb_procs *p, const cb_json *req, char *err, size_t errlen) {
    cb_json *lp = cb_json_get(req, "logprobs");
    p->top_logprobs = -1;
    if (lp && lp->type != CB_JNULL) {
        if (lp->type != CB_JNUM || !lp->is_int || lp->inum < 0 || lp->inum > CB_MAX_TOP_LOGPROBS) {
            snprintf(err, errlen, "field \"logprobs\" must be an integer in [0, %d] (top log-probabilities per token)",
                     CB_MAX_TOP_LOGPROBS);
            return -1;
        }
        p->top_logprobs = (int)lp->inum;
    }
    static const char *switches[] = {"dist", "constrained"};
    int *targets[] = {&p->dist, &p->constrained};
    for (int i = 0; i < 2; i++) {
        cb_json *v = cb_json_get(req, switches[i]);
        if (v && v->type != CB_JNULL && v->type != CB_JBOOL) {
            snprintf(err, errlen, "field \"%s\" must be a boolean", switches[i]);
            return -1;
        }
        *targets[i] = v && v->type == CB_JBOOL && v->boolean;
    }
    return 0;
}

int cb_procs_parse(cb_procs *p, const cb_json *req, int vocab, const int *prompt, int n_prompt, char *err,
                   size_t errlen) {
    memset(p, 0, sizeof *p);
    p->vocab = vocab;
    double rep, pres, freq, min_p;
    if (cb_json_num_field(req, "min_p", 0.0, 0.0, 1.0, &min_p, err, errlen) ||
        cb_json_num_field(req, "repetition_penalty", 1.0, 1e-3, 1e3, &rep, err, errlen) ||
        cb_json_num_field(req, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY, &pres, err, errlen) ||
        cb_json_num_field(req, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY, &freq, err, errlen) ||
        parse_bias(p, req, err, errlen) || parse_flags(p, req, err, errlen))
        goto fail;
    p->min_p = (float)min_p;
    p->repetition_penalty = (float)rep;
    p->presence_penalty = (float)pres;
    p->frequency_penalty = (float)freq;
    size_t nv = (size_t)vocab;
    int ok = 1;
    if (p->repetition_penalty != 1.0f) {
        ok &= (p->seen = calloc(nv, 1)) != NULL;
        for (int i = 0; ok && i < n_prompt; i++) p->seen[prompt[i]] = 1;
    }
    if (p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f) ok &= (p->counts = calloc(nv, sizeof(int))) != NULL;
    if (p->constrained) {
        ok &= (p->mask = calloc((nv + 31) / 32, sizeof *p->mask)) != NULL;
        ok &= (p->held = malloc(nv * sizeof(float))) != NULL;
    }
    if (p->dist) ok &= (p->probs = malloc(nv * sizeof(float))) != NULL;
    ok &= (p->work = malloc(nv * sizeof(float))) != NULL;
    if (!ok) {
        snprintf(err, errlen, "out of memory for the sampler's buffers");
        goto fail;
    }
    return 0;
fail:
    cb_procs_free(p);
    return -1;
}

void cb_procs_free(cb_procs *p) {
    free(p->bias_id);
    free(p->bias);
    free(p->mask);
    free(p->held);
    free(p->work);
    free(p->probs);
    free(p->counts);
    free(p->seen);
    memset(p, 0, sizeof *p);
}

int cb_procs_waits(cb_procs *p, const float *logits) {
    if (!p->constrained || p->have_mask) return 0;
    memcpy(p->held, logits, (size_t)p->vocab * sizeof(float));
    return 1;
}

static int b64_value(char ch) {
    if (ch >= 'A' && ch <= 'Z') return ch - 'A';
    if (ch >= 'a' && ch <= 'z') return ch - 'a' + 26;
    if (ch >= '0' && ch <= '9') return ch - '0' + 52;
    if (ch == '+') return 62;
    if (ch == '/') return 63;
    return -1;
}

int cb_procs_set_mask(cb_procs *p, const cb_json *req, char *err, size_t errlen) {
    if (!p->constrained) {
        snprintf(err, errlen, "this sequence was not submitted with \"constrained\": true");
        return -1;
    }
    if (p->have_mask) {
        snprintf(err, errlen, "a mask for this step is already waiting (send one mask per sampled token)");
        return -1;
    }
    cb_json *v = cb_json_get(req, "allow");
    size_t words = ((size_t)p->vocab + 31) / 32, bytes = words * 4;
    if (!v || v->type != CB_JSTR || v->len != (bytes + 2) / 3 * 4) {
        snprintf(err, errlen, "field \"allow\" must be base64 of %zu bytes (one bit per token, %zu 32-bit words)",
                 bytes, words);
        return -1;
    }
    memset(p->mask, 0, bytes);
    unsigned char *out = (unsigned char *)p->mask;   /* little-endian words: byte j holds tokens 8 j .. 8 j + 7 */
    size_t at = 0;
    for (size_t i = 0; i < v->len; i += 4) {
        int q[4];
        for (int k = 0; k < 4; k++) q[k] = v->str[i + k] == '=' ? 0 : b64_value(v->str[i + k]);
        if (q[0] < 0 || q[1] < 0 || q[2] < 0 || q[3] < 0) {
            snprintf(err, errlen, "field \"allow\" is not base64 (character %zu)", i);
            return -1;
        }
        unsigned char three[3] = {(unsigned char)(q[0] << 2 | q[1] >> 4), (unsigned char)((q[1] & 15) << 4 | q[2] >> 2),
                                  (unsigned char)((q[2] & 3) << 6 | q[3])};
        for (int k = 0; k < 3 && at < bytes; k++) out[at++] = three[k];
    }
    /* the words are little-endian on the wire; on a big-endian host swap them into host order */
    for (size_t w = 0; w < words; w++) {
        const unsigned char *b = (const unsigned char *)&p->mask[w];
        p->mask[w] = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    }
    p->have_mask = 1;
    return 0;
}

/* The processed logits, in transformers' processor order (see logits_procs.h). -1 when the mask allows nothing. */
static int process(cb_procs *p, const float *logits) {
    float *w = p->work;
    memcpy(w, logits, (size_t)p->vocab * sizeof(float));
    if (p->constrained) {
        int any = 0;
        for (int t = 0; t < p->vocab; t++) {
            if (p->mask[t >> 5] >> (t & 31) & 1u) any = 1;
            else w[t] = -INFINITY;
        }
        if (!any) return -1;
    }
    for (int i = 0; i < p->n_bias; i++) w[p->bias_id[i]] += p->bias[i];
    if (p->seen)
        for (int t = 0; t < p->vocab; t++)
            if (p->seen[t]) w[t] = w[t] < 0 ? w[t] * p->repetition_penalty : w[t] / p->repetition_penalty;
    if (p->counts)
        for (int t = 0; t < p->vocab; t++)
            if (p->counts[t])
                w[t] -= p->frequency_penalty * (float)p->counts[t] + p->presence_penalty;
    return 0;
}

int cb_procs_sample(cb_procs *p, cb_sampler *s, const float *logits, void *work, char *err, size_t errlen) {
    if (process(p, logits)) {
        snprintf(err, errlen, "the constraint's mask allows no token");
        return -1;
    }
    p->have_mask = 0;
    p->steps++;
    return cb_sample_dist(s, p->work, p->vocab, work, p->probs);
}

void cb_procs_note(cb_procs *p, int tok) {
    if (p->seen) p->seen[tok] = 1;
    if (p->counts) p->counts[tok]++;
}

/* log-softmax of the model's logits; top: the k largest (ties by lower id), in descending order */
void cb_procs_put_logprobs(const cb_procs *p, cb_buf *b, const float *logits, int tok) {
    if (p->top_logprobs < 0) return;
    int n = p->vocab, k = p->top_logprobs;
    float max = logits[cb_argmax(logits, n)];
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - max);
    double lse = max + log(sum);
    cb_buf_printf(b, ",\"logprob\":%.9g,\"top\":[", (double)logits[tok] - lse);
    int top[CB_MAX_TOP_LOGPROBS];
    int m = 0;
    for (int i = 0; k > 0 && i < n; i++) {
        if (m == k && !(logits[i] > logits[top[m - 1]])) continue;   /* k = 0 never enters */
        int j = m < k ? m++ : m - 1;
        while (j > 0 && logits[i] > logits[top[j - 1]]) {
            top[j] = top[j - 1];
            j--;
        }
        top[j] = i;
    }
    for (int i = 0; i < m; i++)
        cb_buf_printf(b, "%s[%d,%.9g]", i ? "," : "", top[i], (double)logits[top[i]] - lse);
    cb_buf_puts(b, "]");
}
