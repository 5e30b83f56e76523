/* logits_procs.h: what a submit asks of the sampler beyond temperature/top-k/top-p (docs/protocol.md).
 *
 * Processors run in transformers' order on a copy of the model's logits: the allowed-token mask of constrained
 * decoding (disallowed -> -inf), logit_bias (added), repetition_penalty (transformers'
 * RepetitionPenaltyLogitsProcessor over the prompt and the fed tokens), presence/frequency penalties (OpenAI's and
 * vLLM's definition, over the fed tokens only), then the sampler's warpers: temperature, top-k, top-p, min-p.
 * Log-probabilities reported with a token are the model's own (log-softmax of the unprocessed logits), as vLLM
 * and OpenAI report them.
 */
#ifndef COLIBRI_LOGITS_PROCS_H
#define COLIBRI_LOGITS_PROCS_H

#include <stddef.h>
#include <stdint.h>

#include "json.h"
#include "sampler.h"

#define CB_MAX_TOP_LOGPROBS 20

typedef struct {
    float min_p;                  /* handed to the sampler (a warper, after top-p) */
    float repetition_penalty;     /* 1: off */
    float presence_penalty, frequency_penalty;   /* 0: off */
    int n_bias;
    int *bias_id;
    float *bias;
    int top_logprobs;             /* -1: no log-probabilities with tokens; 0..20: the sampled one and this many */
    int dist;                     /* debug: emit a "dist" event (raw logits and final distribution) per step */
    int constrained;              /* every sampling step waits for a "mask" request */
    int have_mask;
    uint32_t *mask;               /* (vocab + 31) / 32 words, bit i of word w allows token 32 w + i */
    float *held;                  /* constrained: the logits of the step waiting for its mask */
    float *work;                  /* the processed logits (vocab) */
    float *probs;                 /* dist: the final distribution (vocab) */
    int *counts;                  /* fed-token occurrences (presence/frequency), vocab */
    unsigned char *seen;          /* prompt and fed tokens (repetition), vocab */
    int vocab, steps;
} cb_procs;

/* Read the processor fields of a submit (see docs/protocol.md). 0, or -1 with err naming the field. */
int cb_procs_parse(cb_procs *p, const cb_json *req, int vocab, const int *prompt, int n_prompt, char *err,
                   size_t errlen);
void cb_procs_free(cb_procs *p);
/* Whether the step must wait for a mask; if so the logits are kept until cb_procs_set_mask brings it. */
int cb_procs_waits(cb_procs *p, const float *logits);
/* A "mask" request's "allow" (base64 of the mask words, little-endian). 0, or -1 with err. */
int cb_procs_set_mask(cb_procs *p, const cb_json *req, char *err, size_t errlen);
/* Process, then sample with s. -1 (err set) when the mask allows no token. work: as cb_sample. */
int cb_procs_sample(cb_procs *p, cb_sampler *s, const float *logits, void *work, char *err, size_t errlen);
/* The token fed to the next step (sampled or forced): history for the penalties. */
void cb_procs_note(cb_procs *p, int tok);
/* The fields a token event adds: "logprob" and "top" ([[id, logprob], ...]) when asked. */
void cb_procs_put_logprobs(const cb_procs *p, cb_buf *b, const float *logits, int tok);

#endif
