/* experts.c: see experts.h. The store (LRU + pinning) is here; the I/O pool, the readers and the hot-set
 * sidecar are in the sections below it. */
#define _GNU_SOURCE
#include "experts.h"
#include "qlinear.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define DIO_ALIGN 4096
#define IO_THREADS 2           /* two reads in flight keep a virtio/NVMe queue busy; more only add contention */
#define MAX_STAGES 64

#define HEAT_DECAY 0.98           /* per access of the layer; see experts.h (measured best of 0.97-0.985) */
#define HEAT_RESCALE 1e100        /* heat_unit beyond this: divide every heat and the unit by it */
#define PIN_MARGIN 1.25           /* an outsider replaces the coldest pinned expert only when this much hotter */

cb_stream_opts cb_stream = {.moe_union = 1, .repin_every = 8};
cb_profile cb_prof;

double cb_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static size_t buf_bytes;       /* the largest expert of any layer + alignment slack, a multiple of DIO_ALIGN */
static int top_k_hint = 4;

static int prefetch_on(void) {
    static int env = -1;
    if (env < 0) {
        const char *v = getenv("COLIBRI_PREFETCH");
        env = v && strcmp(v, "1") == 0;
    }
    return cb_stream.prefetch || env;
}

static void *alloc_buf(void) { return aligned_alloc(DIO_ALIGN, buf_bytes); }

/* ---- registry of live layers (for re-pinning and the sidecar) and per-shard file descriptors ---- */

static cb_expert_layer **live;
static int n_live, live_cap;

static struct {
    const cb_st_index *idx;
    int refs, n;
    int *buffered_fd, *direct_fd;   /* our own descriptors: advice and O_DIRECT must not touch the index's */
} shards;

static void shards_close(void) {
    for (int i = 0; i < shards.n; i++) {
        if (shards.buffered_fd[i] >= 0) close(shards.buffered_fd[i]);
        if (shards.direct_fd[i] >= 0) close(shards.direct_fd[i]);
    }
    free(shards.buffered_fd);
    free(shards.direct_fd);
    memset(&shards, 0, sizeof shards);
}

