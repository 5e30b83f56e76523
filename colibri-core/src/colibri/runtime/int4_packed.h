/* int4_packed.h: int4 weights with per-group scales, as compressed-tensors "pack-quantized" stores them (the
 * format Kimi K2-Thinking ships its routed experts in; colibri/int4_packed.py reads the config).
 *
 * A linear X.weight [rows, cols] is stored as X.weight_packed (I32 [rows, cols / 8]: eight values per word, value
 * k in bits 4k..4k+3, lowest first, each the unsigned u = q + 8), X.weight_scale ([rows, cols / group], BF16 or
 * F32) and X.weight_shape (I32 or I64 [2] = [rows, cols]). Element (r, c) means (u - 8) * scale[r][c / group].
 * On a little-endian machine a row of words is a row of bytes holding two values each, element 2i in the low
 * nibble of byte i: that is how the kernels read it.
 *
 * Numerics: every weight is the exact f32 product (u - 8) * scale (a 4-bit integer times a BF16/F32 scale), and
 * rows are dequantized so, a few at a time, into f32 and handed to kernels.h's float rows kernel: each output is
 * bit-identical to cb_matmul / cb_dot over the dequantized f32 matrix, on every ISA (the decode is exact on the
 * scalar and the AVX2 path alike), whatever the threading or batching. group must be a multiple of 16.
 */
#ifndef COLIBRI_INT4_PACKED_H
#define COLIBRI_INT4_PACKED_H

#include <stddef.h>
#include <stdint.h>

#include "fp8.h"
#include "safetensors.h"

#define CB_I4P_OFFSET 8
#define CB_I4P_LANES 16   /* a group holds whole 16-column chunks (one scale per SIMD chunk) */

typedef struct {
    int rows, cols, group;          /* group: columns sharing one scale */
    const uint8_t *w;               /* the packed words as bytes, row-major [rows][cols / 2] */
    const void *scales;             /* [rows][cols / group] of scale_kind, any alignment */
    cb_fp8_scale_kind scale_kind;   /* F32 or BF16 */
} cb_i4pmatrix;

/* Scale of row r, column group g, as f32. */
float cb_i4p_scale(const cb_i4pmatrix *W, int r, int g);
/* out[c] = (u - 8) * scale: the dequantized row (exact). */
void cb_i4p_dequant_row(float *out, const cb_i4pmatrix *W, int r);
/* Y[i * rows + r] = dot(dequantized W row r, X[i * cols ..]) for i < n: cb_matmul's bits on the dequantized
 * matrix. A scratch row that cannot be allocated fills Y with NaN. Parallel over rows like cb_matmul. */
void cb_i4p_matmul(float *Y, const cb_i4pmatrix *W, const float *X, int n);

/* ---- checkpoints ---- */

/* Whether `name` (an X.weight) is stored packed: 1 when X.weight_packed does not exist (load it another way), 0
 * with *w / *s set and *group the columns per scale when it is packed int4 of logical shape [rows, cols] with a
 * matching scale and shape tensor, -1 with a message naming the tensor otherwise. */
int cb_i4p_locate(const cb_st_index *idx, const char *name, int rows, int cols, const cb_tensor **w,
                  const cb_tensor **s, int *group, char *err, size_t errlen);

/* ---- per-ISA bodies (int4_packed.c dispatches; not for engines) ---- */

void cb_i4p_dequant_row_scalar(float *out, const cb_i4pmatrix *W, int r);
void cb_i4p_dequant_row_avx2(float *out, const cb_i4pmatrix *W, int r);

#endif
