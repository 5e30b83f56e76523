/* decide.h: the `decide` request of the engine protocol (docs/protocol.md): a prompt, the positions whose next-token
 * logits are read, and the tokens (options) to read there. The reply is those logits only, not whole rows, so a
 * System One question about a 150k-vocabulary model moves a handful of floats.
 *
 * Every family gets it from the shared runtime: a decide is a sequence that prefills its prompt and ends without
 * generating, reading selected logits on the way. `pin` marks the end of the state the questions share: a family
 * with recurrent state checkpoints it there (instead of at the end of the prompt), so the next question on the
 * same slot restores the state and prefills only its own tokens; attention KV needs nothing, the slot's
 * longest-common-prefix reuse already keeps the state.
 */
#ifndef COLIBRI_DECIDE_H
#define COLIBRI_DECIDE_H

#include <stdint.h>

#include "json.h"

#define CB_DECIDE_MAX_MARKS 4096
#define CB_DECIDE_MAX_OPTIONS 65536   /* all marks together */

typedef struct {
    int n_marks;               /* 0: the sequence is not a decide */
    int *rows;                 /* prompt position read for each mark (the token before it) */
    int *first_option;         /* n_marks + 1 offsets into options */
    int *options;              /* token ids to read at each row */
    float *scores;             /* one logit per option, filled as the rows are computed */
    int first_row;             /* the smallest row: the prompt is recomputed at least from there */
    int pin;                   /* prompt tokens of the shared state (0: none) */
} cb_decide;

/* Parse `marks` (tokens before each mark, in [1, prompt_len]), `options` (one non-empty array of token ids per
 * mark) and optional `pin` (in [0, prompt_len]) of a decide request. Returns 0, or -1 with a message in err. */
int cb_decide_parse(const cb_json *req, int vocab, int prompt_len, cb_decide *d, char *err, size_t errlen);

/* The length of a prefill chunk from `next` that ends no later than the pin (so the state there can be saved). */
int cb_decide_chunk(const cb_decide *d, int next, int n);

/* Whether a row of [pos0, pos0 + n) is read: the forward pass must then return every row's logits. */
int cb_decide_reads(const cb_decide *d, int pos0, int n);

/* Copy the options' logits of the rows in [pos0, pos0 + n) out of logits[n * vocab]. */
void cb_decide_collect(cb_decide *d, const float *logits, int pos0, int n, int vocab);

/* The `decision` event: {"ev":"decision","id":..,"scores":[[..], ..]} (one array per mark, %.9g floats). */
void cb_decide_put(cb_buf *b, const cb_decide *d, int64_t id);

void cb_decide_free(cb_decide *d);

#endif
