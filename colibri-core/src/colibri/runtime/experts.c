/* experts.c: see experts.h. */
#include "experts.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    return 0;
}

void cb_experts_free(cb_expert_layer *L) {
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

static int read_expert(cb_expert_layer *L, int e, void *buf, char *err, size_t errlen) {
    const cb_expert_location *loc = &L->loc[e];
    if (loc->single_read) {
        if (cb_st_pread(L->idx, loc->shard[0], buf, loc->span_bytes, loc->span_offset, err, errlen)) return -1;
        L->count.reads++;
        L->count.bytes_read += loc->span_bytes;
        return 0;
    }
    for (int m = 0; m < 3; m++) {
        if (cb_st_pread(L->idx, loc->shard[m], (char *)buf + loc->rel[m], loc->nbytes[m], loc->offset[m], err,
                        errlen))
            return -1;
        L->count.reads++;
        L->count.bytes_read += loc->nbytes[m];
    }
    return 0;
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
        if (!L->buf[s] && !(L->buf[s] = aligned_alloc(64, (L->slot_bytes + 63) / 64 * 64))) {
            snprintf(err, errlen, "out of memory for an expert slot of layer %d (%zu bytes)", L->layer,
                     L->slot_bytes);
            return -1;
        }
        if (read_expert(L, e, L->buf[s], err, errlen)) return -1;
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
