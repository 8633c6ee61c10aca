/* y = x W^T (+ b) for steps of up to a few dozen rows of x (fp32): the weight matmuls of
 * decode steps.
 *
 * At these row counts a linear reads each weight once and does little with it; oneDNN's
 * kernels, tuned for wider batches, stream the weight at about half the machine's
 * bandwidth at one row and reach 30-60 % of the fp32 peak at 8-32 rows (BENCHMARKS.md).
 * This kernel reads the weight in panels of 16 output columns laid out k-major, so a
 * panel streams front to back:
 *
 * - w_panels [ceil(n / 16)][k][16]: panel p holds weight rows 16p..16p+15 (zeros past n),
 *   element [p][kk][c] = W[16p + c][kk] (built once by cpu_native.to_panels).
 * - Threads split the panels. For each group of up to 6 rows of x, a tile keeps the
 *   6 x 16 outputs in 12 vector registers; each k broadcasts one value of each row of x
 *   against the panel's 16 values at k (the shape of BLIS's AVX2 micro-kernel). The
 *   panel (k x 64 bytes) stays in L1/L2 while the row groups pass over it.
 *
 * Layouts (elements): x rows of k floats, x_stride apart; out rows of n floats,
 * out_stride apart; bias [n] or NULL. Built with the other kernels by cpu_native.py.
 */
#include <omp.h>
#include <stdint.h>

#include "cpu_decode.h"
#include "cpu_vec.h"

int64_t kvray_linear_num_panels(int64_t n, int kind);
/* int8 weights (cpu_linear_q8.c): `kind` 2 (fp32 x and out) and 3 (bf16) beside 0 and 1;
 * grouped low-bit codes (cpu_linear_qg.c): 4 and 5 */
#define KIND_I8 2
#define KIND_Q 4
#define ITEM_PANELS_Q 8 /* an item of grouped codes quantizes its rows: several panels share that */
int64_t kvray_rows_q_bytes(int64_t m, int64_t k, int group);
int kvray_linear_q_group(const void *w);
void kvray_linear_q_quantize(int bf16_x, const void *x, int64_t x_stride, const void *w, int64_t m, int64_t k,
                             void *buffer);
void kvray_linear_q_panels(int bf16_io, const void *quantized, const void *w, const void *bias, void *out,
                           int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t p0, int64_t p1);
void kvray_linear_q_item(int bf16_io, const void *x, int64_t x_stride, const void *w, const void *bias, void *out,
                         int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t p0, int64_t p1);
int64_t kvray_linear_streams_i8(void);
void kvray_linear_panels_i8(int bf16_io, const void *x, int64_t x_stride, const void *w_panels, const void *bias,
                            void *out, int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t p0, int64_t p1);

#define PANEL 16   /* output columns of a panel: two vectors */
#define MAX_ROWS 6 /* rows of x a tile covers: 12 accumulators of AVX2's 16 registers */

static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, const float *panel,
                                                       int64_t k, float *out, int64_t out_stride,
                                                       const float *bias, int cols, const int rows,
                                                       const char *ahead, int64_t ahead_bytes) {
    v8 acc[MAX_ROWS][2];
    for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = (v8){0};
    /* the prefetch's bytes a k step, in 1/65536ths: a division in the loop (kk * bytes / k)
     * was a 64-bit `idiv` every k step, 15-45 cycles on a Zen 2, beside 12 FMAs: a 32-row
     * step's matmuls there ran at 59 GFLOP/s, 164 without it (BENCHMARKS.md) */
    const int64_t step = ahead ? (ahead_bytes << 16) / k : 0;
    for (int64_t kk = 0; kk < k; kk++) {
        const v8 lo = load8(panel + kk * PANEL), hi = load8(panel + kk * PANEL + 8);
        if (ahead) prefetch_l2(ahead + ((kk * step) >> 16)); /* at most a line a step */
        for (int i = 0; i < rows; i++) {
            const float xv = x[i * x_stride + kk];
            const v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};
            acc[i][0] += xb * lo;
            acc[i][1] += xb * hi;
        }
    }
    const int whole = cols == PANEL && bias != 0; /* a full panel's bias adds as two vectors */
    const v8 b_lo = whole ? load8(bias) : (v8){0}, b_hi = whole ? load8(bias + 8) : (v8){0};
    for (int i = 0; i < rows; i++) {
        float *o = out + i * out_stride;
        if (cols == PANEL) {
            const v8 lo = acc[i][0] + b_lo, hi = acc[i][1] + b_hi;
            store8(o, lo);
            store8(o + 8, hi);
        } else {
            for (int c = 0; c < cols; c++) {
                o[c] = (c < 8 ? acc[i][0][c] : acc[i][1][c - 8]) + (bias ? bias[c] : 0.0f);
            }
        }
    }
}

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *, int,
                        const char *, int64_t);

