/* sink_attn.c: see sink_attn.h. */
#include "sink_attn.h"

#include <math.h>
#include <string.h>

#include "kernels.h"

void cb_sink_attend(float *out, const float *q, int n_heads, int head_dim, const float *const *rows, int n_rows,
                    const float *sinks, float scale, float *scores) {
    for (int h = 0; h < n_heads; h++) {
        const float *qh = q + (size_t)h * head_dim;
        float *oh = out + (size_t)h * head_dim;
        float max = -INFINITY;
        for (int r = 0; r < n_rows; r++) {
            scores[r] = cb_dot(rows[r], CB_F32, qh, head_dim) * scale;
            if (scores[r] > max) max = scores[r];
        }
        float sink = sinks ? sinks[h] : -INFINITY;
        if (sink > max) max = sink;
        float sum = 0;
        for (int r = 0; r < n_rows; r++) {
            scores[r] = expf(scores[r] - max);
            sum += scores[r];
        }
        if (sinks) sum += expf(sink - max);
        memset(oh, 0, (size_t)head_dim * sizeof(float));
        for (int r = 0; r < n_rows; r++) {
            float p = scores[r] / sum;
            for (int d = 0; d < head_dim; d++) oh[d] += p * rows[r][d];
        }
    }
}
