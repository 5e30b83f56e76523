/* threads.c: the persistent worker pool behind cb_parallel_for.
 *
 * Workers spin briefly after each job (decode issues many small matvecs back to back, and a futex wake costs more
 * than a short spin) and then sleep on a condition variable: the engine is often waiting on the disk, and a pool
 * that spins forever would steal the cores the I/O completion and the OS need. Tasks are handed out through an
 * atomic counter; each task writes its own outputs, so which thread runs it never changes a result.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels.h"

/* Roughly 50-100 microseconds of pause instructions before a worker or the caller goes to sleep. */
#define CB_SPIN_ROUNDS 4096

typedef struct {
    pthread_t *workers;
    int n_workers;                     /* threads besides the caller */
    int started;

    pthread_mutex_t mutex;
    pthread_cond_t work_ready;
    pthread_cond_t work_done;

    atomic_uint generation;            /* bumped once per job; workers run each generation exactly once */
    unsigned start_generation;         /* the generation when the workers were created */
    atomic_int pending_workers;        /* workers that have not yet finished the current generation */
    atomic_int next_task;
    int n_tasks;
    void (*fn)(void *ctx, int i);
    void *ctx;
    atomic_int stopping;
    atomic_flag busy;                  /* held by the caller of the running job; nested calls run inline */
} thread_pool;

static thread_pool g_pool = {
    .mutex = PTHREAD_MUTEX_INITIALIZER,
    .work_ready = PTHREAD_COND_INITIALIZER,
    .work_done = PTHREAD_COND_INITIALIZER,
    .busy = ATOMIC_FLAG_INIT,
};
/* Serialises init/shutdown against each other (not against jobs: callers must not resize a pool in use). */
static pthread_mutex_t g_lifecycle = PTHREAD_MUTEX_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void run_tasks(thread_pool *pool) {
    int i;
    while ((i = atomic_fetch_add(&pool->next_task, 1)) < pool->n_tasks) pool->fn(pool->ctx, i);
}

static void *worker_main(void *arg) {
    thread_pool *pool = arg;
    /* Not the current value: a job may already have been posted before this thread got to run. */
    unsigned seen = pool->start_generation;
    for (;;) {
        for (int spin = 0; spin < CB_SPIN_ROUNDS && atomic_load(&pool->generation) == seen; spin++) cpu_relax();
        if (atomic_load(&pool->generation) == seen) {
            pthread_mutex_lock(&pool->mutex);
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stopping))
                pthread_cond_wait(&pool->work_ready, &pool->mutex);
            pthread_mutex_unlock(&pool->mutex);
        }
        if (atomic_load(&pool->stopping)) return NULL;
        seen = atomic_load(&pool->generation);
        run_tasks(pool);
        if (atomic_fetch_sub(&pool->pending_workers, 1) == 1) {
            pthread_mutex_lock(&pool->mutex);
            pthread_cond_signal(&pool->work_done);
            pthread_mutex_unlock(&pool->mutex);
        }
    }
}

static void run_inline(int n, void (*fn)(void *ctx, int i), void *ctx) {
    for (int i = 0; i < n; i++) fn(ctx, i);
}

typedef struct {
    void (*fn)(void *ctx, int r0, int r1);
    void *ctx;
    int rows, chunk;
} rows_job;

static void rows_chunk(void *ctx, int i) {
    const rows_job *j = ctx;
    int r0 = i * j->chunk, r1 = r0 + j->chunk < j->rows ? r0 + j->chunk : j->rows;
    j->fn(j->ctx, r0, r1);
}

void cb_parallel_rows(int rows, size_t work, void (*fn)(void *ctx, int r0, int r1), void *ctx) {
    if (rows <= 0) return;
    int threads = cb_threads_count();
    if (threads <= 1 || work < 32768) {
        fn(ctx, 0, rows);
        return;
    }
    int tasks = threads * 4;
    rows_job j = {fn, ctx, rows, (rows + tasks - 1) / tasks};
    if (j.chunk < 4) j.chunk = 4;
    cb_parallel_for((rows + j.chunk - 1) / j.chunk, rows_chunk, &j);
}

