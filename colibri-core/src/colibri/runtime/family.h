/* family.h: the interface between a family engine and the process that runs it (engine.h): what load is given,
 * what it reports back, and the calls of a cb_family. Blocks may read these types (decoder.h fills a
 * cb_model_info); nothing here depends on the process.
 */
#ifndef COLIBRI_FAMILY_H
#define COLIBRI_FAMILY_H

#include <stddef.h>

#include "decide.h"
#include "experts.h"
#include "hparams.h"
#include "kv.h"

typedef struct {
    const char *model_dir;
    int ctx, slots, cap, threads;
    int max_batch;             /* the most tokens one forward call will get (the prefill chunk) */
    cb_hparams *hp;
} cb_load_args;

/* What load reports back so the runtime can size KV, answer `ready` and count expert traffic. */
typedef struct {
    int vocab;
    int n_layers, kv_dim;      /* KV geometry per slot */
    int kv_k_only;             /* 1: one row of kv_dim floats per token and layer and no V cache (MLA keeps its
                                * compressed latent there); cb_kv.v is then NULL */
    size_t state_bytes;        /* per-slot recurrent state (linear attention), zeroed = the empty sequence. The
                                * runtime keeps a second copy per slot, checkpointed at the end of each prompt;
                                * a slot's prefix is reused only up to the live state or that checkpoint */
    size_t dense_bytes;
    size_t expert_cache_bytes;
    int decide_only;           /* 1: the logits are a decision head's scores, not next tokens: the engine announces
                                * only "decide" and refuses generation */
    int outputs;               /* with cb_family.decide: the head's outputs per position; a decide's options lie in
                                * [0, outputs) (the runtime checks them) and `ready` announces it */
    int max_positions;         /* the longest sequence the model reads (0: only --ctx bounds it); a larger --ctx is
                                * refused at start */
    int n_expert_layers;
    cb_expert_layer **expert_layers;   /* owned by the model; read for stats */
} cb_model_info;

typedef struct cb_family {
    const char *name;
    int (*load)(void **model, const cb_load_args *args, cb_model_info *info, char *err, size_t errlen);
    /* Run tokens[0..n) at positions pos0.. on this slot's KV (positions < pos0 already hold this sequence).
     * Write vocab logits of every row into logits[n * vocab] when all_logits, else of the last row into
     * logits[vocab]. Results must not depend on n: row i equals what n = 1 at position pos0 + i gives. */
    int (*forward)(void *model, cb_kv *kv, const int *tokens, int n, int pos0, float *logits, int all_logits,
                   char *err, size_t errlen);
    void (*free)(void *model);
    /* Optional: the next token of each of n sequences in one pass, so each routed expert any of them chose is read
     * once per layer (docs/architecture.md, "Scheduling"). Sequence i feeds tokens[i] at position pos0[i] on the
     * KV (and recurrent state) kvs[i]; its vocab logits go to logits[i * vocab]. n is at most max_batch; each row
     * must equal what forward gives that sequence alone (n = 1), bit for bit. NULL: the engine steps each slot by
     * itself (families with their own forward, image and decision engines). */
    int (*forward_batch)(void *model, cb_kv *const *kvs, const int *tokens, const int *pos0, int n, float *logits,
                         char *err, size_t errlen);
    /* Optional: answer a decide from the whole prompt in one call, for a bidirectional encoder (every token sees
     * every other, so nothing is computed in chunks, no KV is kept and no prefix is reused). Fill d->scores: per
     * mark, one score per option, the options being columns of the family's decision head, in
     * [0, cb_model_info.outputs) (checked by the runtime). -1 with a message refuses the request (the engine goes
     * on). forward may then be NULL: the engine only decides and refuses generation. This is the one decide-only
     * path: an encoder family is a cb_family like any other and runs in cb_engine_main. */
    int (*decide)(void *model, const int *tokens, int n, cb_decide *d, char *err, size_t errlen);
} cb_family;

#endif
