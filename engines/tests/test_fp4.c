/* test_fp4.c: fp4 (e2m1, per-32 scales) weights: the nibble order and value table, every scale kind, and the
 * kernels against cb_dot of the dequantized f32 rows, bit for bit on every ISA this CPU has, batched or not,
 * threaded or not (fp4.h's contract). */
#include <string.h>

#include "fp4.h"
#include "kernels.h"
#include "qwen_blocks_common.h"

enum { ROWS = 37, COLS = 96, N = 6 };

static uint8_t e8m0_byte(void) { return (uint8_t)(120 + (int)(uniform() * 14)); }   /* 2^-7 .. 2^6 */

int main(void) {
    /* the format: low nibble first, s.ee.m */
    uint8_t two = 0x9 << 4 | 0x7;   /* element 0 = +6, element 1 = -0.5 */
    uint8_t sc1 = 127;              /* 2^0 */
    cb_fp4matrix one = {1, 32, NULL, &sc1, CB_FP8_SCALE_E8M0};
    uint8_t packed1[16] = {two};
    one.w = packed1;
    float row[32];
    cb_fp4_dequant_row(row, &one, 0);
    CHECK(row[0] == 6.0f && row[1] == -0.5f && row[2] == 0.0f, "nibble order / table: %g %g", row[0], row[1]);
    uint8_t sc2 = 130;
    one.scales = &sc2;
    cb_fp4_dequant_row(row, &one, 0);
    CHECK(row[0] == 48.0f, "ue8m0 130 scales by 8: %g", row[0]);

    uint8_t *w = malloc(ROWS * COLS / 2);
    for (int i = 0; i < ROWS * COLS / 2; i++) w[i] = (uint8_t)(uniform() * 256);
    int groups = ROWS * (COLS / CB_FP4_GROUP);
    uint8_t *s8 = malloc(groups);
    float *s32 = malloc(groups * sizeof(float));
    uint16_t *s16 = malloc(groups * sizeof(uint16_t));
    for (int i = 0; i < groups; i++) {
        s8[i] = e8m0_byte();
        s32[i] = 0.01f + (float)uniform();
        s16[i] = cb_f32_to_bf16(s32[i]);
    }
    const void *scales[3] = {s32, s16, s8};
    cb_fp8_scale_kind kinds[3] = {CB_FP8_SCALE_F32, CB_FP8_SCALE_BF16, CB_FP8_SCALE_E8M0};
    float *X = rand_floats(N * COLS, 1.0f, 0), *deq = malloc(ROWS * COLS * sizeof(float));
    float *ref = malloc(N * ROWS * sizeof(float)), *Y = malloc(N * ROWS * sizeof(float)),
          *y1 = malloc(ROWS * sizeof(float));
    cb_isa isas[3] = {CB_ISA_SCALAR, CB_ISA_AVX2, CB_ISA_AVX512};
    for (int k = 0; k < 3; k++) {
        cb_fp4matrix W = {ROWS, COLS, w, scales[k], kinds[k]};
        for (int r = 0; r < ROWS; r++) cb_fp4_dequant_row(deq + r * COLS, &W, r);
        int exact = 1;
        for (int r = 0; r < ROWS && exact; r++)
            for (int c = 0; c < COLS; c++) {
                uint8_t b = w[r * COLS / 2 + c / 2];
                float want = cb_e2m1_table[c & 1 ? b >> 4 : b & 15] * cb_fp4_scale(&W, r, c / 32);
                if (memcmp(&want, &deq[r * COLS + c], 4)) exact = 0;
            }
        CHECK(exact, "kind %d: dequantized rows are e2m1 * scale", k);
        for (int i = 0; i < N; i++)
            for (int r = 0; r < ROWS; r++) ref[i * ROWS + r] = cb_dot(deq + r * COLS, CB_F32, X + i * COLS, COLS);
        for (int threads = 1; threads <= 2; threads++) {
            cb_threads_init(threads);
            for (int t = 0; t < 3; t++) {
                if (cb_set_isa(isas[t])) continue;   /* not on this CPU */
                memset(Y, 0, N * ROWS * sizeof(float));
                cb_fp4_matmul(Y, &W, X, N);
                CHECK(!memcmp(Y, ref, N * ROWS * sizeof(float)), "kind %d isa %s threads %d: batched != cb_dot of "
                      "the dequantized rows", k, cb_isa_name(isas[t]), threads);
                cb_fp4_matvec(y1, &W, X + 3 * COLS);
                CHECK(!memcmp(y1, ref + 3 * ROWS, ROWS * sizeof(float)), "kind %d isa %s: matvec != batched row",
                      k, cb_isa_name(isas[t]));
            }
            cb_set_isa(cb_isa_detect());
        }
    }
    cb_threads_shutdown();
    free(w); free(s8); free(s32); free(s16); free(X); free(deq); free(ref); free(Y); free(y1);
    (void)max_abs_diff;
    printf("test_fp4: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
