/* quant_impl.h: private glue between quant.c (dispatch, activations, float combination) and the per-ISA integer
 * dot products in quant_avx2.c / quant_avx512.c. Engines include quant.h only. */
#ifndef COLIBRI_QUANT_IMPL_H
#define COLIBRI_QUANT_IMPL_H

#include "quant.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define CB_HAVE_X86_QUANT 1
#else
#define CB_HAVE_X86_QUANT 0
#endif

/* Exact sum over c < cols of w[c] * x[c] (int8 levels). */
typedef int32_t (*cb_q8_dot_fn)(const int8_t *w, const int8_t *x, int cols);
/* acc[g] = exact sum over group g (64 columns) of level(w) * x, for g < groups. `x` is in column order,
 * `x_split` in the nibble order of cb_qact.q_split, `group_sums` the per-group sums of x: a path uses whichever
 * suits it (the offset-binary nibbles give sum(u * x) - 8 * sum(x) = sum(level * x) exactly). */
typedef void (*cb_q4_dot_fn)(int32_t *acc, const uint8_t *w, const int8_t *x, const int8_t *x_split,
                             const int32_t *group_sums, int groups);

int32_t cb_q8_dot_scalar(const int8_t *w, const int8_t *x, int cols);
void cb_q4_dot_scalar(int32_t *acc, const uint8_t *w, const int8_t *x, const int8_t *x_split,
                      const int32_t *group_sums, int groups);
#if CB_HAVE_X86_QUANT
int32_t cb_q8_dot_avx2(const int8_t *w, const int8_t *x, int cols);
void cb_q4_dot_avx2(int32_t *acc, const uint8_t *w, const int8_t *x, const int8_t *x_split,
                    const int32_t *group_sums, int groups);
int32_t cb_q8_dot_avx512(const int8_t *w, const int8_t *x, int cols);
void cb_q4_dot_avx512(int32_t *acc, const uint8_t *w, const int8_t *x, const int8_t *x_split,
                      const int32_t *group_sums, int groups);
int32_t cb_q8_dot_avx512vnni(const int8_t *w, const int8_t *x, int cols);
void cb_q4_dot_avx512vnni(int32_t *acc, const uint8_t *w, const int8_t *x, const int8_t *x_split,
                          const int32_t *group_sums, int groups);
#endif

#endif
