/* test_runtime.c: the shared runtime's non-numeric parts: JSON reader (incl. a fuzz pass over random, truncated
 * and mutated inputs, meant to run under ASan/UBSan), safetensors index validation, the expert store's LRU and
 * read accounting, the sampler, and the RoPE geometry read from hyperparameters. */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "blocks.h"
#include "decoder.h"
#include "experts.h"
#include "json.h"
#include "safetensors.h"
#include "sampler.h"

#define TEST_SEED 88172645463325252ULL
#include "check.h"
#include "fixture.h"

/* ---- JSON ---- */

static void test_json_valid(void) {
    char err[256];
    const char *text = " {\"a\": [1, -2.5e3, true, false, null], \"s\": \"x\\n\\u00e9\\ud83d\\ude00\\\"\","
                       " \"big\": 9007199254740993, \"o\": {}} ";
    cb_json_doc *doc = cb_json_parse(text, strlen(text), err, sizeof err);
    CHECK(doc != NULL, "%s", err);
    if (!doc) return;
    cb_json *root = cb_json_root(doc), *a = cb_json_get(root, "a"), *s = cb_json_get(root, "s");
    CHECK(a && a->type == CB_JARR && a->len == 5, "array");
    CHECK(a && a->items[0]->is_int && a->items[0]->inum == 1, "int");
    CHECK(a && !a->items[1]->is_int && a->items[1]->num == -2500.0, "float");
    CHECK(a && a->items[2]->type == CB_JBOOL && a->items[2]->boolean, "true");
    CHECK(a && a->items[4]->type == CB_JNULL, "null");
    CHECK(s && strcmp(s->str, "x\n\xc3\xa9\xf0\x9f\x98\x80\"") == 0, "escapes decode to UTF-8");
    CHECK(cb_json_get(root, "big")->inum == 9007199254740993LL, "int64 beyond 2^53 is exact");
    CHECK(cb_json_get(root, "o")->type == CB_JOBJ && cb_json_get(root, "o")->len == 0, "empty object");
    CHECK(cb_json_get(root, "missing") == NULL, "absent key");
    cb_json_free(doc);
}

static void test_json_invalid(void) {
    const char *bad[] = {"", "{", "[1,]", "{\"a\":}", "{\"a\" 1}", "[1 2]", "\"abc", "tru", "nul", "01", "-",
                         "1.", "1e", "{\"a\":1,}", "\"\\x\"", "\"\\ud800\"", "\"\\udc00\"", "\"\\u12\"", "[]]",
                         "{1:2}", "\"a\tb\"", "{} {}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char err[256] = "";
        cb_json_doc *doc = cb_json_parse(bad[i], strlen(bad[i]), err, sizeof err);
        CHECK(doc == NULL, "accepted invalid JSON <%s>", bad[i]);
        CHECK(strncmp(err, "invalid JSON at byte", 20) == 0, "message <%s> for <%s>", err, bad[i]);
        cb_json_free(doc);
    }
    /* Deep nesting is refused, not a stack overflow. */
    char deep[4001];
    memset(deep, '[', 4000);
    deep[4000] = 0;
    char err[256];
    CHECK(cb_json_parse(deep, 4000, err, sizeof err) == NULL && strstr(err, "nested too deeply"), "%s", err);
}

static void test_json_output(void) {
    cb_buf b = {0};
    cb_buf_json_str(&b, "a\"b\\c\n\x01 \xc3\xa9 \xff \xc3 \xed\xa0\x80 \xf0\x9f\x98\x80");
    CHECK(strcmp(b.data, "\"a\\\"b\\\\c\\n\\u0001 \xc3\xa9 \\ufffd \\ufffd \\ufffd\\ufffd\\ufffd \xf0\x9f\x98\x80\"") == 0,
          "escaped: %s", b.data);
    char err[256];
    cb_json_doc *doc = cb_json_parse(b.data, b.len, err, sizeof err);
    CHECK(doc != NULL, "output parses back: %s", err);
    cb_json_free(doc);
    cb_buf_free(&b);
}

