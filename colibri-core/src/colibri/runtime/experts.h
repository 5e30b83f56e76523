/* experts.h: the routed-expert store of one MoE layer, and the streaming machinery around it.
 *
 * Experts stay on disk until a token routes to them. Each layer keeps `cap` slots and evicts the least
 * recently used unpinned expert on a miss. A miss costs ONE read when the expert's gate, up and down matrices
 * are adjacent in the same shard (the layout safetensors gives per-expert tensors), else one read per matrix.
 * A native fp8 expert (matrices with weight_scale_inv companions, fp8.h) counts its three scale tensors as
 * pieces too: one read when all six tile one span, two when the weights and the scales each tile one (the
 * layout safetensors writes, grouping tensors by dtype), else six.
 * Slot buffers are allocated on first use, so a generous cap costs nothing until the experts are touched.
 * Every buffer has the size of the largest expert of any layer (plus direct-I/O alignment slack), so a staged
 * read can be swapped into any slot instead of copied.
 *
 * Streaming (all switchable through cb_stream_opts, none of it changing a bit of any expert or any counter of
 * hits/misses/bytes): an I/O pool of threads reads staged experts (the block's own misses first, then
 * lookahead predictions, each class in file-offset order); reads use O_DIRECT where the filesystem allows
 * (probed per shard) or buffered reads with POSIX_FADV_RANDOM; a learned hot set (see below) replaces LRU.
 *
 * The hot set (the pin option): each expert has a heat, its routing count (rows routed to it) decayed by
 * HEAT_DECAY at every routed row of its layer (half-life ~34 rows: about 4 tokens at top-8, 17 at top-2), seeded
 * at start from the counts a sidecar next to the model kept from earlier runs. Every repin_every tokens the hottest experts are pinned
 * into half the slots (with hysteresis), and a miss evicts the coldest unpinned resident, least recently used
 * among equals. Recency alone (LRU) forgets an expert routed every other token as soon as a few one-off experts
 * pass; long-run counts alone keep experts the current text no longer routes to. The decayed count weighs both;
 * on the skewed benchmark model and on colibri-nano's routing of real code it hits 3-7 points more often than
 * LRU at the same cache size (docs/benchmarks.md).
 *
 * Set dueling (pin = CB_PIN_DUEL, the default of a partial cache): the hot set's weak spot is a greedy loop whose
 * experts exactly fill a small cache, which LRU keeps and pins of earlier text break. Each layer runs LRU and the
 * hot set as shadow tag directories of its own capacity (expert_duel.c), and a miss evicts by whichever shadow hit
 * more over the recent lookups, so each layer gets the better of the two on the workload it sees.
 */
#ifndef COLIBRI_EXPERTS_H
#define COLIBRI_EXPERTS_H

#include <stddef.h>
#include <stdint.h>

#include "fp4.h"
#include "fp8.h"
#include "matrix.h"
#include "qcontainer.h"
#include "quant.h"
#include "safetensors.h"

enum { CB_GATE = 0, CB_UP = 1, CB_DOWN = 2 };

/* A resident expert: gate [inter, hidden], up [inter, hidden], down [hidden, inter], row-major, each in the form the
 * checkpoint stores it (matrix.h); the three always share one kind. */
typedef struct {
    cb_matrix m[3];
} cb_expert_view;

typedef struct {
    int shard[3];              /* shard of each matrix (a split checkpoint may separate them) */
    int single_read;           /* gate/up/down form one contiguous byte span */
    uint64_t span_offset, span_bytes;
    uint64_t offset[3], nbytes[3];
    size_t rel[3];             /* where each matrix starts inside the slot buffer */
    cb_dtype dt[3];            /* CB_MAT_FLOAT only */
    cb_mat_kind kind;          /* CB_MAT_INT: a colibri-quant expert, located by cb_qexperts_locate, always one read */
    const cb_qc_entry *qe[3];  /* the container entries of gate, up, down */
    size_t rel_scales[3];      /* where each matrix's scales start inside the slot buffer (rel[] = levels) */
    /* CB_MAT_FP8 / CB_MAT_FP4: each matrix has a scale tensor (the sc_* fields); the six tensors are one read when
     * they tile one span, two when the weights tile one span and the scales another (safetensors groups tensors
     * by dtype), else six */
    int two_spans;             /* scaled kinds only: weights at span_offset/span_bytes, scales at sc_span_* */
    uint64_t sc_span_offset, sc_span_bytes;
    int sc_shard[3];
    uint64_t sc_offset[3], sc_nbytes[3];
    cb_fp8_scale_kind sc_kind[3];
    int sc_group[3];           /* CB_MAT_I4P: columns per scale */
} cb_expert_location;

/* Whether an expert's matrices come with scale tensors to read (fp8, fp4 and packed int4). */
static inline int cb_expert_scaled(const cb_expert_location *loc) {
    return loc->kind == CB_MAT_FP8 || loc->kind == CB_MAT_FP4 || loc->kind == CB_MAT_I4P;
}

