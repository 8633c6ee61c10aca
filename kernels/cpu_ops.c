/* The small per-layer operations of a Llama step on a CPU (fp32 or bf16), one pass each,
 * where torch runs four to eight separate ops (each a pass over memory plus a dispatch):
 *
 *   kvray_rms_norm_f32      out = x / rms(x) * weight; with `residual`, first
 *                           residual_out = x + residual and the norm is of that sum
 *   kvray_rotary_f32        Hugging Face's "rotate half" RoPE, in place, on the head
 *                           rows of q and k inside the fused qkv projection's output
 *   kvray_silu_mul_row_f32  one row of silu(g) * u, for the fused decode layers
 *
 * Rows are `dim` contiguous floats, `stride` floats apart. The math follows HF's
 * LlamaRMSNorm (mean of squares in fp32, then rsqrt) and apply_rotary_pos_emb.
 *
 * The _bf16 versions take and give bf16 rows (the weight too; the RoPE tables stay fp32)
 * and compute in fp32. The norm rounds where Hugging Face's bf16 LlamaRMSNorm does: the
 * residual sum, the normalised row before the weight, and the product; RoPE rounds once.
 * Built with kernels/cpu_decode.c by kernels/cpu_native.py.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_decode.h"
#include "cpu_vec.h"

/* One row of each, for the loops below and the fused decode layers (kernels/cpu_layer.c). */

/* the residual stream's add: out = a + b (in bf16, rounded once) */
void kvray_add_row_f32(const float *a, const float *b, float *out, int64_t dim) {
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = a[i] + b[i];
}

void kvray_add_row_bf16(const bf16 *a, const bf16 *b, bf16 *out, int64_t dim) {
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) store8_bf16(out + i, load8_bf16(a + i) + load8_bf16(b + i));
    for (; i < dim; i++) out[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

void kvray_rms_row_f32(const float *src, const float *res, float *sum, float *out, const float *weight, int64_t dim,
                       float eps) {
    if (res != 0) {  // the residual stream goes on as x + residual
        kvray_add_row_f32(src, res, sum, dim);
        src = sum;
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < dim; i++) squares += src[i] * src[i];
    const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = weight[i] * (src[i] * inv);
}

void kvray_rms_row_bf16(const bf16 *src, const bf16 *res, bf16 *sum, bf16 *out, const bf16 *weight, int64_t dim,
                        float eps) {
    if (res != 0) {  // the residual stream goes on as bf16(x + residual)
        kvray_add_row_bf16(src, res, sum, dim);
        src = sum;
    }
    int64_t i;
    v8 squares8 = {0};
    for (i = 0; i + 8 <= dim; i += 8) {
        const v8 v = load8_bf16(src + i);
        squares8 += v * v;
    }
    float squares = sum8(squares8);
    for (; i < dim; i++) squares += bf16_to_f32(src[i]) * bf16_to_f32(src[i]);
    const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
    for (i = 0; i + 8 <= dim; i += 8)  // weight * bf16(x * inv), rounded
        store8_bf16(out + i, load8_bf16(weight + i) * round8_bf16(load8_bf16(src + i) * inv));
    for (; i < dim; i++)
        out[i] = f32_to_bf16(bf16_to_f32(weight[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(src[i]) * inv)));
}

/* RoPE on a row's heads: dst = rotate(src), in place where dst == src (each pair is read
 * before it is written) */
void kvray_rotary_row_f32(const float *src, float *dst, int64_t num_heads, int64_t head_dim, const float *c,
                          const float *s) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        const float *x1 = src + h * head_dim, *x2 = x1 + half;
        float *y1 = dst + h * head_dim, *y2 = y1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i];
            y1[i] = a * c[i] - b * s[i];
            y2[i] = b * c[i] + a * s[i];
        }
    }
}

void kvray_rotary_row_bf16(const bf16 *src, bf16 *dst, int64_t num_heads, int64_t head_dim, const float *c,
                           const float *s) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; h++) {
        const bf16 *x1 = src + h * head_dim, *x2 = x1 + half;
        bf16 *y1 = dst + h * head_dim, *y2 = y1 + half;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
            const v8 a = load8_bf16(x1 + i), b = load8_bf16(x2 + i), ci = load8(c + i), si = load8(s + i);
            store8_bf16(y1 + i, a * ci - b * si);
            store8_bf16(y2 + i, b * ci + a * si);
        }
        for (; i < half; i++) {
            const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
            y1[i] = f32_to_bf16(a * c[i] - b * s[i]);
            y2[i] = f32_to_bf16(b * c[i] + a * s[i]);
        }
    }
}

