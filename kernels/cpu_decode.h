/* Decode attention's pieces (kernels/cpu_decode.c), for the fused decode layers
 * (kernels/cpu_layer.c): a plan of work items per step, scratch per thread, and the items
 * and merges that a parallel region's threads share out. */
#ifndef KVRAY_CPU_DECODE_H
#define KVRAY_CPU_DECODE_H
#include <stdint.h>

enum { F32 = 0, INT8 = 1, BF16 = 2 }; /* how a cache row holds its values */
typedef unsigned short bf16;

typedef struct {
    const char *k_cache, *v_cache;
    /* bytes between token rows, between blocks, between the heads of a token */
    int64_t token_stride, block_stride, head_stride;
    int32_t num_kv_heads, head_dim, block_size;
    float scale;
    int32_t num_blocks; /* the cache's blocks: what a checked build (KVRAY_CHECKS) bounds ids by */
} Cache;

/* A checked build (-DKVRAY_CHECKS, KVRAY_NATIVE_CHECKS=1) stops the process with a message
 * naming the sequence, the position and the id where a step's block table or slot lies
 * outside the cache, before anything is read or written; a normal build checks nothing. */
void kvray_check_tables(const Cache *c, const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                        int32_t num_seqs);
void kvray_check_slots(const Cache *c, const int64_t *slots, int64_t rows);

typedef struct {
    int32_t seq;
    int32_t start, end; /* context positions [start, end) */
    int32_t part;       /* -1: the whole (windowed) context; else its slot among the spans */
    int32_t head0, heads; /* the KV heads it covers */
} Item;

typedef struct {
    Item *items;
    int32_t *first_part; /* per sequence: its first slot among the parts, or -1 (not split) */
    float *parts;        /* split sequences' partial results: [part][q_head] max, sum, then sums */
    int64_t num_items, per_part, num_parts;
    int32_t span, window;
} DecodePlan;

typedef struct {
    float *scores, *own, *q_f32;
} DecodeScratch;

DecodePlan kvray_decode_plan(const int32_t *seq_lens, int32_t num_seqs, int32_t num_q_heads, int32_t num_kv_heads,
                             int32_t head_dim, int32_t block_size, int32_t window, int32_t num_threads);
void kvray_decode_plan_free(DecodePlan *plan);
DecodeScratch kvray_decode_scratch(int32_t num_q_heads, int32_t head_dim, int32_t block_size);
void kvray_decode_scratch_free(DecodeScratch *scratch);
/* A step's decode attention: the plan's items (each a pure function of q and the cache),
 * then, once all are done, the merge of each split sequence. */
typedef struct {
    const DecodePlan *plan;
    float *parts; /* the split sequences' partial results: plan->parts, or a copy of that size */
    const void *q;
    int64_t q_stride;
    void *out;
    int64_t out_stride;
    const Cache *cache;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *seq_lens;
    const int64_t *rows;
    int32_t num_seqs, num_q_heads;
    int quant;   /* the cache's rows: F32, BF16 or INT8 */
    int bf16_io; /* q and out bf16 (the math fp32), else fp32 */
} DecodeArgs;
void kvray_decode_item(const DecodeArgs *a, DecodeScratch *scratch, int64_t i);
void kvray_decode_merge(const DecodeArgs *a, DecodeScratch *scratch, int64_t seq);
#endif