typedef struct {
    uint64_t hits, misses, bytes_read, reads;
} cb_expert_counters;

/* Eviction policy (the pin option): LRU, the learned hot set, or set dueling between the two. */
enum { CB_PIN_OFF = 0, CB_PIN_ON = 1, CB_PIN_DUEL = 2 };

/* Streaming options. The process (engine.c) parses them from its arguments into its own cb_stream_opts and passes
 * them in with cb_experts_configure before the family loads; blocks and the store read them back through
 * cb_experts_options. Nothing parses arguments into this module. */
enum { CB_IO_AUTO = 0, CB_IO_DIRECT = 1, CB_IO_BUFFERED = 2 };
#define CB_IO_THREADS_MAX 8    /* --io-threads upper bound: the queue depths coli tune measures */
typedef struct {
    int prefetch;              /* I/O pool: a block's misses load while its resident experts compute */
    int lookahead;             /* with prefetch: also read the next layer's predicted experts ahead */
    int pin;                   /* CB_PIN_*: learned hot set (pin the most-routed experts, persist counts), alone
                                * or dueling with LRU; any non-zero value runs the hot set's bookkeeping */
    int io_mode;               /* CB_IO_*: auto = direct when the cache cannot hold every expert and the disk allows */
    int moe_union;             /* 1: each expert read once per call and applied to all its rows; 0: row by row */
    int experts_k;             /* lossy: keep at most this many experts per row (0 = the model's top_k) */
    float experts_top_p;       /* lossy: keep the fewest experts whose routing weight reaches this share (0 = off) */
    int repin_every;           /* tokens between hot-set re-pins */
    int io_stages;             /* staging buffers of the I/O pool (0 = 2 x top_k, at least 4) */
    int io_threads;            /* reader threads of the I/O pool and the preload (0 = CBX_IO_THREADS) */
    int preload;               /* read every expert of a cache that holds them all at load (cb_experts_preload) */
    const char *hotset_path;   /* sidecar file; NULL = <model dir>/.colibri-hotset */
} cb_stream_opts;

/* The defaults: every expert read once per MoE call (moe_union), re-pin every 8 tokens, everything else off. */
cb_stream_opts cb_stream_defaults(void);
/* Use these options from now on (copied; hotset_path must outlive the store). Call before the first init. */
void cb_experts_configure(const cb_stream_opts *opts);
const cb_stream_opts *cb_experts_options(void);

/* Cumulative counters of the streaming machinery and time per phase (seconds, wall clock of the main thread). */
typedef struct {
    double io_wait_s, expert_s, attention_s;
    uint64_t prefetch_issued, prefetch_used, prefetch_dropped;   /* dropped: guesses without a free buffer */
    uint64_t lookahead_predicted, lookahead_actual, lookahead_hits;   /* recall = hits / actual */
    uint64_t direct_reads, buffered_reads;
} cb_profile;
extern cb_profile cb_prof;

double cb_now_s(void);

/* Set dueling's shadows of one layer (pin = CB_PIN_DUEL and a partial cache; all NULL otherwise). */
enum { CB_DUEL_LRU = 0, CB_DUEL_HOT = 1, CB_DUEL_POLICIES = 2 };
typedef struct {
    int *tag[CB_DUEL_POLICIES];        /* shadow slot -> expert LRU / the hot set alone would hold there, -1 empty */
    uint64_t *use[CB_DUEL_POLICIES];   /* shadow slot -> tick of its expert's last access */
    unsigned char *keep;               /* real slot -> 1 when the leader's shadow holds it (scratch of a miss) */
    double lead;                       /* decayed (LRU's would-be hits - the hot set's) over the recent lookups */
    uint64_t hits[CB_DUEL_POLICIES];   /* each shadow's would-be hits since init */
    int leader;                        /* CB_DUEL_LRU or CB_DUEL_HOT: whose rule a real miss follows */
    uint64_t switches;                 /* times the lead changed hands */
} cb_expert_duel;

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
    size_t *data_off;          /* slot -> where the expert's bytes start in its buffer (direct-I/O alignment) */
    uint32_t *route_count;     /* expert -> times routed to (what the sidecar keeps across runs) */
    uint64_t *uses;            /* expert -> accesses in this process alone (the stats op's use counts) */
    double *heat;              /* expert -> decayed routing count, in units of heat_unit (hot set only) */
    double heat_unit;          /* what one routed row adds now: grows by 1/HEAT_DECAY per row, so older ones weigh
                                * less without touching every expert (rescaled before it overflows) */
    unsigned char *pinned;     /* expert -> 1 when pinned (its slot is never the victim) */
    int pin_budget;            /* how many experts may be pinned: half the slots when the cache is partial */
    unsigned char *predicted;  /* expert -> 1 when the previous layer's lookahead predicted it */
    int has_prediction;
    char *name_fmt[3];         /* the gate/up/down name formats it was located with (an expert worker locates the same) */
    cb_expert_duel duel;
} cb_expert_layer;

