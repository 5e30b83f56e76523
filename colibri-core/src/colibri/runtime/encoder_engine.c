/* encoder_engine.c: the process of a decision-only encoder (see encoder_engine.h). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "decide.h"
#include "encoder_engine.h"
#include "engine.h"
#include "events.h"
#include "hparams.h"
#include "json.h"
#include "kernels.h"

#define ERRLEN 512
#define MAX_LINE (16u << 20)

typedef struct {
    const cb_encoder_family *fam;
    void *model;
    cb_encoder_info info;
    int ctx, n_slots, cap, threads, shutdown;
    uint64_t prefilled_total, decides;
    cb_buf out;
} encoder_t;

static void emit(encoder_t *E) { cb_emit_line(&E->out); }

static void emit_error(encoder_t *E, int has_id, int64_t id, const char *code, const char *message) {
    cb_emit_error(&E->out, has_id, id, code, message);
}


static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}


/* The streaming flags core may pass any engine; an encoder has no experts to stream, so they change nothing. */
static const char *const IGNORED[] = {"--prefill-chunk", "--prefetch", "--pin", "--lookahead", "--preload",
                                      "--moe-union", "--repin-every", "--io-stages", "--experts-k",
                                      "--experts-top-p", "--hotset", "--io", NULL};

static int parse_args(encoder_t *E, int argc, char **argv, const char **model_dir, cb_hparams *hp, char *err) {
    *model_dir = NULL;
    E->ctx = 512;
    E->n_slots = 1;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int ignored = 0;
        for (int k = 0; IGNORED[k]; k++) ignored |= !strcmp(a, IGNORED[k]);
        int rc = !strcmp(a, "--ctx")       ? cb_parse_int_arg(a, v, 1, 1 << 20, &E->ctx, err, ERRLEN)
                 : !strcmp(a, "--slots")   ? cb_parse_int_arg(a, v, 1, 1024, &E->n_slots, err, ERRLEN)
                 : !strcmp(a, "--cap")     ? cb_parse_int_arg(a, v, 0, 1 << 24, &E->cap, err, ERRLEN)
                 : !strcmp(a, "--threads") ? cb_parse_int_arg(a, v, 0, 4096, &E->threads, err, ERRLEN)
                 : !strcmp(a, "--set")     ? cb_hp_add(hp, v, err, ERRLEN)
                 : 0;
        if (rc) return -1;
        if (!strcmp(a, "--model")) *model_dir = v;
        else if (!ignored && strcmp(a, "--ctx") && strcmp(a, "--slots") && strcmp(a, "--cap") &&
                 strcmp(a, "--threads") && strcmp(a, "--set")) {
            snprintf(err, ERRLEN, "unknown argument %s (--model, --ctx, --slots, --cap, --threads, --set)", a);
            return -1;
        }
        if (!v) {
            snprintf(err, ERRLEN, "%s needs a value", a);
            return -1;
        }
    }
    if (*model_dir) return 0;
    snprintf(err, ERRLEN, "--model DIR is required");
    return -1;
}


/* The prompt's token ids (validated against the vocabulary) into a fresh array: 0, -1 (bad_request) or -2
 * (context_exceeded) with a message. */
static int prompt_field(const encoder_t *E, const cb_json *req, int **ids, int *n, char *err) {
    if (cb_json_ids_field(req, "prompt", E->info.vocab, ids, n, err, ERRLEN)) return -1;
    if (!*n) {
        snprintf(err, ERRLEN, "field \"prompt\" must be a non-empty array of token ids");
        return -1;
    }
    if (*n > E->ctx) {
        snprintf(err, ERRLEN, "prompt of %d tokens exceeds the context of %d tokens", *n, E->ctx);
        free(*ids);
        *ids = NULL;
        return -2;
    }
    return 0;
}

