/* test_mlp.c: the SwiGLU MLP with and without Qwen's sigmoid shared-expert gate, against a double-precision
 * transcription, and batched rows == one row at a time, bit for bit. */
#include <string.h>

#include "mlp.h"
#include "qwen_blocks_common.h"

enum { HID = 20, INTER = 12, T = 5 };

static cb_linear lin(int rows, int cols) {
    cb_linear l = {.w = rand_floats((size_t)rows * cols, 1.0f / sqrtf((float)cols), 0)};
    l.m = cb_matrix_float(l.w, CB_F32, rows, cols);
    return l;
}

static double dot(const cb_linear *l, int r, const double *x) {
    const float *w = l->w;
    double acc = 0;
    for (int c = 0; c < l->m.cols; c++) acc += (double)w[r * l->m.cols + c] * x[c];
    return acc;
}

int main(void) {
    cb_mlp m;
    memset(&m, 0, sizeof m);
    m.hidden = HID;
    m.inter = INTER;
    m.max_batch = T;
    m.gate = lin(INTER, HID);
    m.up = lin(INTER, HID);
    m.down = lin(HID, INTER);
    m.g = malloc(T * INTER * 4);
    m.u = malloc(T * INTER * 4);
    m.s = malloc(T * 4);
    float *x = rand_floats(T * HID, 1.0f, 0), *out = malloc(T * HID * 4), *one = malloc(T * HID * 4);
    double *ref = malloc(T * HID * sizeof(double));
    for (int gated = 0; gated < 2; gated++) {
        if (gated) m.scale = lin(1, HID);
        cb_mlp_forward(&m, out, x, T);
        for (int t = 0; t < T; t++) cb_mlp_forward(&m, one + t * HID, x + t * HID, 1);
        for (int t = 0; t < T; t++) {
            double xd[HID], act[INTER];
            for (int c = 0; c < HID; c++) xd[c] = x[t * HID + c];
            for (int i = 0; i < INTER; i++) {
                double g = dot(&m.gate, i, xd);
                act[i] = g / (1.0 + exp(-g)) * dot(&m.up, i, xd);
            }
            double s = gated ? 1.0 / (1.0 + exp(-dot(&m.scale, 0, xd))) : 1.0;
            for (int c = 0; c < HID; c++) ref[t * HID + c] = s * dot(&m.down, c, act);
        }
        double e = max_abs_diff(out, ref, T * HID);
        CHECK(e < 1e-5, "gated=%d: block vs double reference: %g", gated, e);
        CHECK(!memcmp(out, one, T * HID * 4), "gated=%d: batched rows differ from one at a time", gated);
    }
    cb_mlp_free(&m);
    free(x); free(out); free(one); free(ref);
    printf("test_mlp: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
