/* expert_worker.c: see expert_worker.h. One thread of control (the kernels use the thread pool). */
#include "expert_worker.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "blocks.h"
#include "json.h"
#include "expert_wire.h"
#include "experts_impl.h"
#include "kernels.h"
#include "qlinear.h"

#define ERRLEN 512
#define REQUEST_TIMEOUT_S 30.0   /* the rest of a message once its header arrived */

typedef struct {
    cb_expert_layer store;
    int layer;
    unsigned char *held;
} wlayer_t;

typedef struct {
    cb_st_index idx;
    wlayer_t *layers;
    int n_layers;
    cbw_buf hello;             /* the share currently loaded (a reconnecting head re-sends the same one) */
    uint64_t held_experts, held_bytes;
    float *xs, *gate, *up;
    size_t scratch_rows;
    int hidden_max, inter_max;
} worker_t;

int cb_expert_worker_wanted(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--expert-worker")) return 1;
    return 0;
}

static void drop_share(worker_t *W) {
    for (int i = 0; i < W->n_layers; i++) {
        cb_experts_free(&W->layers[i].store);
        free(W->layers[i].held);
    }
    free(W->layers);
    W->layers = NULL;
    W->n_layers = 0;
    W->held_experts = W->held_bytes = 0;
    W->hello.n = 0;
}

static wlayer_t *layer_of(worker_t *W, int layer) {
    for (int i = 0; i < W->n_layers; i++)
        if (W->layers[i].layer == layer) return &W->layers[i];
    return NULL;
}

/* Locate and read the share a HELLO names. 0, or -1 with a message. */
static int load_share(worker_t *W, const cbw_buf *hello, char *err, size_t errlen) {
    drop_share(W);
    cbw_reader r = {hello->p, hello->n, 0, 0};
    uint32_t n = cbw_get_u32(&r);
    if (r.bad || n > 16384) {
        snprintf(err, errlen, "bad share: %u layers", n);
        return -1;
    }
    W->layers = calloc(n ? n : 1, sizeof *W->layers);
    if (!W->layers) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t layer = cbw_get_u32(&r), n_exp = cbw_get_u32(&r), hidden = cbw_get_u32(&r), inter = cbw_get_u32(&r);
        char names[3][512];
        for (int m = 0; m < 3; m++) cbw_get_str(&r, names[m], sizeof names[m]);
        uint32_t held = cbw_get_u32(&r);
        if (r.bad || n_exp < 1 || n_exp > 65536 || hidden < 1 || hidden > (1u << 20) || inter < 1 ||
            inter > (1u << 20) || layer > 16384 || held > n_exp || layer_of(W, (int)layer)) {
            snprintf(err, errlen, "bad share: layer entry %u", i);
            return -1;
        }
        wlayer_t *wl = &W->layers[W->n_layers];
        const char *const fmts[3] = {names[0], names[1], names[2]};
        if (cb_experts_init(&wl->store, &W->idx, (int)layer, (int)n_exp, (int)n_exp, (int)hidden, (int)inter, fmts,
                            err, errlen))
            return -1;
        wl->layer = (int)layer;
        W->n_layers++;
        if (!(wl->held = calloc(n_exp, 1))) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        if ((int)hidden > W->hidden_max) W->hidden_max = (int)hidden;
        if ((int)inter > W->inter_max) W->inter_max = (int)inter;
        for (uint32_t k = 0; k < held; k++) {
            uint32_t e = cbw_get_u32(&r);
            if (r.bad || e >= n_exp) {
                snprintf(err, errlen, "bad share: layer %u expert %u", layer, e);
                return -1;
            }
            cb_expert_view v;
            if (!wl->held[e] && cb_experts_get(&wl->store, (int)e, &v, err, errlen)) return -1;
            W->held_experts += !wl->held[e];
            wl->held[e] = 1;
        }
    }
    if (r.off != r.n) {
        snprintf(err, errlen, "bad share: %zu trailing bytes", r.n - r.off);
        return -1;
    }
    W->held_bytes = W->held_experts * (uint64_t)cbx_buf_bytes;
    W->hello.n = 0;
    cbw_put(&W->hello, hello->p, hello->n);
    return 0;
}

static int ensure_scratch(worker_t *W, size_t rows, char *err, size_t errlen) {
    if (rows <= W->scratch_rows) return 0;
    free(W->xs);
    free(W->gate);
    free(W->up);
    W->xs = malloc(rows * (size_t)W->hidden_max * sizeof(float));
    W->gate = malloc(rows * (size_t)W->inter_max * sizeof(float));
    W->up = malloc(rows * (size_t)W->inter_max * sizeof(float));
    W->scratch_rows = W->xs && W->gate && W->up ? rows : 0;
    if (!W->scratch_rows) snprintf(err, errlen, "out of memory for %zu rows of scratch", rows);
    return W->scratch_rows ? 0 : -1;
}

