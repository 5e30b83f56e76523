/* image_ops.h: what the image stages share (qwen_image.c for Qwen-Image, qwen_image21.c for Qwen-Image-2.1):
 * key=value arguments, the stdin/stdout protocol, weights (f32 or int8 per row at load), attention, the DiT's norm and
 * RoPE helpers and the VAE's convolution blocks. Definitions in image_ops.c.
 */
#ifndef COLIBRI_IMAGE_OPS_H
#define COLIBRI_IMAGE_OPS_H

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>

#include "qlinear.h"
#include "quant.h"
#include "safetensors.h"

#define MAX_ARGS 64

typedef struct {
    int n;
    const char *key[MAX_ARGS];
    const char *val[MAX_ARGS];
} args_t;

typedef struct {
    const void *w;     /* stored dtype, or (int8) the levels followed by the F16 scales */
    cb_dtype dt;
    int rows, cols;
    float *b;          /* bias (f32) or NULL */
    int quantized;
    cb_qmatrix q;
} linear_t;

#define FALLOC(n) ((float *)xalloc((size_t)(n) * sizeof(float)))

typedef struct {
    int cin, cout, k;
    float *w, *b;
} conv_t;

typedef struct {
    int cin, cout;
    float *g1, *g2;
    conv_t c1, c2, sc;
    int has_sc;
} resblock_t;

typedef struct {
    int C;
    float *gamma;
    conv_t qkv, proj;
} vattn_t;

extern char g_err[512];
extern cb_st_index g_idx;
extern int g_int8;         /* int8=1: the stage's matrices quantized per row at load (the VAE is always f32) */

/* Out of memory anywhere in a stage: xalloc longjmps here (set by main around the stage) with g_err naming the size,
 * so the stage returns an error to main instead of the process calling exit() from deep inside a block. */
extern jmp_buf g_oom;
void oom(size_t bytes);

const char *arg_str(const args_t *a, const char *key);
int arg_int(const args_t *a, const char *key, int *out);
int arg_float(const args_t *a, const char *key, float *out);
int arg_int_or(const args_t *a, const char *key, int fallback);

int read_all(void *dst, size_t n);
int write_all(const void *src, size_t n);
int read_i32(int32_t *v);

const cb_tensor *find(const char *name);
const cb_tensor *find_matrix(const char *name, int rows, int cols);
float *load_f32(const char *name, size_t expect);
int load_linear(linear_t *l, const char *prefix, int rows, int cols, int bias);
void free_linear(linear_t *l);
void linear(const linear_t *l, float *Y, const float *X, int n);
void *xalloc(size_t n);

void attention(float *out, const float *q, const float *k, const float *v, int nq, int nk, int heads, int kv_heads,
               int dim, size_t q_stride, size_t kv_stride, int causal);
void norm_modulate(float *out, const float *x, int n, int D, const float *shift, const float *scale, float eps);
float gelu_tanh(float x);
void qk_norm_rope(float *x, int n, int heads, int hd, const float *w, const float *cs, float eps);
void rope_section(float *out, int pos, int dim);
void rope_text(float *cs, int n, int start, const int axes[3]);
void rope_image(float *cs, int gh, int gw, int frame, const int axes[3]);
int read_step(int ntext, size_t floats, float *lat, int32_t *which, float *timestep);

int load_conv(conv_t *c, const char *prefix, int cin, int cout, int three_d);
void free_conv(conv_t *c);
void conv(const conv_t *c, float *y, const float *x, int h, int w);
void rms_channels(float *x, int C, int hw, const float *gamma, int silu);
int load_res(resblock_t *r, const char *p, int cin, int cout, int three_d);
void free_res(resblock_t *r);
float *res_forward(const resblock_t *r, float *x, int h, int w);
float *vattn_forward(const vattn_t *a, float *x, int h, int w);
float *upsample2x(float *y, int C, int h, int w);

/* What both decoders share around their up blocks: the arguments (z_dim, num_res_blocks, levels, multI; base_dim),
 * post_quant_conv + conv_in + the mid block (resnet, attention, resnet) in front, norm_out + conv_out behind. */
typedef struct {
    int z, nres, levels, dims[9];   /* dims[0] the mid block's channels, dims[i + 1] up block i's output */
    conv_t pq, cin, cout;
    resblock_t mid0, mid1;
    vattn_t attn;
    float *gout;
} vae_frame_t;

int vae_frame_load(vae_frame_t *v, const args_t *a, int three_d, int out_rows);
int vae_frame_next(const vae_frame_t *v, int32_t *h, int32_t *w, float **y);
float *vae_frame_tail(const vae_frame_t *v, float *y, int h, int w);
void vae_frame_free(vae_frame_t *v);

void report_peak_rss(void);

#endif
