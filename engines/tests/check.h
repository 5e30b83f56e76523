/* check.h: what every C test shares: CHECK, which counts checks and failures and reports a failure with its file,
 * line and message without stopping the test, and a xorshift64 generator seeded with TEST_SEED (each test keeps
 * its own seed, so its random inputs do not change). */
#ifndef COLIBRI_TEST_CHECK_H
#define COLIBRI_TEST_CHECK_H

#include <stdint.h>
#include <stdio.h>

#ifndef TEST_SEED
#define TEST_SEED 88172645463325252ULL
#endif

static int failures, checks;
#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        checks++;                                                          \
        if (!(cond)) {                                                     \
            failures++;                                                    \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fprintf(stderr, "\n");                                         \
        }                                                                  \
    } while (0)

static uint64_t rng_state = TEST_SEED;
static inline uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

#endif
