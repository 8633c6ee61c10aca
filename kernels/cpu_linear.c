/* y = x W^T (+ b) for a few rows of x (fp32): the weight matmuls of a small decode step.
 *
 * With one to eight rows a linear reads every weight once and does little with it, so it
 * is bound by memory bandwidth: oneDNN's and MKL's kernels, built for wider batches,
 * reach about half of it here (BENCHMARKS.md, single stream). This kernel streams the
 * dense weight rows front to back, prefetching the next tile's rows, with the rows of x
 * in L1:
 *
 * - Work is split over threads by blocks of weight rows (about 64 KiB each, which stay in
 *   L2 while every group of 4 rows of x passes over them).
 * - A tile is MR rows of x against NR weight rows, vectorised along k with U independent
 *   accumulators per pair; the tile shapes are chosen per MR to fit AVX2's 16 registers.
 *
 * Layouts (elements): x rows of k floats, x_stride apart; w [n, k] contiguous; out rows
 * of n floats, out_stride apart; bias [n] or NULL. k must be a multiple of 16 (the caller
 * checks). Built with the other kernels by kernels/cpu_native.py.
 */
#include <stdint.h>

#include "cpu_vec.h"

#define MAX_ROWS 4        /* rows of x one tile covers */
#define BLOCK_BYTES 65536 /* weight bytes a thread's block of rows holds */
#define PREFETCH_TILES 2  /* how many tiles ahead weight rows are prefetched */

static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, const float *w,
                                                       int64_t k, float *out, int64_t out_stride,
                                                       const float *bias, const int mr, const int nr,
                                                       const int u) {
    v8 acc[MAX_ROWS][4][2];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            for (int s = 0; s < u; s++) acc[i][j][s] = (v8){0};
    for (int64_t kk = 0; kk < k; kk += 8 * u) {
        if ((kk & 15) == 0)  // one prefetch per 64-byte line
            for (int j = 0; j < nr; j++) __builtin_prefetch(w + (j + PREFETCH_TILES * nr) * k + kk, 0, 0);
        for (int s = 0; s < u; s++) {
            v8 wv[4];
            for (int j = 0; j < nr; j++) wv[j] = load8(w + j * k + kk + 8 * s);
            for (int i = 0; i < mr; i++) {
                const v8 xv = load8(x + i * x_stride + kk + 8 * s);
                for (int j = 0; j < nr; j++) acc[i][j][s] += xv * wv[j];
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            v8 total = acc[i][j][0];
            for (int s = 1; s < u; s++) total += acc[i][j][s];
            out[i * out_stride + j] = sum8(total) + (bias ? bias[j] : 0.0f);
        }
}

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *);

#define TILE(MR, NR, U)                                                                                     \
    static void tile_##MR##x##NR(const float *x, int64_t xs, const float *w, int64_t k, float *out,         \
                                 int64_t os, const float *bias) {                                           \
        tile(x, xs, w, k, out, os, bias, MR, NR, U);                                                        \
    }
TILE(1, 4, 1) TILE(2, 2, 2) TILE(3, 2, 1) TILE(4, 2, 1)  // the wide tiles, by rows of x
TILE(1, 1, 2) TILE(2, 1, 2) TILE(3, 1, 2) TILE(4, 1, 2)  // one weight row: a block's tail

static const tile_fn WIDE[MAX_ROWS + 1] = {0, tile_1x4, tile_2x2, tile_3x2, tile_4x2};
static const int WIDTH[MAX_ROWS + 1] = {0, 4, 2, 2, 2};
static const tile_fn NARROW[MAX_ROWS + 1] = {0, tile_1x1, tile_2x1, tile_3x1, tile_4x1};

void kvray_linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *out,
                      int64_t out_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
    int64_t block = BLOCK_BYTES / (4 * k) / 4 * 4;
    block = block < 4 ? 4 : block;
    const int64_t blocks = (n + block - 1) / block;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t first = b * block, end = first + block < n ? first + block : n;
        for (int64_t row = 0; row < m; row += MAX_ROWS) {
            const int mr = m - row < MAX_ROWS ? (int)(m - row) : MAX_ROWS;
            const float *xr = x + row * x_stride;
            float *outr = out + row * out_stride;
            int64_t j = first;
            for (; j + WIDTH[mr] <= end; j += WIDTH[mr])
                WIDE[mr](xr, x_stride, w + j * k, k, outr + j, out_stride, bias ? bias + j : 0);
            for (; j < end; j++) NARROW[mr](xr, x_stride, w + j * k, k, outr + j, out_stride, bias ? bias + j : 0);
        }
    }
}
