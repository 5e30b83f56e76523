/* expert_remote.c: see expert_remote.h. The main thread owns every worker's connection while the worker is ready;
 * the reconnect thread owns it while it is not (connecting, sending the share, waiting for it to load). */
#include "expert_remote.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "expert_wire.h"
#include "experts_impl.h"

#define RECONNECT_EVERY_S 0.5
#define CONNECT_TIMEOUT_S 0.5
#define LOAD_TIMEOUT_S 3600.0   /* a worker reading a large share from disk; the wait is the reconnect thread's */
#define ERRLEN 256

typedef struct {
    char addr[300], host[256], port[32];
    cbw_buf hello;             /* the HELLO payload: the worker's share */
    pthread_mutex_t mu;
    int fd;                    /* ready: the main thread's; else the reconnect thread's (-1 = none) */
    int ready;
    double retry_at;
    uint32_t pid;
    uint64_t held_experts, held_bytes, messages, failures, reconnects, connects;
    /* the current call */
    int pending, n_exp, n_pairs;
    int *exp, *cnt, *pairs;    /* experts sent, rows per expert, (row, choice) index of each output in order */
    int *row_of;               /* row -> its index among the rows sent, -1 when not sent */
    unsigned char *mark;       /* expert -> 1 while it is being sent */
    int pairs_cap;
    cbw_buf msg;
} worker_t;

static worker_t *workers;
static int n_workers;
static int16_t **owner;        /* layer number -> expert -> worker index (-1: nobody) */
static int n_owner;
static int timeout_ms = 2000;
static cb_remote_counters totals;
static pthread_t reconnector;
static int reconnector_running, stopping;
static pthread_mutex_t stop_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t stop_cv = PTHREAD_COND_INITIALIZER;

int cb_remote_active(void) { return n_workers > 0; }
cb_remote_counters cb_remote_totals(void) { return totals; }

/* ---- the map file ---- */

static int parse_experts(const char *list, int n_experts, unsigned char *mark) {
    const char *p = list;
    while (*p) {
        char *end;
        long a = strtol(p, &end, 10), b = a;
        if (end == p || a < 0 || a >= n_experts) return -1;
        p = end;
        if (*p == '-') {
            b = strtol(p + 1, &end, 10);
            if (end == p + 1 || b < a || b >= n_experts) return -1;
            p = end;
        }
        for (long e = a; e <= b; e++) mark[e] = 1;
        if (*p == ',') p++;
        else if (*p && *p != '\n' && *p != ' ') return -1;
        else break;
    }
    return 0;
}

static int add_worker(const char *addr, char *err, size_t errlen) {
    worker_t *p = realloc(workers, (size_t)(n_workers + 1) * sizeof *p);
    if (!p) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    workers = p;
    worker_t *w = &workers[n_workers];
    memset(w, 0, sizeof *w);
    w->fd = -1;
    snprintf(w->addr, sizeof w->addr, "%s", addr);
    if (cbw_split_addr(addr, w->host, sizeof w->host, w->port, sizeof w->port, err, errlen)) return -1;
    pthread_mutex_init(&w->mu, NULL);
    size_t E = 0;
    for (int i = 0; i < cbx_n_live; i++)
        if ((size_t)cbx_live[i]->n_experts > E) E = (size_t)cbx_live[i]->n_experts;
    w->exp = malloc((E ? E : 1) * sizeof(int));
    w->cnt = malloc((E ? E : 1) * sizeof(int));
    w->mark = calloc(E ? E : 1, 1);
    n_workers++;
    if (!w->exp || !w->cnt || !w->mark) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    cbw_put_u32(&w->hello, 0);   /* layer count, patched as layers are added */
    return 0;
}

