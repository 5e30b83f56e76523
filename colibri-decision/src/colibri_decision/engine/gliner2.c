/* gliner2.c: GLiNER2's classification (an `extractor` checkpoint): a DeBERTa-v3 encoder (runtime/deberta.h) under
 * `encoder.`, and the classifier MLP `classifier.0` (hidden -> 2 hidden), ReLU, `classifier.2` (2 hidden -> 1) that
 * GLiNER2 applies to the encoder's state at each `[L]` label marker: one logit per label.
 *
 * The engine only decides (cb_family.decide, the whole prompt at once): a decide's marks point at the label markers
 * (mark m reads position m - 1) and each reads option 0, the classifier's one output. Which prompt GLiNER2 builds,
 * and how the logits become probabilities, is Python's (colibri_decision/gliner2.py).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "deberta.h"
#include "decoder.h"
#include "encoder.h"
#include "engine.h"

#define ENCODER_PREFIX "encoder."   /* where GLiNER2's save_pretrained puts the encoder's own names */

typedef struct {
    cb_decoder d;              /* names the classifier's tensors; holds the index and the hidden size */
    cb_deberta enc;
    cb_linear hidden, out;     /* classifier.0, classifier.2 */
    float *b_hidden, *b_out;
    int hidden2, one, ctx;
} gliner2_t;

static const cb_tensor_spec CLASSIFIER[] = {
    CB_LINEAR("classifier.0.weight", gliner2_t, hidden, gliner2_t, hidden2, d.hidden),
    CB_VECTOR("classifier.0.bias", gliner2_t, b_hidden, gliner2_t, hidden2),
    CB_LINEAR("classifier.2.weight", gliner2_t, out, gliner2_t, one, hidden2),
    CB_VECTOR("classifier.2.bias", gliner2_t, b_out, gliner2_t, one),
    CB_TENSORS_END,
};

static void gliner2_free(void *p) {
    gliner2_t *m = p;
    if (!m) return;
    cb_deberta_free(&m->enc);
    cb_free_tensors(m, CLASSIFIER);
    cb_st_close(&m->d.idx);
    free(m);
}

static int gliner2_load(void **model, const cb_load_args *a, cb_model_info *info, char *err, size_t errlen) {
    gliner2_t *m = calloc(1, sizeof *m);
    if (!(*model = m)) return cb_oom(err, errlen, "the model");
    cb_deberta_config c;   /* a copy: the block's load starts from a cleared cb_deberta */
    size_t bytes = 0;
    if (cb_deberta_config_read(&c, a->hp, err, errlen) || cb_st_open(&m->d.idx, a->model_dir, err, errlen) ||
        cb_deberta_load(&m->enc, &c, &m->d.idx, ENCODER_PREFIX, &bytes, err, errlen))
        goto fail;
    m->d.hidden = c.hidden;
    m->hidden2 = 2 * c.hidden;
    m->one = 1;
    m->ctx = a->ctx;
    if (cb_load_tensors(m, m, CLASSIFIER, 0, &m->d.idx, &bytes, err, errlen)) goto fail;
    info->vocab = c.vocab;
    info->outputs = 1;         /* the classifier's one logit: every option of a decide is 0 */
    info->max_positions = c.position_biased_input ? c.max_positions : 0;
    info->dense_bytes = bytes;
    return 0;
fail:
    gliner2_free(m);
    *model = NULL;
    return -1;
}

/* The classifier's logit at each of rows[0..n) of the encoded states, into out[0..n). */
static int classify(const gliner2_t *m, const float *states, const int *rows, int n, float *out) {
    int H = m->d.hidden;
    float *x = malloc((size_t)n * H * sizeof(float)), *h = malloc((size_t)n * m->hidden2 * sizeof(float));
    if (x && h) {
        for (int i = 0; i < n; i++) memcpy(x + (size_t)i * H, states + (size_t)rows[i] * H, (size_t)H * sizeof(float));
        cb_linear_apply(&m->hidden, h, x, n);
        cb_add_bias(h, m->b_hidden, n, m->hidden2);
        cb_relu(h, (size_t)n * (size_t)m->hidden2);
        cb_linear_apply(&m->out, out, h, n);
        cb_add_bias(out, m->b_out, n, 1);
    }
    free(x);
    free(h);
    return x && h ? 0 : -1;
}

/* Encode the prompt once (every position sees every other), then classify the marks' rows; every option of a
 * mark is output 0, its label's logit. Activations are the call's own, as the encoder block's are. */
static int gliner2_decide(void *p, const int *tokens, int n, cb_decide *d, char *err, size_t errlen) {
    gliner2_t *m = p;
    if (n > m->ctx) {
        snprintf(err, errlen, "a prompt of %d tokens exceeds the context of %d", n, m->ctx);
        return -1;
    }
    float *states = malloc((size_t)n * m->d.hidden * sizeof(float));
    float *logits = malloc((size_t)d->n_marks * sizeof(float));
    int rc = !states || !logits ? cb_oom(err, errlen, "the activations")
                                : cb_deberta_forward(&m->enc, tokens, n, states, err, errlen);
    if (!rc && classify(m, states, d->rows, d->n_marks, logits)) rc = cb_oom(err, errlen, "the classifier");
    for (int i = 0; !rc && i < d->n_marks; i++)
        for (int k = d->first_option[i]; k < d->first_option[i + 1]; k++) d->scores[k] = logits[i];
    free(states);
    free(logits);
    return rc;
}

static const cb_family GLINER2 = {.name = "gliner2", .load = gliner2_load, .free = gliner2_free,
                                  .decide = gliner2_decide};

int main(int argc, char **argv) { return cb_engine_main(argc, argv, &GLINER2); }
