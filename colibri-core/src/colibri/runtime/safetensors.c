/* safetensors.c: see safetensors.h. */
#include "safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"

#define MAX_HEADER_BYTES (100u * 1024u * 1024u)

static uint32_t name_hash(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

const cb_tensor *cb_st_find(const cb_st_index *idx, const char *name) {
    if (!idx->table_size) return NULL;
    uint32_t mask = (uint32_t)idx->table_size - 1;
    for (uint32_t h = name_hash(name) & mask;; h = (h + 1) & mask) {
        int i = idx->table[h];
        if (i < 0) return NULL;
        if (strcmp(idx->tensors[i].name, name) == 0) return &idx->tensors[i];
    }
}

static int path_join(char *out, size_t n, const char *dir, const char *file) {
    int w = snprintf(out, n, "%s/%s", dir, file);
    return w < 0 || (size_t)w >= n ? -1 : 0;
}

static int dtype_from_name(const char *name, cb_dtype *dt, uint64_t *size) {
    if (strcmp(name, "F32") == 0) { *dt = CB_F32; *size = 4; return 1; }
    if (strcmp(name, "BF16") == 0) { *dt = CB_BF16; *size = 2; return 1; }
    if (strcmp(name, "F16") == 0) { *dt = CB_F16; *size = 2; return 1; }
    /* Other dtypes are indexed (a checkpoint may carry tensors the engine never reads), but flagged. F8_E4M3
     * weights with a block-scale companion are read through fp8.h (cb_load_linear and the expert store do it),
     * never as a plain float tensor. */
    static const struct { const char *n; uint64_t s; } other[] = {
        {"F64", 8}, {"I64", 8}, {"U64", 8}, {"I32", 4}, {"U32", 4}, {"I16", 2}, {"U16", 2},
        {"I8", 1}, {"U8", 1}, {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
        {"F4", 0},   /* float4_e2m1fn_x2: two values per byte, the shape counts values (fp4.h) */
    };
    for (size_t i = 0; i < sizeof other / sizeof other[0]; i++)
        if (strcmp(name, other[i].n) == 0) { *dt = CB_F32; *size = other[i].s; return 0; }
    return -1;
}

static int add_tensor(cb_st_index *idx, cb_tensor *t, int *cap) {
    if (idx->n_tensors == *cap) {
        int ncap = *cap ? *cap * 2 : 256;
        cb_tensor *nt = realloc(idx->tensors, (size_t)ncap * sizeof *nt);
        if (!nt) return -1;
        idx->tensors = nt;
        *cap = ncap;
    }
    idx->tensors[idx->n_tensors++] = *t;
    return 0;
}

static int cmp_by_offset(const void *a, const void *b) {
    const cb_tensor *x = *(const cb_tensor *const *)a, *y = *(const cb_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset ? 1 : 0;
}

/* No two tensors of one shard share bytes: an overlapping pair would make one tensor's values another's. */
static int check_overlaps(cb_st_index *idx, int first, const char *path, char *err, size_t errlen) {
    int n = idx->n_tensors - first;
    if (n < 2) return 0;
    const cb_tensor **order = malloc((size_t)n * sizeof *order);
    if (!order) {
        snprintf(err, errlen, "%s: out of memory", path);
        return -1;
    }
    int m = 0;
    for (int i = first; i < idx->n_tensors; i++)
        if (idx->tensors[i].nbytes) order[m++] = &idx->tensors[i];
    qsort(order, (size_t)m, sizeof *order, cmp_by_offset);
    int rc = 0;
    for (int i = 1; i < m && !rc; i++) {
        const cb_tensor *prev = order[i - 1], *cur = order[i];
        if (cur->offset < prev->offset + prev->nbytes) {
            snprintf(err, errlen, "%s: tensor %s (bytes %llu-%llu) overlaps tensor %s (bytes %llu-%llu)", path,
                     cur->name, (unsigned long long)cur->offset, (unsigned long long)(cur->offset + cur->nbytes),
                     prev->name, (unsigned long long)prev->offset,
                     (unsigned long long)(prev->offset + prev->nbytes));
            rc = -1;
        }
    }
    free(order);
    return rc;
}

/* Parse and validate one shard's header, appending its tensors. */
static int index_shard(cb_st_index *idx, int shard, int *cap, char *err, size_t errlen) {
    const char *path = idx->shard_paths[shard];
    int fd = idx->fds[shard];
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(err, errlen, "%s: cannot stat: %s", path, strerror(errno));
        return -1;
    }
    uint64_t file_size = (uint64_t)st.st_size;
    unsigned char lenbuf[8];
    if (file_size < 8 || pread(fd, lenbuf, 8, 0) != 8) {
        snprintf(err, errlen, "%s: truncated safetensors file (%llu bytes, no header length)", path,
                 (unsigned long long)file_size);
        return -1;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | lenbuf[i];
    if (hlen > MAX_HEADER_BYTES || hlen > file_size - 8) {
        snprintf(err, errlen, "%s: corrupted safetensors header (header length %llu, file size %llu)", path,
                 (unsigned long long)hlen, (unsigned long long)file_size);
        return -1;
    }
    char *text = malloc(hlen + 1);
    if (!text) {
        snprintf(err, errlen, "%s: out of memory reading header", path);
        return -1;
    }
    char e[256];
    if (cb_st_pread(idx, shard, text, hlen, 8, e, sizeof e)) {
        snprintf(err, errlen, "%s", e);
        free(text);
        return -1;
    }
    cb_json_doc *doc = cb_json_parse(text, hlen, e, sizeof e);
    free(text);
    if (!doc) {
        snprintf(err, errlen, "%s: corrupted safetensors header: %s", path, e);
        return -1;
    }
    int rc = -1;
    cb_json *root = cb_json_root(doc);
    uint64_t data_start = 8 + hlen, data_size = file_size - data_start;
    if (root->type != CB_JOBJ) {
        snprintf(err, errlen, "%s: corrupted safetensors header: not a JSON object", path);
        goto out;
    }
    int first = idx->n_tensors;
    for (size_t i = 0; i < root->len; i++) {
        const char *name = root->keys[i];
        cb_json *v = root->items[i];
        if (strcmp(name, "__metadata__") == 0) {
            if (v->type != CB_JOBJ) {
                snprintf(err, errlen, "%s: corrupted safetensors header: __metadata__ is not an object", path);
                goto out;
            }
            continue;
        }
        if (v->type != CB_JOBJ) {
            snprintf(err, errlen, "%s: tensor %s: header entry is not an object", path, name);
            goto out;
        }
        cb_json *dt = cb_json_get(v, "dtype"), *shape = cb_json_get(v, "shape");
        cb_json *offs = cb_json_get(v, "data_offsets");
        if (!dt || dt->type != CB_JSTR || !shape || shape->type != CB_JARR || !offs || offs->type != CB_JARR ||
            offs->len != 2 || !offs->items[0]->is_int || !offs->items[1]->is_int) {
            snprintf(err, errlen, "%s: tensor %s: header entry lacks dtype, shape or data_offsets", path, name);
            goto out;
        }
        cb_tensor t;
        memset(&t, 0, sizeof t);
        uint64_t esize;
        int known = dtype_from_name(dt->str, &t.dtype, &esize);
        if (known < 0) {
            snprintf(err, errlen, "%s: tensor %s: unknown dtype %.20s", path, name, dt->str);
            goto out;
        }
        t.supported = known;
        snprintf(t.dtype_name, sizeof t.dtype_name, "%s", dt->str);
        if (shape->len > CB_MAX_DIMS) {
            snprintf(err, errlen, "%s: tensor %s: %zu dimensions (at most %d)", path, name, shape->len,
                     CB_MAX_DIMS);
            goto out;
        }
        t.ndim = (int)shape->len;
        uint64_t numel = 1;
        for (int d = 0; d < t.ndim; d++) {
            cb_json *s = shape->items[d];
            if (!s->is_int || s->inum < 0 || s->inum > ((int64_t)1 << 40)) {
                snprintf(err, errlen, "%s: tensor %s: bad shape", path, name);
                goto out;
            }
            t.shape[d] = s->inum;
            if (s->inum && numel > UINT64_MAX / 16 / (uint64_t)s->inum) {
                snprintf(err, errlen, "%s: tensor %s: shape overflows", path, name);
                goto out;
            }
            numel *= (uint64_t)s->inum;
        }
        int64_t b = offs->items[0]->inum, en = offs->items[1]->inum;
        if (b < 0 || en < b || (uint64_t)en > data_size) {
            snprintf(err, errlen,
                     "%s: tensor %s: data_offsets [%lld, %lld] outside the data section (%llu bytes); "
                     "the file is truncated or corrupted",
                     path, name, (long long)b, (long long)en, (unsigned long long)data_size);
            goto out;
        }
        uint64_t need = esize ? numel * esize : (numel + 1) / 2;
        if ((uint64_t)(en - b) != need) {
            snprintf(err, errlen, "%s: tensor %s: %lld bytes stored but %s x shape needs %llu", path, name,
                     (long long)(en - b), t.dtype_name, (unsigned long long)need);
            goto out;
        }
        t.offset = data_start + (uint64_t)b;
        t.nbytes = (uint64_t)(en - b);
        t.shard = shard;
        t.name = strdup(name);
        if (!t.name || add_tensor(idx, &t, cap)) {
            free(t.name);
            snprintf(err, errlen, "%s: out of memory", path);
            goto out;
        }
    }
    rc = check_overlaps(idx, first, path, err, errlen);
out:
    cb_json_free(doc);
    return rc;
}

static int add_shard(cb_st_index *idx, const char *path, char *err, size_t errlen) {
    for (int i = 0; i < idx->n_shards; i++)
        if (strcmp(idx->shard_paths[i], path) == 0) return 0;
    char **np = realloc(idx->shard_paths, (size_t)(idx->n_shards + 1) * sizeof *np);
    if (!np) goto oom;
    idx->shard_paths = np;
    int *nf = realloc(idx->fds, (size_t)(idx->n_shards + 1) * sizeof *nf);
    if (!nf) goto oom;
    idx->fds = nf;
    char *copy = strdup(path);
    if (!copy) goto oom;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "%s: cannot open shard: %s", path, strerror(errno));
        free(copy);
        return -1;
    }
    idx->shard_paths[idx->n_shards] = copy;
    idx->fds[idx->n_shards] = fd;
    idx->n_shards++;
    return 0;
oom:
    snprintf(err, errlen, "out of memory");
    return -1;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int shards_from_index(cb_st_index *idx, const char *dir, const char *index_path, char *err,
                             size_t errlen) {
    FILE *f = fopen(index_path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: cannot open: %s", index_path, strerror(errno));
        return -1;
    }
    char *text = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 65536 > cap) {
            cap = cap ? cap * 2 : 131072;
            if (cap > MAX_HEADER_BYTES * 2u) { fclose(f); free(text); snprintf(err, errlen, "%s: too large", index_path); return -1; }
            char *nt = realloc(text, cap);
            if (!nt) { fclose(f); free(text); snprintf(err, errlen, "out of memory"); return -1; }
            text = nt;
        }
        size_t r = fread(text + len, 1, cap - len, f);
        len += r;
        if (r == 0) break;
    }
    fclose(f);
    char e[256];
    cb_json_doc *doc = cb_json_parse(text, len, e, sizeof e);
    free(text);
    if (!doc) {
        snprintf(err, errlen, "%s: %s", index_path, e);
        return -1;
    }
    cb_json *wm = cb_json_get(cb_json_root(doc), "weight_map");
    int rc = -1;
    if (!wm || wm->type != CB_JOBJ) {
        snprintf(err, errlen, "%s: no weight_map object", index_path);
        goto out;
    }
    char **names = calloc(wm->len ? wm->len : 1, sizeof *names);
    if (!names) { snprintf(err, errlen, "out of memory"); goto out; }
    for (size_t i = 0; i < wm->len; i++) {
        if (wm->items[i]->type != CB_JSTR || strchr(wm->items[i]->str, '/') || wm->items[i]->str[0] == '.') {
            snprintf(err, errlen, "%s: weight_map[%s] is not a shard file name in the directory", index_path,
                     wm->keys[i]);
            free(names);
            goto out;
        }
        names[i] = wm->items[i]->str;
    }
    qsort(names, wm->len, sizeof *names, cmp_str);
    for (size_t i = 0; i < wm->len; i++) {
        if (i && strcmp(names[i], names[i - 1]) == 0) continue;
        char path[4096];
        if (path_join(path, sizeof path, dir, names[i]) || add_shard(idx, path, err, errlen)) {
            if (!err[0]) snprintf(err, errlen, "%s: path too long", dir);
            free(names);
            goto out;
        }
    }
    free(names);
    rc = 0;
out:
    cb_json_free(doc);
    return rc;
}

