/* Decode attention over the paged KV cache, on a CPU (fp32, bf16, or an 8-bit cache).
 *
 * One query token per sequence. A decode step's attention on a CPU is bound by reading K
 * and V, so the kernel reads each byte once, in the order it lies in memory:
 *
 * - A work item is one sequence's context, or a span of SPAN_TOKENS of it (a long context
 *   is split at multiples of SPAN_TOKENS), over all KV heads: each cache block (block_size
 *   token rows of every KV head) is read front to back. A step of too few items for its
 *   threads splits each item by KV head instead, so that one sequence alone keeps every
 *   thread busy. Heads never meet in the math, so a row's result depends on its own context
 *   only, never on the step's other rows (batch-invariant: a token verified among
 *   speculative drafts rounds as it does in a one-row step).
 * - One pass, a block at a time: its key rows become the scores of every query head, each
 *   head's running max and sum take them in (an online softmax), then its value rows are
 *   added up with the accumulators of one head slice in registers; the next block's K and
 *   V are prefetched piece by piece meanwhile. (Two passes, all scores then all values,
 *   left memory idle during the second: 32 sequences x 300 positions, 300 -> 240 us a
 *   layer in bf16 on a Zen 5, BENCHMARKS.md.)
 * - A sequence split into spans leaves (max, sum, unnormalised output) per span and head;
 *   a last loop merges them (the log-sum-exp combination of flash-decoding).
 *
 * Layouts (elements, fp32 unless said):
 *   q, out        rows of [num_q_heads, head_dim]; row r starts at r * q_stride (out_stride)
 *   k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim], contiguous; or, for an
 *                 8-bit cache (kvray_paged_decode_i8), int8 [..., head_dim + 4]: each row's
 *                 codes then its fp32 scale (kernels/kv_quant.py). The scale multiplies a
 *                 row's score (keys) or its softmax weight (values), never each element.
 *                 kvray_paged_decode_bf16: q, out and both caches bf16; the math is fp32
 *                 (q widened once per work item, out rounded once).
 *   block_tables  int32 [num_seqs, table_stride]
 *   seq_lens      int32 [num_seqs]: context length, the new token included
 *   rows          int64 [num_seqs]: the q (and out) row of each sequence
 *   window        attend to the last `window` positions only; 0: all
 * Supported: head_dim a multiple of 32, 1 to 8 query heads per KV head (the caller checks).
 *
 * Vectors are GCC's portable vector extension (8 floats; AVX/AVX-512, or SSE/NEON pairs).
 * Built by kernels/cpu_native.py (-O3 -march=native -fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "cpu_vec.h"

#define SPAN_TOKENS 512 /* the most context positions one work item covers */
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 1 /* how many blocks ahead rows are prefetched */
#endif
#define SLICE 4         /* vectors of one head's output kept in registers (32 floats) */

/* the fp32 scale that ends an 8-bit row */
static inline float row_scale(const char *row, int32_t head_dim) {
    float s;
    memcpy(&s, row + head_dim, sizeof(s));
    return s;
}


/* 8 values of a row from element x: floats, bf16, or int8 codes (before their scale) */
static inline v8 load_row8(const char *row, int32_t x, const int quant) {
    if (quant == INT8) return load8_i8((const signed char *)row + x);
    if (quant == BF16) return load8_bf16((const bf16 *)row + x);
    return load8((const float *)row + x);
}

/* Bytes [lo, hi) of KV head h in rows [r0, r1) of the next block of the span (`next`: that
 * block, or NULL past the span). Its blocks are scattered, so the hardware prefetcher
 * cannot know where the next one lies; asking for it a block ahead hides the latency. Each
 * piece is asked for just before the same piece of this block is used, so the requests
 * stay in step with the math: asked for all at once, they stall it. */
static inline void prefetch_next(const char *next, const Cache *c, int64_t r0, int64_t r1, int32_t h, int64_t lo,
                                 int64_t hi) {
    if (next == 0) return;
    for (int64_t r = r0; r < r1; r++) {
        const char *row = next + r * c->token_stride + h * c->head_stride;
        for (uintptr_t line = (uintptr_t)(row + lo) & ~(uintptr_t)63; line < (uintptr_t)(row + hi); line += 64)
            prefetch_l2((const void *)line);
    }
}

/* The block PREFETCH_BLOCKS after block `blk` of the table if the span [.., end) reaches it, or NULL */
static inline const char *next_block(const char *cache, const Cache *c, const int32_t *table, int64_t blk,
                                     int64_t end) {
    return (blk + PREFETCH_BLOCKS) * c->block_size < end ? cache + table[blk + PREFETCH_BLOCKS] * c->block_stride : 0;
}

/* Lines [from, from + count) of a contiguous block (an item over every KV head reads all of
 * its next block), clipped to the block's `lines` */
