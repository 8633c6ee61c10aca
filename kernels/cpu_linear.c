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
#include <stdint.h>

#include "cpu_vec.h"

#define PANEL 16   /* output columns of a panel: two vectors */
#define MAX_ROWS 6 /* rows of x a tile covers: 12 accumulators of AVX2's 16 registers */

static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, const float *panel,
                                                       int64_t k, float *out, int64_t out_stride,
                                                       const float *bias, int cols, const int rows) {
    v8 acc[MAX_ROWS][2];
    for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = (v8){0};
    for (int64_t kk = 0; kk < k; kk++) {
        const v8 lo = load8(panel + kk * PANEL), hi = load8(panel + kk * PANEL + 8);
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
            store8(o, acc[i][0] + b_lo);
            store8(o + 8, acc[i][1] + b_hi);
        } else {
            for (int c = 0; c < cols; c++) o[c] = (c < 8 ? acc[i][0][c] : acc[i][1][c - 8]) + (bias ? bias[c] : 0.0f);
        }
    }
}

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, const float *, int);

#define TILE(ROWS)                                                                                           \
    static void tile_##ROWS(const float *x, int64_t xs, const float *panel, int64_t k, float *out, int64_t os, \
                            const float *bias, int cols) {                                                  \
        tile(x, xs, panel, k, out, os, bias, cols, ROWS);                                                    \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
static const tile_fn TILES[MAX_ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

void kvray_linear_f32(const float *x, int64_t x_stride, const float *w_panels, const float *bias, float *out,
                      int64_t out_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int cols = n - p * PANEL < PANEL ? (int)(n - p * PANEL) : PANEL;
        const float *b = bias ? bias + p * PANEL : 0;
        for (int64_t r = 0; r < m; r += MAX_ROWS) {
            const int rows = m - r < MAX_ROWS ? (int)(m - r) : MAX_ROWS;
            TILES[rows](x + r * x_stride, x_stride, w_panels + p * k * PANEL, k, out + r * out_stride + p * PANEL,
                        out_stride, b, cols);
        }
    }
}