static int shards_from_dir(cb_st_index *idx, const char *dir, char *err, size_t errlen) {
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(err, errlen, "%s: cannot open model directory: %s", dir, strerror(errno));
        return -1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    int rc = -1;
    while ((de = readdir(d))) {
        size_t l = strlen(de->d_name);
        if (l <= 12 || strcmp(de->d_name + l - 12, ".safetensors") != 0) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            char **nn = realloc(names, cap * sizeof *nn);
            if (!nn) { snprintf(err, errlen, "out of memory"); goto out; }
            names = nn;
        }
        if (!(names[n] = strdup(de->d_name))) { snprintf(err, errlen, "out of memory"); goto out; }
        n++;
    }
    if (!n) {
        snprintf(err, errlen, "%s: no *.safetensors files and no model.safetensors.index.json", dir);
        goto out;
    }
    qsort(names, n, sizeof *names, cmp_str);
    for (size_t i = 0; i < n; i++) {
        char path[4096];
        if (path_join(path, sizeof path, dir, names[i])) { snprintf(err, errlen, "%s: path too long", dir); goto out; }
        if (add_shard(idx, path, err, errlen)) goto out;
    }
    rc = 0;
out:
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    closedir(d);
    return rc;
}

static int build_table(cb_st_index *idx, char *err, size_t errlen) {
    int size = 16;
    while (size < idx->n_tensors * 2) size *= 2;
    idx->table = malloc((size_t)size * sizeof(int));
    if (!idx->table) { snprintf(err, errlen, "out of memory"); return -1; }
    idx->table_size = size;
    for (int i = 0; i < size; i++) idx->table[i] = -1;
    uint32_t mask = (uint32_t)size - 1;
    for (int i = 0; i < idx->n_tensors; i++) {
        const char *name = idx->tensors[i].name;
        uint32_t h = name_hash(name) & mask;
        while (idx->table[h] >= 0) {
            const cb_tensor *other = &idx->tensors[idx->table[h]];
            if (strcmp(other->name, name) == 0) {
                snprintf(err, errlen, "tensor %s appears in both %s and %s", name,
                         idx->shard_paths[other->shard], idx->shard_paths[idx->tensors[i].shard]);
                return -1;
            }
            h = (h + 1) & mask;
        }
        idx->table[h] = i;
    }
    return 0;
}

