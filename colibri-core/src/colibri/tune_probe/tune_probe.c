/* tune_probe: the seconds one routed expert's matmuls take on this CPU, for coli tune (colibri/tune.py).
 *
 * usage: colibri-tune-probe HIDDEN WIDTH q8|q4 ROWS THREADS SECONDS
 * Times the runtime's own expert kernels (cb_qgate_up, then cb_qmatmul for the down projection) on random levels
 * at the given geometry, best of repeated trials within SECONDS, and prints one JSON line:
 * {"expert_s": <seconds per call for ROWS input rows>, "qpath": "<kernel path>", "copies": <experts cycled>}.
 * Exit 1 with a message on bad arguments or a failed allocation. Weights are random: speed does not depend on their
 * values.
 *
 * Each trial takes the next of enough copies of the expert to overflow the last-level cache (4x its size, at least
 * 64 MiB): a decode token streams ~100 different experts' weights from memory, so one expert timed over and over,
 * its 6 MB hot in a 32 MB L3, measured 0.08 ms where the engine's own decode spends 0.28 (OLMoE-1B-7B int8, 2
 * cores), and coli tune's lookahead rule, which weighs that time, followed the cache instead of the memory. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels.h"
#include "quant.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* How many copies of an expert of `bytes` overflow the last-level cache: 4x its size (64 MiB when unknown, and at
 * least that), at most 1 GiB of copies, at least 2. */
static int copies_for(size_t bytes) {
    long llc = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
    llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (llc <= 0) llc = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    size_t want = llc > 0 ? 4 * (size_t)llc : 0;
    if (want < ((size_t)64 << 20)) want = (size_t)64 << 20;
    if (want > ((size_t)1 << 30)) want = (size_t)1 << 30;
    size_t n = (want + bytes - 1) / bytes;
    return n < 2 ? 2 : (int)n;
}

static int fill(cb_qmatrix *W, cb_qscheme scheme, int rows, int cols, unsigned *seed) {
    size_t level_bytes = cb_qrow_bytes(scheme, cols) * (size_t)rows;
    size_t n_scales = cb_qscale_count(scheme, rows, cols);
    unsigned char *q = malloc(level_bytes);
    uint16_t *scales = malloc(n_scales * sizeof *scales);
    if (!q || !scales) { free(q); free(scales); return -1; }
    for (size_t i = 0; i < level_bytes; i++) { *seed = *seed * 1103515245u + 12345u; q[i] = (unsigned char)(*seed >> 16); }
    for (size_t i = 0; i < n_scales; i++) scales[i] = 0x2000;   /* a small F16 scale: sums stay finite */
    *W = (cb_qmatrix){.scheme = scheme, .rows = rows, .cols = cols, .q = q, .scales = scales};
    return cb_qmatrix_check(W);
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s HIDDEN WIDTH q8|q4 ROWS THREADS SECONDS\n", argv[0]);
        return 1;
    }
    int hidden = atoi(argv[1]), width = atoi(argv[2]), rows = atoi(argv[4]), threads = atoi(argv[5]);
    double budget = atof(argv[6]);
    cb_qscheme scheme = !strcmp(argv[3], "q4") ? CB_Q4_G64 : !strcmp(argv[3], "q8") ? CB_Q8_ROW : 0;
    if (hidden < 64 || width < 64 || hidden % 64 || width % 64 || hidden > 65536 || width > 65536 || rows < 1 ||
        rows > 4096 || !scheme || budget <= 0) {
        fprintf(stderr, "tune_probe: bad arguments (sizes multiples of 64 up to 65536, 1 <= ROWS <= 4096, q8 or "
                "q4)\n");
        return 1;
    }
    cb_threads_init(threads);
    unsigned seed = 42;
    size_t expert_bytes = 3 * cb_qrow_bytes(scheme, hidden) * (size_t)width;
    int n = copies_for(expert_bytes);
    cb_qmatrix *W = calloc((size_t)n * 3, sizeof *W);   /* copy i: gate W[3i], up W[3i+1], down W[3i+2] */
    cb_qact in, mid;
    float *X = malloc((size_t)rows * hidden * sizeof *X), *G = malloc((size_t)rows * width * sizeof *G);
    float *U = malloc((size_t)rows * width * sizeof *U), *Y = malloc((size_t)rows * hidden * sizeof *Y);
    int ok = W && X && G && U && Y && !cb_qact_init(&in, rows, hidden) && !cb_qact_init(&mid, rows, width);
    for (int i = 0; ok && i < n; i++)
        ok = !fill(&W[3 * i], scheme, width, hidden, &seed) && !fill(&W[3 * i + 1], scheme, width, hidden, &seed) &&
             !fill(&W[3 * i + 2], scheme, hidden, width, &seed);
    if (!ok) {
        fprintf(stderr, "tune_probe: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < (size_t)rows * hidden; i++) X[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    double best = 1e30, start = now();
    int next = 0;
    do {
        const cb_qmatrix *Wg = &W[3 * next], *Wu = &W[3 * next + 1], *Wd = &W[3 * next + 2];
        next = (next + 1) % n;
        double t0 = now();
        cb_qact_quantize(&in, X, rows);
        cb_qgate_up(G, U, Wg, Wu, &in);
        for (size_t i = 0; i < (size_t)rows * width; i++) G[i] = G[i] / (1.0f + G[i] * G[i]) * U[i];
        cb_qact_quantize(&mid, G, rows);
        cb_qmatmul(Y, Wd, &mid);
        double t = now() - t0;
        if (t < best) best = t;
    } while (now() - start < budget || next != 0);   /* every copy at least once: the first laps are cold */
    printf("{\"expert_s\": %.9g, \"qpath\": \"%s\", \"copies\": %d}\n", best, cb_qpath_name(cb_qpath_get()), n);
    cb_threads_shutdown();
    return 0;
}