#define TILE(ROWS)                                                                                           \
    static void tile_##ROWS(const float *x, int64_t xs, const float *panel, int64_t k, float *out, int64_t os, \
                            const float *bias, int cols, const char *ahead, int64_t bytes) {                \
        tile(x, xs, panel, k, out, os, bias, cols, ROWS, ahead, bytes);                                      \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
static const tile_fn TILES[MAX_ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

/* One row of x over `streams` (up to STREAMS_F32) neighbouring panels at once, each
 * panel's sums as tile() makes them (the same bits): at one row a single stream leaves one
 * core too few lines in flight (as tile_bf16_streams below) */
#define STREAMS_F32 6 /* 12 accumulators: AVX2 has 16 registers */
static inline __attribute__((always_inline)) void tile_f32_streams(const float *x, const float *panel, int64_t k,
                                                                   float *out, const float *bias, int64_t cols_left,
                                                                   const int streams) {
    v8 acc[STREAMS_F32][2];
    for (int s = 0; s < streams; s++) acc[s][0] = acc[s][1] = (v8){0};
    for (int64_t kk = 0; kk < k; kk++) {
        const float xv = x[kk];
        const v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};
        for (int s = 0; s < streams; s++) {
            const float *w = panel + (s * k + kk) * PANEL;
            acc[s][0] += xb * load8(w);
            acc[s][1] += xb * load8(w + 8);
        }
    }
    for (int s = 0; s < streams; s++) {
        const int64_t left = cols_left - s * PANEL;
        const float *b = bias ? bias + s * PANEL : 0;
        float *o = out + s * PANEL;
        if (left >= PANEL) {
            store8(o, acc[s][0] + (b ? load8(b) : (v8){0}));
            store8(o + 8, acc[s][1] + (b ? load8(b + 8) : (v8){0}));
        } else {
            for (int c = 0; c < left; c++) o[c] = (c < 8 ? acc[s][0][c] : acc[s][1][c - 8]) + (b ? b[c] : 0.0f);
        }
    }
}

typedef void (*streams_f32_fn)(const float *, const float *, int64_t, float *, const float *, int64_t);
#define STREAMS_F(S)                                                                                           \
    static void streams_f32_##S(const float *x, const float *panel, int64_t k, float *out, const float *bias, \
                                int64_t cols_left) {                                                          \
        tile_f32_streams(x, panel, k, out, bias, cols_left, S);                                               \
    }
STREAMS_F(2) STREAMS_F(3) STREAMS_F(4) STREAMS_F(5) STREAMS_F(6)
static const streams_f32_fn STREAMS_F32_FNS[STREAMS_F32 + 1] = {0, 0, streams_f32_2, streams_f32_3,
                                                                streams_f32_4, streams_f32_5, streams_f32_6};

/* m rows shared evenly among the fewest tiles of at most `most` rows (9 rows of 8-row tiles:
 * 5 + 4, not 8 + 1) */
static int64_t rows_per_tile(int64_t m, int64_t most) {
    const int64_t tiles = (m + most - 1) / most;
    return (m + tiles - 1) / tiles;
}