static void test_json_fuzz(void) {
    const char *seeds[] = {
        "{\"op\":\"submit\",\"id\":12,\"slot\":0,\"prompt\":[1,2,3],\"temperature\":0.7,\"stop\":[],\"logits\":true}",
        "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,24]},\"__metadata__\":{\"format\":\"pt\"}}",
        "[\"\\u00e9\\ud83d\\ude00\", -0.0e-5, {\"\": [[[]]]}, null, false]",
    };
    char buf[512];
    char err[256];
    for (int iter = 0; iter < 200000; iter++) {
        const char *seed = seeds[iter % 3];
        size_t n = strlen(seed);
        memcpy(buf, seed, n);
        int mode = (int)(rnd() % 4);
        if (mode == 0) {
            n = rnd() % (n + 1);                         /* truncation */
        } else if (mode == 1) {
            int flips = 1 + (int)(rnd() % 4);             /* byte mutations */
            for (int f = 0; f < flips; f++) buf[rnd() % n] = (char)(rnd() & 0xFF);
        } else if (mode == 2) {
            const char alphabet[] = "{}[]\",:\\u0123456789eE+-.tfnrul \t\n";
            n = rnd() % 64;                               /* random JSON-ish tokens */
            for (size_t i = 0; i < n; i++) buf[i] = alphabet[rnd() % (sizeof alphabet - 1)];
        } else {
            n = rnd() % 64;                               /* random bytes */
            for (size_t i = 0; i < n; i++) buf[i] = (char)(rnd() & 0xFF);
        }
        /* Parse from an exact-size heap copy so ASan catches any read past the end. */
        char *copy = malloc(n ? n : 1);
        memcpy(copy, buf, n);
        cb_json_doc *doc = cb_json_parse(copy, n, err, sizeof err);
        if (!doc) CHECK(err[0] != 0, "error without message");
        cb_json_free(doc);
        free(copy);
    }
}

/* ---- safetensors fixtures (fixture.h), and one with a hand-written header ---- */

/* A shard with a hand-written header (offsets exactly as given) and `data_len` zero bytes of data. */
static void write_raw_shard(const char *file, const char *header, size_t data_len) {
    FILE *f = open_shard(file, header, strlen(header));
    for (size_t i = 0; i < data_len; i++) fputc(0, f);
    fclose(f);
}

/* cb_map_linear keeps an embedding's rows in the file: the rows it gathers are the loaded copy's, bit for bit, and
 * a tensor misaligned in its file is loaded instead of read misaligned. */
static void test_mapped_embedding(void) {
    clear_tmp();
    enum { R = 5, C = 6 };
    float e[R * C];
    for (int i = 0; i < R * C; i++) e[i] = (float)(i * 7 % 11) - 4.25f;
    uint16_t pad[1] = {0};
    fx_tensor ts[] = {{"e", "F32", 2, {R, C}, e, sizeof e}, {"odd", "BF16", 1, {1}, pad, sizeof pad},
                      {"f", "F32", 2, {R, C}, e, sizeof e}};
    write_shard("model.safetensors", ts, 3);
    char err[512];
    cb_st_index idx;
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) == 0, "%s", err);
    cb_linear loaded, mapped, misaligned;
    size_t held = 0;
    CHECK(cb_load_linear(&loaded, &idx, "e", R, C, NULL, err, sizeof err) == 0, "%s", err);
    CHECK(cb_map_linear(&mapped, &idx, "e", R, C, &held, err, sizeof err) == 0, "%s", err);
    CHECK(mapped.map != NULL && held == 0, "e mapped (%p), %zu bytes held", mapped.map, held);
    const cb_tensor *f = cb_st_find(&idx, "f");
    CHECK(f && f->offset % CB_MAP_ALIGN != 0, "f starts misaligned in its file");
    CHECK(cb_map_linear(&misaligned, &idx, "f", R, C, &held, err, sizeof err) == 0, "%s", err);
    CHECK(misaligned.map == NULL && held == sizeof e, "misaligned f loaded, %zu bytes held", held);
    for (int r = 0; r < R; r++) {
        float a[C], b[C], c[C];
        cb_embed(a, &loaded, r);
        cb_embed(b, &mapped, r);
        cb_embed(c, &misaligned, r);
        CHECK(memcmp(a, b, sizeof a) == 0 && memcmp(a, c, sizeof a) == 0 && memcmp(a, e + r * C, sizeof a) == 0,
              "row %d", r);
    }
    cb_linear wrong;
    CHECK(cb_map_linear(&wrong, &idx, "e", R, C + 1, NULL, err, sizeof err) != 0 && strstr(err, "shape") &&
              wrong.map == NULL && wrong.w == NULL, "%s", err);
    cb_linear_free(&loaded);
    cb_linear_free(&mapped);
    cb_linear_free(&misaligned);
    CHECK(mapped.map == NULL && mapped.w == NULL, "freed");
    cb_st_close(&idx);
}

