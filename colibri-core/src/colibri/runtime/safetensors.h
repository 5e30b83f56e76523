/* safetensors.h: an index of every tensor in a checkpoint directory, read from the shard headers.
 *
 * The index validates each header against its file (offsets inside the data section, byte counts equal to
 * dtype size x shape) so a truncated or corrupted shard is reported by name before any weight is used.
 */
#ifndef COLIBRI_SAFETENSORS_H
#define COLIBRI_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

#define CB_MAX_DIMS 8

typedef struct {
    char *name;
    int shard;                 /* index into cb_st_index.shard_paths / fds */
    int supported;             /* dtype is one the float kernels take (F32, BF16, F16); F8_E4M3 block-quantized
                                * weights are read through fp8.h instead */
    cb_dtype dtype;
    char dtype_name[16];
    int ndim;
    int64_t shape[CB_MAX_DIMS];
    uint64_t offset;           /* absolute byte offset in the shard file */
    uint64_t nbytes;
} cb_tensor;

typedef struct {
    int n_shards;
    char **shard_paths;
    int *fds;
    int n_tensors;
    cb_tensor *tensors;
    int *table;                /* open-addressing hash of tensor names -> index, size table_size */
    int table_size;
    void *quant;               /* qlinear.c's memo: the colibri-quant container (cb_qcontainer), a native marker,
                                * or NULL before anyone asked (cb_qc_of) */
    void (*quant_free)(void *quant);   /* how cb_st_close frees it (set with it; no link-time dependency) */
} cb_st_index;

/* Open model_dir/model.safetensors.index.json (its weight_map's shards) or else every *.safetensors in the
 * directory, and index all tensors. Returns 0, or -1 with a message naming the file and the problem. */
int cb_st_open(cb_st_index *idx, const char *model_dir, char *err, size_t errlen);
/* Add one more file to an open index (a head shipped beside a sharded checkpoint, which its index does not name).
 * 0, or -1 with a message (the index is then closed). */
int cb_st_add_file(cb_st_index *idx, const char *path, char *err, size_t errlen);
void cb_st_close(cb_st_index *idx);

const cb_tensor *cb_st_find(const cb_st_index *idx, const char *name);

/* Look a tensor up and check its dtype is supported and its shape equals dims[0..ndim) (a 1-D expectation
 * also accepts nothing else). Returns NULL with a message naming the tensor when any check fails. */
const cb_tensor *cb_st_expect(const cb_st_index *idx, const char *name, int ndim, const int64_t *dims,
                              char *err, size_t errlen);

/* pread exactly n bytes at offset from a shard (retrying short reads). Returns 0 or -1 with a message. */
int cb_st_pread(const cb_st_index *idx, int shard, void *dst, uint64_t n, uint64_t offset, char *err,
                size_t errlen);

/* Mapped tensor data must start this aligned in its file (safetensors pads its header to 8), as the row readers
 * take 2- and 4-byte elements by pointer: a misaligned tensor is loaded (into an aligned buffer) instead. */
#define CB_MAP_ALIGN 8u
/* Map tensor t read-only instead of reading it: *at points at its first byte, and the mapping the caller must
 * munmap is (*base, *len). Pages come in from the file (or the page cache) as they are touched and the kernel may
 * drop them again under memory pressure, so a tensor read a row at a time (an untied input embedding) costs the
 * rows used, not the tensor. 0, or -1 with a message; callers fall back to cb_st_load. */
int cb_st_map(const cb_st_index *idx, const cb_tensor *t, const void **at, void **base, size_t *len, char *err,
              size_t errlen);

/* Allocate a 64-byte aligned buffer and read the whole tensor into it. NULL with a message on failure. */
void *cb_st_load(const cb_st_index *idx, const cb_tensor *t, char *err, size_t errlen);

/* Read weight tensor t and its scale tensor sc into one 64-byte-aligned buffer (*buf, the caller's to free): the
 * weights first, the scales from the next 64-byte boundary (*scales); *bytes grows by both. 0, or -1 with a
 * message naming `name` (nothing allocated then). The reader of every format that stores a matrix as weights plus
 * scales (fp8, fp4, colibri-quant int8/int4). */
int cb_scaled_read(void **buf, const void **scales, const cb_st_index *idx, const cb_tensor *t, const cb_tensor *sc,
                   const char *name, size_t *bytes, char *err, size_t errlen);

#endif
