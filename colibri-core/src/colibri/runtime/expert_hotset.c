/* expert_hotset.c: the learned hot set (experts.h): each expert's decayed routing count, the pins re-chosen every
 * repin_every tokens, and the sidecar that keeps the counts across runs. */
#include "experts_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define HEAT_DECAY 0.98           /* per routed row of the layer; see experts.h (measured best of 0.97-0.985) */
#define HEAT_RESCALE 1e100        /* heat_unit beyond this: divide every heat and the unit by it */
#define PIN_MARGIN 1.25           /* an outsider replaces the coldest pinned expert only when this much hotter */

static int tokens_since_repin, repins;
static char hotset_status[1400] = "none";
static int hotset_loaded;

const char *cb_experts_hotset_status(void) { return hotset_status; }

int cb_experts_pinned_total(void) {
    int n = 0;
    for (int i = 0; i < cbx_n_live; i++)
        for (int e = 0; e < cbx_live[i]->n_experts; e++) n += cbx_live[i]->pinned[e];
    return n;
}

/* One more routed row of e: its heat grows by the current unit, and the unit grows so that every earlier row
 * weighs HEAT_DECAY times less than this one. */
void cbx_warm_up(cb_expert_layer *L, int e) {
    L->heat[e] += L->heat_unit;
    L->heat_unit /= HEAT_DECAY;
    if (L->heat_unit > HEAT_RESCALE) {
        for (int x = 0; x < L->n_experts; x++) L->heat[x] /= HEAT_RESCALE;
        L->heat_unit /= HEAT_RESCALE;
    }
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
    if (cb_experts_options()->hotset_path) {
        snprintf(out, n, "%s", cb_experts_options()->hotset_path);
        return;
    }
    const char *first = cbx_shards_index() ? cbx_shards_index()->shard_paths[0] : "";
    const char *slash = strrchr(first, '/');
    int dir = slash ? (int)(slash - first) : 1;
    snprintf(out, n, "%.*s/.colibri-hotset", dir, slash ? first : ".");
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
    if (!cbx_shards_index()) return;
    char path[1024];
    sidecar_path(path, sizeof path);
    FILE *f = fopen(path, "r");
    if (!f) return;
    char magic[32];
    int version = 0;
    unsigned long long key = 0;
    uint64_t want = model_key(cbx_shards_index());
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
            cb_expert_layer *L = cbx_layer_no(layer);
            for (int e = 0; e < n; e++) {
                unsigned long c = 0;
                if (fscanf(f, "%lu", &c) != 1) break;
                if (L && e < L->n_experts) L->route_count[e] = (uint32_t)c;
            }
        }
        snprintf(hotset_status, sizeof hotset_status, "loaded");
        for (int i = 0; i < cbx_n_live; i++) {
            seed_heat(cbx_live[i]);
            repin_layer(cbx_live[i]);
        }
    }
    if (strncmp(hotset_status, "ignored", 7) == 0) fprintf(stderr, "notice: hot set %s\n", hotset_status);
    fclose(f);
}

int cb_experts_save_hotset(char *err, size_t errlen) {
    if (!cb_experts_options()->pin || !cbx_shards_index() || !cbx_n_live) return 0;
    char path[1024], tmp[1100];
    sidecar_path(path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) {
        snprintf(err, errlen, "cannot write the hot set %s: %s", tmp, strerror(errno));
        return -1;
    }
    fprintf(f, "%s %d key %016llx\n", HOTSET_MAGIC, HOTSET_VERSION, (unsigned long long)model_key(cbx_shards_index()));
    for (int layer = 0, done = 0; done < cbx_n_live; layer++) {
        cb_expert_layer *L = cbx_layer_no(layer);
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
    if (!cb_experts_options()->pin || !cbx_n_live) return;
    if (!hotset_loaded) load_hotset();
    tokens_since_repin += n;
    int every = cb_experts_options()->repin_every > 0 ? cb_experts_options()->repin_every : 8;
    if (tokens_since_repin < every) return;
    tokens_since_repin = 0;
    for (int i = 0; i < cbx_n_live; i++) repin_layer(cbx_live[i]);
    if (++repins % 16 == 0) {
        char err[512];
        if (cb_experts_save_hotset(err, sizeof err)) fprintf(stderr, "notice: %s\n", err);
    }
}

