/* kv_file.c: see kv_file.h; the layout is docs/formats.md "Saved KV files". */
#include "kv_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char MAGIC[8] = {'C', 'O', 'L', 'I', 'K', 'V', '\r', '\n'};

/* Every field at its natural alignment, no padding: the struct is the on-disk header (little-endian hosts). */
typedef struct {
    char magic[8];
    uint32_t version, header_bytes;
    char family[CB_KV_FAMILY_LEN];
    char identity[CB_KV_IDENTITY_LEN];
    uint32_t n_layers, kv_dim, kv_k_only, n_tokens;
    uint32_t snap_pos, reserved;
    uint64_t state_bytes, payload_bytes;
    uint64_t checksum;         /* over the header before this field, then the payload */
} kv_header;

_Static_assert(sizeof(kv_header) == 160, "kv_header is the on-disk layout: no padding");

#define CHECKED_HEADER offsetof(kv_header, checksum)
#define IO_CHUNK ((size_t)8 << 20)

/* ---- checksum ---- */

static const uint64_t P1 = 0x9E3779B185EBCA87ULL, P2 = 0xC2B2AE3D27D4EB4FULL, P3 = 0x165667B19E3779F9ULL;

static uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t load64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static void hash_block(cb_kv_hash *h, const unsigned char *p) {
    for (int i = 0; i < 4; i++) h->lane[i] = rotl(h->lane[i] + load64(p + 8 * i) * P2, 31) * P1;
}

void cb_kv_hash_init(cb_kv_hash *h) {
    memset(h, 0, sizeof *h);
    for (int i = 0; i < 4; i++) h->lane[i] = P1 * (uint64_t)(i + 1) + P3;
}

void cb_kv_hash_update(cb_kv_hash *h, const void *data, size_t n) {
    const unsigned char *p = data;
    h->total += n;
    if (h->tail_len) {
        size_t take = 32 - h->tail_len < n ? 32 - h->tail_len : n;
        memcpy(h->tail + h->tail_len, p, take);
        h->tail_len += take;
        p += take;
        n -= take;
        if (h->tail_len < 32) return;
        hash_block(h, h->tail);
        h->tail_len = 0;
    }
    for (; n >= 32; p += 32, n -= 32) hash_block(h, p);
    memcpy(h->tail, p, n);
    h->tail_len = n;
}

uint64_t cb_kv_hash_final(const cb_kv_hash *h) {
    uint64_t acc = h->total * P3;
    for (int i = 0; i < 4; i++) acc = rotl(acc ^ h->lane[i], 27) * P1 + P3;
    for (size_t i = 0; i < h->tail_len; i++) acc = rotl(acc ^ (h->tail[i] * P3), 11) * P1;
    acc ^= acc >> 33;
    acc *= P2;
    acc ^= acc >> 29;
    return acc;
}

/* ---- geometry ---- */

/* Bytes of the payload for this geometry, or 0 when it would overflow (never for a slot the engine allocated). */
static uint64_t payload_bytes(const cb_kv_geometry *g, uint64_t n_tokens, int has_snap) {
    uint64_t row = (uint64_t)g->kv_dim * sizeof(float) * (g->kv_k_only ? 1u : 2u);
    uint64_t layers = (uint64_t)g->n_layers;
    if (n_tokens && row && layers && row > UINT64_MAX / n_tokens / layers) return 0;
    uint64_t kv = row * n_tokens * layers;
    uint64_t states = (uint64_t)g->state_bytes * (has_snap ? 2u : 1u);
    uint64_t total = n_tokens * sizeof(int32_t) + kv + states;
    return total < kv ? 0 : total;
}

static void put_name(char *dst, size_t cap, const char *src) {
    memset(dst, 0, cap);
    size_t n = strlen(src ? src : "");
    memcpy(dst, src ? src : "", n < cap ? n : cap);
}

static int same_name(const char *field, size_t cap, const char *want) {
    char expect[CB_KV_IDENTITY_LEN];
    put_name(expect, cap, want);
    return memcmp(field, expect, cap) == 0;
}

/* ---- writing ---- */