/* out = silu(g) * u over n values; in bf16 silu(g) is rounded before the product, as torch
 * rounds F.silu's result. SiLU uses the kernels' own exp (cpu_vec.h), within an ulp of
 * torch's. (Over a prompt step's rows torch's two ops are faster: 185 us against 269 at
 * 512 x 1,536 bf16 on a Zen 5, so the MLP module keeps them.) */
void kvray_silu_mul_row_f32(const float *g, const float *u, float *out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) store16(out + i, silu16(load16(g + i)) * load16(u + i));
#endif
    for (; i + 8 <= n; i += 8) store8(out + i, silu8(load8(g + i)) * load8(u + i));
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void kvray_silu_mul_row_bf16(const bf16 *g, const bf16 *u, bf16 *out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
        store16_bf16(out + i, round16_bf16(silu16(load16_bf16(g + i))) * load16_bf16(u + i));
#endif
    for (; i + 8 <= n; i += 8) store8_bf16(out + i, round8_bf16(silu8(load8_bf16(g + i))) * load8_bf16(u + i));
    for (; i < n; i++) {
        const float gv = bf16_to_f32(g[i]);
        out[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(gv / (1.0f + expf(-gv)))) * bf16_to_f32(u[i]));
    }
}

#define RMS_NORM(SUFFIX, T)                                                                                       \
    void kvray_rms_norm_##SUFFIX(const T *x, int64_t x_stride, const T *residual, int64_t residual_stride,        \
                                 T *residual_out, int64_t residual_out_stride, T *out, int64_t out_stride,        \
                                 const T *weight, int64_t rows, int64_t dim, float eps, int32_t num_threads) {    \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * dim > 32768)")              \
        for (int64_t r = 0; r < rows; r++)                                                                      \
            kvray_rms_row_##SUFFIX(x + r * x_stride, residual ? residual + r * residual_stride : 0,               \
                                   residual ? residual_out + r * residual_out_stride : 0, out + r * out_stride,   \
                                   weight, dim, eps);                                                           \
    }
RMS_NORM(f32, float)
RMS_NORM(bf16, bf16)

#define ROTARY(SUFFIX, T)                                                                                        \
    void kvray_rotary_##SUFFIX(T *x, int64_t row_stride, int64_t num_heads, int64_t head_dim, const float *cos,   \
                               const float *sin, int64_t rows, int32_t num_threads) {                           \
        const int64_t half = head_dim / 2;                                                                      \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * num_heads * head_dim > 32768)") \
        for (int64_t r = 0; r < rows; r++)                                                                      \
            kvray_rotary_row_##SUFFIX(x + r * row_stride, x + r * row_stride, num_heads, head_dim, cos + r * half,  \
                                      sin + r * half);                                                          \
    }
ROTARY(f32, float)
ROTARY(bf16, bf16)

/* Greedy sampling: out[r] = the index of row r's largest value (the first of equal ones; the
 * first NaN where a row has one, as torch.argmax gives), rows of n fp32 values `stride`
 * apart; 8 lanes each keep their best value and where it was, then the lanes meet. */
int64_t kvray_argmax_row_f32(const float *x, int64_t n) {
    v8 best = (v8){0} - INFINITY;
    v8i where = {0}, at = {0, 1, 2, 3, 4, 5, 6, 7}, nan = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8, at += 8) {
        const v8 v = load8(x + i);
        const v8i better = v > best;
        best = (v8)(((v8i)v & better) | ((v8i)best & ~better));
        where = (at & better) | (where & ~better);
        nan |= v != v;
    }
    float m = -INFINITY;
    int64_t arg = 0;
    for (int l = 0; l < 8; l++)
        if (best[l] > m || (best[l] == m && where[l] < arg)) m = best[l], arg = where[l];
    for (; i < n; i++)
        if (x[i] > m) m = x[i], arg = i;
    int any_nan = 0;
    for (int l = 0; l < 8; l++) any_nan |= nan[l] != 0;
    for (i = any_nan ? 0 : n; i < n; i++)  /* the tail's NaNs are caught below */
        if (x[i] != x[i]) return i;
    for (i = n / 8 * 8; i < n; i++)
        if (x[i] != x[i]) return i;
    return arg;
}

void kvray_argmax_f32(const float *x, int64_t stride, int64_t n, int64_t rows, int64_t *out, int32_t num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * n > 262144)")
    for (int64_t r = 0; r < rows; r++) out[r] = kvray_argmax_row_f32(x + r * stride, n);
}
