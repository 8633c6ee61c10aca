/* 8-float vectors for the native CPU kernels: GCC's portable vector extension (one AVX
 * register; SSE/NEON pairs elsewhere), with unaligned loads and stores and a sum; bf16
 * values (the top 16 bits of an fp32) loaded as floats and stored rounded to nearest even. */
#ifndef KVRAY_CPU_VEC_H
#define KVRAY_CPU_VEC_H
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Every allocation of the native kernels: out of memory is a message naming the bytes and
 * an abort (the worker process ends and is replaced), never a NULL written through. */
static inline void *kvray_malloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "kvray native kernels: out of memory allocating %zu bytes\n", bytes);
        abort();
    }
    return p;
}

static inline void *kvray_calloc(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "kvray native kernels: out of memory allocating %zu x %zu bytes\n", count, size);
        abort();
    }
    return p;
}

/* `bytes` aligned to `alignment` (a power of two); rounded up to a multiple of it, as
 * aligned_alloc requires */
static inline void *kvray_aligned_alloc(size_t alignment, size_t bytes) {
    const size_t rounded = (bytes + alignment - 1) / alignment * alignment;
    void *p = aligned_alloc(alignment, rounded ? rounded : alignment);
    if (!p) {
        fprintf(stderr, "kvray native kernels: out of memory allocating %zu aligned bytes\n", bytes);
        abort();
    }
    return p;
}

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof(v)); }

/* A software prefetch of data a kernel reads soon (the next KV block, the next weight
 * panel), into L2 and not L1 (`prefetcht1` on x86). Asked into L1, every line held one of
 * the core's few L1 miss buffers until it came, so few were in flight and the demand loads
 * waited behind them: on a Zen 4, a SmolLM2 decode step's attention at 16 rows x 300
 * context read its K/V at ~15 GB/s (7.1 ms for 30 layers, 3.6 ms with the K/V in cache);
 * into L2, 4.9 ms. The loads then hit L2, a few cycles away (BENCHMARKS.md). */
static inline void prefetch_l2(const void *p) { __builtin_prefetch(p, 0, 2); }

/* 8 int8 codes as floats (an 8-bit KV cache's values before their scale) */
typedef signed char v8c __attribute__((vector_size(8)));

