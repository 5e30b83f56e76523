/* expert_wire.c: see expert_wire.h. */
#include "expert_wire.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

void cbw_put(cbw_buf *b, const void *data, size_t n) {
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n) cap *= 2;
        unsigned char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, data, n);
    b->n += n;
}

void cbw_put_u32(cbw_buf *b, uint32_t v) { cbw_put(b, &v, 4); }

void cbw_put_str(cbw_buf *b, const char *s) {
    size_t n = strlen(s);
    cbw_put_u32(b, (uint32_t)n);
    cbw_put(b, s, n);
}

void cbw_buf_free(cbw_buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

const void *cbw_get(cbw_reader *r, size_t n) {
    if (r->bad || n > r->n - r->off) {
        r->bad = 1;
        return NULL;
    }
    const void *p = r->p + r->off;
    r->off += n;
    return p;
}

uint32_t cbw_get_u32(cbw_reader *r) {
    const void *p = cbw_get(r, 4);
    uint32_t v = 0;
    if (p) memcpy(&v, p, 4);
    return v;
}

void cbw_get_str(cbw_reader *r, char *out, size_t outlen) {
    uint32_t n = cbw_get_u32(r);
    const char *p = r->bad || n >= outlen ? NULL : cbw_get(r, n);
    if (!p) {
        r->bad = 1;
        if (outlen) out[0] = 0;
        return;
    }
    memcpy(out, p, n);
    out[n] = 0;
}

double cbw_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Wait until fd is ready for `events` or the deadline passes: 1 ready, 0 timeout, -1 error. */
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        double left = deadline - cbw_now();
        if (left <= 0) return 0;
        struct pollfd p = {fd, events, 0};
        int ms = left > 3600 ? 3600000 : (int)(left * 1000.0) + 1;
        int rc = poll(&p, 1, ms);
        if (rc > 0) return 1;
        if (rc < 0 && errno != EINTR) return -1;
    }
}

static int write_all(int fd, const void *data, size_t n, double deadline, char *err, size_t errlen) {
    const unsigned char *p = data;
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int w = wait_fd(fd, POLLOUT, deadline);
            if (w > 0) continue;
            snprintf(err, errlen, w == 0 ? "send timed out" : "send failed: %s", strerror(errno));
            return -1;
        }
        snprintf(err, errlen, "send failed: %s", k < 0 ? strerror(errno) : "no progress");
        return -1;
    }
    return 0;
}

static int read_all(int fd, void *data, size_t n, double deadline, char *err, size_t errlen) {
    unsigned char *p = data;
    while (n) {
        ssize_t k = recv(fd, p, n, MSG_DONTWAIT);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0) {
            snprintf(err, errlen, "connection closed by the peer");
            return -1;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int w = wait_fd(fd, POLLIN, deadline);
            if (w > 0) continue;
            snprintf(err, errlen, w == 0 ? "no answer within the timeout" : "receive failed: %s", strerror(errno));
            return -1;
        }
        snprintf(err, errlen, "receive failed: %s", strerror(errno));
        return -1;
    }
    return 0;
}

int cbw_send(int fd, int type, const cbw_buf *payload, double deadline, char *err, size_t errlen) {
    if (payload->oom || payload->n > CBW_MAX_PAYLOAD) {
        snprintf(err, errlen, "message too large or out of memory building it");
        return -1;
    }
    /* Header and payload in one write: two small writes would meet Nagle and delayed ACKs (40 ms a message). */
    uint32_t h[4] = {CBW_MAGIC, (uint32_t)CBW_VERSION | ((uint32_t)type << 16), (uint32_t)payload->n, 0};
    if (payload->n <= 65536) {
        unsigned char one[CBW_HEADER_BYTES + 65536];
        memcpy(one, h, sizeof h);
        if (payload->n) memcpy(one + sizeof h, payload->p, payload->n);
        return write_all(fd, one, sizeof h + payload->n, deadline, err, errlen);
    }
    if (write_all(fd, h, sizeof h, deadline, err, errlen)) return -1;
    return write_all(fd, payload->p, payload->n, deadline, err, errlen);
}

