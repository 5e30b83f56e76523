/* qcontainer.c: reading and validating the colibri-quant stamp of every shard (see qcontainer.h). */
#include "qcontainer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

#define QC_NAME "colibri-quant"
#define QC_VERSION "1"
#define QC_MAX_HEADER (100u * 1024u * 1024u)

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

void cb_qc_close(cb_qcontainer *c) {
    if (!c) return;
    for (int i = 0; i < c->n; i++) free(c->entries[i].name);
    free(c->entries);
    memset(c, 0, sizeof *c);
}

static int entry_cmp(const void *a, const void *b) {
    return strcmp(((const cb_qc_entry *)a)->name, ((const cb_qc_entry *)b)->name);
}

const cb_qc_entry *cb_qc_find(const cb_qcontainer *c, const char *name) {
    cb_qc_entry key = {.name = (char *)name};
    return c->n ? bsearch(&key, c->entries, (size_t)c->n, sizeof key, entry_cmp) : NULL;
}

/* The shard's parsed header (NULL with a message on failure). */
static cb_json_doc *read_shard_header(const cb_st_index *idx, int shard, char *err, size_t errlen) {
    unsigned char lenbuf[8];
    if (cb_st_pread(idx, shard, lenbuf, 8, 0, err, errlen)) return NULL;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | lenbuf[i];
    if (hlen > QC_MAX_HEADER) {
        snprintf(err, errlen, "%s: corrupted safetensors header length", idx->shard_paths[shard]);
        return NULL;
    }
    char *text = malloc(hlen + 1);
    if (!text) {
        snprintf(err, errlen, "%s: out of memory reading the header", idx->shard_paths[shard]);
        return NULL;
    }
    cb_json_doc *doc = NULL;
    if (cb_st_pread(idx, shard, text, hlen, 8, err, errlen) == 0) {
        char e[200];
        doc = cb_json_parse(text, hlen, e, sizeof e);
        if (!doc) snprintf(err, errlen, "%s: corrupted safetensors header: %s", idx->shard_paths[shard], e);
    }
    free(text);
    return doc;
}

static const cb_json *metadata_of(cb_json_doc *doc) {
    const cb_json *m = cb_json_get(cb_json_root(doc), "__metadata__");
    return m && m->type == CB_JOBJ ? m : NULL;
}

static int is_stamped(const cb_json *meta) {
    return meta && (cb_json_get(meta, "colibri.container") || cb_json_get(meta, "colibri.version") ||
                    cb_json_get(meta, "colibri.schemes"));
}

static const char *meta_str(const cb_json *meta, const char *key) {
    const cb_json *v = cb_json_get(meta, key);
    return v && v->type == CB_JSTR ? v->str : NULL;
}

/* Stored name for a quantized part: the source name without a trailing ".weight", plus suffix. */
static void part_name(char *out, size_t n, const char *logical, const char *suffix) {
    size_t len = strlen(logical);
    if (len >= 7 && strcmp(logical + len - 7, ".weight") == 0) len -= 7;
    snprintf(out, n, "%.*s%s", (int)len, logical, suffix);
}

typedef struct {
    const cb_st_index *idx;
    int shard;
    unsigned char *claimed;      /* per index tensor */
    char *err;
    size_t errlen;
} shard_ctx;

static const cb_tensor *take(shard_ctx *s, const char *stored, const char *logical, const char *scheme) {
    const cb_tensor *t = cb_st_find(s->idx, stored);
    const char *path = s->idx->shard_paths[s->shard];
    if (!t || t->shard != s->shard) {
        snprintf(s->err, s->errlen, "%s: tensor %s is marked %s but %s is missing", path, logical, scheme, stored);
        return NULL;
    }
    size_t i = (size_t)(t - s->idx->tensors);
    if (s->claimed[i]) {
        snprintf(s->err, s->errlen, "%s: tensor %s is claimed twice by the scheme map", path, stored);
        return NULL;
    }
    s->claimed[i] = 1;
    return t;
}

