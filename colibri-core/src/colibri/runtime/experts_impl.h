/* experts_impl.h: what the expert store's modules share among themselves (not for engines or blocks).
 *
 *   expert_store.c    the slots, eviction and cb_experts_get; the registry of live layers; the options
 *   expert_read.c     locating an expert's pieces, planning its reads, the per-shard descriptors and the readers
 *   expert_pool.c     the I/O pool that stages reads ahead of the compute
 *   expert_hotset.c   the learned hot set (heat, pins) and its sidecar file
 *   expert_duel.c     set dueling: LRU's and the hot set's shadow tags, and the victim of the leader
 *   expert_preload.c  reading every expert of a cache that holds them all, at load
 */
#ifndef COLIBRI_EXPERTS_IMPL_H
#define COLIBRI_EXPERTS_IMPL_H

#include "experts.h"

#define CBX_DIO_ALIGN 4096
#define CBX_IO_THREADS 2       /* default: two reads in flight keep a virtio/NVMe queue busy (coli tune measures) */
#define CBX_IO_THREADS_MAX CB_IO_THREADS_MAX
int cbx_io_threads(void);   /* the pool's and the preload's reader threads (--io-threads, else the default) */

/* ---- expert_store.c ---- */
extern size_t cbx_buf_bytes;   /* the largest expert of any layer + alignment slack, a multiple of CBX_DIO_ALIGN */
void *cbx_alloc_buf(void);
extern cb_expert_layer **cbx_live;   /* every initialised layer (re-pinning, the sidecar, preload) */
extern int cbx_n_live;
cb_expert_layer *cbx_layer_no(int layer);
/* The slot among n (tag: slot -> expert, -1 empty; use: slot -> last access tick) a miss evicts: an empty one,
 * else by_heat the coldest unpinned expert (least recently used among equals), else the least recently used;
 * slots with spare[s] set are not candidates (spare may be NULL). -1 when no slot is a candidate. */
int cbx_victim(const cb_expert_layer *L, const int *tag, const uint64_t *use, int n, int by_heat,
               const unsigned char *spare);

/* ---- expert_read.c ---- */
/* Locate a native expert's three matrices (and their scale tensors for fp8 / fp4). 0, or -1 naming the tensor. */
int cbx_locate_native(cb_expert_location *loc, const cb_st_index *idx, const char *const names[3], int layer,
                      int e, int hidden, int inter, char *err, size_t errlen);
/* Where each piece goes in the slot buffer; returns the bytes the expert needs. */
size_t cbx_plan_pieces(cb_expert_location *loc);
/* This process's own descriptors of idx's shards (buffered with random-access advice, and O_DIRECT when wanted and
 * allowed); reference counted per layer. 0, or -1 out of memory. */
int cbx_shards_open(const cb_st_index *idx, int want_direct);
void cbx_shards_release(const cb_st_index *idx);
const cb_st_index *cbx_shards_index(void);   /* the index the descriptors belong to, NULL when none */
/* Read expert e into buf; *data_off says where its span starts (non-zero only for aligned direct reads). No
 * counters but the atomic direct/buffered ones: the I/O threads call it too. */
int cbx_raw_read(const cb_expert_layer *L, int e, void *buf, size_t *data_off, char *err, size_t errlen);
/* Count one read of expert e in L's counters (reads, bytes_read). */
void cbx_count_read(cb_expert_layer *L, int e);

/* ---- expert_pool.c ---- */
/* If e is staged, wait for it and swap its buffer into slot s. 1 = taken, 0 = not staged, -1 = read failed. */
int cbx_take_staged(cb_expert_layer *L, int e, int s, char *err, size_t errlen);

/* ---- expert_hotset.c ---- */
/* One more routed row of e: its heat grows (hot set only). */
void cbx_warm_up(cb_expert_layer *L, int e);

/* ---- expert_duel.c ---- */
int cbx_duel_init(cb_expert_layer *L);   /* 0, or -1 out of memory (cbx_duel_free cleans up either way) */
void cbx_duel_free(cb_expert_layer *L);
/* Feed one lookup of e (at tick now) to both shadows and update the lead. */
void cbx_duel_observe(cb_expert_layer *L, int e, uint64_t now);
/* The real slot a miss evicts: by the leader's rule, a resident its shadow no longer holds first. */
int cbx_duel_victim(cb_expert_layer *L);

#endif