/* Answer a RUN: every (row, expert) output in request order, from the held experts. 0, or -1 with a message. */
static int run_request(worker_t *W, const cbw_buf *req, cbw_buf *out, char *err, size_t errlen) {
    cbw_reader r = {req->p, req->n, 0, 0};
    uint32_t layer = cbw_get_u32(&r);
    float limit = 0;
    const void *lp = cbw_get(&r, 4);
    if (lp) memcpy(&limit, lp, 4);
    uint32_t n_rows = cbw_get_u32(&r), n_exp = cbw_get_u32(&r);
    wlayer_t *wl = r.bad ? NULL : layer_of(W, (int)layer);
    if (!wl) {
        snprintf(err, errlen, "layer %u is not in this worker's share", layer);
        return -1;
    }
    cb_expert_layer *L = &wl->store;
    size_t H = (size_t)L->hidden, row_bytes = H * sizeof(float);
    if (n_exp > (uint32_t)L->n_experts || n_rows > req->n / row_bytes) {
        snprintf(err, errlen, "bad request: %u experts, %u rows", n_exp, n_rows);
        return -1;
    }
    /* The rows follow the expert lists: find them first. */
    size_t lists = r.off, pairs = 0;
    for (uint32_t k = 0; k < n_exp; k++) {
        cbw_get_u32(&r);
        uint32_t c = cbw_get_u32(&r);
        if (r.bad || c > n_rows || !cbw_get(&r, (size_t)c * 4)) {
            snprintf(err, errlen, "bad request: expert list %u", k);
            return -1;
        }
        pairs += c;
    }
    const float *x = cbw_get(&r, (size_t)n_rows * row_bytes);
    if (!x || r.off != r.n) {
        snprintf(err, errlen, "bad request: %zu bytes for %u rows", req->n, n_rows);
        return -1;
    }
    if (ensure_scratch(W, n_rows, err, errlen)) return -1;
    int quant = L->loc[0].kind == CB_MAT_INT;
    if (quant && cb_qexperts_begin(x, (int)n_rows, (int)H)) {
        snprintf(err, errlen, "out of memory quantizing %u rows", n_rows);
        return -1;
    }
    out->n = 0;
    out->oom = 0;
    cbw_put(out, NULL, 0);
    if (pairs * row_bytes > CBW_MAX_PAYLOAD) {
        snprintf(err, errlen, "answer too large");
        return -1;
    }
    if (out->cap < pairs * row_bytes) {
        unsigned char *p = realloc(out->p, pairs * row_bytes);
        if (!p) {
            snprintf(err, errlen, "out of memory for the answer");
            return -1;
        }
        out->p = p;
        out->cap = pairs * row_bytes;
    }
    r.off = lists;
    int *rows = malloc((n_rows ? n_rows : 1) * sizeof(int));
    if (!rows) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int rc = 0;
    for (uint32_t k = 0; k < n_exp && !rc; k++) {
        uint32_t e = cbw_get_u32(&r), c = cbw_get_u32(&r);
        for (uint32_t i = 0; i < c; i++) {
            uint32_t row = cbw_get_u32(&r);
            rows[i] = (int)row;
            if (row >= n_rows) rc = -1;
        }
        if (rc || e >= (uint32_t)L->n_experts || !wl->held[e]) {
            snprintf(err, errlen, "layer %u expert %u is not in this worker's share (or a row is out of range)",
                     layer, e);
            rc = -1;
            break;
        }
        cb_expert_view v;
        if (cb_experts_get(L, (int)e, &v, err, errlen) ||
            cb_expert_apply(&v, (float *)(void *)(out->p + out->n), W->xs, W->gate, W->up, x, rows, (int)c,
                            L->hidden, L->inter, limit, err, errlen))
            rc = -1;
        out->n += (size_t)c * row_bytes;
    }
    free(rows);
    return rc;
}

static void reply_error(int fd, const char *msg) {
    cbw_buf b = {0};
    char err[ERRLEN];
    cbw_put_str(&b, msg);
    if (cbw_send(fd, CBW_ERROR, &b, cbw_now() + REQUEST_TIMEOUT_S, err, sizeof err))
        fprintf(stderr, "notice: %s\n", err);
    cbw_buf_free(&b);
}

