/* sampler.h: choosing the next token from logits. Greedy (argmax, lowest index on ties) at temperature 0;
 * otherwise temperature, then top-k, then top-p, then min-p (transformers' warper order), drawn from the
 * sampler's own seeded PRNG so a seed gives the same tokens on every machine. */
#ifndef COLIBRI_SAMPLER_H
#define COLIBRI_SAMPLER_H

#include <stdint.h>

typedef struct {
    float temperature;         /* <= 0: greedy */
    float top_p;               /* >= 1 or <= 0: off */
    int top_k;                 /* <= 0: off */
    float min_p;               /* <= 0: off; keeps tokens at least min_p times as likely as the likeliest */
    uint64_t state, inc;       /* PCG32 */
} cb_sampler;

void cb_sampler_init(cb_sampler *s, float temperature, float top_p, int top_k, uint64_t seed);
int cb_argmax(const float *logits, int n);
/* Sample one token. work must hold 2 * n entries (floats and ints share it as index/probability pairs). */
int cb_sample(cb_sampler *s, const float *logits, int n, void *work);
/* The same draw; probs (n floats, or NULL) receives the distribution it was drawn from (one-hot when greedy). */
int cb_sample_dist(cb_sampler *s, const float *logits, int n, void *work, float *probs);
uint32_t cb_pcg32(cb_sampler *s);

#endif
