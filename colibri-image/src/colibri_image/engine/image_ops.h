/* image_ops.h: the image family's block library, what the stages of qwen_image.c (Qwen-Image) and qwen_image21.c
 * (Qwen-Image-2.1) are composed of: the per-stage context, the stage vtable and its main, declarative tensor tables,
 * the stdin/stdout protocol, weights (f32 or int8 per row at load), attention, the DiT's norm and RoPE helpers and
 * the VAE's convolution blocks. Definitions in image_ops.c.
 *
 * Nothing here is process-global: a stage's checkpoint index, its key=value hyperparameters, its weight form and
 * its last error live in one img_ctx that main creates and passes down. Every failure (a missing tensor, a bad
 * request, out of memory) is returned up as -1 / NULL with c->err naming it, and main prints the one error line.
 */
#ifndef COLIBRI_IMAGE_OPS_H
#define COLIBRI_IMAGE_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "hparams.h"
#include "qlinear.h"
#include "quant.h"
#include "safetensors.h"

/* ---- one stage's state ---- */

/* The buffers of one session (img_ctx.session) or request, freed together whichever way it ends. */
#define IMG_MAX_BUFS 32
typedef struct {
    int n;
    void *p[IMG_MAX_BUFS];
} img_bufs;

typedef struct {
    cb_st_index idx;           /* the component folder's checkpoint */
    cb_hparams hp;             /* the stage's key=value arguments, read through cb_hp_spec tables */
    int int8;                  /* the stage's matrices quantized per row at load (never for the VAE) */
    img_bufs session;          /* the session's buffers, freed by img_main after forward */
    char err[512];             /* what failed, for main's one error line */
} img_ctx;

/* A stage of the image pipeline, one per process: load_model fills a zeroed model_size struct (its hparams table
 * read first), forward runs the session (requests on stdin until the end of input, answers on stdout) and
 * free_model frees whatever load_model got to, even half-way. */
typedef struct {
    const char *name;
    size_t model_size;
    const cb_hp_spec *hparams;
    int f32_only;              /* int8= does not apply (the VAE's convolutions stay f32) */
    int (*load_model)(img_ctx *c, void *model);
    int (*forward)(img_ctx *c, void *model);
    void (*free_model)(void *model);
} img_stage;

/* Qwen-Image-2.1's transformer and VAE (qwen_image21.c), for the binary's stage list in qwen_image.c's main. */
extern const img_stage dit21_stage, vae21_stage;

/* argv: STAGE COMPONENT_DIR key=value...; runs the stage of that name from `stages` (NULL-terminated): the
 * process's exit status (0, 1 with "error: ..." on stderr, 2 for a usage error). */
int img_main(int argc, char **argv, const img_stage *const *stages);

/* calloc of n floats; NULL with c->err "out of memory allocating N bytes" (the message the pipeline recognises). */
float *img_floats(img_ctx *c, size_t n);
void *img_alloc(img_ctx *c, size_t bytes);

void *img_keep(img_ctx *c, img_bufs *b, size_t bytes);   /* img_alloc, kept in b */
float *img_buf(img_ctx *c, img_bufs *b, size_t floats);
void img_bufs_free(img_bufs *b);

