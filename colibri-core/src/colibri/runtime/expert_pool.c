/* expert_pool.c: the I/O pool (experts.h's streaming): threads that read staged experts, the block's own misses
 * first, then lookahead predictions, each class in file-offset order; a staged buffer is swapped into its slot. */
#include "experts_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_STAGES 64

static int top_k_hint = 4;

static int prefetch_on(void) {
    static int env = -1;
    if (env < 0) {
        const char *v = getenv("COLIBRI_PREFETCH");
        env = v && strcmp(v, "1") == 0;
    }
    return cb_experts_options()->prefetch || env;
}

enum { ST_FREE = 0, ST_QUEUED, ST_READING, ST_READY };

typedef struct {
    cb_expert_layer *layer;
    int expert, state, urgent;
    uint64_t seq;
    void *buf;
    size_t data_off;
    int rc;
    char err[256];
} stage_t;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    pthread_t thread[CBX_IO_THREADS_MAX];
    int started, quit, n, n_threads;
    stage_t st[MAX_STAGES];
    uint64_t seq;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

/* As many stages as the RAM plan left room for (--io-stages), else two per routed expert of a token: the block's
 * own misses plus the next layer's predictions. */
static int pool_size(void) {
    int stages = cb_experts_options()->io_stages;
    if (stages > 0) return stages < MAX_STAGES ? stages : MAX_STAGES;
    int n = 2 * top_k_hint;
    return n < 4 ? 4 : n > MAX_STAGES ? MAX_STAGES : n;
}

void cb_experts_hint_top_k(int top_k) {
    if (top_k > top_k_hint) top_k_hint = top_k;
}

size_t cb_experts_staging_bytes(void) { return prefetch_on() ? (size_t)pool_size() * cbx_buf_bytes : 0; }

/* The next queued read: urgent before predicted, then by shard and file offset so the disk sees ascending
 * offsets. Called with the lock held. */
static stage_t *next_queued(void) {
    stage_t *best = NULL;
    for (int i = 0; i < pool.n; i++) {
        stage_t *s = &pool.st[i];
        if (s->state != ST_QUEUED) continue;
        if (!best) { best = s; continue; }
        const cb_expert_location *a = &s->layer->loc[s->expert], *b = &best->layer->loc[best->expert];
        if (s->urgent != best->urgent) { if (s->urgent) best = s; continue; }
        if (a->shard[0] != b->shard[0] ? a->shard[0] < b->shard[0] : a->offset[0] < b->offset[0]) best = s;
    }
    return best;
}

static void *io_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        stage_t *s;
        while (!(s = next_queued()) && !pool.quit) pthread_cond_wait(&pool.work, &pool.mu);
        if (pool.quit) break;
        s->state = ST_READING;
        cb_expert_layer *L = s->layer;
        int e = s->expert;
        void *dst = s->buf;
        pthread_mutex_unlock(&pool.mu);
        char err[256] = "";
        size_t off = 0;
        int rc = cbx_raw_read(L, e, dst, &off, err, sizeof err);
        pthread_mutex_lock(&pool.mu);
        s->rc = rc;
        s->data_off = off;
        memcpy(s->err, err, sizeof err);
        s->state = ST_READY;
        pthread_cond_broadcast(&pool.done);
    }
    pthread_mutex_unlock(&pool.mu);
    return NULL;
}

static stage_t *find_stage(const cb_expert_layer *L, int e) {
    for (int i = 0; i < pool.n; i++)
        if (pool.st[i].state != ST_FREE && pool.st[i].layer == L && pool.st[i].expert == e) return &pool.st[i];
    return NULL;
}

/* A stage to fill: a free one, else the oldest prediction nobody is reading. An urgent read may take any
 * prediction; a prediction only one made for another layer (stale once the forward has moved on), so a
 * layer's guesses never push each other out. */
static stage_t *take_stage(const cb_expert_layer *L, int urgent) {
    stage_t *victim = NULL;
    for (int i = 0; i < pool.n; i++) {
        stage_t *s = &pool.st[i];
        if (s->state == ST_FREE) return s;
        if (!s->urgent && (s->state == ST_QUEUED || s->state == ST_READY) && (urgent || s->layer != L) &&
            (!victim || s->seq < victim->seq))
            victim = s;
    }
    if (victim) victim->state = ST_FREE;
    return victim;
}

/* 1 when e is resident, queued or reading now, 0 when prefetching is off or no buffer is free. A guess the pool
 * has no room for counts as dropped; an urgent read without a buffer is not dropped, only deferred: the block
 * reads it itself unless a buffer frees up first (blocks.c queues its misses again as it consumes them). */
