/* kv_file.h: a slot's state on disk (docs/formats.md "Saved KV files"), so a conversation survives a restart.
 *
 * A file holds the token ids a slot has fed, their KV rows of every layer (K and V, or the one MLA latent + RoPE
 * key row with kv_k_only; DSA index keys live in those rows), the recurrent state at exactly that length and,
 * when there is one, the end-of-prompt checkpoint (engine.c's snapshot). The header names the family, the model
 * identity the caller gave the engine and the geometry; a checksum covers the header and the payload.
 *
 * Writes go to a temporary file that is fsynced and renamed over the target, so a reader sees a whole file or
 * none. Reads trust nothing: the header is checked against the engine's own geometry and the file's size before
 * any byte of it sizes anything, and a failed check says why in one line (the caller warns and prefills).
 */
#ifndef COLIBRI_KV_FILE_H
#define COLIBRI_KV_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "kv.h"

#define CB_KV_FILE_VERSION 1
#define CB_KV_FAMILY_LEN 32
#define CB_KV_IDENTITY_LEN 64

/* What a file must match to be loaded: the engine's family, model identity and per-slot geometry. */
typedef struct {
    const char *family;
    const char *identity;      /* the caller's model/container identity ("" when none was given) */
    int n_layers, kv_dim, kv_k_only, ctx;
    size_t state_bytes;
} cb_kv_geometry;

/* Save tokens[0, n_tokens) with their rows of kv (and kv->state; snap when snap_pos > 0) to path, atomically.
 * Returns the bytes written, or 0 with a one-line reason in err (no file is left behind). */
size_t cb_kv_file_save(const char *path, const cb_kv_geometry *g, const cb_kv *kv, const int *tokens, int n_tokens,
                       const float *snap, int snap_pos, char *err, size_t errlen);


/* The checksum the format uses (64-bit, four interleaved multiply-rotate lanes over little-endian words), exposed
 * for tests and for readers in other languages to follow: update with any split of the bytes gives the same. */
typedef struct {
    uint64_t lane[4];
    unsigned char tail[32];
    size_t tail_len;
    uint64_t total;
} cb_kv_hash;

/* An opened, header-checked file: its tokens are read; the payload is not yet. */
typedef struct {
    const char *path;          /* the caller's string, for messages */
    int fd;
    int n_tokens, snap_pos;
    int *tokens;
    uint64_t checksum;         /* as stored */
    cb_kv_hash hash;           /* over what has been read so far */
} cb_kv_file;

/* Open path and check its header against g and its size; reads the token ids. 0 on success, else -1 with the
 * reason in err (nothing to close). */
int cb_kv_file_open(cb_kv_file *f, const char *path, const cb_kv_geometry *g, char *err, size_t errlen);

/* Read the payload into kv (rows 0..n_tokens of every layer), state (the state at n_tokens, when the model has
 * one) and snap (the checkpoint at f->snap_pos, when the file has one), then verify the checksum. On failure the
 * destinations hold garbage: the caller must forget the slot's prefix. */
int cb_kv_file_read(cb_kv_file *f, const cb_kv_geometry *g, cb_kv *kv, float *state, float *snap, char *err,
                    size_t errlen);

void cb_kv_file_close(cb_kv_file *f);

void cb_kv_hash_init(cb_kv_hash *h);
void cb_kv_hash_update(cb_kv_hash *h, const void *data, size_t n);
uint64_t cb_kv_hash_final(const cb_kv_hash *h);

#endif