static void test_safetensors(void) {
    clear_tmp();
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t b[4] = {0x3f80, 0x4000, 0xbf80, 0x0000};   /* bf16 1, 2, -1, 0 */
    fx_tensor ts[] = {{"a", "F32", 2, {2, 3}, a, sizeof a}, {"b", "BF16", 1, {4}, b, sizeof b},
                      {"i", "I64", 1, {0}, a, 0}};
    size_t size = write_shard("model.safetensors", ts, 3);
    char err[512];
    cb_st_index idx;
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) == 0, "%s", err);
    CHECK(idx.n_tensors == 3, "%d tensors", idx.n_tensors);
    const cb_tensor *t = cb_st_find(&idx, "a");
    CHECK(t && t->dtype == CB_F32 && t->ndim == 2 && t->shape[1] == 3 && t->nbytes == 24, "tensor a");
    float *loaded = t ? cb_st_load(&idx, t, err, sizeof err) : NULL;
    CHECK(loaded && loaded[5] == 6.0f, "loaded data");
    free(loaded);
    int64_t want[2] = {3, 2};
    CHECK(!cb_st_expect(&idx, "a", 2, want, err, sizeof err) && strstr(err, "shape [2, 3]"), "%s", err);
    CHECK(!cb_st_expect(&idx, "nope", 1, want, err, sizeof err) && strstr(err, "not found"), "%s", err);
    int64_t zero[1] = {0};
    CHECK(!cb_st_expect(&idx, "i", 1, zero, err, sizeof err) && strstr(err, "I64"), "%s", err);
    cb_st_close(&idx);

    /* Truncated: the data section no longer holds the last tensor. */
    char path[512];
    path_in_tmp(path, sizeof path, "model.safetensors");
    CHECK(truncate(path, (off_t)(size - 4)) == 0, "truncate");
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) != 0 && strstr(err, path) && strstr(err, "tensor b") &&
              strstr(err, "truncated"), "%s", err);
    CHECK(truncate(path, 5) == 0, "truncate");
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) != 0 && strstr(err, "truncated safetensors file"), "%s", err);

    /* Byte count inconsistent with dtype x shape. */
    fx_tensor wrong[] = {{"a", "F32", 2, {2, 2}, a, sizeof a}};
    write_shard("model.safetensors", wrong, 1);
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) != 0 && strstr(err, "x shape needs 16"), "%s", err);

    /* Overlapping byte ranges, a non-object __metadata__ or entry, and huge offsets are errors naming the file. */
    clear_tmp();
    write_raw_shard("model.safetensors", "{\"x\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                    "\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16);
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) != 0 && strstr(err, path) && strstr(err, "overlaps"), "%s", err);
    write_raw_shard("model.safetensors", "{\"__metadata__\":[1],\"x\":{\"dtype\":\"F32\",\"shape\":[1],"
                    "\"data_offsets\":[0,4]}}", 4);
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) != 0 && strstr(err, "__metadata__"), "%s", err);
    write_raw_shard("model.safetensors", "{\"x\":7}", 0);
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) != 0 && strstr(err, "not an object"), "%s", err);
    write_raw_shard("model.safetensors", "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],"
                    "\"data_offsets\":[1180591620717411303424,1180591620717411303428]}}", 4);
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) != 0 && strstr(err, path), "%s", err);
    write_raw_shard("model.safetensors", "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],"
                    "\"data_offsets\":[9223372036854775800,9223372036854775804]}}", 4);
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) != 0 && strstr(err, "outside the data section"), "%s", err);
    write_raw_shard("model.safetensors", "{\"x\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"
                    "\"y\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4);
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) == 0, "an empty tensor overlaps nothing: %s", err);
    cb_st_close(&idx);

    /* Random header corruption never crashes: it either still validates or names the file. */
    size = write_shard("model.safetensors", ts, 3);
    FILE *f = fopen(path, "rb");
    unsigned char *orig = malloc(size);
    CHECK(fread(orig, 1, size, f) == size, "read back");
    fclose(f);
    for (int iter = 0; iter < 3000; iter++) {
        unsigned char *m = malloc(size);
        memcpy(m, orig, size);
        int flips = 1 + (int)(rnd() % 3);
        for (int k = 0; k < flips; k++) m[rnd() % (size - 24)] = (unsigned char)rnd();
        f = fopen(path, "wb");
        fwrite(m, 1, size - (iter % 7 == 0 ? rnd() % size : 0), f);
        fclose(f);
        free(m);
        if (cb_st_open(&idx, tmpdir, err, sizeof err) == 0) cb_st_close(&idx);
        else CHECK(strstr(err, path) != NULL, "error does not name the file: %s", err);
    }
    free(orig);

    /* Sharded: the index's weight_map names the shards; a tensor in two shards is an error. */
    clear_tmp();
    fx_tensor s1[] = {{"a", "F32", 2, {2, 3}, a, sizeof a}}, s2[] = {{"b", "BF16", 1, {4}, b, sizeof b}};
    write_shard("m-1.safetensors", s1, 1);
    write_shard("m-2.safetensors", s2, 1);
    path_in_tmp(path, sizeof path, "model.safetensors.index.json");
    f = fopen(path, "w");
    fputs("{\"metadata\":{},\"weight_map\":{\"a\":\"m-1.safetensors\",\"b\":\"m-2.safetensors\"}}", f);
    fclose(f);
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) == 0 && idx.n_shards == 2 && cb_st_find(&idx, "b") &&
              cb_st_find(&idx, "b")->shard == 1, "%s", err);
    cb_st_close(&idx);
    write_shard("m-2.safetensors", s1, 1);
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) != 0 && strstr(err, "appears in both"), "%s", err);
    f = fopen(path, "w");
    fputs("{\"weight_map\":{\"a\":\"../etc/passwd\"}}", f);
    fclose(f);
    CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) != 0 && strstr(err, "weight_map[a]"), "%s", err);
}

