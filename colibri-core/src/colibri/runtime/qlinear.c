/* qlinear.c: see qlinear.h. */
#include "qlinear.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels.h"

/* idx->quant holds the opened container, or this marker once the checkpoint is known to be native. The cache
 * is written through a const index: it is a memo of what the (immutable) files say, not a change to them. */
static char native_marker;

static void free_container(void *quant) {
    if (quant && quant != &native_marker) {
        cb_qc_close(quant);
        free(quant);
    }
}

int cb_qc_of(const cb_st_index *idx, const cb_qcontainer **out, char *err, size_t errlen) {
    cb_st_index *mut = (cb_st_index *)idx;
    if (!mut->quant) {
        cb_qcontainer *c = calloc(1, sizeof *c);
        if (!c) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        int rc = cb_qc_open(c, idx, err, errlen);
        if (rc < 0) {
            free(c);
            return -1;
        }
        if (rc == 1) {
            free(c);
            mut->quant = &native_marker;
        } else {
            mut->quant = c;
        }
        mut->quant_free = free_container;
    }
    *out = mut->quant == &native_marker ? NULL : mut->quant;
    return 0;
}

void cb_qc_release(cb_st_index *idx) {
    free_container(idx->quant);
    idx->quant = NULL;
    idx->quant_free = NULL;
}

static const char *kind_name(cb_qc_kind k) {
    switch (k) {
    case CB_QC_F32: return "f32";
    case CB_QC_BF16: return "bf16";
    case CB_QC_COPY: return "copy";
    case CB_QC_INT8_ROW: return "int8-row";
    case CB_QC_INT4_G64: return "int4-g64";
    }
    return "?";
}

static int is_quantized(const cb_qc_entry *e) { return e->kind == CB_QC_INT8_ROW || e->kind == CB_QC_INT4_G64; }

/* The stored byte counts must be exactly what the scheme needs for [rows, cols]: a truncated or padded
 * qweight/scales tensor is refused by name (the kernels would read past it or misplace every scale). */
static int check_parts(const cb_qc_entry *e, int rows, int cols, char *err, size_t errlen) {
    if (e->rows != rows || e->cols != cols) {
        snprintf(err, errlen,
                 "tensor %s is [%d, %d] in the container but the config implies [%d, %d] "
                 "(was config.json edited? reconvert the model)",
                 e->name, e->rows, e->cols, rows, cols);
        return -1;
    }
    cb_qscheme s = e->kind == CB_QC_INT8_ROW ? CB_Q8_ROW : CB_Q4_G64;
    uint64_t qb = (uint64_t)rows * cb_qrow_bytes(s, cols), sb = (uint64_t)cb_qscale_count(s, rows, cols) * 2;
    if (e->qweight->nbytes != qb) {
        snprintf(err, errlen, "tensor %s holds %llu bytes, %s [%d, %d] needs %llu (reconvert the model)",
                 e->qweight->name, (unsigned long long)e->qweight->nbytes, kind_name(e->kind), rows, cols,
                 (unsigned long long)qb);
        return -1;
    }
    if (e->scales->nbytes != sb || e->scales->dtype != CB_F16) {
        snprintf(err, errlen, "scale tensor %s holds %llu bytes of %s, %s [%d, %d] needs %llu of F16 "
                 "(truncated? reconvert the model)", e->scales->name, (unsigned long long)e->scales->nbytes,
                 e->scales->dtype_name, kind_name(e->kind), rows, cols, (unsigned long long)sb);
        return -1;
    }
    return 0;
}

/* The container's quantized entry for `name`, its parts checked against [rows, cols]: 0 with *out set, 1 when the
 * tensor is not quantized (or the checkpoint is native), -1 with a message. */
static int quantized_entry(const cb_st_index *idx, const char *name, int rows, int cols, const cb_qc_entry **out,
                           char *err, size_t errlen) {
    const cb_qcontainer *qc;
    if (cb_qc_of(idx, &qc, err, errlen)) return -1;
    *out = qc ? cb_qc_find(qc, name) : NULL;
    if (!*out || !is_quantized(*out)) return 1;
    return check_parts(*out, rows, cols, err, errlen);
}

int cb_qlinear_load(void **buf, cb_qmatrix *q, const cb_st_index *idx, const char *name, int rows, int cols,
                    size_t *bytes, char *err, size_t errlen) {
    const cb_qc_entry *e;
    int found = quantized_entry(idx, name, rows, cols, &e, err, errlen);
    if (found) return found;
    const void *scales;
    if (cb_scaled_read(buf, &scales, idx, e->qweight, e->scales, name, bytes, err, errlen)) return -1;
    if (cb_qc_matrix(e, *buf, scales, q)) {
        snprintf(err, errlen, "tensor %s: %s [%d, %d] is not usable by the integer kernels", name,
                 kind_name(e->kind), rows, cols);
        free(*buf);
        *buf = NULL;
        return -1;
    }
    return 0;
}