static inline void prefetch_lines(const char *block, int64_t from, int64_t count, int64_t lines) {
    if (block == 0) return;
    const int64_t to = from + count < lines ? from + count : lines;
    for (int64_t line = from; line < to; line++) prefetch_l2(block + 64 * line);
}

/* the first context position a sequence of `len` attends to */
static inline int32_t window_start(int32_t len, int32_t window) {
    return (window > 0 && len > window) ? len - window : 0;
}

/* how many spans (aligned to multiples of `span`) the attended positions touch */
static inline int64_t num_spans(int32_t len, int32_t window, int32_t span) {
    return (len - 1) / span - window_start(len, window) / span + 1;
}


/* a chunk's 8 scores of one query head, as stored (a chunk may have fewer rows) */
static inline void store_scores(float *dst, v8 sc, int rows) {
    if (rows == 8) {
        store8(dst, sc);
    } else {
        for (int r = 0; r < rows; r++) dst[r] = sc[r];
    }
}

/* Where the CPU has AVX-512, the fp32 and int8 scores and every cache's weighted value sums
 * run in 16-float vectors (the portable loops' are 8): about half the instructions, which
 * an int8 cache needs (its rows are widened before any math; half the bytes of bf16 leave
 * the kernel bound by instructions, not by memory). Each output element's value sum is the
 * same, lane by lane; a score's dot product adds its 16-float partial sums in another order. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define FAST_X16 1

/* [sum of a[0], ..., sum of a[7]] */
static inline __attribute__((always_inline)) v8 sums8_x16(const __m512 a[8]) {
    v8 halves[8];
    for (int r = 0; r < 8; r++)
        halves[r] = (v8)_mm256_add_ps(_mm512_castps512_ps256(a[r]),
                                      _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(a[r]), 1)));
    return sums8(halves);
}

/* [q . k_0, ..., q . k_7] for a query head q and 8 key rows, all d floats */
static inline __attribute__((always_inline)) v8 dots8(const float *q, const float *const k[8], int32_t d) {
    __m512 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm512_setzero_ps();
    for (int32_t x = 0; x < d; x += 16) {
        const __m512 qv = _mm512_loadu_ps(q + x);
        for (int r = 0; r < 8; r++) a[r] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[r] + x), a[r]);
    }
    return sums8_x16(a);
}

/* 16 values of a cache row from element x, as fp32 (int8: the codes, before their scale) */
static inline __attribute__((always_inline)) __m512 load16_row(const char *row, int32_t x, const int quant) {
    if (quant == INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + x))));
    if (quant == BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const bf16 *)row + x))), 16));
    return _mm512_loadu_ps((const float *)row + x);
}

/* acc[g][0:32] (+)= sum_t p[g][t] s_t v_t[0:32] for a KV head's `group` query heads (acc
 * rows head_dim apart, p rows n apart) over `rows` value rows token_stride bytes apart,
 * starting at element x0 (s_t: an int8 row's scale, else 1). A bf16 cache's rows widen as
 * their even elements then their odd ones (two instructions for 32, not four), so its
 * acc[g][0:32] holds elements x0, x0 + 2, ..., x0 + 30, x0 + 1, ..., x0 + 31: the same
 * sums, in that order until `unshuffle_acc` (attend_span's end). */
static inline __attribute__((always_inline)) void add_values32(float *acc, int32_t d, const char *v, int32_t x0,
                                                               int64_t token_stride, int64_t rows, const float *p,
                                                               int64_t n, const int group, int fresh, const int quant) {
    __m512 a[8][2];
    for (int g = 0; g < group; g++)
        for (int s = 0; s < 2; s++) a[g][s] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + g * d + 16 * s);
    for (int64_t t = 0; t < rows; t++) {
        const char *row = v + t * token_stride;
        const float vs = quant == INT8 ? row_scale(row, d) : 1.0f;
        __m512 vv[2];
        if (quant == BF16) { /* 32 bf16 as one load: the low halves (even elements), then the high */
            const __m512i pairs = _mm512_loadu_si512((const bf16 *)row + x0);
            vv[0] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            vv[1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
        } else {
            vv[0] = load16_row(row, x0, quant);
            vv[1] = load16_row(row, x0 + 16, quant);
        }
        for (int g = 0; g < group; g++) {
            const __m512 pg = _mm512_set1_ps(p[g * n + t] * vs);
            for (int s = 0; s < 2; s++) a[g][s] = _mm512_fmadd_ps(pg, vv[s], a[g][s]);
        }
    }
    for (int g = 0; g < group; g++)
        for (int s = 0; s < 2; s++) _mm512_storeu_ps(acc + g * d + 16 * s, a[g][s]);
}
/* a bf16 cache's accumulators (add_values32) back in element order, 32 at a time */
static inline void unshuffle_acc(float *acc, int64_t n) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t x = 0; x < n; x += 32) {
        const __m512 even = _mm512_loadu_ps(acc + x), odd = _mm512_loadu_ps(acc + x + 16);
        _mm512_storeu_ps(acc + x, _mm512_permutex2var_ps(even, lo, odd));
        _mm512_storeu_ps(acc + x + 16, _mm512_permutex2var_ps(even, hi, odd));
    }
}
#else /* the same two, 8 floats at a time */
static inline __attribute__((always_inline)) v8 dots8(const float *q, const float *const k[8], int32_t d) {
    v8 a[8] = {0};
    for (int32_t x = 0; x < d; x += 8) {
        const v8 qv = load8(q + x);
        for (int r = 0; r < 8; r++) a[r] += qv * load8(k[r] + x);
    }
    return sums8(a);
}