static int add_layer(worker_t *w, int wi, int layer, const char *list, char *err, size_t errlen) {
    cb_expert_layer *L = cbx_layer_no(layer);
    if (!L) {
        snprintf(err, errlen, "layer %d is not a MoE layer of this model", layer);
        return -1;
    }
    if (layer >= n_owner) {
        int16_t **p = realloc(owner, (size_t)(layer + 1) * sizeof *p);
        if (!p) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        for (int i = n_owner; i <= layer; i++) p[i] = NULL;
        owner = p;
        n_owner = layer + 1;
    }
    if (!owner[layer]) {
        if (!(owner[layer] = malloc((size_t)L->n_experts * sizeof(int16_t)))) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        for (int e = 0; e < L->n_experts; e++) owner[layer][e] = -1;
    }
    unsigned char *mark = calloc((size_t)L->n_experts, 1);
    if (!mark) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (parse_experts(list, L->n_experts, mark)) {
        snprintf(err, errlen, "layer %d: expert list %s is not ranges of 0..%d", layer, list, L->n_experts - 1);
        free(mark);
        return -1;
    }
    uint32_t held = 0;
    for (int e = 0; e < L->n_experts; e++) held += mark[e];
    cbw_put_u32(&w->hello, (uint32_t)layer);
    cbw_put_u32(&w->hello, (uint32_t)L->n_experts);
    cbw_put_u32(&w->hello, (uint32_t)L->hidden);
    cbw_put_u32(&w->hello, (uint32_t)L->inter);
    for (int m = 0; m < 3; m++) cbw_put_str(&w->hello, L->name_fmt[m]);
    cbw_put_u32(&w->hello, held);
    for (int e = 0; e < L->n_experts; e++)
        if (mark[e]) {
            if (owner[layer][e] >= 0 && owner[layer][e] != wi) {
                snprintf(err, errlen, "layer %d expert %d is given to two workers", layer, e);
                free(mark);
                return -1;
            }
            owner[layer][e] = (int16_t)wi;
            cbw_put_u32(&w->hello, (uint32_t)e);
        }
    free(mark);
    uint32_t n_layers;
    memcpy(&n_layers, w->hello.p, 4);
    n_layers++;
    memcpy(w->hello.p, &n_layers, 4);
    if (w->hello.oom) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}

static int read_map(const char *path, char *err, size_t errlen) {
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "cannot open the expert map %s: %s", path, strerror(errno));
        return -1;
    }
    char *line = NULL, msg[ERRLEN];
    size_t cap = 0;
    int lineno = 0, rc = 0;
    while (getline(&line, &cap, f) > 0 && !rc) {
        lineno++;
        char word[16], addr[300];
        int layer, used = 0;
        msg[0] = 0;
        if (lineno == 1) {
            if (strncmp(line, "colibri-expert-map 1", 20)) snprintf(msg, sizeof msg, "not a colibri-expert-map 1 file");
        } else if (sscanf(line, "%15s", word) != 1 || word[0] == '#') {
            continue;
        } else if (!strcmp(word, "worker") && sscanf(line, "worker %299s", addr) == 1) {
            if (n_workers >= 32000) snprintf(msg, sizeof msg, "too many workers");
            else add_worker(addr, msg, sizeof msg);
        } else if (!strcmp(word, "layer") && sscanf(line, "layer %d experts %n", &layer, &used) == 1 && used) {
            if (!n_workers) snprintf(msg, sizeof msg, "a layer line before any worker line");
            else add_layer(&workers[n_workers - 1], n_workers - 1, layer, line + used, msg, sizeof msg);
        } else {
            snprintf(msg, sizeof msg, "expected `worker HOST:PORT` or `layer L experts LIST`");
        }
        if (msg[0]) {
            snprintf(err, errlen, "expert map %s line %d: %s", path, lineno, msg);
            rc = -1;
        }
    }
    if (!rc && !lineno) {
        snprintf(err, errlen, "expert map %s is empty", path);
        rc = -1;
    }
    free(line);
    fclose(f);
    return rc;
}

/* ---- connecting ---- */

