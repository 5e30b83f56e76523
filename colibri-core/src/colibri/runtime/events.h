/* events.h: the output side of the engine protocol (docs/protocol.md) that every engine process shares: one JSON
 * event per stdout line, `error` and `fatal` events, and the checks of request fields and command-line numbers,
 * so every engine answers alike.
 */
#ifndef COLIBRI_EVENTS_H
#define COLIBRI_EVENTS_H

#include <stddef.h>
#include <stdint.h>

#include "json.h"

/* Write b as one line to stdout (newline added, flushed; nothing when b failed to grow), then empty it. */
void cb_emit_line(cb_buf *b);
/* {"ev":"error","id":id or null,"code":..,"message":..} through b. */
void cb_emit_error(cb_buf *b, int has_id, int64_t id, const char *code, const char *message);
/* {"ev":"fatal","code":..,"message":..} straight to stdout, and the message on stderr. */
void cb_emit_fatal(const char *code, const char *message);
/* An integer field of a request in [lo, hi]; absent or null: def, or an error when required. 0, or -1 with err
 * naming the field. */
int cb_json_int_field(const cb_json *req, const char *key, int required, int64_t def, int64_t lo, int64_t hi,
                      int64_t *out, char *err, size_t errlen);
/* An optional array of token ids in [0, vocab) into a fresh array (*out NULL and *n 0 when absent, null or
 * empty). 0, or -1 with err naming the field and the first bad entry. */
int cb_json_ids_field(const cb_json *req, const char *key, int vocab, int **out, int *n, char *err, size_t errlen);
/* A command-line integer (`flag` its name, v its value or NULL) in [lo, hi]: 0, or -1 with err naming the flag. */
int cb_parse_int_arg(const char *flag, const char *v, int lo, int hi, int *out, char *err, size_t errlen);

#endif
