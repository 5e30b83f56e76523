/* json.h: a small validating JSON reader (for safetensors headers and protocol lines) and an output buffer
 * for writing JSON events.
 *
 * The reader builds a tree in one arena freed at once. It never trusts its input: every malformed,
 * truncated or absurdly nested document yields -1 and a one-line message saying what and where.
 */
#ifndef COLIBRI_JSON_H
#define COLIBRI_JSON_H

#include <stddef.h>
#include <stdint.h>

typedef enum { CB_JNULL, CB_JBOOL, CB_JNUM, CB_JSTR, CB_JARR, CB_JOBJ } cb_jtype;

typedef struct cb_json cb_json;
struct cb_json {
    cb_jtype type;
    int is_int;          /* number written without fraction/exponent and within int64 range */
    int boolean;
    double num;
    int64_t inum;
    char *str;           /* CB_JSTR: decoded UTF-8, NUL-terminated (may contain NULs if \u0000 was used) */
    size_t len;          /* string bytes, or child count for arrays and objects */
    char **keys;         /* CB_JOBJ: child keys, parallel to items */
    cb_json **items;     /* CB_JARR / CB_JOBJ children */
};

typedef struct cb_json_doc cb_json_doc;

/* Parse exactly one JSON value (surrounding whitespace allowed). Returns the document (free with
 * cb_json_free) or NULL with a message in err. */
cb_json_doc *cb_json_parse(const char *text, size_t n, char *err, size_t errlen);
cb_json *cb_json_root(cb_json_doc *doc);
void cb_json_free(cb_json_doc *doc);

/* Object member by key, NULL when absent or when obj is not an object. */
cb_json *cb_json_get(const cb_json *obj, const char *key);
/* An optional number field in [lo, hi] (def when absent or null). 0, or -1 with err naming the field. */
int cb_json_num_field(const cb_json *obj, const char *key, double def, double lo, double hi, double *out, char *err,
                      size_t errlen);

/* Growable byte buffer for writing events. Allocation failure sets `failed` and further writes are dropped. */
typedef struct {
    char *data;
    size_t len, cap;
    int failed;
} cb_buf;

void cb_buf_reset(cb_buf *b);
void cb_buf_free(cb_buf *b);
void cb_buf_put(cb_buf *b, const char *s, size_t n);
void cb_buf_puts(cb_buf *b, const char *s);
void cb_buf_printf(cb_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A JSON string literal (with quotes), escaping control characters, quotes and backslashes. */
void cb_buf_json_str(cb_buf *b, const char *s);

#endif