static int resolve_entry(shard_ctx *s, const char *logical, const char *scheme, cb_qc_entry *e) {
    const char *path = s->idx->shard_paths[s->shard];
    memset(e, 0, sizeof *e);
    int q8 = strcmp(scheme, "int8-row") == 0, q4 = strcmp(scheme, "int4-g64") == 0;
    if (q8 || q4) {
        char qn[1024], sn[1024];
        part_name(qn, sizeof qn, logical, ".qweight");
        part_name(sn, sizeof sn, logical, ".scales");
        const cb_tensor *qw = take(s, qn, logical, scheme), *sc = qw ? take(s, sn, logical, scheme) : NULL;
        if (!qw || !sc) return -1;
        if (strcmp(qw->dtype_name, q8 ? "I8" : "U8") != 0 || qw->ndim != 2 || qw->shape[0] < 1 ||
            qw->shape[1] < 1 || qw->shape[0] > INT32_MAX || qw->shape[1] > CB_Q_MAX_COLS) {
            snprintf(s->err, s->errlen, "%s: %s is %s with %d dims, scheme %s stores a 2-D %s matrix", path, qn,
                     qw->dtype_name, qw->ndim, scheme, q8 ? "I8" : "U8");
            return -1;
        }
        int64_t rows = qw->shape[0], cols = q8 ? qw->shape[1] : 2 * qw->shape[1];
        int64_t want_groups = q8 ? 0 : cols / CB_Q4_GROUP;
        int scales_ok = strcmp(sc->dtype_name, "F16") == 0 && sc->shape[0] == rows &&
                        (q8 ? sc->ndim == 1 : (sc->ndim == 2 && sc->shape[1] == want_groups && cols % 64 == 0));
        if (!scales_ok || cols > CB_Q_MAX_COLS) {
            snprintf(s->err, s->errlen, "%s: %s does not match scheme %s on a [%lld, %lld] matrix", path, sn, scheme,
                     (long long)rows, (long long)cols);
            return -1;
        }
        e->kind = q8 ? CB_QC_INT8_ROW : CB_QC_INT4_G64;
        e->rows = (int)rows;
        e->cols = (int)cols;
        e->qweight = qw;
        e->scales = sc;
    } else if (!strcmp(scheme, "f32") || !strcmp(scheme, "bf16") || !strcmp(scheme, "copy")) {
        const cb_tensor *t = take(s, logical, logical, scheme);
        if (!t) return -1;
        const char *want = !strcmp(scheme, "f32") ? "F32" : !strcmp(scheme, "bf16") ? "BF16" : NULL;
        if (want && strcmp(t->dtype_name, want) != 0) {
            snprintf(s->err, s->errlen, "%s: %s is %s but its scheme %s stores %s", path, logical, t->dtype_name,
                     scheme, want);
            return -1;
        }
        e->kind = !strcmp(scheme, "f32") ? CB_QC_F32 : !strcmp(scheme, "bf16") ? CB_QC_BF16 : CB_QC_COPY;
        e->data = t;
    } else {
        snprintf(s->err, s->errlen, "%s: tensor %s has unknown scheme %.40s (upgrade colibri, or reconvert)", path,
                 logical, scheme);
        return -1;
    }
    e->name = dup_str(logical);
    if (!e->name) {
        snprintf(s->err, s->errlen, "out of memory");
        return -1;
    }
    return 0;
}

/* Validate one stamped shard and append its entries. */
static int read_stamped_shard(cb_qcontainer *c, int *cap, shard_ctx *s, const cb_json *meta) {
    const char *path = s->idx->shard_paths[s->shard];
    const char *name = meta_str(meta, "colibri.container"), *version = meta_str(meta, "colibri.version");
    if (!name || strcmp(name, QC_NAME) != 0) {
        snprintf(s->err, s->errlen, "%s: __metadata__ colibri.container=%.40s is not a format colibri knows", path,
                 name ? name : "(missing)");
        return -1;
    }
    if (!version || strcmp(version, QC_VERSION) != 0) {
        snprintf(s->err, s->errlen, "%s: colibri-quant version %.20s is not supported (this engine reads %s)", path,
                 version ? version : "(missing)", QC_VERSION);
        return -1;
    }
    const char *schemes = meta_str(meta, "colibri.schemes");
    char e[200];
    cb_json_doc *doc = schemes ? cb_json_parse(schemes, strlen(schemes), e, sizeof e) : NULL;
    const cb_json *map = doc ? cb_json_root(doc) : NULL;
    if (!map || map->type != CB_JOBJ) {
        snprintf(s->err, s->errlen, "%s: __metadata__ colibri.schemes is not a JSON object of tensor -> scheme", path);
        cb_json_free(doc);
        return -1;
    }
    int rc = 0;
    for (size_t i = 0; i < map->len && rc == 0; i++) {
        if (map->items[i]->type != CB_JSTR) {
            snprintf(s->err, s->errlen, "%s: colibri.schemes entry %s is not a string", path, map->keys[i]);
            rc = -1;
            break;
        }
        if (c->n == *cap) {
            int ncap = *cap ? 2 * *cap : 256;
            cb_qc_entry *grown = realloc(c->entries, (size_t)ncap * sizeof *grown);
            if (!grown) {
                snprintf(s->err, s->errlen, "out of memory");
                rc = -1;
                break;
            }
            c->entries = grown;
            *cap = ncap;
        }
        rc = resolve_entry(s, map->keys[i], map->items[i]->str, &c->entries[c->n]);
        if (rc == 0) c->n++;
    }
    cb_json_free(doc);
    if (rc) return -1;
    for (int t = 0; t < s->idx->n_tensors; t++) {
        if (s->idx->tensors[t].shard == s->shard && !s->claimed[t]) {
            snprintf(s->err, s->errlen, "%s: tensor %s is not named in the colibri.schemes map", path,
                     s->idx->tensors[t].name);
            return -1;
        }
    }
    return 0;
}

