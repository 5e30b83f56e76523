/* experts.h: the routed-expert store of one MoE layer.
 *
 * Experts stay on disk until a token routes to them. Each layer keeps `cap` slots and evicts the least
 * recently used expert on a miss. A miss costs ONE pread when the expert's gate, up and down matrices are
 * adjacent in the same shard (the layout safetensors gives per-expert tensors), else one pread per matrix.
 * Slot buffers are allocated on first use, so a generous cap costs nothing until the experts are touched.
 * Every buffer has the size of the largest expert of any layer, so the prefetcher's one staging buffer can be
 * swapped with any slot's instead of copied.
 */
#ifndef COLIBRI_EXPERTS_H
#define COLIBRI_EXPERTS_H

#include <stddef.h>
#include <stdint.h>

#include "safetensors.h"

enum { CB_GATE = 0, CB_UP = 1, CB_DOWN = 2 };

/* A resident expert: gate [inter, hidden], up [inter, hidden], down [hidden, inter], row-major. */
typedef struct {
    const void *w[3];
    cb_dtype dt[3];
} cb_expert_view;

typedef struct {
    int shard[3];              /* shard of each matrix (a split checkpoint may separate them) */
    int single_read;           /* gate/up/down form one contiguous byte span */
    uint64_t span_offset, span_bytes;
    uint64_t offset[3], nbytes[3];
    size_t rel[3];             /* where each matrix starts inside the slot buffer */
    cb_dtype dt[3];
} cb_expert_location;

typedef struct {
    uint64_t hits, misses, bytes_read, reads;
} cb_expert_counters;

typedef struct {
    int layer, n_experts, cap, hidden, inter;
    const cb_st_index *idx;
    cb_expert_location *loc;
    size_t slot_bytes;         /* the largest expert of the layer */
    int *slot_of;              /* expert -> slot, -1 when not resident */
    int *expert_in;            /* slot -> expert, -1 when empty */
    uint64_t *last_use;        /* slot -> tick of the last access */
    void **buf;                /* slot -> buffer, NULL until first used */
    uint64_t tick;
    cb_expert_counters count;
    int staged;                /* expert being prefetched for this layer, -1 when none */
} cb_expert_layer;

/* Locate every expert of one layer. names[m] is a printf format taking (layer, expert) for matrix m in
 * gate, up, down order. cap <= 0 or cap >= n_experts keeps every expert once loaded. */
int cb_experts_init(cb_expert_layer *L, const cb_st_index *idx, int layer, int n_experts, int cap, int hidden,
                    int inter, const char *const names[3], char *err, size_t errlen);
void cb_experts_free(cb_expert_layer *L);

/* Make expert e resident (reading it on a miss, evicting the LRU slot) and return its matrices. The view
 * stays valid until the next cb_experts_get on this layer. */
int cb_experts_get(cb_expert_layer *L, int e, cb_expert_view *view, char *err, size_t errlen);

/* Start reading expert e into the layer's staging buffer on the I/O thread, so the read overlaps compute. A
 * no-op when e is resident, when another prefetch is in flight, or unless COLIBRI_PREFETCH=1. The next
 * cb_experts_get(e) then counts the miss and the read as usual, so counters never depend on prefetching.
 * Only prefetch an expert the caller will get before any other miss on this layer. */
void cb_experts_prefetch(cb_expert_layer *L, int e);
/* Wait for and discard an unconsumed prefetch of this layer (error paths; cb_experts_free does it too). */
void cb_experts_prefetch_cancel(cb_expert_layer *L);
/* Stop the I/O thread (at exit; it restarts on the next prefetch). */
void cb_experts_io_shutdown(void);

/* Bytes of the one staging buffer prefetching uses (0 unless COLIBRI_PREFETCH=1); valid after every init. */
size_t cb_experts_staging_bytes(void);

/* Bytes of the cache at full occupancy. */
size_t cb_experts_cache_bytes(const cb_expert_layer *L);

#endif
