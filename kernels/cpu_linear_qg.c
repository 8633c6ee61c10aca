/* y = x W^T (+ b) with W held as low-bit codes in groups along k: each group of `group`
 * values (16, 32 or 128) of each output column has its own scale and min, and the weight it
 * stands for is code * scale + min (codes of 4, 5, 6 or 8 bits, unsigned). The weight
 * matmuls of `quantization="int4"` (codes 0..15, groups of 32 or 128) and `"gguf"`, whose blocks
 * repack into this layout without loss (models/gguf_groups.py: Q4_x as 4-bit codes, Q5_x
 * as 5-bit, Q6_K as 6-bit in groups of 16, Q8_0 as 8-bit). Scales (and mins) are fp32, or
 * fp16 where the file's are (`half`); a symmetric format's min is -offset * scale and not
 * stored (`offset` > 0): the codes take the file's bytes, give or take its block headers.
 *
 * The activations are quantized too, as llama.cpp does: each row's group of `group` values
 * (128 as llama.cpp's k-quants take 256 a scale) to int8 codes (scale d = max |x| / 127, rounded to nearest even), and a group's dot
 * product is integer arithmetic: sum_j w_j x_j = scale * d * sum_j code_j xq_j +
 * min * d * sum_j xq_j, the integer sums exact (AVX512-VNNI's `vpdpbusd`: 64 unsigned x
 * signed byte products a instruction, summed in fours into 16 column sums), each group's
 * two terms added to the column's fp32 sum in order (fused multiply-adds). The portable C
 * path does the same arithmetic in the same order, so both give the same bits, and a row's
 * result does not depend on the other rows of the step (speculation's verified tokens
 * equal plain decoding's).
 *
 * Layout (built once by kernels/cpu_groups.py to_panels): a 64-byte header {bits, group,
 * half, offset}, then panels of 16 output columns (P = ceil(n / 16), zero codes, scales and
 * mins past n), each k / group blocks of
 *   codes: 8 bits: group / 4 quads of [16 columns][4 consecutive k] bytes; 4 to 6 bits:
 *          group / 8 64-byte chunks of the codes' low 4 bits, chunk h holding quad 2h in
 *          its low nibbles and quad 2h + 1 in its high ones, then (5 and 6 bits) a plane
 *          per higher bit: a 64-bit mask per quad, bit 4 c + j of column c's code for the
 *          quad's k j
 *   16 scales, then 16 mins unless offset > 0 (fp32, or fp16 where half)
 * so the 16 columns' codes of 4 consecutive k are one 64-byte vector: `vpdpbusd`'s shape
 * (a high bit plane's mask adds its bit to the nibbles with one masked byte add).
 *
 * Rows go through in tiles of up to ROWS_Q over a panel (the panel's block read once for
 * the tile). kvray_linear_q_f32/bf16 quantize x once for all their items; the fused decode
 * step's row phases quantize each row they write for the linear after them
 * (kvray_linear_q_quantize_row); an item given x itself (kvray_linear_item: the attention's
 * output, which no one phase writes a row of at a time) quantizes the rows into a buffer
 * of its thread's own.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "cpu_vec.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAS_VNNI_Q 1
#define HAS_AVX2_Q 0
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAS_VNNI_Q 0
#define HAS_AVX2_Q 1 /* AVX2's `vpmaddubsw`: pairs of u8 x s8 products to i16 */
#else
#define HAS_VNNI_Q 0
#define HAS_AVX2_Q 0
#endif

#define PANEL_Q 16
#define ROWS_Q 8
#define HEADER_Q 64
#define MAX_GROUP_Q 128

typedef struct {
    int32_t bits, group, half, offset;
} HeaderQ;

/* a header's layout and its blocks' sizes in bytes */
typedef struct {
    int bits, group, half, offset;
    int64_t codes, scales, block; /* a block's codes, its 16 scales, the whole block */
} LayoutQ;

