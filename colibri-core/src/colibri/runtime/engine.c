/* engine.c: the engine process every family shares: arguments, the JSON-lines protocol (docs/protocol.md),
 * KV slots, scheduling and stats. The family only loads weights and runs forward passes (engine.h).
 *
 * Scheduling: one thread of control. Each round gives every prefilling sequence one prompt chunk, then every
 * decoding sequence one token: together in one batched forward (cb_family.forward_batch, up to the prefill chunk's
 * rows at a time) when two or more decode and the family has one, so an expert several of them chose is read once
 * per layer; else one forward per slot. stdin is polled between steps so a cancel lands within one step.
 */
#include "engine.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "expert_remote.h"
#include "expert_stats.h"
#include "expert_worker.h"
#include "decide.h"
#include "events.h"
#include "json.h"
#include "kernels.h"
#include "kv_file.h"
#include "logits_procs.h"
#include "sampler.h"

/* Prompt tokens per forward pass unless --prefill-chunk says otherwise. Chunking never changes a bit (every block
 * gives each row what it would get alone); a bigger chunk reads each routed expert once for more rows, which is
 * what matters when experts stream from disk, at the price of scratch that grows with it. */
#define DEFAULT_PREFILL_CHUNK 32
#define MAX_LINE ((size_t)16 << 20)
#define ERRLEN 512
#define KV_PATH_MAX 4096

/* SEQ_AWAIT_MASK: constrained decoding; the step's logits are held until the caller's "mask" arrives. */
typedef enum { SEQ_IDLE = 0, SEQ_PREFILL, SEQ_DECODE, SEQ_AWAIT_MASK } seq_phase;

typedef struct {
    cb_kv kv;
    int *tokens;               /* the tokens whose KV this slot holds */
    int n_tokens;
    /* the sequence running in the slot, if any */
    seq_phase phase;
    int64_t id;
    int *prompt, prompt_len, next, reused;
    int max_tokens, generated, want_logits;   /* want_logits: 0 none, LOGITS_TEXT or LOGITS_F32 */
    int *stop, n_stop;
    int *forced, n_forced;
    int pending;               /* the token the next decode step feeds */
    float *snap;               /* recurrent state checkpoint at the end of the last prefilled prompt */
    int snap_pos;              /* tokens it covers; 0 = none */
    cb_sampler sampler;
    cb_procs procs;            /* penalties, bias, mask, logprobs (logits_procs.h) */
    cb_decide decide;          /* a decide request's marks and options (n_marks 0: a generation) */
    char *kv_save;             /* where to save the slot's state when the sequence ends ("kv_save"), or NULL */
    char kv_identity[CB_KV_IDENTITY_LEN + 1];   /* the request's "kv_identity", written into the saved file */
    double prefill_s, decode_s;
    int decode_steps;
    int batched_steps;         /* decode steps taken in one forward with other sequences */
    cb_expert_counters count;  /* expert traffic of this sequence's forward passes */
    cb_profile prof;           /* streaming counters and phase times of this sequence's forward passes */
    double forward_s;
    /* The same three when the prompt was done: done's "decode" object is the difference, so a benchmark gets the
     * decode phase's hit rate, bytes and time split without the prefill's (which reads most experts once). */
    cb_expert_counters prefill_count;
    cb_profile prefill_prof;
    double prefill_forward_s;
    cb_remote_counters net, prefill_net;   /* expert-worker traffic of this sequence, and at the prompt's end */
} slot_t;

typedef struct {
    const cb_family *fam;
    void *model;
    cb_model_info info;
    int ctx, n_slots, cap, threads, prefill_chunk;
    cb_stream_opts stream;     /* parsed here, handed to the expert store once (cb_experts_configure) */
    const char *expert_map;    /* --expert-map: routed experts held by expert workers (expert_remote.h) */
    int expert_timeout_ms, expert_wait_s;
    slot_t *slots;
    slot_t **batch;            /* n_slots: the sequences of a batched decode step */
    cb_kv **batch_kv;
    int *batch_tokens, *batch_pos;
    float *logits;             /* prefill_chunk x vocab */
    void *sample_work;
    cb_buf out;
    char *in;
    size_t in_len, in_cap;
    int in_eof, discarding, shutdown;
    uint64_t prefilled_total, generated_total, decides;
} engine_t;

/* ---- small helpers ---- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

size_t cb_rss_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return 0;
    unsigned long size = 0, resident = 0;
    int ok = fscanf(f, "%lu %lu", &size, &resident) == 2;
    fclose(f);
    long page = sysconf(_SC_PAGESIZE);
    return ok && page > 0 ? (size_t)resident * (size_t)page : 0;
}

static void emit(engine_t *E) { cb_emit_line(&E->out); }

static void emit_error(engine_t *E, int has_id, int64_t id, const char *code, const char *message) {
    cb_emit_error(&E->out, has_id, id, code, message);
}

static void emit_fatal(const char *code, const char *message) { cb_emit_fatal(code, message); }

static void put_float(cb_buf *b, double v) {
    if (isfinite(v)) cb_buf_printf(b, "%.9g", v);
    else cb_buf_puts(b, "null");
}

enum { LOGITS_TEXT = 1, LOGITS_F32 = 2 };

/* A logits row as base64 of its little-endian IEEE float32 bytes ("logits": "f32"): exact, about 5.3 characters
 * per value instead of ~15, and no float printing or parsing on either side (docs/protocol.md). */
