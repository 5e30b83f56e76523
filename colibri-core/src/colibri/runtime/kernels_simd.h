/* kernels_simd.h: the SIMD matvec/matmul kernels, written once over a 16-lane vector type and instantiated by
 * kernels_avx2.c (V16 = two 8-wide registers) and kernels_avx512.c (V16 = one 16-wide register).
 *
 * Sharing one body is what makes the AVX-512 path trustworthy on machines that lack AVX-512: all of the loop,
 * tiling and tail logic is exercised by the AVX2 instantiation (and by a test build that instantiates the AVX-512
 * tile shapes on AVX2 registers); only the six small vector primitives differ.
 *
 * The includer defines, before including this file:
 *   V16                      the vector type, lanes 0..15
 *   CB_TARGET                the function attribute enabling the ISA
 *   CB_SUFFIX                appended to the public names (cb_rows##CB_SUFFIX, cb_convert##CB_SUFFIX)
 *   MV_ROWS                  rows per matvec tile (independent accumulators in flight)
 *   MM_ROWS, MM_INPUTS       rows x inputs per matmul tile (each weight vector is reused MM_INPUTS times)
 *   and the always-inline primitives v16_zero, v16_load_f32, v16_load_bf16, v16_load_f16, v16_fma (w*x + acc,
 *   fused), v16_set1 (broadcast), v16_add, v16_mul (each rounded), v16_store and v16_reduce (the tree
 *   s8[i]=l[i]+l[i+8], s4, s2, s1 of kernels.h).
 */
#ifndef CB_SUFFIX
#error "kernels_simd.h is a template: define V16, CB_TARGET, CB_SUFFIX and the v16_* primitives first"
#endif

#define CB_CAT_(a, b) a##b
#define CB_CAT(a, b) CB_CAT_(a, b)
#define CB_NAME(base) CB_CAT(base, CB_SUFFIX)
#define CB_INLINE static inline __attribute__((always_inline)) CB_TARGET

_Static_assert(MV_ROWS >= 1 && MV_ROWS <= 4 && MM_ROWS >= 1 && MM_ROWS <= 4 && MM_INPUTS >= 1 && MM_INPUTS <= 4,
               "tile() holds at most 4 x 4 accumulators");

/* Weight rows of a matmul row block stay in L2 while every group of inputs streams past them. */
#define CB_MM_BLOCK_BYTES (96 * 1024)

CB_INLINE V16 load_weights(const char *row, cb_dtype dt, int c) {
    if (dt == CB_F32) return v16_load_f32((const float *)row + c);
    if (dt == CB_BF16) return v16_load_bf16((const uint16_t *)row + c);
    return v16_load_f16((const uint16_t *)row + c);
}

CB_INLINE float weight_scalar(const char *row, cb_dtype dt, int c) {
    if (dt == CB_F32) return ((const float *)row)[c];
    if (dt == CB_BF16) return cb_bf16_to_f32(((const uint16_t *)row)[c]);
    return cb_f16_to_f32(((const uint16_t *)row)[c]);
}

/* nr rows x nx inputs, all compile-time constants after inlining, so acc lives in registers. Each (row, input)
 * pair has its own 16-lane accumulator: grouping changes the schedule, never the order of any one dot product. */
