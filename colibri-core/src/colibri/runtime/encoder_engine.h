/* encoder_engine.h: the process of a decision-only encoder model (an extractor's classifier heads over a
 * bidirectional encoder): the same command line and JSON-lines protocol as engine.h's (docs/protocol.md), but the
 * one sequence operation is `decide`, and `ready` announces `"abilities": ["decide"]`.
 *
 * An encoder reads the whole prompt at once (every position attends to every other), so there is no KV cache,
 * no prefix reuse and no prefill in chunks: a decide is one forward pass over its prompt, answered at once (`accept`
 * with `reused_tokens` 0, `decision`, `done` `decided`). A mark m reads the head's outputs at prompt position m - 1
 * and its options are indices into those outputs (`[0, outputs)`), the encoder's analogue of a language model's
 * token ids into a logits row. `pin` is accepted and ignored: there is no state to keep between requests.
 * `submit` is refused with `bad_request` (the engine does not chat); `reset`, `cancel`, `stats`, `shutdown` work
 * as in engine.h's process (a decide is never running when the next line is read).
 *
 *     int main(int argc, char **argv) { return cb_encoder_main(argc, argv, &my_encoder); }
 */
#ifndef COLIBRI_ENCODER_ENGINE_H
#define COLIBRI_ENCODER_ENGINE_H

#include <stddef.h>

#include "family.h"

typedef struct {
    int vocab;                 /* prompt token ids lie in [0, vocab) */
    int outputs;               /* head outputs per position: a decide's options lie in [0, outputs) */
    int max_positions;         /* the longest prompt the encoder reads (0: only --ctx bounds it) */
    size_t dense_bytes;
} cb_encoder_info;

typedef struct {
    const char *name;
    int (*load)(void **model, const cb_load_args *args, cb_encoder_info *info, char *err, size_t errlen);
    /* Encode tokens[0..n) and write the head's outputs at each of rows[0..n_rows) (positions, may repeat) into
     * out[n_rows x outputs]. 0, or -1 with a message. */
    int (*score)(void *model, const int *tokens, int n, const int *rows, int n_rows, float *out, char *err,
                 size_t errlen);
    void (*free)(void *model);
} cb_encoder_family;

int cb_encoder_main(int argc, char **argv, const cb_encoder_family *family);

#endif
