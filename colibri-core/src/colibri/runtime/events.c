/* events.c: the protocol's shared event writers and field checks (see events.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "events.h"

void cb_emit_line(cb_buf *b) {
    cb_buf_put(b, "\n", 1);
    if (!b->failed) {
        fwrite(b->data, 1, b->len, stdout);
        fflush(stdout);
    }
    cb_buf_reset(b);
}

void cb_emit_error(cb_buf *b, int has_id, int64_t id, const char *code, const char *message) {
    cb_buf_puts(b, "{\"ev\":\"error\",\"id\":");
    if (has_id) cb_buf_printf(b, "%lld", (long long)id);
    else cb_buf_puts(b, "null");
    cb_buf_printf(b, ",\"code\":\"%s\",\"message\":", code);
    cb_buf_json_str(b, message);
    cb_buf_puts(b, "}");
    cb_emit_line(b);
}

void cb_emit_fatal(const char *code, const char *message) {
    cb_buf b = {0};
    cb_buf_printf(&b, "{\"ev\":\"fatal\",\"code\":\"%s\",\"message\":", code);
    cb_buf_json_str(&b, message);
    cb_buf_puts(&b, "}");
    cb_emit_line(&b);
    fprintf(stderr, "fatal: %s\n", message);
    cb_buf_free(&b);
}

int cb_json_int_field(const cb_json *req, const char *key, int required, int64_t def, int64_t lo, int64_t hi,
                      int64_t *out, char *err, size_t errlen) {
    const cb_json *v = cb_json_get(req, key);
    if (!v || v->type == CB_JNULL) {
        if (required) {
            snprintf(err, errlen, "missing field \"%s\"", key);
            return -1;
        }
        *out = def;
        return 0;
    }
    if (v->type != CB_JNUM || !v->is_int || v->inum < lo || v->inum > hi) {
        snprintf(err, errlen, "field \"%s\" must be an integer in [%lld, %lld]", key, (long long)lo, (long long)hi);
        return -1;
    }
    *out = v->inum;
    return 0;
}

int cb_json_ids_field(const cb_json *req, const char *key, int vocab, int **out, int *n, char *err, size_t errlen) {
    *out = NULL;
    *n = 0;
    const cb_json *v = cb_json_get(req, key);
    if (!v || v->type == CB_JNULL) return 0;
    if (v->type != CB_JARR) {
        snprintf(err, errlen, "field \"%s\" must be an array of token ids", key);
        return -1;
    }
    if (!v->len) return 0;
    *out = malloc(v->len * sizeof(int));
    if (!*out) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < v->len; i++) {
        const cb_json *t = v->items[i];
        if (t->type != CB_JNUM || !t->is_int || t->inum < 0 || t->inum >= vocab) {
            snprintf(err, errlen, "field \"%s\"[%zu] is not a token id in [0, %d)", key, i, vocab);
            free(*out);
            *out = NULL;
            return -1;
        }
        (*out)[i] = (int)t->inum;
    }
    *n = (int)v->len;
    return 0;
}

int cb_parse_int_arg(const char *flag, const char *v, int lo, int hi, int *out, char *err, size_t errlen) {
    char *end;
    errno = 0;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || errno || end == v || *end || x < lo || x > hi) {
        snprintf(err, errlen, "%s needs an integer in [%d, %d], got %s", flag, lo, hi, v ? v : "nothing");
        return -1;
    }
    *out = (int)x;
    return 0;
}