/* Connect, send the share, wait for the worker to load it. Called without w->mu; only a worker that is not ready. */
static void connect_worker(worker_t *w, double load_wait_s) {
    char err[ERRLEN];
    int fd = cbw_connect(w->host, w->port, cbw_now() + CONNECT_TIMEOUT_S, err, sizeof err);
    if (fd < 0) return;
    pthread_mutex_lock(&w->mu);
    w->fd = fd;   /* visible to cb_remote_stop, which shuts it down to end the wait */
    pthread_mutex_unlock(&w->mu);
    /* Checked after publishing fd: a stop that began earlier is seen here, a later one shuts fd down. */
    pthread_mutex_lock(&stop_mu);
    int stop_now = stopping;
    pthread_mutex_unlock(&stop_mu);
    if (stop_now) {
        pthread_mutex_lock(&w->mu);
        w->fd = -1;
        pthread_mutex_unlock(&w->mu);
        close(fd);
        return;
    }
    cbw_buf in = {0};
    int type = 0, ok = 0;
    if (!cbw_send(fd, CBW_HELLO, &w->hello, cbw_now() + (double)timeout_ms / 1000.0, err, sizeof err) &&
        !cbw_recv(fd, &type, &in, cbw_now() + load_wait_s, err, sizeof err) && type == CBW_HELLO_OK) {
        cbw_reader r = {in.p, in.n, 0, 0};
        uint32_t pid = cbw_get_u32(&r), experts = cbw_get_u32(&r), lo = cbw_get_u32(&r), hi = cbw_get_u32(&r);
        if (!r.bad) {
            ok = 1;
            pthread_mutex_lock(&w->mu);
            w->pid = pid;
            w->held_experts = experts;
            w->held_bytes = (uint64_t)lo | (uint64_t)hi << 32;
            w->reconnects += w->connects > 0;
            w->connects++;
            w->ready = 1;
            pthread_mutex_unlock(&w->mu);
        }
    } else if (type == CBW_ERROR) {
        cbw_reader r = {in.p, in.n, 0, 0};
        cbw_get_str(&r, err, sizeof err);
        fprintf(stderr, "notice: expert worker %s refused its share: %s\n", w->addr, err);
    }
    cbw_buf_free(&in);
    if (!ok) {
        pthread_mutex_lock(&w->mu);
        w->fd = -1;
        pthread_mutex_unlock(&w->mu);
        close(fd);
    }
}

static void *reconnect_loop(void *arg) {
    (void)arg;
    pthread_mutex_lock(&stop_mu);
    while (!stopping) {
        pthread_mutex_unlock(&stop_mu);
        for (int i = 0; i < n_workers; i++) {
            worker_t *w = &workers[i];
            pthread_mutex_lock(&w->mu);
            int want = !w->ready && w->fd < 0 && cbw_now() >= w->retry_at;
            pthread_mutex_unlock(&w->mu);
            if (want) connect_worker(w, LOAD_TIMEOUT_S);
        }
        pthread_mutex_lock(&stop_mu);
        if (stopping) break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += (long)(RECONNECT_EVERY_S * 1e9);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&stop_cv, &stop_mu, &ts);
    }
    pthread_mutex_unlock(&stop_mu);
    return NULL;
}

/* The main thread gives up on a ready worker: the reconnect thread takes it from here. */
static void mark_dead(worker_t *w, const char *why) {
    fprintf(stderr, "notice: expert worker %s lost (%s); its experts stream from disk until it is back\n", w->addr,
            why);
    pthread_mutex_lock(&w->mu);
    if (w->fd >= 0) close(w->fd);
    w->fd = -1;
    w->ready = 0;
    w->failures++;
    w->retry_at = cbw_now() + RECONNECT_EVERY_S;
    pthread_mutex_unlock(&w->mu);
    totals.failures++;
}

int cb_remote_start(const char *map_path, int timeout, double wait_s, char *err, size_t errlen) {
    if (timeout > 0) timeout_ms = timeout;
    stopping = 0;
    if (read_map(map_path, err, errlen)) {
        cb_remote_stop();
        return -1;
    }
    /* A worker that accepts gets wait_s to load its share; one that does not accept within the timeout is left to
     * the reconnect thread (the request streams its experts meanwhile). In order: simple, and each wait bounded. */
    for (int i = 0; i < n_workers; i++) {
        double refuse_until = cbw_now() + (double)timeout_ms / 1000.0;
        while (!workers[i].ready && cbw_now() < refuse_until) {
            connect_worker(&workers[i], wait_s > 1 ? wait_s : 1);
            if (!workers[i].ready) usleep(100000);
        }
        if (!workers[i].ready) fprintf(stderr, "notice: expert worker %s is not up yet\n", workers[i].addr);
    }
    if (pthread_create(&reconnector, NULL, reconnect_loop, NULL)) {
        snprintf(err, errlen, "cannot start the expert-worker reconnect thread");
        cb_remote_stop();
        return -1;
    }
    reconnector_running = 1;
    return 0;
}

