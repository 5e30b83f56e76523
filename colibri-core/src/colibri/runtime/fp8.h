/* fp8.h: block-quantized fp8 weights, as DeepSeek-V3/R1/V3.2 and Kimi K2 ship them (docs/formats.md).
 *
 * A quantized linear `X.weight` is stored as F8_E4M3 (e4m3fn: 1 sign, 4 exponent, 3 mantissa bits, bias 7, no
 * infinities, S.1111.111 = NaN) [rows, cols] with a companion `X.weight_scale_inv` [ceil(rows/128),
 * ceil(cols/128)] (F32 in the released checkpoints; BF16 and F8_E8M0 scales are read too). Element (r, c)
 * means e4m3(W[r, c]) * scale[r / 128][c / 128].
 *
 * Numerics (the contract the tests check): the kernels form each weight as the f32 product
 *     w = (float)e4m3 * scale            (one rounding, the value torch's dequantization computes)
 * and feed it to the summation order of kernels.h (16 lanes, fmaf, the pairwise tree, the tail in order). So a
 * row's dot product is bit-identical to cb_dot of the dequantized f32 row, on every ISA (scalar, AVX2 and
 * AVX-512 here), whatever the threading or batching: an fp8 checkpoint and its dequantized
 * f32 copy give the same tokens. Block columns never split a 16-lane chunk (128 is a multiple of 16), so each
 * chunk has one scale.
 *
 * Scale pointers may have any alignment (tensors are packed back to back in a shard); they are read with memcpy.
 */
#ifndef COLIBRI_FP8_H
#define COLIBRI_FP8_H

#include <stddef.h>
#include <stdint.h>

#include "safetensors.h"

#define CB_FP8_BLOCK 128

typedef enum { CB_FP8_SCALE_F32 = 0, CB_FP8_SCALE_BF16 = 1, CB_FP8_SCALE_E8M0 = 2 } cb_fp8_scale_kind;

typedef struct {
    int rows, cols;
    const uint8_t *w;               /* e4m3fn bytes, row-major [rows][cols] */
    const void *scales;             /* [ceil(rows/128)][ceil(cols/128)] of scale_kind, any alignment */
    cb_fp8_scale_kind scale_kind;
} cb_fp8matrix;

/* Exact decode of one e4m3fn byte (a 256-entry table). */
float cb_e4m3_to_f32(uint8_t b);
/* The scale of block (block_row, block_col), as f32 (exact for every kind). */
float cb_fp8_scale(const cb_fp8matrix *W, int block_row, int block_col);
/* Scale i of a packed scale array of `kind` (any alignment), as f32; fp8 blocks and fp4 groups both decode here. */
float cb_scale_at(const void *scales, cb_fp8_scale_kind kind, size_t i);
size_t cb_fp8_scale_count(int rows, int cols);        /* ceil(rows/128) * ceil(cols/128) */
size_t cb_fp8_scale_size(cb_fp8_scale_kind kind);     /* bytes per scale */
/* The scale kind of a safetensors dtype name ("F32", "BF16", "F8_E8M0"): 0, or -1 for any other. */
int cb_fp8_scale_kind_of(const char *dtype_name, cb_fp8_scale_kind *out);

/* out[c] = e4m3(W[r, c]) * scale, in f32 (the dequantized row). */
void cb_fp8_dequant_row(float *out, const cb_fp8matrix *W, int r);
/* y[r] = dot(dequantized W row r, x) for every row. Parallel over rows once rows * cols >= 32768. */
void cb_fp8_matvec(float *y, const cb_fp8matrix *W, const float *x);
/* Y[i * rows + r] = dot(W row r, X[i * cols ..]) for i < n. Bit-identical to n calls of cb_fp8_matvec. */
void cb_fp8_matmul(float *Y, const cb_fp8matrix *W, const float *X, int n);

/* ---- checkpoints ---- */

/* The scale companion of weight `name`: "<name>_scale_inv" (transformers' naming), else, for "P.weight",
 * "P.scale" (DeepSeek's reference-code naming). NULL when there is none: the tensor is not fp8-quantized. */
const cb_tensor *cb_fp8_companion(const cb_st_index *idx, const char *name);
/* Locate `name` as a block-quantized [rows, cols] matrix: 1 when it has no scale companion (load it as float),
 * 0 with *w / *s set when it is F8_E4M3 of that shape with a companion of the block shape and a scale dtype
 * above, -1 with a message naming the tensor otherwise. */
int cb_fp8_locate(const cb_st_index *idx, const char *name, int rows, int cols, const cb_tensor **w,
                  const cb_tensor **s, char *err, size_t errlen);
/* Load `name` as block-quantized fp8: 1 when it is not (no companion), 0 with *buf owning the e4m3 bytes then
 * the scales and *W pointing into it (*bytes grows by both), -1 with a message. */
int cb_fp8_load(void **buf, cb_fp8matrix *W, const cb_st_index *idx, const char *name, int rows, int cols,
                size_t *bytes, char *err, size_t errlen);


/* ---- per-ISA bodies (fp8.c dispatches; not for engines) ---- */

/* Y[j * ldy + r] = dot(W row r, X[j * ldx ..]) for r in [r0, r1), j < n. */
void cb_fp8_rows_scalar(float *Y, size_t ldy, const cb_fp8matrix *W, const float *X, size_t ldx, int n, int r0,
                        int r1);
void cb_fp8_rows_avx2(float *Y, size_t ldy, const cb_fp8matrix *W, const float *X, size_t ldx, int n, int r0,
                      int r1);
void cb_fp8_rows_avx512(float *Y, size_t ldy, const cb_fp8matrix *W, const float *X, size_t ldx, int n, int r0,
                        int r1);
extern const float cb_e4m3_table[256];

#endif
