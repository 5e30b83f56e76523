/* qcontainer.h: the engine-side reader of colibri-quant containers (docs/formats.md), mirroring the Python
 * validator colibri.convert.container.open_container: the same stamp checks, the same refusals.
 *
 * Usage: cb_st_open the directory as usual, then cb_qc_open on its index. A native checkpoint (no shard stamped)
 * answers 1 and the engine goes on as before; a container answers 0 and maps every source tensor name to how it
 * is stored; anything unknown or inconsistent answers -1 with a one-line message naming the shard.
 */
#ifndef COLIBRI_QCONTAINER_H
#define COLIBRI_QCONTAINER_H

#include <stddef.h>
#include <stdint.h>

#include "quant.h"
#include "safetensors.h"

typedef enum { CB_QC_F32 = 0, CB_QC_BF16 = 1, CB_QC_COPY = 2, CB_QC_INT8_ROW = 3, CB_QC_INT4_G64 = 4 } cb_qc_kind;

typedef struct {
    char *name;                  /* the source tensor name, e.g. "model.layers.0.mlp.experts.3.up_proj.weight" */
    cb_qc_kind kind;
    int rows, cols;              /* quantized kinds: the logical [rows, cols] */
    const cb_tensor *data;       /* float and copy kinds */
    const cb_tensor *qweight;    /* quantized kinds */
    const cb_tensor *scales;
} cb_qc_entry;

typedef struct {
    int n;
    cb_qc_entry *entries;        /* sorted by name */
} cb_qcontainer;

/* 0: a container (c filled); 1: a native checkpoint (c empty); -1: refused, with a message. */
int cb_qc_open(cb_qcontainer *c, const cb_st_index *idx, char *err, size_t errlen);
void cb_qc_close(cb_qcontainer *c);
const cb_qc_entry *cb_qc_find(const cb_qcontainer *c, const char *name);

/* The one byte span [*begin, *end) of one shard holding every part of the n named tensors (an expert's block).
 * Returns 0, or -1 with a message when a name is missing or the parts are split or not adjacent. */
int cb_qc_span(const cb_qcontainer *c, const char *const *names, int n, int *shard, uint64_t *begin,
               uint64_t *end, char *err, size_t errlen);

/* A cb_qmatrix over a quantized entry whose qweight and scales bytes the caller holds in memory (e.g. inside an
 * expert's slot buffer). Returns 0, or -1 when the entry is not quantized. */
int cb_qc_matrix(const cb_qc_entry *e, const void *qweight, const void *scales, cb_qmatrix *out);

#endif
