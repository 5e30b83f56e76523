/* kernels_scalar.c: the reference path. Every SIMD path must reproduce these bits exactly, so this file is the
 * definition of the summation order (see kernels.h), written as plainly as possible. */
#include <math.h>
#include <string.h>

#include "kernels_impl.h"

size_t cb_dtype_size(cb_dtype dt) {
    switch (dt) {
    case CB_F32: return 4;
    case CB_BF16: return 2;
    case CB_F16: return 2;
    }
    return 0;
}

static float bits_to_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

float cb_bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

/* Exact for every pattern, including subnormals (normalised into f32's range) and inf/NaN. A NaN keeps its sign
 * and payload and comes out quiet (bit 22 set), which is what the F16C/AVX-512 conversion instructions do. */
float cb_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1f) {
        uint32_t nan_quiet = mantissa ? 0x00400000u : 0;
        return bits_to_f32(sign | 0x7f800000u | nan_quiet | (mantissa << 13));
    }
    if (exponent == 0) {
        if (mantissa == 0) return bits_to_f32(sign);
        /* Subnormal: mantissa * 2^-24. Shift the leading one up to the implicit-bit position. */
        uint32_t shift = 0;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            shift++;
        }
        mantissa &= 0x3ffu;
        return bits_to_f32(sign | ((113u - shift) << 23) | (mantissa << 13));
    }
    return bits_to_f32(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/* Round to nearest even; every NaN becomes the canonical quiet NaN 0x7fc0 (sign dropped), as torch does. */
uint16_t cb_f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)((bits + rounding_bias) >> 16);
}

static float weight_at(const void *row, cb_dtype dt, int c) {
    switch (dt) {
    case CB_BF16: return cb_bf16_to_f32(((const uint16_t *)row)[c]);
    case CB_F16: return cb_f16_to_f32(((const uint16_t *)row)[c]);
    case CB_F32: break;
    }
    return ((const float *)row)[c];
}

/* The fixed order: 16 lanes accumulated with fmaf, the pairwise tree, then the tail in order. fmaf is fused
 * (one rounding), exactly like the vfmadd instructions of the SIMD paths. */
static float dot_scalar(const void *row, cb_dtype dt, const float *x, int cols) {
    float lane[16] = {0};
    int main_cols = cols - cols % 16;
    for (int c = 0; c < main_cols; c += 16)
        for (int k = 0; k < 16; k++) lane[k] = fmaf(weight_at(row, dt, c + k), x[c + k], lane[k]);
    float sum = cb_lane16_reduce(lane);
    for (int c = main_cols; c < cols; c++) sum = fmaf(weight_at(row, dt, c), x[c], sum);
    return sum;
}

void cb_rows_scalar(float *Y, size_t ldy, const void *W, cb_dtype dt, const float *X, size_t ldx, int n, int r0,
                    int r1, int cols) {
    size_t row_bytes = (size_t)cols * cb_dtype_size(dt);
    for (int r = r0; r < r1; r++) {
        const void *row = (const char *)W + (size_t)r * row_bytes;
        for (int j = 0; j < n; j++) Y[(size_t)j * ldy + r] = dot_scalar(row, dt, X + (size_t)j * ldx, cols);
    }
}

void cb_axpy_scalar(float *y, float a, const float *x, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] += a * x[i];
}

void cb_axpy_rows_scalar(float *y, const float *a, size_t lda, const float *X, size_t ldx, int m, size_t n) {
    for (int t = 0; t < m; t++) cb_axpy_scalar(y, a[(size_t)t * lda], X + (size_t)t * ldx, n);
}

void cb_convert_scalar(float *out, const void *in, cb_dtype dt, size_t n) {
    if (dt == CB_F32) {
        memcpy(out, in, n * sizeof(float));
        return;
    }
    const uint16_t *h = in;
    if (dt == CB_BF16)
        for (size_t i = 0; i < n; i++) out[i] = cb_bf16_to_f32(h[i]);
    else
        for (size_t i = 0; i < n; i++) out[i] = cb_f16_to_f32(h[i]);
}