static void put_f32_base64(cb_buf *b, const float *row, int n) {
    static const char digits[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char chunk[4096];
    size_t used = 0, total = (size_t)n * 4;
    unsigned char three[3];
    size_t k = 0;
    for (size_t i = 0; i < total; i++) {
        uint32_t bits;
        memcpy(&bits, &row[i / 4], 4);
        three[k++] = (unsigned char)(bits >> (8 * (i % 4)));   /* byte i%4 of the value, least significant first */
        if (k < 3 && i + 1 < total) continue;
        for (size_t j = k; j < 3; j++) three[j] = 0;
        chunk[used++] = digits[three[0] >> 2];
        chunk[used++] = digits[((three[0] & 3) << 4) | (three[1] >> 4)];
        chunk[used++] = k > 1 ? digits[((three[1] & 15) << 2) | (three[2] >> 6)] : '=';
        chunk[used++] = k > 2 ? digits[three[2] & 63] : '=';
        k = 0;
        if (used + 4 > sizeof chunk) {
            cb_buf_put(b, chunk, used);
            used = 0;
        }
    }
    cb_buf_put(b, chunk, used);
}

static cb_expert_counters total_counters(const engine_t *E) {
    cb_expert_counters c = {0};
    for (int i = 0; i < E->info.n_expert_layers; i++) {
        const cb_expert_counters *l = &E->info.expert_layers[i]->count;
        c.hits += l->hits;
        c.misses += l->misses;
        c.bytes_read += l->bytes_read;
        c.reads += l->reads;
    }
    return c;
}

static void put_counters(cb_buf *b, const cb_expert_counters *c) {
    uint64_t acc = c->hits + c->misses;
    cb_buf_printf(b, ",\"expert_hits\":%llu,\"expert_misses\":%llu,\"hit_rate\":", (unsigned long long)c->hits,
                  (unsigned long long)c->misses);
    put_float(b, acc ? (double)c->hits / (double)acc : 0.0);
    cb_buf_printf(b, ",\"bytes_read\":%llu,\"reads\":%llu", (unsigned long long)c->bytes_read,
                  (unsigned long long)c->reads);
}

static void remote_delta(cb_remote_counters *acc, const cb_remote_counters *after, const cb_remote_counters *before) {
#define DELTA(f) acc->f += after->f - before->f
    DELTA(messages); DELTA(rows); DELTA(experts); DELTA(bytes_sent); DELTA(bytes_received); DELTA(layer_round_trips);
    DELTA(failures); DELTA(fallback_experts);
#undef DELTA
}

static void add_profile(cb_profile *acc, const cb_profile *after, const cb_profile *before) {
    acc->io_wait_s += after->io_wait_s - before->io_wait_s;
    acc->expert_s += after->expert_s - before->expert_s;
    acc->attention_s += after->attention_s - before->attention_s;
#define DELTA(f) acc->f += after->f - before->f
    DELTA(prefetch_issued); DELTA(prefetch_used); DELTA(prefetch_dropped); DELTA(lookahead_predicted);
    DELTA(lookahead_actual); DELTA(lookahead_hits); DELTA(direct_reads); DELTA(buffered_reads);
#undef DELTA
}

/* The streaming switches and lossy knobs in effect, as JSON fields (ready, done and stats carry them). */
static void put_streaming(cb_buf *b) {
    const cb_stream_opts *o = cb_experts_options();
    cb_buf_printf(b, ",\"prefetch\":%s,\"lookahead\":%s,\"pin\":%s,\"io\":\"%s\",\"moe_union\":%s,"
                  "\"pinned_experts\":%d", o->prefetch ? "true" : "false",
                  o->prefetch && o->lookahead ? "true" : "false", o->pin ? "true" : "false",
                  cb_experts_io_name(),
                  o->moe_union ? "true" : "false", cb_experts_pinned_total());
    cb_buf_printf(b, ",\"policy\":\"%s\"", cb_experts_policy_name());
    if (o->pin == CB_PIN_DUEL) cb_buf_printf(b, ",\"duel_lru_layers\":%d", cb_experts_duel_lru_layers());
    if (o->experts_k > 0 || o->experts_top_p > 0) {
        cb_buf_puts(b, ",\"lossy\":\"");
        if (o->experts_k > 0) cb_buf_printf(b, "experts-k=%d", o->experts_k);
        if (o->experts_k > 0 && o->experts_top_p > 0) cb_buf_puts(b, " ");
        if (o->experts_top_p > 0) cb_buf_printf(b, "experts-top-p=%g", (double)o->experts_top_p);
        cb_buf_puts(b, "\"");
    }
}

static void put_profile(cb_buf *b, const cb_profile *p, double forward_s) {
    double other = forward_s - p->io_wait_s - p->expert_s - p->attention_s;
    cb_buf_puts(b, ",\"io_wait_s\":");
    put_float(b, p->io_wait_s);
    cb_buf_puts(b, ",\"expert_s\":");
    put_float(b, p->expert_s);
    cb_buf_puts(b, ",\"attention_s\":");
    put_float(b, p->attention_s);
    cb_buf_puts(b, ",\"other_s\":");
    put_float(b, other > 0 ? other : 0.0);
    cb_buf_printf(b, ",\"prefetch_issued\":%llu,\"prefetch_used\":%llu,\"prefetch_dropped\":%llu",
                  (unsigned long long)p->prefetch_issued, (unsigned long long)p->prefetch_used,
                  (unsigned long long)p->prefetch_dropped);
    cb_buf_puts(b, ",\"lookahead_recall\":");
    if (p->lookahead_actual) put_float(b, (double)p->lookahead_hits / (double)p->lookahead_actual);
    else cb_buf_puts(b, "null");
}

/* ---- sequences ---- */

static void seq_clear(slot_t *s) {
    free(s->prompt);
    free(s->stop);
    free(s->forced);
    free(s->kv_save);
    s->kv_save = NULL;
    s->prompt = s->stop = s->forced = NULL;
    cb_procs_free(&s->procs);
    cb_decide_free(&s->decide);
    s->phase = SEQ_IDLE;
}

static cb_kv_geometry kv_geometry(const engine_t *E, const char *identity) {
    cb_kv_geometry g = {E->fam->name, identity, E->info.n_layers, E->info.kv_dim, E->info.kv_k_only, E->ctx,
                        E->info.state_bytes};
    return g;
}

/* The end of a sequence saves the slot when asked: every fed token (the last sampled one is not fed yet), the
 * state at exactly that length, and the end-of-prompt checkpoint. A failed save is a warning in done, never an
 * error: the answer is already out. */
static void save_slot(engine_t *E, slot_t *s, cb_buf *b) {
    if (!s->kv_save || s->n_tokens < 1) return;
    char err[ERRLEN];
    cb_kv_geometry g = kv_geometry(E, s->kv_identity);
    size_t bytes = cb_kv_file_save(s->kv_save, &g, &s->kv, s->tokens, s->n_tokens, s->snap, s->snap_pos, err,
                                   sizeof err);
    if (bytes) {
        cb_buf_printf(b, ",\"kv_saved_tokens\":%d,\"kv_saved_bytes\":%zu", s->n_tokens, bytes);
    } else {
        fprintf(stderr, "warning: %s\n", err);
        cb_buf_puts(b, ",\"kv_warning\":");
        cb_buf_json_str(b, err);
    }
}

/* "kv_load": take the slot's prefix from a saved file when it beats what the slot holds. Returns the tokens now
 * reusable (at least `reuse`, the in-memory answer); on any failure the slot's prefix is forgotten (0) and `warn`
 * says why. The recurrent state restores only at the saved length or at the saved checkpoint, never in between. */
static int load_slot(engine_t *E, slot_t *s, const char *path, const char *identity, const int *prompt, int keep,
                     int reuse, int *loaded, char *warn) {
    cb_kv_geometry g = kv_geometry(E, identity);
    cb_kv_file f;
    *loaded = 0;
    if (cb_kv_file_open(&f, path, &g, warn, ERRLEN)) return reuse;
    int common = 0;
    while (common < f.n_tokens && common < keep && f.tokens[common] == prompt[common]) common++;
    int usable = common;
    if (s->kv.state) usable = common == f.n_tokens ? common : f.snap_pos && f.snap_pos <= common ? f.snap_pos : 0;
    if (usable <= reuse) {
        cb_kv_file_close(&f);
        return reuse;
    }
    if (cb_kv_file_read(&f, &g, &s->kv, s->kv.state, s->snap, warn, ERRLEN)) {
        cb_kv_file_close(&f);
        s->n_tokens = 0;
        s->snap_pos = 0;
        return 0;
    }
    memcpy(s->tokens, f.tokens, (size_t)f.n_tokens * sizeof(int));
    s->n_tokens = f.n_tokens;
    if (s->kv.state) {
        if (usable == f.n_tokens) {
            s->snap_pos = f.snap_pos;
        } else {
            memcpy(s->kv.state, s->snap, E->info.state_bytes);
            s->snap_pos = usable;
        }
    }
    cb_kv_file_close(&f);
    *loaded = usable;
    return usable;
}

static void finish(engine_t *E, slot_t *s, const char *reason) {
    cb_buf *b = &E->out;
    E->decides += !strcmp(reason, "decided");
    cb_buf_printf(b, "{\"ev\":\"done\",\"id\":%lld,\"reason\":\"%s\",\"prompt_tokens\":%d,"
                     "\"prefilled_tokens\":%d,\"generated_tokens\":%d,\"prefill_tps\":",
                  (long long)s->id, reason, s->prompt_len, s->next - s->reused, s->generated);
    put_float(b, s->prefill_s > 0 ? (double)(s->next - s->reused) / s->prefill_s : 0.0);
    cb_buf_puts(b, ",\"decode_tps\":");
    put_float(b, s->decode_s > 0 ? (double)s->decode_steps / s->decode_s : 0.0);
    put_counters(b, &s->count);
    put_streaming(b);
    put_profile(b, &s->prof, s->forward_s);
    if (cb_remote_active()) cb_remote_put_counters(b, &s->net);
    cb_expert_counters dc = {s->count.hits - s->prefill_count.hits, s->count.misses - s->prefill_count.misses,
                             s->count.bytes_read - s->prefill_count.bytes_read,
                             s->count.reads - s->prefill_count.reads};
    cb_profile dp = {0};
    add_profile(&dp, &s->prof, &s->prefill_prof);
    cb_buf_printf(b, ",\"batched_steps\":%d,\"decode\":{\"steps\":%d", s->batched_steps, s->decode_steps);
    put_counters(b, &dc);
    put_profile(b, &dp, s->forward_s - s->prefill_forward_s);
    if (cb_remote_active()) {
        cb_remote_counters dn = {0};
        remote_delta(&dn, &s->net, &s->prefill_net);
        cb_remote_put_counters(b, &dn);
    }
    cb_buf_puts(b, "}");
    save_slot(E, s, b);
    cb_buf_printf(b, ",\"rss_bytes\":%zu}", cb_rss_bytes());
    emit(E);
    seq_clear(s);
}

/* The process-wide traffic counters and the clock, taken around a forward pass. */
typedef struct {
    cb_expert_counters count;
    cb_profile prof;
    cb_remote_counters net;
    double t;
} traffic_t;

static traffic_t traffic_now(const engine_t *E) {
    traffic_t t = {total_counters(E), cb_prof, cb_remote_totals(), now_s()};
    return t;
}

/* Share `i` of `of` of a counter's growth: equal parts, the remainder to the first shares, so the parts add up. */
static uint64_t share(uint64_t after, uint64_t before, int i, int of) {
    uint64_t d = after - before, q = d / (uint64_t)of, r = d % (uint64_t)of;
    return q + ((uint64_t)i < r);
}

/* Charge sequence s with its part of a forward pass it ran in with of - 1 others: its wall time and phase times
 * in full (each one waited for the whole pass), the expert and network traffic in equal shares (so the requests'
 * counts add up to the engine's). `done` holds the time and phases at the pass's end. */
static void charge(slot_t *s, const traffic_t *before, const traffic_t *done, const traffic_t *after, int i, int of) {
    s->forward_s += done->t - before->t;
    add_profile(&s->prof, &done->prof, &before->prof);
    s->count.hits += share(after->count.hits, before->count.hits, i, of);
    s->count.misses += share(after->count.misses, before->count.misses, i, of);
    s->count.bytes_read += share(after->count.bytes_read, before->count.bytes_read, i, of);
    s->count.reads += share(after->count.reads, before->count.reads, i, of);
#define SHARE(f) s->net.f += share(after->net.f, before->net.f, i, of)
    SHARE(messages); SHARE(rows); SHARE(experts); SHARE(bytes_sent); SHARE(bytes_received);
    SHARE(layer_round_trips); SHARE(failures); SHARE(fallback_experts);
#undef SHARE
}

static void note_fed(slot_t *s, const int *tokens, int n) {
    memcpy(s->tokens + s->n_tokens, tokens, (size_t)n * sizeof(int));
    s->n_tokens += n;
}

static int forward(engine_t *E, slot_t *s, const int *tokens, int n, int all_logits, char *err) {
    traffic_t before = traffic_now(E);
    if (E->fam->forward(E->model, &s->kv, tokens, n, s->n_tokens, E->logits, all_logits, err, ERRLEN)) return -1;
    traffic_t done = traffic_now(E);
    cb_experts_after_tokens(n);
    traffic_t after = traffic_now(E);
    charge(s, &before, &done, &after, 0, 1);
    note_fed(s, tokens, n);
    return 0;
}

/* Sample from logits (or take the teacher-forced token), emit it, and either finish the sequence or queue the
   token for the next step. A forced token is reported and stop-checked like a sampled one: the caller sees the
   sequence the model was actually fed. */
static void take_token(engine_t *E, slot_t *s, const float *logits) {
    if (cb_procs_waits(&s->procs, logits)) {
        s->phase = SEQ_AWAIT_MASK;
        return;
    }
    char err[ERRLEN];
    /* A forced step is sampled too, so the processors' distribution (`dist`) and the RNG advance as in a free run */
    int tok = cb_procs_sample(&s->procs, &s->sampler, logits, E->sample_work, err, sizeof err);
    if (tok < 0) {
        emit_error(E, 1, s->id, "bad_request", err);
        seq_clear(s);
        return;
    }
    if (s->generated < s->n_forced) tok = s->forced[s->generated];
    if (s->procs.dist) {
        cb_buf_printf(&E->out, "{\"ev\":\"dist\",\"id\":%lld,\"step\":%d,\"logits\":\"", (long long)s->id,
                      s->generated);
        put_f32_base64(&E->out, logits, E->info.vocab);
        cb_buf_puts(&E->out, "\",\"probs\":\"");
        put_f32_base64(&E->out, s->procs.probs, E->info.vocab);
        cb_buf_puts(&E->out, "\"}");
        emit(E);
    }
    cb_buf_printf(&E->out, "{\"ev\":\"token\",\"id\":%lld,\"tok\":%d", (long long)s->id, tok);
    cb_procs_put_logprobs(&s->procs, &E->out, logits, tok);
    cb_buf_puts(&E->out, "}");
    emit(E);
    s->generated++;
    E->generated_total++;
    for (int i = 0; i < s->n_stop; i++)
        if (s->stop[i] == tok) {
            finish(E, s, "stop");
            return;
        }
    if (s->generated >= s->max_tokens || s->n_tokens >= E->ctx) {
        finish(E, s, "length");
        return;
    }
    s->pending = tok;
    cb_procs_note(&s->procs, s->pending);
    s->phase = SEQ_DECODE;
}

/* A decide of an encoder family: the whole prompt in one call (cb_family.decide), then its decision. It is
 * answered as soon as it is accepted: there is nothing to interleave with other slots, and the next request line
 * (a `stats`, a `shutdown`) then sees it done. */
static void decide_whole(engine_t *E, slot_t *s) {
    char err[ERRLEN];
    double t0 = now_s();
    if (E->fam->decide(E->model, s->prompt, s->prompt_len, &s->decide, err, ERRLEN)) {
        emit_error(E, 1, s->id, "bad_request", err);   /* the request's fault (options the head has not): */
        seq_clear(s);                                    /* the engine goes on */
        return;
    }
    s->prefill_s = s->forward_s = now_s() - t0;
    s->prefill_forward_s = s->forward_s;
    s->next = s->prompt_len;
    s->n_tokens = 0;    /* nothing is kept: the next sequence on this slot is computed whole again */
    E->prefilled_total += (uint64_t)s->prompt_len;
    cb_decide_put(&E->out, &s->decide, s->id);
    emit(E);
    finish(E, s, "decided");
}

static int step(engine_t *E, slot_t *s, char *err) {
    int vocab = E->info.vocab;
    if (s->phase == SEQ_PREFILL) {
        int n = s->prompt_len - s->next;
        if (n > E->prefill_chunk) n = E->prefill_chunk;
        n = cb_decide_chunk(&s->decide, s->next, n);
        int pos0 = s->n_tokens;
        int reads = cb_decide_reads(&s->decide, pos0, n);
        double t0 = now_s();
        if (forward(E, s, s->prompt + s->next, n, s->want_logits != 0 || reads, err)) return -1;
        if (reads) cb_decide_collect(&s->decide, E->logits, pos0, n, vocab);
        s->prefill_s += now_s() - t0;
        s->next += n;
        E->prefilled_total += (uint64_t)n;
        if (s->next == s->prompt_len) {
            s->prefill_count = s->count;
            s->prefill_net = s->net;
            s->prefill_prof = s->prof;
            s->prefill_forward_s = s->forward_s;
        }
        /* a decide's questions share the state up to its pin: that is the checkpoint the next question needs */
        if (s->kv.state && s->next == (s->decide.pin ? s->decide.pin : s->prompt_len)) {
            memcpy(s->snap, s->kv.state, E->info.state_bytes);
            s->snap_pos = s->n_tokens;
        }
        if (s->want_logits) {
            for (int i = 0; i < n; i++) {
                cb_buf *b = &E->out;
                const float *row = E->logits + (size_t)i * (size_t)vocab;
                cb_buf_printf(b, "{\"ev\":\"logits\",\"id\":%lld,\"pos\":%d,", (long long)s->id, pos0 + i);
                if (s->want_logits == LOGITS_F32) {
                    cb_buf_puts(b, "\"f32\":\"");
                    put_f32_base64(b, row, vocab);
                    cb_buf_puts(b, "\"}");
                } else {
                    cb_buf_puts(b, "\"values\":[");
                    for (int v = 0; v < vocab; v++) {
                        if (v) cb_buf_put(b, ",", 1);
                        put_float(b, row[v]);
                    }
                    cb_buf_puts(b, "]}");
                }
                emit(E);
            }
        }
        if (s->next < s->prompt_len) {
            cb_buf_printf(&E->out, "{\"ev\":\"keepalive\",\"id\":%lld,\"done\":%d,\"total\":%d}", (long long)s->id,
                          s->next, s->prompt_len);
            emit(E);
            return 0;
        }
        if (s->decide.n_marks) {
            cb_decide_put(&E->out, &s->decide, s->id);
            emit(E);
            finish(E, s, "decided");
            return 0;
        }
        if (s->max_tokens <= 0) {
            finish(E, s, "length");
            return 0;
        }
        take_token(E, s, E->logits + (s->want_logits ? (size_t)(n - 1) * (size_t)vocab : 0));
        return 0;
    }
    double t0 = now_s();
    if (forward(E, s, &s->pending, 1, 0, err)) return -1;
    s->decode_s += now_s() - t0;
    s->decode_steps++;
    take_token(E, s, E->logits);
    return 0;
}

static void read_input(engine_t *E, int block);

/* One decode token of each of the n sequences in one forward pass (cb_family.forward_batch), then each one's
 * sampling, stop and grammar handling exactly as a step of its own would do it, in slot order. */
static int step_batch(engine_t *E, slot_t **seqs, int n, char *err) {
    for (int i = 0; i < n; i++) {
        E->batch_kv[i] = &seqs[i]->kv;
        E->batch_tokens[i] = seqs[i]->pending;
        E->batch_pos[i] = seqs[i]->n_tokens;
    }
    traffic_t before = traffic_now(E);
    if (E->fam->forward_batch(E->model, E->batch_kv, E->batch_tokens, E->batch_pos, n, E->logits, err, ERRLEN))
        return -1;
    traffic_t done = traffic_now(E);
    cb_experts_after_tokens(n);
    traffic_t after = traffic_now(E);
    for (int i = 0; i < n; i++) {
        slot_t *s = seqs[i];
        charge(s, &before, &done, &after, i, n);
        note_fed(s, &E->batch_tokens[i], 1);
        s->decode_s += done.t - before.t;
        s->decode_steps++;
        s->batched_steps++;
    }
    for (int i = 0; i < n; i++) take_token(E, seqs[i], E->logits + (size_t)i * (size_t)E->info.vocab);
    return 0;
}

/* Every decoding sequence's next token: batched when two or more decode and the family can (at most a prefill
 * chunk's rows per pass: its scratch and E->logits hold that many), else one step each. stdin is polled after
 * each pass; a sequence it cancels is skipped, one it starts waits for the next round. On failure *failed names
 * the sequences of the failing pass. */
static int decode_round(engine_t *E, slot_t ***failed, int *n_failed, char *err) {
    for (int from = 0; from < E->n_slots && !E->shutdown;) {
        int n = 0;
        while (from < E->n_slots && n < E->prefill_chunk) {
            slot_t *s = &E->slots[from++];
            if (s->phase == SEQ_DECODE) E->batch[n++] = s;
        }
        if (n >= 2 && E->fam->forward_batch) {
            if (step_batch(E, E->batch, n, err)) {
                *failed = E->batch, *n_failed = n;
                return -1;
            }
            read_input(E, 0);
            continue;
        }
        for (int i = 0; i < n; i++) {
            if (E->batch[i]->phase != SEQ_DECODE) continue;   /* cancelled while an earlier one stepped */
            if (step(E, E->batch[i], err)) {
                *failed = &E->batch[i], *n_failed = 1;
                return -1;
            }
            read_input(E, 0);
        }
    }
    return 0;
}

/* ---- requests ---- */

static int int_field(cb_json *req, const char *key, int required, int64_t def, int64_t lo, int64_t hi,
                     int64_t *out, char *err) {
    return cb_json_int_field(req, key, required, def, lo, hi, out, err, ERRLEN);
}

static int num_field(cb_json *req, const char *key, double def, double lo, double hi, double *out, char *err) {
    return cb_json_num_field(req, key, def, lo, hi, out, err, ERRLEN);
}

/* An optional array of token ids (each in [0, vocab)); NULL/0 when absent. */
static int ids_field(cb_json *req, const char *key, int vocab, int **out, int *n, char *err) {
    return cb_json_ids_field(req, key, vocab, out, n, err, ERRLEN);
}

/* An optional file path field ("kv_load", "kv_save"): NULL when absent; borrowed from the request. */
static int path_field(cb_json *req, const char *key, const char **out, char *err) {
    cb_json *v = cb_json_get(req, key);
    *out = NULL;
    if (!v || v->type == CB_JNULL) return 0;
    if (v->type != CB_JSTR || !v->str[0] || strlen(v->str) >= KV_PATH_MAX) {
        snprintf(err, ERRLEN, "field \"%s\" must be a file path (a non-empty string under %d bytes)", key,
                 KV_PATH_MAX);
        return -1;
    }
    *out = v->str;
    return 0;
}

static slot_t *find_seq(engine_t *E, int64_t id) {
    for (int i = 0; i < E->n_slots; i++)
        if (E->slots[i].phase != SEQ_IDLE && E->slots[i].id == id) return &E->slots[i];
    return NULL;
}

static void do_submit(engine_t *E, cb_json *req) {
    char err[ERRLEN];
    int64_t id, slot_no, max_tokens, top_k, seed;
    double temperature, top_p;
    if (int_field(req, "id", 1, 0, INT64_MIN, INT64_MAX, &id, err)) {
        emit_error(E, 0, 0, "bad_request", err);
        return;
    }
    if (int_field(req, "slot", 0, 0, 0, E->n_slots - 1, &slot_no, err) ||
        int_field(req, "max_tokens", 0, 128, 0, INT32_MAX, &max_tokens, err) ||
        int_field(req, "top_k", 0, 0, 0, INT32_MAX, &top_k, err) ||
        int_field(req, "seed", 0, 0, INT64_MIN, INT64_MAX, &seed, err) ||
        num_field(req, "temperature", 0.0, 0.0, 1e6, &temperature, err) ||
        num_field(req, "top_p", 1.0, 0.0, 1.0, &top_p, err)) {
        emit_error(E, 1, id, "bad_request", err);
        return;
    }
    cb_json *lg = cb_json_get(req, "logits");
    int is_f32 = lg && lg->type == CB_JSTR && strcmp(lg->str, "f32") == 0;
    if (lg && lg->type != CB_JBOOL && lg->type != CB_JNULL && !is_f32) {
        emit_error(E, 1, id, "bad_request", "field \"logits\" must be a boolean or \"f32\"");
        return;
    }
    const char *kv_load, *kv_save;
    cb_json *kv_id = cb_json_get(req, "kv_identity");
    if (path_field(req, "kv_load", &kv_load, err) || path_field(req, "kv_save", &kv_save, err)) {
        emit_error(E, 1, id, "bad_request", err);
        return;
    }
    if (kv_id && kv_id->type != CB_JNULL && (kv_id->type != CB_JSTR || strlen(kv_id->str) > CB_KV_IDENTITY_LEN)) {
        snprintf(err, ERRLEN, "field \"kv_identity\" must be a string of at most %d bytes", CB_KV_IDENTITY_LEN);
        emit_error(E, 1, id, "bad_request", err);
        return;
    }
    const char *identity = kv_id && kv_id->type == CB_JSTR ? kv_id->str : "";
    if (find_seq(E, id)) {
        emit_error(E, 1, id, "bad_request", "a sequence with this id is already running");
        return;
    }
    slot_t *s = &E->slots[slot_no];
    if (s->phase != SEQ_IDLE) {
        snprintf(err, ERRLEN, "slot %lld is running sequence %lld", (long long)slot_no, (long long)s->id);
        emit_error(E, 1, id, "busy", err);
        return;
    }
    int *prompt, n_prompt, *stop, n_stop, *forced, n_forced;
    if (ids_field(req, "prompt", E->info.vocab, &prompt, &n_prompt, err)) {
        emit_error(E, 1, id, "bad_request", err);
        return;
    }
    if (!n_prompt) {
        emit_error(E, 1, id, "bad_request", "field \"prompt\" must be a non-empty array of token ids");
        return;
    }
    if (n_prompt > E->ctx) {
        free(prompt);
        snprintf(err, ERRLEN, "prompt of %d tokens exceeds the context of %d tokens (start the engine with a larger --ctx)",
                 n_prompt, E->ctx);
        emit_error(E, 1, id, "context_exceeded", err);
        return;
    }
    if (ids_field(req, "stop", E->info.vocab, &stop, &n_stop, err)) {
        free(prompt);
        emit_error(E, 1, id, "bad_request", err);
        return;
    }
    if (ids_field(req, "forced", E->info.vocab, &forced, &n_forced, err)) {
        free(prompt);
        free(stop);
        emit_error(E, 1, id, "bad_request", err);
        return;
    }
    cb_procs procs;
    if (cb_procs_parse(&procs, req, E->info.vocab, prompt, n_prompt, err, sizeof err)) {
        free(prompt);
        free(stop);
        free(forced);
        emit_error(E, 1, id, "bad_request", err);
        return;
    }
    cb_decide decide = {0};
    cb_json *op = cb_json_get(req, "op");
    int deciding = op && op->type == CB_JSTR && !strcmp(op->str, "decide");
    int options = E->fam->decide ? E->info.outputs : E->info.vocab;   /* a head's columns, else token ids */
    if (deciding && cb_decide_parse(req, options, n_prompt, &decide, err, ERRLEN)) {
        cb_procs_free(&procs);
        free(prompt);
        free(stop);
        free(forced);
        emit_error(E, 1, id, "bad_request", err);
        return;
    }
    /* Reuse the longest common prefix, but always recompute the last prompt token to get its logits (a decide:
     * every row it reads; an encoder's decide: everything, each token sees the whole prompt). */
    int reuse = 0, keep = deciding ? (E->fam->decide ? 0 : decide.first_row) : n_prompt - 1;
    while (reuse < s->n_tokens && reuse < keep && s->tokens[reuse] == prompt[reuse]) reuse++;
    /* A recurrent state cannot be rewound. Keep it when it covers exactly the reused tokens, else go back to the
     * checkpoint taken after the last prompt (a chat turn whose re-tokenized reply differs from the sampled
     * tokens still reuses the history before it), else start from the empty state. */
    if (s->kv.state && reuse < s->n_tokens) {
        if (s->snap_pos > 0 && s->snap_pos <= reuse) {
            memcpy(s->kv.state, s->snap, E->info.state_bytes);
            reuse = s->snap_pos;
        } else {
            reuse = 0;
        }
    }
    int loaded = 0;
    char kv_warn[ERRLEN];
    kv_warn[0] = 0;
    if (kv_load) {
        reuse = load_slot(E, s, kv_load, identity, prompt, keep, reuse, &loaded, kv_warn);
        if (kv_warn[0]) fprintf(stderr, "warning: %s; prefilling instead\n", kv_warn);
    }
    if (s->kv.state && reuse == 0) memset(s->kv.state, 0, E->info.state_bytes);
    if (s->snap_pos > reuse) s->snap_pos = 0;    /* the tokens it covered are about to be overwritten */
    s->n_tokens = reuse;
    s->id = id;
    s->prompt = prompt;
    s->prompt_len = n_prompt;
    s->next = reuse;
    s->reused = reuse;
    s->max_tokens = deciding ? 0 : (int)max_tokens;
    s->decide = decide;
    s->generated = 0;
    s->want_logits = is_f32 ? LOGITS_F32 : (lg && lg->type == CB_JBOOL && lg->boolean) ? LOGITS_TEXT : 0;
    s->stop = stop;
    s->n_stop = n_stop;
    s->forced = forced;
    s->n_forced = n_forced;
    s->prefill_s = s->decode_s = 0;
    s->decode_steps = s->batched_steps = 0;
    memset(&s->count, 0, sizeof s->count);
    memset(&s->prof, 0, sizeof s->prof);
    s->forward_s = 0;
    memset(&s->prefill_count, 0, sizeof s->prefill_count);
    memset(&s->net, 0, sizeof s->net);
    memset(&s->prefill_net, 0, sizeof s->prefill_net);
    memset(&s->prefill_prof, 0, sizeof s->prefill_prof);
    s->prefill_forward_s = 0;
    cb_sampler_init(&s->sampler, (float)temperature, (float)top_p, (int)top_k, (uint64_t)seed);
    s->procs = procs;
    s->sampler.min_p = procs.min_p;
    s->kv_save = kv_save ? strdup(kv_save) : NULL;   /* a failed copy only skips the save */
    snprintf(s->kv_identity, sizeof s->kv_identity, "%s", identity);
    s->phase = SEQ_PREFILL;
    cb_buf_printf(&E->out, "{\"ev\":\"accept\",\"id\":%lld,\"slot\":%lld,\"prompt_tokens\":%d,\"reused_tokens\":%d",
                  (long long)id, (long long)slot_no, n_prompt, reuse);
    if (kv_load) cb_buf_printf(&E->out, ",\"kv_loaded\":%d", loaded);
    if (kv_warn[0]) {
        cb_buf_puts(&E->out, ",\"kv_warning\":");
        cb_buf_json_str(&E->out, kv_warn);
    }
    cb_buf_puts(&E->out, "}");
    emit(E);
    if (deciding && E->fam->decide) decide_whole(E, s);
}

static void do_stats(engine_t *E) {
    cb_buf *b = &E->out;
    cb_expert_counters tot = total_counters(E);
    uint64_t acc = tot.hits + tot.misses;
    /* Totals carry the expert_ prefix here because the unprefixed names are the per-layer arrays. */
    cb_buf_printf(b, "{\"ev\":\"stats\",\"expert_hits\":%llu,\"expert_misses\":%llu,\"hit_rate\":",
                  (unsigned long long)tot.hits, (unsigned long long)tot.misses);
    put_float(b, acc ? (double)tot.hits / (double)acc : 0.0);
    cb_buf_printf(b, ",\"expert_bytes_read\":%llu,\"expert_reads\":%llu", (unsigned long long)tot.bytes_read,
                  (unsigned long long)tot.reads);
    cb_buf_printf(b, ",\"prefilled_tokens\":%llu,\"generated_tokens\":%llu,\"decides\":%llu,\"rss_bytes\":%zu",
                  (unsigned long long)E->prefilled_total, (unsigned long long)E->generated_total,
                  (unsigned long long)E->decides, cb_rss_bytes());
    put_streaming(b);
    static const char *names[] = {"layers", "hits", "misses", "bytes_read", "reads"};
    for (int f = 0; f < 5; f++) {
        cb_buf_printf(b, ",\"%s\":[", names[f]);
        for (int i = 0; i < E->info.n_expert_layers; i++) {
            const cb_expert_layer *L = E->info.expert_layers[i];
            uint64_t v = f == 0 ? (uint64_t)L->layer : f == 1 ? L->count.hits : f == 2 ? L->count.misses
                       : f == 3 ? L->count.bytes_read : L->count.reads;
            cb_buf_printf(b, "%s%llu", i ? "," : "", (unsigned long long)v);
        }
        cb_buf_puts(b, "]");
    }
    cb_experts_put_maps(b, E->info.expert_layers, E->info.n_expert_layers);
    if (cb_remote_active()) {
        cb_remote_counters net = cb_remote_totals();
        cb_remote_put_counters(b, &net);
        cb_remote_put_workers(b);
    }
    cb_buf_puts(b, "}");
    emit(E);
}

static void handle_line(engine_t *E, const char *line, size_t n) {
    while (n && (line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t')) n--;
    if (!n) return;
    char err[ERRLEN];
    cb_json_doc *doc = cb_json_parse(line, n, err, sizeof err);
    if (!doc) {
        emit_error(E, 0, 0, "bad_request", err);
        return;
    }
    cb_json *req = cb_json_root(doc);
    cb_json *op = cb_json_get(req, "op");
    cb_json *idv = cb_json_get(req, "id");
    int has_id = idv && idv->type == CB_JNUM && idv->is_int;
    int64_t id = has_id ? idv->inum : 0;
    if (req->type != CB_JOBJ) {
        emit_error(E, 0, 0, "bad_request", "a request must be a JSON object");
    } else if (!op || op->type != CB_JSTR) {
        emit_error(E, has_id, id, "bad_request", "missing string field \"op\"");
    } else if (!strcmp(op->str, "submit") && (E->info.decide_only || !E->fam->forward)) {
        emit_error(E, has_id, id, "bad_request", "this model only decides (a decision head or an encoder): use op \"decide\"");
    } else if (!strcmp(op->str, "submit") || !strcmp(op->str, "decide")) {
        do_submit(E, req);
    } else if (!strcmp(op->str, "cancel")) {
        slot_t *s = has_id ? find_seq(E, id) : NULL;
        if (!has_id) emit_error(E, 0, 0, "bad_request", "cancel needs an integer \"id\"");
        else if (!s) emit_error(E, 1, id, "bad_request", "no running sequence has this id");
        else finish(E, s, "cancelled");
    } else if (!strcmp(op->str, "reset")) {
        int64_t slot_no;
        if (int_field(req, "slot", 1, 0, 0, E->n_slots - 1, &slot_no, err)) {
            emit_error(E, has_id, id, "bad_request", err);
        } else if (E->slots[slot_no].phase != SEQ_IDLE) {
            snprintf(err, ERRLEN, "slot %lld is running sequence %lld", (long long)slot_no,
                     (long long)E->slots[slot_no].id);
            emit_error(E, has_id, id, "busy", err);
        } else {
            E->slots[slot_no].n_tokens = 0;
        }
    } else if (!strcmp(op->str, "mask")) {
        slot_t *s = has_id ? find_seq(E, id) : NULL;
        if (!s) emit_error(E, has_id, id, "bad_request", "mask needs the integer \"id\" of a running sequence");
        else if (cb_procs_set_mask(&s->procs, req, err, sizeof err)) emit_error(E, 1, id, "bad_request", err);
        else if (s->phase == SEQ_AWAIT_MASK) take_token(E, s, s->procs.held);
    } else if (!strcmp(op->str, "stats")) {
        do_stats(E);
    } else if (!strcmp(op->str, "shutdown")) {
        E->shutdown = 1;
    } else {
        snprintf(err, ERRLEN, "unknown op \"%.64s\" (submit, decide, mask, cancel, reset, stats, shutdown)", op->str);
        emit_error(E, has_id, id, "bad_request", err);
    }
    cb_json_free(doc);
}

/* Read what stdin has (waiting for it when `block`), handling every complete line. */
static void read_input(engine_t *E, int block) {
    while (!E->in_eof && !E->shutdown) {
        struct pollfd pfd = {0, POLLIN, 0};
        int r = poll(&pfd, 1, block ? -1 : 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return;
        if (E->in_cap - E->in_len < 65536) {
            size_t cap = E->in_cap ? E->in_cap * 2 : 131072;
            char *p = realloc(E->in, cap);
            if (!p) {
                E->in_eof = 1;
                return;
            }
            E->in = p;
            E->in_cap = cap;
        }
        ssize_t got = read(0, E->in + E->in_len, E->in_cap - E->in_len);
        if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (got <= 0) {
            E->in_eof = 1;
            if (E->in_len && !E->discarding) handle_line(E, E->in, E->in_len);   /* a last unterminated line */
            E->in_len = 0;
            return;
        }
        size_t scan_from = E->in_len, start = 0;
        E->in_len += (size_t)got;
        for (size_t i = scan_from; i < E->in_len; i++) {
            if (E->in[i] != '\n') continue;
            if (!E->discarding) handle_line(E, E->in + start, i - start);
            E->discarding = 0;
            start = i + 1;
            if (E->shutdown) return;
        }
        memmove(E->in, E->in + start, E->in_len - start);
        E->in_len -= start;
        if (E->in_len > MAX_LINE) {
            if (!E->discarding) emit_error(E, 0, 0, "bad_request", "request line longer than 16 MiB");
            E->discarding = 1;
            E->in_len = 0;
        }
        block = 0;
    }
}

/* ---- arguments and main loop ---- */

static int parse_int_arg(const char *flag, const char *v, int lo, int hi, int *out, char *err) {
    return cb_parse_int_arg(flag, v, lo, hi, out, err, ERRLEN);
}

static int parse_switch(const char *flag, const char *v, int *out, char *err) {
    if (v && (!strcmp(v, "1") || !strcmp(v, "on"))) *out = 1;
    else if (v && (!strcmp(v, "0") || !strcmp(v, "off"))) *out = 0;
    else {
        snprintf(err, ERRLEN, "%s needs on or off, got %s", flag, v ? v : "nothing");
        return -1;
    }
    return 0;
}

static int parse_args(engine_t *E, int argc, char **argv, const char **model_dir, cb_hparams *hp, char *err) {
    *model_dir = NULL;
    E->ctx = 4096;
    E->n_slots = 1;
    E->cap = 0;
    E->threads = 0;
    E->prefill_chunk = DEFAULT_PREFILL_CHUNK;
    E->stream = cb_stream_defaults();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(a, "--model")) {
            if (!v) { snprintf(err, ERRLEN, "--model needs a directory"); return -1; }
            *model_dir = v;
        } else if (!strcmp(a, "--ctx")) rc = parse_int_arg(a, v, 1, 1 << 24, &E->ctx, err);
        else if (!strcmp(a, "--slots")) rc = parse_int_arg(a, v, 1, 1024, &E->n_slots, err);
        else if (!strcmp(a, "--cap")) rc = parse_int_arg(a, v, 0, 1 << 24, &E->cap, err);
        else if (!strcmp(a, "--threads")) rc = parse_int_arg(a, v, 0, 4096, &E->threads, err);
        else if (!strcmp(a, "--prefill-chunk")) rc = parse_int_arg(a, v, 1, 4096, &E->prefill_chunk, err);
        else if (!strcmp(a, "--prefetch")) rc = parse_switch(a, v, &E->stream.prefetch, err);
        else if (!strcmp(a, "--pin")) {
            if (v && !strcmp(v, "duel")) E->stream.pin = CB_PIN_DUEL;
            else if (parse_switch(a, v, &E->stream.pin, err)) {
                snprintf(err, ERRLEN, "--pin needs on, off or duel, got %s", v ? v : "nothing");
                return -1;
            }
        }
        else if (!strcmp(a, "--lookahead")) rc = parse_switch(a, v, &E->stream.lookahead, err);
        else if (!strcmp(a, "--preload")) rc = parse_switch(a, v, &E->stream.preload, err);
        else if (!strcmp(a, "--moe-union")) rc = parse_switch(a, v, &E->stream.moe_union, err);
        else if (!strcmp(a, "--repin-every")) rc = parse_int_arg(a, v, 1, 1 << 30, &E->stream.repin_every, err);
        else if (!strcmp(a, "--io-stages")) rc = parse_int_arg(a, v, 2, 64, &E->stream.io_stages, err);
        else if (!strcmp(a, "--io-threads")) rc = parse_int_arg(a, v, 1, CB_IO_THREADS_MAX,
                                                                  &E->stream.io_threads, err);
        else if (!strcmp(a, "--experts-k")) rc = parse_int_arg(a, v, 1, 1 << 16, &E->stream.experts_k, err);
        else if (!strcmp(a, "--expert-timeout-ms")) rc = parse_int_arg(a, v, 10, 600000, &E->expert_timeout_ms, err);
        else if (!strcmp(a, "--expert-wait-s")) rc = parse_int_arg(a, v, 0, 86400, &E->expert_wait_s, err);
        else if (!strcmp(a, "--expert-map")) {
            if (!v) { snprintf(err, ERRLEN, "--expert-map needs a file path"); return -1; }
            E->expert_map = v;
        }
        else if (!strcmp(a, "--hotset")) {
            if (!v) { snprintf(err, ERRLEN, "--hotset needs a file path"); return -1; }
            E->stream.hotset_path = v;
        } else if (!strcmp(a, "--io")) {
            if (v && !strcmp(v, "auto")) E->stream.io_mode = CB_IO_AUTO;
            else if (v && !strcmp(v, "direct")) E->stream.io_mode = CB_IO_DIRECT;
            else if (v && !strcmp(v, "buffered")) E->stream.io_mode = CB_IO_BUFFERED;
            else { snprintf(err, ERRLEN, "--io needs auto, direct or buffered, got %s", v ? v : "nothing"); return -1; }
        } else if (!strcmp(a, "--experts-top-p")) {
            char *end;
            double p = v ? strtod(v, &end) : 0;
            if (!v || end == v || *end || !(p > 0 && p <= 1)) {
                snprintf(err, ERRLEN, "--experts-top-p needs a number in (0, 1], got %s", v ? v : "nothing");
                return -1;
            }
            E->stream.experts_top_p = p >= 1 ? 0.0f : (float)p;
        }
        else if (!strcmp(a, "--set")) {
            if (cb_hp_add(hp, v, err, ERRLEN)) return -1;
        } else {
            snprintf(err, ERRLEN, "unknown argument %s (--model, --ctx, --slots, --cap, --threads, --set, --prefetch, "
                                  "--pin, --lookahead, --preload, --io, --io-stages, --io-threads, --moe-union, "
                                  "--repin-every, --hotset, --experts-k, --experts-top-p, --expert-map, "
                                  "--expert-timeout-ms, --expert-wait-s)", a);
            return -1;
        }
        if (rc) return -1;
        i++;
    }
    if (!*model_dir) {
        snprintf(err, ERRLEN, "--model DIR is required");
        return -1;
    }
    return 0;
}

static int alloc_slots(engine_t *E, char *err) {
    E->slots = calloc((size_t)E->n_slots, sizeof *E->slots);
    if (!E->slots) goto oom;
    size_t per = (size_t)E->info.n_layers * (size_t)E->ctx * (size_t)E->info.kv_dim;
    for (int i = 0; i < E->n_slots; i++) {
        slot_t *s = &E->slots[i];
        s->kv.n_layers = E->info.n_layers;
        s->kv.ctx = E->ctx;
        s->kv.kv_dim = E->info.kv_dim;
        /* calloc: pages of KV never reached by a sequence are never touched, so never resident. */
        s->kv.k = calloc(per ? per : 1, sizeof(float));
        s->kv.v = E->info.kv_k_only ? NULL : calloc(per ? per : 1, sizeof(float));
        s->tokens = malloc((size_t)E->ctx * sizeof(int));
        if (E->info.state_bytes &&
            (!(s->kv.state = calloc(1, E->info.state_bytes)) || !(s->snap = malloc(E->info.state_bytes))))
            goto oom;
        if (!s->kv.k || (!s->kv.v && !E->info.kv_k_only) || !s->tokens) goto oom;
    }
    E->batch = malloc((size_t)E->n_slots * sizeof *E->batch);
    E->batch_kv = malloc((size_t)E->n_slots * sizeof *E->batch_kv);
    E->batch_tokens = malloc((size_t)E->n_slots * sizeof(int));
    E->batch_pos = malloc((size_t)E->n_slots * sizeof(int));
    if (!E->batch || !E->batch_kv || !E->batch_tokens || !E->batch_pos) goto oom;
    E->logits = malloc((size_t)E->prefill_chunk * (size_t)E->info.vocab * sizeof(float));
    E->sample_work = malloc((size_t)E->info.vocab * 2 * sizeof(float));
    if (!E->logits || !E->sample_work) goto oom;
    return 0;
oom:
    snprintf(err, ERRLEN, "out of memory allocating %d KV slots of %d tokens", E->n_slots, E->ctx);
    return -1;
}

static void free_engine(engine_t *E) {
    if (E->slots)
        for (int i = 0; i < E->n_slots; i++) {
            seq_clear(&E->slots[i]);
            free(E->slots[i].kv.k);
            free(E->slots[i].kv.v);
            free(E->slots[i].tokens);
            free(E->slots[i].kv.state);
            free(E->slots[i].snap);
        }
    free(E->slots);
    free(E->batch);
    free(E->batch_kv);
    free(E->batch_tokens);
    free(E->batch_pos);
    free(E->logits);
    free(E->sample_work);
    free(E->in);
    cb_buf_free(&E->out);
    if (E->model) E->fam->free(E->model);
}

int cb_engine_main(int argc, char **argv, const cb_family *family) {
    engine_t E;
    memset(&E, 0, sizeof E);
    E.fam = family;
    cb_hparams hp = {0};
    char err[ERRLEN];
    const char *model_dir;
    int rc = 2;
    if (cb_expert_worker_wanted(argc, argv)) return cb_expert_worker_main(argc, argv);
    E.expert_wait_s = 120;
    if (parse_args(&E, argc, argv, &model_dir, &hp, err)) {
        emit_fatal("bad_args", err);
        goto out;
    }
    cb_experts_configure(&E.stream);
    if (cb_threads_init(E.threads)) {
        emit_fatal("internal", "cannot start the compute threads");
        goto out;
    }
    cb_load_args la = {model_dir, E.ctx, E.n_slots, E.cap, E.threads, E.prefill_chunk, &hp};
    err[0] = 0;
    if (family->load(&E.model, &la, &E.info, err, sizeof err)) {
        E.model = NULL;
        emit_fatal("load", err[0] ? err : "loading the model failed");
        goto out_threads;
    }
    if (cb_hp_check_used(&hp, family->name, err, ERRLEN)) {
        emit_fatal("bad_args", err);
        goto out_threads;
    }
    if (E.info.vocab < 1 || E.info.n_layers < 0 || E.info.kv_dim < 0 || (family->decide && E.info.outputs < 1)) {
        emit_fatal("load", "the family reported an invalid model geometry");
        goto out_threads;
    }
    if (E.info.max_positions > 0 && E.ctx > E.info.max_positions) {
        snprintf(err, ERRLEN, "--ctx %d: the model reads at most %d positions", E.ctx, E.info.max_positions);
        emit_fatal("bad_args", err);
        goto out_threads;
    }
    if (alloc_slots(&E, err)) {
        emit_fatal("load", err);
        goto out_threads;
    }
    if (E.expert_map && cb_remote_start(E.expert_map, E.expert_timeout_ms, E.expert_wait_s, err, ERRLEN)) {
        emit_fatal("bad_args", err);
        goto out_threads;
    }
    cb_experts_after_tokens(0);   /* loads the hot-set sidecar when pinning */
    uint64_t preloaded = 0;
    if (E.stream.preload && cb_experts_preload(&preloaded, err, ERRLEN)) {
        emit_fatal("load", err);
        goto out_threads;
    }
    if (E.stream.experts_k > 0 || E.stream.experts_top_p > 0)
        fprintf(stderr, "warning: lossy expert routing (--experts-k / --experts-top-p): tokens will differ from "
                        "the model's own routing\n");
    size_t kv_bytes = (size_t)E.n_slots * (E.info.kv_k_only ? 1 : 2) * (size_t)E.info.n_layers * (size_t)E.ctx *
                      (size_t)E.info.kv_dim *
                      sizeof(float);
    cb_buf_printf(&E.out, "{\"ev\":\"ready\",\"family\":");
    cb_buf_json_str(&E.out, family->name);
    cb_buf_printf(&E.out, ",\"vocab\":%d,\"ctx\":%d,\"slots\":%d,\"cap\":%d,\"threads\":%d,\"isa\":\"%s\","
                          "\"dense_bytes\":%zu,\"kv_bytes\":%zu,\"state_bytes\":%zu,\"expert_cache_bytes\":%zu",
                  E.info.vocab, E.ctx, E.n_slots, E.cap, cb_threads_count(), cb_isa_name(cb_get_isa()),
                  E.info.dense_bytes, kv_bytes, (size_t)E.n_slots * 2 * E.info.state_bytes, E.info.expert_cache_bytes);
    cb_buf_printf(&E.out, ",\"preloaded_bytes\":%llu,\"staging_bytes\":%zu,\"hotset\":",
                  (unsigned long long)preloaded, cb_experts_staging_bytes());
    cb_buf_json_str(&E.out, cb_experts_hotset_status());
    put_streaming(&E.out);
    if (family->decide) cb_buf_printf(&E.out, ",\"outputs\":%d", E.info.outputs);
    /* a head-only model or an encoder only decides, and keeps no KV worth a file */
    int decide_only = E.info.decide_only || !family->forward;
    cb_buf_puts(&E.out, decide_only ? ",\"abilities\":[\"decide\"]}"
                        : family->forward_batch ? ",\"abilities\":[\"chat\",\"decide\",\"kv_files\",\"batched_decode\"]}"
                                                : ",\"abilities\":[\"chat\",\"decide\",\"kv_files\"]}");
    emit(&E);

    rc = 0;
    while (!E.shutdown) {
        int active = 0;
        /* a sequence held for its mask is not active: the loop blocks on stdin, which brings the mask; at end of
         * stdin no mask can come, and the held sequences end as cancelled below */
        for (int i = 0; i < E.n_slots; i++) active |= E.slots[i].phase == SEQ_PREFILL || E.slots[i].phase == SEQ_DECODE;
        if (!active && E.in_eof) break;
        read_input(&E, !active);
        slot_t **failed = NULL;
        int n_failed = 0;
        for (int i = 0; i < E.n_slots && !E.shutdown && !n_failed; i++) {
            slot_t *s = &E.slots[i];
            if (s->phase != SEQ_PREFILL) continue;
            if (step(&E, s, err)) {
                E.batch[0] = s;
                failed = E.batch, n_failed = 1;
                break;
            }
            read_input(&E, 0);
        }
        if (!n_failed && !E.shutdown) decode_round(&E, &failed, &n_failed, err);
        if (n_failed) {
            for (int i = 0; i < n_failed; i++) emit_error(&E, 1, failed[i]->id, "internal", err);
            emit_fatal("internal", err);
            rc = 2;
            goto out_threads;
        }
    }
    for (int i = 0; i < E.n_slots; i++)
        if (E.slots[i].phase != SEQ_IDLE) finish(&E, &E.slots[i], "cancelled");
out_threads:
    if (E.model && rc == 0) {
        char herr[ERRLEN];
        if (cb_experts_save_hotset(herr, sizeof herr)) fprintf(stderr, "notice: %s\n", herr);
    }
    cb_remote_stop();
    free_engine(&E);
    E.model = NULL;
    cb_experts_io_shutdown();
    cb_threads_shutdown();
out:
    cb_hp_free(&hp);
    return rc;
}
