/* compressor.c: see compressor.h. */
#include "compressor.h"

#include <math.h>

void cb_compress_window(float *entry, const float *const *kv, const float *const *gate, int n_slots, int dim) {
    for (int c = 0; c < dim; c++) {
        float max = -INFINITY;
        for (int s = 0; s < n_slots; s++)
            if (gate[s] && gate[s][c] > max) max = gate[s][c];
        float sum = 0;
        for (int s = 0; s < n_slots; s++)
            if (gate[s]) sum += expf(gate[s][c] - max);
        float acc = 0;
        for (int s = 0; s < n_slots; s++)
            if (gate[s]) acc += kv[s][c] * (expf(gate[s][c] - max) / sum);
        entry[c] = acc;
    }
}
