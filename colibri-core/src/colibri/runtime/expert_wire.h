/* expert_wire.h: the binary framing between a head engine and its expert workers (docs/protocol.md, "Expert
 * workers"), and the socket calls both sides make, every one bounded by a deadline so a dead or stalled peer costs
 * at most that long.
 *
 * A message is a 16-byte header, then `bytes` of payload:
 *     u32 magic "CBXW" | u16 version | u16 type | u32 bytes | u32 reserved (0)
 * Integers are u32/i32 and vectors f32, all little-endian: the byte order of every CPU the engines build for
 * (a big-endian build fails at compile time rather than speaking another protocol).
 */
#ifndef COLIBRI_EXPERT_WIRE_H
#define COLIBRI_EXPERT_WIRE_H

#include <stddef.h>
#include <stdint.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the expert-worker framing is little-endian; this build's host order is not"
#endif

#define CBW_MAGIC 0x57584243u   /* "CBXW" */
#define CBW_VERSION 1
#define CBW_HEADER_BYTES 16
#define CBW_MAX_PAYLOAD ((uint32_t)1 << 30)

enum { CBW_HELLO = 1, CBW_HELLO_OK = 2, CBW_RUN = 3, CBW_RUN_OK = 4, CBW_ERROR = 5 };

/* A growing payload. */
typedef struct {
    unsigned char *p;
    size_t n, cap;
    int oom;                   /* a put failed: the message must not be sent */
} cbw_buf;

void cbw_put(cbw_buf *b, const void *data, size_t n);
void cbw_put_u32(cbw_buf *b, uint32_t v);
void cbw_put_str(cbw_buf *b, const char *s);   /* u32 length, then the bytes (no terminator) */
void cbw_buf_free(cbw_buf *b);

/* Reading a received payload: every get checks the bounds; `bad` is set on the first one that does not fit. */
typedef struct {
    const unsigned char *p;
    size_t n, off;
    int bad;
} cbw_reader;

uint32_t cbw_get_u32(cbw_reader *r);
const void *cbw_get(cbw_reader *r, size_t n);   /* a pointer into the payload, NULL (and bad) past its end */
/* A string into out (at most outlen - 1 bytes, terminated); a longer one sets bad. */
void cbw_get_str(cbw_reader *r, char *out, size_t outlen);

/* Monotonic seconds. */
double cbw_now(void);

/* Send a header of `type` and the payload before `deadline` (cbw_now() seconds). 0, or -1 with a message. */
int cbw_send(int fd, int type, const cbw_buf *payload, double deadline, char *err, size_t errlen);
/* Receive one message into *payload (grown as needed, at most CBW_MAX_PAYLOAD) before the deadline; *type is the
 * header's. 0, or -1 with a message (peer closed, timeout, bad header). */
int cbw_recv(int fd, int *type, cbw_buf *payload, double deadline, char *err, size_t errlen);

/* "host:port" split (the last ':'; [v6] brackets allowed). 0, or -1 with a message. */
int cbw_split_addr(const char *addr, char *host, size_t hostlen, char *port, size_t portlen, char *err,
                   size_t errlen);
/* A TCP connection to host:port before the deadline (TCP_NODELAY: a layer's request is one write). */
int cbw_connect(const char *host, const char *port, double deadline, char *err, size_t errlen);
/* TCP_NODELAY: every message is one write, and a layer waits for its answer. */
void cbw_nodelay(int fd);
/* A listening socket on host:port (port "0": any free port, written back to *bound_port). */
int cbw_listen(const char *host, const char *port, int *bound_port, char *err, size_t errlen);

#endif
