/* fixture.h: safetensors checkpoints written by the C tests into their own temporary directory (tmpdir, which
 * the test's main creates): tensors in a given order, so a test controls which pieces are adjacent. Include after
 * check.h. */
#ifndef COLIBRI_TEST_FIXTURE_H
#define COLIBRI_TEST_FIXTURE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct {
    const char *name, *dtype;
    int ndim;
    int64_t shape[2];
    const void *data;
    size_t nbytes;
} fx_tensor;

static char tmpdir[256];

static inline void path_in_tmp(char *out, size_t n, const char *file) { snprintf(out, n, "%s/%s", tmpdir, file); }

/* Create a shard file holding the 8-byte length and `header`; the caller appends the data and closes it. */
static inline FILE *open_shard(const char *file, const char *header, size_t hl) {
    char path[512];
    path_in_tmp(path, sizeof path, file);
    FILE *f = fopen(path, "wb");
    uint8_t len[8];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    fwrite(len, 1, 8, f);
    fwrite(header, 1, hl, f);
    return f;
}

/* Write tensors to a safetensors file in the given order; returns the file's size. */
static inline size_t write_shard(const char *file, const fx_tensor *t, int count) {
    static char header[65536];
    size_t hl = 0, off = 0;
    hl += (size_t)snprintf(header + hl, sizeof header - hl, "{");
    for (int i = 0; i < count; i++) {
        hl += (size_t)snprintf(header + hl, sizeof header - hl, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[",
                               i ? "," : "", t[i].name, t[i].dtype);
        for (int d = 0; d < t[i].ndim; d++)
            hl += (size_t)snprintf(header + hl, sizeof header - hl, "%s%lld", d ? "," : "", (long long)t[i].shape[d]);
        hl += (size_t)snprintf(header + hl, sizeof header - hl, "],\"data_offsets\":[%zu,%zu]}", off,
                               off + t[i].nbytes);
        off += t[i].nbytes;
    }
    hl += (size_t)snprintf(header + hl, sizeof header - hl, "}");
    while (hl % 8) header[hl++] = ' ';
    FILE *f = open_shard(file, header, hl);
    for (int i = 0; i < count; i++) fwrite(t[i].data, 1, t[i].nbytes, f);
    fclose(f);
    return 8 + hl + off;
}

/* Empty tmpdir (between fixtures). */
static inline void clear_tmp(void) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -f %s/*", tmpdir);
    CHECK(system(cmd) == 0, "rm");
}

#endif