/* ---- expert store ---- */

enum { HID = 4, INTER = 3, NEXP = 4 };

static float expert_value(int e, int m, int i) { return (float)(e * 100 + m * 10) + (float)i * 0.5f; }

static void write_experts(int interleave) {
    clear_tmp();
    static float data[NEXP][3][HID * INTER];
    static float filler[4] = {9, 9, 9, 9};
    static char names[NEXP][3][96];
    static const char *mat[3] = {"gate_proj", "up_proj", "down_proj"};
    fx_tensor t[NEXP * 4];
    int n = 0;
    for (int e = 0; e < NEXP; e++)
        for (int m = 0; m < 3; m++) {
            for (int i = 0; i < HID * INTER; i++) data[e][m][i] = expert_value(e, m, i);
            snprintf(names[e][m], sizeof names[e][m], "layers.0.experts.%d.%s", e, mat[m]);
            int64_t r = m == 2 ? HID : INTER, c = m == 2 ? INTER : HID;
            t[n++] = (fx_tensor){names[e][m], "F32", 2, {r, c}, data[e][m], sizeof data[e][m]};
            if (interleave && m == 0 && e == 1) t[n++] = (fx_tensor){"filler", "F32", 1, {4}, filler, sizeof filler};
        }
    write_shard("model.safetensors", t, n);
}

