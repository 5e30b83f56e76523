/* quant_impl.h: private glue between quant.c (dispatch, activations, the tile driver, the scalar reference) and
 * the per-ISA register tiles in quant_avx2.c (AVX2, AVX-VNNI) / quant_avx512.c (AVX-512 BW, VNNI). Engines include quant.h only. */
#ifndef COLIBRI_QUANT_IMPL_H
#define COLIBRI_QUANT_IMPL_H

#include "quant.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define CB_HAVE_X86_QUANT 1
#else
#define CB_HAVE_X86_QUANT 0
#endif

/* AVX-VNNI's intrinsics (_mm256_dpbusd_avx_epi32, target "avxvnni") arrived in GCC 11 and clang 12; an older
 * compiler builds the other paths and never offers this one. */
#if CB_HAVE_X86_QUANT && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define CB_HAVE_AVX_VNNI 1
#else
#define CB_HAVE_AVX_VNNI 0
#endif

/* The scalar reference (quant.c). Exact sum over c < cols of w[c] * x[c] (int8 levels). */
int32_t cb_q8_dot_scalar(const int8_t *w, const int8_t *x, int cols);
/* acc[g] = exact sum over group g (64 columns) of level(w) * x, for g < groups (x in column order). */
void cb_q4_dot_scalar(int32_t *acc, const uint8_t *w, const int8_t *x, int groups);

/* One register tile: R weight rows x N input rows, R * N == the path's lane count (16 on AVX-512, 8 on AVX2).
 * Output item k = j * R + r is weight row w[r] against input j, and out[k] must be exactly what quant.h's float
 * combination gives for that pair (the driver has already clamped w[] and the inputs to real rows, so a tile past
 * the matrix's edge recomputes a real row and the driver drops the copy). */
#define CB_QTILE_MAX_LANES 16
#define CB_QTILE_MAX_INPUTS 4
typedef struct {
    int R, N, cols, groups;
    const void *w[CB_QTILE_MAX_LANES];
    const int8_t *x[CB_QTILE_MAX_INPUTS];          /* levels, column order (int8) */
    const int8_t *x_split[CB_QTILE_MAX_INPUTS];    /* levels, nibble order (int4) */
    const int32_t *group_sums[CB_QTILE_MAX_INPUTS];
    const float *w_scales;                         /* int4: [R][groups] weight scales as f32 */
    int32_t x_sum[CB_QTILE_MAX_LANES];             /* int8: sum of input j's levels, at each of its lanes */
    float w_scale[CB_QTILE_MAX_LANES];             /* int8: row r's scale, at each of its lanes */
    float x_scale[CB_QTILE_MAX_LANES];             /* input j's scale, at each of its lanes */
    const char *prefetch;                          /* the next row block's weights, or NULL */
    size_t prefetch_bytes;
} cb_qtile;
typedef void (*cb_qtile_fn)(float *out, const cb_qtile *t);

/* Software prefetch of the next row block's weights, spread evenly over a tile's column loop. A tile reads its rows
 * a column chunk at a time, row after row, so the stream the hardware prefetchers see jumps by a row each load and
 * they do not follow it: from DRAM a decode matvec ran at half the bandwidth a plain scan gets. Prefetching
 * changes no arithmetic. */
typedef struct {
    const char *next, *end;
    size_t step;
} cb_qprefetch;

static inline cb_qprefetch cb_qprefetch_begin(const cb_qtile *t, int iterations) {
    size_t lines = (t->prefetch_bytes + 63) / 64, per = iterations > 0 ? (lines + (size_t)iterations - 1) / (size_t)iterations : lines;
    return (cb_qprefetch){t->prefetch, t->prefetch ? t->prefetch + t->prefetch_bytes : NULL, per * 64};
}

static inline void cb_qprefetch_step(cb_qprefetch *p) {
    for (const char *stop = p->next + p->step; p->next && p->next < stop && p->next < p->end; p->next += 64)
        __builtin_prefetch(p->next, 0, 3);
}

#if CB_HAVE_X86_QUANT
void cb_q8_tile_avx2(float *out, const cb_qtile *t);
void cb_q4_tile_avx2(float *out, const cb_qtile *t);
void cb_q8_tile_avx2vnni(float *out, const cb_qtile *t);
void cb_q4_tile_avx2vnni(float *out, const cb_qtile *t);
void cb_q8_tile_avx512(float *out, const cb_qtile *t);
void cb_q4_tile_avx512(float *out, const cb_qtile *t);
void cb_q8_tile_avx512vnni(float *out, const cb_qtile *t);
void cb_q4_tile_avx512vnni(float *out, const cb_qtile *t);
#endif

#endif
