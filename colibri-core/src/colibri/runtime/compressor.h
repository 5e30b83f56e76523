/* compressor.h: DeepSeek-V4's KV compressor: one compressed entry from a window of source rows.
 *
 * Each slot s contributes a value row kv_s and a gate row gate_s (the learned per-slot position bias already
 * added); per channel c the entry is the gate-softmax-weighted sum over the slots:
 *
 *     entry[c] = sum_s softmax_s(gate_s[c]) kv_s[c]
 *
 * A NULL slot is absent (gate -inf: weight 0), which is how the overlapping CSA window starts the sequence.
 * The caller normalises and rotates the entry (the compressor's RMSNorm and RoPE at the window's first position).
 */
#ifndef COLIBRI_COMPRESSOR_H
#define COLIBRI_COMPRESSOR_H

/* kv[n_slots], gate[n_slots]: pointers to dim floats each, or NULL (both) for an absent slot. */
void cb_compress_window(float *entry, const float *const *kv, const float *const *gate, int n_slots, int dim);

#endif