/* dots8 for `group` (at most 3) query heads at once, d apart from q, against the same 8
 * rows: out[g] = [q_g . k_0, ..., q_g . k_7], each the same sums as dots8's (lane by lane
 * over x in order, then sums8). Four rows at a time keep the group's 12 sums and its q
 * vectors in AVX2's 16 registers, so a key vector loaded once meets every head of the
 * group: 7 loads for 12 FMAs, where dots8 per head takes 9 for 8. */
#define GROUP_DOTS 3
static inline __attribute__((always_inline)) void dots8_group(const float *q, const float *const k[8], int32_t d,
                                                              const int group, v8 *out) {
    v8 sums[GROUP_DOTS][8];
    for (int half = 0; half < 8; half += 4) {
        v8 a[GROUP_DOTS][4];
        for (int g = 0; g < group; g++)
            for (int r = 0; r < 4; r++) a[g][r] = (v8){0};
        for (int32_t x = 0; x < d; x += 8) {
            v8 qv[GROUP_DOTS];
            for (int g = 0; g < group; g++) qv[g] = load8(q + g * d + x);
            for (int r = 0; r < 4; r++) {
                const v8 kv = load8(k[half + r] + x);
                for (int g = 0; g < group; g++) a[g][r] += qv[g] * kv;
            }
        }
        for (int g = 0; g < group; g++)
            for (int r = 0; r < 4; r++) sums[g][half + r] = a[g][r];
    }
    for (int g = 0; g < group; g++) out[g] = sums8(sums[g]);
}

static inline __attribute__((always_inline)) void add_values32(float *acc, int32_t d, const char *v, int32_t x0,
                                                               int64_t token_stride, int64_t rows, const float *p,
                                                               int64_t n, const int group, int fresh, const int quant) {
    v8 a[8][SLICE];
    for (int g = 0; g < group; g++)
        for (int s = 0; s < SLICE; s++) a[g][s] = fresh ? (v8){0} : load8(acc + g * d + 8 * s);
    for (int64_t t = 0; t < rows; t++) {
        const char *row = v + t * token_stride;
        const float vs = quant == INT8 ? row_scale(row, d) : 1.0f;
        v8 vv[SLICE];
        for (int s = 0; s < SLICE; s++) vv[s] = load_row8(row, x0 + 8 * s, quant);
        for (int g = 0; g < group; g++) {
            const float pg = p[g * n + t] * vs;
            for (int s = 0; s < SLICE; s++) a[g][s] += pg * vv[s];
        }
    }
    for (int g = 0; g < group; g++)
        for (int s = 0; s < SLICE; s++) store8(acc + g * d + 8 * s, a[g][s]);
}
#endif

/* Where the CPU has AVX512-BF16 too, a bf16 cache's scores take each query head's dot with
 * 8 key rows by `vdpbf16ps` straight from the cache (32 bf16 of q and k a multiply, the
 * pairs' products summed in fp32; the query is bf16 already, so its fp32 copy narrows back
 * exactly): the same outputs, about 2x fewer instructions than widening the rows. */
#if defined(__AVX512BF16__) && defined(FAST_X16)
#define FAST_BF16 1

/* [q . k_0, ..., q . k_7] for q as d/32 vectors of bf16 pairs and 8 bf16 key rows */
static inline __attribute__((always_inline)) v8 dots8_bf16(const __m512bh *q, const bf16 *const k[8], int32_t chunks) {
    __m512 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm512_setzero_ps();
    for (int32_t x = 0; x < chunks; x++)
        for (int r = 0; r < 8; r++) a[r] = _mm512_dpbf16_ps(a[r], q[x], (__m512bh)_mm512_loadu_si512(k[r] + 32 * x));
    return sums8_x16(a);
}

#endif

/* acc[qh][:] *= f (query heads' rows head_dim apart) */
static inline void rescale(float *acc, int32_t d, int32_t qh, float f) {
    for (int32_t x = 0; x < d; x += 8) store8(acc + qh * d + x, load8(acc + qh * d + x) * f);
}