static LayoutQ layout_q(const void *w) {
    const HeaderQ *h = (const HeaderQ *)w;
    LayoutQ l = {h->bits, h->group, h->half, h->offset, 0, 0, 0};
    l.codes = (int64_t)l.group * PANEL_Q * l.bits / 8;
    l.scales = PANEL_Q * (l.half ? 2 : 4);
    l.block = l.codes + l.scales * (l.offset ? 1 : 2);
    return l;
}

static inline float half_to_f32(uint16_t h) {
    const int exp = h >> 10 & 31, man = h & 1023;
    const float v = exp == 0 ? ldexpf((float)man, -24) : exp == 31 ? (man ? NAN : INFINITY) : ldexpf((float)(man | 1024), exp - 25);
    return h & 0x8000 ? -v : v;
}

/* column c's scale and min in a block */
static inline void scale_min_q(const LayoutQ *l, const uint8_t *block, int c, float *scale, float *min) {
    const uint8_t *at = block + l->codes;
    uint16_t h;
    if (l->half) {
        memcpy(&h, at + 2 * c, 2);
        *scale = half_to_f32(h);
    } else
        memcpy(scale, at + 4 * c, 4);
    if (l->offset)
        *min = *scale * -(float)l->offset;
    else if (l->half) {
        memcpy(&h, at + l->scales + 2 * c, 2);
        *min = half_to_f32(h);
    } else
        memcpy(min, at + l->scales + 4 * c, 4);
}

/* column c's code for the group's k j */
static inline int32_t code_q(const uint8_t *block, int bits, int group, int c, int j) {
    if (bits == 8) return block[64 * (j / 4) + 4 * c + j % 4];
    int32_t code = block[64 * (j / 8) + 4 * c + j % 4] >> (4 * (j / 4 % 2)) & 15;
    const int bit = 4 * c + j % 4;
    const uint8_t *plane = block + group * 8 + 8 * (j / 4);
    for (int b = 0; b < bits - 4; b++) code |= (plane[b * group * 2 + bit / 8] >> (bit % 8) & 1) << (4 + b);
    return code;
}

/* Rows of x quantized per group: codes [m][k], scales d [m][k / group], and
 * s = d * (sum of the group's codes) [m][k / group] */
typedef struct {
    int8_t *codes;
    float *d, *s;
    int64_t k, groups;
} RowsQ;

/* bytes for m rows of k values quantized in groups */
int64_t kvray_rows_q_bytes(int64_t m, int64_t k, int group) {
    return m * k + 2 * m * (k / group) * (int64_t)sizeof(float);
}

static RowsQ rows_q_at(void *buffer, int64_t m, int64_t k, int group) {
    RowsQ q = {(int8_t *)buffer, 0, 0, k, k / group};
    q.d = (float *)((char *)buffer + m * k);
    q.s = q.d + m * q.groups;
    return q;
}

/* row r of x (fp32, or bf16 widened) quantized per group into q */
static void quantize_row(const void *x, int bf16_x, int group, const RowsQ *q, int64_t r) {
    float v[MAX_GROUP_Q];
    for (int64_t g = 0; g < q->groups; g++) {
        const int64_t at = g * group;
        float amax = 0.0f;
        for (int j = 0; j < group; j++) {
            v[j] = bf16_x ? bf16_to_f32(((const bf16 *)x)[at + j]) : ((const float *)x)[at + j];
            amax = fmaxf(amax, fabsf(v[j]));
        }
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int8_t *codes = q->codes + r * q->k + at;
        int32_t sum = 0;
        for (int j = 0; j < group; j++) {
            float c = nearbyintf(v[j] * id);
            c = c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c;
            codes[j] = (int8_t)c;
            sum += (int32_t)c;
        }
        q->d[r * q->groups + g] = d;
        q->s[r * q->groups + g] = d * (float)sum;
    }
}

/* out[c] = sums[c] (+ bias[c]) for `cols` columns, fp32 or rounded to bf16 */
static inline void store_q(const float *sums, const void *bias, void *out, int cols, int bf16_io) {
    for (int c = 0; c < cols; c++) {
        float v = sums[c];
        if (bias) v += bf16_io ? bf16_to_f32(((const bf16 *)bias)[c]) : ((const float *)bias)[c];
        if (bf16_io)
            ((bf16 *)out)[c] = f32_to_bf16(v);
        else
            ((float *)out)[c] = v;
    }
}

