/* qwen_blocks_common.h: the check macro, a seeded generator and random f32 arrays shared by the block tests
 * (test_deltanet.c, test_gqa.c, test_mlp.c). */
#ifndef QWEN_BLOCKS_COMMON_H
#define QWEN_BLOCKS_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"

static double uniform(void) { return (double)(rnd() >> 11) / 9007199254740992.0; }

/* n floats uniform in [-scale, scale] (+ offset), malloc'ed. */
static float *rand_floats(size_t n, float scale, float offset) {
    float *x = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = offset + scale * (float)(2.0 * uniform() - 1.0);
    return x;
}

static double max_abs_diff(const float *a, const double *b, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

#endif
