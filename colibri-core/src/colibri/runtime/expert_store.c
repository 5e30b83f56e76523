/* expert_store.c: the slots of each MoE layer's expert cache, eviction and cb_experts_get (experts.h); the
 * registry of live layers and the streaming options. Reading is expert_read.c's, staging expert_pool.c's. */
#include "experts_impl.h"
#include "qlinear.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static cb_stream_opts opts = {.moe_union = 1, .repin_every = 8};
cb_profile cb_prof;

cb_stream_opts cb_stream_defaults(void) { return (cb_stream_opts){.moe_union = 1, .repin_every = 8}; }
void cb_experts_configure(const cb_stream_opts *o) { opts = *o; }
const cb_stream_opts *cb_experts_options(void) { return &opts; }
int cbx_io_threads(void) {
    int n = opts.io_threads > 0 ? opts.io_threads : CBX_IO_THREADS;
    return n < CBX_IO_THREADS_MAX ? n : CBX_IO_THREADS_MAX;
}

double cb_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

size_t cbx_buf_bytes;

void *cbx_alloc_buf(void) { return aligned_alloc(CBX_DIO_ALIGN, cbx_buf_bytes); }

cb_expert_layer **cbx_live;
int cbx_n_live;
static int live_cap;

cb_expert_layer *cbx_layer_no(int layer) {
    for (int i = 0; i < cbx_n_live; i++)
        if (cbx_live[i]->layer == layer) return cbx_live[i];
    return NULL;
}

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
    L->uses = calloc((size_t)n_experts, sizeof(uint64_t));
    L->heat = calloc((size_t)n_experts, sizeof(double));
    L->heat_unit = 1.0;
    L->pinned = calloc((size_t)n_experts, 1);
    L->predicted = calloc((size_t)n_experts, 1);
    if (!L->loc || !L->slot_of || !L->expert_in || !L->last_use || !L->buf || !L->data_off || !L->route_count ||
        !L->uses || !L->heat || !L->pinned || !L->predicted) {
        snprintf(err, errlen, "out of memory for the expert store of layer %d", layer);
        cb_experts_free(L);
        return -1;
    }
    /* Pinning keeps half the cache for the hottest experts; a cache that holds every expert has nothing to
     * protect. */
    L->pin_budget = cb_experts_options()->pin && L->cap < n_experts ? L->cap / 2 : 0;
    for (int e = 0; e < n_experts; e++) L->slot_of[e] = -1;
    for (int s = 0; s < L->cap; s++) L->expert_in[s] = -1;
    /* A cache that holds every expert never evicts: nothing to duel over. */
    if (cb_experts_options()->pin == CB_PIN_DUEL && L->cap < n_experts && cbx_duel_init(L)) {
        snprintf(err, errlen, "out of memory for the expert store of layer %d", layer);
        cb_experts_free(L);
        return -1;
    }
    for (int m = 0; m < 3; m++)
        if (!(L->name_fmt[m] = strdup(names[m]))) {
            snprintf(err, errlen, "out of memory for the expert store of layer %d", layer);
            cb_experts_free(L);
            return -1;
        }
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
        if (cbx_locate_native(loc, idx, names, layer, e, hidden, inter, err, errlen)) {
            cb_experts_free(L);
            return -1;
        }
        size_t need = cbx_plan_pieces(loc);
        if (need > L->slot_bytes) L->slot_bytes = need;
    }
    /* Slack for a direct read that starts up to one page before the span and ends on a page boundary. */
    size_t rounded = (L->slot_bytes + 2 * CBX_DIO_ALIGN + CBX_DIO_ALIGN - 1) / CBX_DIO_ALIGN * CBX_DIO_ALIGN;
    if (rounded > cbx_buf_bytes) cbx_buf_bytes = rounded;
    int io_mode = cb_experts_options()->io_mode;
    int want_direct = io_mode == CB_IO_DIRECT || (io_mode == CB_IO_AUTO && L->cap < n_experts);
    if (cbx_shards_open(idx, want_direct)) {
        snprintf(err, errlen, "out of memory for the shard descriptors");
        cb_experts_free(L);
        return -1;
    }
    if (cbx_n_live == live_cap) {
        int nc = live_cap ? live_cap * 2 : 64;
        cb_expert_layer **p = realloc(cbx_live, (size_t)nc * sizeof *p);
        if (!p) {
            snprintf(err, errlen, "out of memory");
            cbx_shards_release(idx);
            cb_experts_free(L);
            return -1;
        }
        cbx_live = p;
        live_cap = nc;
    }
    cbx_live[cbx_n_live++] = L;
    return 0;
}