static void test_experts(void) {
    const char *const names[3] = {"layers.%d.experts.%d.gate_proj", "layers.%d.experts.%d.up_proj",
                                  "layers.%d.experts.%d.down_proj"};
    char err[512];
    for (int interleave = 0; interleave < 2; interleave++) {
        write_experts(interleave);
        cb_st_index idx;
        CHECK(cb_st_open(&idx, tmpdir, err, sizeof err) == 0, "%s", err);
        cb_expert_layer L;
        CHECK(cb_experts_init(&L, &idx, 0, NEXP, 2, HID, INTER, names, err, sizeof err) == 0, "%s", err);
        CHECK(L.loc[0].single_read && L.loc[1].single_read == !interleave, "contiguity detection");
        size_t expert_bytes = 3 * HID * INTER * sizeof(float);
        int order[] = {0, 1, 0, 2, 1, 0, 0, 3};
        /* cap 2, LRU: 0 miss, 1 miss, 0 hit, 2 miss (evicts 1), 1 miss (evicts 0), 0 miss (evicts 2), 0 hit,
         * 3 miss. */
        int expect_hit[] = {0, 0, 1, 0, 0, 0, 1, 0};
        for (int k = 0; k < 8; k++) {
            uint64_t hits = L.count.hits;
            cb_expert_view v;
            CHECK(cb_experts_get(&L, order[k], &v, err, sizeof err) == 0, "%s", err);
            CHECK((L.count.hits > hits) == expect_hit[k], "access %d of expert %d", k, order[k]);
            for (int m = 0; m < 3; m++)
                for (int i = 0; i < HID * INTER; i++)
                    CHECK(((const float *)v.m[m].f.w)[i] == expert_value(order[k], m, i), "expert %d matrix %d", order[k], m);
        }
        CHECK(L.count.hits == 2 && L.count.misses == 6, "hits %llu misses %llu", (unsigned long long)L.count.hits,
              (unsigned long long)L.count.misses);
        CHECK(L.count.bytes_read == 6 * expert_bytes, "bytes");
        /* Expert 1 missed twice; with the filler between its gate and up it needs one read per matrix. */
        uint64_t want_reads = interleave ? 6 + 2 * 2 : 6;
        CHECK(L.count.reads == want_reads, "reads %llu", (unsigned long long)L.count.reads);
        cb_expert_view v;
        CHECK(cb_experts_get(&L, NEXP, &v, err, sizeof err) != 0 && strstr(err, "out of range"), "%s", err);
        /* Prefetching changes no data and no counter: the same accesses with the next miss read ahead. */
        cb_expert_counters plain = L.count;
        cb_experts_free(&L);
        CHECK(cb_experts_init(&L, &idx, 0, NEXP, 2, HID, INTER, names, err, sizeof err) == 0, "%s", err);
        for (int k = 0; k < 8; k++) {
            CHECK(cb_experts_get(&L, order[k], &v, err, sizeof err) == 0, "%s", err);
            for (int j = k + 1; j < 8; j++)
                if (L.slot_of[order[j]] < 0) {
                    int ok = 1;   /* only when every access before it is a hit, as the MoE block guarantees */
                    for (int i = k + 1; i < j; i++) ok &= L.slot_of[order[i]] >= 0;
                    if (ok) cb_experts_prefetch(&L, order[j]);
                    break;
                }
            for (int m = 0; m < 3; m++)
                for (int i = 0; i < HID * INTER; i++)
                    CHECK(((const float *)v.m[m].f.w)[i] == expert_value(order[k], m, i), "prefetched expert %d", order[k]);
        }
        CHECK(!memcmp(&plain, &L.count, sizeof plain), "counters with prefetch: %llu/%llu %llu/%llu %llu/%llu %llu/%llu", (unsigned long long)plain.hits, (unsigned long long)L.count.hits, (unsigned long long)plain.misses, (unsigned long long)L.count.misses, (unsigned long long)plain.reads, (unsigned long long)L.count.reads, (unsigned long long)plain.bytes_read, (unsigned long long)L.count.bytes_read);
        cb_experts_prefetch(&L, 1);      /* left unconsumed: free must wait for it */
        cb_experts_free(&L);
        /* Lookahead's guesses, the unchosen ones dropped (whether an I/O thread took them first or not): the
         * chosen guess and the dropped ones read the same bytes and count as the plain accesses do. */
        CHECK(cb_experts_init(&L, &idx, 0, NEXP, 2, HID, INTER, names, err, sizeof err) == 0, "%s", err);
        uint64_t issued = cb_prof.prefetch_issued, used = cb_prof.prefetch_used, dropped = cb_prof.prefetch_dropped;
        for (int e = 0; e < 4; e++) cb_experts_predict(&L, e);
        int wanted[NEXP] = {0};
        wanted[2] = 1;
        CHECK(cb_experts_prefetch(&L, 2) == 1, "a guess the router chose is already staged");
        cb_experts_drop_guesses(&L, wanted);
        uint64_t issued_now = cb_prof.prefetch_issued - issued, dropped_now = cb_prof.prefetch_dropped - dropped;
        CHECK(issued_now == 4 && dropped_now <= 3, "4 guesses issued, at most the 3 unchosen dropped: %llu %llu",
              (unsigned long long)issued_now, (unsigned long long)dropped_now);
        int seq[] = {2, 0, 3};
        for (int k = 0; k < 3; k++) {
            CHECK(cb_experts_get(&L, seq[k], &v, err, sizeof err) == 0, "%s", err);
            for (int m = 0; m < 3; m++)
                for (int i = 0; i < HID * INTER; i++)
                    CHECK(((const float *)v.m[m].f.w)[i] == expert_value(seq[k], m, i), "guessed expert %d", seq[k]);
        }
        CHECK(L.count.misses == 3 && L.count.hits == 0 && L.count.bytes_read == 3 * expert_bytes,
              "counters after guesses: %llu misses", (unsigned long long)L.count.misses);
        CHECK(cb_prof.prefetch_used - used >= 1, "the chosen guess was used");
        cb_experts_free(&L);
        /* The hot set evicts the coldest expert, not the least recent: after 0, 0, 0, 1 the cap-2 cache keeps the
         * thrice-routed 0 when 2 arrives, where LRU drops it (and misses it again next). */
        for (int hot = 0; hot < 2; hot++) {
            cb_stream_opts o = cb_stream_defaults();
            o.pin = hot;
            cb_experts_configure(&o);
            CHECK(cb_experts_init(&L, &idx, 0, NEXP, 2, HID, INTER, names, err, sizeof err) == 0, "%s", err);
            int seq[] = {0, 0, 0, 1, 2, 0};
            for (int k = 0; k < 6; k++) CHECK(cb_experts_get(&L, seq[k], &v, err, sizeof err) == 0, "%s", err);
            CHECK(L.count.hits == (hot ? 3u : 2u), "%s: %llu hits", hot ? "hot set" : "LRU",
                  (unsigned long long)L.count.hits);
            CHECK(L.slot_of[0] >= 0 && L.slot_of[2] >= 0 && (hot || L.slot_of[1] < 0), "residents");
            cb_experts_free(&L);
        }
        /* A pass's routing counts its rows (cb_experts_note_routing): after a prefill chunk where 40 rows chose 0
         * and the last one chose 1, served 0 then 1, expert 2 evicts 1 under the hot set (0 is far hotter, though
         * less recent), and 0 under LRU. Counted once per pass the two would tie, and recency would drop 0. */
        for (int hot = 0; hot < 2; hot++) {
            cb_stream_opts o = cb_stream_defaults();
            o.pin = hot;
            cb_experts_configure(&o);
            CHECK(cb_experts_init(&L, &idx, 0, NEXP, 2, HID, INTER, names, err, sizeof err) == 0, "%s", err);
            int chunk[42] = {0}, next = 2;
            chunk[40] = 1, chunk[41] = -1;   /* -1: a choice a row did not make (trimmed), skipped */
            cb_experts_note_routing(&L, chunk, 42);
            CHECK(cb_experts_serve(&L, 0, &v, err, sizeof err) == 0 && cb_experts_serve(&L, 1, &v, err, sizeof err) == 0,
                  "%s", err);
            cb_experts_note_routing(&L, &next, 1);
            CHECK(cb_experts_serve(&L, 2, &v, err, sizeof err) == 0, "%s", err);
            CHECK(hot ? L.slot_of[0] >= 0 && L.slot_of[1] < 0 : L.slot_of[0] < 0 && L.slot_of[1] >= 0,
                  "%s after a 40-row and a 1-row expert: 0 %s, 1 %s", hot ? "hot set" : "LRU",
                  L.slot_of[0] >= 0 ? "kept" : "evicted", L.slot_of[1] >= 0 ? "kept" : "evicted");
            CHECK(L.route_count[0] == 40 && L.route_count[1] == 1 && L.uses[0] == 1 && L.uses[1] == 1,
                  "route counts are rows, uses are accesses: %u %u %llu %llu", L.route_count[0], L.route_count[1],
                  (unsigned long long)L.uses[0], (unsigned long long)L.uses[1]);
            if (hot) {   /* a long pass (a prefill chunk of thousands of rows) keeps the heat finite */
                static int many[200000];
                for (int j = 0; j < 200000; j++) many[j] = 3;
                cb_experts_note_routing(&L, many, 200000);
                CHECK(isfinite(L.heat_unit) && L.heat_unit > 0 && isfinite(L.heat[3]) && L.heat[3] > L.heat[0],
                      "heat after a long pass: unit %g, heat %g vs %g", L.heat_unit, L.heat[3], L.heat[0]);
            }
            cb_experts_free(&L);
        }
        cb_stream_opts defaults = cb_stream_defaults();
        cb_experts_configure(&defaults);
        /* cap 0 keeps every expert once read. */
        CHECK(cb_experts_init(&L, &idx, 0, NEXP, 0, HID, INTER, names, err, sizeof err) == 0, "%s", err);
        for (int k = 0; k < 8; k++) cb_experts_get(&L, order[k], &v, err, sizeof err);
        CHECK(L.cap == NEXP && L.count.misses == 4 && L.count.hits == 4, "cap 0");
        cb_experts_free(&L);
        /* A wrong shape is named. */
        CHECK(cb_experts_init(&L, &idx, 0, NEXP, 2, HID + 1, INTER, names, err, sizeof err) != 0 &&
                  strstr(err, "gate_proj") && strstr(err, "shape"), "%s", err);
        cb_st_close(&idx);
    }
}

