/* expert_remote.h: the head engine's side of expert parallelism: routed experts held in the RAM of expert workers
 * (other processes, usually on other machines; expert_worker.h) are computed there instead of read from disk.
 *
 * An expert map (a text file the launcher writes, docs/protocol.md "Expert workers") names each worker's address
 * and the (layer, expert) pairs it holds. In a MoE call, the experts a row chose that this process does not hold
 * resident and a live worker does are sent to that worker: the hidden rows that chose them, once each, and per
 * expert the rows it applies to; the worker answers each (row, expert) output, computed with the same
 * cb_expert_apply on the same rows, which the block then combines in its own fixed order. So tokens never depend on
 * which process computed what.
 *
 * Failure: every socket call has a deadline (the timeout, 2 s by default). A worker that errs, closes or times out
 * is marked dead and its experts of the call are handed back to the local path, which streams them from disk. A
 * background thread reconnects dead workers (every 0.5 s) and re-sends their share; once the worker has loaded it
 * the head uses it again. Nothing here ever stops a request.
 */
#ifndef COLIBRI_EXPERT_REMOTE_H
#define COLIBRI_EXPERT_REMOTE_H

#include <stdint.h>

#include "experts.h"
#include "json.h"

/* Read the expert map and connect to every worker, waiting up to wait_s for them to load their share (a worker
 * that is not up by then is left to the reconnect thread). Call after every MoE layer is initialised. 0, or -1
 * with a message naming the map file and line. */
int cb_remote_start(const char *map_path, int timeout_ms, double wait_s, char *err, size_t errlen);
/* Stop the reconnect thread and close every connection. */
void cb_remote_stop(void);
int cb_remote_active(void);

/* Send the experts of L that rows chose (n_rows[e] > 0), that L does not hold resident and a live worker does;
 * their n_rows become 0 (the local path skips them). x: the n rows of the layer input; chosen: n x top_k. */
void cb_remote_send(cb_expert_layer *L, int *n_rows, const int *chosen, int n, int top_k, const float *x,
                    float swiglu_limit);
/* Collect the outputs of the last send into y ((row, choice) x hidden). The experts of a worker that failed get
 * their n_rows back; returns how many experts the caller must still compute (0 when every worker answered). */
int cb_remote_recv(cb_expert_layer *L, int *n_rows, float *y);

/* Network counters, cumulative (bytes are payload + header, both directions). */
typedef struct {
    uint64_t messages, rows, experts, bytes_sent, bytes_received, layer_round_trips, failures, fallback_experts;
} cb_remote_counters;
cb_remote_counters cb_remote_totals(void);
/* The counters as JSON fields (,"remote_messages":...), for done events and stats. */
void cb_remote_put_counters(cb_buf *b, const cb_remote_counters *c);
/* ,"expert_workers":[{address, alive, pid, experts, bytes_held, messages, failures, reconnects}, ...] */
void cb_remote_put_workers(cb_buf *b);

#endif