#if HAS_VNNI_Q
static inline __m512 load16_ps(const uint8_t *at, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at)) : _mm512_loadu_ps(at);
}

/* rows r0 .. r0 + rows of q over one panel's blocks: sums[i][16] */
static inline __attribute__((always_inline)) void tile_q(const RowsQ *q, int64_t r0, const uint8_t *panel,
                                                         const int bits, const LayoutQ *l, const int rows,
                                                         float sums[][PANEL_Q]) {
    __m512 acc[ROWS_Q];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    const int group = l->group;
    const __m512i low = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(16), b5 = _mm512_set1_epi8(32);
    for (int64_t g = 0; g < q->groups; g++) {
        const uint8_t *block = panel + g * l->block, *planes = block + group * 8;
        __m512i dot[ROWS_Q];
        const int8_t *xg[ROWS_Q];
        for (int i = 0; i < rows; i++) {
            dot[i] = _mm512_setzero_si512();
            xg[i] = q->codes + (r0 + i) * q->k + g * group;
        }
        if (bits != 8) {
            for (int h = 0; h < group / 8; h++) {
                const __m512i raw = _mm512_loadu_si512(block + 64 * h);
                __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                if (bits >= 5) { /* quad 2h's and 2h + 1's fifth (and sixth) bits */
                    uint64_t m[2];
                    memcpy(m, planes + 16 * h, 16);
                    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(m[0]), lo, b4);
                    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(m[1]), hi, b4);
                    if (bits == 6) {
                        memcpy(m, planes + group * 2 + 16 * h, 16);
                        lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(m[0]), lo, b5);
                        hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(m[1]), hi, b5);
                    }
                }
                for (int i = 0; i < rows; i++) {
                    int32_t a, b;
                    memcpy(&a, xg[i] + 8 * h, 4);
                    memcpy(&b, xg[i] + 8 * h + 4, 4);
                    dot[i] = _mm512_dpbusd_epi32(dot[i], lo, _mm512_set1_epi32(a));
                    dot[i] = _mm512_dpbusd_epi32(dot[i], hi, _mm512_set1_epi32(b));
                }
            }
        } else {
            for (int j = 0; j < group / 4; j++) {
                const __m512i w = _mm512_loadu_si512(block + 64 * j);
                for (int i = 0; i < rows; i++) {
                    int32_t a;
                    memcpy(&a, xg[i] + 4 * j, 4);
                    dot[i] = _mm512_dpbusd_epi32(dot[i], w, _mm512_set1_epi32(a));
                }
            }
        }
        const __m512 scale = load16_ps(block + l->codes, l->half);
        const __m512 min = l->offset ? _mm512_mul_ps(scale, _mm512_set1_ps(-(float)l->offset))
                                     : load16_ps(block + l->codes + l->scales, l->half);
        for (int i = 0; i < rows; i++) {
            const int64_t at = (r0 + i) * q->groups + g;
            const __m512 sd = _mm512_mul_ps(scale, _mm512_set1_ps(q->d[at]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), sd, acc[i]);
            acc[i] = _mm512_fmadd_ps(min, _mm512_set1_ps(q->s[at]), acc[i]);
        }
    }
    for (int i = 0; i < rows; i++) _mm512_storeu_ps(sums[i], acc[i]);
}
#elif HAS_AVX2_Q
/* sum += 4 consecutive products a lane, of 8 columns' codes w (0..63) and the row's 4 codes
 * x: `vpmaddubsw` pairs them into i16 (at most 2 * 63 * 127: no saturation), `vpmaddwd`
 * adds the pairs into i32 */
static inline __m256i dot4_avx2(__m256i sum, __m256i w, __m256i x) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

/* 32 bits of a plane's mask -> 32 bytes, `value` where the bit is set */
static inline __m256i bits_to_bytes(const uint8_t *at, char value) {
    uint32_t m;
    memcpy(&m, at, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                            3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(value));
}

