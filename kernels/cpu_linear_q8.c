/* y = x W^T (+ b) with W held as int8 codes and one fp32 scale per output column: the
 * weight matmuls of `quantization="int8"` (weight-only, symmetric, per output channel).
 *
 * A decode step reads every weight once, so its speed is the bytes it reads: int8 codes
 * are half of bf16's and a quarter of fp32's. The math stays float: each code is widened
 * to fp32 (sign-extend, convert: `load8_i8`) and multiplied by x's value in fp32, summed
 * over k in order in one accumulator per output, and the sum times the column's scale is
 * the output (plus the bias); bf16 x is widened in chunks of k, bf16 out rounded once. A
 * row's result does not depend on how many rows the step has (speculation's verified
 * tokens equal plain decoding's).
 *
 * - Panel p (P = ceil(n / 16)) is PANEL_I8 * k + 64 bytes: the codes [k][16], element
 *   [kk][c] = q[16p + c][kk] (zero past n), then the 16 columns' fp32 scales (zero past n)
 *   (built once by cpu_native.to_panels_int8). A panel ends in its own scales, as an 8-bit
 *   KV row does, so one pointer per linear carries both.
 * - Tiles of up to ROWS_I8 rows keep 6 x 16 sums in 12 vector registers, as the fp32
 *   panels' tile() does, and prefetch a share of the next panel; one row reads up to
 *   STREAMS_I8 neighbouring panels side by side (more lines in flight on one core).
 * Called through cpu_linear.c's dispatch (kinds KIND_I8_F32 / KIND_I8_BF16), which shares
 * the panels out among the threads.
 */
#include <stdint.h>

#include "cpu_decode.h"
#include "cpu_vec.h"

#define PANEL_I8 16
#define ROWS_I8 6
#define CHUNK_K 256 /* bf16 x is widened this many values of k at a time (6 KB for 6 rows) */
#define STREAMS_I8 4

int64_t kvray_linear_num_panels(int64_t n, int kind);

static inline int64_t panel_bytes_i8(int64_t k) { return PANEL_I8 * k + PANEL_I8 * (int64_t)sizeof(float); }

/* x[0..len) of a row, as floats: bf16 widened into `buf`, fp32 as it is */
static inline __attribute__((always_inline)) const float *row_f32(const void *x, int bf16_x, int64_t k0,
                                                                  int64_t len, float *buf) {
    if (!bf16_x) return (const float *)x + k0;
    const bf16 *h = (const bf16 *)x + k0;
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) store8(buf + j, load8_bf16(h + j));
    for (; j < len; j++) buf[j] = bf16_to_f32(h[j]);
    return buf;
}

/* out[c] = sum[c] * scale[c] + bias[c] for `cols` columns, fp32 or rounded to bf16 */
static inline __attribute__((always_inline)) void store_i8(v8 lo, v8 hi, const float *scale, const void *bias,
                                                           void *out, int cols, int bf16_io) {
    lo *= load8(scale);
    hi *= load8(scale + 8);
    if (cols == PANEL_I8) {
        if (bias) {
            lo += bf16_io ? load8_bf16((const bf16 *)bias) : load8((const float *)bias);
            hi += bf16_io ? load8_bf16((const bf16 *)bias + 8) : load8((const float *)bias + 8);
        }
        if (bf16_io) {
            store8_bf16((bf16 *)out, lo);
            store8_bf16((bf16 *)out + 8, hi);
        } else {
            store8((float *)out, lo);
            store8((float *)out + 8, hi);
        }
        return;
    }
    for (int c = 0; c < cols; c++) {
        float v = c < 8 ? lo[c] : hi[c - 8];
        if (bias) v += bf16_io ? bf16_to_f32(((const bf16 *)bias)[c]) : ((const float *)bias)[c];
        if (bf16_io)
            ((bf16 *)out)[c] = f32_to_bf16(v);
        else
            ((float *)out)[c] = v;
    }
}