/* Panel p of out = x W^T (+ b), for all m rows */
void kvray_linear_panel_f32(const float *x, int64_t x_stride, const float *w_panels, const float *bias, float *out,
                            int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t p) {
    const int cols = n - p * PANEL < PANEL ? (int)(n - p * PANEL) : PANEL;
    const float *b = bias ? bias + p * PANEL : 0;
    /* rows shared evenly among the fewest tiles (8 rows: 4 + 4, not 6 + 2: a 2-row tile
     * waits on its FMAs' latency), and every tile prefetches a share of the next panel, the
     * first included (as the bf16 panels below): at 2-12 rows on a Zen 2, 30 layers' weights
     * streamed at 13-18 GB/s with only the later tiles prefetching, 19-23 with all */
    const int64_t panel_bytes = k * PANEL * (int64_t)sizeof(float);
    const int64_t per_tile = rows_per_tile(m, MAX_ROWS), tiles = (m + per_tile - 1) / per_tile;
    const char *next = p + 1 < kvray_linear_num_panels(n, 0) ? (const char *)(w_panels + (p + 1) * k * PANEL) : 0;
    for (int64_t r = 0, t = 0; r < m; r += per_tile, t++) {
        const int rows = m - r < per_tile ? (int)(m - r) : (int)per_tile;
        const char *ahead = next ? next + t * panel_bytes / tiles : 0;
        TILES[rows](x + r * x_stride, x_stride, w_panels + p * k * PANEL, k, out + r * out_stride + p * PANEL,
                    out_stride, b, cols, ahead, panel_bytes / tiles);
    }
}

/* The same in bf16: x, the weight, the bias and out in bf16, the sums in fp32.
 *
 * - w_panels [ceil(n / 32)][k / 2][32][2] (k even): panel p holds weight rows 32p..32p+31,
 *   element [p][j][c][e] = W[32p + c][2j + e], so one k pair of a panel is 64 values, two
 *   512-bit vectors of 16 (column, pair) lanes: AVX512-BF16's `vdpbf16ps` multiplies a
 *   lane's pair by the same pair of x (broadcast) and adds both products to that column's
 *   fp32 sum (cpu_native.to_panels_bf16 builds it).
 * - For each group of up to 8 rows of x, 16 accumulators hold the 8 x 32 sums; out is
 *   the sum plus the bias, rounded to bf16 once. Each sum runs over k in order in one
 *   accumulator for any number of rows, so a row's result is the same in a step of 1 row
 *   or of 20 (batch-invariant: speculation's verified tokens equal plain decoding's). One
 *   accumulator per sum costs nothing at 1-5 rows: the weight streams from DRAM slower
 *   than the adds' latency (BENCHMARKS.md, speculative decoding).
 * Without AVX512-BF16 the same sums run in portable C (for tests on other CPUs: dtype
 * "auto" picks bf16 only where the CPU multiplies it natively).
 */
#define PANEL_BF16 32
#define MAX_ROWS_BF16 8

