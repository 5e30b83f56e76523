/* test_duel.c: set dueling between LRU and the learned hot set (expert_duel.c), on synthetic routing traces
 * replayed through the real expert store: a greedy loop that exactly fills a small cache after a stretch of skewed
 * text (where the hot set's stale pins lose to LRU), skewed routing (where the hot set beats LRU), the shadows
 * counting exactly what each policy alone hits, and bookkeeping bounded by the slot count. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "experts.h"
#include "safetensors.h"

#define TEST_SEED 0x5eed0fd0e1ULL
#include "check.h"
#include "fixture.h"

enum { HID = 4, INTER = 3, NEXP = 16, CAP = 4, TOPK = 2, MAX_TOKENS = 4096 };

static const char *const NAMES[3] = {"layers.%d.experts.%d.gate_proj", "layers.%d.experts.%d.up_proj",
                                     "layers.%d.experts.%d.down_proj"};

static void write_experts(void) {
    static float data[NEXP][3][HID * INTER];
    static char names[NEXP][3][96];
    fx_tensor t[NEXP * 3];
    int n = 0;
    for (int e = 0; e < NEXP; e++)
        for (int m = 0; m < 3; m++) {
            for (int i = 0; i < HID * INTER; i++) data[e][m][i] = (float)(e * 100 + m * 10 + i);
            snprintf(names[e][m], sizeof names[e][m], NAMES[m], 0, e);
            int64_t r = m == 2 ? HID : INTER, c = m == 2 ? INTER : HID;
            t[n++] = (fx_tensor){names[e][m], "F32", 2, {r, c}, data[e][m], sizeof data[e][m]};
        }
    write_shard("model.safetensors", t, n);
}

/* A token's TOPK distinct experts drawn from a Zipf(1.2) popularity over NEXP (expert 0 the most routed). */
static void skewed_token(int *out) {
    double w[NEXP], total = 0;
    for (int e = 0; e < NEXP; e++) total += w[e] = 1.0 / pow(e + 1, 1.2);
    for (int k = 0; k < TOPK; k++) {
        for (;;) {
            double u = (double)(rnd() >> 11) / 9007199254740992.0 * total;
            int e = 0;
            while (e < NEXP - 1 && u >= w[e]) u -= w[e++];
            int dup = 0;
            for (int j = 0; j < k; j++) dup |= out[j] == e;
            if (!dup) {
                out[k] = e;
                break;
            }
        }
    }
}

/* n tokens of skewed routing, then `loop` tokens of a greedy loop: two tokens repeating, whose four experts (the
 * least routed of the skewed part) exactly fill the CAP-slot cache. Lengths are multiples of the re-pin period,
 * so every replay starts its re-pin count at zero. */
static int make_trace(int *trace, int skewed, int loop) {
    rng_state = TEST_SEED;
    for (int t = 0; t < skewed; t++) skewed_token(trace + t * TOPK);
    static const int cycle[2][TOPK] = {{12, 13}, {14, 15}};
    for (int t = 0; t < loop; t++) memcpy(trace + (skewed + t) * TOPK, cycle[t % 2], sizeof cycle[0]);
    return skewed + loop;
}

typedef struct {
    uint64_t hits, lookups, shadow_hits[CB_DUEL_POLICIES], switches;
} replay_result;

static cb_st_index idx;
static char hotset_path[300];

/* A CAP-slot store (cap: CAP unless given) of the checkpoint under the given pin policy. */
static void open_store(cb_expert_layer *L, int pin, int cap) {
    cb_stream_opts o = cb_stream_defaults();
    o.pin = pin;
    o.hotset_path = hotset_path;
    cb_experts_configure(&o);
    char err[512];
    CHECK(cb_experts_init(L, &idx, 0, NEXP, cap ? cap : CAP, HID, INTER, NAMES, err, sizeof err) == 0, "%s", err);
}

/* One token as the engine serves it: its experts, then the hot set's token count. */
static void feed_token(cb_expert_layer *L, const int *experts) {
    char err[512];
    for (int k = 0; k < TOPK; k++) {
        cb_expert_view v;
        int e = experts[k];
        CHECK(cb_experts_get(L, e, &v, err, sizeof err) == 0, "%s", err);
        CHECK(((const float *)v.m[CB_DOWN].f.w)[1] == (float)(e * 100 + 20 + 1), "expert %d's bytes", e);
    }
    cb_experts_after_tokens(1);
}

/* Replay the trace through a CAP-slot store under the given pin policy. */
static replay_result replay(int pin, const int *trace, int n_tokens) {
    cb_expert_layer L;
    replay_result r = {0};
    open_store(&L, pin, 0);
    for (int t = 0; t < n_tokens; t++) feed_token(&L, trace + t * TOPK);
    r.hits = L.count.hits;
    r.lookups = L.count.hits + L.count.misses;
    memcpy(r.shadow_hits, L.duel.hits, sizeof r.shadow_hits);
    r.switches = L.duel.switches;
    CHECK((pin == CB_PIN_DUEL) == (cb_experts_duel_bytes(&L) > 0), "a partial cache duels only with --pin duel");
    cb_experts_free(&L);
    return r;
}

