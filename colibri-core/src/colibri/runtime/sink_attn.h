/* sink_attn.h: multi-query attention of one query row over a gathered set of shared key=value rows, with a
 * learned per-head attention sink (DeepSeek-V4, gpt-oss style).
 *
 * Every head h scores each row r as q_h . kv_r * scale; the sink is one more logit that takes part in the
 * softmax and is then dropped, so the weights over the rows sum to less than 1:
 *
 *     p = softmax([scores_h, sink_h])[:-1];   out_h = sum_r p_r kv_r
 *
 * The rows are given as pointers (a sliding window of the KV cache, then chosen compressed entries), visited in
 * the given order.
 */
#ifndef COLIBRI_SINK_ATTN_H
#define COLIBRI_SINK_ATTN_H

/* q, out: n_heads * head_dim. rows[n_rows] each head_dim floats. sinks: n_heads (NULL: no sink).
 * scores: scratch of n_rows + 1 floats. */
void cb_sink_attend(float *out, const float *q, int n_heads, int head_dim, const float *const *rows, int n_rows,
                    const float *sinks, float scale, float *scores);

#endif