/* Query head qh's running max takes a block's largest score m (the span's first block
 * starts it); where m raises it, the sums so far shrink by exp(m_old - m). Returns what the
 * block's scores are measured from: the max, or 0 while every score so far is -inf (only
 * with infinite inputs; -inf - -inf would be NaN, and the tiny numerators left, exp
 * stopping at -87, are wiped by the first finite score). */
static inline float online_max(float *max_out, float *sum_out, float *acc, int32_t d, int32_t qh, float m,
                               int first_block) {
    if (first_block) {
        max_out[qh] = m;
        sum_out[qh] = 0.0f;
    } else if (m > max_out[qh]) {
        const float shrink = expf(max_out[qh] - m);
        max_out[qh] = m;
        sum_out[qh] *= shrink;
        rescale(acc, d, qh, shrink);
    }
    return max_out[qh] == -INFINITY ? 0.0f : max_out[qh];
}

/* The item's attention in one pass over its blocks (the online softmax of flash-decoding):
 * per block, the scores of its key rows for every query head, each head's running max and
 * sum (its accumulators rescaled where the max grows), then the block's value rows weighted
 * by their softmax numerators. The next block's K and V are prefetched while this one is
 * computed, so memory streams all along (two passes left it idle during the second).
 * Writes, per query head q_h, m its largest score:
 * acc[q_h][:] = sum_i exp(s_i - m) v_i, max_out[q_h] = m, sum_out[q_h] = sum_i exp(s_i - m). */
static inline __attribute__((always_inline)) void attend_span(const Cache *c, const float *qs,
                                                              const int32_t *table, int32_t start,
                                                              int32_t end, int32_t h0, int32_t h1,
                                                              float *scores, float *acc,
                                                              float *max_out, float *sum_out,
                                                              const int group, const int quant) {
    const int64_t n = end - start;
    const int32_t d = c->head_dim, bs = c->block_size;
#ifdef FAST_BF16
    const int32_t chunks = d / 32;
    __m512bh qb[quant == BF16 ? (h1 - h0) * group * chunks : 1]; /* the item's query heads in bf16 pairs */
    for (int32_t qh = 0; quant == BF16 && qh < (h1 - h0) * group; qh++)
        for (int32_t x = 0; x < chunks; x++) {
            const float *qx = qs + ((int64_t)h0 * group + qh) * d + 32 * x;
            qb[qh * chunks + x] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qx + 16), _mm512_loadu_ps(qx));
        }