static inline __m256 load8_ps(const uint8_t *at, int half) {
    if (!half) return _mm256_loadu_ps((const float *)at);
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
#else
    float v[8];
    for (int c = 0; c < 8; c++) {
        uint16_t h;
        memcpy(&h, at + 2 * c, 2);
        v[c] = half_to_f32(h);
    }
    return _mm256_loadu_ps(v);
#endif
}

/* as the AVX-512 tile, 8 columns a vector; 8-bit codes as 16 * high nibble + low nibble (a
 * byte code times 127 twice would saturate i16) */
static inline __attribute__((always_inline)) void tile_q(const RowsQ *q, int64_t r0, const uint8_t *panel,
                                                         const int bits, const LayoutQ *l, const int rows,
                                                         float sums[][PANEL_Q]) {
    __m256 acc[ROWS_Q][2];
    for (int i = 0; i < rows; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const int group = l->group;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < q->groups; g++) {
        const uint8_t *block = panel + g * l->block, *planes = block + group * 8;
        __m256i dot[ROWS_Q][2], high[ROWS_Q][2];
        const int8_t *xg[ROWS_Q];
        for (int i = 0; i < rows; i++) {
            dot[i][0] = dot[i][1] = high[i][0] = high[i][1] = _mm256_setzero_si256();
            xg[i] = q->codes + (r0 + i) * q->k + g * group;
        }
        const int chunks = bits == 8 ? group / 4 : group / 8;
        for (int h = 0; h < chunks; h++)
            for (int half = 0; half < 2; half++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 64 * h + 32 * half));
                __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                if (bits == 5 || bits == 6) { /* quad 2h's and 2h + 1's higher bits, these 8 columns' */
                    for (int b = 0; b < bits - 4; b++) {
                        const uint8_t *plane = planes + b * group * 2 + 16 * h + 4 * half;
                        lo = _mm256_or_si256(lo, bits_to_bytes(plane, (char)(16 << b)));
                        hi = _mm256_or_si256(hi, bits_to_bytes(plane + 8, (char)(16 << b)));
                    }
                }
                for (int i = 0; i < rows; i++) {
                    int32_t a, b;
                    memcpy(&a, xg[i] + (bits == 8 ? 4 : 8) * h, 4);
                    if (bits != 8) { /* quad 2h in the low nibbles, 2h + 1 in the high */
                        memcpy(&b, xg[i] + 8 * h + 4, 4);
                        dot[i][half] = dot4_avx2(dot[i][half], lo, _mm256_set1_epi32(a));
                        dot[i][half] = dot4_avx2(dot[i][half], hi, _mm256_set1_epi32(b));
                    } else {
                        const __m256i xa = _mm256_set1_epi32(a);
                        dot[i][half] = dot4_avx2(dot[i][half], lo, xa);
                        high[i][half] = dot4_avx2(high[i][half], hi, xa);
                    }
                }
            }
        for (int half = 0; half < 2; half++) {
            const int64_t at8 = 8 * half * (l->half ? 2 : 4);
            const __m256 scale = load8_ps(block + l->codes + at8, l->half);
            const __m256 min = l->offset ? _mm256_mul_ps(scale, _mm256_set1_ps(-(float)l->offset))
                                         : load8_ps(block + l->codes + l->scales + at8, l->half);
            for (int i = 0; i < rows; i++) {
                const int64_t at = (r0 + i) * q->groups + g;
                const __m256i total = _mm256_add_epi32(dot[i][half], _mm256_slli_epi32(high[i][half], 4));
                const __m256 sd = _mm256_mul_ps(scale, _mm256_set1_ps(q->d[at]));
                acc[i][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), sd, acc[i][half]);
                acc[i][half] = _mm256_fmadd_ps(min, _mm256_set1_ps(q->s[at]), acc[i][half]);
            }
        }
    }
    for (int i = 0; i < rows; i++) {
        _mm256_storeu_ps(sums[i], acc[i][0]);
        _mm256_storeu_ps(sums[i] + 8, acc[i][1]);
    }
}
#else
/* the same arithmetic, in the same order, a column at a time */
static inline __attribute__((always_inline)) void tile_q(const RowsQ *q, int64_t r0, const uint8_t *panel,
                                                         const int bits, const LayoutQ *l, const int rows,
                                                         float sums[][PANEL_Q]) {
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < PANEL_Q; c++) sums[i][c] = 0.0f;
    for (int64_t g = 0; g < q->groups; g++) {
        const uint8_t *block = panel + g * l->block;
        float scale[PANEL_Q], min[PANEL_Q];
        for (int c = 0; c < PANEL_Q; c++) scale_min_q(l, block, c, &scale[c], &min[c]);
        for (int i = 0; i < rows; i++) {
            const int8_t *xg = q->codes + (r0 + i) * q->k + g * l->group;
            const int64_t at = (r0 + i) * q->groups + g;
            for (int c = 0; c < PANEL_Q; c++) {
                int32_t dot = 0;
                for (int j = 0; j < l->group; j++) dot += code_q(block, bits, l->group, c, j) * xg[j];
                sums[i][c] = fmaf((float)dot, scale[c] * q->d[at], sums[i][c]);
                sums[i][c] = fmaf(min[c], q->s[at], sums[i][c]);
            }
        }
    }
}
#endif

