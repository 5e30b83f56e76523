/* qlinear.h: running colibri-quant containers (docs/formats.md) through the shared blocks.
 *
 * A family never asks whether its checkpoint is quantized. cb_load_linear, cb_linear_apply and cb_embed
 * (blocks.c) dispatch here for a matrix the container stores as int8-row / int4-g64, and the expert store
 * (expert_store.c) locates a quantized expert as one byte span and hands its matrices to cb_qexpert_run. Float
 * entries (bf16, f32) are stored under their source names, so the float path loads them unchanged.
 *
 * The container is opened (and its stamp validated) once per cb_st_index, on first use, and kept in
 * idx->quant until cb_st_close; a refused stamp is a load error naming the shard and tensor.
 */
#ifndef COLIBRI_QLINEAR_H
#define COLIBRI_QLINEAR_H

#include <stddef.h>

#include "experts.h"
#include "qcontainer.h"
#include "quant.h"
#include "safetensors.h"

/* 0 with *out = the container, or NULL for a native checkpoint; -1 with a message when the stamp is refused. */
int cb_qc_of(const cb_st_index *idx, const cb_qcontainer **out, char *err, size_t errlen);
/* Free what cb_qc_of cached on idx now (cb_st_close does it through idx->quant_free). */
void cb_qc_release(cb_st_index *idx);

/* Load `name` as a quantized [rows, cols] matrix when the container stores it so: 0 loaded (*buf owns the
 * levels followed by the scales, *q points into it, *bytes grows by what is held), 1 when the tensor is not
 * quantized (the caller loads it as float), -1 with a message naming the tensor. */
int cb_qlinear_load(void **buf, cb_qmatrix *q, const cb_st_index *idx, const char *name, int rows, int cols,
                    size_t *bytes, char *err, size_t errlen);
/* cb_qlinear_load for a matrix read a row at a time: the levels stay in the file, mapped read-only (*map, *map_len
 * to munmap), and only the scales are read into *buf. Where the levels cannot be mapped (misaligned in the file,
 * mmap refused) it loads them as cb_qlinear_load does and leaves *map NULL. Same returns. */
int cb_qlinear_map(void **buf, void **map, size_t *map_len, cb_qmatrix *q, const cb_st_index *idx, const char *name,
                   int rows, int cols, size_t *bytes, char *err, size_t errlen);
/* Y[i] = W X[i] for n rows through the integer kernels (activations quantized once per row). Returns 0, or -1
 * when scratch cannot be allocated (Y is then filled with NaN so the failure cannot pass as a result). */
int cb_qlinear_apply(const cb_qmatrix *q, float *Y, const float *X, int n);

/* ---- routed experts ---- */

/* Locate expert e of `layer` in a container: its three matrices (names: printf formats of (layer, expert)) must
 * be quantized with the expected shapes and form one byte span of one shard. 0, or -1 naming the tensor. */
int cb_qexperts_locate(const cb_qcontainer *qc, const char *const names[3], int layer, int e, int hidden,
                       int inter, cb_expert_location *loc, char *err, size_t errlen);
/* Fill view->m[] (CB_MAT_INT) from a quantized expert's bytes at base. */
void cb_qexperts_view(const cb_expert_location *loc, const char *base, cb_expert_view *view);
/* Quantize a MoE layer's input (n rows of hidden) once, before its quantized experts run. 0 or -1. */
int cb_qexperts_begin(const float *x, int n, int hidden);
/* Run a quantized expert on the given input rows (indices into the cb_qexperts_begin input): the fused
 * gate+up pass, silu(gate) * up, quantized once, then down. gate/up get rows x inter, down rows x hidden.
 * Row r's result equals what the expert gives that row alone. 0, or -1 with a message. */
int cb_qexpert_run(float *down, float *gate, float *up, const cb_expert_view *ex, const int *rows, int n_rows,
                   char *err, size_t errlen);

#endif
