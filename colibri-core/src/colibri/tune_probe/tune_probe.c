/* tune_probe: the seconds one routed expert's matmuls take on this CPU, for coli tune (colibri/tune.py).
 *
 * usage: colibri-tune-probe HIDDEN WIDTH q8|q4 ROWS THREADS SECONDS
 * Times the runtime's own expert kernels (cb_qgate_up, then cb_qmatmul for the down projection) on random levels
 * at the given geometry, best of repeated trials within SECONDS, and prints one JSON line:
 * {"expert_s": <seconds per call for ROWS input rows>, "qpath": "<kernel path>"}. Exit 1 with a message on bad
 * arguments or a failed allocation. Weights are random: speed does not depend on their values. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"
#include "quant.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
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
    if (hidden < 64 || width < 64 || hidden % 64 || width % 64 || rows < 1 || rows > 4096 || !scheme || budget <= 0) {
        fprintf(stderr, "tune_probe: bad arguments (sizes multiples of 64, 1 <= ROWS <= 4096, q8 or q4)\n");
        return 1;
    }
    cb_threads_init(threads);
    unsigned seed = 42;
    cb_qmatrix Wg, Wu, Wd;
    cb_qact in, mid;
    float *X = malloc((size_t)rows * hidden * sizeof *X), *G = malloc((size_t)rows * width * sizeof *G);
    float *U = malloc((size_t)rows * width * sizeof *U), *Y = malloc((size_t)rows * hidden * sizeof *Y);
    if (!X || !G || !U || !Y || fill(&Wg, scheme, width, hidden, &seed) || fill(&Wu, scheme, width, hidden, &seed) ||
        fill(&Wd, scheme, hidden, width, &seed) || cb_qact_init(&in, rows, hidden) || cb_qact_init(&mid, rows, width)) {
        fprintf(stderr, "tune_probe: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < (size_t)rows * hidden; i++) X[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    double best = 1e30, start = now();
    do {
        double t0 = now();
        cb_qact_quantize(&in, X, rows);
        cb_qgate_up(G, U, &Wg, &Wu, &in);
        for (size_t i = 0; i < (size_t)rows * width; i++) G[i] = G[i] / (1.0f + G[i] * G[i]) * U[i];
        cb_qact_quantize(&mid, G, rows);
        cb_qmatmul(Y, &Wd, &mid);
        double t = now() - t0;
        if (t < best) best = t;
    } while (now() - start < budget);
    printf("{\"expert_s\": %.9g, \"qpath\": \"%s\"}\n", best, cb_qpath_name(cb_qpath_get()));
    cb_threads_shutdown();
    return 0;
}