void cb_experts_free(cb_expert_layer *L) {
    cb_experts_prefetch_cancel(L);
    for (int i = 0; i < cbx_n_live; i++)
        if (cbx_live[i] == L) {
            cbx_live[i] = cbx_live[--cbx_n_live];
            cbx_shards_release(L->idx);
            break;
        }
    if (!cbx_n_live) {
        free(cbx_live);
        cbx_live = NULL;
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
    free(L->uses);
    free(L->heat);
    free(L->pinned);
    free(L->predicted);
    cbx_duel_free(L);
    for (int m = 0; m < 3; m++) free(L->name_fmt[m]);
    memset(L, 0, sizeof *L);
}

size_t cb_experts_cache_bytes(const cb_expert_layer *L) { return (size_t)L->cap * L->slot_bytes; }

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

/* The real cache and both of set dueling's shadows evict by this one rule. Pins count only by heat: LRU alone
 * has none (pinning never takes every slot). */
int cbx_victim(const cb_expert_layer *L, const int *tag, const uint64_t *use, int n, int by_heat,
               const unsigned char *spare) {
    int s = -1;
    for (int i = 0; i < n; i++) {
        int x = tag[i];
        if (x < 0) return i;
        if ((spare && spare[i]) || (by_heat && L->pinned[x])) continue;
        if (s < 0) { s = i; continue; }
        if (by_heat) {
            double hx = L->heat[x], hs = L->heat[tag[s]];
            if (hx != hs) { if (hx < hs) s = i; continue; }
        }
        if (use[i] < use[s]) s = i;
    }
    return s;
}

/* Where a missing expert goes: an empty slot, else the victim of the policy in effect. */
static int victim_slot(cb_expert_layer *L) {
    if (L->duel.keep) return cbx_duel_victim(L);
    int s = cbx_victim(L, L->expert_in, L->last_use, L->cap, cb_experts_options()->pin != CB_PIN_OFF, NULL);
    return s < 0 ? 0 : s;
}

const char *cb_experts_policy_name(void) {
    int pin = cb_experts_options()->pin;
    return pin == CB_PIN_DUEL ? "duel" : pin ? "hot" : "lru";
}

int cb_experts_duel_lru_layers(void) {
    int n = 0;
    for (int i = 0; i < cbx_n_live; i++)
        n += cbx_live[i]->duel.keep && cb_experts_duel_leader(cbx_live[i]) == CB_DUEL_LRU;
    return n;
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
        if (loc->kind == CB_MAT_I4P) {
            *M = (cb_matrix){.kind = CB_MAT_I4P, .rows = rows, .cols = cols};
            M->i4 = (cb_i4pmatrix){rows, cols, loc->sc_group[m], w, scales, loc->sc_kind[m]};
        } else if (loc->kind == CB_MAT_FP4) {
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

void cb_experts_note_routing(cb_expert_layer *L, const int *chosen, int n) {
    int heat = cb_experts_options()->pin != CB_PIN_OFF;
    for (int j = 0; j < n; j++) {
        int e = chosen[j];
        if (e < 0 || e >= L->n_experts) continue;
        L->route_count[e]++;
        if (heat) cbx_warm_up(L, e);
    }
}

static int in_range(const cb_expert_layer *L, int e, char *err, size_t errlen) {
    if (e >= 0 && e < L->n_experts) return 1;
    snprintf(err, errlen, "layer %d: expert %d out of range", L->layer, e);
    return 0;
}

int cb_experts_get(cb_expert_layer *L, int e, cb_expert_view *view, char *err, size_t errlen) {
    if (!in_range(L, e, err, errlen)) return -1;
    cb_experts_note_routing(L, &e, 1);
    return cb_experts_serve(L, e, view, err, errlen);
}

int cb_experts_serve(cb_expert_layer *L, int e, cb_expert_view *view, char *err, size_t errlen) {
    if (!in_range(L, e, err, errlen)) return -1;
    L->uses[e]++;
    trace_access(L, e);
    uint64_t now = ++L->tick;
    if (L->duel.keep) cbx_duel_observe(L, e, now);
    int s = L->slot_of[e];
    if (s >= 0) {
        L->count.hits++;
    } else {
        L->count.misses++;
        s = victim_slot(L);
        if (L->expert_in[s] >= 0) L->slot_of[L->expert_in[s]] = -1;
        L->expert_in[s] = -1;
        double t0 = cb_now_s();
        int staged = cbx_take_staged(L, e, s, err, errlen);
        if (staged < 0) return -1;
        if (!staged) {
            if (!L->buf[s] && !(L->buf[s] = cbx_alloc_buf())) {
                snprintf(err, errlen, "out of memory for an expert slot of layer %d (%zu bytes)", L->layer,
                         cbx_buf_bytes);
                return -1;
            }
            if (cbx_raw_read(L, e, L->buf[s], &L->data_off[s], err, errlen)) return -1;
        }
        cb_prof.io_wait_s += cb_now_s() - t0;
        cbx_count_read(L, e);
        L->expert_in[s] = e;
        L->slot_of[e] = s;
    }
    L->last_use[s] = now;
    expert_view(L, e, (const char *)L->buf[s] + L->data_off[s], view);
    return 0;
}