int cb_st_open(cb_st_index *idx, const char *model_dir, char *err, size_t errlen) {
    memset(idx, 0, sizeof *idx);
    err[0] = 0;
    char index_path[4096];
    struct stat st;
    int rc;
    if (path_join(index_path, sizeof index_path, model_dir, "model.safetensors.index.json")) {
        snprintf(err, errlen, "%s: path too long", model_dir);
        return -1;
    }
    if (stat(index_path, &st) == 0) rc = shards_from_index(idx, model_dir, index_path, err, errlen);
    else rc = shards_from_dir(idx, model_dir, err, errlen);
    int cap = 0;
    for (int s = 0; rc == 0 && s < idx->n_shards; s++) rc = index_shard(idx, s, &cap, err, errlen);
    if (rc == 0) rc = build_table(idx, err, errlen);
    if (rc) cb_st_close(idx);
    return rc;
}

int cb_st_add_file(cb_st_index *idx, const char *path, char *err, size_t errlen) {
    for (int i = 0; i < idx->n_shards; i++)
        if (strcmp(idx->shard_paths[i], path) == 0) return 0;   /* the directory's own listing had it */
    int cap = idx->n_tensors;   /* the tensor array is exactly full: add_tensor grows it */
    free(idx->table);
    idx->table = NULL;
    int rc = add_shard(idx, path, err, errlen);
    if (rc == 0) rc = index_shard(idx, idx->n_shards - 1, &cap, err, errlen);
    if (rc == 0) rc = build_table(idx, err, errlen);
    if (rc) cb_st_close(idx);
    return rc;
}