/* ---- sampler ---- */

static void test_sampler(void) {
    float logits[8] = {0.1f, 2.0f, -1.0f, 2.0f, 1.9f, 0.0f, -3.0f, 1.0f};
    float work[16];
    cb_sampler s;
    cb_sampler_init(&s, 0.0f, 1.0f, 0, 1);
    CHECK(cb_sample(&s, logits, 8, work) == 1, "greedy takes the lowest index on ties");
    cb_sampler_init(&s, 1.0f, 1.0f, 1, 5);
    CHECK(cb_sample(&s, logits, 8, work) == 1, "top_k 1 is greedy");
    int a[64], b[64], counts[8] = {0};
    cb_sampler_init(&s, 1.0f, 1.0f, 0, 42);
    for (int i = 0; i < 64; i++) a[i] = cb_sample(&s, logits, 8, work);
    cb_sampler_init(&s, 1.0f, 1.0f, 0, 42);
    for (int i = 0; i < 64; i++) b[i] = cb_sample(&s, logits, 8, work);
    CHECK(memcmp(a, b, sizeof a) == 0, "same seed, same draws");
    cb_sampler_init(&s, 1.0f, 0.5f, 3, 7);
    for (int i = 0; i < 2000; i++) counts[cb_sample(&s, logits, 8, work)]++;
    /* top-3 = {1, 3, 4}; top-p 0.5 of their mass keeps the first two (equal probabilities). */
    CHECK(counts[1] > 800 && counts[3] > 800 && counts[1] + counts[3] == 2000, "top-k/top-p support %d %d %d",
          counts[1], counts[3], counts[4]);
}

