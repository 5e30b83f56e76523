/* json.c: see json.h. Recursive descent with an explicit depth limit; all nodes live in one arena. */
#include "json.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define JSON_MAX_DEPTH 64

typedef struct arena_block {
    struct arena_block *next;
    size_t used, cap;
    max_align_t data[];
} arena_block;

struct cb_json_doc {
    arena_block *blocks;
    cb_json *root;
};

typedef struct {
    const char *s;
    size_t n, pos;
    cb_json_doc *doc;
    char *err;
    size_t errlen;
} parser;

static void *arena_alloc(cb_json_doc *doc, size_t size) {
    size = (size + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
    arena_block *b = doc->blocks;
    if (!b || b->cap - b->used < size) {
        size_t cap = size > 65536 ? size : 65536;
        b = malloc(sizeof(arena_block) + cap);
        if (!b) return NULL;
        b->cap = cap;
        b->used = 0;
        b->next = doc->blocks;
        doc->blocks = b;
    }
    void *p = (char *)b->data + b->used;
    b->used += size;
    return p;
}

static int fail(parser *p, const char *what) {
    if (p->err && p->errlen) snprintf(p->err, p->errlen, "invalid JSON at byte %zu: %s", p->pos, what);
    return -1;
}

static void skip_ws(parser *p) {
    while (p->pos < p->n) {
        char c = p->s[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static int parse_value(parser *p, cb_json **out, int depth);

static int hex4(parser *p, unsigned *out) {
    if (p->n - p->pos < 4) return fail(p, "truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p->s[p->pos++];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return fail(p, "bad hex digit in \\u escape");
    }
    *out = v;
    return 0;
}

static size_t put_utf8(char *dst, unsigned cp) {
    if (cp < 0x80) { dst[0] = (char)cp; return 1; }
    if (cp < 0x800) { dst[0] = (char)(0xC0 | (cp >> 6)); dst[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        dst[0] = (char)(0xE0 | (cp >> 12)); dst[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[2] = (char)(0x80 | (cp & 0x3F)); return 3;
    }
    dst[0] = (char)(0xF0 | (cp >> 18)); dst[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    dst[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); dst[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* p->pos is just past the opening quote. Decoded text is never longer than the raw text. */
static int parse_string(parser *p, char **out, size_t *out_len) {
    size_t start = p->pos, end = start;
    while (end < p->n && p->s[end] != '"') {
        if (p->s[end] == '\\') end++;
        end++;
    }
    if (end >= p->n) return fail(p, "unterminated string");
    char *dst = arena_alloc(p->doc, end - start + 1);
    if (!dst) return fail(p, "out of memory");
    size_t len = 0;
    while (p->pos < end) {
        unsigned char c = (unsigned char)p->s[p->pos];
        if (c < 0x20) return fail(p, "control character in string");
        if (c != '\\') { dst[len++] = (char)c; p->pos++; continue; }
        p->pos++;
        char e = p->s[p->pos++];
        switch (e) {
        case '"': dst[len++] = '"'; break;
        case '\\': dst[len++] = '\\'; break;
        case '/': dst[len++] = '/'; break;
        case 'b': dst[len++] = '\b'; break;
        case 'f': dst[len++] = '\f'; break;
        case 'n': dst[len++] = '\n'; break;
        case 'r': dst[len++] = '\r'; break;
        case 't': dst[len++] = '\t'; break;
        case 'u': {
            unsigned cp;
            if (p->pos > end || hex4(p, &cp)) return p->pos > end ? fail(p, "truncated \\u escape") : -1;
            if (p->pos > end) return fail(p, "truncated \\u escape");
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo;
                if (end - p->pos < 6 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u')
                    return fail(p, "unpaired UTF-16 surrogate");
                p->pos += 2;
                if (hex4(p, &lo)) return -1;
                if (lo < 0xDC00 || lo > 0xDFFF) return fail(p, "unpaired UTF-16 surrogate");
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                return fail(p, "unpaired UTF-16 surrogate");
            }
            len += put_utf8(dst + len, cp);
            break;
        }
        default: return fail(p, "bad escape in string");
        }
    }
    p->pos = end + 1;
    dst[len] = 0;
    *out = dst;
    *out_len = len;
    return 0;
}

static int parse_number(parser *p, cb_json *v) {
    size_t start = p->pos;
    int integral = 1;
    if (p->pos < p->n && p->s[p->pos] == '-') p->pos++;
    if (p->pos >= p->n) return fail(p, "truncated number");
    if (p->s[p->pos] == '0') {
        p->pos++;
    } else if (p->s[p->pos] >= '1' && p->s[p->pos] <= '9') {
        while (p->pos < p->n && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
    } else {
        return fail(p, "bad number");
    }
    if (p->pos < p->n && p->s[p->pos] == '.') {
        integral = 0;
        p->pos++;
        if (p->pos >= p->n || p->s[p->pos] < '0' || p->s[p->pos] > '9') return fail(p, "bad fraction");
        while (p->pos < p->n && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
    }
    if (p->pos < p->n && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
        integral = 0;
        p->pos++;
        if (p->pos < p->n && (p->s[p->pos] == '+' || p->s[p->pos] == '-')) p->pos++;
        if (p->pos >= p->n || p->s[p->pos] < '0' || p->s[p->pos] > '9') return fail(p, "bad exponent");
        while (p->pos < p->n && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
    }
    char tmp[64];
    size_t len = p->pos - start;
    if (len >= sizeof tmp) {
        /* Long literals: strtod needs a terminated copy; integers this long overflow int64 anyway. */
        char *big = malloc(len + 1);
        if (!big) return fail(p, "out of memory");
        memcpy(big, p->s + start, len);
        big[len] = 0;
        v->num = strtod(big, NULL);
        free(big);
        integral = 0;
    } else {
        memcpy(tmp, p->s + start, len);
        tmp[len] = 0;
        v->num = strtod(tmp, NULL);
        if (integral) {
            /* Exact int64 parse (doubles lose precision past 2^53, and file offsets can be that large). */
            const char *q = tmp;
            int neg = *q == '-';
            if (neg) q++;
            uint64_t acc = 0;
            for (; *q; q++) {
                unsigned d = (unsigned)(*q - '0');
                if (acc > (UINT64_MAX - d) / 10) { integral = 0; break; }
                acc = acc * 10 + d;
            }
            if (integral && (neg ? acc > (uint64_t)INT64_MAX + 1 : acc > (uint64_t)INT64_MAX)) integral = 0;
            if (integral) v->inum = neg ? (int64_t)(0 - acc) : (int64_t)acc;
        }
    }
    v->type = CB_JNUM;
    v->is_int = integral;
    return 0;
}

static int expect_word(parser *p, const char *w) {
    size_t n = strlen(w);
    if (p->n - p->pos < n || memcmp(p->s + p->pos, w, n) != 0) return fail(p, "unexpected token");
    p->pos += n;
    return 0;
}

/* Children are collected in a temporary malloc'd vector, then copied into the arena once the count is known. */
typedef struct {
    cb_json **items;
    char **keys;
    size_t n, cap;
} child_vec;

static int child_push(child_vec *v, cb_json *item, char *key) {
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 8;
        cb_json **items = realloc(v->items, cap * sizeof *items);
        if (!items) return -1;
        v->items = items;
        char **keys = realloc(v->keys, cap * sizeof *keys);
        if (!keys) return -1;
        v->keys = keys;
        v->cap = cap;
    }
    v->items[v->n] = item;
    v->keys[v->n] = key;
    v->n++;
    return 0;
}

static int finish_children(parser *p, cb_json *v, child_vec *cv, int with_keys) {
    v->len = cv->n;
    if (cv->n) {
        v->items = arena_alloc(p->doc, cv->n * sizeof(cb_json *));
        if (!v->items) return fail(p, "out of memory");
        memcpy(v->items, cv->items, cv->n * sizeof(cb_json *));
        if (with_keys) {
            v->keys = arena_alloc(p->doc, cv->n * sizeof(char *));
            if (!v->keys) return fail(p, "out of memory");
            memcpy(v->keys, cv->keys, cv->n * sizeof(char *));
        }
    }
    return 0;
}

static int parse_container(parser *p, cb_json *v, int depth, int is_obj) {
    char close = is_obj ? '}' : ']';
    child_vec cv = {0};
    int rc = -1;
    p->pos++;
    skip_ws(p);
    if (p->pos < p->n && p->s[p->pos] == close) {
        p->pos++;
        rc = 0;
        goto done;
    }
    for (;;) {
        char *key = NULL;
        skip_ws(p);
        if (is_obj) {
            size_t key_len;
            if (p->pos >= p->n || p->s[p->pos] != '"') { fail(p, "expected a string key"); goto done; }
            p->pos++;
            if (parse_string(p, &key, &key_len)) goto done;
            skip_ws(p);
            if (p->pos >= p->n || p->s[p->pos] != ':') { fail(p, "expected ':' after key"); goto done; }
            p->pos++;
        }
        cb_json *child;
        if (parse_value(p, &child, depth + 1)) goto done;
        if (child_push(&cv, child, key)) { fail(p, "out of memory"); goto done; }
        skip_ws(p);
        if (p->pos >= p->n) { fail(p, is_obj ? "unterminated object" : "unterminated array"); goto done; }
        char c = p->s[p->pos++];
        if (c == close) break;
        if (c != ',') { fail(p, is_obj ? "expected ',' or '}'" : "expected ',' or ']'"); goto done; }
    }
    rc = 0;
done:
    if (rc == 0) rc = finish_children(p, v, &cv, is_obj);
    free(cv.items);
    free(cv.keys);
    return rc;
}

static int parse_value(parser *p, cb_json **out, int depth) {
    if (depth > JSON_MAX_DEPTH) return fail(p, "nested too deeply");
    skip_ws(p);
    if (p->pos >= p->n) return fail(p, "unexpected end of input");
    cb_json *v = arena_alloc(p->doc, sizeof *v);
    if (!v) return fail(p, "out of memory");
    memset(v, 0, sizeof *v);
    *out = v;
    char c = p->s[p->pos];
    switch (c) {
    case '{': v->type = CB_JOBJ; return parse_container(p, v, depth, 1);
    case '[': v->type = CB_JARR; return parse_container(p, v, depth, 0);
    case '"': v->type = CB_JSTR; p->pos++; return parse_string(p, &v->str, &v->len);
    case 't': v->type = CB_JBOOL; v->boolean = 1; return expect_word(p, "true");
    case 'f': v->type = CB_JBOOL; return expect_word(p, "false");
    case 'n': v->type = CB_JNULL; return expect_word(p, "null");
    default:
        if (c == '-' || (c >= '0' && c <= '9')) return parse_number(p, v);
        return fail(p, "unexpected character");
    }
}

cb_json_doc *cb_json_parse(const char *text, size_t n, char *err, size_t errlen) {
    if (err && errlen) err[0] = 0;
    cb_json_doc *doc = calloc(1, sizeof *doc);
    if (!doc) {
        if (err && errlen) snprintf(err, errlen, "out of memory");
        return NULL;
    }
    parser p = {text, n, 0, doc, err, errlen};
    if (!text) {
        fail(&p, "no input");
        cb_json_free(doc);
        return NULL;
    }
    if (parse_value(&p, &doc->root, 0)) {
        cb_json_free(doc);
        return NULL;
    }
    skip_ws(&p);
    if (p.pos != n) {
        fail(&p, "trailing characters after the value");
        cb_json_free(doc);
        return NULL;
    }
    return doc;
}

cb_json *cb_json_root(cb_json_doc *doc) { return doc ? doc->root : NULL; }

void cb_json_free(cb_json_doc *doc) {
    if (!doc) return;
    arena_block *b = doc->blocks;
    while (b) {
        arena_block *next = b->next;
        free(b);
        b = next;
    }
    free(doc);
}

cb_json *cb_json_get(const cb_json *obj, const char *key) {
    if (!obj || obj->type != CB_JOBJ) return NULL;
    for (size_t i = 0; i < obj->len; i++)
        if (strcmp(obj->keys[i], key) == 0) return obj->items[i];
    return NULL;
}

/* ---- output buffer ---- */

void cb_buf_reset(cb_buf *b) { b->len = 0; b->failed = 0; }

void cb_buf_free(cb_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

static int buf_reserve(cb_buf *b, size_t extra) {
    if (b->failed) return -1;
    if (b->len + extra + 1 <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1) cap *= 2;
    char *d = realloc(b->data, cap);
    if (!d) { b->failed = 1; return -1; }
    b->data = d;
    b->cap = cap;
    return 0;
}

void cb_buf_put(cb_buf *b, const char *s, size_t n) {
    if (buf_reserve(b, n)) return;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = 0;
}

void cb_buf_puts(cb_buf *b, const char *s) { cb_buf_put(b, s, strlen(s)); }

void cb_buf_printf(cb_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char small[256];
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) { cb_buf_put(b, small, (size_t)n); return; }
    if (buf_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* Length of the valid UTF-8 sequence at q (1-4), or 0 when it is not one (overlong, surrogate, truncated). */
static int utf8_len(const unsigned char *q) {
    if (q[0] < 0x80) return 1;
    int n = q[0] >= 0xC2 && q[0] <= 0xDF ? 2 : q[0] >= 0xE0 && q[0] <= 0xEF ? 3 : q[0] >= 0xF0 && q[0] <= 0xF4 ? 4 : 0;
    if (!n) return 0;
    for (int i = 1; i < n; i++)
        if ((q[i] & 0xC0) != 0x80) return 0;
    if (n == 3 && ((q[0] == 0xE0 && q[1] < 0xA0) || (q[0] == 0xED && q[1] >= 0xA0))) return 0;
    if (n == 4 && ((q[0] == 0xF0 && q[1] < 0x90) || (q[0] == 0xF4 && q[1] >= 0x90))) return 0;
    return n;
}

void cb_buf_json_str(cb_buf *b, const char *s) {
    cb_buf_put(b, "\"", 1);
    for (const unsigned char *q = (const unsigned char *)s; *q;) {
        if (*q == '"') cb_buf_put(b, "\\\"", 2);
        else if (*q == '\\') cb_buf_put(b, "\\\\", 2);
        else if (*q == '\n') cb_buf_put(b, "\\n", 2);
        else if (*q < 0x20) cb_buf_printf(b, "\\u%04x", *q);
        else {
            /* Events must stay valid UTF-8 whatever bytes a request or a path carried. */
            int n = utf8_len(q);
            if (n) cb_buf_put(b, (const char *)q, (size_t)n);
            else cb_buf_puts(b, "\\ufffd");
            q += n ? n : 1;
            continue;
        }
        q++;
    }
    cb_buf_put(b, "\"", 1);
}

int cb_json_num_field(const cb_json *obj, const char *key, double def, double lo, double hi, double *out, char *err,
                      size_t errlen) {
    cb_json *v = cb_json_get(obj, key);
    if (!v || v->type == CB_JNULL) {
        *out = def;
        return 0;
    }
    if (v->type != CB_JNUM || !(v->num >= lo && v->num <= hi)) {
        snprintf(err, errlen, "field \"%s\" must be a number in [%g, %g]", key, lo, hi);
        return -1;
    }
    *out = v->num;
    return 0;
}
