/* expert_preload.c: cb_experts_preload (experts.h), reading every expert of a cache that holds them all on the
 * I/O threads before the first token. */
#include "experts_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    cb_expert_layer **layers;
    int n_layers;
    _Atomic long next;         /* the next (layer, expert) to read, layer-major: close to file order */
    long total;
    _Atomic int failed;
    char err[512];
    pthread_mutex_t err_mu;
} preload_job;

static void *preload_main(void *arg) {
    preload_job *job = arg;
    for (;;) {
        long i = job->next++;
        if (i >= job->total || job->failed) return NULL;
        cb_expert_layer *L = NULL;
        long e = i;
        for (int k = 0; k < job->n_layers; e -= job->layers[k++]->n_experts)
            if (e < job->layers[k]->n_experts) { L = job->layers[k]; break; }
        /* An empty cache of n_experts slots: expert e takes slot e, so no two threads touch the same entry. */
        char err[512] = "";
        if (!L->buf[e] && !(L->buf[e] = cbx_alloc_buf()))
            snprintf(err, sizeof err, "out of memory for an expert slot of layer %d (%zu bytes)", L->layer,
                     cbx_buf_bytes);
        else if (cbx_raw_read(L, (int)e, L->buf[e], &L->data_off[e], err, sizeof err) == 0)
            continue;
        pthread_mutex_lock(&job->err_mu);
        if (!job->failed) snprintf(job->err, sizeof job->err, "%s", err);
        job->failed = 1;
        pthread_mutex_unlock(&job->err_mu);
        return NULL;
    }
}

int cb_experts_preload(uint64_t *bytes, char *err, size_t errlen) {
    *bytes = 0;
    preload_job job = {.err_mu = PTHREAD_MUTEX_INITIALIZER};
    job.layers = malloc((size_t)(cbx_n_live ? cbx_n_live : 1) * sizeof *job.layers);
    if (!job.layers) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (int layer = 0, seen = 0; seen < cbx_n_live; layer++) {
        cb_expert_layer *L = cbx_layer_no(layer);
        if (!L) continue;
        seen++;
        int empty = L->cap == L->n_experts;
        for (int s = 0; s < L->cap && empty; s++) empty = L->expert_in[s] < 0;
        if (!empty) continue;  /* a partial cache streams; one already in use keeps what it has */
        job.layers[job.n_layers++] = L;
        job.total += L->n_experts;
    }
    pthread_t th[CBX_IO_THREADS_MAX];
    int started = 0, want = cbx_io_threads();
    for (int i = 0; i < want; i++) started += pthread_create(&th[started], NULL, preload_main, &job) == 0;
    if (!started) preload_main(&job);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    /* On a failed read the store stays empty (the buffers are kept and reused by the lazy path). */
    for (int k = 0; k < job.n_layers && !job.failed; k++) {
        cb_expert_layer *L = job.layers[k];
        for (int e = 0; e < L->n_experts; e++) {
            uint64_t before = L->count.bytes_read;
            cbx_count_read(L, e);
            *bytes += L->count.bytes_read - before;
            L->expert_in[e] = e;
            L->slot_of[e] = e;
        }
    }
    free(job.layers);
    if (job.failed) snprintf(err, errlen, "%s", job.err);
    return job.failed ? -1 : 0;
}
