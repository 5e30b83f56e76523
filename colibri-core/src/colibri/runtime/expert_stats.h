/* expert_stats.h: the expert store's per-expert picture for the stats op (use counts and cache residency). */
#ifndef COLIBRI_EXPERT_STATS_H
#define COLIBRI_EXPERT_STATS_H

#include "experts.h"
#include "json.h"

/* Append the per-layer arrays `experts` (experts in the layer), `cache_slots` (its cache's slots), `uses`
 * (per expert: accesses in this process) and `resident` (per expert: 0 on disk, 1 in the cache, 2 in the cache
 * and pinned by the hot set) as JSON fields (each preceded by a comma), in the order of `layers`; when set dueling
 * runs, also `shadow_lru_hits` and `shadow_hot_hits` (per layer: what LRU / the hot set alone would have hit). */
void cb_experts_put_maps(cb_buf *b, cb_expert_layer *const *layers, int n_layers);

#endif
