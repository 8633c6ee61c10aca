/* A decode step through all of a Llama model's layers in one call (fp32 or bf16).
 *
 * Where every row of a step is a decode row (no prompt chunk) and few enough for the
 * matmul panels, the per-layer work is small: at one sequence, SmolLM2's 30 layers run
 * ~15 torch ops and native calls each, and their Python and dispatch cost about as much as
 * the weights take to stream (BENCHMARKS.md, single stream). Here one parallel region runs
 * every layer, each phase shared out among the threads with a barrier after it:
 *
 *   h = RMSNorm(x)                      rows
 *   qkv = h Wqkv^T (+ b)                panels (kernels/cpu_linear.c)
 *   RoPE on q and k; k, v -> the cache  rows
 *   attn = decode attention             work items (kernels/cpu_decode.c)
 *   x += attn Wo^T (+ b)                panels, added into the residual stream
 *   h = RMSNorm(x)                      rows
 *   gu = h Wgu^T (+ b)                  panels
 *   a = silu(g) * u                     rows
 *   x += a Wdown^T (+ b)                panels
 *
 * The math and the roundings are the layers' own (kernels/cpu_ops.c, the panels): in bf16
 * each op's result is rounded to bf16 as the torch layers round it. SiLU uses the kernels'
 * own exp (cpu_vec.h), within an ulp of torch's (fp32 logits agree to ~1e-6). x [T, hidden] is the
 * residual stream, updated in place; the caller applies the final norm and the LM head.
 * Built with the other kernels by kernels/cpu_native.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "cpu_vec.h"

typedef struct { /* one layer's tensors (the model's dtype), as cpu_native.DecodeLayer lays them out */
    const void *input_norm, *post_norm;           /* [hidden] */
    const void *qkv, *o, *gate_up, *down;         /* weights in the panels' layout */
    const void *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* or NULL */
    void *k_cache, *v_cache;                      /* [num_blocks, block_size, Hkv, D], contiguous */
    int32_t window;                               /* attend to the last `window` positions; 0: all */
} DecodeLayer;

typedef struct {
    int32_t hidden, num_q_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
} DecodeShape;

/* from kernels/cpu_ops.c and kernels/cpu_linear.c */
void kvray_rms_row_f32(const float *, const float *, float *, float *, const float *, int64_t, float);
void kvray_rms_row_bf16(const bf16 *, const bf16 *, bf16 *, bf16 *, const bf16 *, int64_t, float);
void kvray_rotary_row_f32(float *, int64_t, int64_t, const float *, const float *);
void kvray_rotary_row_bf16(bf16 *, int64_t, int64_t, const float *, const float *);
void kvray_linear_body_f32(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t, int64_t,
                           int64_t, int);
void kvray_linear_body_bf16(const bf16 *, int64_t, const bf16 *, const bf16 *, bf16 *, int64_t, int64_t, int64_t,
                            int64_t, int);

/* out = x W^T (+ b), or out += that: x [m, k], out [m, n], both unit-stride rows */
static void linear(int bf16_io, const void *x, const void *w, const void *b, void *out, int64_t m, int64_t n,
                   int64_t k, int accumulate) {
    if (bf16_io)
        kvray_linear_body_bf16((const bf16 *)x, k, (const bf16 *)w, (const bf16 *)b, (bf16 *)out, n, m, n, k,
                               accumulate);
    else
        kvray_linear_body_f32((const float *)x, k, (const float *)w, (const float *)b, (float *)out, n, m, n, k,
                              accumulate);
}

static void rms_rows(int bf16_io, const void *x, void *out, const void *weight, int64_t rows, int64_t dim,
                     float eps) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16_io)
            kvray_rms_row_bf16((const bf16 *)x + r * dim, 0, 0, (bf16 *)out + r * dim, (const bf16 *)weight, dim, eps);
        else
            kvray_rms_row_f32((const float *)x + r * dim, 0, 0, (float *)out + r * dim, (const float *)weight, dim,
                              eps);
    }
}

/* RoPE on each row's q and k heads, then its k and v into the cache at the row's slot */
static void rope_and_store(int bf16_io, void *qkv, const DecodeShape *sh, const DecodeLayer *l, int64_t rows,
                           const float *cos, const float *sin, const int64_t *slots) {
    const int64_t d = sh->head_dim, half = d / 2, q_width = sh->num_q_heads * d, kv_width = sh->num_kv_heads * d;
    const int64_t width = q_width + 2 * kv_width, size = bf16_io ? 2 : 4;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        char *row = (char *)qkv + r * width * size;
        if (bf16_io)
            kvray_rotary_row_bf16((bf16 *)row, sh->num_q_heads + sh->num_kv_heads, d, cos + r * half, sin + r * half);
        else
            kvray_rotary_row_f32((float *)row, sh->num_q_heads + sh->num_kv_heads, d, cos + r * half, sin + r * half);
        memcpy((char *)l->k_cache + slots[r] * kv_width * size, row + q_width * size, kv_width * size);
        memcpy((char *)l->v_cache + slots[r] * kv_width * size, row + (q_width + kv_width) * size, kv_width * size);
    }
}