int cb_qlinear_map(void **buf, void **map, size_t *map_len, cb_qmatrix *q, const cb_st_index *idx, const char *name,
                   int rows, int cols, size_t *bytes, char *err, size_t errlen) {
    *map = NULL;
    *map_len = 0;
    const cb_qc_entry *e;
    int found = quantized_entry(idx, name, rows, cols, &e, err, errlen);
    if (found) return found;
    const void *levels;
    if (e->qweight->offset % CB_MAP_ALIGN || cb_st_map(idx, e->qweight, &levels, map, map_len, err, errlen))
        return cb_qlinear_load(buf, q, idx, name, rows, cols, bytes, err, errlen);
    size_t sbytes = (size_t)e->scales->nbytes;
    char *scales = aligned_alloc(64, (sbytes + 63) / 64 * 64 + 64);
    if (!scales) {
        snprintf(err, errlen, "out of memory loading %s", name);
        goto fail;
    }
    if (cb_st_pread(idx, e->scales->shard, scales, sbytes, e->scales->offset, err, errlen)) goto fail;
    if (cb_qc_matrix(e, levels, scales, q)) {
        snprintf(err, errlen, "tensor %s: %s [%d, %d] is not usable by the integer kernels", name, kind_name(e->kind),
                 rows, cols);
        goto fail;
    }
    *buf = scales;
    if (bytes) *bytes += sbytes;
    return 0;
fail:
    free(scales);
    munmap(*map, *map_len);
    *map = NULL;
    *map_len = 0;
    return -1;
}

/* ---- activation scratch ---- */

/* Quantized activations are scratch of the calling (engine) thread, keyed by width: a forward pass uses a
 * handful of widths (hidden, attention width, intermediate), each grown to the largest batch seen. */
#define SCRATCH_WIDTHS 12
static cb_qact scratch[SCRATCH_WIDTHS];
static int scratch_next;

static cb_qact *scratch_for(int cols, int n) {
    int slot = -1;
    for (int i = 0; i < SCRATCH_WIDTHS; i++)
        if (scratch[i].q && scratch[i].cols == cols) slot = i;
    if (slot >= 0 && scratch[slot].capacity_n >= n) return &scratch[slot];
    if (slot < 0) {
        for (int i = 0; i < SCRATCH_WIDTHS && slot < 0; i++)
            if (!scratch[i].q) slot = i;
        if (slot < 0) slot = scratch_next++ % SCRATCH_WIDTHS;
    }
    int want = slot >= 0 && scratch[slot].q && scratch[slot].cols == cols ? 2 * scratch[slot].capacity_n : 1;
    if (want < n) want = n;
    cb_qact_free(&scratch[slot]);
    if (cb_qact_init(&scratch[slot], want, cols)) return NULL;
    return &scratch[slot];
}

static void fill_nan(float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = NAN;
}

int cb_qlinear_apply(const cb_qmatrix *q, float *Y, const float *X, int n) {
    cb_qact *a = scratch_for(q->cols, n);
    if (!a || cb_qact_quantize(a, X, n) || cb_qmatmul(Y, q, a)) {
        fill_nan(Y, (size_t)n * (size_t)q->rows);
        return -1;
    }
    return 0;
}

/* ---- routed experts ---- */

int cb_qexperts_locate(const cb_qcontainer *qc, const char *const names[3], int layer, int e, int hidden,
                       int inter, cb_expert_location *loc, char *err, size_t errlen) {
    char buf[3][512];
    const char *nm[3];
    const cb_qc_entry *ent[3];
    for (int m = 0; m < 3; m++) {
        snprintf(buf[m], sizeof buf[m], names[m], layer, e);
        nm[m] = buf[m];
        if (!(ent[m] = cb_qc_find(qc, nm[m]))) {
            snprintf(err, errlen, "the container has no tensor %s (does config.json's expert count match the "
                     "converted model? reconvert it)", nm[m]);
            return -1;
        }
        if (!is_quantized(ent[m])) {
            snprintf(err, errlen, "routed expert tensor %s is stored as %s; the engine runs int8-row or int4-g64 "
                     "experts (reconvert with coli convert)", nm[m], kind_name(ent[m]->kind));
            return -1;
        }
        int rows = m == CB_DOWN ? hidden : inter, cols = m == CB_DOWN ? inter : hidden;
        if (check_parts(ent[m], rows, cols, err, errlen)) return -1;
    }
    int shard;
    uint64_t begin, end;
    if (cb_qc_span(qc, nm, 3, &shard, &begin, &end, err, errlen)) return -1;
    memset(loc, 0, sizeof *loc);
    loc->kind = CB_MAT_INT;
    loc->single_read = 1;
    loc->span_offset = begin;
    loc->span_bytes = end - begin;
    for (int m = 0; m < 3; m++) {
        loc->shard[m] = shard;
        loc->qe[m] = ent[m];
        loc->offset[m] = ent[m]->qweight->offset;
        loc->nbytes[m] = ent[m]->qweight->nbytes + ent[m]->scales->nbytes;
        loc->rel[m] = (size_t)(ent[m]->qweight->offset - begin);
        loc->rel_scales[m] = (size_t)(ent[m]->scales->offset - begin);
        loc->dt[m] = CB_F32;   /* unused: the view's q[] describes the matrices */
    }
    return 0;
}