/* out[i][c] = sums[i][c] + bias[c], rounded, for the tile's rows and the panel's columns */
static inline void store_tile_bf16(const float *sums, int rows, int cols, const bf16 *bias, bf16 *out,
                                   int64_t out_stride) {
    for (int i = 0; i < rows; i++) {
        const float *s = sums + i * PANEL_BF16;
        bf16 *o = out + i * out_stride;
        if (cols == PANEL_BF16) {
            for (int c = 0; c < PANEL_BF16; c += 8) {
                v8 v = load8(s + c);
                if (bias) v += load8_bf16(bias + c);
                store8_bf16(o + c, v);
            }
        } else {
            for (int c = 0; c < cols; c++) o[c] = f32_to_bf16(s[c] + (bias ? bf16_to_f32(bias[c]) : 0.0f));
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

static inline __attribute__((always_inline)) void tile_bf16(const bf16 *x, int64_t x_stride, const bf16 *panel,
                                                            int64_t pairs, bf16 *out, int64_t out_stride,
                                                            const bf16 *bias, int cols, const int rows,
                                                            const char *ahead, int64_t ahead_bytes) {
    /* one fp32 sum per output, over k in order, whatever the tile's rows: a row's result
     * does not depend on how many rows the step has (a decode step's token and the same
     * token among a verification's drafts round alike) */
    __m512 acc[MAX_ROWS_BF16][2];
    for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const int64_t step = ahead ? (ahead_bytes << 16) / pairs : 0; /* bytes a pair, 1/65536ths (as tile) */
    for (int64_t j = 0; j < pairs; j++) {
        const bf16 *w = panel + j * 2 * PANEL_BF16;
        const __m512bh lo = (__m512bh)_mm512_loadu_si512(w), hi = (__m512bh)_mm512_loadu_si512(w + PANEL_BF16);
        if (ahead) { /* this tile's share of the next panel: at most 128 bytes a pair */
            const char *a = ahead + ((j * step) >> 16);
            prefetch_l2(a);
            if (ahead_bytes > 64 * pairs) prefetch_l2(a + 64);
        }
        for (int i = 0; i < rows; i++) {
            int32_t pair;
            memcpy(&pair, x + i * x_stride + 2 * j, sizeof(pair));
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, lo);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, hi);
        }
    }
    float sums[MAX_ROWS_BF16 * PANEL_BF16];
    for (int i = 0; i < rows; i++) {
        _mm512_storeu_ps(sums + i * PANEL_BF16, acc[i][0]);
        _mm512_storeu_ps(sums + i * PANEL_BF16 + 16, acc[i][1]);
    }
    store_tile_bf16(sums, rows, cols, bias, out, out_stride);
}
#else
static inline __attribute__((always_inline)) void tile_bf16(const bf16 *x, int64_t x_stride, const bf16 *panel,
                                                            int64_t pairs, bf16 *out, int64_t out_stride,
                                                            const bf16 *bias, int cols, const int rows,
                                                            const char *ahead, int64_t ahead_bytes) {
    (void)ahead;
    (void)ahead_bytes;
    float sums[MAX_ROWS_BF16 * PANEL_BF16] = {0};
    for (int64_t j = 0; j < pairs; j++) {
        const bf16 *w = panel + j * 2 * PANEL_BF16;
        for (int i = 0; i < rows; i++) {
            const float x0 = bf16_to_f32(x[i * x_stride + 2 * j]), x1 = bf16_to_f32(x[i * x_stride + 2 * j + 1]);
            for (int c = 0; c < PANEL_BF16; c++)
                sums[i * PANEL_BF16 + c] += x0 * bf16_to_f32(w[2 * c]) + x1 * bf16_to_f32(w[2 * c + 1]);
        }
    }
    store_tile_bf16(sums, rows, cols, bias, out, out_stride);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* One row of x over `streams` (up to STREAMS_BF16) neighbouring panels at once, each panel's
 * sums as tile_bf16 makes them (one accumulator per sum, over k in order: the same bits).
 * At one row a tile does little with each line it reads, and one core reading a single
 * stream keeps too few lines in flight: reading 8 panels side by side, a SmolLM2 decode
 * step's layers at one row took 6.1 -> 5.3 ms on a Zen 4 (BENCHMARKS.md, single stream).
 * At 2-4 rows it gained nothing there, so only one row takes it. Each stream also asks for
 * its lines STREAM_AHEAD bytes ahead, into L2 (6.2 -> 6.0 ms, and 5.0 -> 4.7 where the VM's
 * memory was fast; 512 or 2048 bytes ahead did less). Three side by side beat eight (likely: the
 * items smaller, the threads' shares more even, fewer prefetches competing for the core's
 * miss buffers): a 1-row step 5.58 -> 5.31 ms where memory read fast, 7.13 -> 6.84 where
 * it read slow (ABBA, each pair bucketed by the bandwidth around it); 2 streams 4 % slower
 * than 3, 4 streams 1 % (BENCHMARKS.md, single stream). */
#define STREAMS_BF16 3
#define STREAM_AHEAD 1024 /* bytes: how far ahead of its reads a stream prefetches */
static inline __attribute__((always_inline)) void tile_bf16_streams(const bf16 *x, const bf16 *panel, int64_t pairs,
                                                                    bf16 *out, const bf16 *bias, int64_t cols_left,
                                                                    const int streams) {
    __m512 acc[STREAMS_BF16][2];
    const int64_t stride = pairs * 2 * PANEL_BF16; /* between panels (elements) */
    for (int s = 0; s < streams; s++) acc[s][0] = acc[s][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j++) {
        int32_t pair;
        memcpy(&pair, x + 2 * j, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        for (int s = 0; s < streams; s++) {
            const bf16 *w = panel + s * stride + j * 2 * PANEL_BF16;
            if (!(j & 1)) /* the 256 bytes this stream reads in the next two pairs, STREAM_AHEAD on */
                for (int line = 0; line < 4; line++) prefetch_l2((const char *)w + STREAM_AHEAD + 64 * line);
            acc[s][0] = _mm512_dpbf16_ps(acc[s][0], xb, (__m512bh)_mm512_loadu_si512(w));
            acc[s][1] = _mm512_dpbf16_ps(acc[s][1], xb, (__m512bh)_mm512_loadu_si512(w + PANEL_BF16));
        }
    }
    for (int s = 0; s < streams; s++) {
        float sums[PANEL_BF16];
        _mm512_storeu_ps(sums, acc[s][0]);
        _mm512_storeu_ps(sums + 16, acc[s][1]);
        const int64_t left = cols_left - s * PANEL_BF16;
        store_tile_bf16(sums, 1, left < PANEL_BF16 ? (int)left : PANEL_BF16, bias ? bias + s * PANEL_BF16 : 0,
                        out + s * PANEL_BF16, 0);
    }
}

typedef void (*streams_bf16_fn)(const bf16 *, const bf16 *, int64_t, bf16 *, const bf16 *, int64_t);
#define STREAMS(S)                                                                                          \
    static void streams_bf16_##S(const bf16 *x, const bf16 *panel, int64_t pairs, bf16 *out, const bf16 *bias, \
                                 int64_t cols_left) {                                                      \
        tile_bf16_streams(x, panel, pairs, out, bias, cols_left, S);                                       \
    }
STREAMS(2) STREAMS(3)
static const streams_bf16_fn STREAMS_BF16_FNS[STREAMS_BF16 + 1] = {0, 0, streams_bf16_2, streams_bf16_3};
#define HAS_STREAMS_BF16 1
#define STREAMS_MAX_BF16 STREAMS_BF16
#else
#define HAS_STREAMS_BF16 0
#define STREAMS_MAX_BF16 1
#endif

typedef void (*tile_bf16_fn)(const bf16 *, int64_t, const bf16 *, int64_t, bf16 *, int64_t, const bf16 *, int,
                             const char *, int64_t);

#define TILE_BF16(ROWS)                                                                                   \
    static void tile_bf16_##ROWS(const bf16 *x, int64_t xs, const bf16 *panel, int64_t pairs, bf16 *out,   \
                                 int64_t os, const bf16 *bias, int cols, const char *ahead, int64_t bytes) { \
        tile_bf16(x, xs, panel, pairs, out, os, bias, cols, ROWS, ahead, bytes);                           \
    }
TILE_BF16(1) TILE_BF16(2) TILE_BF16(3) TILE_BF16(4) TILE_BF16(5) TILE_BF16(6) TILE_BF16(7) TILE_BF16(8)
static const tile_bf16_fn TILES_BF16[MAX_ROWS_BF16 + 1] = {0,           tile_bf16_1, tile_bf16_2,
                                                           tile_bf16_3, tile_bf16_4, tile_bf16_5,
                                                           tile_bf16_6, tile_bf16_7, tile_bf16_8};

void kvray_linear_panel_bf16(const bf16 *x, int64_t x_stride, const bf16 *w_panels, const bf16 *bias, bf16 *out,
                             int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t p) {
    const int64_t per_tile = rows_per_tile(m, MAX_ROWS_BF16);
    const int cols = n - p * PANEL_BF16 < PANEL_BF16 ? (int)(n - p * PANEL_BF16) : PANEL_BF16;
    const bf16 *b = bias ? bias + p * PANEL_BF16 : 0;
    /* One tile streams the panel from memory, its compute hidden under the stream. Where
     * there are several, every tile prefetches a share of the next panel while it works,
     * so the next panel's tiles find it in cache and memory stays busy throughout: the
     * first tile included (16 rows, 8 + 8: 10.6 -> 9.7 ms a SmolLM2 decode step through
     * every layer against only the later tiles prefetching; 9 rows 9.8 -> 7.2 ms). The
     * prefetches go to L2 (cpu_vec.h: on a Zen 4, 9 rows 12.6 -> 10.6 ms, 12 rows 14.6 ->
     * 13.1). */
    const int64_t panel_bytes = k * PANEL_BF16 * (int64_t)sizeof(bf16);
    const int64_t tiles = (m + per_tile - 1) / per_tile;
    const int64_t sharing = tiles > 1 ? tiles : 0; /* the tiles that prefetch, a share each */
    const char *next = p + 1 < kvray_linear_num_panels(n, 1) ? (const char *)(w_panels + (p + 1) * k * PANEL_BF16) : 0;
    for (int64_t r = 0, t = 0; r < m; r += per_tile, t++) {
        const int rows = m - r < per_tile ? (int)(m - r) : (int)per_tile;
        const char *ahead = sharing && next ? next + t * panel_bytes / sharing : 0;
        TILES_BF16[rows](x + r * x_stride, x_stride, w_panels + p * k * PANEL_BF16, k / 2,
                         out + r * out_stride + p * PANEL_BF16, out_stride, b, cols, ahead,
                         sharing ? panel_bytes / sharing : 0);
    }
}

/* A linear's items, each a range of neighbouring panels: one panel each, but for one row,
 * where an item is up to STREAMS_BF16 (bf16) or STREAMS_F32 panels read side by side
 * (tile_bf16_streams, tile_f32_streams), their number a multiple of the threads so that
 * the threads get even shares. */
int64_t kvray_linear_items(int64_t n, int64_t m, int kind, int32_t num_threads) {
    const int64_t panels = kvray_linear_num_panels(n, kind);
    if (kind >= KIND_Q) { /* any rows: ITEM_PANELS_Q panels an item, the threads' shares even */
        const int64_t threads = num_threads > 0 ? num_threads : 1;
        int64_t items = (panels + ITEM_PANELS_Q - 1) / ITEM_PANELS_Q;
        items = (items + threads - 1) / threads * threads;
        return items < panels ? items : panels;
    }
    const int64_t streams = kind >= KIND_I8 ? kvray_linear_streams_i8()
                            : kind          ? (HAS_STREAMS_BF16 ? STREAMS_MAX_BF16 : 1)
                                               : STREAMS_F32;
    if (m != 1 || streams == 1) return panels;
    const int64_t threads = num_threads > 0 ? num_threads : 1;
    int64_t items = (panels + streams - 1) / streams;
    items = (items + threads - 1) / threads * threads;
    return items < panels ? items : panels;
}

/* item i of `items` (kvray_linear_items): panels [i * panels / items, (i + 1) * panels / items) */
void kvray_linear_item(int kind, const void *x, int64_t x_stride, const void *w_panels, const void *bias,
                       void *out, int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t items, int64_t i) {
    const int64_t panels = kvray_linear_num_panels(n, kind);
    const int64_t p0 = i * panels / items, p1 = (i + 1) * panels / items;
    if (kind >= KIND_Q) {
        kvray_linear_q_item(kind & 1, x, x_stride, w_panels, bias, out, out_stride, m, n, k, p0, p1);
        return;
    }
    if (kind >= KIND_I8) {
        kvray_linear_panels_i8(kind & 1, x, x_stride, w_panels, bias, out, out_stride, m, n, k, p0, p1);
        return;
    }
    if (!kind) {
        if (m == 1 && p1 - p0 > 1) {
            const float *b = bias ? (const float *)bias + p0 * PANEL : 0;
            STREAMS_F32_FNS[p1 - p0](x, (const float *)w_panels + p0 * k * PANEL, k, (float *)out + p0 * PANEL, b,
                                     n - p0 * PANEL);
            return;
        }
        for (int64_t p = p0; p < p1; p++)
            kvray_linear_panel_f32(x, x_stride, w_panels, bias, out, out_stride, m, n, k, p);
        return;
    }
#if HAS_STREAMS_BF16
    if (m == 1 && p1 - p0 > 1) {
        const bf16 *b = bias ? (const bf16 *)bias + p0 * PANEL_BF16 : 0;
        STREAMS_BF16_FNS[p1 - p0](x, (const bf16 *)w_panels + p0 * k * PANEL_BF16, k / 2,
                                  (bf16 *)out + p0 * PANEL_BF16, b, n - p0 * PANEL_BF16);
        return;
    }
#endif
    for (int64_t p = p0; p < p1; p++)
        kvray_linear_panel_bf16(x, x_stride, w_panels, bias, out, out_stride, m, n, k, p);
}

/* item i as kvray_linear_item, of grouped codes, its x quantized already (kvray_linear_q_quantize) */
void kvray_linear_item_q(int kind, const void *quantized, const void *w_panels, const void *bias, void *out,
                         int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t items, int64_t i) {
    const int64_t panels = kvray_linear_num_panels(n, kind);
    kvray_linear_q_panels(kind & 1, quantized, w_panels, bias, out, out_stride, m, n, k, i * panels / items,
                          (i + 1) * panels / items);
}

/* the panels of an n-column output (fp32 or bf16 panels) */
int64_t kvray_linear_num_panels(int64_t n, int kind) {
    return kind == 1 ? (n + PANEL_BF16 - 1) / PANEL_BF16 : (n + PANEL - 1) / PANEL; /* int8: 16 */
}

/* the output columns of a panel (the last one's may lie past n) */
int64_t kvray_linear_panel_cols(int kind) { return kind == 1 ? PANEL_BF16 : PANEL; }

/* A thread's share of a linear's items: [next, end), claimed one at a time by it and, once
 * they have run out of their own, by the other threads (a cache line each) */
typedef struct {
    int64_t next, end;
} __attribute__((aligned(64))) Claims;

/* out = x W^T (+ b), the panels shared out among the threads. Each thread takes its own
 * share's items in order (a panel prefetches the next, kernels' order as with a static
 * schedule), then helps itself to what the others have not claimed yet: where another
 * process takes a thread off its core (a served worker beside the ingress and the load
 * generator), its partner takes over the rest of its share instead of waiting for it at
 * the region's end. Each item is computed once, by whoever claims it, with the same
 * arithmetic: the result does not depend on who did what. */
static void linear(int kind, const void *x, int64_t x_stride, const void *w_panels, const void *bias, void *out,
                   int64_t out_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
    const int64_t items = kvray_linear_items(n, m, kind, num_threads);
    /* grouped codes: x quantized once here, for all the items */
    void *quantized = kind >= KIND_Q ? kvray_malloc(kvray_rows_q_bytes(m, k, kvray_linear_q_group(w_panels))) : 0;
    if (kind >= KIND_Q) {
        if (!quantized) abort();
        kvray_linear_q_quantize(kind & 1, x, x_stride, w_panels, m, k, quantized);
    }
    const int32_t teams = num_threads > 0 ? num_threads : 1;
    Claims claims[teams];
    for (int32_t t = 0; t < teams; t++) {
        claims[t].next = t * items / teams;
        claims[t].end = (t + 1) * items / teams;
    }
#pragma omp parallel num_threads(teams)
    {
        /* its own share first, then the others' (all of them: a team smaller than asked,
         * nested or under OMP_THREAD_LIMIT, still does every share) */
        const int32_t self = omp_get_thread_num();
        for (int32_t v = 0; v < teams; v++) {
            Claims *c = &claims[(self + v) % teams];
            for (int64_t i; (i = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED)) < c->end;) {
                if (quantized)
                    kvray_linear_item_q(kind, quantized, w_panels, bias, out, out_stride, m, n, k, items, i);
                else
                    kvray_linear_item(kind, x, x_stride, w_panels, bias, out, out_stride, m, n, k, items, i);
            }
        }
    }
    free(quantized);
}