#endif
    float widened[8 * d], zeros[d];
    memset(zeros, 0, sizeof(zeros));
    /* an item over every KV head reads its blocks whole: it prefetches the next one as
     * contiguous lines, a share at each (rows, head) step (else row by row, its heads only).
     * Blocks are walked by index: `b0 / bs` was a 64-bit `idiv` (15-45 cycles on a Zen 2),
     * five a block. With the scores below (dots8_group), on a Zen 2 in fp32: a fused decode
     * step at 32 rows x 300 context 96.0 -> 85.6 ms, 16 rows 49.2 -> 43.9 (BENCHMARKS.md) */
    const int whole = h0 == 0 && h1 == c->num_kv_heads;
    const int64_t block_lines = bs * c->token_stride / 64;
    for (int64_t blk = start / bs, b0 = start; b0 < end; b0 = ++blk * bs) {
        const int64_t first = blk * bs, b1 = first + bs < end ? first + bs : end;
        const char *keys = c->k_cache + table[blk] * c->block_stride;
        const char *values = c->v_cache + table[blk] * c->block_stride;
        const char *next_keys = next_block(c->k_cache, c, table, blk, end);
        const char *next_values = next_block(c->v_cache, c, table, blk, end);
        /* the lines each step prefetches: the K loop's steps are chunks x heads, the V loop's
         * heads x slices */
        const int64_t k_steps = ((b1 - b0 + 7) / 8) * (h1 - h0);
        const int64_t v_steps = (h1 - h0) * ((d + 8 * SLICE - 1) / (8 * SLICE));
        const int64_t k_share = (block_lines + k_steps - 1) / k_steps, v_share = (block_lines + v_steps - 1) / v_steps;
        int64_t k_line = 0, v_line = 0;
        /* scores[q_h][i] = q_h . k_i * scale, in chunks of 8 rows: per KV head, the chunk's
         * rows (widened to fp32 once, bf16 or int8) meet each of the group's query heads
         * with 8 independent sums, reduced together (sums8) */
        for (int64_t t0 = b0; t0 < b1; t0 += 8) {
            const int rows = b1 - t0 < 8 ? (int)(b1 - t0) : 8;
            for (int32_t h = h0; h < h1; h++) {
                if (whole) {
                    prefetch_lines(next_keys, k_line, k_share, block_lines);
                    k_line += k_share;
                } else {
                    prefetch_next(next_keys, c, t0 - first, t0 - first + rows, h, 0, c->head_stride);
                }
#ifdef FAST_BF16
                if (quant == BF16) {
                    const bf16 *kb[8];
                    for (int r = 0; r < 8; r++)
                        kb[r] = r < rows ? (const bf16 *)(keys + (t0 + r - first) * c->token_stride + h * c->head_stride)
                                         : (const bf16 *)zeros;
                    for (int g = 0; g < group; g++)
                        store_scores(scores + (h * group + g) * n + (t0 - start),
                                     dots8_bf16(qb + ((h - h0) * group + g) * chunks, kb, chunks) * c->scale, rows);
                    continue;
                }
#endif
                const float *k[8];
                v8 row_scales = {1, 1, 1, 1, 1, 1, 1, 1};
                for (int r = 0; r < 8; r++) {
                    const char *kp = keys + (t0 + r - first) * c->token_stride + h * c->head_stride;
                    if (r >= rows) {
                        k[r] = zeros;
                    } else if (quant == F32) {
                        k[r] = (const float *)kp;
                    } else {
#ifdef FAST_X16 /* written out here: as a helper it cost the int8 kernel ~3 % */
                        for (int32_t x = 0; x < d; x += 16) _mm512_storeu_ps(widened + r * d + x, load16_row(kp, x, quant));
#else
                        for (int32_t x = 0; x < d; x += 8) store8(widened + r * d + x, load_row8(kp, x, quant));
#endif
                        k[r] = widened + r * d;
                        if (quant == INT8) row_scales[r] = row_scale(kp, d);
                    }
                }
#ifndef FAST_X16
                if (group <= GROUP_DOTS) {
                    v8 dots[GROUP_DOTS];
                    dots8_group(qs + (int64_t)h * group * d, k, d, group, dots);
                    for (int g = 0; g < group; g++)
                        store_scores(scores + (h * group + g) * n + (t0 - start), dots[g] * row_scales * c->scale,
                                     rows);
                    continue;
                }
#endif
                for (int g = 0; g < group; g++)
                    store_scores(scores + (h * group + g) * n + (t0 - start),
                                 dots8(qs + ((int64_t)h * group + g) * d, k, d) * row_scales * c->scale, rows);
            }
        }
        /* each query head's numerators exp(s_i - m) against its running max m; where the
         * block raises m, the sums so far shrink by exp(m_old - m) */
        for (int32_t qh = h0 * group; qh < h1 * group; qh++) {
            float *sq = scores + qh * n + (b0 - start);
            const float from = online_max(max_out, sum_out, acc, d, qh, max_of(sq, b1 - b0), b0 == start);
            sum_out[qh] += exp_sum(sq, b1 - b0, from);
        }
        /* acc[q_h] += sum_i p[q_h][i] v_i over the block: one head slice of SLICE vectors
         * at a time, with the accumulators of its query heads in registers */
        for (int32_t h = h0; h < h1; h++) {
            for (int32_t x0 = 0; x0 < d; x0 += 8 * SLICE) {
                const int64_t width = quant == BF16 ? sizeof(bf16) : quant == INT8 ? 1 : sizeof(float);
                if (whole) {
                    prefetch_lines(next_values, v_line, v_share, block_lines);
                    v_line += v_share;
                } else {
                    prefetch_next(next_values, c, b0 - first, b1 - first, h, x0 * width,
                                  x0 + 8 * SLICE < d ? (x0 + 8 * SLICE) * width : c->head_stride);
                }
                add_values32(acc + h * group * d + x0, d, values + (b0 - first) * c->token_stride + h * c->head_stride,
                             x0, c->token_stride, b1 - b0, scores + h * group * n + (b0 - start), n, group, b0 == start,
                             quant);
            }
        }
    }
#ifdef FAST_X16
    if (quant == BF16) unshuffle_acc(acc + (int64_t)h0 * group * d, (int64_t)(h1 - h0) * group * d);
#endif
}

/* one instantiation per (group, quant): both are constants inside attend_span */
static void attend_item(const Cache *c, const float *qs, const int32_t *table, const Item *it, float *scores,
                        float *acc, float *max_out, float *sum_out, int group, int quant) {
#define SPAN(G, Q) \
    attend_span(c, qs, table, it->start, it->end, it->head0, it->head0 + it->heads, scores, acc, max_out, sum_out, G, Q)
#define GROUPS(Q)                 \
    switch (group) {              \
        case 1: SPAN(1, Q); break; \
        case 2: SPAN(2, Q); break; \
        case 3: SPAN(3, Q); break; \
        case 4: SPAN(4, Q); break; \
        case 5: SPAN(5, Q); break; \
        case 6: SPAN(6, Q); break; \
        case 7: SPAN(7, Q); break; \
        default: SPAN(8, Q); break; \
    }
    if (quant == INT8) {
        GROUPS(INT8)
    } else if (quant == BF16) {
        GROUPS(BF16)
    } else {
        GROUPS(F32)
    }
#undef GROUPS
#undef SPAN
}