/* ---- RoPE geometry ---- */

/* cb_rope_init from --set pairs (NULL-terminated key, value list). 0 on success; err holds the refusal. */
static int rope_from(cb_rope *r, int head_dim, char err[256], ...) {
    char *keys[8], *values[8];
    int used[8] = {0}, n = 0;
    va_list ap;
    va_start(ap, err);
    for (const char *k; n < 8 && (k = va_arg(ap, const char *));) {
        keys[n] = (char *)k;
        values[n++] = va_arg(ap, char *);
    }
    va_end(ap);
    cb_hparams hp = {n, keys, values, used};
    err[0] = 0;
    return cb_rope_init(r, &hp, head_dim, 1, err, 256);
}

static void test_rope_geometry(void) {
    cb_rope r;
    char err[256];
    /* transformers: dim = int(16 * 0.3125) = 5 sets the frequencies 1 / theta^(2i / 5), i < 3; 6 dims rotate. */
    CHECK(rope_from(&r, 16, err, "rope_theta", "10000", "partial_rotary_factor", "0.3125", NULL) == 0, "%s", err);
    CHECK(r.rot_dim == 6, "odd rotary dim 5 rotates %d dims, want 6", r.rot_dim);
    for (int i = 0; i < 3; i++)
        CHECK(r.inv_freq[i] == 1.0f / powf(10000.0f, (float)(2 * i) / 5.0f), "inv_freq[%d] over dim 5", i);
    cb_rope_free(&r);
    /* int(100 * 0.29) is 28 in double (Python's product), 29 in float: the rotation must follow Python. */
    CHECK(rope_from(&r, 100, err, "rope_theta", "10000", "partial_rotary_factor", "0.29", NULL) == 0, "%s", err);
    CHECK(r.rot_dim == 28, "100 x 0.29 rotates %d dims, want 28", r.rot_dim);
    CHECK(r.inv_freq[1] == 1.0f / powf(10000.0f, 2.0f / 28.0f), "inv_freq over dim 28");
    cb_rope_free(&r);
    CHECK(rope_from(&r, 64, err, "rope_theta", "10000", NULL) == 0 && r.rot_dim == 64, "full rotation");
    cb_rope_free(&r);
    /* refusals: an odd head rotated whole would rotate past the head; yarn's ramp has no odd form */
    CHECK(rope_from(&r, 5, err, "rope_theta", "10000", NULL) == -1 && strstr(err, "more than head_dim 5"), "%s", err);
    CHECK(rope_from(&r, 16, err, "rope_theta", "10000", "partial_rotary_factor", "0.3125", "rope_type", "yarn",
                    "rope_factor", "4", NULL) == -1 && strstr(err, "yarn needs an even"), "%s", err);
    CHECK(rope_from(&r, 16, err, "rope_theta", "10000", "partial_rotary_factor", "0.5x", NULL) == -1 &&
          strstr(err, "partial_rotary_factor=0.5x"), "%s", err);
    CHECK(rope_from(&r, 16, err, "rope_theta", "10000", "partial_rotary_factor", "0.01", NULL) == -1 &&
          strstr(err, "no dimensions"), "%s", err);
}

