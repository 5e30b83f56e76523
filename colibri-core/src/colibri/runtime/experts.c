/* experts.c: see experts.h. */
#include "experts.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One I/O thread serves every layer with at most one read in flight: the MoE block prefetches the next expert
 * it will miss while it computes the current one, which is all the overlap a layer-by-layer forward allows. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int started, quit;
    int state;                 /* 0 idle, 1 read requested or in flight, 2 finished */
    cb_expert_layer *layer;
    int expert;
    void *dst;
    int rc;
    char err[256];
    void *staging;             /* owned by the main thread; the worker only writes through dst */
} io_worker;

static io_worker io = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
static int prefetch_enabled = -1;
static size_t buf_bytes;       /* the largest expert of any layer, rounded up to 64 */

static int prefetch_on(void) {
    if (prefetch_enabled < 0) {
        const char *v = getenv("COLIBRI_PREFETCH");
        /* Opt-in: with the checkpoint in the page cache the read is a memcpy that competes with the compute
         * threads for cores and memory bandwidth, and on this project's 2-core machines it measured no gain. */
        prefetch_enabled = v && strcmp(v, "1") == 0;
    }
    return prefetch_enabled;
}

static void *alloc_buf(void) { return aligned_alloc(64, buf_bytes); }

size_t cb_experts_staging_bytes(void) { return prefetch_on() ? buf_bytes : 0; }

int cb_experts_init(cb_expert_layer *L, const cb_st_index *idx, int layer, int n_experts, int cap, int hidden,
                    int inter, const char *const names[3], char *err, size_t errlen) {
    memset(L, 0, sizeof *L);
    L->staged = -1;
    L->layer = layer;
    L->n_experts = n_experts;
    L->cap = (cap <= 0 || cap > n_experts) ? n_experts : cap;
    L->hidden = hidden;
    L->inter = inter;
    L->idx = idx;
    L->loc = calloc((size_t)n_experts, sizeof *L->loc);
    L->slot_of = malloc((size_t)n_experts * sizeof(int));
    L->expert_in = malloc((size_t)L->cap * sizeof(int));
    L->last_use = calloc((size_t)L->cap, sizeof(uint64_t));
    L->buf = calloc((size_t)L->cap, sizeof(void *));
    if (!L->loc || !L->slot_of || !L->expert_in || !L->last_use || !L->buf) {
        snprintf(err, errlen, "out of memory for the expert store of layer %d", layer);
        cb_experts_free(L);
        return -1;
    }
    for (int e = 0; e < n_experts; e++) L->slot_of[e] = -1;
    for (int s = 0; s < L->cap; s++) L->expert_in[s] = -1;
    for (int e = 0; e < n_experts; e++) {
        cb_expert_location *loc = &L->loc[e];
        const cb_tensor *t[3];
        for (int m = 0; m < 3; m++) {
            char name[512];
            snprintf(name, sizeof name, names[m], layer, e);
            int64_t dims[2] = {m == CB_DOWN ? hidden : inter, m == CB_DOWN ? inter : hidden};
            if (!(t[m] = cb_st_expect(idx, name, 2, dims, err, errlen))) {
                cb_experts_free(L);
                return -1;
            }
            loc->offset[m] = t[m]->offset;
            loc->nbytes[m] = t[m]->nbytes;
            loc->dt[m] = t[m]->dtype;
            loc->shard[m] = t[m]->shard;
        }
        /* One read when the three matrices tile one span of one shard, in any order, each aligned for its
         * dtype inside the slot buffer (the buffer itself is 64-byte aligned). */
        uint64_t lo = loc->offset[0], hi = loc->offset[0] + loc->nbytes[0], total = 0;
        int same_shard = loc->shard[1] == loc->shard[0] && loc->shard[2] == loc->shard[0], aligned = 1;
        for (int m = 0; m < 3; m++) {
            if (loc->offset[m] < lo) lo = loc->offset[m];
            if (loc->offset[m] + loc->nbytes[m] > hi) hi = loc->offset[m] + loc->nbytes[m];
            total += loc->nbytes[m];
        }
        for (int m = 0; m < 3; m++)
            if ((loc->offset[m] - lo) % cb_dtype_size(loc->dt[m])) aligned = 0;
        loc->single_read = same_shard && aligned && hi - lo == total;
        size_t need;
        if (loc->single_read) {
            loc->span_offset = lo;
            loc->span_bytes = total;
            for (int m = 0; m < 3; m++) loc->rel[m] = (size_t)(loc->offset[m] - lo);
            need = (size_t)total;
        } else {
            size_t at = 0;
            for (int m = 0; m < 3; m++) {
                loc->rel[m] = at;
                at += ((size_t)loc->nbytes[m] + 63) / 64 * 64;
            }
            need = at;
        }
        if (need > L->slot_bytes) L->slot_bytes = need;
    }
    size_t rounded = (L->slot_bytes + 63) / 64 * 64;
    if (rounded > buf_bytes) buf_bytes = rounded;
    return 0;
}

void cb_experts_free(cb_expert_layer *L) {
    cb_experts_prefetch_cancel(L);
    if (L->buf)
        for (int s = 0; s < L->cap; s++) free(L->buf[s]);
    free(L->buf);
    free(L->loc);
    free(L->slot_of);
    free(L->expert_in);
    free(L->last_use);
    memset(L, 0, sizeof *L);
}

size_t cb_experts_cache_bytes(const cb_expert_layer *L) { return (size_t)L->cap * L->slot_bytes; }

