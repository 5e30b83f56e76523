/* test_kv_file.c: saved KV files (runtime/kv_file.c): a round trip restores every byte of the slot and the
 * states; any truncation, any flipped bit, and any header that disagrees with the engine (family, identity,
 * geometry, sizes, a hostile token count) is refused with a one-line reason; the checksum does not depend on how
 * the bytes are split. Runs under ASan/UBSan with `make -C engines sanitize`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "kv_file.h"

static char dir[64];

static float frand(void) { return (float)(rnd() % 2000003) / 1000.0f - 1000.0f; }

typedef struct {
    cb_kv kv;
    float *snap;
    int *tokens;
} slot;

static void slot_init(slot *s, const cb_kv_geometry *g, int fill) {
    size_t per = (size_t)g->n_layers * (size_t)g->ctx * (size_t)g->kv_dim;
    s->kv.n_layers = g->n_layers;
    s->kv.ctx = g->ctx;
    s->kv.kv_dim = g->kv_dim;
    s->kv.k = calloc(per, sizeof(float));
    s->kv.v = g->kv_k_only ? NULL : calloc(per, sizeof(float));
    s->kv.state = g->state_bytes ? calloc(1, g->state_bytes) : NULL;
    s->snap = g->state_bytes ? calloc(1, g->state_bytes) : NULL;
    s->tokens = calloc((size_t)g->ctx, sizeof(int));
    if (!fill) return;
    for (size_t i = 0; i < per; i++) {
        s->kv.k[i] = frand();
        if (s->kv.v) s->kv.v[i] = frand();
    }
    for (size_t i = 0; i < g->state_bytes / sizeof(float); i++) {
        s->kv.state[i] = frand();
        s->snap[i] = frand();
    }
    for (int i = 0; i < g->ctx; i++) s->tokens[i] = (int)(rnd() % 50000);
}

static void slot_free(slot *s) {
    free(s->kv.k);
    free(s->kv.v);
    free(s->kv.state);
    free(s->snap);
    free(s->tokens);
}

/* open + read into a fresh slot; returns 0 when the file was accepted whole */
static int load(const char *path, const cb_kv_geometry *g, slot *dst, int *n_tokens, int *snap_pos, char *err) {
    cb_kv_file f;
    if (cb_kv_file_open(&f, path, g, err, 256)) return -1;
    int rc = cb_kv_file_read(&f, g, &dst->kv, dst->kv.state, dst->snap, err, 256);
    if (!rc) {
        memcpy(dst->tokens, f.tokens, (size_t)f.n_tokens * sizeof(int));
        *n_tokens = f.n_tokens;
        *snap_pos = f.snap_pos;
    }
    cb_kv_file_close(&f);
    return rc;
}

static void round_trip(const cb_kv_geometry *g, int n, int snap_pos) {
    char path[128], err[256];
    snprintf(path, sizeof path, "%s/slot.kv", dir);
    slot a, b;
    slot_init(&a, g, 1);
    slot_init(&b, g, 0);
    size_t bytes = cb_kv_file_save(path, g, &a.kv, a.tokens, n, a.snap, snap_pos, err, sizeof err);
    CHECK(bytes > 0, "save failed: %s", err);
    struct stat st;
    CHECK(stat(path, &st) == 0 && (size_t)st.st_size == bytes, "the file is the size reported");
    char tmp[160];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    CHECK(access(tmp, F_OK) != 0, "no temporary file is left behind");
    int got_n = 0, got_snap = -1;
    CHECK(load(path, g, &b, &got_n, &got_snap, err) == 0, "load failed: %s", err);
    CHECK(got_n == n, "tokens %d != %d", got_n, n);
    int want_snap = g->state_bytes && snap_pos > 0 && snap_pos < n ? snap_pos : 0;
    CHECK(got_snap == want_snap, "snap_pos %d != %d", got_snap, want_snap);
    CHECK(!memcmp(a.tokens, b.tokens, (size_t)n * sizeof(int)), "token ids restored");
    size_t row = (size_t)n * (size_t)g->kv_dim * sizeof(float);
    for (int l = 0; l < g->n_layers; l++) {
        CHECK(!memcmp(cb_kv_k(&a.kv, l, 0), cb_kv_k(&b.kv, l, 0), row), "K rows of layer %d restored", l);
        if (!g->kv_k_only)
            CHECK(!memcmp(cb_kv_v(&a.kv, l, 0), cb_kv_v(&b.kv, l, 0), row), "V rows of layer %d restored", l);
        /* rows past n are not part of the file: the destination keeps its zeros */
        if (n < g->ctx) CHECK(cb_kv_k(&b.kv, l, n)[0] == 0.0f, "row %d of layer %d untouched", n, l);
    }
    if (g->state_bytes) {
        CHECK(!memcmp(a.kv.state, b.kv.state, g->state_bytes), "state restored");
        if (want_snap) CHECK(!memcmp(a.snap, b.snap, g->state_bytes), "checkpoint restored");
    }
    slot_free(&a);
    slot_free(&b);
}