/* rows (1..ROWS_I8) of x over one panel */
static inline __attribute__((always_inline)) void tile_i8(const void *x, int64_t x_stride, const signed char *panel,
                                                          int64_t k, void *out, int64_t out_stride, const void *bias,
                                                          int cols, const int rows, const int bf16_io,
                                                          const char *ahead, int64_t ahead_bytes) {
    v8 acc[ROWS_I8][2];
    for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = (v8){0};
    float wide[ROWS_I8][CHUNK_K];
    const int64_t step = ahead ? (ahead_bytes << 16) / k : 0; /* bytes a k step, in 1/65536ths (as tile) */
    const int64_t elem = bf16_io ? (int64_t)sizeof(bf16) : (int64_t)sizeof(float);
    for (int64_t k0 = 0; k0 < k; k0 += CHUNK_K) {
        const int64_t len = k - k0 < CHUNK_K ? k - k0 : CHUNK_K;
        const float *xr[ROWS_I8];
        for (int i = 0; i < rows; i++)
            xr[i] = row_f32((const char *)x + i * x_stride * elem, bf16_io, k0, len, wide[i]);
        const signed char *w = panel + k0 * PANEL_I8;
        for (int64_t j = 0; j < len; j++) {
            const v8 lo = load8_i8(w + j * PANEL_I8), hi = load8_i8(w + j * PANEL_I8 + 8);
            if (ahead) prefetch_l2(ahead + (((k0 + j) * step) >> 16));
            for (int i = 0; i < rows; i++) {
                const float xv = xr[i][j];
                const v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};
                acc[i][0] += xb * lo;
                acc[i][1] += xb * hi;
            }
        }
    }
    const float *scale = (const float *)(panel + PANEL_I8 * k);
    for (int i = 0; i < rows; i++)
        store_i8(acc[i][0], acc[i][1], scale, bias, (char *)out + i * out_stride * elem, cols, bf16_io);
}

typedef void (*tile_i8_fn)(const void *, int64_t, const signed char *, int64_t, void *, int64_t, const void *, int,
                           const char *, int64_t);
#define TILE_I8(ROWS, BF16)                                                                                      \
    static void tile_i8_##ROWS##_##BF16(const void *x, int64_t xs, const signed char *panel, int64_t k, void *out, \
                                        int64_t os, const void *bias, int cols, const char *ahead, int64_t bytes) { \
        tile_i8(x, xs, panel, k, out, os, bias, cols, ROWS, BF16, ahead, bytes);                                 \
    }
TILE_I8(1, 0) TILE_I8(2, 0) TILE_I8(3, 0) TILE_I8(4, 0) TILE_I8(5, 0) TILE_I8(6, 0)
TILE_I8(1, 1) TILE_I8(2, 1) TILE_I8(3, 1) TILE_I8(4, 1) TILE_I8(5, 1) TILE_I8(6, 1)
static const tile_i8_fn TILES_I8[2][ROWS_I8 + 1] = {
    {0, tile_i8_1_0, tile_i8_2_0, tile_i8_3_0, tile_i8_4_0, tile_i8_5_0, tile_i8_6_0},
    {0, tile_i8_1_1, tile_i8_2_1, tile_i8_3_1, tile_i8_4_1, tile_i8_5_1, tile_i8_6_1},
};

/* one row of x over `streams` neighbouring panels at once, each panel's sums as tile_i8
 * makes them (the same bits) */