/* 0, or -1 with the message formatted into c->err. */
int img_fail(img_ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- weights ---- */

typedef struct {
    const void *w;     /* stored dtype, or (int8) the levels followed by the F16 scales */
    cb_dtype dt;
    int rows, cols;
    float *b;          /* bias (f32) or NULL */
    int quantized;
    cb_qmatrix q;
} linear_t;

typedef struct {
    int cin, cout, k;
    float *w, *b;
} conv_t;

typedef struct {
    int cin, cout, has_sc, causal;   /* shape (set by the IMG_RES entry that loads it) */
    float *g1, *g2;
    conv_t c1, c2, sc;
} resblock_t;

typedef struct {
    int C;
    float *gamma;
    conv_t qkv, proj;
} vattn_t;

/* ---- declarative tensor tables ---- */

typedef enum {
    IMG_LINEAR,        /* linear_t from <name>.weight [rows, cols] (+ <name>.bias when `flag`) */
    IMG_VECTOR,        /* float * of rows f32 values */
    IMG_MATRIX,        /* const cb_tensor * of a [rows, cols] matrix, located and checked, read by the forward pass */
    IMG_CONV,          /* conv_t from <name>.weight [rows out, cols in, (kt,) k, k] and <name>.bias; flag: causal 3-D */
    IMG_RES,           /* resblock_t under <name>. (cols channels in, rows out); `flag`: causal 3-D convolutions */
    IMG_RES_LIST,      /* resblock_t * of `count` blocks <name> formatted with (i, j): the first cols -> rows, the rest
                        * rows -> rows (diffusers' up blocks) */
} img_tensor_kind;

#define IMG_ALWAYS ((size_t)-1)
#define IMG_NEVER ((size_t)-2)

/* One tensor (or block of tensors) of a struct. The name, after the walk's prefix, is a printf format of the walk's
 * two indices (layer, or up block and resnet). rows / cols / count are offsets of int fields of the walk's shape
 * struct; flag and when are IMG_ALWAYS, IMG_NEVER or such an offset (when: the entry is loaded only if non-zero). */
typedef struct {
    const char *name;  /* NULL ends a table */
    img_tensor_kind kind;
    size_t at;         /* offset of the field in the destination struct */
    size_t rows, cols, flag, when, count;
} img_tensor_spec;

#define IMG_LIN(name, T, f, S, rows, cols, bias) \
    {name, IMG_LINEAR, offsetof(T, f), offsetof(S, rows), offsetof(S, cols), bias, IMG_ALWAYS, 0}
#define IMG_VEC(name, T, f, S, n) {name, IMG_VECTOR, offsetof(T, f), offsetof(S, n), 0, IMG_NEVER, IMG_ALWAYS, 0}
#define IMG_VEC_IF(name, T, f, S, n, when) \
    {name, IMG_VECTOR, offsetof(T, f), offsetof(S, n), 0, IMG_NEVER, offsetof(S, when), 0}
#define IMG_MAT(name, T, f, S, rows, cols) \
    {name, IMG_MATRIX, offsetof(T, f), offsetof(S, rows), offsetof(S, cols), IMG_NEVER, IMG_ALWAYS, 0}
#define IMG_CONV_IF(name, T, f, S, out, in, causal, when) \
    {name, IMG_CONV, offsetof(T, f), offsetof(S, out), offsetof(S, in), causal, when, 0}
#define IMG_CONV_OF(name, T, f, S, out, in, causal) IMG_CONV_IF(name, T, f, S, out, in, causal, IMG_ALWAYS)
#define IMG_RES_OF(name, T, f, S, out, in, causal) \
    {name, IMG_RES, offsetof(T, f), offsetof(S, out), offsetof(S, in), causal, IMG_ALWAYS, 0}
#define IMG_RES_LIST_OF(name, T, f, S, out, in, causal, count) \
    {name, IMG_RES_LIST, offsetof(T, f), offsetof(S, out), offsetof(S, in), causal, IMG_ALWAYS, offsetof(S, count)}
#define IMG_TENSORS_END {NULL, IMG_LINEAR, 0, 0, 0, 0, 0, 0}

/* Load the table's entries into dst, shapes from `shape` (often dst itself), names prefix + format(i, j). 0, or -1
 * with c->err naming the tensor. */
int img_load(img_ctx *c, void *dst, const void *shape, const img_tensor_spec *table, const char *prefix, int i, int j);
/* Free what img_load loaded (all of it or any part: dst must have started zeroed). */
void img_free(void *dst, const void *shape, const img_tensor_spec *table);
/* Load layer l of the zeroed array of n structs of `size` bytes from the table with index l (layers NULL: the
 * allocation failed, c->err says so): 0 or -1. */
int img_load_layers(img_ctx *c, void *layers, const void *shape, const img_tensor_spec *table, const char *prefix,
                    int n, size_t size);
void img_free_layers(void *layers, const void *shape, const img_tensor_spec *table, int n, size_t size);
/* A required integer that may be 0, and the three RoPE axis sizes (axes_dims_rope) of both transformers. */
#define IMG_HP_COUNT(key, T, f) {key, CB_HP_INT, offsetof(T, f), 0, CB_HP_NONNEG, NULL, 0}
#define IMG_HP_REAL(key, T, f) {key, CB_HP_FLOAT, offsetof(T, f), 0, CB_HP_NONNEG, NULL, 0}
#define IMG_HP_AXES(T, f) IMG_HP_COUNT("axes0", T, f[0]), IMG_HP_COUNT("axes1", T, f[1]), IMG_HP_COUNT("axes2", T, f[2])

/* The stage's hyperparameters into dst as the table says: 0, or -1 with c->err naming the key. */
int img_hparams(img_ctx *c, const cb_hp_spec *table, void *dst);

void linear(const linear_t *l, float *Y, const float *X, int n);

/* ---- stdin / stdout ---- */

int read_all(void *dst, size_t n);
/* One answer: the int32 header (hdr_ints of them, 0 none) then `floats` f32 values, flushed: 0 or -1. */
int img_reply(img_ctx *c, const int32_t *hdr, int hdr_ints, const float *data, size_t floats);
int read_i32(int32_t *v);
/* One step request of a transformer session (cmd 1, which text, timestep, the latents): 1 read, 0 the end of the
 * session (end of input or another command), -1 a short or bad request. */
int read_step(img_ctx *c, int ntext, size_t floats, float *lat, int32_t *which, float *timestep);

/* ---- transformer pieces ---- */

int attention(img_ctx *c, float *out, const float *q, const float *k, const float *v, int nq, int nk, int heads,
              int kv_heads, int dim, size_t q_stride, size_t kv_stride, int causal);
void norm_modulate(float *out, const float *x, int n, int D, const float *shift, const float *scale, float eps);
float gelu_tanh(float x);
void qk_norm_rope(float *x, int n, int heads, int hd, const float *w, const float *cs, float eps);
void rope_text(float *cs, int n, int start, const int axes[3]);
void rope_image(float *cs, int gh, int gw, int frame, const int axes[3]);

/* ---- VAE pieces (each -1 / NULL on failure; the _forward ones free their input either way) ---- */

int conv(img_ctx *c, const conv_t *cv, float *y, const float *x, int h, int w);
float *res_forward(img_ctx *c, const resblock_t *r, float *x, int h, int w);
float *upsample2x(img_ctx *c, float *y, int C, int h, int w);

/* An up block of either decoder: resnets (the first in -> out channels, the rest out -> out), then (but the last
 * block) an upsampler conv to up_out channels. */
typedef struct {
    int in, out, up_out, up, ft, nres1;   /* ft: 2.1's temporal factor of the DupUp3D shortcut (1 without) */
    resblock_t *res;
    conv_t upconv;
} upblock_t;

/* What both decoders share: the arguments (z_dim, num_res_blocks, levels, multI; base_dim), post_quant_conv +
 * conv_in + the mid block (resnet, attention, resnet) in front, the up blocks' shapes and weights, norm_out +
 * conv_out behind. */
typedef struct {
    int base, z, nres, levels, mult[8];
    int dims[9];       /* dims[0] the mid block's channels, dims[i + 1] up block i's output */
    int d0x3, top, out_rows, causal;
    conv_t pq, cin, cout;
    resblock_t mid0, mid1;
    vattn_t attn;
    float *gout;
    upblock_t U[8];
    const img_tensor_spec *up_tensors;
} vae_frame_t;

extern const cb_hp_spec vae_frame_hparams[];
/* After vae_frame_hparams: the frame's tensors and the up blocks' (causal: Qwen-Image's 3-D kernels; out_rows:
 * conv_out's rows; halve: the upsamplers halve the channels; tup: each block's temporal upsampling, or NULL). */
int vae_frame_load(img_ctx *c, vae_frame_t *v, int causal, int out_rows, const img_tensor_spec *up_tensors, int halve,
                   const int *tup);
int vae_frame_next(img_ctx *c, const vae_frame_t *v, int32_t *h, int32_t *w, float **y);
float *vae_frame_tail(img_ctx *c, const vae_frame_t *v, float *y, int h, int w);
void vae_frame_free(vae_frame_t *v);

#endif
