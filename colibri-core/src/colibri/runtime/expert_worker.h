/* expert_worker.h: an engine binary started with --expert-worker holds a share of a model's routed experts in RAM
 * and computes their outputs for a head engine (expert_remote.h) over the framing of expert_wire.h.
 *
 *     ENGINE --expert-worker --model DIR [--listen HOST:PORT] [--threads N]
 *
 * It prints one JSON line {"ev":"listening","port":P,"pid":N} once it listens (port 0 = any free port), and
 * {"ev":"loaded",...} whenever it has read a share. The head sends the share (layers, the three name formats of
 * each, which experts): the worker locates them in its own copy of the checkpoint exactly as the head does and
 * reads them all before answering, so every request it then answers comes from RAM. It serves one head at a time
 * (a new connection replaces the old) and exits when its stdin closes (the process that started it is gone).
 */
#ifndef COLIBRI_EXPERT_WORKER_H
#define COLIBRI_EXPERT_WORKER_H

/* 1 when argv asks for worker mode. */
int cb_expert_worker_wanted(int argc, char **argv);
/* Run the worker until stdin closes. Returns the process exit code (0; 2 on bad arguments or a failed start). */
int cb_expert_worker_main(int argc, char **argv);

#endif
