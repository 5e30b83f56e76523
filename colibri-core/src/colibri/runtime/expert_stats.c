/* expert_stats.c: what a dashboard's heatmap needs from the expert store, written as stats fields.
 *
 * Kept apart from engine.c so the stats op stays one call, and from expert_store.c so the store's hot path has
 * no JSON in it. Reading the arrays between steps is safe: the engine answers stats on its main thread, which is
 * the only one that changes slot_of, pinned and uses (the I/O threads only fill staging buffers). */
#include "expert_stats.h"

static int residency(const cb_expert_layer *L, int e) {
    if (L->slot_of[e] < 0) return 0;
    return L->pinned[e] ? 2 : 1;
}

void cb_experts_put_maps(cb_buf *b, cb_expert_layer *const *layers, int n_layers) {
    cb_buf_puts(b, ",\"experts\":[");
    for (int i = 0; i < n_layers; i++) cb_buf_printf(b, "%s%d", i ? "," : "", layers[i]->n_experts);
    cb_buf_puts(b, "],\"cache_slots\":[");
    for (int i = 0; i < n_layers; i++) cb_buf_printf(b, "%s%d", i ? "," : "", layers[i]->cap);
    for (int field = 0; field < 2; field++) {
        cb_buf_puts(b, field ? "],\"resident\":[" : "],\"uses\":[");
        for (int i = 0; i < n_layers; i++) {
            const cb_expert_layer *L = layers[i];
            cb_buf_puts(b, i ? ",[" : "[");
            for (int e = 0; e < L->n_experts; e++) {
                if (field) cb_buf_printf(b, "%s%d", e ? "," : "", residency(L, e));
                else cb_buf_printf(b, "%s%llu", e ? "," : "", (unsigned long long)L->uses[e]);
            }
            cb_buf_puts(b, "]");
        }
    }
    cb_buf_puts(b, "]");
    int dueling = 0;
    for (int i = 0; i < n_layers; i++) dueling |= layers[i]->duel.keep != NULL;
    if (!dueling) return;
    /* What each policy alone would have hit on the same lookups: set dueling's shadows, per layer. */
    for (int p = 0; p < CB_DUEL_POLICIES; p++) {
        cb_buf_puts(b, p == CB_DUEL_LRU ? ",\"shadow_lru_hits\":[" : ",\"shadow_hot_hits\":[");
        for (int i = 0; i < n_layers; i++)
            cb_buf_printf(b, "%s%llu", i ? "," : "", (unsigned long long)layers[i]->duel.hits[p]);
        cb_buf_puts(b, "]");
    }
}