void cb_st_close(cb_st_index *idx) {
    if (idx->quant_free) idx->quant_free(idx->quant);
    for (int i = 0; i < idx->n_shards; i++) {
        if (idx->fds[i] >= 0) close(idx->fds[i]);
        free(idx->shard_paths[i]);
    }
    for (int i = 0; i < idx->n_tensors; i++) free(idx->tensors[i].name);
    free(idx->shard_paths);
    free(idx->fds);
    free(idx->tensors);
    free(idx->table);
    memset(idx, 0, sizeof *idx);
}

const cb_tensor *cb_st_expect(const cb_st_index *idx, const char *name, int ndim, const int64_t *dims,
                              char *err, size_t errlen) {
    const cb_tensor *t = cb_st_find(idx, name);
    if (!t) {
        snprintf(err, errlen, "tensor %s not found in the checkpoint", name);
        return NULL;
    }
    if (!t->supported && strcmp(t->dtype_name, "F8_E4M3") == 0) {
        snprintf(err, errlen, "%s: tensor %s has dtype F8_E4M3 but no block-scale companion %s_scale_inv; the "
                 "engine reads fp8 only as 128x128 block-quantized linear weights", idx->shard_paths[t->shard],
                 name, name);
        return NULL;
    }
    if (!t->supported) {
        snprintf(err, errlen, "%s: tensor %s has dtype %s; the engine reads F32, BF16 and F16",
                 idx->shard_paths[t->shard], name, t->dtype_name);
        return NULL;
    }
    int ok = t->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++) ok = t->shape[d] == dims[d];
    if (!ok) {
        char want[128] = "", got[128] = "";
        size_t w = 0, g = 0;
        for (int d = 0; d < ndim && w < sizeof want; d++)
            w += (size_t)snprintf(want + w, sizeof want - w, "%s%lld", d ? ", " : "", (long long)dims[d]);
        for (int d = 0; d < t->ndim && g < sizeof got; d++)
            g += (size_t)snprintf(got + g, sizeof got - g, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
        snprintf(err, errlen, "%s: tensor %s has shape [%s] but the config implies [%s]",
                 idx->shard_paths[t->shard], name, got, want);
        return NULL;
    }
    return t;
}

