/* Prefill attention on a CPU (fp32 or bf16): one sequence's chunk of new query rows over
 * its whole context (a cached prefix, gathered by the caller, then the chunk itself),
 * causal, grouped-query.
 *
 * Work items are tiles of ROWS consecutive query positions of one query head, longest
 * context first, shared out dynamically. A tile is two register-blocked products, as a
 * GEMM micro-kernel does them (ROWS rows x VECS vectors of sums in registers):
 *   scores = q_tile . K^T   over the keys the tile's last row sees, against K packed once
 *                           per call as [kv head][key block][head_dim][KEYS] (a key block
 *                           of K^T, so one vector load is KEYS/VECS keys' same dimension;
 *                           bf16 where AVX512-BF16 multiplies it: pairs of dimensions,
 *                           [..][head_dim / 2][KEYS][2], two dimensions a `vdpbf16ps`);
 *   an exact softmax per row (its own causal end; later keys weigh 0), then
 *   out = P . V             against V packed as fp32 [kv head][key][head_dim].
 * Each row's result depends only on its own query and context (never on the tile's other
 * rows or the chunk's length beyond it), in fp32 from bf16 or fp32 inputs; a bf16 output is
 * rounded once.
 *
 * Layouts (elements):
 *   q, out   rows [q_len] of [num_q_heads, head_dim], row stride q_stride / out_stride
 *   k, v     rows [kv_len] of [num_kv_heads, head_dim], row stride kv_stride; query row i
 *            is context position kv_len - q_len + i and sees positions 0..that one
 * Supported: head_dim a multiple of 64 (a value block is up to 64 dims); num_q_heads a
 * multiple of num_kv_heads (cpu_native.takes_prefill checks both).
 * Built by kernels/cpu_native.py (-O3 -march=native -fopenmp).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#ifdef __AVX512F__
#define VW 16   /* floats per vector */
#define VECS 4  /* vectors per row of a register tile: ROWS x VECS sums fill 24 of 32 zmm */
#else
#define VW 8
#define VECS 2  /* 12 of 16 ymm (BLIS's 6 x 16 AVX2 tile) */
#endif
#define ROWS 6
#define KEYS (VW * VECS) /* keys of a score block; also the output dims of a value block */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef unsigned short bf16;

static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof(v)); }

static inline float element(const void *base, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const bf16 *)base)[i]) : ((const float *)base)[i];
}

/* K^T of one kv head, one key block: kp[x][j] = k[key0 + j][x] (0 past kv_len) */
static void pack_keys(const void *k, int64_t kv_stride, int64_t key0, int64_t kv_len, int32_t h,
                      int32_t d, float *kp, int is_bf16) {
    for (int j = 0; j < KEYS; j++) {
        const int64_t key = key0 + j;
        for (int32_t x = 0; x < d; x++)
            kp[(int64_t)x * KEYS + j] = key < kv_len ? element(k, key * kv_stride + (int64_t)h * d + x, is_bf16) : 0.0f;
    }
}

static void pack_values(const void *v, int64_t kv_stride, int64_t key, int32_t h, int32_t d, float *vp,
                        int is_bf16) {
    for (int32_t x = 0; x < d; x++) vp[x] = element(v, key * kv_stride + (int64_t)h * d + x, is_bf16);
}

