/* expert_duel.c: set dueling between LRU and the learned hot set (experts.h, --pin duel).
 *
 * Each layer keeps two shadow tag directories of its cache's capacity: the experts LRU alone would hold and those
 * the hot set alone would hold, fed by the same lookups as the real cache (tags and last-access ticks only, no
 * expert bytes). A decayed lead counts which shadow hit more over the last ~DUEL_WINDOW lookups, and a real miss
 * evicts by the leader's rule, preferring a resident the leader's shadow no longer holds: while one policy keeps
 * the lead the real cache becomes its shadow, so it hits exactly as often as that policy alone would. The hot set
 * leads at start (the sidecar's counts make it right from the first token); LRU takes over only when its shadow
 * is DUEL_MARGIN hits ahead, and hands back the same way.
 *
 * Per layer, not per store: the layers' caches are separate and their routing differs (the routing study's last
 * layer is far more skewed than its first), so each layer follows the policy that serves its own lookups.
 * Called on the thread that calls cb_experts_get (the store's only mutator); nothing here allocates after init. */
#include "experts_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A shadow's hit loses half its weight over 64 lookups: about 8 tokens of a top-8 layer, 32 of a top-2 one, so a
 * greedy loop of a few tokens wins the lead within one or two passes and a phase of skewed routing wins it back.
 * Half-lives of 10-14 lookups gained up to 0.8 points on nano's greedy loops in the engine but lost 0.1-0.2 on its
 * held-out text, and flip on test_duel's skewed trace below this margin (docs/benchmarks.md, set dueling). */
#define DUEL_DECAY 0.98922801319397     /* 0.5 ** (1 / 64): a half-life of 64 lookups */
#define DUEL_FLUSH 1e-9      /* a lead this close to zero is a tie (and never decays into subnormals) */
/* The lead changes hands only past this many recent would-be hits: on skewed routing LRU wins a lookup here and
 * there by luck, and following it for those few lookups breaks the hot set's residents (measured in test_duel). */
#define DUEL_MARGIN 2.0

int cbx_duel_init(cb_expert_layer *L) {
    cb_expert_duel *d = &L->duel;
    for (int p = 0; p < CB_DUEL_POLICIES; p++) {
        d->tag[p] = malloc((size_t)L->cap * sizeof(int));
        d->use[p] = calloc((size_t)L->cap, sizeof(uint64_t));
        if (!d->tag[p] || !d->use[p]) return -1;
        for (int s = 0; s < L->cap; s++) d->tag[p][s] = -1;
    }
    d->leader = CB_DUEL_HOT;   /* until LRU proves better: the sidecar's counts make the hot set right from the start */
    d->keep = calloc((size_t)L->cap, 1);
    return d->keep ? 0 : -1;
}

void cbx_duel_free(cb_expert_layer *L) {
    cb_expert_duel *d = &L->duel;
    for (int p = 0; p < CB_DUEL_POLICIES; p++) {
        free(d->tag[p]);
        free(d->use[p]);
    }
    free(d->keep);
    memset(d, 0, sizeof *d);
}

size_t cb_experts_duel_bytes(const cb_expert_layer *L) {
    if (!L->duel.keep) return 0;
    return (size_t)L->cap * (CB_DUEL_POLICIES * (sizeof(int) + sizeof(uint64_t)) + 1);
}

int cb_experts_duel_leader(const cb_expert_layer *L) { return L->duel.leader; }

/* One lookup of e in shadow p: 1 on a would-be hit; on a would-be miss e takes the slot p's own rule evicts. */
static int shadow_touch(cb_expert_layer *L, int p, int e, uint64_t now) {
    int *tag = L->duel.tag[p];
    uint64_t *use = L->duel.use[p];
    for (int s = 0; s < L->cap; s++)
        if (tag[s] == e) {
            use[s] = now;
            return 1;
        }
    int s = cbx_victim(L, tag, use, L->cap, p == CB_DUEL_HOT, NULL);
    if (s < 0) s = 0;   /* every slot pinned: only a budget of every slot could do it, and it is at most half */
    tag[s] = e;
    use[s] = now;
    return 0;
}

void cbx_duel_observe(cb_expert_layer *L, int e, uint64_t now) {
    cb_expert_duel *d = &L->duel;
    int lru = shadow_touch(L, CB_DUEL_LRU, e, now), hot = shadow_touch(L, CB_DUEL_HOT, e, now);
    d->hits[CB_DUEL_LRU] += (uint64_t)lru;
    d->hits[CB_DUEL_HOT] += (uint64_t)hot;
    d->lead = d->lead * DUEL_DECAY + (double)(lru - hot);
    if (fabs(d->lead) < DUEL_FLUSH) d->lead = 0;
    int leader = d->lead > DUEL_MARGIN ? CB_DUEL_LRU : d->lead < -DUEL_MARGIN ? CB_DUEL_HOT : d->leader;
    if (leader != d->leader) {
        d->leader = leader;
        d->switches++;
    }
}

int cbx_duel_victim(cb_expert_layer *L) {
    cb_expert_duel *d = &L->duel;
    int leader = cb_experts_duel_leader(L);
    const int *shadow = d->tag[leader];
    memset(d->keep, 0, (size_t)L->cap);
    for (int s = 0; s < L->cap; s++)
        if (shadow[s] >= 0 && L->slot_of[shadow[s]] >= 0) d->keep[L->slot_of[shadow[s]]] = 1;
    int by_heat = leader == CB_DUEL_HOT;
    int s = cbx_victim(L, L->expert_in, L->last_use, L->cap, by_heat, d->keep);
    if (s < 0) s = cbx_victim(L, L->expert_in, L->last_use, L->cap, by_heat, NULL);
    return s < 0 ? 0 : s;
}