void cb_qexperts_view(const cb_expert_location *loc, const char *base, cb_expert_view *view) {
    for (int m = 0; m < 3; m++) {
        cb_matrix *M = &view->m[m];
        *M = (cb_matrix){.kind = CB_MAT_INT, .rows = loc->qe[m]->rows, .cols = loc->qe[m]->cols};
        cb_qc_matrix(loc->qe[m], base + loc->rel[m], base + loc->rel_scales[m], &M->q);
    }
}

/* The MoE layer input, quantized once per call; each expert gathers its rows from it. */
static cb_qact layer_in, expert_in, down_in;

static int ensure(cb_qact *a, int n, int cols) {
    if (a->q && a->cols == cols && a->capacity_n >= n) return 0;
    int want = a->q && a->cols == cols ? 2 * a->capacity_n : 1;
    if (want < n) want = n;
    cb_qact_free(a);
    return cb_qact_init(a, want, cols);
}

int cb_qexperts_begin(const float *x, int n, int hidden) {
    if (ensure(&layer_in, n, hidden)) return -1;
    return cb_qact_quantize(&layer_in, x, n);
}

/* dst row j = src row rows[j]: levels, split levels, group sums, level sum and scale are all per row, so a
 * gathered row is exactly what quantizing that row alone gives. */
static void gather(cb_qact *dst, const cb_qact *src, const int *rows, int n) {
    size_t c = (size_t)src->cols, groups = c / CB_Q4_GROUP;
    dst->n = n;
    for (int j = 0; j < n; j++) {
        size_t r = (size_t)rows[j];
        memcpy(dst->q + (size_t)j * c, src->q + r * c, c);
        if (src->q_split) {
            memcpy(dst->q_split + (size_t)j * c, src->q_split + r * c, c);
            memcpy(dst->group_sums + (size_t)j * groups, src->group_sums + r * groups, groups * sizeof(int32_t));
        }
        dst->scale[j] = src->scale[r];
        dst->sums[j] = src->sums[r];
    }
}

int cb_qexpert_run(float *down, float *gate, float *up, const cb_expert_view *ex, const int *rows, int n_rows,
                   char *err, size_t errlen) {
    const cb_qmatrix *G = &ex->m[CB_GATE].q, *U = &ex->m[CB_UP].q, *D = &ex->m[CB_DOWN].q;
    int hidden = G->cols, inter = G->rows;
    if (!layer_in.q || layer_in.cols != hidden || D->rows != hidden || D->cols != inter) {
        snprintf(err, errlen, "quantized expert shapes disagree with the layer input (internal error)");
        return -1;
    }
    for (int j = 0; j < n_rows; j++)
        if (rows[j] < 0 || rows[j] >= layer_in.n) {
            snprintf(err, errlen, "quantized expert row %d outside the layer input (internal error)", rows[j]);
            return -1;
        }
    if (ensure(&expert_in, n_rows, hidden) || ensure(&down_in, n_rows, inter)) {
        snprintf(err, errlen, "out of memory for quantized expert activations");
        return -1;
    }
    gather(&expert_in, &layer_in, rows, n_rows);
    if (cb_qgate_up(gate, up, G, U, &expert_in)) {
        snprintf(err, errlen, "quantized expert gate/up kernels refused their matrices");
        return -1;
    }
    cb_silu_mul(gate, up, n_rows * inter);
    if (cb_qact_quantize(&down_in, gate, n_rows) || cb_qmatmul(down, D, &down_in)) {
        snprintf(err, errlen, "quantized expert down kernel refused its matrix");
        return -1;
    }
    return 0;
}