/* The three policies on one trace; the duel's shadows must count exactly what LRU and the hot set alone hit. */
static void compare(const char *what, const int *trace, int n, replay_result out[3]) {
    out[0] = replay(CB_PIN_OFF, trace, n);
    out[1] = replay(CB_PIN_ON, trace, n);
    out[2] = replay(CB_PIN_DUEL, trace, n);
    printf("%s: %d lookups, hits lru %llu, hot %llu, duel %llu (%llu switches)\n", what, n * TOPK,
           (unsigned long long)out[0].hits, (unsigned long long)out[1].hits, (unsigned long long)out[2].hits,
           (unsigned long long)out[2].switches);
    CHECK(out[2].shadow_hits[CB_DUEL_LRU] == out[0].hits, "%s: LRU shadow %llu, LRU alone %llu", what,
          (unsigned long long)out[2].shadow_hits[CB_DUEL_LRU], (unsigned long long)out[0].hits);
    CHECK(out[2].shadow_hits[CB_DUEL_HOT] == out[1].hits, "%s: hot-set shadow %llu, hot set alone %llu", what,
          (unsigned long long)out[2].shadow_hits[CB_DUEL_HOT], (unsigned long long)out[1].hits);
}

static int trace[MAX_TOKENS * TOPK];

/* The three policies on `skewed` tokens of skewed routing then `loop` tokens of a greedy loop, a trace on which
 * `winner` (0 LRU, 1 the hot set) hits more often than `loser`: the duel must hit at least as often as the winner. */
static void expect_duel_keeps_the_winner(const char *what, int skewed, int loop, int winner, int loser) {
    static const char *const NAME[2] = {"LRU", "the hot set"};
    replay_result r[3];
    int n = make_trace(trace, skewed, loop);
    compare(what, trace, n, r);
    CHECK(r[winner].hits > r[loser].hits, "%s: a case %s wins: %llu hits against %llu", what, NAME[winner],
          (unsigned long long)r[winner].hits, (unsigned long long)r[loser].hits);
    CHECK(r[2].hits >= r[winner].hits, "%s: duel %llu hits, %s %llu", what, (unsigned long long)r[2].hits,
          NAME[winner], (unsigned long long)r[winner].hits);
    CHECK(winner == 1 || r[2].switches >= 1, "%s: the lead went to LRU", what);
}

/* (a) Skewed text, then a greedy loop of two tokens whose experts exactly fill the cache: LRU keeps the loop, the
 * hot set's pins of the text break it until re-pinning catches up; the duel follows LRU once it leads.
 * (b) Skewed routing alone: the decayed counts keep the popular experts that LRU drops after a few one-offs. */
static void test_greedy_loop_and_skew(void) {
    expect_duel_keeps_the_winner("greedy loop", 96, 160, 0, 1);
    expect_duel_keeps_the_winner("skewed", 1024, 0, 1, 0);
}

/* (c) Over a long trace of alternating phases, the shadows hold at most CAP distinct valid experts each, the
 * bookkeeping's bytes never change (a function of the slot count), and the lead stays within its window's bound.
 * A cache of every expert never evicts and keeps no shadows. */
static void test_bounded(void) {
    cb_expert_layer L;
    open_store(&L, CB_PIN_DUEL, 0);
    size_t bytes = cb_experts_duel_bytes(&L);
    CHECK(bytes == (size_t)CAP * (2 * (sizeof(int) + sizeof(uint64_t)) + 1), "%zu bytes of bookkeeping", bytes);
    double max_lead = 0;
    uint64_t lookups = 0;
    for (int phase = 0; phase < 16; phase++) {
        int n = make_trace(trace, phase % 2 ? 64 : 200, phase % 2 ? 200 : 8);
        for (int t = 0; t < n; t++) {
            feed_token(&L, trace + t * TOPK);
            lookups += TOPK;
            if (fabs(L.duel.lead) > max_lead) max_lead = fabs(L.duel.lead);
        }
        for (int p = 0; p < CB_DUEL_POLICIES; p++) {
            int seen[NEXP] = {0}, held = 0;
            for (int s = 0; s < CAP; s++) {
                int e = L.duel.tag[p][s];
                if (e < 0) continue;
                CHECK(e < NEXP && !seen[e], "shadow %d slot %d holds %d", p, s, e);
                if (e < NEXP) seen[e] = 1;
                held++;
            }
            CHECK(held == CAP, "shadow %d holds %d of %d", p, held, CAP);
            CHECK(L.duel.hits[p] <= lookups, "shadow %d: %llu hits of %llu", p, (unsigned long long)L.duel.hits[p],
                  (unsigned long long)lookups);
        }
        CHECK(cb_experts_duel_bytes(&L) == bytes, "bookkeeping grew to %zu", cb_experts_duel_bytes(&L));
    }
    /* |lead| <= sum of DUEL_DECAY^i = 1 / (1 - 0.5^(1/64)) ~ 92.8 */
    CHECK(max_lead <= 93.0, "lead reached %g", max_lead);
    CHECK(L.duel.switches >= 2, "%llu lead changes over alternating phases", (unsigned long long)L.duel.switches);
    cb_experts_free(&L);
    open_store(&L, CB_PIN_DUEL, NEXP);
    CHECK(cb_experts_duel_bytes(&L) == 0 && !L.duel.tag[0], "a cache of every expert keeps no shadows");
    CHECK(!strcmp(cb_experts_policy_name(), "duel"), "policy %s", cb_experts_policy_name());
    cb_experts_free(&L);
}

int main(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/cb-test-duel-XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(hotset_path, sizeof hotset_path, "%s/hotset", tmpdir);
    write_experts();
    char err[512];
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) == 0, "%s", err);
    test_greedy_loop_and_skew();
    test_bounded();
    cb_st_close(&idx);
    cb_experts_io_shutdown();
    clear_tmp();
    rmdir(tmpdir);
    printf("test_duel: %d checks, %d failed\n", checks, failures);
    return failures != 0;
}
