/* decide.c: parsing, scoring and reporting of `decide` requests (decide.h). */
#include "decide.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void cb_decide_free(cb_decide *d) {
    void *owned[] = {d->rows, d->first_option, d->options, d->scores};
    for (size_t i = 0; i < sizeof owned / sizeof *owned; i++) free(owned[i]);
    memset(d, 0, sizeof *d);
}

static int fail(cb_decide *d, char *err, size_t errlen, const char *message) {
    snprintf(err, errlen, "%s", message);
    cb_decide_free(d);
    return -1;
}

int cb_decide_parse(const cb_json *req, int vocab, int prompt_len, cb_decide *d, char *err, size_t errlen) {
    memset(d, 0, sizeof *d);
    const cb_json *marks = cb_json_get(req, "marks"), *options = cb_json_get(req, "options");
    const cb_json *pin = cb_json_get(req, "pin");
    if (!marks || marks->type != CB_JARR || !marks->len || marks->len > CB_DECIDE_MAX_MARKS)
        return fail(d, err, errlen, "field \"marks\" must be a non-empty array of at most 4096 positions");
    if (!options || options->type != CB_JARR || options->len != marks->len)
        return fail(d, err, errlen, "field \"options\" must be an array of token-id arrays, one per mark");
    size_t total = 0;
    for (size_t i = 0; i < options->len; i++) {
        const cb_json *o = options->items[i];
        if (o->type != CB_JARR || !o->len) {
            snprintf(err, errlen, "field \"options\"[%zu] must be a non-empty array of token ids", i);
            cb_decide_free(d);
            return -1;
        }
        total += o->len;
    }
    if (total > CB_DECIDE_MAX_OPTIONS) return fail(d, err, errlen, "more than 65536 options in one decide");
    int n = (int)marks->len;
    d->rows = malloc((size_t)n * sizeof(int));
    d->first_option = malloc((size_t)(n + 1) * sizeof(int));
    d->options = malloc(total * sizeof(int));
    d->scores = calloc(total, sizeof(float));
    if (!d->rows || !d->first_option || !d->options || !d->scores) return fail(d, err, errlen, "out of memory");
    d->first_row = prompt_len;
    int k = 0;
    for (int i = 0; i < n; i++) {
        const cb_json *m = marks->items[i];
        if (m->type != CB_JNUM || !m->is_int || m->inum < 1 || m->inum > prompt_len) {
            snprintf(err, errlen, "field \"marks\"[%d] must be a token count in [1, %d] (the prompt's length)", i,
                     prompt_len);
            cb_decide_free(d);
            return -1;
        }
        d->rows[i] = (int)m->inum - 1;
        if (d->rows[i] < d->first_row) d->first_row = d->rows[i];
        d->first_option[i] = k;
        const cb_json *o = options->items[i];
        for (size_t j = 0; j < o->len; j++) {
            const cb_json *t = o->items[j];
            if (t->type != CB_JNUM || !t->is_int || t->inum < 0 || t->inum >= vocab) {
                snprintf(err, errlen, "field \"options\"[%d][%zu] is not a token id in [0, %d)", i, j, vocab);
                cb_decide_free(d);
                return -1;
            }
            d->options[k++] = (int)t->inum;
        }
    }
    d->first_option[n] = k;
    if (pin && pin->type != CB_JNULL) {
        if (pin->type != CB_JNUM || !pin->is_int || pin->inum < 0 || pin->inum > prompt_len) {
            snprintf(err, errlen, "field \"pin\" must be a token count in [0, %d] (the prompt's length)", prompt_len);
            cb_decide_free(d);
            return -1;
        }
        d->pin = (int)pin->inum;
    }
    d->n_marks = n;
    return 0;
}

int cb_decide_chunk(const cb_decide *d, int next, int n) {
    return d->pin > next && n > d->pin - next ? d->pin - next : n;
}

int cb_decide_reads(const cb_decide *d, int pos0, int n) {
    for (int i = 0; i < d->n_marks; i++)
        if (d->rows[i] >= pos0 && d->rows[i] < pos0 + n) return 1;
    return 0;
}

void cb_decide_collect(cb_decide *d, const float *logits, int pos0, int n, int vocab) {
    for (int i = 0; i < d->n_marks; i++) {
        int r = d->rows[i] - pos0;
        if (r < 0 || r >= n) continue;
        const float *row = logits + (size_t)r * (size_t)vocab;
        for (int k = d->first_option[i]; k < d->first_option[i + 1]; k++) d->scores[k] = row[d->options[k]];
    }
}

void cb_decide_put(cb_buf *b, const cb_decide *d, int64_t id) {
    cb_buf_printf(b, "{\"ev\":\"decision\",\"id\":%lld,\"scores\":[", (long long)id);
    for (int i = 0; i < d->n_marks; i++) {
        cb_buf_puts(b, i ? ",[" : "[");
        for (int k = d->first_option[i]; k < d->first_option[i + 1]; k++) {
            if (k > d->first_option[i]) cb_buf_puts(b, ",");
            if (isfinite(d->scores[k])) cb_buf_printf(b, "%.9g", (double)d->scores[k]);
            else cb_buf_puts(b, "null");
        }
        cb_buf_puts(b, "]");
    }
    cb_buf_puts(b, "]}");
}
