/* The small per-layer operations of a Llama step on a CPU (fp32 or bf16), one pass each,
 * where torch runs four to eight separate ops (each a pass over memory plus a dispatch):
 *
 *   kvray_rms_norm_f32      out = x / rms(x) * weight; with `residual`, first
 *                           residual_out = x + residual and the norm is of that sum
 *   kvray_rotary_f32        Hugging Face's "rotate half" RoPE, in place, on the head
 *                           rows of q or k inside the fused qkv projection's output
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

#include "cpu_vec.h"

typedef unsigned short bf16;

void kvray_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                        float *residual_out, int64_t residual_out_stride, float *out, int64_t out_stride,
                        const float *weight, int64_t rows, int64_t dim, float eps, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *outr = out + r * out_stride;
        const float *src = xr;
        if (residual != 0) {  // the residual stream goes on as x + residual
            const float *res = residual + r * residual_stride;
            float *sum = residual_out + r * residual_out_stride;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) sum[i] = xr[i] + res[i];
            src = sum;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; i++) squares += src[i] * src[i];
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) outr[i] = weight[i] * (src[i] * inv);
    }
}

void kvray_rotary_f32(float *x, int64_t row_stride, int64_t num_heads, int64_t head_dim, const float *cos,
                      const float *sin, int64_t rows, int32_t num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * num_heads * head_dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < num_heads; h++) {
            float *x1 = x + r * row_stride + h * head_dim, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

void kvray_rms_norm_bf16(const bf16 *x, int64_t x_stride, const bf16 *residual, int64_t residual_stride,
                         bf16 *residual_out, int64_t residual_out_stride, bf16 *out, int64_t out_stride,
                         const bf16 *weight, int64_t rows, int64_t dim, float eps, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *src = x + r * x_stride;
        bf16 *outr = out + r * out_stride;
        if (residual != 0) {  // the residual stream goes on as bf16(x + residual)
            const bf16 *res = residual + r * residual_stride;
            bf16 *sum = residual_out + r * residual_out_stride;
            int64_t i = 0;
            for (; i + 8 <= dim; i += 8) store8_bf16(sum + i, load8_bf16(src + i) + load8_bf16(res + i));
            for (; i < dim; i++) sum[i] = f32_to_bf16(bf16_to_f32(src[i]) + bf16_to_f32(res[i]));
            src = sum;
        }
        v8 squares8 = {0};
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            const v8 v = load8_bf16(src + i);
            squares8 += v * v;
        }
        float squares = sum8(squares8);
        for (; i < dim; i++) squares += bf16_to_f32(src[i]) * bf16_to_f32(src[i]);
        const float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        for (i = 0; i + 8 <= dim; i += 8)  // weight * bf16(x * inv), rounded
            store8_bf16(outr + i, load8_bf16(weight + i) * round8_bf16(load8_bf16(src + i) * inv));
        for (; i < dim; i++)
            outr[i] = f32_to_bf16(bf16_to_f32(weight[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(src[i]) * inv)));
    }
}

void kvray_rotary_bf16(bf16 *x, int64_t row_stride, int64_t num_heads, int64_t head_dim, const float *cos,
                       const float *sin, int64_t rows, int32_t num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * num_heads * head_dim > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < num_heads; h++) {
            bf16 *x1 = x + r * row_stride + h * head_dim, *x2 = x1 + half;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                const v8 a = load8_bf16(x1 + i), b = load8_bf16(x2 + i), ci = load8(c + i), si = load8(s + i);
                store8_bf16(x1 + i, a * ci - b * si);
                store8_bf16(x2 + i, b * ci + a * si);
            }
            for (; i < half; i++) {
                const float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
                x1[i] = f32_to_bf16(a * c[i] - b * s[i]);
                x2[i] = f32_to_bf16(b * c[i] + a * s[i]);
            }
        }
    }
}