void kvray_linear_f32(const float *x, int64_t x_stride, const float *w_panels, const float *bias, float *out,
                      int64_t out_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
    linear(0, x, x_stride, w_panels, bias, out, out_stride, m, n, k, num_threads);
}

void kvray_linear_bf16(const bf16 *x, int64_t x_stride, const bf16 *w_panels, const bf16 *bias, bf16 *out,
                       int64_t out_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
    linear(1, x, x_stride, w_panels, bias, out, out_stride, m, n, k, num_threads);
}

/* int8 panels (cpu_linear_q8.c): x, bias and out fp32 or bf16 */
void kvray_linear_i8_f32(const float *x, int64_t x_stride, const void *w_panels, const float *bias, float *out,
                         int64_t out_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
    linear(KIND_I8, x, x_stride, w_panels, bias, out, out_stride, m, n, k, num_threads);
}

void kvray_linear_i8_bf16(const bf16 *x, int64_t x_stride, const void *w_panels, const bf16 *bias, bf16 *out,
                          int64_t out_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
    linear(KIND_I8 + 1, x, x_stride, w_panels, bias, out, out_stride, m, n, k, num_threads);
}

/* grouped low-bit codes (cpu_linear_qg.c): x, bias and out fp32 or bf16 */
void kvray_linear_q_f32(const float *x, int64_t x_stride, const void *w_panels, const float *bias, float *out,
                        int64_t out_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
    linear(KIND_Q, x, x_stride, w_panels, bias, out, out_stride, m, n, k, num_threads);
}

void kvray_linear_q_bf16(const bf16 *x, int64_t x_stride, const void *w_panels, const bf16 *bias, bf16 *out,
                         int64_t out_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
    linear(KIND_Q + 1, x, x_stride, w_panels, bias, out, out_stride, m, n, k, num_threads);
}