static void paged_decode(const void *q, int64_t q_stride, void *out, int64_t out_stride, const Cache cache,
                         const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                         const int64_t *rows, int32_t num_seqs, int32_t num_q_heads, int32_t window,
                         int32_t num_threads, int quant, int bf16_io);

void kvray_paged_decode_f32(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                            const float *k_cache, const float *v_cache, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *seq_lens, const int64_t *rows,
                            int32_t num_seqs, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                            int32_t block_size, int32_t num_blocks, float scale, int32_t window,
                            int32_t num_threads) {
    const int64_t row = (int64_t)head_dim * sizeof(float), token = num_kv_heads * row;
    const Cache cache = {(const char *)k_cache, (const char *)v_cache, token, block_size * token, row,
                         num_kv_heads, head_dim, block_size, scale, num_blocks};
    paged_decode(q, q_stride, out, out_stride, cache, block_tables, table_stride, seq_lens, rows, num_seqs,
                 num_q_heads, window, num_threads, F32, 0);
}

/* the same over an 8-bit cache: rows of head_dim int8 codes and their fp32 scale */
static void paged_decode_i8(const void *q, int64_t q_stride, void *out, int64_t out_stride,
                            const signed char *k_cache, const signed char *v_cache, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *seq_lens, const int64_t *rows, int32_t num_seqs,
                            int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                            int32_t num_blocks, float scale, int32_t window, int32_t num_threads, int bf16_io) {
    const int64_t row = head_dim + (int64_t)sizeof(float), token = num_kv_heads * row;
    const Cache cache = {(const char *)k_cache, (const char *)v_cache, token, block_size * token, row,
                         num_kv_heads, head_dim, block_size, scale, num_blocks};
    paged_decode(q, q_stride, out, out_stride, cache, block_tables, table_stride, seq_lens, rows, num_seqs,
                 num_q_heads, window, num_threads, INT8, bf16_io);
}

void kvray_paged_decode_i8(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                           const signed char *k_cache, const signed char *v_cache, const int32_t *block_tables,
                           int64_t table_stride, const int32_t *seq_lens, const int64_t *rows,
                           int32_t num_seqs, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                           int32_t block_size, int32_t num_blocks, float scale, int32_t window,
                           int32_t num_threads) {
    paged_decode_i8(q, q_stride, out, out_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, rows,
                    num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, window,
                    num_threads, 0);
}

/* an 8-bit cache under a bf16 model: q and out bf16 (q widened once per item, out rounded once) */
void kvray_paged_decode_i8_bf16(const bf16 *q, int64_t q_stride, bf16 *out, int64_t out_stride,
                                const signed char *k_cache, const signed char *v_cache, const int32_t *block_tables,
                                int64_t table_stride, const int32_t *seq_lens, const int64_t *rows,
                                int32_t num_seqs, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                                int32_t block_size, int32_t num_blocks, float scale, int32_t window,
                                int32_t num_threads) {
    paged_decode_i8(q, q_stride, out, out_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, rows,
                    num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, window,
                    num_threads, 1);
}

/* out row r = values * inv, as floats, or rounded to bf16 where q and out are bf16 */
static void write_out(void *out, int64_t r, const float *values, float inv, int64_t n, int bf16_io) {
    if (bf16_io) {
        bf16 *o = (bf16 *)out + r;
        for (int64_t x = 0; x < n; x++) o[x] = f32_to_bf16(values[x] * inv);
    } else {
        float *o = (float *)out + r;
        for (int64_t x = 0; x < n; x++) o[x] = values[x] * inv;
    }
}

/* the same with q, out and the caches in bf16 */
void kvray_paged_decode_bf16(const bf16 *q, int64_t q_stride, bf16 *out, int64_t out_stride, const bf16 *k_cache,
                             const bf16 *v_cache, const int32_t *block_tables, int64_t table_stride,
                             const int32_t *seq_lens, const int64_t *rows, int32_t num_seqs, int32_t num_q_heads,
                             int32_t num_kv_heads, int32_t head_dim, int32_t block_size, int32_t num_blocks,
                             float scale, int32_t window, int32_t num_threads) {
    const int64_t row = (int64_t)head_dim * sizeof(bf16), token = num_kv_heads * row;
    const Cache cache = {(const char *)k_cache, (const char *)v_cache, token, block_size * token, row,
                         num_kv_heads, head_dim, block_size, scale, num_blocks};
    paged_decode(q, q_stride, out, out_stride, cache, block_tables, table_stride, seq_lens, rows, num_seqs,
                 num_q_heads, window, num_threads, BF16, 1);
}