#ifdef __AVX2__
#include <immintrin.h>
static inline v8 load8_i8(const signed char *p) { /* sign-extend, then convert: 3 instructions */
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline v8 load8_i8(const signed char *p) { /* portable: GCC may convert lane by lane */
    v8c v;
    memcpy(&v, p, sizeof(v));
    return __builtin_convertvector(v, v8);
}
#endif

/* bf16 <-> fp32: a bf16 is the high half of an fp32, so widening is a shift; narrowing
 * rounds to nearest even (as torch does) and keeps a NaN a NaN */
typedef unsigned short v8h __attribute__((vector_size(16)));
typedef unsigned int v8u __attribute__((vector_size(32)));

#ifdef __AVX2__
static inline v8 load8_bf16(const unsigned short *p) { /* widen from memory, shift: 2 instructions */
    return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
#else
static inline v8 load8_bf16(const unsigned short *p) { /* portable: GCC splits the widening in halves */
    v8h h;
    memcpy(&h, p, sizeof(h));
    return (v8)(__builtin_convertvector(h, v8u) << 16);
}
#endif

/* ROUND(v): v rounded to the nearest bf16 (as a float: its low 16 bits zero); STORE(p, v)
 * stores it as bf16. The same operations lane by lane at either width (8 here, 16 where
 * AVX-512 has it). */
#define KVRAY_BF16_OUT(ROUND, STORE, VF, VU, VH)                                  \
    static inline VF ROUND(VF v) {                                               \
        const VU u = (VU)v, nan = (VU)(v != v);                                  \
        const VU rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;       \
        return (VF)((rounded & ~nan) | ((u | 0x400000u) & nan));                 \
    }                                                                            \
    static inline void STORE(unsigned short *p, VF v) {                         \
        const VH h = __builtin_convertvector((VU)ROUND(v) >> 16, VH);            \
        memcpy(p, &h, sizeof(h));                                                \
    }
KVRAY_BF16_OUT(round8_bf16, store8_bf16, v8, v8u, v8h)

static inline float bf16_to_f32(unsigned short h) {
    const unsigned int u = (unsigned int)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline unsigned short f32_to_bf16(float f) {
    unsigned int u;
    memcpy(&u, &f, sizeof(u));
    if (f != f) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* the sums of 8 vectors' lanes, as one vector: [sum(a[0]), ..., sum(a[7])] (3 rounds
 * of pairwise shuffles and adds) */
typedef int v8s __attribute__((vector_size(32)));

static inline v8 sums8(const v8 a[8]) {
    const v8s even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const v8s lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8s lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], even) + __builtin_shuffle(a[2 * i], a[2 * i + 1], odd);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shuffle(t[2 * i], t[2 * i + 1], lo2) + __builtin_shuffle(t[2 * i], t[2 * i + 1], hi2);
    return __builtin_shuffle(u[0], u[1], lo4) + __builtin_shuffle(u[0], u[1], hi4);
}

typedef int v8i __attribute__((vector_size(32)));

/* exp of a vector of floats (Cephes' expf: 2^n times a degree-6 polynomial on the reduced
 * argument; about 1 ulp), for arguments <= 0 as a softmax has; below -87 it gives ~0. The
 * same operations lane by lane at either width: exp8, and exp16 where AVX-512 has it. */
#define KVRAY_EXP(NAME, VF, VI)                                                   \
    static inline VF NAME(VF x) {                                                \
        const VF floor_at = (VF){0} - 87.0f;                                     \
        const VI low = x < floor_at;                                             \
        x = (VF)(((VI)x & ~low) | ((VI)floor_at & low));                         \
        const VF fx = x * 1.44269504088896341f + 0.5f;                           \
        VI ni = __builtin_convertvector(fx, VI); /* toward zero: one too high for fx < 0 */ \
        VF n = __builtin_convertvector(ni, VF);                                  \
        const VI over = n > fx;                                                  \
        ni += over;                                                              \
        n += __builtin_convertvector(over, VF);                                  \
        const VF r = x - n * 0.693359375f - n * -2.12194440e-4f;                 \
        VF y = r * 1.9875691500e-4f + 1.3981999507e-3f;                          \
        y = y * r + 8.3334519073e-3f;                                            \
        y = y * r + 4.1665795894e-2f;                                            \
        y = y * r + 1.6666665459e-1f;                                            \
        y = y * r + 5.0000001201e-1f;                                            \
        y = y * (r * r) + r + 1.0f;                                              \
        return y * (VF)((ni + 127) << 23);                                       \
    }
KVRAY_EXP(exp8, v8, v8i)
#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
typedef int v16i __attribute__((vector_size(64)));
KVRAY_EXP(exp16, v16, v16i)
#endif

/* silu(x) = x * sigmoid(x), with the exp of -|x| only (sigmoid(x) = 1 / (1 + e) for x >= 0,
 * e / (1 + e) below, e = exp(-|x|)); the same operations lane by lane at either width */
#define KVRAY_SILU(NAME, VF, VI, EXP)                                             \
    static inline VF NAME(VF x) {                                                \
        const VI negative = x < 0, sign_bit = (VI){0} + (-2147483647 - 1);      \
        const VF e = EXP((VF)((VI)x | sign_bit)); /* exp(-|x|) */               \
        const VF r = 1.0f / (1.0f + e);                                          \
        const VF sigmoid = (VF)(((VI)r & ~negative) | ((VI)(e * r) & negative)); \
        return x * sigmoid;                                                      \
    }
KVRAY_SILU(silu8, v8, v8i, exp8)

#ifdef __AVX512F__
KVRAY_SILU(silu16, v16, v16i, exp16)

/* 16-float loads and stores of fp32 and bf16 rows */
typedef unsigned int v16u __attribute__((vector_size(64)));
typedef unsigned short v16h __attribute__((vector_size(32)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof(v)); }

static inline v16 load16_bf16(const unsigned short *p) {
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}

KVRAY_BF16_OUT(round16_bf16, store16_bf16, v16, v16u, v16h)
#endif

static inline float sum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* the largest of sq[0:n], n >= 1: 16 (AVX-512) or 8 running maxima, then across them (a
 * scalar chain waits ~3 cycles an element) */
static inline float max_of(const float *sq, int64_t n) {
    float m = sq[0];
    int64_t i = 0;
#ifdef __AVX512F__
    if (n >= 16) {
        __m512 ms = _mm512_loadu_ps(sq);
        for (i = 16; i + 16 <= n; i += 16) ms = _mm512_max_ps(ms, _mm512_loadu_ps(sq + i));
        m = _mm512_reduce_max_ps(ms);
    }
#endif
    if (n - i >= 8) {
        v8 ms = load8(sq + i);
        for (i += 8; i + 8 <= n; i += 8) {
            const v8 x = load8(sq + i);
            const v8i above = x > ms;
            ms = (v8)(((v8i)x & above) | ((v8i)ms & ~above));
        }
        for (int r = 0; r < 8; r++) m = ms[r] > m ? ms[r] : m;
    }
    for (; i < n; i++) m = sq[i] > m ? sq[i] : m;
    return m;
}

/* sq[i] = exp(sq[i] - m) for i < n; returns their sum */
static inline float exp_sum(float *sq, int64_t n, float m) {
    float sum = 0.0f;
    int64_t i = 0;
#ifdef __AVX512F__
    if (n >= 16) {
        v16 total = {0};
        for (; i + 16 <= n; i += 16) {
            v16 e;
            memcpy(&e, sq + i, sizeof(e));
            e = exp16(e - m);
            memcpy(sq + i, &e, sizeof(e));
            total += e;
        }
        sum = _mm512_reduce_add_ps((__m512)total);
    }
#endif
    v8 total = {0};
    for (; i + 8 <= n; i += 8) {
        const v8 e = exp8(load8(sq + i) - m);
        store8(sq + i, e);
        total += e;
    }
    sum += sum8(total);
    for (; i < n; i++) {
        sq[i] = expf(sq[i] - m);
        sum += sq[i];
    }
    return sum;
}

/* sq[i] = exp(sq[i] - m) for i < n, where m = max(sq); returns the sum and sets *max */
static inline float softmax_numerators(float *sq, int64_t n, float *max) {
    *max = max_of(sq, n);
    return exp_sum(sq, n, *max);
}
#endif
