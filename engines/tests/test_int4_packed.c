/* test_int4_packed.c: compressed-tensors pack-quantized int4 weights: the word / nibble order and the offset, both
 * scale kinds and two group sizes, the decode on every ISA against the scalar one, and the kernels against
 * cb_dot of the dequantized f32 rows, bit for bit, batched or not, threaded or not (int4_packed.h's contract). */
#include <string.h>

#include "int4_packed.h"
#include "kernels.h"
#include "qwen_blocks_common.h"

enum { ROWS = 37, COLS = 128, N = 6 };

int main(void) {
    /* the format: one I32 word holds values 0..7, lowest bits first, each stored as q + 8 */
    uint32_t word = 0;
    int q[8] = {-8, 7, 0, -1, 3, -5, 1, 6};
    for (int k = 0; k < 8; k++) word |= (uint32_t)(q[k] + 8) << (4 * k);
    uint32_t words[2] = {word, 0x88888888u};   /* 16 columns; the second word is all zeros */
    float one_scale = 0.5f;
    cb_i4pmatrix one = {1, 16, 16, (const uint8_t *)words, &one_scale, CB_FP8_SCALE_F32};
    float row[16];
    cb_isa isas[3] = {CB_ISA_SCALAR, CB_ISA_AVX2, CB_ISA_AVX512};
    for (int t = 0; t < 3; t++) {
        if (cb_set_isa(isas[t])) continue;
        cb_i4p_dequant_row(row, &one, 0);
        int ok = 1;
        for (int k = 0; k < 8; k++) ok &= row[k] == 0.5f * (float)q[k] && row[8 + k] == 0.0f;
        CHECK(ok, "isa %s: word order / offset: %g %g %g", cb_isa_name(isas[t]), row[0], row[1], row[7]);
    }
    cb_set_isa(cb_isa_detect());

    uint8_t *w = malloc(ROWS * COLS / 2);
    for (int i = 0; i < ROWS * COLS / 2; i++) w[i] = (uint8_t)(uniform() * 256);
    int groups = ROWS * (COLS / 16);
    float *s32 = malloc(groups * sizeof(float));
    uint16_t *s16 = malloc(groups * sizeof(uint16_t));
    for (int i = 0; i < groups; i++) {
        s16[i] = cb_f32_to_bf16(0.01f + (float)uniform());
        s32[i] = 0.01f + (float)uniform();
    }
    const void *scales[2] = {s32, s16};
    cb_fp8_scale_kind kinds[2] = {CB_FP8_SCALE_F32, CB_FP8_SCALE_BF16};
    int group_sizes[2] = {32, 16};
    float *X = rand_floats(N * COLS, 1.0f, 0), *deq = malloc(ROWS * COLS * sizeof(float));
    float *ref = malloc(N * ROWS * sizeof(float)), *Y = malloc(N * ROWS * sizeof(float)),
          *other = malloc(COLS * sizeof(float));
    for (int k = 0; k < 2; k++)
        for (int gi = 0; gi < 2; gi++) {
            int G = group_sizes[gi];
            cb_i4pmatrix W = {ROWS, COLS, G, w, scales[k], kinds[k]};
            int exact = 1;
            for (int r = 0; r < ROWS; r++) {
                cb_i4p_dequant_row_scalar(deq + r * COLS, &W, r);
                for (int c = 0; c < COLS; c++) {
                    uint8_t b = w[r * COLS / 2 + c / 2];
                    float want = (float)((c & 1 ? b >> 4 : b & 15) - 8) * cb_i4p_scale(&W, r, c / G);
                    if (memcmp(&want, &deq[r * COLS + c], 4)) exact = 0;
                }
            }
            CHECK(exact, "kind %d group %d: dequantized rows are (u - 8) * scale", k, G);
            for (int i = 0; i < N; i++)
                for (int r = 0; r < ROWS; r++)
                    ref[i * ROWS + r] = cb_dot(deq + r * COLS, CB_F32, X + i * COLS, COLS);
            for (int threads = 1; threads <= 2; threads++) {
                cb_threads_init(threads);
                for (int t = 0; t < 3; t++) {
                    if (cb_set_isa(isas[t])) continue;   /* not on this CPU */
                    int same = 1;
                    for (int r = 0; r < ROWS; r++) {
                        cb_i4p_dequant_row(other, &W, r);
                        same &= !memcmp(other, deq + r * COLS, COLS * sizeof(float));
                    }
                    CHECK(same, "kind %d group %d isa %s: decode != scalar decode", k, G, cb_isa_name(isas[t]));
                    for (int n = 1; n <= N; n += N - 1) {
                        memset(Y, 0, N * ROWS * sizeof(float));
                        cb_i4p_matmul(Y, &W, X, n);
                        CHECK(!memcmp(Y, ref, (size_t)n * ROWS * sizeof(float)), "kind %d group %d isa %s threads %d "
                              "n %d: != cb_dot of the dequantized rows", k, G, cb_isa_name(isas[t]), threads, n);
                    }
                }
                cb_set_isa(cb_isa_detect());
            }
        }
    cb_threads_shutdown();
    free(w); free(s32); free(s16); free(X); free(deq); free(ref); free(Y); free(other);
    (void)max_abs_diff;
    printf("test_int4_packed: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