DecodePlan kvray_decode_plan(const int32_t *seq_lens, int32_t num_seqs, int32_t num_q_heads, int32_t num_kv_heads,
                             int32_t head_dim, int32_t block_size, int32_t window, int32_t num_threads) {
    /* spans: whole blocks (the first may start mid-block), cut at multiples of `span` */
    const int32_t span = SPAN_TOKENS / block_size * block_size > 0 ? SPAN_TOKENS / block_size * block_size : block_size;
    int64_t num_spans_all = 0, num_parts = 0;
    for (int32_t s = 0; s < num_seqs; s++) {
        const int64_t pieces = num_spans(seq_lens[s], window, span);
        num_spans_all += pieces;
        if (pieces > 1) num_parts += pieces;
    }
    /* too few spans to give every thread two: one item per span and KV head */
    const int32_t per_item = num_spans_all < 2 * (int64_t)num_threads ? 1 : num_kv_heads;
    const int64_t num_items = num_spans_all * (num_kv_heads / per_item);
    DecodePlan plan = {(Item *)kvray_malloc(sizeof(Item) * num_items), (int32_t *)kvray_malloc(sizeof(int32_t) * (num_seqs + 1)),
                       NULL, num_items, (int64_t)num_q_heads * (head_dim + 2), num_parts, span, window};
    int64_t k = 0, part = 0;
    /* the longest contexts come last from the caller (sorted ascending): schedule them first */
    for (int32_t s = num_seqs - 1; s >= 0; s--) {
        const int32_t len = seq_lens[s], start = window_start(len, window);
        const int64_t pieces = num_spans(len, window, span);
        plan.first_part[s] = pieces > 1 ? (int32_t)part : -1;
        for (int64_t p = 0; p < pieces; p++) {
            const int32_t lo = p == 0 ? start : (int32_t)((start / span + p) * span);
            const int32_t hi = (start / span + p + 1) * span < len ? (int32_t)((start / span + p + 1) * span) : len;
            for (int32_t h = 0; h < num_kv_heads; h += per_item)
                plan.items[k++] = (Item){s, lo, hi, pieces > 1 ? (int32_t)(part + p) : -1, h, per_item};
        }
        if (pieces > 1) part += pieces;
    }
    /* spans' partial results: [part][q_head] max and sum, [part][q_head][head_dim] sums */
    if (num_parts) plan.parts = (float *)kvray_malloc(sizeof(float) * num_parts * plan.per_part);
    return plan;
}

void kvray_decode_plan_free(DecodePlan *plan) {
    free(plan->items);
    free(plan->first_part);
    free(plan->parts);
}

DecodeScratch kvray_decode_scratch(int32_t num_q_heads, int32_t head_dim, int32_t block_size) {
    const int64_t per_part = (int64_t)num_q_heads * (head_dim + 2);
    const int64_t longest = block_size > SPAN_TOKENS ? block_size : SPAN_TOKENS; /* a span's most positions */
    return (DecodeScratch){(float *)kvray_malloc(sizeof(float) * num_q_heads * longest),
                           (float *)kvray_malloc(sizeof(float) * per_part),
                           (float *)kvray_malloc(sizeof(float) * num_q_heads * head_dim)};
}

void kvray_decode_scratch_free(DecodeScratch *scratch) {
    free(scratch->scores);
    free(scratch->own);
    free(scratch->q_f32);
}

/* Work item i of the plan: its span's attention, into `out` (a sequence not split) or
 * into the item's part (`a->parts`). A pure function of q and the cache. */
void kvray_decode_item(const DecodeArgs *a, DecodeScratch *scratch, int64_t i) {
    const DecodePlan *plan = a->plan;
    const Cache *cache = a->cache;
    const int bf16_io = a->bf16_io;
    const int32_t head_dim = cache->head_dim, num_q_heads = a->num_q_heads;
    const int group = num_q_heads / cache->num_kv_heads;
    float *scores = scratch->scores, *own = scratch->own, *q_f32 = scratch->q_f32;
    const Item *it = &plan->items[i];
    const int32_t qh0 = it->head0 * group, qh1 = (it->head0 + it->heads) * group;
    const float *qs = (const float *)a->q + a->rows[it->seq] * a->q_stride;
    if (bf16_io) { /* the item's heads of the query, widened once */
        const bf16 *qb = (const bf16 *)a->q + a->rows[it->seq] * a->q_stride;
        for (int32_t x = qh0 * head_dim; x < qh1 * head_dim; x++) q_f32[x] = bf16_to_f32(qb[x]);
        qs = q_f32;
    }
    /* the sums run in this thread's scratch; only finished values go out (an item may run
     * twice at once: cpu_share.h) */
    float *mx = own, *sm = own + num_q_heads, *acc = own + 2 * num_q_heads;
    attend_item(cache, qs, a->block_tables + it->seq * a->table_stride, it, scores, acc, mx, sm, group, a->quant);
    if (it->part < 0) {
        for (int32_t qh = qh0; qh < qh1; qh++)
            write_out(a->out, a->rows[it->seq] * a->out_stride + qh * head_dim, acc + qh * head_dim, 1.0f / sm[qh],
                      head_dim, bf16_io);
        return;
    }
    float *part = a->parts + it->part * plan->per_part;
    memcpy(part + qh0, mx + qh0, sizeof(float) * (qh1 - qh0));
    memcpy(part + num_q_heads + qh0, sm + qh0, sizeof(float) * (qh1 - qh0));
    memcpy(part + 2 * num_q_heads + qh0 * head_dim, acc + qh0 * head_dim, sizeof(float) * (qh1 - qh0) * head_dim);
}

