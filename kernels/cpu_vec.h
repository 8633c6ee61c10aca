/* 8-float vectors for the native CPU kernels: GCC's portable vector extension (one AVX
 * register; SSE/NEON pairs elsewhere), with unaligned loads and stores and a sum. */
#ifndef KVRAY_CPU_VEC_H
#define KVRAY_CPU_VEC_H
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof(v)); }

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

static inline float sum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
#endif