/* O_DIRECT works where one aligned read at offset 0 succeeds; tmpfs and some overlays refuse the open. */
static int open_direct(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) return -1;
    void *probe = aligned_alloc(DIO_ALIGN, DIO_ALIGN);
    ssize_t r = probe ? pread(fd, probe, DIO_ALIGN, 0) : -1;
    free(probe);
    if (r < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int shards_open(const cb_st_index *idx, int want_direct) {
    if (shards.idx == idx) {
        shards.refs++;
        return 0;
    }
    if (shards.idx) return 0;   /* one model per process; a second index reads through its own fds */
    shards.idx = idx;
    shards.refs = 1;
    shards.n = idx->n_shards;
    shards.buffered_fd = malloc((size_t)shards.n * sizeof(int));
    shards.direct_fd = malloc((size_t)shards.n * sizeof(int));
    if (!shards.buffered_fd || !shards.direct_fd) {
        shards_close();
        return -1;
    }
    for (int i = 0; i < shards.n; i++) {
        shards.buffered_fd[i] = open(idx->shard_paths[i], O_RDONLY | O_CLOEXEC);
        /* Expert reads are random and exactly sized: kernel readahead would only drag in neighbours that get
         * evicted before use (measured 7x slower for mmap streaming with 8 MiB readahead). */
        if (shards.buffered_fd[i] >= 0) posix_fadvise(shards.buffered_fd[i], 0, 0, POSIX_FADV_RANDOM);
        shards.direct_fd[i] = want_direct ? open_direct(idx->shard_paths[i]) : -1;
        if (want_direct && shards.direct_fd[i] < 0 && cb_stream.io_mode == CB_IO_DIRECT)
            fprintf(stderr, "notice: %s refuses direct I/O (%s); reading it buffered\n", idx->shard_paths[i],
                    strerror(errno));
    }
    return 0;
}

static void shards_release(const cb_st_index *idx) {
    if (shards.idx == idx && --shards.refs == 0) shards_close();
}

const char *cb_experts_io_name(void) {
    int direct = 0, buffered = 0;
    for (int i = 0; i < shards.n; i++) {
        if (shards.direct_fd[i] >= 0) direct++;
        else buffered++;
    }
    return direct && buffered ? "mixed" : direct ? "direct" : "buffered";
}

/* ---- readers (no counters: the I/O threads call these too) ---- */

static int pread_all(int fd, void *dst, uint64_t n, uint64_t offset, uint64_t need, const char *path, char *err,
                     size_t errlen) {
    char *p = dst;
    uint64_t got = 0;
    while (got < n) {
        size_t chunk = n - got > ((size_t)1 << 30) ? (size_t)1 << 30 : (size_t)(n - got);
        ssize_t r = pread(fd, p + got, chunk, (off_t)(offset + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            snprintf(err, errlen, "reading %s at offset %llu: %s", path, (unsigned long long)(offset + got),
                     strerror(errno));
            return -1;
        }
        if (r == 0) break;
        got += (uint64_t)r;
    }
    if (got < need) {
        snprintf(err, errlen, "%s is truncated: wanted %llu bytes at offset %llu", path, (unsigned long long)need,
                 (unsigned long long)offset);
        return -1;
    }
    return 0;
}

/* Read expert e into buf; *data_off says where its span starts (non-zero only for aligned direct reads). */
static int raw_read(const cb_expert_layer *L, int e, void *buf, size_t *data_off, char *err, size_t errlen) {
    const cb_expert_location *loc = &L->loc[e];
    const cb_st_index *idx = L->idx;
    int own = shards.idx == idx;
    *data_off = 0;
    if (loc->single_read) {
        int sh = loc->shard[0];
        if (own && shards.direct_fd[sh] >= 0) {
            uint64_t lo = loc->span_offset & ~(uint64_t)(DIO_ALIGN - 1);
            uint64_t need = loc->span_offset + loc->span_bytes - lo;
            uint64_t len = (need + DIO_ALIGN - 1) & ~(uint64_t)(DIO_ALIGN - 1);
            /* The last page of the file may be short: only `need` bytes must arrive. */
            if (pread_all(shards.direct_fd[sh], buf, len, lo, need, idx->shard_paths[sh], err, errlen)) return -1;
            *data_off = (size_t)(loc->span_offset - lo);
            __atomic_add_fetch(&cb_prof.direct_reads, 1, __ATOMIC_RELAXED);
            return 0;
        }
        int fd = own && shards.buffered_fd[sh] >= 0 ? shards.buffered_fd[sh] : idx->fds[sh];
        __atomic_add_fetch(&cb_prof.buffered_reads, 1, __ATOMIC_RELAXED);
        return pread_all(fd, buf, loc->span_bytes, loc->span_offset, loc->span_bytes, idx->shard_paths[sh], err,
                         errlen);
    }
    if (loc->two_spans) {   /* fp8: the weights' span at rel[0]'s base, the scales' span at rel_scales[]'s */
        int sh = loc->shard[0], fd = own && shards.buffered_fd[sh] >= 0 ? shards.buffered_fd[sh] : idx->fds[sh];
        size_t wbase = loc->rel[0] - (size_t)(loc->offset[0] - loc->span_offset);
        size_t sbase = loc->rel_scales[0] - (size_t)(loc->sc_offset[0] - loc->sc_span_offset);
        int ssh = loc->sc_shard[0];
        int sfd = own && shards.buffered_fd[ssh] >= 0 ? shards.buffered_fd[ssh] : idx->fds[ssh];
        if (pread_all(fd, (char *)buf + wbase, loc->span_bytes, loc->span_offset, loc->span_bytes,
                      idx->shard_paths[sh], err, errlen) ||
            pread_all(sfd, (char *)buf + sbase, loc->sc_span_bytes, loc->sc_span_offset, loc->sc_span_bytes,
                      idx->shard_paths[ssh], err, errlen))
            return -1;
        __atomic_add_fetch(&cb_prof.buffered_reads, 2, __ATOMIC_RELAXED);
        return 0;
    }
    for (int m = 0; m < 3; m++) {
        int sh = loc->shard[m];
        int fd = own && shards.buffered_fd[sh] >= 0 ? shards.buffered_fd[sh] : idx->fds[sh];
        if (pread_all(fd, (char *)buf + loc->rel[m], loc->nbytes[m], loc->offset[m], loc->nbytes[m],
                      idx->shard_paths[sh], err, errlen))
            return -1;
    }
    for (int m = 0; cb_expert_scaled(loc) && m < 3; m++) {
        int sh = loc->sc_shard[m];
        int fd = own && shards.buffered_fd[sh] >= 0 ? shards.buffered_fd[sh] : idx->fds[sh];
        if (pread_all(fd, (char *)buf + loc->rel_scales[m], loc->sc_nbytes[m], loc->sc_offset[m],
                      loc->sc_nbytes[m], idx->shard_paths[sh], err, errlen))
            return -1;
    }
    __atomic_add_fetch(&cb_prof.buffered_reads, cb_expert_scaled(loc) ? 6 : 3, __ATOMIC_RELAXED);
    return 0;
}

static void count_read(cb_expert_layer *L, int e) {
    const cb_expert_location *loc = &L->loc[e];
    L->count.reads += loc->single_read ? 1 : loc->two_spans ? 2 : cb_expert_scaled(loc) ? 6 : 3;
    uint64_t pieces = loc->nbytes[0] + loc->nbytes[1] + loc->nbytes[2];
    if (cb_expert_scaled(loc)) pieces += loc->sc_nbytes[0] + loc->sc_nbytes[1] + loc->sc_nbytes[2];
    L->count.bytes_read += loc->single_read ? loc->span_bytes : pieces;
}

/* Locate a native expert's three matrices, and their block scales when the checkpoint is fp8 (all three or
 * none: a scale companion on only some of them is refused). */
static int locate_native(cb_expert_location *loc, const cb_st_index *idx, const char *const names[3], int layer,
                         int e, int hidden, int inter, char *err, size_t errlen) {
    for (int m = 0; m < 3; m++) {
        char name[512];
        snprintf(name, sizeof name, names[m], layer, e);
        int rows = m == CB_DOWN ? hidden : inter, cols = m == CB_DOWN ? inter : hidden;
        const cb_tensor *t, *sc;
        int rc4 = cb_fp4_locate(idx, name, rows, cols, &t, &sc, err, errlen);   /* fp4 first: I8/U8/F4 + scale */
        if (rc4 < 0) return -1;
        int rc = rc4 == 0 ? 0 : cb_fp8_locate(idx, name, rows, cols, &t, &sc, err, errlen);
        if (rc < 0) return -1;
        if (m > 0 && rc == 0 && (rc4 == 0) != (loc->kind == CB_MAT_FP4)) {
            snprintf(err, errlen, "layer %d expert %d: %s is %s but its other matrices are not; an expert's three "
                     "matrices share one format", layer, e, name, rc4 == 0 ? "fp4" : "fp8");
            return -1;
        }
        if (m > 0 && (rc == 0) != cb_expert_scaled(loc)) {
            snprintf(err, errlen, "layer %d expert %d: %s %s a block-scale companion but its other matrices %s; "
                     "an expert is fp8 in all three matrices or in none", layer, e, name, rc ? "lacks" : "has",
                     rc ? "have one" : "do not");
            return -1;
        }
        if (rc == 1) {
            int64_t dims[2] = {rows, cols};
            if (!(t = cb_st_expect(idx, name, 2, dims, err, errlen))) return -1;
        } else {
            loc->kind = rc4 == 0 ? CB_MAT_FP4 : CB_MAT_FP8;
            loc->sc_offset[m] = sc->offset;
            loc->sc_nbytes[m] = sc->nbytes;
            loc->sc_shard[m] = sc->shard;
            if (loc->kind == CB_MAT_FP4) cb_fp4_scale_kind_of(sc->dtype_name, &loc->sc_kind[m]);
            else cb_fp8_scale_kind_of(sc->dtype_name, &loc->sc_kind[m]);
        }
        loc->offset[m] = t->offset;
        loc->nbytes[m] = t->nbytes;
        loc->dt[m] = t->dtype;   /* meaningless for a scaled kind (its view describes the matrices) */
        loc->shard[m] = t->shard;
    }
    return 0;
}

/* Whether three pieces tile one span of one shard (in any order); its start and length. */
static int tiles_span(const uint64_t *off, const uint64_t *nb, const int *sh, uint64_t *lo_out, uint64_t *bytes) {
    uint64_t lo = off[0], hi = off[0] + nb[0], total = 0;
    for (int k = 0; k < 3; k++) {
        if (sh[k] != sh[0]) return 0;
        if (off[k] < lo) lo = off[k];
        if (off[k] + nb[k] > hi) hi = off[k] + nb[k];
        total += nb[k];
    }
    *lo_out = lo;
    *bytes = total;
    return hi - lo == total;
}

/* Where each piece goes in the slot buffer; returns the bytes the expert needs. One read when the pieces (three
 * matrices, plus three scale tensors for fp8) tile one span of one shard, in any order, each float matrix
 * aligned for its dtype inside the buffer (the buffer itself is page aligned; fp8 bytes and scales are read
 * unaligned). */
static size_t plan_pieces(cb_expert_location *loc) {
    int scaled = cb_expert_scaled(loc), np = scaled ? 6 : 3;
    uint64_t off[6], nb[6];
    int sh[6];
    for (int m = 0; m < 3; m++) {
        off[m] = loc->offset[m], nb[m] = loc->nbytes[m], sh[m] = loc->shard[m];
        if (scaled) off[3 + m] = loc->sc_offset[m], nb[3 + m] = loc->sc_nbytes[m], sh[3 + m] = loc->sc_shard[m];
    }
    uint64_t lo = off[0], hi = off[0] + nb[0], total = 0;
    int same_shard = 1, aligned = 1;
    for (int k = 0; k < np; k++) {
        if (off[k] < lo) lo = off[k];
        if (off[k] + nb[k] > hi) hi = off[k] + nb[k];
        total += nb[k];
        same_shard &= sh[k] == sh[0];
    }
    for (int m = 0; m < 3 && !scaled; m++)
        if ((off[m] - lo) % cb_dtype_size(loc->dt[m])) aligned = 0;
    loc->single_read = same_shard && aligned && hi - lo == total;
    size_t rel[6];
    size_t need;
    uint64_t wlo, wbytes, slo, sbytes;
    if (loc->single_read) {
        loc->span_offset = lo;
        loc->span_bytes = total;
        for (int k = 0; k < np; k++) rel[k] = (size_t)(off[k] - lo);
        need = (size_t)total;
    } else if (scaled && tiles_span(off, nb, sh, &wlo, &wbytes) && tiles_span(off + 3, nb + 3, sh + 3, &slo, &sbytes)) {
        loc->two_spans = 1;
        loc->span_offset = wlo;
        loc->span_bytes = wbytes;
        loc->sc_span_offset = slo;
        loc->sc_span_bytes = sbytes;
        size_t sbase = ((size_t)wbytes + 63) / 64 * 64;
        for (int m = 0; m < 3; m++) {
            rel[m] = (size_t)(off[m] - wlo);
            rel[3 + m] = sbase + (size_t)(off[3 + m] - slo);
        }
        need = sbase + (size_t)sbytes;
    } else {
        size_t at = 0;
        for (int k = 0; k < np; k++) {
            rel[k] = at;
            at += ((size_t)nb[k] + 63) / 64 * 64;
        }
        need = at;
    }
    for (int m = 0; m < 3; m++) {
        loc->rel[m] = rel[m];
        if (scaled) loc->rel_scales[m] = rel[3 + m];
    }
    return need;
}

/* ---- the store ---- */

int cb_experts_init(cb_expert_layer *L, const cb_st_index *idx, int layer, int n_experts, int cap, int hidden,
                    int inter, const char *const names[3], char *err, size_t errlen) {
    memset(L, 0, sizeof *L);
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
    L->data_off = calloc((size_t)L->cap, sizeof(size_t));
    L->route_count = calloc((size_t)n_experts, sizeof(uint32_t));
    L->heat = calloc((size_t)n_experts, sizeof(double));
    L->heat_unit = 1.0;
    L->pinned = calloc((size_t)n_experts, 1);
    L->predicted = calloc((size_t)n_experts, 1);
    if (!L->loc || !L->slot_of || !L->expert_in || !L->last_use || !L->buf || !L->data_off || !L->route_count ||
        !L->heat || !L->pinned || !L->predicted) {
        snprintf(err, errlen, "out of memory for the expert store of layer %d", layer);
        cb_experts_free(L);
        return -1;
    }
    /* Pinning keeps half the cache for the hottest experts; a cache that holds every expert has nothing to
     * protect. */
    L->pin_budget = cb_stream.pin && L->cap < n_experts ? L->cap / 2 : 0;
    for (int e = 0; e < n_experts; e++) L->slot_of[e] = -1;
    for (int s = 0; s < L->cap; s++) L->expert_in[s] = -1;
    const cb_qcontainer *qc;
    if (cb_qc_of(idx, &qc, err, errlen)) {
        cb_experts_free(L);
        return -1;
    }
    for (int e = 0; e < n_experts; e++) {
        cb_expert_location *loc = &L->loc[e];
        if (qc) {   /* colibri-quant container: each expert is one span by construction (qlinear.c) */
            if (cb_qexperts_locate(qc, names, layer, e, hidden, inter, loc, err, errlen)) {
                cb_experts_free(L);
                return -1;
            }
            if (loc->span_bytes > L->slot_bytes) L->slot_bytes = (size_t)loc->span_bytes;
            continue;
        }
        if (locate_native(loc, idx, names, layer, e, hidden, inter, err, errlen)) {
            cb_experts_free(L);
            return -1;
        }
        size_t need = plan_pieces(loc);
        if (need > L->slot_bytes) L->slot_bytes = need;
    }
    /* Slack for a direct read that starts up to one page before the span and ends on a page boundary. */
    size_t rounded = (L->slot_bytes + 2 * DIO_ALIGN + DIO_ALIGN - 1) / DIO_ALIGN * DIO_ALIGN;
    if (rounded > buf_bytes) buf_bytes = rounded;
    int want_direct = cb_stream.io_mode == CB_IO_DIRECT || (cb_stream.io_mode == CB_IO_AUTO && L->cap < n_experts);
    if (shards_open(idx, want_direct)) {
        snprintf(err, errlen, "out of memory for the shard descriptors");
        cb_experts_free(L);
        return -1;
    }
    if (n_live == live_cap) {
        int nc = live_cap ? live_cap * 2 : 64;
        cb_expert_layer **p = realloc(live, (size_t)nc * sizeof *p);
        if (!p) {
            snprintf(err, errlen, "out of memory");
            shards_release(idx);
            cb_experts_free(L);
            return -1;
        }
        live = p;
        live_cap = nc;
    }
    live[n_live++] = L;
    return 0;
}

void cb_experts_free(cb_expert_layer *L) {
    cb_experts_prefetch_cancel(L);
    for (int i = 0; i < n_live; i++)
        if (live[i] == L) {
            live[i] = live[--n_live];
            shards_release(L->idx);
            break;
        }
    if (!n_live) {
        free(live);
        live = NULL;
        live_cap = 0;
    }
    if (L->buf)
        for (int s = 0; s < L->cap; s++) free(L->buf[s]);
    free(L->buf);
    free(L->loc);
    free(L->slot_of);
    free(L->expert_in);
    free(L->last_use);
    free(L->data_off);
    free(L->route_count);
    free(L->heat);
    free(L->pinned);
    free(L->predicted);
    memset(L, 0, sizeof *L);
}

size_t cb_experts_cache_bytes(const cb_expert_layer *L) { return (size_t)L->cap * L->slot_bytes; }

/* ---- the I/O pool ---- */

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
    pthread_t thread[IO_THREADS];
    int started, quit, n;
    stage_t st[MAX_STAGES];
    uint64_t seq;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

/* As many stages as the RAM plan left room for (--io-stages), else two per routed expert of a token: the block's
 * own misses plus the next layer's predictions. */
static int pool_size(void) {
    if (cb_stream.io_stages > 0) return cb_stream.io_stages < MAX_STAGES ? cb_stream.io_stages : MAX_STAGES;
    int n = 2 * top_k_hint;
    return n < 4 ? 4 : n > MAX_STAGES ? MAX_STAGES : n;
}

void cb_experts_hint_top_k(int top_k) {
    if (top_k > top_k_hint) top_k_hint = top_k;
}

size_t cb_experts_staging_bytes(void) { return prefetch_on() ? (size_t)pool_size() * buf_bytes : 0; }

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
        int rc = raw_read(L, e, dst, &off, err, sizeof err);
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
        for (int i = 0; i < IO_THREADS && ok; i++) ok = pthread_create(&pool.thread[i], NULL, io_main, NULL) == 0;
        if (!ok) {
            /* Cannot happen short of resource exhaustion; reads then stay synchronous. */
            pool.quit = 1;
            pthread_cond_broadcast(&pool.work);
            pthread_mutex_unlock(&pool.mu);
            return 0;
        }
        pool.started = 1;
    }
    if (!(s = take_stage(L, urgent)) || (!s->buf && !(s->buf = alloc_buf()))) {
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
        for (int i = 0; i < IO_THREADS; i++) pthread_join(pool.thread[i], NULL);
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

/* If e is staged, wait for it and swap its buffer into slot s. 1 = taken, 0 = not staged, -1 = read failed. */
static int take_staged(cb_expert_layer *L, int e, int s, char *err, size_t errlen) {
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

/* COLIBRI_EXPERT_TRACE=<file>: one "layer expert" line per access, for studying cache policies offline. */
static void trace_access(const cb_expert_layer *L, int e) {
    static FILE *trace;
    static int opened;
    if (!opened) {
        opened = 1;
        const char *path = getenv("COLIBRI_EXPERT_TRACE");
        if (path && *path && !(trace = fopen(path, "w"))) fprintf(stderr, "notice: cannot write %s\n", path);
    }
    if (trace) fprintf(trace, "%d %d\n", L->layer, e);
}

/* One more access of e: its heat grows by the current unit, and the unit grows so that every earlier access
 * weighs HEAT_DECAY times less than this one. */
static void warm_up(cb_expert_layer *L, int e) {
    L->heat[e] += L->heat_unit;
    L->heat_unit /= HEAT_DECAY;
    if (L->heat_unit > HEAT_RESCALE) {
        for (int x = 0; x < L->n_experts; x++) L->heat[x] /= HEAT_RESCALE;
        L->heat_unit /= HEAT_RESCALE;
    }
}

/* Where a missing expert goes: an empty slot, else the coldest unpinned resident with the hot set, the least
 * recently used unpinned one without it (and among equally hot ones). Pinning never takes every slot. */
static int victim_slot(const cb_expert_layer *L) {
    int s = -1;
    for (int i = 0; i < L->cap; i++) {
        int x = L->expert_in[i];
        if (x < 0) return i;
        if (L->pinned[x]) continue;
        if (s < 0) { s = i; continue; }
        if (cb_stream.pin) {
            double hx = L->heat[x], hs = L->heat[L->expert_in[s]];
            if (hx != hs) { if (hx < hs) s = i; continue; }
        }
        if (L->last_use[i] < L->last_use[s]) s = i;
    }
    return s < 0 ? 0 : s;
}

/* The matrices of expert e from its bytes at base, in the kind its location says. */
static void expert_view(const cb_expert_layer *L, int e, const char *base, cb_expert_view *view) {
    const cb_expert_location *loc = &L->loc[e];
    if (loc->kind == CB_MAT_INT) {
        cb_qexperts_view(loc, base, view);
        return;
    }
    for (int m = 0; m < 3; m++) {
        int rows = m == CB_DOWN ? L->hidden : L->inter, cols = m == CB_DOWN ? L->inter : L->hidden;
        const uint8_t *w = (const uint8_t *)(base + loc->rel[m]);
        const void *scales = base + loc->rel_scales[m];
        cb_matrix *M = &view->m[m];
        if (loc->kind == CB_MAT_FP4) {
            *M = (cb_matrix){.kind = CB_MAT_FP4, .rows = rows, .cols = cols};
            M->f4 = (cb_fp4matrix){rows, cols, w, scales, loc->sc_kind[m]};
        } else if (loc->kind == CB_MAT_FP8) {
            *M = (cb_matrix){.kind = CB_MAT_FP8, .rows = rows, .cols = cols};
            M->f8 = (cb_fp8matrix){rows, cols, w, scales, loc->sc_kind[m]};
        } else {
            *M = cb_matrix_float(w, loc->dt[m], rows, cols);
        }
    }
}

int cb_experts_get(cb_expert_layer *L, int e, cb_expert_view *view, char *err, size_t errlen) {
    if (e < 0 || e >= L->n_experts) {
        snprintf(err, errlen, "layer %d: expert %d out of range", L->layer, e);
        return -1;
    }
    L->route_count[e]++;
    trace_access(L, e);
    if (cb_stream.pin) warm_up(L, e);
    int s = L->slot_of[e];
    if (s >= 0) {
        L->count.hits++;
    } else {
        L->count.misses++;
        s = victim_slot(L);
        if (L->expert_in[s] >= 0) L->slot_of[L->expert_in[s]] = -1;
        L->expert_in[s] = -1;
        double t0 = cb_now_s();
        int staged = take_staged(L, e, s, err, errlen);
        if (staged < 0) return -1;
        if (!staged) {
            if (!L->buf[s] && !(L->buf[s] = alloc_buf())) {
                snprintf(err, errlen, "out of memory for an expert slot of layer %d (%zu bytes)", L->layer,
                         buf_bytes);
                return -1;
            }
            if (raw_read(L, e, L->buf[s], &L->data_off[s], err, errlen)) return -1;
        }
        cb_prof.io_wait_s += cb_now_s() - t0;
        count_read(L, e);
        L->expert_in[s] = e;
        L->slot_of[e] = s;
    }
    L->last_use[s] = ++L->tick;
    expert_view(L, e, (const char *)L->buf[s] + L->data_off[s], view);
    return 0;
}

/* ---- learned hot set ---- */

static int tokens_since_repin, repins;
static char hotset_status[1400] = "none";
static int hotset_loaded;

const char *cb_experts_hotset_status(void) { return hotset_status; }

int cb_experts_pinned_total(void) {
    int n = 0;
    for (int i = 0; i < n_live; i++)
        for (int e = 0; e < live[i]->n_experts; e++) n += live[i]->pinned[e];
    return n;
}

/* Pin the hottest experts, keeping a pinned one unless an outsider is clearly hotter (PIN_MARGIN): without
 * that margin, two experts of near-equal heat would trade places at every re-pin. */
static void repin_layer(cb_expert_layer *L) {
    int E = L->n_experts, n = 0;
    const double *heat = L->heat;
    for (int e = 0; e < E; e++) n += L->pinned[e];
    for (;;) {
        int best = -1, weak = -1;
        for (int e = 0; e < E; e++) {
            if (L->pinned[e]) {
                if (weak < 0 || heat[e] < heat[weak]) weak = e;
            } else if (heat[e] > 0 && (best < 0 || heat[e] > heat[best])) {
                best = e;
            }
        }
        if (best < 0) break;
        if (n < L->pin_budget) {
            L->pinned[best] = 1;
            n++;
        } else if (weak >= 0 && heat[best] > PIN_MARGIN * heat[weak]) {
            L->pinned[weak] = 0;
            L->pinned[best] = 1;
        } else {
            break;
        }
    }
    while (n > L->pin_budget) {   /* a smaller budget than the sidecar's run had */
        int weak = -1;
        for (int e = 0; e < E; e++)
            if (L->pinned[e] && (weak < 0 || heat[e] < heat[weak])) weak = e;
        L->pinned[weak] = 0;
        n--;
    }
}

/* FNV-1a over every shard's name, JSON header and first and last 4 KiB of data: the header alone would match
 * any checkpoint of the same architecture (a fine-tune routes differently), the sampled bytes tell them apart. */
static uint64_t model_key(const cb_st_index *idx) {
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < idx->n_shards; i++) {
        const char *base = strrchr(idx->shard_paths[i], '/');
        base = base ? base + 1 : idx->shard_paths[i];
        for (const char *p = base; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ULL;
        unsigned char len8[8];
        if (pread(idx->fds[i], len8, 8, 0) != 8) continue;
        uint64_t hlen = 0;
        for (int b = 7; b >= 0; b--) hlen = hlen << 8 | len8[b];
        if (hlen > ((uint64_t)1 << 30)) continue;
        char *hdr = malloc(hlen ? hlen : 1);
        if (hdr && pread(idx->fds[i], hdr, hlen, 8) == (ssize_t)hlen)
            for (uint64_t k = 0; k < hlen; k++) h = (h ^ (unsigned char)hdr[k]) * 1099511628211ULL;
        free(hdr);
        unsigned char sample[4096];
        off_t end = lseek(idx->fds[i], 0, SEEK_END);
        off_t at[2] = {(off_t)(8 + hlen), end - (off_t)sizeof sample};
        for (int k = 0; k < 2; k++) {
            if (at[k] < (off_t)(8 + hlen)) at[k] = (off_t)(8 + hlen);
            ssize_t got = pread(idx->fds[i], sample, sizeof sample, at[k]);
            for (ssize_t b = 0; b < got; b++) h = (h ^ sample[b]) * 1099511628211ULL;
        }
    }
    return h;
}

static void sidecar_path(char *out, size_t n) {
    if (cb_stream.hotset_path) {
        snprintf(out, n, "%s", cb_stream.hotset_path);
        return;
    }
    const char *first = shards.idx ? shards.idx->shard_paths[0] : "";
    const char *slash = strrchr(first, '/');
    int dir = slash ? (int)(slash - first) : 1;
    snprintf(out, n, "%.*s/.colibri-hotset", dir, slash ? first : ".");
}

static cb_expert_layer *layer_no(int layer) {
    for (int i = 0; i < n_live; i++)
        if (live[i]->layer == layer) return live[i];
    return NULL;
}

#define HOTSET_MAGIC "colibri-hotset"
#define HOTSET_VERSION 1

/* A layer's heat from the sidecar's counts: each expert's share of the routing, at the steady-state heat of an
 * expert routed that often (share / (1 - HEAT_DECAY) units), so the first tokens start from the long-run picture
 * and their own accesses take over within a few half-lives. */
static void seed_heat(cb_expert_layer *L) {
    double total = 0;
    for (int e = 0; e < L->n_experts; e++) total += L->route_count[e];
    if (total <= 0) return;
    for (int e = 0; e < L->n_experts; e++)
        L->heat[e] = L->heat_unit * (L->route_count[e] / total) / (1.0 - HEAT_DECAY);
}

/* Load the sidecar's counts into the live layers; a file of another model or version is ignored (noticed). */
static void load_hotset(void) {
    hotset_loaded = 1;
    if (!shards.idx) return;
    char path[1024];
    sidecar_path(path, sizeof path);
    FILE *f = fopen(path, "r");
    if (!f) return;
    char magic[32];
    int version = 0;
    unsigned long long key = 0;
    uint64_t want = model_key(shards.idx);
    if (fscanf(f, "%31s %d key %llx", magic, &version, &key) != 3 || strcmp(magic, HOTSET_MAGIC)) {
        snprintf(hotset_status, sizeof hotset_status, "ignored: %s is not a colibri hot-set file", path);
    } else if (version != HOTSET_VERSION) {
        snprintf(hotset_status, sizeof hotset_status, "ignored: %s has version %d (this engine writes %d)", path,
                 version, HOTSET_VERSION);
    } else if (key != want) {
        snprintf(hotset_status, sizeof hotset_status, "ignored: %s belongs to another model", path);
    } else {
        int layer, n;
        while (fscanf(f, " layer %d experts %d", &layer, &n) == 2) {
            cb_expert_layer *L = layer_no(layer);
            for (int e = 0; e < n; e++) {
                unsigned long c = 0;
                if (fscanf(f, "%lu", &c) != 1) break;
                if (L && e < L->n_experts) L->route_count[e] = (uint32_t)c;
            }
        }
        snprintf(hotset_status, sizeof hotset_status, "loaded");
        for (int i = 0; i < n_live; i++) {
            seed_heat(live[i]);
            repin_layer(live[i]);
        }
    }
    if (strncmp(hotset_status, "ignored", 7) == 0) fprintf(stderr, "notice: hot set %s\n", hotset_status);
    fclose(f);
}

int cb_experts_save_hotset(char *err, size_t errlen) {
    if (!cb_stream.pin || !shards.idx || !n_live) return 0;
    char path[1024], tmp[1100];
    sidecar_path(path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) {
        snprintf(err, errlen, "cannot write the hot set %s: %s", tmp, strerror(errno));
        return -1;
    }
    fprintf(f, "%s %d key %016llx\n", HOTSET_MAGIC, HOTSET_VERSION, (unsigned long long)model_key(shards.idx));
    for (int layer = 0, done = 0; done < n_live; layer++) {
        cb_expert_layer *L = layer_no(layer);
        if (!L) continue;
        done++;
        fprintf(f, "layer %d experts %d\n", L->layer, L->n_experts);
        for (int e = 0; e < L->n_experts; e++) fprintf(f, "%u%c", L->route_count[e], e + 1 < L->n_experts ? ' ' : '\n');
    }
    int bad = ferror(f);
    bad |= fflush(f) != 0 || fsync(fileno(f)) != 0;
    bad |= fclose(f) != 0;
    if (bad || rename(tmp, path) != 0) {
        snprintf(err, errlen, "cannot write the hot set %s: %s", path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

void cb_experts_after_tokens(int n) {
    if (!cb_stream.pin || !n_live) return;
    if (!hotset_loaded) load_hotset();
    tokens_since_repin += n;
    int every = cb_stream.repin_every > 0 ? cb_stream.repin_every : 8;
    if (tokens_since_repin < every) return;
    tokens_since_repin = 0;
    for (int i = 0; i < n_live; i++) repin_layer(live[i]);
    if (++repins % 16 == 0) {
        char err[512];
        if (cb_experts_save_hotset(err, sizeof err)) fprintf(stderr, "notice: %s\n", err);
    }
}

/* ---- preloading a cache that holds every expert ---- */

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
        if (!L->buf[e] && !(L->buf[e] = alloc_buf()))
            snprintf(err, sizeof err, "out of memory for an expert slot of layer %d (%zu bytes)", L->layer, buf_bytes);
        else if (raw_read(L, (int)e, L->buf[e], &L->data_off[e], err, sizeof err) == 0)
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
    job.layers = malloc((size_t)(n_live ? n_live : 1) * sizeof *job.layers);
    if (!job.layers) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (int layer = 0, seen = 0; seen < n_live; layer++) {
        cb_expert_layer *L = layer_no(layer);
        if (!L) continue;
        seen++;
        int empty = L->cap == L->n_experts;
        for (int s = 0; s < L->cap && empty; s++) empty = L->expert_in[s] < 0;
        if (!empty) continue;  /* a partial cache streams; one already in use keeps what it has */
        job.layers[job.n_layers++] = L;
        job.total += L->n_experts;
    }
    pthread_t th[IO_THREADS];
    int started = 0;
    for (int i = 0; i < IO_THREADS; i++) started += pthread_create(&th[started], NULL, preload_main, &job) == 0;
    if (!started) preload_main(&job);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    /* On a failed read the store stays empty (the buffers are kept and reused by the lazy path). */
    for (int k = 0; k < job.n_layers && !job.failed; k++) {
        cb_expert_layer *L = job.layers[k];
        for (int e = 0; e < L->n_experts; e++) {
            uint64_t before = L->count.bytes_read;
            count_read(L, e);
            *bytes += L->count.bytes_read - before;
            L->expert_in[e] = e;
            L->slot_of[e] = e;
        }
    }
    free(job.layers);
    if (job.failed) snprintf(err, errlen, "%s", job.err);
    return job.failed ? -1 : 0;
}