/* Sequence seq, once every item is done: its spans merged (weights exp(m_p - m)) into
 * `out`, where it was split; nothing else. */
void kvray_decode_merge(const DecodeArgs *a, DecodeScratch *scratch, int64_t seq) {
    const DecodePlan *plan = a->plan;
    if (plan->first_part[seq] < 0) return;
    const int bf16_io = a->bf16_io;
    const int32_t head_dim = a->cache->head_dim, num_q_heads = a->num_q_heads;
    const int64_t per_part = plan->per_part, pieces = num_spans(a->seq_lens[seq], plan->window, plan->span);
    float *os = scratch->own; /* one head's merged sums */
    for (int32_t qh = 0; qh < num_q_heads; qh++) {
        float m = -INFINITY, total = 0.0f;
        for (int64_t p = 0; p < pieces; p++) {
            const float mp = a->parts[(plan->first_part[seq] + p) * per_part + qh];
            m = mp > m ? mp : m;
        }
        for (int32_t x = 0; x < head_dim; x++) os[x] = 0.0f;
        for (int64_t p = 0; p < pieces; p++) {
            const float *base = a->parts + (plan->first_part[seq] + p) * per_part;
            const float w = expf(base[qh] - m);
            total += w * base[num_q_heads + qh];
            const float *acc = base + 2 * num_q_heads + qh * head_dim;
            for (int32_t x = 0; x < head_dim; x++) os[x] += w * acc[x];
        }
        write_out(a->out, a->rows[seq] * a->out_stride + qh * head_dim, os, 1.0f / total, head_dim, bf16_io);
    }
}

static void paged_decode(const void *q, int64_t q_stride, void *out, int64_t out_stride, const Cache cache,
                         const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                         const int64_t *rows, int32_t num_seqs, int32_t num_q_heads, int32_t window,
                         int32_t num_threads, int quant, int bf16_io) {
    kvray_check_tables(&cache, block_tables, table_stride, seq_lens, num_seqs);
    DecodePlan plan = kvray_decode_plan(seq_lens, num_seqs, num_q_heads, cache.num_kv_heads, cache.head_dim,
                                        cache.block_size, window, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        DecodeScratch scratch = kvray_decode_scratch(num_q_heads, cache.head_dim, cache.block_size);
        const DecodeArgs args = {&plan,    plan.parts,   q,        q_stride, out,      out_stride, &cache,
                                 block_tables, table_stride, seq_lens, rows,     num_seqs, num_q_heads, quant,
                                 bf16_io};
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < plan.num_items; i++) kvray_decode_item(&args, &scratch, i);
#pragma omp for schedule(static)
        for (int32_t seq = 0; seq < num_seqs; seq++) kvray_decode_merge(&args, &scratch, seq);
        kvray_decode_scratch_free(&scratch);
    }
    kvray_decode_plan_free(&plan);
}

void kvray_check_tables(const Cache *c, const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                        int32_t num_seqs) {
#ifdef KVRAY_CHECKS
    for (int32_t s = 0; s < num_seqs; s++) {
        const int32_t used = (seq_lens[s] + c->block_size - 1) / c->block_size;
        if (seq_lens[s] < 0 || used > table_stride) {
            fprintf(stderr, "kvray native check: sequence %d: length %d needs %d blocks, its table holds %lld\n", s,
                    seq_lens[s], used, (long long)table_stride);
            abort();
        }
        for (int32_t j = 0; j < used; j++) {
            const int32_t id = block_tables[s * table_stride + j];
            if (id < 0 || id >= c->num_blocks) {
                fprintf(stderr, "kvray native check: sequence %d, block %d: id %d outside the cache's [0, %d)\n", s,
                        j, id, c->num_blocks);
                abort();
            }
        }
    }
#else
    (void)c, (void)block_tables, (void)table_stride, (void)seq_lens, (void)num_seqs;
#endif
}

void kvray_check_slots(const Cache *c, const int64_t *slots, int64_t rows) {
#ifdef KVRAY_CHECKS
    const int64_t most = (int64_t)c->num_blocks * c->block_size;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= most) {
            fprintf(stderr, "kvray native check: row %lld: slot %lld outside the cache's [0, %lld)\n", (long long)r,
                    (long long)slots[r], (long long)most);
            abort();
        }
#else
    (void)c, (void)slots, (void)rows;
#endif
}