/* Locate every expert of one layer. names[m] is a printf format taking (layer, expert) for matrix m in
 * gate, up, down order. cap <= 0 or cap >= n_experts keeps every expert once loaded. */
int cb_experts_init(cb_expert_layer *L, const cb_st_index *idx, int layer, int n_experts, int cap, int hidden,
                    int inter, const char *const names[3], char *err, size_t errlen);
void cb_experts_free(cb_expert_layer *L);

/* Count one forward pass's routing of this layer: chosen[0..n) the experts its rows chose, row by row (-1: none),
 * into the route count the sidecar keeps and the heat, one routed row at a time as if the pass's tokens had come
 * one by one. A prefill chunk where 40 rows chose e and 2 chose f so leaves e far hotter, where counting each
 * expert once per pass left them equal and the prompt's routing taught the hot set nothing. A MoE block calls it
 * once per pass, before cb_experts_serve; the experts an expert worker computes are counted here too. */
void cb_experts_note_routing(cb_expert_layer *L, const int *chosen, int n);

/* Make expert e resident (reading it on a miss, evicting the LRU slot, the coldest with the hot set, or by the
 * leading shadow's rule when dueling) and return its matrices; its routing was counted by
 * cb_experts_note_routing. The view stays valid until the next cb_experts_serve on this layer. */
int cb_experts_serve(cb_expert_layer *L, int e, cb_expert_view *view, char *err, size_t errlen);

/* One routing of e counted and served: cb_experts_note_routing of a single row, then cb_experts_serve. */
int cb_experts_get(cb_expert_layer *L, int e, cb_expert_view *view, char *err, size_t errlen);

/* Queue a read of expert e into a staging buffer of the I/O pool, so it overlaps compute. A no-op when e is
 * resident or already staged, or unless prefetching is on (the prefetch option, or COLIBRI_PREFETCH=1). The
 * next cb_experts_get(e) then counts the miss and the read as usual, so counters never depend on prefetching.
 * cb_experts_prefetch is urgent (the caller needs e now); cb_experts_predict is a guess (lookahead), served
 * after every urgent read and the first to give its buffer up when the pool is full. */
int cb_experts_prefetch(cb_expert_layer *L, int e);   /* 1 = resident or queued, 0 = no free buffer (or off) */
void cb_experts_predict(cb_expert_layer *L, int e);
/* Forget this layer's guesses still waiting in the queue that its router did not choose (wanted[e] == 0), once it
 * has chosen: a wrong guess left there would be read before the next layer's guesses, which sort after it. */
void cb_experts_drop_guesses(cb_expert_layer *L, const int *wanted);
/* Wait for and discard every staged read of this layer (error paths; cb_experts_free does it too). */
void cb_experts_prefetch_cancel(cb_expert_layer *L);
/* Stop the I/O threads and free the staging buffers (at exit; they restart on the next prefetch). */
void cb_experts_io_shutdown(void);

/* Size the staging pool from the largest top_k of any MoE layer (cb_moe_init calls this), unless
 * the io_stages option says how many buffers the RAM plan left for it. */
void cb_experts_hint_top_k(int top_k);
/* Bytes of the staging buffers prefetching uses (0 when it is off); valid after every init. */
size_t cb_experts_staging_bytes(void);

/* Hot set: count n more tokens; every repin_every tokens re-pin each layer (with hysteresis) and
 * now and then save the sidecar. No-op unless the pin option is on. */
void cb_experts_after_tokens(int n);
/* Write the sidecar now (at exit). Returns 0, or -1 with a message (the caller reports it as a notice). */
int cb_experts_save_hotset(char *err, size_t errlen);
/* What happened to the sidecar at start: "none", "loaded", "ignored: ..." (for the ready event). */
const char *cb_experts_hotset_status(void);
/* Experts pinned across all layers, and the effective read mode ("direct", "buffered", "mixed"). */
int cb_experts_pinned_total(void);
const char *cb_experts_io_name(void);

/* Read every expert of each layer whose (still empty) cache holds them all, on the I/O threads in layer and
 * expert order, before the first token: a model that fits then costs its reads at load, as llama.cpp's populated
 * mmap does, instead of slowing its first requests. Counted in reads and bytes_read (*bytes: this call's), never as
 * hits or misses. Partial caches are left to stream. Returns 0, or -1 with the failed read's message. */
int cb_experts_preload(uint64_t *bytes, char *err, size_t errlen);

/* The policy in effect ("lru", "hot", "duel": what the stats carry), and how many layers LRU leads when dueling. */
const char *cb_experts_policy_name(void);
int cb_experts_duel_lru_layers(void);
/* Which shadow leads layer L now (CB_DUEL_LRU or CB_DUEL_HOT; the hot set on a tie), and the bytes its dueling
 * bookkeeping holds: a function of the slot count alone, 0 when the layer does not duel. */
int cb_experts_duel_leader(const cb_expert_layer *L);
size_t cb_experts_duel_bytes(const cb_expert_layer *L);

/* Bytes of the cache at full occupancy. */
size_t cb_experts_cache_bytes(const cb_expert_layer *L);

#endif