/* s[r][j] = q[r] . k_j for the tile's ROWS rows (q: fp32 [ROWS][d]) over key blocks [0, nb) */
static void tile_scores(const float *q, const float *kp, int32_t d, int64_t nb, float *s, int64_t ld) {
    for (int64_t b = 0; b < nb; b++) {
        const float *panel = kp + b * d * KEYS;
        vf acc[ROWS][VECS];
        memset(acc, 0, sizeof(acc));
        for (int32_t x = 0; x < d; x++) {
            vf kv[VECS];
            for (int c = 0; c < VECS; c++) kv[c] = loadv(panel + (int64_t)x * KEYS + c * VW);
            for (int r = 0; r < ROWS; r++) {
                const vf qb = (vf){0} + q[r * d + x];
                for (int c = 0; c < VECS; c++) acc[r][c] += qb * kv[c];
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < VECS; c++) storev(s + r * ld + b * KEYS + c * VW, acc[r][c]);
    }
}

/* o[r][:] = sum_j p[r][j] v_j over keys [0, n), KEYS output dims at a time */
static void tile_values(const float *p, int64_t ld, const float *vp, int32_t d, int64_t n, float *o) {
    for (int32_t x0 = 0; x0 < d; x0 += KEYS) {
        vf acc[ROWS][VECS];
        memset(acc, 0, sizeof(acc));
        for (int64_t j = 0; j < n; j++) {
            vf vv[VECS];
            for (int c = 0; c < VECS; c++) vv[c] = loadv(vp + j * d + x0 + c * VW);
            for (int r = 0; r < ROWS; r++) {
                const vf pb = (vf){0} + p[r * ld + j];
                for (int c = 0; c < VECS; c++) acc[r][c] += pb * vv[c];
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < VECS; c++) storev(o + r * d + x0 + c * VW, acc[r][c]);
    }
}

/* Where the CPU has AVX512-BF16, a bf16 prefill's scores take `vdpbf16ps` straight from
 * the bf16 q and K: K^T packed as bf16 pairs [kv head][key block][head_dim / 2][KEYS][2]
 * (one vector load: 16 keys' same pair of dimensions), q's pair of dimensions broadcast, two
 * dimensions a multiply (the products exact in fp32, summed in fp32): half the
 * instructions of widening both to fp32. The values' sums stay fp32. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAIRED_KEYS 1

/* K^T of one kv head, one key block, as bf16 pairs: kp[i][j][e] = k[key0 + j][2i + e] */
static void pack_keys_bf16(const bf16 *k, int64_t kv_stride, int64_t key0, int64_t kv_len, int32_t h, int32_t d,
                           bf16 *kp) {
    for (int j = 0; j < KEYS; j++) {
        const int64_t key = key0 + j;
        const bf16 *row = key < kv_len ? k + key * kv_stride + (int64_t)h * d : 0;
        for (int32_t i = 0; i < d / 2; i++)
            for (int e = 0; e < 2; e++) kp[((int64_t)i * KEYS + j) * 2 + e] = row ? row[2 * i + e] : 0;
    }
}

/* s[r][j] = q[r] . k_j for the tile's `rows` rows of bf16 q (rows q_stride apart; the
 * tile's other rows score 0) over key blocks [0, nb) of bf16-pair K^T */
static void tile_scores_bf16(const bf16 *q, int64_t q_stride, int64_t rows, const bf16 *kp, int32_t d, int64_t nb,
                             float *s, int64_t ld) {
    for (int64_t b = 0; b < nb; b++) {
        const bf16 *panel = kp + b * d * KEYS;
        __m512 acc[ROWS][VECS];
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < VECS; c++) acc[r][c] = _mm512_setzero_ps();
        for (int32_t i = 0; i < d / 2; i++) {
            __m512bh kv[VECS];
            for (int c = 0; c < VECS; c++)
                kv[c] = (__m512bh)_mm512_loadu_si512(panel + ((int64_t)i * KEYS + c * VW) * 2);
            for (int r = 0; r < ROWS; r++) {
                int32_t pair = 0;
                if (r < rows) memcpy(&pair, q + r * q_stride + 2 * i, sizeof(pair));
                const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
                for (int c = 0; c < VECS; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qb, kv[c]);
            }
        }
        for (int r = 0; r < ROWS; r++)
            for (int c = 0; c < VECS; c++) _mm512_storeu_ps(s + r * ld + b * KEYS + c * VW, acc[r][c]);
    }
}
#endif

static inline __attribute__((always_inline)) void prefill_attention(const void *q, int64_t q_stride, const void *k, const void *v, int64_t kv_stride,
    void *out, int64_t out_stride, int64_t q_len, int64_t kv_len, int32_t num_q_heads, int32_t num_kv_heads, int32_t d,
    float scale, int32_t num_threads, const int is_bf16) {
    const int32_t group = num_q_heads / num_kv_heads;
    const int64_t nb = (kv_len + KEYS - 1) / KEYS, ld = nb * KEYS, first = kv_len - q_len;
    const int64_t tiles = (q_len + ROWS - 1) / ROWS, items = tiles * num_q_heads;
#ifdef PAIRED_KEYS
    const int paired = is_bf16; /* K^T as bf16 pairs, scored by vdpbf16ps */
#else
    const int paired = 0;
#endif
    void *kp = kvray_malloc((paired ? sizeof(bf16) : sizeof(float)) * num_kv_heads * ld * d);
    float *vp = kvray_malloc(sizeof(float) * num_kv_heads * kv_len * d);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_kv_heads * nb; i++) {
            if (paired) {
#ifdef PAIRED_KEYS
                pack_keys_bf16(k, kv_stride, (i % nb) * KEYS, kv_len, (int32_t)(i / nb), d, (bf16 *)kp + i * KEYS * d);
#endif
            } else {
                pack_keys(k, kv_stride, (i % nb) * KEYS, kv_len, (int32_t)(i / nb), d, (float *)kp + i * KEYS * d,
                          is_bf16);
            }
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_kv_heads * kv_len; i++)
            pack_values(v, kv_stride, i % kv_len, (int32_t)(i / kv_len), d, vp + i * d, is_bf16);
        float *qt = kvray_malloc(sizeof(float) * ROWS * d);
        float *s = kvray_malloc(sizeof(float) * ROWS * ld);
        float *o = kvray_malloc(sizeof(float) * ROWS * d);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t tile = tiles - 1 - item / num_q_heads; /* longest contexts first */
            const int32_t head = (int32_t)(item % num_q_heads), h = head / group;
            const int64_t r0 = tile * ROWS, rows = q_len - r0 < ROWS ? q_len - r0 : ROWS;
            const int64_t seen = first + r0 + rows; /* keys the tile's last row sees */
            const int64_t blocks = (seen + KEYS - 1) / KEYS;
            if (paired) {
#ifdef PAIRED_KEYS
                tile_scores_bf16((const bf16 *)q + r0 * q_stride + (int64_t)head * d, q_stride, rows,
                                 (const bf16 *)kp + (int64_t)h * ld * d, d, blocks, s, ld);
#endif
            } else {
                memset(qt, 0, sizeof(float) * ROWS * d);
                for (int64_t r = 0; r < rows; r++)
                    for (int32_t x = 0; x < d; x++)
                        qt[r * d + x] = element(q, (r0 + r) * q_stride + (int64_t)head * d + x, is_bf16);
                tile_scores(qt, (const float *)kp + (int64_t)h * ld * d, d, blocks, s, ld);
            }
            float inv[ROWS];
            for (int64_t r = 0; r < ROWS; r++) {
                float *sr = s + r * ld;
                const int64_t own = r < rows ? first + r0 + r + 1 : 0; /* keys row r sees */
                for (int64_t j = 0; j < own; j++) sr[j] *= scale;
                float max;
                inv[r] = own ? 1.0f / softmax_numerators(sr, own, &max) : 0.0f;
                for (int64_t j = own; j < seen; j++) sr[j] = 0.0f;
            }
            tile_values(s, ld, vp + (int64_t)h * kv_len * d, d, seen, o);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t at = (r0 + r) * out_stride + (int64_t)head * d;
                for (int32_t x = 0; x < d; x++) {
                    const float value = o[r * d + x] * inv[r];
                    if (is_bf16)
                        ((bf16 *)out)[at + x] = f32_to_bf16(value);
                    else
                        ((float *)out)[at + x] = value;
                }
            }
        }
        free(qt);
        free(s);
        free(o);
    }
    free(kp);
    free(vp);
}

void kvray_prefill_attention_f32(const float *q, int64_t q_stride, const float *k, const float *v,
                                 int64_t kv_stride, float *out, int64_t out_stride, int64_t q_len, int64_t kv_len,
                                 int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, float scale,
                                 int32_t num_threads) {
    prefill_attention(q, q_stride, k, v, kv_stride, out, out_stride, q_len, kv_len, num_q_heads, num_kv_heads,
                      head_dim, scale, num_threads, 0);
}

void kvray_prefill_attention_bf16(const bf16 *q, int64_t q_stride, const bf16 *k, const bf16 *v,
                                  int64_t kv_stride, bf16 *out, int64_t out_stride, int64_t q_len, int64_t kv_len,
                                  int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, float scale,
                                  int32_t num_threads) {
    prefill_attention(q, q_stride, k, v, kv_stride, out, out_stride, q_len, kv_len, num_q_heads, num_kv_heads,
                      head_dim, scale, num_threads, 1);
}