void cb_remote_stop(void) {
    pthread_mutex_lock(&stop_mu);
    stopping = 1;
    pthread_cond_broadcast(&stop_cv);
    pthread_mutex_unlock(&stop_mu);
    for (int i = 0; i < n_workers; i++) {   /* wake a reconnect waiting for a share to load */
        pthread_mutex_lock(&workers[i].mu);
        if (!workers[i].ready && workers[i].fd >= 0) shutdown(workers[i].fd, SHUT_RDWR);
        pthread_mutex_unlock(&workers[i].mu);
    }
    if (reconnector_running) pthread_join(reconnector, NULL);
    reconnector_running = 0;
    for (int i = 0; i < n_workers; i++) {
        worker_t *w = &workers[i];
        if (w->fd >= 0) close(w->fd);
        pthread_mutex_destroy(&w->mu);
        cbw_buf_free(&w->hello);
        cbw_buf_free(&w->msg);
        free(w->exp);
        free(w->cnt);
        free(w->pairs);
        free(w->row_of);
        free(w->mark);
    }
    free(workers);
    workers = NULL;
    n_workers = 0;
    for (int i = 0; i < n_owner; i++) free(owner[i]);
    free(owner);
    owner = NULL;
    n_owner = 0;
}

/* ---- a MoE call ---- */

static int is_ready(worker_t *w) {
    pthread_mutex_lock(&w->mu);
    int r = w->ready;
    pthread_mutex_unlock(&w->mu);
    return r;
}

void cb_remote_send(cb_expert_layer *L, int *n_rows, const int *chosen, int n, int top_k, const float *x,
                    float swiglu_limit) {
    if (!n_workers || L->layer >= n_owner || !owner[L->layer]) return;
    const int16_t *own = owner[L->layer];
    int H = L->hidden, sent_any = 0;
    for (int wi = 0; wi < n_workers; wi++) {
        worker_t *w = &workers[wi];
        w->pending = 0;
        w->n_exp = 0;
        w->n_pairs = 0;
        if (!is_ready(w)) continue;
        for (int e = 0; e < L->n_experts; e++)
            if (n_rows[e] && own[e] == wi && L->slot_of[e] < 0) w->exp[w->n_exp++] = e;
        if (!w->n_exp) continue;
        if (w->pairs_cap < n * top_k) {
            int *p = realloc(w->pairs, (size_t)n * (size_t)top_k * sizeof(int));
            int *r = p ? realloc(w->row_of, (size_t)n * sizeof(int)) : NULL;
            if (p) w->pairs = p;
            if (!r) continue;   /* out of memory: this worker's experts stay local */
            w->row_of = r;
            w->pairs_cap = n * top_k;
        }
        /* The rows that chose any of them, each sent once, in ascending order. */
        for (int k = 0; k < w->n_exp; k++) w->mark[w->exp[k]] = 1;
        int n_sent = 0;
        for (int i = 0; i < n; i++) {
            int hit = 0;
            for (int j = 0; j < top_k; j++) {
                int ch = chosen[(size_t)i * (size_t)top_k + (size_t)j];
                hit |= ch >= 0 && w->mark[ch];
            }
            w->row_of[i] = hit ? n_sent++ : -1;
        }
        for (int k = 0; k < w->n_exp; k++) w->mark[w->exp[k]] = 0;
        cbw_buf *b = &w->msg;
        b->n = 0;
        b->oom = 0;
        cbw_put_u32(b, (uint32_t)L->layer);
        cbw_put(b, &swiglu_limit, 4);
        cbw_put_u32(b, (uint32_t)n_sent);
        cbw_put_u32(b, (uint32_t)w->n_exp);
        /* Per expert its rows in ascending order: the order gather_rows gives the local path. */
        for (int k = 0; k < w->n_exp; k++) {
            int e = w->exp[k];
            w->cnt[k] = n_rows[e];
            cbw_put_u32(b, (uint32_t)e);
            cbw_put_u32(b, (uint32_t)n_rows[e]);
            for (int i = 0; i < n; i++)
                for (int j = 0; j < top_k; j++)
                    if (chosen[(size_t)i * (size_t)top_k + (size_t)j] == e) {
                        cbw_put_u32(b, (uint32_t)w->row_of[i]);
                        w->pairs[w->n_pairs++] = i * top_k + j;
                    }
        }
        for (int i = 0; i < n; i++)
            if (w->row_of[i] >= 0) cbw_put(b, x + (size_t)i * (size_t)H, (size_t)H * sizeof(float));
        char err[ERRLEN];
        if (cbw_send(w->fd, CBW_RUN, b, cbw_now() + (double)timeout_ms / 1000.0, err, sizeof err)) {
            mark_dead(w, err);
            continue;
        }
        for (int k = 0; k < w->n_exp; k++) n_rows[w->exp[k]] = 0;
        w->pending = 1;
        sent_any = 1;
        totals.messages++;
        w->messages++;
        totals.rows += (uint64_t)n_sent;
        totals.experts += (uint64_t)w->n_exp;
        totals.bytes_sent += b->n + CBW_HEADER_BYTES;
    }
    totals.layer_round_trips += (uint64_t)sent_any;
}