int cbw_recv(int fd, int *type, cbw_buf *payload, double deadline, char *err, size_t errlen) {
    uint32_t h[4];
    if (read_all(fd, h, sizeof h, deadline, err, errlen)) return -1;
    if (h[0] != CBW_MAGIC || (h[1] & 0xffff) != CBW_VERSION || h[2] > CBW_MAX_PAYLOAD) {
        snprintf(err, errlen, "not an expert-worker message (magic %08x, version %u, %u bytes)", h[0],
                 h[1] & 0xffff, h[2]);
        return -1;
    }
    *type = (int)(h[1] >> 16);
    payload->n = 0;
    payload->oom = 0;
    if (h[2] > payload->cap) {
        unsigned char *p = realloc(payload->p, h[2]);
        if (!p) {
            snprintf(err, errlen, "out of memory for a %u-byte message", h[2]);
            return -1;
        }
        payload->p = p;
        payload->cap = h[2];
    }
    if (read_all(fd, payload->p, h[2], deadline, err, errlen)) return -1;
    payload->n = h[2];
    return 0;
}

int cbw_split_addr(const char *addr, char *host, size_t hostlen, char *port, size_t portlen, char *err,
                   size_t errlen) {
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr || !colon[1] || strlen(colon + 1) >= portlen) {
        snprintf(err, errlen, "expert worker address %s is not host:port", addr);
        return -1;
    }
    const char *h = addr;
    size_t hn = (size_t)(colon - addr);
    if (hn >= 2 && h[0] == '[' && h[hn - 1] == ']') {
        h++;
        hn -= 2;
    }
    if (hn >= hostlen) {
        snprintf(err, errlen, "expert worker address %s: host name too long", addr);
        return -1;
    }
    memcpy(host, h, hn);
    host[hn] = 0;
    snprintf(port, portlen, "%s", colon + 1);
    return 0;
}

static struct addrinfo *resolve(const char *host, const char *port, int passive, char *err, size_t errlen) {
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = passive ? AI_PASSIVE : 0;
    int rc = getaddrinfo(host, port, &hints, &res);
    if (rc) {
        snprintf(err, errlen, "cannot resolve %s:%s: %s", host, port, gai_strerror(rc));
        return NULL;
    }
    return res;
}

int cbw_connect(const char *host, const char *port, double deadline, char *err, size_t errlen) {
    struct addrinfo *res = resolve(host, port, 0, err, errlen);
    if (!res) return -1;
    int fd = -1;
    snprintf(err, errlen, "cannot connect to %s:%s", host, port);
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) continue;
        int rc = connect(fd, a->ai_addr, a->ai_addrlen);
        if (rc < 0 && errno == EINPROGRESS) {
            int soerr = 0;
            socklen_t len = sizeof soerr;
            if (wait_fd(fd, POLLOUT, deadline) > 0 && !getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len) && !soerr)
                rc = 0;
            else if (soerr)
                snprintf(err, errlen, "cannot connect to %s:%s: %s", host, port, strerror(soerr));
        }
        if (rc < 0) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd >= 0) cbw_nodelay(fd);
    return fd;
}

void cbw_nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int cbw_listen(const char *host, const char *port, int *bound_port, char *err, size_t errlen) {
    struct addrinfo *res = resolve(host, port, 1, err, errlen);
    if (!res) return -1;
    int fd = -1;
    snprintf(err, errlen, "cannot listen on %s:%s", host, port);
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        /* a restarted worker rebinds its port while the old connections linger in TIME_WAIT */
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) || listen(fd, 4)) {
            snprintf(err, errlen, "cannot listen on %s:%s: %s", host, port, strerror(errno));
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd >= 0 && bound_port) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        *bound_port = 0;
        if (!getsockname(fd, (struct sockaddr *)&ss, &len))
            *bound_port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                                   : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    }
    return fd;
}
