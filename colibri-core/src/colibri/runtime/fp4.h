/* fp4.h: fp4 (e2m1) weights with per-32 power-of-two scales, as DeepSeek-V4 ships its routed experts.
 *
 * The format (transformers' DeepSeek-V4 loader, integrations/finegrained_fp8.py, expert_dtype "fp4"): a matrix
 * [rows, cols] is stored as `X.weight` with two e2m1 values per byte, element 2i in the low nibble and 2i + 1 in
 * the high one: dtype I8 or U8 with shape [rows, cols / 2], or F4 (float4_e2m1fn_x2) with the logical shape
 * [rows, cols]. The nibble is s.ee.m: magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign. Its companion
 * `X.weight_scale_inv` (transformers' naming) or `X.scale` (DeepSeek's) holds one scale per row and 32 columns,
 * [rows, cols / 32]: F8_E8M0 / U8 (ue8m0, 2^(b - 127)), or F32 / BF16. Element (r, c) means
 * e2m1(W[r, c]) * scale[r][c / 32].
 *
 * Numerics, the contract of fp8.h: every weight is formed as the f32 product e2m1 * scale (exact for ue8m0
 * scales) and fed to kernels.h's summation order (16 lanes, fmaf, the pairwise tree), so a row's dot product is
 * bit-identical to cb_dot of the dequantized f32 row, on every ISA (scalar and AVX2; AVX-512 CPUs run AVX2),
 * whatever the threading or batching. cols must be a multiple of 32, so every 16-lane chunk has one scale.
 */
#ifndef COLIBRI_FP4_H
#define COLIBRI_FP4_H

#include <stddef.h>
#include <stdint.h>

#include "fp8.h"
#include "safetensors.h"

#define CB_FP4_GROUP 32

typedef struct {
    int rows, cols;
    const uint8_t *w;               /* packed nibbles, row-major [rows][cols / 2] */
    const void *scales;             /* [rows][cols / 32] of scale_kind, any alignment */
    cb_fp8_scale_kind scale_kind;   /* F32, BF16 or E8M0 (U8 bytes are ue8m0 too) */
} cb_fp4matrix;

extern const float cb_e2m1_table[16];

/* Scale of row r, column group g, as f32 (exact for every kind). */
float cb_fp4_scale(const cb_fp4matrix *W, int r, int g);
/* out[c] = e2m1(W[r, c]) * scale: the dequantized row. */
void cb_fp4_dequant_row(float *out, const cb_fp4matrix *W, int r);
/* Y[i * rows + r] = dot(dequantized W row r, X[i * cols ..]) for i < n; row by row bit-identical to n = 1.
 * Parallel over rows once rows * cols * n >= 32768. */
void cb_fp4_matmul(float *Y, const cb_fp4matrix *W, const float *X, int n);
void cb_fp4_matvec(float *y, const cb_fp4matrix *W, const float *x);

/* ---- checkpoints ---- */

/* Whether `name` is an fp4 matrix: its dtype is I8, U8 or F4 and it has a scale companion (cb_fp8_companion's
 * naming). 1 when it is not (load it another way), 0 with *w / *s set when it is fp4 of shape [rows, cols] with
 * scales [rows, cols / 32] of a dtype above, -1 with a message naming the tensor otherwise. */
int cb_fp4_locate(const cb_st_index *idx, const char *name, int rows, int cols, const cb_tensor **w,
                  const cb_tensor **s, char *err, size_t errlen);
/* Load `name` as fp4: 1 when it is not, 0 with *buf owning the packed bytes then the scales and *W pointing into
 * it (*bytes grows by both), -1 with a message. */
int cb_fp4_load(void **buf, cb_fp4matrix *W, const cb_st_index *idx, const char *name, int rows, int cols,
                size_t *bytes, char *err, size_t errlen);
/* The scale kind of a scale tensor's dtype name: 0, or -1 when it is not F32, BF16, F8_E8M0 or U8. */
int cb_fp4_scale_kind_of(const char *dtype_name, cb_fp8_scale_kind *out);

/* ---- per-ISA bodies (fp4.c dispatches; not for engines) ---- */

/* Y[j * ldy + r] = dot(W row r, X[j * ldx ..]) for r in [r0, r1), j < n. */
void cb_fp4_rows_scalar(float *Y, size_t ldy, const cb_fp4matrix *W, const float *X, size_t ldx, int n, int r0,
                        int r1);
void cb_fp4_rows_avx2(float *Y, size_t ldy, const cb_fp4matrix *W, const float *X, size_t ldx, int n, int r0,
                      int r1);

#endif
