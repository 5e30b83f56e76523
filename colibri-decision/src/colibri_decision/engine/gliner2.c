/* gliner2.c: GLiNER2's classification (an `extractor` checkpoint): a DeBERTa-v3 encoder (runtime/deberta.h) under
 * `encoder.`, and the classifier MLP `classifier.0` (hidden -> 2 hidden), ReLU, `classifier.2` (2 hidden -> 1) that
 * GLiNER2 applies to the encoder's state at each `[L]` label marker: one logit per label.
 *
 * The engine is decision-only (runtime/encoder_engine.h): a decide's marks point at the label markers (mark m reads
 * position m - 1) and each reads option 0, the classifier's one output. Which prompt GLiNER2 builds, and how the
 * logits become probabilities, is Python's (colibri_decision/gliner2.py).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "deberta.h"
#include "encoder_engine.h"
#include "safetensors.h"

typedef struct {
    cb_st_index idx;
    cb_deberta enc;
    cb_linear hidden, out;     /* classifier.0, classifier.2 */
    float *b_hidden, *b_out;
    float *states;             /* ctx x hidden: the encoder's output of the current prompt */
    int ctx;
} gliner2_t;

static void gliner2_free(void *p) {
    gliner2_t *m = p;
    if (!m) return;
    cb_deberta_free(&m->enc);
    cb_linear_free(&m->hidden);
    cb_linear_free(&m->out);
    free(m->b_hidden);
    free(m->b_out);
    free(m->states);
    cb_st_close(&m->idx);
    free(m);
}

static int gliner2_load(void **model, const cb_load_args *a, cb_encoder_info *info, char *err, size_t errlen) {
    gliner2_t *m = calloc(1, sizeof *m);
    if (!m) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    *model = m;
    cb_deberta_config c;
    size_t bytes = 0;
    if (cb_deberta_config_read(&c, a->hp, err, errlen) || cb_st_open(&m->idx, a->model_dir, err, errlen)) goto fail;
    if (cb_deberta_load(&m->enc, &c, &m->idx, "encoder.", &bytes, err, errlen)) goto fail;
    int H = c.hidden;
    if (cb_load_linear(&m->hidden, &m->idx, "classifier.0.weight", 2 * H, H, &bytes, err, errlen) ||
        cb_load_vector(&m->b_hidden, &m->idx, "classifier.0.bias", 2 * H, &bytes, err, errlen) ||
        cb_load_linear(&m->out, &m->idx, "classifier.2.weight", 1, 2 * H, &bytes, err, errlen) ||
        cb_load_vector(&m->b_out, &m->idx, "classifier.2.bias", 1, &bytes, err, errlen))
        goto fail;
    m->ctx = a->ctx;
    m->states = malloc((size_t)a->ctx * H * sizeof(float));
    if (!m->states) {
        snprintf(err, errlen, "out of memory for %d positions of %d states", a->ctx, H);
        goto fail;
    }
    info->vocab = c.vocab;
    info->outputs = 1;
    info->max_positions = c.position_biased_input ? c.max_positions : 0;
    info->dense_bytes = bytes;
    return 0;
fail:
    gliner2_free(m);
    *model = NULL;
    return -1;
}

static int gliner2_score(void *p, const int *tokens, int n, const int *rows, int n_rows, float *out, char *err,
                         size_t errlen) {
    gliner2_t *m = p;
    int H = m->enc.c.hidden;
    if (n > m->ctx) {
        snprintf(err, errlen, "prompt of %d tokens exceeds the context of %d", n, m->ctx);
        return -1;
    }
    if (cb_deberta_forward(&m->enc, tokens, n, m->states, err, errlen)) return -1;
    float *x = malloc((size_t)n_rows * H * sizeof(float)), *h = malloc((size_t)n_rows * 2 * H * sizeof(float));
    if (!x || !h) {
        free(x);
        free(h);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (int i = 0; i < n_rows; i++) memcpy(x + (size_t)i * H, m->states + (size_t)rows[i] * H, H * sizeof(float));
    cb_linear_apply(&m->hidden, h, x, n_rows);
    cb_add_bias(h, m->b_hidden, n_rows, 2 * H);
    for (size_t i = 0; i < (size_t)n_rows * 2 * H; i++) h[i] = h[i] > 0 ? h[i] : 0;
    cb_linear_apply(&m->out, out, h, n_rows);
    cb_add_bias(out, m->b_out, n_rows, 1);
    free(x);
    free(h);
    return 0;
}

static const cb_encoder_family GLINER2 = {"gliner2", gliner2_load, gliner2_score, gliner2_free};

int main(int argc, char **argv) { return cb_encoder_main(argc, argv, &GLINER2); }