static inline __attribute__((always_inline)) void streams_i8(const void *x, const signed char *panel, int64_t k,
                                                             void *out, const void *bias, int64_t cols_left,
                                                             const int streams, const int bf16_io) {
    v8 acc[STREAMS_I8][2];
    for (int s = 0; s < streams; s++) acc[s][0] = acc[s][1] = (v8){0};
    float wide[CHUNK_K];
    const int64_t pb = panel_bytes_i8(k);
    for (int64_t k0 = 0; k0 < k; k0 += CHUNK_K) {
        const int64_t len = k - k0 < CHUNK_K ? k - k0 : CHUNK_K;
        const float *xr = row_f32(x, bf16_io, k0, len, wide);
        for (int64_t j = 0; j < len; j++) {
            const float xv = xr[j];
            const v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};
            for (int s = 0; s < streams; s++) {
                const signed char *w = panel + s * pb + (k0 + j) * PANEL_I8;
                acc[s][0] += xb * load8_i8(w);
                acc[s][1] += xb * load8_i8(w + 8);
            }
        }
    }
    const int64_t elem = bf16_io ? (int64_t)sizeof(bf16) : (int64_t)sizeof(float);
    for (int s = 0; s < streams; s++) {
        const int64_t left = cols_left - s * PANEL_I8;
        const int cols = left < PANEL_I8 ? (int)left : PANEL_I8;
        const void *b = bias ? (const char *)bias + s * PANEL_I8 * elem : 0;
        const float *scale = (const float *)(panel + s * pb + PANEL_I8 * k);
        store_i8(acc[s][0], acc[s][1], scale, b, (char *)out + s * PANEL_I8 * elem, cols, bf16_io);
    }
}

typedef void (*streams_i8_fn)(const void *, const signed char *, int64_t, void *, const void *, int64_t);
#define STREAMS_FN(S, BF16)                                                                                       \
    static void streams_i8_##S##_##BF16(const void *x, const signed char *panel, int64_t k, void *out,            \
                                        const void *bias, int64_t cols_left) {                                    \
        streams_i8(x, panel, k, out, bias, cols_left, S, BF16);                                                   \
    }
STREAMS_FN(2, 0) STREAMS_FN(3, 0) STREAMS_FN(4, 0) STREAMS_FN(2, 1) STREAMS_FN(3, 1) STREAMS_FN(4, 1)
static const streams_i8_fn STREAMS_I8_FNS[2][STREAMS_I8 + 1] = {
    {0, 0, streams_i8_2_0, streams_i8_3_0, streams_i8_4_0},
    {0, 0, streams_i8_2_1, streams_i8_3_1, streams_i8_4_1},
};

/* The panels a one-row item reads side by side (cpu_linear.c's kvray_linear_items) */
int64_t kvray_linear_streams_i8(void) { return STREAMS_I8; }

/* Panels [p0, p1) of out = x W^T (+ b), for all m rows (bf16_io: x, bias and out bf16) */
void kvray_linear_panels_i8(int bf16_io, const void *x, int64_t x_stride, const void *w_panels, const void *bias,
                            void *out, int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t p0, int64_t p1) {
    const int64_t elem = bf16_io ? (int64_t)sizeof(bf16) : (int64_t)sizeof(float);
    const int64_t pb = panel_bytes_i8(k), panels = kvray_linear_num_panels(n, 2 + bf16_io);
    const signed char *w = (const signed char *)w_panels;
    if (m == 1 && p1 - p0 > 1) {
        const void *b = bias ? (const char *)bias + p0 * PANEL_I8 * elem : 0;
        STREAMS_I8_FNS[bf16_io][p1 - p0](x, w + p0 * pb, k, (char *)out + p0 * PANEL_I8 * elem, b,
                                         n - p0 * PANEL_I8);
        return;
    }
    const int64_t tiles = (m + ROWS_I8 - 1) / ROWS_I8, per_tile = (m + tiles - 1) / tiles;
    for (int64_t p = p0; p < p1; p++) {
        const int cols = n - p * PANEL_I8 < PANEL_I8 ? (int)(n - p * PANEL_I8) : PANEL_I8;
        const void *b = bias ? (const char *)bias + p * PANEL_I8 * elem : 0;
        const char *next = p + 1 < panels ? (const char *)(w + (p + 1) * pb) : 0;
        for (int64_t r = 0, t = 0; r < m; r += per_tile, t++) {
            const int rows = m - r < per_tile ? (int)(m - r) : (int)per_tile;
            const char *ahead = next ? next + t * pb / tiles : 0;
            TILES_I8[bf16_io][rows]((const char *)x + r * x_stride * elem, x_stride, w + p * pb, k,
                                    (char *)out + (r * out_stride + p * PANEL_I8) * elem, out_stride, b, cols,
                                    ahead, pb / tiles);
        }
    }
}
