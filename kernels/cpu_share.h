/* Work sharing inside a parallel region that no straggling thread holds up.
 *
 * `#pragma omp for` ends with a barrier: every thread of the team must arrive before any
 * goes on. Where other processes share the cores (a served worker beside the ingress, the
 * HTTP proxy and the load generator on 2 cores), a thread of the team is taken off its
 * core every millisecond or two, for ~0.3 ms at a time (BENCHMARKS.md, served against
 * offline), and at each barrier the other thread spins until it is back: a fused decode
 * step has ~300 barriers, so nearly every such preemption stalls the whole team.
 *
 * Here a phase's items are claimed, a run of neighbours at a time, from a shared counter by
 * whichever thread comes, and a thread that finds them all claimed waits for them to be
 * done; if no run is done for kvray_share_redo_ns (50 us), or twice the longest run the
 * waiter did itself in the phase where that is longer, the run's holder is taken to be off
 * its core and the waiter computes the runs not yet done itself. So the phases' items must be idempotent: each a pure
 * function of buffers no later phase writes, writing an output nothing else writes (the
 * holder, when it is back, writes the same bits again). Each run's completion is a flag,
 * set once, with release order, after its writes.
 *
 *   share_init(s, items, per, num_threads);   (once, on a zeroed Share)
 *   share_run(s, item, ctx, scratch);          (every thread of the team, in the same order)
 *
 * returns when all the items are done and their writes visible to the caller. Which thread
 * computes an item changes nothing in its arithmetic: results stay deterministic and
 * batch-invariant. A Share serves one phase once (s->n zeroed flags, one a run).
 */
#ifndef KVRAY_CPU_SHARE_H
#define KVRAY_CPU_SHARE_H
#include <stdint.h>
#include <time.h>

typedef struct {
    int64_t next;   /* the next run to claim */
    int64_t done;   /* runs done (each counted once) */
    int64_t n;      /* the phase's runs */
    uint8_t *flags; /* per run: 1 once done */
    int64_t items;  /* the phase's items, */
    int64_t per;    /* claimed `per` neighbours at a time: a run */
    char pad[16];   /* a cache line per phase: neighbouring phases' counters do not share one */
} Share;

/* About this many runs a thread: few enough that claiming them costs little beside the
 * items (a row's RMSNorm is ~0.1 us, a claim and its completion move cache lines between
 * cores), and neighbours together: a matmul panel prefetches the next one
 * (kernels/cpu_linear.c), which serves the thread that reads it only in a run (one-panel
 * items, taken by the threads in turn, left every thread's own next panel cold and made a
 * decode step's matmuls ~1.5x slower). Enough to even out the threads. */
enum { SHARE_RUNS_PER_THREAD = 4 };

/* s serves `items` items in runs of `per` (0: about SHARE_RUNS_PER_THREAD runs a thread) */
static inline void share_init(Share *s, int64_t items, int64_t per, int32_t num_threads) {
    const int64_t runs = (int64_t)SHARE_RUNS_PER_THREAD * num_threads;
    s->items = items;
    s->per = per > 0 ? per : items > runs ? (items + runs - 1) / runs : 1;
    s->n = (items + s->per - 1) / s->per;
}

/* one item of a phase; `scratch`: the calling thread's own */
typedef void (*share_item)(const void *ctx, void *scratch, int64_t i);

/* no run done for this long: compute the rest here (kernels/cpu_layer.c; a test sets it
 * to 0, every waiter then computing what is not yet done) */
extern int64_t kvray_share_redo_ns;

static inline void share_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static inline int64_t share_now_ns(void) {
    struct timespec t;
    timespec_get(&t, TIME_UTC);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* the next unclaimed run, or -1 when all are claimed */
static inline int64_t share_claim(Share *s) {
    if (__atomic_load_n(&s->next, __ATOMIC_RELAXED) >= s->n) return -1;
    const int64_t i = __atomic_fetch_add(&s->next, 1, __ATOMIC_RELAXED);
    return i < s->n ? i : -1;
}

static inline void share_finish(Share *s, int64_t i) {
    uint8_t zero = 0;
    if (__atomic_compare_exchange_n(&s->flags[i], &zero, 1, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED))
        __atomic_fetch_add(&s->done, 1, __ATOMIC_RELEASE);
}

/* run r: items [r * per, (r + 1) * per) */
static inline void share_run_items(const Share *s, share_item item, const void *ctx, void *scratch, int64_t r) {
    const int64_t end = (r + 1) * s->per < s->items ? (r + 1) * s->per : s->items;
    for (int64_t i = r * s->per; i < end; i++) item(ctx, scratch, i);
}

static inline void share_run(Share *s, share_item item, const void *ctx, void *scratch) {
    const int64_t n = s->n;
    int64_t longest = 0, start = share_now_ns(); /* the longest run this thread did */
    for (int64_t i; (i = share_claim(s)) >= 0;) {
        share_run_items(s, item, ctx, scratch, i);
        share_finish(s, i);
        const int64_t end = share_now_ns();
        longest = end - start > longest ? end - start : longest;
        start = end;
    }
    int64_t seen = __atomic_load_n(&s->done, __ATOMIC_ACQUIRE);
    if (seen >= n) return;
    /* a run still going may take as long as the longest one here did: not before twice that
     * is its holder taken to be away (0: at once) */
    const int64_t patience = kvray_share_redo_ns && 2 * longest > kvray_share_redo_ns ? 2 * longest
                                                                                       : kvray_share_redo_ns;
    int64_t since = share_now_ns();
    for (int spins = 1;; spins++) {
        const int64_t done = __atomic_load_n(&s->done, __ATOMIC_ACQUIRE);
        if (done >= n) return;
        share_relax();
        if (spins % 32) continue;
        const int64_t now = share_now_ns();
        if (done != seen) {
            seen = done;
            since = now;
        } else if (now - since > patience) {
            break;
        }
    }
    for (int64_t i = 0; i < n; i++) /* the holders are away: their runs, here */
        if (!__atomic_load_n(&s->flags[i], __ATOMIC_ACQUIRE)) {
            share_run_items(s, item, ctx, scratch, i);
            share_finish(s, i);
        }
}
#endif