int cb_qc_open(cb_qcontainer *c, const cb_st_index *idx, char *err, size_t errlen) {
    memset(c, 0, sizeof *c);
    int stamped = 0, plain = -1, first_stamped = -1;
    for (int s = 0; s < idx->n_shards; s++) {
        cb_json_doc *doc = read_shard_header(idx, s, err, errlen);
        if (!doc) return -1;
        if (is_stamped(metadata_of(doc))) {
            stamped++;
            if (first_stamped < 0) first_stamped = s;
        } else if (plain < 0) {
            plain = s;
        }
        cb_json_free(doc);
    }
    if (stamped == 0) return 1;
    if (plain >= 0) {
        snprintf(err, errlen, "%s: shard has no colibri-quant stamp while %s has (reconvert into an empty directory)",
                 idx->shard_paths[plain], idx->shard_paths[first_stamped]);
        return -1;
    }
    unsigned char *claimed = calloc((size_t)idx->n_tensors + 1, 1);
    if (!claimed) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int cap = 0, rc = 0;
    for (int s = 0; s < idx->n_shards && rc == 0; s++) {
        cb_json_doc *doc = read_shard_header(idx, s, err, errlen);
        if (!doc) {
            rc = -1;
            break;
        }
        shard_ctx ctx = {idx, s, claimed, err, errlen};
        rc = read_stamped_shard(c, &cap, &ctx, metadata_of(doc));
        cb_json_free(doc);
    }
    free(claimed);
    if (rc) {
        cb_qc_close(c);
        return -1;
    }
    qsort(c->entries, (size_t)c->n, sizeof *c->entries, entry_cmp);
    for (int i = 1; i < c->n; i++) {
        if (strcmp(c->entries[i - 1].name, c->entries[i].name) == 0) {
            snprintf(err, errlen, "tensor %s appears in two shards (remove the duplicate shard)", c->entries[i].name);
            cb_qc_close(c);
            return -1;
        }
    }
    return 0;
}

int cb_qc_span(const cb_qcontainer *c, const char *const *names, int n, int *shard, uint64_t *begin,
               uint64_t *end, char *err, size_t errlen) {
    const cb_tensor *parts[64];
    int np = 0;
    for (int i = 0; i < n; i++) {
        const cb_qc_entry *e = cb_qc_find(c, names[i]);
        if (!e) {
            snprintf(err, errlen, "the container has no tensor %s (reconvert the model)", names[i]);
            return -1;
        }
        const cb_tensor *own[2] = {e->data ? e->data : e->qweight, e->data ? NULL : e->scales};
        for (int k = 0; k < 2; k++) {
            if (!own[k]) continue;
            if (np == 64) {
                snprintf(err, errlen, "too many tensors in one span");
                return -1;
            }
            /* Insertion sort by offset: a handful of parts. */
            int j = np++;
            while (j > 0 && parts[j - 1]->offset > own[k]->offset) {
                parts[j] = parts[j - 1];
                j--;
            }
            parts[j] = own[k];
        }
    }
    if (np == 0) {
        snprintf(err, errlen, "no tensors given");
        return -1;
    }
    for (int i = 1; i < np; i++) {
        if (parts[i]->shard != parts[0]->shard || parts[i - 1]->offset + parts[i - 1]->nbytes != parts[i]->offset) {
            snprintf(err, errlen, "%s and %s are not adjacent in one shard (reconvert the model)", parts[i - 1]->name,
                     parts[i]->name);
            return -1;
        }
    }
    *shard = parts[0]->shard;
    *begin = parts[0]->offset;
    *end = parts[np - 1]->offset + parts[np - 1]->nbytes;
    return 0;
}

int cb_qc_matrix(const cb_qc_entry *e, const void *qweight, const void *scales, cb_qmatrix *out) {
    if (!e || (e->kind != CB_QC_INT8_ROW && e->kind != CB_QC_INT4_G64)) return -1;
    *out = (cb_qmatrix){e->kind == CB_QC_INT8_ROW ? CB_Q8_ROW : CB_Q4_G64, e->rows, e->cols, qweight, scales};
    return cb_qmatrix_check(out);
}
