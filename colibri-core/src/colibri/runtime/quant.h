/* quant.h: integer matvec/matmul over colibri-quant weights (docs/formats.md), bit-identical on every ISA.
 *
 * Weights (as the container stores them):
 *   CB_Q8_ROW  int8 levels [rows][cols] in [-127, 127], one F16 scale per row.
 *   CB_Q4_G64  [rows][cols/2] bytes, byte j holds column 2j in its low nibble and 2j+1 in its high nibble, each as
 *              level + 8 (levels in [-7, 7]); one F16 scale per group of 64 columns, [rows][cols/64].
 *              cols must be a multiple of 64.
 * Activations are quantized once per input row: scale = absmax / 127, q = round-half-even(x * (127 / absmax))
 * clamped to [-127, 127] (absmax 0: all zero, scale 0; absmax inf/NaN: all zero, scale = absmax, so the output is
 * NaN as a float path's would be).
 *
 * Output, for weight row r and one input row (acc_g = exact int32 sum of w_level * x_level over group g; Q8 has a
 * single group, the whole row):
 *     Q8:  y = ((float)acc * w_scale) * x_scale
 *     Q4:  s = 0; for g = 0, 1, ...: s = fmaf((float)acc_g, w_scale_g, s);  y = s * x_scale
 * Integer sums are exact whatever the SIMD grouping, and the float combination above is the same code on every
 * path, so scalar, AVX2, AVX-512 and AVX-512 VNNI give the same bits, and matmul row i equals matvec on input i.
 * cols <= CB_Q_MAX_COLS keeps every int32 sum exact (127 * 127 * cols < 2^31).
 *
 * Scale pointers may have any alignment (containers pack tensors back to back); they are read with memcpy.
 */
#ifndef COLIBRI_QUANT_H
#define COLIBRI_QUANT_H

#include <stddef.h>
#include <stdint.h>

#define CB_Q4_GROUP 64
#define CB_Q_MAX_COLS 131072

typedef enum { CB_Q8_ROW = 1, CB_Q4_G64 = 2 } cb_qscheme;

typedef enum {
    CB_QPATH_SCALAR = 0,
    CB_QPATH_AVX2 = 1,          /* AVX2: vpmaddubsw + vpmaddwd */
    CB_QPATH_AVX2_VNNI = 2,     /* AVX2 + AVX-VNNI (VEX vpdpbusd: Alder Lake and later client CPUs, no AVX-512) */
    CB_QPATH_AVX512 = 3,        /* AVX-512 BW: vpmaddubsw + vpmaddwd on 64-byte registers */
    CB_QPATH_AVX512_VNNI = 4,   /* AVX-512 BW + VNNI: vpdpbusd */
    CB_QPATH_COUNT
} cb_qpath;

typedef struct {
    cb_qscheme scheme;
    int rows, cols;
    const void *q;              /* levels, as above */
    const void *scales;         /* F16 bit patterns, as above; any alignment */
} cb_qmatrix;

/* Quantized activations for n input rows of cols values. Owned memory: cb_qact_init / cb_qact_free. */
typedef struct {
    int n, cols, capacity_n;
    int8_t *q;                  /* [n][cols] levels in column order */
    int8_t *q_split;            /* [n][cols] per 64-column group: its 32 even columns, then its 32 odd columns
                                 * (the Q4 nibble order); NULL when cols is not a multiple of 64 */
    int32_t *group_sums;        /* [n][cols/64] sum of levels per group (the Q4 SIMD paths' nibble offset) */
    int32_t *sums;              /* [n] sum of each row's levels (the Q8 VNNI path's weight offset) */
    float *scale;               /* [n] */
} cb_qact;

/* Paths: the default follows cb_get_isa() (COLIBRI_ISA), using the best integer path that ISA level allows;
 * COLIBRI_QPATH=scalar|avx2|avx2-vnni|avx512|avx512-vnni (read once) picks one path instead, when this CPU has
 * it. The paths are not a ladder (a CPU may have AVX-512 BW without AVX-VNNI), so ask cb_qpath_available. */
cb_qpath cb_qpath_detect(void);               /* the fastest path this CPU has */
int cb_qpath_available(cb_qpath path);        /* 1 if this CPU (and this build's compiler) has the path */
int cb_qpath_set(cb_qpath path);              /* 0, or -1 if this CPU lacks it */
void cb_qpath_reset(void);                    /* back to following cb_get_isa() */
cb_qpath cb_qpath_get(void);
const char *cb_qpath_name(cb_qpath path);

/* 0 when W is usable (known scheme, rows >= 1, 1 <= cols <= CB_Q_MAX_COLS, Q4 cols % 64 == 0), else -1. */
int cb_qmatrix_check(const cb_qmatrix *W);
size_t cb_qrow_bytes(cb_qscheme scheme, int cols);        /* bytes of one row of levels */
size_t cb_qscale_count(cb_qscheme scheme, int rows, int cols);

/* Returns 0, or -1 on a bad size or failed allocation. max_n input rows of cols values. */
int cb_qact_init(cb_qact *a, int max_n, int cols);
void cb_qact_free(cb_qact *a);
/* Quantize n <= capacity rows of x ([n][cols] floats). Returns 0 or -1. */
int cb_qact_quantize(cb_qact *a, const float *x, int n);

/* Y[i * rows + r] = W row r . input i, for every input i < a->n. Parallel over rows (cb_parallel_for).
 * Return 0, or -1 when W is unusable or its cols differ from the activations'. */
int cb_qmatmul(float *Y, const cb_qmatrix *W, const cb_qact *a);
/* y[r] = W row r . input i (one input of a batch). */
int cb_qmatvec(float *y, const cb_qmatrix *W, const cb_qact *a, int i);
/* The fused expert up-projection: G = Wg . inputs and U = Wu . inputs in one parallel pass over the same
 * quantized activations (layout as cb_qmatmul). Wg and Wu must have equal shapes. */
int cb_qgate_up(float *G, float *U, const cb_qmatrix *Wg, const cb_qmatrix *Wu, const cb_qact *a);

/* Convenience for one float input: quantizes x (allocating) and calls cb_qmatvec. */
int cb_qmatvec_f32(float *y, const cb_qmatrix *W, const float *x);

/* out[c] = level * scale (float, exact) for row r: embedding lookups and tests. Returns 0 or -1. */
int cb_qdequant_row(float *out, const cb_qmatrix *W, int r);

#endif