static int write_all(int fd, cb_kv_hash *h, const void *data, size_t n) {
    const char *p = data;
    if (h) cb_kv_hash_update(h, data, n);
    while (n) {
        ssize_t w = write(fd, p, n > IO_CHUNK ? IO_CHUNK : n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* K (or the latent row) then V of every layer, each layer's rows contiguous: the file's order, the slot's too. */
static int write_rows(int fd, cb_kv_hash *h, const cb_kv *kv, int n_tokens) {
    size_t bytes = (size_t)n_tokens * (size_t)kv->kv_dim * sizeof(float);
    for (int l = 0; l < kv->n_layers; l++) {
        if (write_all(fd, h, cb_kv_k(kv, l, 0), bytes)) return -1;
        if (kv->v && write_all(fd, h, cb_kv_v(kv, l, 0), bytes)) return -1;
    }
    return 0;
}

size_t cb_kv_file_save(const char *path, const cb_kv_geometry *g, const cb_kv *kv, const int *tokens, int n_tokens,
                       const float *snap, int snap_pos, char *err, size_t errlen) {
    int has_snap = g->state_bytes && snap && snap_pos > 0 && snap_pos < n_tokens;
    kv_header hd;
    memset(&hd, 0, sizeof hd);
    memcpy(hd.magic, MAGIC, sizeof MAGIC);
    hd.version = CB_KV_FILE_VERSION;
    hd.header_bytes = sizeof hd;
    put_name(hd.family, sizeof hd.family, g->family);
    put_name(hd.identity, sizeof hd.identity, g->identity);
    hd.n_layers = (uint32_t)g->n_layers;
    hd.kv_dim = (uint32_t)g->kv_dim;
    hd.kv_k_only = (uint32_t)(g->kv_k_only != 0);
    hd.n_tokens = (uint32_t)n_tokens;
    hd.snap_pos = has_snap ? (uint32_t)snap_pos : 0;
    hd.state_bytes = g->state_bytes;
    hd.payload_bytes = payload_bytes(g, (uint64_t)n_tokens, has_snap);
    if (n_tokens < 1 || !hd.payload_bytes) {
        snprintf(err, errlen, "kv save %s: nothing to save (%d tokens)", path, n_tokens);
        return 0;
    }
    char tmp[4200];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp) {
        snprintf(err, errlen, "kv save: path too long (%.80s...); use a shorter --kv-dir", path);
        return 0;
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(err, errlen, "kv save %s: %s (check that --kv-dir is writable)", tmp, strerror(errno));
        return 0;
    }
    cb_kv_hash h;
    cb_kv_hash_init(&h);
    cb_kv_hash_update(&h, &hd, CHECKED_HEADER);
    int rc = write_all(fd, NULL, &hd, sizeof hd);
    /* token ids as int32: an engine int is 32 bits on every platform the runtime builds for */
    _Static_assert(sizeof(int) == sizeof(int32_t), "token ids are stored as int32");
    rc = rc || write_all(fd, &h, tokens, (size_t)n_tokens * sizeof(int));
    rc = rc || write_rows(fd, &h, kv, n_tokens);
    if (g->state_bytes) rc = rc || write_all(fd, &h, kv->state, g->state_bytes);
    if (has_snap) rc = rc || write_all(fd, &h, snap, g->state_bytes);
    hd.checksum = cb_kv_hash_final(&h);
    if (!rc) rc = pwrite(fd, &hd.checksum, sizeof hd.checksum, CHECKED_HEADER) != (ssize_t)sizeof hd.checksum;
    if (!rc) rc = fsync(fd);
    int saved_errno = errno;
    if (close(fd)) rc = rc ? rc : -1;
    if (!rc && rename(tmp, path)) {
        saved_errno = errno;
        rc = -1;
    }
    if (rc) {
        snprintf(err, errlen, "kv save %s: %s (free disk space or lower --kv-disk-budget)", path,
                 strerror(saved_errno ? saved_errno : EIO));
        unlink(tmp);
        return 0;
    }
    /* the rename is durable only once the directory is synced */
    char dir[4200];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) {
        if (slash == dir) slash[1] = 0;
        else *slash = 0;
    } else {
        snprintf(dir, sizeof dir, ".");
    }
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    return sizeof hd + (size_t)hd.payload_bytes;
}

/* ---- reading ---- */

static int read_exact(cb_kv_file *f, void *dst, size_t n) {
    char *p = dst;
    size_t want = n;
    while (n) {
        ssize_t r = read(f->fd, p, n > IO_CHUNK ? IO_CHUNK : n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    cb_kv_hash_update(&f->hash, dst, want);
    return 0;
}

void cb_kv_file_close(cb_kv_file *f) {
    if (f->fd >= 0) close(f->fd);
    free(f->tokens);
    f->tokens = NULL;
    f->fd = -1;
}

int cb_kv_file_open(cb_kv_file *f, const char *path, const cb_kv_geometry *g, char *err, size_t errlen) {
    memset(f, 0, sizeof *f);
    f->path = path;
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) {
        snprintf(err, errlen, "kv file %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    kv_header hd;
    const char *why = NULL;
    if (fstat(f->fd, &st) || !S_ISREG(st.st_mode)) why = "not a regular file";
    else if ((uint64_t)st.st_size < sizeof hd) why = "truncated header";
    else if (read(f->fd, &hd, sizeof hd) != (ssize_t)sizeof hd) why = "unreadable header";
    else if (memcmp(hd.magic, MAGIC, sizeof MAGIC)) why = "not a colibri KV file (bad magic)";
    else if (hd.version != CB_KV_FILE_VERSION || hd.header_bytes != sizeof hd) why = "unsupported version";
    else if (!same_name(hd.family, sizeof hd.family, g->family)) why = "saved by another family";
    else if (!same_name(hd.identity, sizeof hd.identity, g->identity)) why = "saved for another model";
    else if (hd.n_layers != (uint32_t)g->n_layers || hd.kv_dim != (uint32_t)g->kv_dim ||
             hd.kv_k_only != (uint32_t)(g->kv_k_only != 0) || hd.state_bytes != g->state_bytes)
        why = "another KV geometry";
    else if (hd.n_tokens < 1 || hd.n_tokens > (uint32_t)g->ctx) why = "token count out of this engine's --ctx";
    else if (hd.snap_pos && (!g->state_bytes || hd.snap_pos >= hd.n_tokens)) why = "bad checkpoint position";
    else if (hd.payload_bytes != payload_bytes(g, hd.n_tokens, hd.snap_pos != 0)) why = "payload size mismatch";
    else if ((uint64_t)st.st_size - sizeof hd != hd.payload_bytes) why = "truncated or padded payload";
    if (why) {
        snprintf(err, errlen, "kv file %s ignored: %s", path, why);
        cb_kv_file_close(f);
        return -1;
    }
    /* sizes below are bounded by the engine's own --ctx, never by the file alone */
    f->n_tokens = (int)hd.n_tokens;
    f->snap_pos = (int)hd.snap_pos;
    f->checksum = hd.checksum;
    cb_kv_hash_init(&f->hash);
    cb_kv_hash_update(&f->hash, &hd, CHECKED_HEADER);
    f->tokens = malloc((size_t)f->n_tokens * sizeof(int));
    if (!f->tokens || read_exact(f, f->tokens, (size_t)f->n_tokens * sizeof(int))) {
        snprintf(err, errlen, "kv file %s ignored: %s", path, f->tokens ? "unreadable token ids" : "out of memory");
        cb_kv_file_close(f);
        return -1;
    }
    return 0;
}

int cb_kv_file_read(cb_kv_file *f, const cb_kv_geometry *g, cb_kv *kv, float *state, float *snap, char *err,
                    size_t errlen) {
    size_t bytes = (size_t)f->n_tokens * (size_t)kv->kv_dim * sizeof(float);
    int rc = 0;
    for (int l = 0; l < kv->n_layers && !rc; l++) {
        rc = read_exact(f, cb_kv_k(kv, l, 0), bytes);
        if (!rc && !g->kv_k_only) rc = read_exact(f, cb_kv_v(kv, l, 0), bytes);
    }
    if (!rc && g->state_bytes) rc = read_exact(f, state, g->state_bytes);
    if (!rc && f->snap_pos) rc = read_exact(f, snap, g->state_bytes);
    if (rc) {
        snprintf(err, errlen, "kv file %s ignored: unreadable payload", f->path);
        return -1;
    }
    if (cb_kv_hash_final(&f->hash) != f->checksum) {
        snprintf(err, errlen, "kv file %s ignored: checksum mismatch (corrupt)", f->path);
        return -1;
    }
    return 0;
}