static long file_size(const char *path) {
    struct stat st;
    return stat(path, &st) ? -1 : (long)st.st_size;
}

static unsigned char *slurp(const char *path, long *n) {
    *n = file_size(path);
    FILE *f = fopen(path, "rb");
    unsigned char *data = malloc((size_t)*n);
    if (!f || !data || fread(data, 1, (size_t)*n, f) != (size_t)*n) {
        fprintf(stderr, "cannot read %s\n", path);
        exit(1);
    }
    fclose(f);
    return data;
}

static void spit(const char *path, const unsigned char *data, long n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(1);
    }
    fclose(f);
}

static int refused(const char *path, const cb_kv_geometry *g, const char *reason) {
    slot b;
    slot_init(&b, g, 0);
    char err[256] = "";
    int n = 0, sp = 0;
    int rc = load(path, g, &b, &n, &sp, err);
    slot_free(&b);
    if (rc == 0) return 0;
    CHECK(strchr(err, '\n') == NULL && strstr(err, path) != NULL, "one line naming the file: %s", err);
    if (reason) CHECK(strstr(err, reason) != NULL, "reason '%s' in: %s", reason, err);
    return 1;
}

static void damage(const cb_kv_geometry *g) {
    char path[128], bad[128], err[256];
    snprintf(path, sizeof path, "%s/good.kv", dir);
    snprintf(bad, sizeof bad, "%s/bad.kv", dir);
    slot a;
    slot_init(&a, g, 1);
    int n = 9;
    CHECK(cb_kv_file_save(path, g, &a.kv, a.tokens, n, a.snap, 4, err, sizeof err) > 0, "save: %s", err);
    slot_free(&a);
    long size;
    unsigned char *data = slurp(path, &size);
    /* every truncation */
    int all = 1;
    for (long cut = 0; cut < size; cut += (cut < 200 ? 1 : 37)) {
        spit(bad, data, cut);
        all &= refused(bad, g, NULL);
    }
    CHECK(all, "every truncated file is refused");
    /* a flipped bit anywhere (every header byte, then spread over the payload) */
    all = 1;
    for (long at = 0; at < size; at += (at < 200 ? 1 : 13)) {
        data[at] ^= (unsigned char)(1u << (at % 8));
        spit(bad, data, size);
        data[at] ^= (unsigned char)(1u << (at % 8));
        int r = refused(bad, g, NULL);
        if (!r) fprintf(stderr, "flip at %ld accepted\n", at);
        all &= r;
    }
    CHECK(all, "every flipped bit is refused");
    spit(bad, data, size);
    CHECK(!refused(bad, g, NULL), "the undamaged copy loads");
    /* a hostile header: 2^31 tokens with sizes to match, a huge state; refused before any allocation */
    unsigned char hostile[160];
    memcpy(hostile, data, sizeof hostile);
    uint32_t big = 0x80000000u;
    memcpy(hostile + 124, &big, 4);
    uint64_t huge = (uint64_t)1 << 62;
    memcpy(hostile + 144, &huge, 8);
    spit(bad, hostile, sizeof hostile);
    CHECK(refused(bad, g, "--ctx"), "hostile token count");
    memcpy(hostile, data, sizeof hostile);
    memcpy(hostile + 136, &huge, 8);
    spit(bad, hostile, sizeof hostile);
    CHECK(refused(bad, g, "geometry"), "hostile state size");
    /* another engine's file: family, identity, geometry */
    cb_kv_geometry other = *g;
    other.family = "other";
    CHECK(refused(path, &other, "another family"), "family");
    other = *g;
    other.identity = "0123";
    CHECK(refused(path, &other, "another model"), "identity");
    other = *g;
    other.kv_dim += 1;
    CHECK(refused(path, &other, "geometry"), "kv_dim");
    other = *g;
    other.ctx = n - 1;
    CHECK(refused(path, &other, "--ctx"), "more tokens than the context");
    CHECK(refused("/nonexistent/x.kv", g, "No such file"), "missing file");
    free(data);
    unlink(bad);
    unlink(path);
}