CB_INLINE void tile(float *Y, size_t ldy, const char *W, size_t row_bytes, cb_dtype dt, const float *X, size_t ldx,
                    int cols, const int nr, const int nx) {
    V16 acc[4][4];
    const int main_cols = cols - cols % 16;
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
        for (int j = 0; j < nx; j++) acc[r][j] = v16_zero();
    for (int c = 0; c < main_cols; c += 16) {
        V16 xv[4];
#pragma GCC unroll 4
        for (int j = 0; j < nx; j++) xv[j] = v16_load_f32(X + (size_t)j * ldx + c);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) {
            V16 w = load_weights(W + (size_t)r * row_bytes, dt, c);
#pragma GCC unroll 4
            for (int j = 0; j < nx; j++) acc[r][j] = v16_fma(w, xv[j], acc[r][j]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++) {
        const char *row = W + (size_t)r * row_bytes;
#pragma GCC unroll 4
        for (int j = 0; j < nx; j++) {
            const float *x = X + (size_t)j * ldx;
            float sum = v16_reduce(acc[r][j]);
            for (int c = main_cols; c < cols; c++) sum = __builtin_fmaf(weight_scalar(row, dt, c), x[c], sum);
            Y[(size_t)j * ldy + r] = sum;
        }
    }
}

/* One input against rows [r0, r1): MV_ROWS rows at a time for memory-level parallelism. */
CB_INLINE void rows_one_input(float *y, const char *W, size_t row_bytes, cb_dtype dt, const float *x, int r0,
                              int r1, int cols) {
    int r = r0;
    for (; r + MV_ROWS <= r1; r += MV_ROWS)
        tile(y + r, 1, W + (size_t)r * row_bytes, row_bytes, dt, x, 0, cols, MV_ROWS, 1);
    for (; r < r1; r++) tile(y + r, 1, W + (size_t)r * row_bytes, row_bytes, dt, x, 0, cols, 1, 1);
}

CB_INLINE void rows_impl(float *Y, size_t ldy, const char *W, cb_dtype dt, const float *X, size_t ldx, int n, int r0,
                         int r1, int cols) {
    const size_t row_bytes = (size_t)cols * (dt == CB_F32 ? 4 : 2);
    if (n == 1) {
        rows_one_input(Y, W, row_bytes, dt, X, r0, r1, cols);
        return;
    }
    int block_rows = row_bytes ? (int)(CB_MM_BLOCK_BYTES / row_bytes) : MM_ROWS;
    block_rows -= block_rows % MM_ROWS;
    if (block_rows < MM_ROWS) block_rows = MM_ROWS;
    for (int rb = r0; rb < r1; rb += block_rows) {
        int re = r1 - rb < block_rows ? r1 : rb + block_rows;
        int j = 0;
        for (; j + MM_INPUTS <= n; j += MM_INPUTS) {
            float *y = Y + (size_t)j * ldy;
            const float *x = X + (size_t)j * ldx;
            int r = rb;
            for (; r + MM_ROWS <= re; r += MM_ROWS)
                tile(y + r, ldy, W + (size_t)r * row_bytes, row_bytes, dt, x, ldx, cols, MM_ROWS, MM_INPUTS);
            for (; r < re; r++)
                tile(y + r, ldy, W + (size_t)r * row_bytes, row_bytes, dt, x, ldx, cols, 1, MM_INPUTS);
        }
        for (; j < n; j++) rows_one_input(Y + (size_t)j * ldy, W, row_bytes, dt, X + (size_t)j * ldx, rb, re, cols);
    }
}

/* One non-inlined body per dtype, so the dtype tests vanish from the inner loops. */
static CB_TARGET void CB_NAME(rows_f32_)(float *Y, size_t ldy, const char *W, const float *X, size_t ldx, int n,
                                         int r0, int r1, int cols) {
    rows_impl(Y, ldy, W, CB_F32, X, ldx, n, r0, r1, cols);
}
static CB_TARGET void CB_NAME(rows_bf16_)(float *Y, size_t ldy, const char *W, const float *X, size_t ldx, int n,
                                          int r0, int r1, int cols) {
    rows_impl(Y, ldy, W, CB_BF16, X, ldx, n, r0, r1, cols);
}
static CB_TARGET void CB_NAME(rows_f16_)(float *Y, size_t ldy, const char *W, const float *X, size_t ldx, int n,
                                         int r0, int r1, int cols) {
    rows_impl(Y, ldy, W, CB_F16, X, ldx, n, r0, r1, cols);
}

CB_TARGET void CB_NAME(cb_rows)(float *Y, size_t ldy, const void *W, cb_dtype dt, const float *X, size_t ldx, int n,
                                int r0, int r1, int cols) {
    switch (dt) {
    case CB_F32: CB_NAME(rows_f32_)(Y, ldy, W, X, ldx, n, r0, r1, cols); return;
    case CB_BF16: CB_NAME(rows_bf16_)(Y, ldy, W, X, ldx, n, r0, r1, cols); return;
    case CB_F16: CB_NAME(rows_f16_)(Y, ldy, W, X, ldx, n, r0, r1, cols); return;
    }
}

CB_TARGET void CB_NAME(cb_convert)(float *out, const void *in, cb_dtype dt, size_t n) {
    const char *src = in;
    const size_t esize = dt == CB_F32 ? 4 : 2;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) v16_store(out + i, load_weights(src + i * esize, dt, 0));
    for (; i < n; i++) out[i] = weight_scalar(src + i * esize, dt, 0);
}

/* cb_axpy's steps, m of them per element in order of t (a rounded product, then a rounded sum, never fused), with
 * y held in registers across them: 64 floats at a time, then 16, then the scalar expression. */
CB_TARGET void CB_NAME(cb_axpy_rows)(float *y, const float *a, size_t lda, const float *X, size_t ldx, int m,
                                     size_t n) {
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        V16 acc[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) acc[k] = v16_load_f32(y + i + 16 * k);
        for (int t = 0; t < m; t++) {
            V16 va = v16_set1(a[(size_t)t * lda]);
            const float *x = X + (size_t)t * ldx + i;
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) acc[k] = v16_add(acc[k], v16_mul(va, v16_load_f32(x + 16 * k)));
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) v16_store(y + i + 16 * k, acc[k]);
    }
    for (; i + 16 <= n; i += 16) {
        V16 acc = v16_load_f32(y + i);
        for (int t = 0; t < m; t++)
            acc = v16_add(acc, v16_mul(v16_set1(a[(size_t)t * lda]), v16_load_f32(X + (size_t)t * ldx + i)));
        v16_store(y + i, acc);
    }
    for (; i < n; i++)
        for (int t = 0; t < m; t++) y[i] += a[(size_t)t * lda] * X[(size_t)t * ldx + i];
}

#undef CB_INLINE
#undef CB_NAME
#undef CB_CAT
#undef CB_CAT_