int cb_st_pread(const cb_st_index *idx, int shard, void *dst, uint64_t n, uint64_t offset, char *err,
                size_t errlen) {
    char *p = dst;
    while (n) {
        size_t chunk = n > (1u << 30) ? (1u << 30) : (size_t)n;
        ssize_t r = pread(idx->fds[shard], p, chunk, (off_t)offset);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            snprintf(err, errlen, "%s: read of %llu bytes at offset %llu failed: %s", idx->shard_paths[shard],
                     (unsigned long long)n, (unsigned long long)offset, r < 0 ? strerror(errno) : "end of file");
            return -1;
        }
        p += r;
        n -= (uint64_t)r;
        offset += (uint64_t)r;
    }
    return 0;
}

int cb_st_map(const cb_st_index *idx, const cb_tensor *t, const void **at, void **base, size_t *len, char *err,
              size_t errlen) {
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0 || t->nbytes == 0) {
        snprintf(err, errlen, "%s: cannot be mapped", t->name);
        return -1;
    }
    uint64_t first = t->offset / (uint64_t)page * (uint64_t)page;
    size_t n = (size_t)(t->offset - first + t->nbytes);
    void *m = mmap(NULL, n, PROT_READ, MAP_PRIVATE, idx->fds[t->shard], (off_t)first);
    if (m == MAP_FAILED) {
        snprintf(err, errlen, "%s: mmap of %s failed: %s", t->name, idx->shard_paths[t->shard], strerror(errno));
        return -1;
    }
    *base = m;
    *len = n;
    *at = (const char *)m + (t->offset - first);
    return 0;
}

void *cb_st_load(const cb_st_index *idx, const cb_tensor *t, char *err, size_t errlen) {
    size_t n = (size_t)t->nbytes;
    void *buf = aligned_alloc(64, (n + 63) / 64 * 64 + 64);
    if (!buf) {
        snprintf(err, errlen, "out of memory loading %s (%zu bytes)", t->name, n);
        return NULL;
    }
    if (cb_st_pread(idx, t->shard, buf, n, t->offset, err, errlen)) {
        free(buf);
        return NULL;
    }
    return buf;
}

int cb_scaled_read(void **buf, const void **scales, const cb_st_index *idx, const cb_tensor *t, const cb_tensor *sc,
                   const char *name, size_t *bytes, char *err, size_t errlen) {
    size_t wbytes = (size_t)t->nbytes, at = (wbytes + 63) / 64 * 64;
    char *b = aligned_alloc(64, (at + (size_t)sc->nbytes + 63) / 64 * 64 + 64);
    if (!b) {
        snprintf(err, errlen, "out of memory loading %s (%zu bytes)", name, wbytes);
        return -1;
    }
    if (cb_st_pread(idx, t->shard, b, t->nbytes, t->offset, err, errlen) ||
        cb_st_pread(idx, sc->shard, b + at, sc->nbytes, sc->offset, err, errlen)) {
        free(b);
        return -1;
    }
    *buf = b;
    *scales = b + at;
    if (bytes) *bytes += (size_t)t->nbytes + (size_t)sc->nbytes;
    return 0;
}