static void hash_splits(void) {
    unsigned char buf[1000];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (unsigned char)rnd();
    cb_kv_hash whole;
    cb_kv_hash_init(&whole);
    cb_kv_hash_update(&whole, buf, sizeof buf);
    uint64_t want = cb_kv_hash_final(&whole);
    for (int trial = 0; trial < 50; trial++) {
        cb_kv_hash h;
        cb_kv_hash_init(&h);
        size_t at = 0;
        while (at < sizeof buf) {
            size_t take = (size_t)(rnd() % 70);
            if (take > sizeof buf - at) take = sizeof buf - at;
            cb_kv_hash_update(&h, buf + at, take);
            at += take;
        }
        CHECK(cb_kv_hash_final(&h) == want, "the checksum does not depend on the split (trial %d)", trial);
    }
    cb_kv_hash_init(&whole);
    cb_kv_hash_update(&whole, buf, sizeof buf - 1);
    CHECK(cb_kv_hash_final(&whole) != want, "one byte less changes the checksum");
}

static void save_errors(const cb_kv_geometry *g) {
    slot a;
    slot_init(&a, g, 1);
    char err[256] = "";
    CHECK(cb_kv_file_save("/nonexistent/dir/x.kv", g, &a.kv, a.tokens, 3, NULL, 0, err, sizeof err) == 0,
          "an unwritable directory fails");
    CHECK(strstr(err, "/nonexistent/dir/x.kv") && strstr(err, "--kv-dir"), "names the file and the fix: %s", err);
    CHECK(cb_kv_file_save("/tmp/never.kv", g, &a.kv, a.tokens, 0, NULL, 0, err, sizeof err) == 0, "0 tokens");
    slot_free(&a);
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/cb-test-kv-XXXXXX");
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    cb_kv_geometry gqa = {"olmoe", "abc", 3, 8, 0, 16, 0};
    cb_kv_geometry mla = {"deepseek", "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", 2, 13, 1,
                          12, 0};
    cb_kv_geometry hybrid = {"qwen", "id", 1, 6, 0, 10, 4 * 37};
    round_trip(&gqa, 5, 0);
    round_trip(&gqa, 16, 0);
    round_trip(&mla, 7, 0);
    round_trip(&hybrid, 8, 5);
    round_trip(&hybrid, 8, 0);
    round_trip(&hybrid, 8, 8);      /* a checkpoint at the file's own length is the state itself: not stored */
    damage(&hybrid);
    damage(&mla);
    hash_splits();
    save_errors(&gqa);
    char path[128];
    snprintf(path, sizeof path, "%s/slot.kv", dir);
    unlink(path);
    rmdir(dir);
    printf("test_kv_file: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