typedef void (*tile_q_fn)(const RowsQ *, int64_t, const uint8_t *, const LayoutQ *, float[][PANEL_Q]);
#define TILE_Q(ROWS, BITS)                                                                                      \
    static void tile_q_##ROWS##_##BITS(const RowsQ *q, int64_t r0, const uint8_t *panel, const LayoutQ *l,     \
                                       float sums[][PANEL_Q]) {                                                 \
        tile_q(q, r0, panel, BITS, l, ROWS, sums);                                                              \
    }
#define TILES_OF(BITS) \
    TILE_Q(1, BITS) TILE_Q(2, BITS) TILE_Q(3, BITS) TILE_Q(4, BITS) TILE_Q(5, BITS) TILE_Q(6, BITS) TILE_Q(7, BITS) TILE_Q(8, BITS)
#define ROW_OF(BITS)                                                                                   \
    {0, tile_q_1_##BITS, tile_q_2_##BITS, tile_q_3_##BITS, tile_q_4_##BITS, tile_q_5_##BITS, tile_q_6_##BITS, \
     tile_q_7_##BITS, tile_q_8_##BITS}
TILES_OF(4) TILES_OF(5) TILES_OF(6) TILES_OF(8)
static const tile_q_fn TILES_Q[4][ROWS_Q + 1] = {ROW_OF(4), ROW_OF(5), ROW_OF(6), ROW_OF(8)};

/* Panels [p0, p1) of out = x W^T (+ b) for all m rows of q (bf16_io: bias and out bf16) */
static void panels_q(int bf16_io, const RowsQ *q, const void *w, const void *bias, void *out, int64_t out_stride,
                     int64_t m, int64_t n, int64_t p0, int64_t p1) {
    const LayoutQ l = layout_q(w);
    const int64_t elem = bf16_io ? (int64_t)sizeof(bf16) : (int64_t)sizeof(float);
    const int64_t pb = q->groups * l.block;
    const uint8_t *data = (const uint8_t *)w + HEADER_Q;
    const tile_q_fn *tiles = TILES_Q[l.bits == 8 ? 3 : l.bits - 4];
    float sums[ROWS_Q][PANEL_Q];
    for (int64_t p = p0; p < p1; p++) {
        const int cols = n - p * PANEL_Q < PANEL_Q ? (int)(n - p * PANEL_Q) : PANEL_Q;
        const void *b = bias ? (const char *)bias + p * PANEL_Q * elem : 0;
        for (int64_t r = 0; r < m; r += ROWS_Q) {
            const int rows = m - r < ROWS_Q ? (int)(m - r) : ROWS_Q;
            tiles[rows](q, r, data + p * pb, &l, sums);
            for (int i = 0; i < rows; i++)
                store_q(sums[i], b, (char *)out + ((r + i) * out_stride + p * PANEL_Q) * elem, cols, bf16_io);
        }
    }
}

/* the group size of these panels (cpu_linear.c sizes its buffers with it) */
int kvray_linear_q_group(const void *w) { return ((const HeaderQ *)w)->group; }

/* x's m rows quantized for panels `w` into `buffer` (kvray_rows_q_bytes) */
void kvray_linear_q_quantize(int bf16_x, const void *x, int64_t x_stride, const void *w, int64_t m, int64_t k,
                             void *buffer) {
    const int group = kvray_linear_q_group(w);
    const RowsQ q = rows_q_at(buffer, m, k, group);
    const int64_t elem = bf16_x ? (int64_t)sizeof(bf16) : (int64_t)sizeof(float);
    for (int64_t r = 0; r < m; r++) quantize_row((const char *)x + r * x_stride * elem, bf16_x, group, &q, r);
}

/* row r (of m) alone, into the same layout: where a phase writes its rows one at a time */
void kvray_linear_q_quantize_row(int bf16_x, const void *x_row, const void *w, int64_t m, int64_t k, int64_t r,
                                 void *buffer) {
    const int group = kvray_linear_q_group(w);
    const RowsQ q = rows_q_at(buffer, m, k, group);
    quantize_row(x_row, bf16_x, group, &q, r);
}

/* Panels [p0, p1) from rows quantized once (kvray_linear_q_quantize) */
void kvray_linear_q_panels(int bf16_io, const void *quantized, const void *w, const void *bias, void *out,
                           int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t p0, int64_t p1) {
    const RowsQ q = rows_q_at((void *)quantized, m, k, kvray_linear_q_group(w));
    panels_q(bf16_io, &q, w, bias, out, out_stride, m, n, p0, p1);
}

/* Panels [p0, p1) of x's rows: x quantized here, into a buffer of this thread's own */
void kvray_linear_q_item(int bf16_io, const void *x, int64_t x_stride, const void *w, const void *bias, void *out,
                         int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t p0, int64_t p1) {
    static __thread void *buffer;
    static __thread int64_t capacity;
    const int64_t need = kvray_rows_q_bytes(m, k, kvray_linear_q_group(w));
    if (need > capacity) {
        free(buffer);
        buffer = kvray_malloc(need);
        capacity = need;
    }
    kvray_linear_q_quantize(bf16_io, x, x_stride, w, m, k, buffer);
    kvray_linear_q_panels(bf16_io, buffer, w, bias, out, out_stride, m, n, k, p0, p1);
}

/* whether the grouped codes' dot products run on integer vector units here (AVX512-VNNI or
 * AVX2; else portable C) */
int kvray_linear_q_native(void) { return HAS_VNNI_Q || HAS_AVX2_Q; }

/* Rows `ids` (m of them, each in [0, n)) of the weight [n, k] the panels stand for, into out
 * [m, k] (fp32, or rounded to bf16): an embedding held as grouped codes (a tied LM head's, or
 * its own), looked up; code * scale + min, as the de-quantized weight holds it. */
void kvray_linear_q_rows(const void *w, int64_t n, int64_t k, const int64_t *ids, int64_t m, void *out, int bf16_out) {
    const LayoutQ l = layout_q(w);
    const int64_t groups = k / l.group, pb = groups * l.block;
    const uint8_t *data = (const uint8_t *)w + HEADER_Q;
    (void)n;
    for (int64_t r = 0; r < m; r++) {
        const int c = (int)(ids[r] % PANEL_Q);
        const uint8_t *panel = data + ids[r] / PANEL_Q * pb;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *block = panel + g * l.block;
            float scale, min;
            scale_min_q(&l, block, c, &scale, &min);
            for (int j = 0; j < l.group; j++) {
                const float v = fmaf((float)code_q(block, l.bits, l.group, c, j), scale, min);
                const int64_t at = r * k + g * l.group + j;
                if (bf16_out)
                    ((bf16 *)out)[at] = f32_to_bf16(v);
                else
                    ((float *)out)[at] = v;
            }
        }
    }
}