int cb_remote_recv(cb_expert_layer *L, int *n_rows, float *y) {
    int redo = 0, H = L->hidden;
    for (int wi = 0; wi < n_workers; wi++) {
        worker_t *w = &workers[wi];
        if (!w->pending) continue;
        w->pending = 0;
        char err[ERRLEN];
        int type = 0;
        int ok = !cbw_recv(w->fd, &type, &w->msg, cbw_now() + (double)timeout_ms / 1000.0, err, sizeof err);
        if (ok && type == CBW_ERROR) {
            cbw_reader r = {w->msg.p, w->msg.n, 0, 0};
            cbw_get_str(&r, err, sizeof err);
            ok = 0;
        } else if (ok && (type != CBW_RUN_OK || w->msg.n != (size_t)w->n_pairs * (size_t)H * sizeof(float))) {
            snprintf(err, sizeof err, "answer of %zu bytes, type %d, for %d outputs", w->msg.n, type, w->n_pairs);
            ok = 0;
        }
        if (!ok) {
            mark_dead(w, err);
            for (int k = 0; k < w->n_exp; k++) n_rows[w->exp[k]] = w->cnt[k];
            redo += w->n_exp;
            totals.fallback_experts += (uint64_t)w->n_exp;
            continue;
        }
        totals.bytes_received += w->msg.n + CBW_HEADER_BYTES;
        for (int p = 0; p < w->n_pairs; p++)
            memcpy(y + (size_t)w->pairs[p] * (size_t)H, w->msg.p + (size_t)p * (size_t)H * sizeof(float),
                   (size_t)H * sizeof(float));
        /* their routing was counted with the layer's (cb_experts_note_routing); the stats count each row */
        for (int k = 0; k < w->n_exp; k++) L->uses[w->exp[k]] += (uint64_t)w->cnt[k];
    }
    return redo;
}

/* ---- stats ---- */

void cb_remote_put_counters(cb_buf *b, const cb_remote_counters *c) {
    cb_buf_printf(b, ",\"remote_messages\":%llu,\"remote_rows\":%llu,\"remote_experts\":%llu,"
                     "\"remote_bytes_sent\":%llu,\"remote_bytes_received\":%llu,\"remote_layer_round_trips\":%llu,"
                     "\"remote_failures\":%llu,\"remote_fallback_experts\":%llu",
                  (unsigned long long)c->messages, (unsigned long long)c->rows, (unsigned long long)c->experts,
                  (unsigned long long)c->bytes_sent, (unsigned long long)c->bytes_received,
                  (unsigned long long)c->layer_round_trips, (unsigned long long)c->failures,
                  (unsigned long long)c->fallback_experts);
}

void cb_remote_put_workers(cb_buf *b) {
    cb_buf_puts(b, ",\"expert_workers\":[");
    for (int i = 0; i < n_workers; i++) {
        worker_t *w = &workers[i];
        pthread_mutex_lock(&w->mu);
        cb_buf_puts(b, i ? ",{\"address\":" : "{\"address\":");
        cb_buf_json_str(b, w->addr);
        cb_buf_printf(b, ",\"alive\":%s,\"pid\":%u,\"experts\":%llu,\"bytes_held\":%llu,\"messages\":%llu,"
                         "\"failures\":%llu,\"reconnects\":%llu}",
                      w->ready ? "true" : "false", w->pid, (unsigned long long)w->held_experts,
                      (unsigned long long)w->held_bytes, (unsigned long long)w->messages,
                      (unsigned long long)w->failures, (unsigned long long)w->reconnects);
        pthread_mutex_unlock(&w->mu);
    }
    cb_buf_puts(b, "]");
}