static int stage(cb_expert_layer *L, int e, int urgent) {
    if (!prefetch_on() || e < 0 || e >= L->n_experts) return 0;
    if (L->slot_of[e] >= 0) return 1;
    pthread_mutex_lock(&pool.mu);
    stage_t *s = find_stage(L, e);
    if (s) {
        s->urgent |= urgent;   /* a prediction the block now needs jumps the queue */
        pthread_mutex_unlock(&pool.mu);
        return 1;
    }
    if (!pool.started) {
        pool.n = pool_size();
        pool.quit = 0;
        int ok = 1;
        pool.n_threads = cbx_io_threads();
        for (int i = 0; i < pool.n_threads && ok; i++) ok = pthread_create(&pool.thread[i], NULL, io_main, NULL) == 0;
        if (!ok) {
            /* Cannot happen short of resource exhaustion; reads then stay synchronous. */
            pool.quit = 1;
            pthread_cond_broadcast(&pool.work);
            pthread_mutex_unlock(&pool.mu);
            return 0;
        }
        pool.started = 1;
    }
    if (!(s = take_stage(L, urgent)) || (!s->buf && !(s->buf = cbx_alloc_buf()))) {
        if (s) s->state = ST_FREE;
        if (!urgent) cb_prof.prefetch_dropped++;
        pthread_mutex_unlock(&pool.mu);
        return 0;
    }
    s->layer = L;
    s->expert = e;
    s->urgent = urgent;
    s->seq = ++pool.seq;
    s->rc = 0;
    s->state = ST_QUEUED;
    cb_prof.prefetch_issued++;
    pthread_cond_signal(&pool.work);
    pthread_mutex_unlock(&pool.mu);
    return 1;
}

int cb_experts_prefetch(cb_expert_layer *L, int e) { return stage(L, e, 1); }
void cb_experts_predict(cb_expert_layer *L, int e) { (void)stage(L, e, 0); }

void cb_experts_drop_guesses(cb_expert_layer *L, const int *wanted) {
    pthread_mutex_lock(&pool.mu);
    for (int i = 0; i < pool.n; i++) {
        stage_t *s = &pool.st[i];
        if (s->layer == L && s->state == ST_QUEUED && !s->urgent && !wanted[s->expert]) {
            s->state = ST_FREE;
            cb_prof.prefetch_dropped++;
        }
    }
    pthread_mutex_unlock(&pool.mu);
}

void cb_experts_prefetch_cancel(cb_expert_layer *L) {
    pthread_mutex_lock(&pool.mu);
    for (int i = 0; i < pool.n; i++) {
        stage_t *s = &pool.st[i];
        if (s->state == ST_FREE || s->layer != L) continue;
        while (s->state == ST_READING) pthread_cond_wait(&pool.done, &pool.mu);
        s->state = ST_FREE;
    }
    pthread_mutex_unlock(&pool.mu);
}

void cb_experts_io_shutdown(void) {
    pthread_mutex_lock(&pool.mu);
    int started = pool.started;
    pool.quit = 1;
    pthread_cond_broadcast(&pool.work);
    pthread_mutex_unlock(&pool.mu);
    if (started)
        for (int i = 0; i < pool.n_threads; i++) pthread_join(pool.thread[i], NULL);
    pthread_mutex_lock(&pool.mu);
    for (int i = 0; i < MAX_STAGES; i++) {
        free(pool.st[i].buf);
        memset(&pool.st[i], 0, sizeof pool.st[i]);
    }
    pool.started = 0;
    pool.quit = 0;
    pool.n = 0;
    pthread_mutex_unlock(&pool.mu);
}

int cbx_take_staged(cb_expert_layer *L, int e, int s, char *err, size_t errlen) {
    if (!pool.started) return 0;
    pthread_mutex_lock(&pool.mu);
    stage_t *st = find_stage(L, e);
    if (!st) {
        pthread_mutex_unlock(&pool.mu);
        return 0;
    }
    st->urgent = 1;
    pthread_cond_broadcast(&pool.work);
    while (st->state == ST_QUEUED || st->state == ST_READING) pthread_cond_wait(&pool.done, &pool.mu);
    int rc = st->rc;
    if (rc) {
        snprintf(err, errlen, "%s", st->err);
    } else {
        void *t = L->buf[s];
        L->buf[s] = st->buf;
        L->data_off[s] = st->data_off;
        st->buf = t;
        cb_prof.prefetch_used++;
    }
    st->state = ST_FREE;
    pthread_mutex_unlock(&pool.mu);
    return rc ? -1 : 1;
}