/* Read expert e's bytes into buf (no counters: the I/O thread calls this too). */
static int raw_read(const cb_expert_layer *L, int e, void *buf, char *err, size_t errlen) {
    const cb_expert_location *loc = &L->loc[e];
    if (loc->single_read) return cb_st_pread(L->idx, loc->shard[0], buf, loc->span_bytes, loc->span_offset, err, errlen);
    for (int m = 0; m < 3; m++)
        if (cb_st_pread(L->idx, loc->shard[m], (char *)buf + loc->rel[m], loc->nbytes[m], loc->offset[m], err,
                        errlen))
            return -1;
    return 0;
}

static void count_read(cb_expert_layer *L, int e) {
    const cb_expert_location *loc = &L->loc[e];
    L->count.reads += loc->single_read ? 1 : 3;
    L->count.bytes_read += loc->single_read ? loc->span_bytes : loc->nbytes[0] + loc->nbytes[1] + loc->nbytes[2];
}

static void *io_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&io.mu);
    for (;;) {
        while (io.state != 1 && !io.quit) pthread_cond_wait(&io.cv, &io.mu);
        if (io.quit) break;
        cb_expert_layer *L = io.layer;
        int e = io.expert;
        void *dst = io.dst;
        pthread_mutex_unlock(&io.mu);
        char err[256] = "";
        int rc = raw_read(L, e, dst, err, sizeof err);
        pthread_mutex_lock(&io.mu);
        io.rc = rc;
        memcpy(io.err, err, sizeof err);
        io.state = 2;
        pthread_cond_broadcast(&io.cv);
    }
    pthread_mutex_unlock(&io.mu);
    return NULL;
}

/* Wait for this layer's staged read; returns its result (and clears the staging state). */
static int wait_staged(cb_expert_layer *L, char *err, size_t errlen) {
    pthread_mutex_lock(&io.mu);
    while (io.state == 1) pthread_cond_wait(&io.cv, &io.mu);
    int rc = io.rc;
    if (rc && err) snprintf(err, errlen, "%s", io.err);
    io.state = 0;
    pthread_mutex_unlock(&io.mu);
    L->staged = -1;
    return rc;
}

void cb_experts_prefetch(cb_expert_layer *L, int e) {
    if (!prefetch_on() || e < 0 || e >= L->n_experts || L->slot_of[e] >= 0 || L->staged >= 0) return;
    pthread_mutex_lock(&io.mu);
    if (io.state != 0 || (!io.staging && !(io.staging = alloc_buf()))) {
        pthread_mutex_unlock(&io.mu);
        return;
    }
    if (!io.started) {
        io.quit = 0;
        if (pthread_create(&io.thread, NULL, io_main, NULL) != 0) {
            pthread_mutex_unlock(&io.mu);
            prefetch_enabled = 0;
            return;
        }
        io.started = 1;
    }
    io.layer = L;
    io.expert = e;
    io.dst = io.staging;
    io.state = 1;
    L->staged = e;
    pthread_cond_broadcast(&io.cv);
    pthread_mutex_unlock(&io.mu);
}

void cb_experts_prefetch_cancel(cb_expert_layer *L) {
    if (L->staged >= 0) wait_staged(L, NULL, 0);
}

void cb_experts_io_shutdown(void) {
    pthread_mutex_lock(&io.mu);
    int started = io.started;
    io.quit = 1;
    pthread_cond_broadcast(&io.cv);
    pthread_mutex_unlock(&io.mu);
    if (started) pthread_join(io.thread, NULL);
    pthread_mutex_lock(&io.mu);
    io.started = 0;
    io.quit = 0;
    io.state = 0;
    free(io.staging);
    io.staging = NULL;
    pthread_mutex_unlock(&io.mu);
}

int cb_experts_get(cb_expert_layer *L, int e, cb_expert_view *view, char *err, size_t errlen) {
    if (e < 0 || e >= L->n_experts) {
        snprintf(err, errlen, "layer %d: expert %d out of range", L->layer, e);
        return -1;
    }
    int s = L->slot_of[e];
    if (s >= 0) {
        L->count.hits++;
    } else {
        L->count.misses++;
        /* An empty slot first, else the least recently used one. */
        s = 0;
        for (int i = 0; i < L->cap; i++) {
            if (L->expert_in[i] < 0) { s = i; break; }
            if (L->last_use[i] < L->last_use[s]) s = i;
        }
        if (L->expert_in[s] >= 0) L->slot_of[L->expert_in[s]] = -1;
        L->expert_in[s] = -1;
        if (!L->buf[s] && L->staged != e && !(L->buf[s] = alloc_buf())) {
            snprintf(err, errlen, "out of memory for an expert slot of layer %d (%zu bytes)", L->layer,
                     L->slot_bytes);
            return -1;
        }
        if (L->staged == e) {
            /* Prefetched: take the staging buffer as the slot's, and give the slot's old buffer to staging. */
            if (wait_staged(L, err, errlen)) return -1;
            void *t = L->buf[s];
            L->buf[s] = io.staging;
            io.staging = t;
        } else if (raw_read(L, e, L->buf[s], err, errlen)) {
            return -1;
        }
        count_read(L, e);
        L->expert_in[s] = e;
        L->slot_of[e] = s;
    }
    L->last_use[s] = ++L->tick;
    for (int m = 0; m < 3; m++) {
        view->w[m] = (const char *)L->buf[s] + L->loc[e].rel[m];
        view->dt[m] = L->loc[e].dt[m];
    }
    return 0;
}