/* Per-layer lists in a config's spellings become one letter per layer; a bad entry names the key and the entry. */
static void test_layer_lists(void) {
    char out[8], err[256];
    const char *words = "full_attention=F,linear_attention=L";
    CHECK(!cb_hp_layer_words("layer_types", "linear_attention,full_attention,linear_attention", words, 3, out, err,
                             sizeof err) && !strcmp(out, "LFL"), "%s", err);
    CHECK(cb_hp_layer_words("layer_types", "full_attention,sliding", words, 2, out, err, sizeof err) &&
          strstr(err, "entry 1 is sliding") && strstr(err, "full_attention linear_attention"), "%s", err);
    CHECK(cb_hp_layer_words("layer_types", "full_attention", words, 2, out, err, sizeof err) &&
          strstr(err, "1 entries for 2 layers"), "%s", err);
    CHECK(cb_hp_layer_words("layer_types", "full_attention,full_attention,", words, 2, out, err, sizeof err) &&
          strstr(err, "more entries"), "%s", err);
    memcpy(out, "MMMM", 5);
    CHECK(!cb_hp_layer_indices("mlp_only_layers", "0,3", 4, 'D', out, err, sizeof err) && !strcmp(out, "DMMD"), "%s",
          err);
    CHECK(cb_hp_layer_indices("mlp_only_layers", "4", 4, 'D', out, err, sizeof err) && strstr(err, "below 4"), "%s",
          err);
}

/* A word from a list, as its index; absent: the default; another word: an error naming key and words. */
static void test_hp_choice(void) {
    typedef struct { int pick; } T;
    static const cb_hp_spec table[] = {CB_HP_CHOICE_OF("layout", T, pick, "fused,split", 0), CB_HP_END};
    char *keys[1] = {"layout"}, *values[1] = {"split"}, err[256];
    int used[1] = {0};
    cb_hparams hp = {1, keys, values, used};
    T t = {-1};
    CHECK(!cb_hp_read(&hp, table, &t, err, sizeof err) && t.pick == 1 && used[0], "%s", err);
    values[0] = "both";
    CHECK(cb_hp_read(&hp, table, &t, err, sizeof err) && strstr(err, "layout=both: expected one of fused,split"), "%s",
          err);
    hp.n = 0;
    CHECK(!cb_hp_read(&hp, table, &t, err, sizeof err) && t.pick == 0, "%s", err);
}

/* A name's alternatives by layout, then the weight prefix in place of model. */
static void test_decoder_names(void) {
    cb_decoder d;
    memset(&d, 0, sizeof d);
    char buf[128];
    const char *fmt = "model.layers.%d.attn_norm.weight|layers.%d.attn_norm.weight";
    CHECK(!strcmp(cb_decoder_name(&d, buf, sizeof buf, fmt, 3), "model.layers.3.attn_norm.weight"), "%s", buf);
    d.layout = 1;
    CHECK(!strcmp(cb_decoder_name(&d, buf, sizeof buf, fmt, 3), "layers.3.attn_norm.weight"), "%s", buf);
    CHECK(!strcmp(cb_decoder_name(&d, buf, sizeof buf, "head.weight", 0), "head.weight"), "fewer alternatives: %s",
          buf);
    d.layout = 0;
    d.prefix = "model.language_model.";
    CHECK(!strcmp(cb_decoder_format(&d, buf, sizeof buf, "model.layers.%d.mlp.experts.%d.up_proj.weight"),
                  "model.language_model.layers.%d.mlp.experts.%d.up_proj.weight"), "%s", buf);
    CHECK(!strcmp(cb_decoder_name(&d, buf, sizeof buf, "lm_head.weight", 0), "lm_head.weight"), "%s", buf);
}

int main(void) {
    setenv("COLIBRI_PREFETCH", "1", 1);   /* the expert test checks prefetching changes nothing */
    snprintf(tmpdir, sizeof tmpdir, "/tmp/cb-test-runtime-XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_json_valid();
    test_json_invalid();
    test_json_output();
    test_json_fuzz();
    test_safetensors();
    test_mapped_embedding();
    test_experts();
    test_sampler();
    test_rope_geometry();
    test_layer_lists();
    test_hp_choice();
    test_decoder_names();
    cb_experts_io_shutdown();
    clear_tmp();
    rmdir(tmpdir);
    printf("test_runtime: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