void cb_parallel_for(int n, void (*fn)(void *ctx, int i), void *ctx) {
    thread_pool *pool = &g_pool;
    if (n <= 0) return;
    if (n == 1 || pool->n_workers == 0 || atomic_flag_test_and_set(&pool->busy)) {
        /* A single task, no pool, or called from inside a job (or from a second thread): run here. */
        run_inline(n, fn, ctx);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_tasks = n;
    atomic_store(&pool->next_task, 0);
    atomic_store(&pool->pending_workers, pool->n_workers);
    pthread_mutex_lock(&pool->mutex);
    atomic_fetch_add(&pool->generation, 1);
    pthread_cond_broadcast(&pool->work_ready);
    pthread_mutex_unlock(&pool->mutex);

    run_tasks(pool);

    for (int spin = 0; spin < CB_SPIN_ROUNDS && atomic_load(&pool->pending_workers) > 0; spin++) cpu_relax();
    if (atomic_load(&pool->pending_workers) > 0) {
        pthread_mutex_lock(&pool->mutex);
        while (atomic_load(&pool->pending_workers) > 0) pthread_cond_wait(&pool->work_done, &pool->mutex);
        pthread_mutex_unlock(&pool->mutex);
    }
    atomic_flag_clear(&pool->busy);
}

static void stop_workers(thread_pool *pool) {
    pthread_mutex_lock(&pool->mutex);
    atomic_store(&pool->stopping, 1);
    pthread_cond_broadcast(&pool->work_ready);
    pthread_mutex_unlock(&pool->mutex);
    for (int i = 0; i < pool->started; i++) pthread_join(pool->workers[i], NULL);
    free(pool->workers);
    pool->workers = NULL;
    pool->n_workers = 0;
    pool->started = 0;
    atomic_store(&pool->stopping, 0);
}

/* ---- physical core count --------------------------------------------------------------------------------------- */

static int read_line(const char *path, char *buf, size_t size) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char *ok = fgets(buf, (int)size, f);
    fclose(f);
    if (!ok) return -1;
    buf[strcspn(buf, "\n")] = '\0';
    return 0;
}

/* SMT siblings share a core's FMA units, and oversubscribing them was measured to cost 2.3x: count each core
 * once, among the CPUs this process may run on (a container's cpuset, taskset). */
static int physical_cores(void) {
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (online < 1) online = 1;
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    int have_mask = sched_getaffinity(0, sizeof allowed, &allowed) == 0;
    enum { MAX_CORES = 1024, ID_LEN = 64 };
    char (*seen)[ID_LEN] = calloc(MAX_CORES, ID_LEN);
    if (!seen) return (int)online;
    int cores = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE && cores < MAX_CORES; cpu++) {
        if (have_mask && !CPU_ISSET(cpu, &allowed)) continue;
        char path[128], siblings[ID_LEN];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/core_cpus_list", cpu);
        if (read_line(path, siblings, sizeof siblings) != 0) {
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list", cpu);
            if (read_line(path, siblings, sizeof siblings) != 0) continue;
        }
        int known = 0;
        for (int k = 0; k < cores && !known; k++) known = strcmp(seen[k], siblings) == 0;
        if (!known) memcpy(seen[cores++], siblings, ID_LEN);
    }
    free(seen);
    if (cores == 0) {
        /* No sysfs topology (not Linux, or hidden): fall back to the CPUs we may use. */
        int usable = have_mask ? CPU_COUNT(&allowed) : (int)online;
        return usable > 0 ? usable : 1;
    }
    return cores;
}

/* ---- public API ------------------------------------------------------------------------------------------------ */

int cb_threads_init(int n_threads) {
    pthread_mutex_lock(&g_lifecycle);
    thread_pool *pool = &g_pool;
    if (pool->started) stop_workers(pool);
    if (n_threads <= 0) n_threads = physical_cores();
    int rc = 0;
    if (n_threads > 1) {
        pool->start_generation = atomic_load(&pool->generation);
        pool->workers = calloc((size_t)n_threads - 1, sizeof *pool->workers);
        if (!pool->workers) {
            rc = -1;
        } else {
            for (int i = 0; i < n_threads - 1; i++) {
                if (pthread_create(&pool->workers[i], NULL, worker_main, pool) != 0) {
                    rc = -1;
                    break;
                }
                pool->started++;
            }
            if (rc != 0) stop_workers(pool);
            else pool->n_workers = n_threads - 1;
        }
    }
    pthread_mutex_unlock(&g_lifecycle);
    return rc;
}

int cb_threads_count(void) { return g_pool.n_workers + 1; }

void cb_threads_shutdown(void) {
    pthread_mutex_lock(&g_lifecycle);
    if (g_pool.started) stop_workers(&g_pool);
    pthread_mutex_unlock(&g_lifecycle);
}