/* Answer one decide: a forward pass over the prompt, the options' outputs at each mark's row. */
static int do_decide(encoder_t *E, const cb_json *req, int64_t id, char *err) {
    int64_t slot;
    int *prompt = NULL, n = 0;
    if (cb_json_int_field(req, "slot", 0, 0, 0, E->n_slots - 1, &slot, err, ERRLEN)) {
        emit_error(E, 1, id, "bad_request", err);
        return 0;
    }
    int bad = prompt_field(E, req, &prompt, &n, err);
    if (bad) {
        emit_error(E, 1, id, bad == -2 ? "context_exceeded" : "bad_request", err);
        return 0;
    }
    cb_decide d = {0};
    if (cb_decide_parse(req, E->info.outputs, n, &d, err, ERRLEN)) {
        free(prompt);
        emit_error(E, 1, id, "bad_request", err);
        return 0;
    }
    if (!d.n_marks) {
        free(prompt);
        cb_decide_free(&d);
        emit_error(E, 1, id, "bad_request", "a decide needs at least one mark");
        return 0;
    }
    cb_buf_printf(&E->out, "{\"ev\":\"accept\",\"id\":%lld,\"slot\":%lld,\"prompt_tokens\":%d,\"reused_tokens\":0}",
                  (long long)id, (long long)slot, n);
    emit(E);
    float *rows = malloc((size_t)d.n_marks * (size_t)E->info.outputs * sizeof(float));
    double t0 = now_s();
    int rc = rows ? E->fam->score(E->model, prompt, n, d.rows, d.n_marks, rows, err, ERRLEN) : -1;
    if (!rows) snprintf(err, ERRLEN, "out of memory");
    double dt = now_s() - t0;
    if (!rc) {
        for (int i = 0; i < d.n_marks; i++)
            for (int k = d.first_option[i]; k < d.first_option[i + 1]; k++)
                d.scores[k] = rows[(size_t)i * E->info.outputs + d.options[k]];
        cb_decide_put(&E->out, &d, id);
        emit(E);
        E->prefilled_total += (uint64_t)n;
        E->decides++;
        cb_buf_printf(&E->out, "{\"ev\":\"done\",\"id\":%lld,\"reason\":\"decided\",\"prompt_tokens\":%d,"
                               "\"prefilled_tokens\":%d,\"generated_tokens\":0,\"prefill_tps\":%.3f,\"decode_tps\":0,"
                               "\"expert_hits\":0,\"expert_misses\":0,\"hit_rate\":0,\"bytes_read\":0,\"reads\":0,"
                               "\"rss_bytes\":%zu}",
                      (long long)id, n, n, dt > 0 ? n / dt : 0.0, cb_rss_bytes());
        emit(E);
    }
    free(rows);
    free(prompt);
    cb_decide_free(&d);
    return rc;
}

