/* expert_read.c: where an expert's pieces are in the checkpoint, how many reads they take, this process's own
 * per-shard descriptors (buffered with POSIX_FADV_RANDOM, O_DIRECT where the filesystem allows) and the readers. */
#define _GNU_SOURCE
#include "experts_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static struct {
    const cb_st_index *idx;
    int refs, n;
    int *buffered_fd, *direct_fd;   /* our own descriptors: advice and O_DIRECT must not touch the index's */
} shards;

static void shards_close(void) {
    for (int i = 0; i < shards.n; i++) {
        if (shards.buffered_fd[i] >= 0) close(shards.buffered_fd[i]);
        if (shards.direct_fd[i] >= 0) close(shards.direct_fd[i]);
    }
    free(shards.buffered_fd);
    free(shards.direct_fd);
    memset(&shards, 0, sizeof shards);
}

/* O_DIRECT works where one aligned read at offset 0 succeeds; tmpfs and some overlays refuse the open. */
static int open_direct(const char *path) {
    int fd = open(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
    if (fd < 0) return -1;
    void *probe = aligned_alloc(CBX_DIO_ALIGN, CBX_DIO_ALIGN);
    ssize_t r = probe ? pread(fd, probe, CBX_DIO_ALIGN, 0) : -1;
    free(probe);
    if (r < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int cbx_shards_open(const cb_st_index *idx, int want_direct) {
    if (shards.idx == idx) {
        shards.refs++;
        return 0;
    }
    if (shards.idx) return 0;   /* one model per process; a second index reads through its own fds */
    shards.idx = idx;
    shards.refs = 1;
    shards.n = idx->n_shards;
    shards.buffered_fd = malloc((size_t)shards.n * sizeof(int));
    shards.direct_fd = malloc((size_t)shards.n * sizeof(int));
    if (!shards.buffered_fd || !shards.direct_fd) {
        shards_close();
        return -1;
    }
    for (int i = 0; i < shards.n; i++) {
        shards.buffered_fd[i] = open(idx->shard_paths[i], O_RDONLY | O_CLOEXEC);
        /* Expert reads are random and exactly sized: kernel readahead would only drag in neighbours that get
         * evicted before use (measured 7x slower for mmap streaming with 8 MiB readahead). */
        if (shards.buffered_fd[i] >= 0) posix_fadvise(shards.buffered_fd[i], 0, 0, POSIX_FADV_RANDOM);
        shards.direct_fd[i] = want_direct ? open_direct(idx->shard_paths[i]) : -1;
        if (want_direct && shards.direct_fd[i] < 0 && cb_experts_options()->io_mode == CB_IO_DIRECT)
            fprintf(stderr, "notice: %s refuses direct I/O (%s); reading it buffered\n", idx->shard_paths[i],
                    strerror(errno));
    }
    return 0;
}

void cbx_shards_release(const cb_st_index *idx) {
    if (shards.idx == idx && --shards.refs == 0) shards_close();
}

const char *cb_experts_io_name(void) {
    int direct = 0, buffered = 0;
    for (int i = 0; i < shards.n; i++) {
        if (shards.direct_fd[i] >= 0) direct++;
        else buffered++;
    }
    return direct && buffered ? "mixed" : direct ? "direct" : "buffered";
}

/* ---- readers (no counters: the I/O threads call these too) ---- */

static int pread_all(int fd, void *dst, uint64_t n, uint64_t offset, uint64_t need, const char *path, char *err,
                     size_t errlen) {
    char *p = dst;
    uint64_t got = 0;
    while (got < n) {
        size_t chunk = n - got > ((size_t)1 << 30) ? (size_t)1 << 30 : (size_t)(n - got);
        ssize_t r = pread(fd, p + got, chunk, (off_t)(offset + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            snprintf(err, errlen, "reading %s at offset %llu: %s", path, (unsigned long long)(offset + got),
                     strerror(errno));
            return -1;
        }
        if (r == 0) break;
        got += (uint64_t)r;
    }
    if (got < need) {
        snprintf(err, errlen, "%s is truncated: wanted %llu bytes at offset %llu", path, (unsigned long long)need,
                 (unsigned long long)offset);
        return -1;
    }
    return 0;
}

int cbx_raw_read(const cb_expert_layer *L, int e, void *buf, size_t *data_off, char *err, size_t errlen) {
    const cb_expert_location *loc = &L->loc[e];
    const cb_st_index *idx = L->idx;
    int own = shards.idx == idx;
    *data_off = 0;
    if (loc->single_read) {
        int sh = loc->shard[0];
        if (own && shards.direct_fd[sh] >= 0) {
            uint64_t lo = loc->span_offset & ~(uint64_t)(CBX_DIO_ALIGN - 1);
            uint64_t need = loc->span_offset + loc->span_bytes - lo;
            uint64_t len = (need + CBX_DIO_ALIGN - 1) & ~(uint64_t)(CBX_DIO_ALIGN - 1);
            /* The last page of the file may be short: only `need` bytes must arrive. */
            if (pread_all(shards.direct_fd[sh], buf, len, lo, need, idx->shard_paths[sh], err, errlen)) return -1;
            *data_off = (size_t)(loc->span_offset - lo);
            __atomic_add_fetch(&cb_prof.direct_reads, 1, __ATOMIC_RELAXED);
            return 0;
        }
        int fd = own && shards.buffered_fd[sh] >= 0 ? shards.buffered_fd[sh] : idx->fds[sh];
        __atomic_add_fetch(&cb_prof.buffered_reads, 1, __ATOMIC_RELAXED);
        return pread_all(fd, buf, loc->span_bytes, loc->span_offset, loc->span_bytes, idx->shard_paths[sh], err,
                         errlen);
    }
    if (loc->two_spans) {   /* fp8: the weights' span at rel[0]'s base, the scales' span at rel_scales[]'s */
        int sh = loc->shard[0], fd = own && shards.buffered_fd[sh] >= 0 ? shards.buffered_fd[sh] : idx->fds[sh];
        size_t wbase = loc->rel[0] - (size_t)(loc->offset[0] - loc->span_offset);
        size_t sbase = loc->rel_scales[0] - (size_t)(loc->sc_offset[0] - loc->sc_span_offset);
        int ssh = loc->sc_shard[0];
        int sfd = own && shards.buffered_fd[ssh] >= 0 ? shards.buffered_fd[ssh] : idx->fds[ssh];
        if (pread_all(fd, (char *)buf + wbase, loc->span_bytes, loc->span_offset, loc->span_bytes,
                      idx->shard_paths[sh], err, errlen) ||
            pread_all(sfd, (char *)buf + sbase, loc->sc_span_bytes, loc->sc_span_offset, loc->sc_span_bytes,
                      idx->shard_paths[ssh], err, errlen))
            return -1;
        __atomic_add_fetch(&cb_prof.buffered_reads, 2, __ATOMIC_RELAXED);
        return 0;
    }
    for (int m = 0; m < 3; m++) {
        int sh = loc->shard[m];
        int fd = own && shards.buffered_fd[sh] >= 0 ? shards.buffered_fd[sh] : idx->fds[sh];
        if (pread_all(fd, (char *)buf + loc->rel[m], loc->nbytes[m], loc->offset[m], loc->nbytes[m],
                      idx->shard_paths[sh], err, errlen))
            return -1;
    }
    for (int m = 0; cb_expert_scaled(loc) && m < 3; m++) {
        int sh = loc->sc_shard[m];
        int fd = own && shards.buffered_fd[sh] >= 0 ? shards.buffered_fd[sh] : idx->fds[sh];
        if (pread_all(fd, (char *)buf + loc->rel_scales[m], loc->sc_nbytes[m], loc->sc_offset[m],
                      loc->sc_nbytes[m], idx->shard_paths[sh], err, errlen))
            return -1;
    }
    __atomic_add_fetch(&cb_prof.buffered_reads, cb_expert_scaled(loc) ? 6 : 3, __ATOMIC_RELAXED);
    return 0;
}

void cbx_count_read(cb_expert_layer *L, int e) {
    const cb_expert_location *loc = &L->loc[e];
    L->count.reads += loc->single_read ? 1 : loc->two_spans ? 2 : cb_expert_scaled(loc) ? 6 : 3;
    uint64_t pieces = loc->nbytes[0] + loc->nbytes[1] + loc->nbytes[2];
    if (cb_expert_scaled(loc)) pieces += loc->sc_nbytes[0] + loc->sc_nbytes[1] + loc->sc_nbytes[2];
    L->count.bytes_read += loc->single_read ? loc->span_bytes : pieces;
}

/* Locate a native expert's three matrices, and their scales when the checkpoint is fp8, fp4 or packed int4 (all
 * three or none: a scale companion on only some of them is refused). */
int cbx_locate_native(cb_expert_location *loc, const cb_st_index *idx, const char *const names[3], int layer,
                         int e, int hidden, int inter, char *err, size_t errlen) {
    for (int m = 0; m < 3; m++) {
        char name[512];
        snprintf(name, sizeof name, names[m], layer, e);
        int rows = m == CB_DOWN ? hidden : inter, cols = m == CB_DOWN ? inter : hidden;
        const cb_tensor *t, *sc;
        int group = 0;
        int rci = cb_i4p_locate(idx, name, rows, cols, &t, &sc, &group, err, errlen);   /* X.weight_packed */
        if (rci < 0) return -1;
        int rc4 = rci == 0 ? 1 : cb_fp4_locate(idx, name, rows, cols, &t, &sc, err, errlen);   /* I8/U8/F4 + scale */
        if (rc4 < 0) return -1;
        int rc = rci == 0 || rc4 == 0 ? 0 : cb_fp8_locate(idx, name, rows, cols, &t, &sc, err, errlen);
        if (rc < 0) return -1;
        cb_mat_kind kind = rci == 0 ? CB_MAT_I4P : rc4 == 0 ? CB_MAT_FP4 : CB_MAT_FP8;
        if (m > 0 && rc == 0 && kind != loc->kind) {
            snprintf(err, errlen, "layer %d expert %d: %s is %s but its other matrices are not; an expert's three "
                     "matrices share one format", layer, e, name,
                     kind == CB_MAT_I4P ? "packed int4" : kind == CB_MAT_FP4 ? "fp4" : "fp8");
            return -1;
        }
        if (m > 0 && (rc == 0) != cb_expert_scaled(loc)) {
            snprintf(err, errlen, "layer %d expert %d: %s %s a block-scale companion but its other matrices %s; "
                     "an expert is fp8 in all three matrices or in none", layer, e, name, rc ? "lacks" : "has",
                     rc ? "have one" : "do not");
            return -1;
        }
        if (rc == 1) {
            int64_t dims[2] = {rows, cols};
            if (!(t = cb_st_expect(idx, name, 2, dims, err, errlen))) return -1;
        } else {
            loc->kind = kind;
            loc->sc_offset[m] = sc->offset;
            loc->sc_nbytes[m] = sc->nbytes;
            loc->sc_shard[m] = sc->shard;
            loc->sc_group[m] = group;
            if (loc->kind == CB_MAT_FP4) cb_fp4_scale_kind_of(sc->dtype_name, &loc->sc_kind[m]);
            else cb_fp8_scale_kind_of(sc->dtype_name, &loc->sc_kind[m]);
        }
        loc->offset[m] = t->offset;
        loc->nbytes[m] = t->nbytes;
        loc->dt[m] = t->dtype;   /* meaningless for a scaled kind (its view describes the matrices) */
        loc->shard[m] = t->shard;
    }
    return 0;
}

/* Whether three pieces tile one span of one shard (in any order); its start and length. */
static int tiles_span(const uint64_t *off, const uint64_t *nb, const int *sh, uint64_t *lo_out, uint64_t *bytes) {
    uint64_t lo = off[0], hi = off[0] + nb[0], total = 0;
    for (int k = 0; k < 3; k++) {
        if (sh[k] != sh[0]) return 0;
        if (off[k] < lo) lo = off[k];
        if (off[k] + nb[k] > hi) hi = off[k] + nb[k];
        total += nb[k];
    }
    *lo_out = lo;
    *bytes = total;
    return hi - lo == total;
}

/* Where each piece goes in the slot buffer; returns the bytes the expert needs. One read when the pieces (three
 * matrices, plus three scale tensors for fp8) tile one span of one shard, in any order, each float matrix
 * aligned for its dtype inside the buffer (the buffer itself is page aligned; fp8 bytes and scales are read
 * unaligned). */
size_t cbx_plan_pieces(cb_expert_location *loc) {
    int scaled = cb_expert_scaled(loc), np = scaled ? 6 : 3;
    uint64_t off[6], nb[6];
    int sh[6];
    for (int m = 0; m < 3; m++) {
        off[m] = loc->offset[m], nb[m] = loc->nbytes[m], sh[m] = loc->shard[m];
        if (scaled) off[3 + m] = loc->sc_offset[m], nb[3 + m] = loc->sc_nbytes[m], sh[3 + m] = loc->sc_shard[m];
    }
    uint64_t lo = off[0], hi = off[0] + nb[0], total = 0;
    int same_shard = 1, aligned = 1;
    for (int k = 0; k < np; k++) {
        if (off[k] < lo) lo = off[k];
        if (off[k] + nb[k] > hi) hi = off[k] + nb[k];
        total += nb[k];
        same_shard &= sh[k] == sh[0];
    }
    for (int m = 0; m < 3 && !scaled; m++)
        if ((off[m] - lo) % cb_dtype_size(loc->dt[m])) aligned = 0;
    loc->single_read = same_shard && aligned && hi - lo == total;
    size_t rel[6];
    size_t need;
    uint64_t wlo, wbytes, slo, sbytes;
    if (loc->single_read) {
        loc->span_offset = lo;
        loc->span_bytes = total;
        for (int k = 0; k < np; k++) rel[k] = (size_t)(off[k] - lo);
        need = (size_t)total;
    } else if (scaled && tiles_span(off, nb, sh, &wlo, &wbytes) && tiles_span(off + 3, nb + 3, sh + 3, &slo, &sbytes)) {
        loc->two_spans = 1;
        loc->span_offset = wlo;
        loc->span_bytes = wbytes;
        loc->sc_span_offset = slo;
        loc->sc_span_bytes = sbytes;
        size_t sbase = ((size_t)wbytes + 63) / 64 * 64;
        for (int m = 0; m < 3; m++) {
            rel[m] = (size_t)(off[m] - wlo);
            rel[3 + m] = sbase + (size_t)(off[3 + m] - slo);
        }
        need = sbase + (size_t)sbytes;
    } else {
        size_t at = 0;
        for (int k = 0; k < np; k++) {
            rel[k] = at;
            at += ((size_t)nb[k] + 63) / 64 * 64;
        }
        need = at;
    }
    for (int m = 0; m < 3; m++) {
        loc->rel[m] = rel[m];
        if (scaled) loc->rel_scales[m] = rel[3 + m];
    }
    return need;
}


const cb_st_index *cbx_shards_index(void) { return shards.idx; }
