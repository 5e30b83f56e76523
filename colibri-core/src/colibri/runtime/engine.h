/* engine.h: what a family engine supplies and what the shared runtime does with it.
 *
 * The runtime owns the process: argument parsing, the JSON-lines protocol of docs/protocol.md, KV slots,
 * scheduling (slots interleaved, prefill in chunks, the slots decoding together batched, stdin polled between
 * steps), prefix reuse, sampling and stats. A family supplies a cb_family: load the weights, run a forward pass over
 * n tokens of one slot (and, optionally, over one token of each of several slots), free.
 * A family's C file is then a short composition of the blocks in blocks.h and decoder.h (which never include this
 * header: the dependency runs process -> blocks; the family interface is family.h, the KV cache kv.h and the --set
 * table hparams.h) plus
 *
 *     int main(int argc, char **argv) { return cb_engine_main(argc, argv, &my_family); }
 */
#ifndef COLIBRI_ENGINE_H
#define COLIBRI_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "family.h"

int cb_engine_main(int argc, char **argv, const cb_family *family);

/* Resident set size of this process in bytes (from /proc/self/statm), 0 when unknown. */
size_t cb_rss_bytes(void);

#endif