/* a = silu(g) * u for gu = [g | u] rows; in bf16 silu(g) is rounded before the product, as torch does */
static void silu_mul(int bf16_io, const void *gu, void *a, int64_t rows, int64_t inter) {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = 0;
        if (bf16_io) {
            const bf16 *g = (const bf16 *)gu + r * 2 * inter, *u = g + inter;
            bf16 *out = (bf16 *)a + r * inter;
            for (; i + 8 <= inter; i += 8)
                store8_bf16(out + i, round8_bf16(silu8(load8_bf16(g + i))) * load8_bf16(u + i));
            for (; i < inter; i++) {
                const float gv = bf16_to_f32(g[i]);
                out[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(gv / (1.0f + expf(-gv)))) * bf16_to_f32(u[i]));
            }
        } else {
            const float *g = (const float *)gu + r * 2 * inter, *u = g + inter;
            float *out = (float *)a + r * inter;
            for (; i + 8 <= inter; i += 8) store8(out + i, silu8(load8(g + i)) * load8(u + i));
            for (; i < inter; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
    }
}

static void decode_layers(const DecodeLayer *layers, int32_t num_layers, const DecodeShape *sh, void *x, int64_t rows,
                          const float *cos, const float *sin, const int64_t *slots, const int32_t *block_tables,
                          int64_t table_stride, const int32_t *seq_lens, const int64_t *q_rows, int32_t num_seqs,
                          int32_t num_threads, int bf16_io) {
    const int64_t size = bf16_io ? 2 : 4, d = sh->head_dim, hidden = sh->hidden, inter = sh->intermediate;
    const int64_t q_width = sh->num_q_heads * d, kv_width = sh->num_kv_heads * d, qkv_width = q_width + 2 * kv_width;
    char *h = malloc(rows * hidden * size), *qkv = malloc(rows * qkv_width * size);
    char *attn = malloc(rows * q_width * size), *gu = malloc(rows * 2 * inter * size), *act = malloc(rows * inter * size);
    /* the attention's work items depend on the window only: a plan per distinct window */
    DecodePlan *plans = malloc(sizeof(DecodePlan) * num_layers);
    int32_t *plan_of = malloc(sizeof(int32_t) * num_layers), num_plans = 0;
    for (int32_t i = 0; i < num_layers; i++) {
        plan_of[i] = -1;
        for (int32_t j = 0; j < num_plans; j++)
            if (plans[j].window == layers[i].window) plan_of[i] = j;
        if (plan_of[i] < 0) {
            plans[num_plans] = kvray_decode_plan(seq_lens, num_seqs, sh->num_q_heads, sh->num_kv_heads, sh->head_dim,
                                                 sh->block_size, layers[i].window, num_threads);
            plan_of[i] = num_plans++;
        }
    }
    const int64_t row = d * size, token = sh->num_kv_heads * row;
#pragma omp parallel num_threads(num_threads)
    {
        DecodeScratch scratch = kvray_decode_scratch(sh->num_q_heads, sh->head_dim, sh->block_size);
        for (int32_t i = 0; i < num_layers; i++) {
            const DecodeLayer *l = &layers[i];
            const Cache cache = {(const char *)l->k_cache, (const char *)l->v_cache, token, sh->block_size * token, row,
                                 sh->num_kv_heads, sh->head_dim, sh->block_size, sh->scale};
            rms_rows(bf16_io, x, h, l->input_norm, rows, hidden, sh->eps);
            linear(bf16_io, h, l->qkv, l->qkv_bias, qkv, rows, qkv_width, hidden, 0);
            rope_and_store(bf16_io, qkv, sh, l, rows, cos, sin, slots);
            kvray_decode_attend(&plans[plan_of[i]], &scratch, qkv, qkv_width, attn, q_width, &cache, block_tables,
                                table_stride, seq_lens, q_rows, num_seqs, sh->num_q_heads, bf16_io ? BF16 : F32);
            linear(bf16_io, attn, l->o, l->o_bias, x, rows, hidden, q_width, 1);
            rms_rows(bf16_io, x, h, l->post_norm, rows, hidden, sh->eps);
            linear(bf16_io, h, l->gate_up, l->gate_up_bias, gu, rows, 2 * inter, hidden, 0);
            silu_mul(bf16_io, gu, act, rows, inter);
            linear(bf16_io, act, l->down, l->down_bias, x, rows, hidden, inter, 1);
        }
        kvray_decode_scratch_free(&scratch);
    }
    for (int32_t j = 0; j < num_plans; j++) kvray_decode_plan_free(&plans[j]);
    free(plans);
    free(plan_of);
    free(h);
    free(qkv);
    free(attn);
    free(gu);
    free(act);
}

/* x [rows, hidden]: the residual stream into the first layer, out of the last; cos, sin
 * [rows, head_dim / 2] fp32; slots [rows]: each row's cache slot; block_tables, seq_lens,
 * q_rows: the step's decode rows as kvray_paged_decode_* takes them */
void kvray_decode_layers_f32(const DecodeLayer *layers, int32_t num_layers, const DecodeShape *shape, float *x,
                             int64_t rows, const float *cos, const float *sin, const int64_t *slots,
                             const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                             const int64_t *q_rows, int32_t num_seqs, int32_t num_threads) {
    decode_layers(layers, num_layers, shape, x, rows, cos, sin, slots, block_tables, table_stride, seq_lens, q_rows,
                  num_seqs, num_threads, 0);
}

void kvray_decode_layers_bf16(const DecodeLayer *layers, int32_t num_layers, const DecodeShape *shape, bf16 *x,
                              int64_t rows, const float *cos, const float *sin, const int64_t *slots,
                              const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                              const int64_t *q_rows, int32_t num_seqs, int32_t num_threads) {
    decode_layers(layers, num_layers, shape, x, rows, cos, sin, slots, block_tables, table_stride, seq_lens, q_rows,
                  num_seqs, num_threads, 1);
}