static int handle_line(encoder_t *E, const char *line, size_t n) {
    while (n && (line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t')) n--;
    if (!n) return 0;
    char err[ERRLEN];
    cb_json_doc *doc = cb_json_parse(line, n, err, sizeof err);
    if (!doc) {
        emit_error(E, 0, 0, "bad_request", err);
        return 0;
    }
    cb_json *req = cb_json_root(doc), *op = cb_json_get(req, "op"), *idv = cb_json_get(req, "id");
    int has_id = idv && idv->type == CB_JNUM && idv->is_int, rc = 0;
    int64_t id = has_id ? idv->inum : 0;
    if (req->type != CB_JOBJ) {
        emit_error(E, 0, 0, "bad_request", "a request must be a JSON object");
    } else if (!op || op->type != CB_JSTR) {
        emit_error(E, has_id, id, "bad_request", "missing string field \"op\"");
    } else if (!strcmp(op->str, "decide")) {
        if (!has_id) emit_error(E, 0, 0, "bad_request", "a decide needs an integer \"id\"");
        else if (do_decide(E, req, id, err)) {
            emit_error(E, 1, id, "internal", err);
            cb_emit_fatal("internal", err);
            rc = -1;
        }
    } else if (!strcmp(op->str, "submit")) {
        emit_error(E, has_id, id, "bad_request", "this engine only decides (abilities: decide); it cannot generate");
    } else if (!strcmp(op->str, "cancel")) {
        emit_error(E, has_id, id, "bad_request", "no running sequence has this id");
    } else if (!strcmp(op->str, "reset")) {
        int64_t slot;
        if (cb_json_int_field(req, "slot", 0, 0, 0, E->n_slots - 1, &slot, err, ERRLEN)) emit_error(E, has_id, id, "bad_request", err);
    } else if (!strcmp(op->str, "stats")) {
        cb_buf_printf(&E->out, "{\"ev\":\"stats\",\"expert_hits\":0,\"expert_misses\":0,\"hit_rate\":0,"
                               "\"expert_bytes_read\":0,\"expert_reads\":0,\"prefilled_tokens\":%llu,"
                               "\"generated_tokens\":0,\"decides\":%llu,\"rss_bytes\":%zu,\"layers\":[],\"hits\":[],"
                               "\"misses\":[],\"bytes_read\":[],\"reads\":[]}",
                      (unsigned long long)E->prefilled_total, (unsigned long long)E->decides, cb_rss_bytes());
        emit(E);
    } else if (!strcmp(op->str, "shutdown")) {
        E->shutdown = 1;
    } else {
        snprintf(err, ERRLEN, "unknown op \"%.64s\" (decide, reset, stats, shutdown)", op->str);
        emit_error(E, has_id, id, "bad_request", err);
    }
    cb_json_free(doc);
    return rc;
}

/* Lines from stdin, each at most MAX_LINE bytes (a longer one is refused and skipped, never buffered whole). */
static int serve(encoder_t *E) {
    size_t cap = 1 << 16, len = 0;
    char *line = malloc(cap);
    int c, too_long = 0, rc = 0;
    if (!line) return -1;
    while (!E->shutdown && !rc && (c = getchar()) != EOF) {
        if (c != '\n') {
            if (too_long) continue;
            if (len + 1 >= cap) {
                if (cap >= MAX_LINE) {
                    too_long = 1;
                    continue;
                }
                char *p = realloc(line, cap * 2);
                if (!p) {
                    too_long = 1;
                    continue;
                }
                line = p;
                cap *= 2;
            }
            line[len++] = (char)c;
            continue;
        }
        if (too_long) emit_error(E, 0, 0, "bad_request", "request line longer than 16 MiB");
        else rc = handle_line(E, line, len);
        len = 0;
        too_long = 0;
    }
    if (!rc && !E->shutdown && len && !too_long) rc = handle_line(E, line, len);   /* a last unterminated line */
    free(line);
    return rc;
}

/* Parse the command line, start the threads and load the model: NULL, or the fatal code with a message in err. */
static const char *start(encoder_t *E, int argc, char **argv, cb_hparams *hp, char *err) {
    const char *model_dir;
    if (parse_args(E, argc, argv, &model_dir, hp, err)) return "bad_args";
    if (cb_threads_init(E->threads)) {
        snprintf(err, ERRLEN, "cannot start the compute threads");
        return "internal";
    }
    cb_load_args la = {model_dir, E->ctx, E->n_slots, E->cap, E->threads, E->ctx, hp};
    err[0] = 0;
    if (E->fam->load(&E->model, &la, &E->info, err, ERRLEN)) {
        E->model = NULL;
        if (!err[0]) snprintf(err, ERRLEN, "loading the model failed");
        return "load";
    }
    if (cb_hp_check_used(hp, E->fam->name, err, ERRLEN)) return "bad_args";
    if (E->info.vocab < 1 || E->info.outputs < 1) {
        snprintf(err, ERRLEN, "the family reported an invalid model geometry");
        return "load";
    }
    if (E->info.max_positions > 0 && E->ctx > E->info.max_positions) {
        snprintf(err, ERRLEN, "--ctx %d: the encoder reads at most %d positions", E->ctx, E->info.max_positions);
        return "bad_args";
    }
    return NULL;
}

int cb_encoder_main(int argc, char **argv, const cb_encoder_family *family) {
    encoder_t E;
    memset(&E, 0, sizeof E);
    E.fam = family;
    cb_hparams hp = {0};
    char err[ERRLEN];
    int rc = 2;
    const char *fatal = start(&E, argc, argv, &hp, err);
    if (fatal) {
        cb_emit_fatal(fatal, err);
    } else {
        cb_buf_puts(&E.out, "{\"ev\":\"ready\",\"family\":");
        cb_buf_json_str(&E.out, family->name);
        cb_buf_printf(&E.out, ",\"vocab\":%d,\"outputs\":%d,\"ctx\":%d,\"slots\":%d,\"cap\":%d,\"threads\":%d,"
                              "\"isa\":\"%s\",\"dense_bytes\":%zu,\"kv_bytes\":0,\"state_bytes\":0,"
                              "\"expert_cache_bytes\":0,\"preloaded_bytes\":0,\"staging_bytes\":0,\"hotset\":\"none\","
                              "\"abilities\":[\"decide\"]}",
                      E.info.vocab, E.info.outputs, E.ctx, E.n_slots, E.cap, cb_threads_count(),
                      cb_isa_name(cb_get_isa()), E.info.dense_bytes);
        emit(&E);
        rc = serve(&E) ? 2 : 0;
    }
    if (E.model) family->free(E.model);
    cb_threads_shutdown();
    cb_buf_free(&E.out);
    cb_hp_free(&hp);
    return rc;
}