/* One message from the head; -1 closes the connection. */
static int serve_message(worker_t *W, int fd, cbw_buf *in, cbw_buf *out) {
    char err[ERRLEN];
    int type;
    if (cbw_recv(fd, &type, in, cbw_now() + REQUEST_TIMEOUT_S, err, sizeof err)) return -1;
    if (type == CBW_HELLO) {
        int same = W->n_layers && W->hello.n == in->n && !memcmp(W->hello.p, in->p, in->n);
        if (!same && load_share(W, in, err, sizeof err)) {
            drop_share(W);
            reply_error(fd, err);
            return 0;
        }
        printf("{\"ev\":\"loaded\",\"experts\":%llu,\"bytes\":%llu}\n", (unsigned long long)W->held_experts,
               (unsigned long long)W->held_bytes);
        fflush(stdout);
        cbw_buf b = {0};
        cbw_put_u32(&b, (uint32_t)getpid());
        cbw_put_u32(&b, (uint32_t)W->held_experts);
        cbw_put_u32(&b, (uint32_t)W->held_bytes);
        cbw_put_u32(&b, (uint32_t)(W->held_bytes >> 32));
        int rc = cbw_send(fd, CBW_HELLO_OK, &b, cbw_now() + REQUEST_TIMEOUT_S, err, sizeof err);
        cbw_buf_free(&b);
        return rc;
    }
    if (type == CBW_RUN) {
        if (run_request(W, in, out, err, sizeof err)) {
            reply_error(fd, err);
            return 0;
        }
        return cbw_send(fd, CBW_RUN_OK, out, cbw_now() + REQUEST_TIMEOUT_S, err, sizeof err);
    }
    reply_error(fd, "unknown message type");
    return -1;
}

static void fatal(const char *code, const char *msg) {
    cb_buf b = {0};
    cb_buf_printf(&b, "{\"ev\":\"fatal\",\"code\":\"%s\",\"message\":", code);
    cb_buf_json_str(&b, msg);
    cb_buf_puts(&b, "}\n");
    fwrite(b.data, 1, b.len, stdout);
    fflush(stdout);
    cb_buf_free(&b);
}

static int parse_worker_args(int argc, char **argv, const char **model, const char **listen_at, int *threads) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--expert-worker")) continue;
        if (!v) break;
        if (!strcmp(a, "--model")) *model = v;
        else if (!strcmp(a, "--listen")) *listen_at = v;
        else if (!strcmp(a, "--threads")) *threads = atoi(v);
        else {
            char msg[ERRLEN];
            snprintf(msg, sizeof msg, "unknown expert-worker argument %s (--model, --listen, --threads)", a);
            fatal("bad_args", msg);
            return -1;
        }
        i++;
    }
    if (!*model) {
        fatal("bad_args", "--expert-worker needs --model DIR");
        return -1;
    }
    return 0;
}

int cb_expert_worker_main(int argc, char **argv) {
    const char *model = NULL, *listen_at = "127.0.0.1:0";
    int threads = 0, rc = 2;
    if (parse_worker_args(argc, argv, &model, &listen_at, &threads)) return 2;
    worker_t W;
    memset(&W, 0, sizeof W);
    char err[ERRLEN], host[256], port[32];
    if (cb_st_open(&W.idx, model, err, sizeof err)) {
        fatal("load", err);
        return 2;
    }
    int bound = 0, lfd = -1;
    if (cbw_split_addr(listen_at, host, sizeof host, port, sizeof port, err, sizeof err) ||
        (lfd = cbw_listen(host, port, &bound, err, sizeof err)) < 0) {
        fatal("bad_args", err);
        goto out_index;
    }
    if (cb_threads_init(threads)) {
        fatal("internal", "cannot start the compute threads");
        goto out_listen;
    }
    printf("{\"ev\":\"listening\",\"port\":%d,\"pid\":%d}\n", bound, (int)getpid());
    fflush(stdout);
    cbw_buf in = {0}, out = {0};
    int conn = -1;
    rc = 0;
    for (;;) {
        struct pollfd p[3] = {{0, POLLIN, 0}, {lfd, POLLIN, 0}, {conn, POLLIN, 0}};
        int k = poll(p, conn >= 0 ? 3 : 2, -1);
        if (k < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (p[0].revents) {
            char buf[256];
            ssize_t got = read(0, buf, sizeof buf);
            if (got <= 0) break;   /* the starter is gone */
        }
        if (p[1].revents & POLLIN) {
            int c = accept(lfd, NULL, NULL);
            if (c >= 0) {
                cbw_nodelay(c);
                if (conn >= 0) close(conn);
                conn = c;
                continue;
            }
        }
        if (conn >= 0 && p[2].revents && serve_message(&W, conn, &in, &out)) {
            close(conn);
            conn = -1;
        }
    }
    if (conn >= 0) close(conn);
    cbw_buf_free(&in);
    cbw_buf_free(&out);
    cbw_buf_free(&W.hello);
    drop_share(&W);
    free(W.xs);
    free(W.gate);
    free(W.up);
    cb_experts_io_shutdown();
    cb_threads_shutdown();
out_listen:
    close(lfd);
out_index:
    cb_st_close(&W.idx);
    return rc;
}
