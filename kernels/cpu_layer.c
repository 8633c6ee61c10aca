/* A decode step through all of a Llama model's layers in one call (fp32 or bf16).
 *
 * Where every row of a step is a decode row (no prompt chunk) and few enough for the
 * matmul panels, the per-layer work is small: at one sequence, SmolLM2's 30 layers run
 * ~15 torch ops and native calls each, and their Python and dispatch cost about as much as
 * the weights take to stream (BENCHMARKS.md, single stream). Here one parallel region runs
 * every layer, each phase's items shared out as cpu_share.h does (no thread barrier: a
 * thread that another process took off its core holds up nobody, its items are done by the
 * other), each phase writing a buffer of its own for this layer:
 *
 *   x_in = r + z of the layer before    rows (layer 0: the caller's x)
 *   h = RMSNorm(x_in)
 *   qkv = h Wqkv^T (+ b)                panels (kernels/cpu_linear.c)
 *   qk = RoPE(q, k); k, v -> the cache  rows
 *   attn = decode attention             work items, then merges (kernels/cpu_decode.c)
 *   y = attn Wo^T (+ b)                 panels
 *   r = x_in + y, h2 = RMSNorm(r)       rows
 *   gu = h2 Wgu^T (+ b)                 panels
 *   a = silu(g) * u                     rows
 *   z = a Wdown^T (+ b)                 panels
 *
 * and at the end x = r + z of the last layer (and, in a step from its tokens that asks for
 * them, the final norm of x and the LM head's logits: decode_step). The buffers cost ~20 KB
 * per row and layer in bf16 (SmolLM2: 10 MB at 16 rows), written once a step.
 *
 * The math and the roundings are the layers' own (kernels/cpu_ops.c, the panels): in bf16
 * each op's result is rounded to bf16 as the torch layers round it. SiLU uses the kernels'
 * own exp (cpu_vec.h), within an ulp of torch's (fp32 logits agree to ~1e-6); a residual
 * add rounds the sum as the bf16 modules' add does. x [T, hidden] is
 * the residual stream, in and out.
 * Built with the other kernels by kernels/cpu_native.py.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "cpu_share.h"
#include "cpu_vec.h"

typedef struct { /* one layer's tensors (the model's dtype), as cpu_fused.DecodeLayer lays them out */
    const void *input_norm, *post_norm;           /* [hidden] */
    const void *qkv, *o, *gate_up, *down;         /* weights in the panels' layout */
    const void *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* or NULL */
    void *k_cache, *v_cache;                      /* [num_blocks, block_size, Hkv, D], contiguous */
    int32_t window;                               /* attend to the last `window` positions; 0: all */
} DecodeLayer;

typedef struct {
    int32_t hidden, num_q_heads, num_kv_heads, head_dim, intermediate, block_size;
    int32_t kv_int8; /* the caches hold int8 codes, each row's fp32 scale after them (kernels/kv_quant.py) */
    float eps, scale;
    int32_t weight_codes; /* the four linears' panels: 0 the dtype, 1 int8 codes (cpu_linear_q8.c), 2 grouped
                           * codes (cpu_linear_qg.c); the head: Head's */
    int32_t embed_codes;  /* decode_step's embedding: grouped codes' panels (its rows gathered), else rows */
    int32_t num_blocks;   /* each cache's blocks (a checked build bounds block ids and slots by it) */
} DecodeShape;

/* The model's final norm and LM head, where a step ends in its logits (kvray_decode_step_*) */
typedef struct {
    const void *norm;   /* [hidden], the model's dtype */
    const void *panels; /* the head's weight [n, hidden] in the panels' layout (cpu_linear.c) */
    int64_t n;          /* the head's outputs (the vocabulary) */
    float *logits;      /* out: [rows, n] fp32, each the head's output in the model's dtype, widened */
    int64_t *argmax;    /* out: [rows], each row's greedy token (as torch.argmax of logits), or NULL */
    int32_t weight_codes; /* as DecodeShape's */
} Head;

/* from kernels/cpu_ops.c and kernels/cpu_linear.c */
void kvray_rms_row_f32(const float *, const float *, float *, float *, const float *, int64_t, float);
void kvray_rms_row_bf16(const bf16 *, const bf16 *, bf16 *, bf16 *, const bf16 *, int64_t, float);
void kvray_add_row_f32(const float *, const float *, float *, int64_t);
void kvray_add_row_bf16(const bf16 *, const bf16 *, bf16 *, int64_t);
void kvray_rotary_row_f32(const float *, float *, int64_t, int64_t, const float *, const float *);
void kvray_rotary_row_bf16(const bf16 *, bf16 *, int64_t, int64_t, const float *, const float *);
void kvray_silu_mul_row_f32(const float *, const float *, float *, int64_t);
void kvray_silu_mul_row_bf16(const bf16 *, const bf16 *, bf16 *, int64_t);
int64_t kvray_linear_items(int64_t n, int64_t m, int kind, int32_t num_threads);
void kvray_linear_item(int kind, const void *x, int64_t x_stride, const void *w_panels, const void *bias, void *out,
                       int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t items, int64_t i);
int64_t kvray_linear_num_panels(int64_t n, int kind);
int64_t kvray_linear_panel_cols(int kind);
int64_t kvray_argmax_row_f32(const float *x, int64_t n);
/* grouped codes (cpu_linear_qg.c): a linear's input quantized once, a row at a time */
void kvray_linear_item_q(int kind, const void *quantized, const void *w_panels, const void *bias, void *out,
                         int64_t out_stride, int64_t m, int64_t n, int64_t k, int64_t items, int64_t i);
int64_t kvray_rows_q_bytes(int64_t m, int64_t k, int group);
void kvray_linear_q_quantize_row(int bf16_x, const void *x_row, const void *w, int64_t m, int64_t k, int64_t r,
                                 void *buffer);
void kvray_linear_q_rows(const void *w, int64_t n, int64_t k, const int64_t *ids, int64_t m, void *out, int bf16_out);
enum { GROUPED = 2 }; /* DecodeShape.weight_codes of grouped codes */

int64_t kvray_share_redo_ns = 50000;

/* how long a wait for a phase's items lasts before the waiter computes them (cpu_share.h);
 * returns the value before */
int64_t kvray_set_share_redo_ns(int64_t ns) {
    const int64_t before = kvray_share_redo_ns;
    kvray_share_redo_ns = ns;
    return before;
}

enum { PHASES = 10 }; /* per layer (decode attention's items and merge two of them); one more at the end */
enum { ATTEND = 3 };  /* the phase of decode attention's items */

/* Built with -DKVRAY_PHASE_TIMES (`kvray bench kernel-ab --phases`, never the product), each
 * phase's wall time on thread 0's clock adds up here, summed over layers and calls: where a
 * fused step's time goes, phase by phase. */
#ifdef KVRAY_PHASE_TIMES
double kvray_phase_seconds[PHASES];
#define RUN_PHASE(j, fn, arg)                                                                  \
    do {                                                                                       \
        const double start_ = omp_get_wtime();                                                 \
        share_run(&s[j], fn, arg, &scratch);                                                   \
        if (omp_get_thread_num() == 0) kvray_phase_seconds[j] += omp_get_wtime() - start_;     \
    } while (0)
#else
#define RUN_PHASE(j, fn, arg) share_run(&s[j], fn, arg, &scratch)
#endif

/* out = x W^T (+ b): x [m, k], out [m, n], both unit-stride rows; an item is a range of
 * neighbouring panels (kvray_linear_items: one, or at one bf16 row several read at once) */
typedef struct {
    int kind; /* cpu_linear.c's: bf16 x and out in bit 0, the weights' codes (DecodeShape's) above it */
    const void *x, *w, *b;
    void *out;
    int64_t m, n, k, items;
    const void *xq; /* grouped codes: x quantized by the phase that wrote it (RowsOut), or NULL */
} LinearPhase;

static void linear_item(const void *phase, void *scratch, int64_t i) {
    const LinearPhase *c = phase;
    (void)scratch;
    if (c->xq)
        kvray_linear_item_q(c->kind, c->xq, c->w, c->b, c->out, c->n, c->m, c->n, c->k, c->items, i);
    else
        kvray_linear_item(c->kind, c->x, c->k, c->w, c->b, c->out, c->n, c->m, c->n, c->k, c->items, i);
}

/* Where the linear after a row phase takes grouped codes: each row the phase writes is
 * quantized for it there (once, not by each of the linear's items), into xq */
typedef struct {
    void *xq;          /* kvray_rows_q_bytes(m, dim, the linear's group), or NULL: nothing to do */
    const void *w;     /* the linear's panels (their group) */
    int64_t m;         /* the step's rows */
} RowsOut;

static void rows_out(const RowsOut *o, int bf16_io, const void *row, int64_t dim, int64_t r) {
    if (o->xq) kvray_linear_q_quantize_row(bf16_io, row, o->w, o->m, dim, r, o->xq);
}

/* bytes for a step's m rows of k values quantized for grouped codes (any group: the
 * smallest, 16, needs the most), 64-byte multiples; 0 for other weights */
static int64_t rows_out_bytes(int codes, int64_t m, int64_t k) {
    return codes == GROUPED ? (kvray_rows_q_bytes(m, k, 16) + 63) / 64 * 64 : 0;
}

/* the next `bytes` of *at (advanced past them), or NULL for none */
static void *rows_out_take(char **at, int64_t bytes) {
    void *taken = bytes ? *at : 0;
    *at += bytes;
    return taken;
}

/* the LM head's item i (a range of its panels, as linear_item), then, in bf16, its columns
 * of every row widened into the fp32 logits: the bits of the head's bf16 output .float();
 * with `best`, each row's argmax over the item's columns into best[i * rows + r] while
 * they are in this core's cache (head_argmax merges them) */
typedef struct {
    LinearPhase linear;
    float *logits;
    int64_t *best;
} HeadPhase;

static void head_item(const void *phase, void *scratch, int64_t i) {
    const HeadPhase *c = phase;
    const LinearPhase *l = &c->linear;
    linear_item(l, scratch, i);
    const int64_t panels = kvray_linear_num_panels(l->n, l->kind), cols = kvray_linear_panel_cols(l->kind);
    const int64_t first = i * panels / l->items * cols, end = (i + 1) * panels / l->items * cols;
    const int64_t last = end < l->n ? end : l->n;
    for (int64_t r = 0; r < l->m; r++) {
        float *row = c->logits + r * l->n;
        if (l->kind & 1) /* fp32: linear_item wrote the logits themselves */
            for (int64_t col = first; col < last; col++) row[col] = bf16_to_f32(((const bf16 *)l->out)[r * l->n + col]);
        if (c->best) c->best[i * l->m + r] = first + kvray_argmax_row_f32(row + first, last - first);
    }
}

/* each row's argmax from the items' own (in column order: the first NaN, else the first of
 * the largest, as torch.argmax and kvray_argmax_row_f32 take them) */
static void head_argmax(const HeadPhase *c, int64_t *out) {
    const LinearPhase *l = &c->linear;
    for (int64_t r = 0; r < l->m; r++) {
        const float *row = c->logits + r * l->n;
        int64_t arg = c->best[r];
        for (int64_t i = 1; i < l->items && row[arg] == row[arg]; i++) {
            const int64_t at = c->best[i * l->m + r];
            if (row[at] != row[at] || row[at] > row[arg]) arg = at;
        }
        out[r] = arg;
    }
}

/* sum = src + res (where res is given), out = RMSNorm(that) * weight; an item is a row */
typedef struct {
    int bf16_io;
    const void *src, *res;
    void *sum, *out;
    const void *weight;
    int64_t dim;
    float eps;
    RowsOut quantized;
} NormPhase;

static void norm_item(const void *phase, void *scratch, int64_t r) {
    const NormPhase *c = phase;
    const int64_t at = r * c->dim;
    (void)scratch;
    if (c->bf16_io)
        kvray_rms_row_bf16((const bf16 *)c->src + at, c->res ? (const bf16 *)c->res + at : 0,
                           c->res ? (bf16 *)c->sum + at : 0, (bf16 *)c->out + at, c->weight, c->dim, c->eps);
    else
        kvray_rms_row_f32((const float *)c->src + at, c->res ? (const float *)c->res + at : 0,
                          c->res ? (float *)c->sum + at : 0, (float *)c->out + at, c->weight, c->dim, c->eps);
    rows_out(&c->quantized, c->bf16_io, (const char *)c->out + at * (c->bf16_io ? 2 : 4), c->dim, r);
}

/* out = a + b, the residual stream's add (kernels/cpu_ops.c); an item is a row */
typedef struct {
    int bf16_io;
    const void *a, *b;
    void *out;
    int64_t dim;
} AddPhase;

static void add_item(const void *phase, void *scratch, int64_t r) {
    const AddPhase *c = phase;
    const int64_t at = r * c->dim;
    (void)scratch;
    if (c->bf16_io)
        kvray_add_row_bf16((const bf16 *)c->a + at, (const bf16 *)c->b + at, (bf16 *)c->out + at, c->dim);
    else
        kvray_add_row_f32((const float *)c->a + at, (const float *)c->b + at, (float *)c->out + at, c->dim);
}

/* qk = RoPE(the q and k heads of a qkv row); its k and the row's v into the cache at the
 * row's slot; an item is a row */
typedef struct {
    int bf16_io;
    const void *qkv;
    void *qk;
    const DecodeShape *sh;
    const DecodeLayer *l;
    const float *cos, *sin;
    const int64_t *slots;
} RopePhase;

/* One KV head's row of d values (bf16 or fp32) as int8 codes and their fp32 scale, as
 * kv_quant.quantize does it: scale = max |x| / 127 (0 for a zero row, its codes 0), codes
 * x / scale rounded half away from zero; the same fp32 operations, so the same bits. */
static void quantize_row(const void *src, int bf16_io, int64_t d, signed char *dst) {
    float x[d], amax = 0.0f;
    for (int64_t i = 0; i < d; i++) {
        x[i] = bf16_io ? bf16_to_f32(((const bf16 *)src)[i]) : ((const float *)src)[i];
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    }
    const float scale = amax / 127.0f, safe = scale > 0.0f ? scale : 1.0f;
    for (int64_t i = 0; i < d; i++) {
        const float y = x[i] / safe, code = floorf(fabsf(y) + 0.5f);
        dst[i] = (signed char)(y < 0.0f ? -fminf(code, 127.0f) : fminf(code, 127.0f));
    }
    memcpy(dst + d, &scale, sizeof(scale));
}

/* a token's K or V (kv_heads rows of d values) into its cache slot, as the cache holds them */
static void cache_write(void *cache, int64_t slot, const char *src, const DecodeShape *sh, int bf16_io) {
    const int64_t d = sh->head_dim, size = bf16_io ? 2 : 4, kv_width = sh->num_kv_heads * d;
    if (!sh->kv_int8) {
        memcpy((char *)cache + slot * kv_width * size, src, kv_width * size);
        return;
    }
    const int64_t row = d + (int64_t)sizeof(float);
    for (int32_t h = 0; h < sh->num_kv_heads; h++)
        quantize_row(src + h * d * size, bf16_io, d, (signed char *)cache + (slot * sh->num_kv_heads + h) * row);
}

static void rope_item(const void *phase, void *scratch, int64_t r) {
    const RopePhase *c = phase;
    const DecodeShape *sh = c->sh;
    (void)scratch;
    const int64_t d = sh->head_dim, half = d / 2, q_width = sh->num_q_heads * d, kv_width = sh->num_kv_heads * d;
    const int64_t size = c->bf16_io ? 2 : 4, heads = sh->num_q_heads + sh->num_kv_heads;
    const char *row = (const char *)c->qkv + r * (q_width + 2 * kv_width) * size;
    char *qk = (char *)c->qk + r * (q_width + kv_width) * size;
    if (c->bf16_io)
        kvray_rotary_row_bf16((const bf16 *)row, (bf16 *)qk, heads, d, c->cos + r * half, c->sin + r * half);
    else
        kvray_rotary_row_f32((const float *)row, (float *)qk, heads, d, c->cos + r * half, c->sin + r * half);
    cache_write(c->l->k_cache, c->slots[r], qk + q_width * size, sh, c->bf16_io);
    cache_write(c->l->v_cache, c->slots[r], row + (q_width + kv_width) * size, sh, c->bf16_io);
}

/* a = silu(g) * u for gu = [g | u] rows; in bf16 silu(g) is rounded before the product, as
 * torch does; an item is a row */
typedef struct {
    int bf16_io;
    const void *gu;
    void *act;
    int64_t inter;
    RowsOut quantized;
} SiluPhase;

static void silu_item(const void *phase, void *scratch, int64_t r) {
    const SiluPhase *c = phase;
    const int64_t inter = c->inter;
    (void)scratch;
    if (c->bf16_io) {
        const bf16 *g = (const bf16 *)c->gu + r * 2 * inter;
        kvray_silu_mul_row_bf16(g, g + inter, (bf16 *)c->act + r * inter, inter);
    } else {
        const float *g = (const float *)c->gu + r * 2 * inter;
        kvray_silu_mul_row_f32(g, g + inter, (float *)c->act + r * inter, inter);
    }
    rows_out(&c->quantized, c->bf16_io, (const char *)c->act + r * inter * (c->bf16_io ? 2 : 4), inter, r);
}

static void attend_item(const void *phase, void *scratch, int64_t i) { kvray_decode_item(phase, scratch, i); }
static void merge_item(const void *phase, void *scratch, int64_t seq) { kvray_decode_merge(phase, scratch, seq); }

/* A layer's buffers for one step: every phase writes its own (cpu_share.h) */
typedef struct {
    void *x_in; /* the residual stream into the layer (layer 0: the caller's x) */
    void *h, *qkv, *qk, *attn, *y, *r, *h2, *gu, *act, *z;
    float *parts;
    void *h_q, *h2_q, *act_q; /* grouped codes: h, h2 and act quantized for their linears (RowsOut) */
} LayerBuffers;

static void decode_layers(const DecodeLayer *layers, int32_t num_layers, const DecodeShape *sh, void *x, int64_t rows,
                          const float *cos, const float *sin, const int64_t *slots, const int32_t *block_tables,
                          int64_t table_stride, const int32_t *seq_lens, const int64_t *q_rows, int32_t num_seqs,
                          int32_t num_threads, int bf16_io, const Head *head) {
    const int64_t size = bf16_io ? 2 : 4, d = sh->head_dim, hidden = sh->hidden, inter = sh->intermediate;
    const int64_t q_width = sh->num_q_heads * d, kv_width = sh->num_kv_heads * d, qkv_width = q_width + 2 * kv_width;
    const int64_t qk_width = q_width + kv_width;
    const Cache bounds = {.block_size = sh->block_size, .num_blocks = sh->num_blocks};
    kvray_check_tables(&bounds, block_tables, table_stride, seq_lens, num_seqs);
    kvray_check_slots(&bounds, slots, rows);
    /* the attention's work items depend on the window only: a plan per distinct window */
    DecodePlan *plans = kvray_malloc(sizeof(DecodePlan) * num_layers);
    int32_t *plan_of = kvray_malloc(sizeof(int32_t) * num_layers), num_plans = 0;
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
    /* per layer: the buffers, the attention's partial results, each phase's done flags */
    const int64_t widths[] = {hidden, hidden, qkv_width, qk_width, q_width, hidden, hidden, hidden, 2 * inter, inter,
                              hidden};
    int64_t per_layer = 0, parts_total = 0, flags_total = 0;
    for (size_t j = 0; j < sizeof widths / sizeof widths[0]; j++) per_layer += widths[j] * rows * size;
    const int lin = bf16_io | sh->weight_codes << 1; /* the layers' linears' kind (cpu_linear.c) */
    const int64_t items_qkv = kvray_linear_items(qkv_width, rows, lin, num_threads);
    const int64_t items_hidden = kvray_linear_items(hidden, rows, lin, num_threads); /* o and down */
    const int64_t items_gu = kvray_linear_items(2 * inter, rows, lin, num_threads);
    /* then the last layer's r + z (normed for the head where there is one), then the head */
    const int64_t num_shares = PHASES * num_layers + 2;
    const int head_kind = bf16_io | (head ? head->weight_codes << 1 : 0);
    const int64_t items_head = head ? kvray_linear_items(head->n, rows, head_kind, num_threads) : 0;
    Share *shares = kvray_aligned_alloc(64, sizeof(Share) * num_shares); /* a Share is a cache line */
    memset(shares, 0, sizeof(Share) * num_shares);
    for (int32_t i = 0; i < num_layers; i++) {
        const DecodePlan *plan = &plans[plan_of[i]];
        parts_total += plan->num_parts * plan->per_part;
        /* the merge has nothing to do where no sequence is split into spans */
        const int64_t merges = plan->num_parts ? num_seqs : 0;
        const int64_t items[PHASES] = {rows,         items_qkv, rows,     plan->num_items, merges,
                                       items_hidden, rows,      items_gu, rows,            items_hidden};
        /* in runs of neighbours (cpu_share.h), but for attention's items: the plan orders
         * them longest first, and one at a time evens out the threads best */
        for (int j = 0; j < PHASES; j++)
            share_init(&shares[PHASES * i + j], items[j], j == ATTEND ? 1 : 0, num_threads);
    }
    share_init(&shares[num_shares - 2], rows, 0, num_threads);
    share_init(&shares[num_shares - 1], items_head, 0, num_threads);
    for (int64_t j = 0; j < num_shares; j++) flags_total += shares[j].n;
    uint8_t *flags = kvray_calloc(flags_total, 1);
    for (int64_t j = 0, offset = 0; j < num_shares; offset += shares[j].n, j++) shares[j].flags = flags + offset;
    char *arena = kvray_malloc(per_layer * num_layers);
    /* grouped codes: the rows the row phases quantize for the linears after them (RowsOut) */
    const int64_t q_hidden = rows_out_bytes(sh->weight_codes, rows, hidden);
    const int64_t q_inter = rows_out_bytes(sh->weight_codes, rows, inter);
    const int64_t q_head = head ? rows_out_bytes(head->weight_codes, rows, hidden) : 0;
    char *quantized = kvray_malloc((2 * q_hidden + q_inter) * num_layers + q_head + 1), *q_at = quantized;
    /* the head's input rows, and its output before widening (bf16; fp32 writes the logits) */
    void *head_in = head ? kvray_malloc(rows * hidden * size) : 0;
    void *head_out = head && bf16_io ? kvray_malloc(rows * head->n * size) : head ? (void *)head->logits : 0;
    int64_t *head_best = head && head->argmax ? kvray_malloc(sizeof(int64_t) * items_head * rows) : 0;
    float *parts = kvray_malloc(sizeof(float) * (parts_total > 0 ? parts_total : 1));
    LayerBuffers *bufs = kvray_malloc(sizeof(LayerBuffers) * num_layers);
    char *at = arena;
    float *part_at = parts;
    for (int32_t i = 0; i < num_layers; i++) {
        void **slot[] = {&bufs[i].x_in, &bufs[i].h,  &bufs[i].qkv, &bufs[i].qk,  &bufs[i].attn, &bufs[i].y,
                         &bufs[i].r,    &bufs[i].h2, &bufs[i].gu,  &bufs[i].act, &bufs[i].z};
        for (size_t j = 0; j < sizeof widths / sizeof widths[0]; j++) {
            *slot[j] = at;
            at += widths[j] * rows * size;
        }
        if (i == 0) bufs[i].x_in = x;
        const DecodePlan *plan = &plans[plan_of[i]];
        bufs[i].parts = part_at;
        part_at += plan->num_parts * plan->per_part;
        bufs[i].h_q = rows_out_take(&q_at, q_hidden);
        bufs[i].h2_q = rows_out_take(&q_at, q_hidden);
        bufs[i].act_q = rows_out_take(&q_at, q_inter);
    }
    void *head_q = rows_out_take(&q_at, q_head);
    const int64_t row = sh->kv_int8 ? d + (int64_t)sizeof(float) : d * size, token = sh->num_kv_heads * row;
    const int quant = sh->kv_int8 ? INT8 : bf16_io ? BF16 : F32;
#pragma omp parallel num_threads(num_threads)
    {
        DecodeScratch scratch = kvray_decode_scratch(sh->num_q_heads, sh->head_dim, sh->block_size);
        for (int32_t i = 0; i < num_layers; i++) {
            const DecodeLayer *l = &layers[i];
            const LayerBuffers *b = &bufs[i];
            Share *s = shares + PHASES * i;
            const DecodePlan *plan = &plans[plan_of[i]];
            const Cache cache = {(const char *)l->k_cache, (const char *)l->v_cache, token, sh->block_size * token, row,
                                 sh->num_kv_heads, sh->head_dim, sh->block_size, sh->scale, sh->num_blocks};
            /* h = RMSNorm(x_in), x_in = the last layer's r + z */
            const NormPhase norm_in = {bf16_io, i ? bufs[i - 1].r : x, i ? bufs[i - 1].z : 0, b->x_in, b->h,
                                       l->input_norm, hidden, sh->eps, {b->h_q, l->qkv, rows}};
            RUN_PHASE(0, norm_item, &norm_in);
            const LinearPhase qkv = {lin,  b->h,      l->qkv, l->qkv_bias, b->qkv, rows, qkv_width,
                                     hidden, items_qkv, b->h_q};
            RUN_PHASE(1, linear_item, &qkv);
            const RopePhase rope = {bf16_io, b->qkv, b->qk, sh, l, cos, sin, slots};
            RUN_PHASE(2, rope_item, &rope);
            const DecodeArgs attend = {plan,   b->parts,     b->qk,    qk_width, b->attn,  q_width,
                                       &cache, block_tables, table_stride, seq_lens, q_rows, num_seqs,
                                       sh->num_q_heads, quant, bf16_io};
            RUN_PHASE(3, attend_item, &attend);
            RUN_PHASE(4, merge_item, &attend);
            const LinearPhase o = {lin, b->attn, l->o, l->o_bias, b->y, rows, hidden, q_width, items_hidden};
            RUN_PHASE(5, linear_item, &o);
            /* r = x_in + y, h2 = RMSNorm(r) */
            const NormPhase norm_post = {bf16_io, b->x_in, b->y,    b->r,  b->h2, l->post_norm,
                                         hidden,  sh->eps, {b->h2_q, l->gate_up, rows}};
            RUN_PHASE(6, norm_item, &norm_post);
            const LinearPhase gate_up = {lin,  b->h2,  l->gate_up, l->gate_up_bias, b->gu, rows, 2 * inter,
                                         hidden, items_gu, b->h2_q};
            RUN_PHASE(7, linear_item, &gate_up);
            const SiluPhase silu = {bf16_io, b->gu, b->act, inter, {b->act_q, l->down, rows}};
            RUN_PHASE(8, silu_item, &silu);
            const LinearPhase down = {lin,   b->act, l->down, l->down_bias, b->z, rows, hidden,
                                      inter, items_hidden, b->act_q};
            RUN_PHASE(9, linear_item, &down);
        }
        /* x = the last layer's r + z; with a head, head_in = the final RMSNorm of x, then the
         * logits: the bits of compute_logits's norm, linear and .float() */
        const LayerBuffers *last = &bufs[num_layers - 1];
        if (head) {
            const NormPhase norm_out = {bf16_io, last->r, last->z, x, head_in, head->norm, hidden, sh->eps,
                                        {head_q, head->panels, rows}};
            share_run(&shares[num_shares - 2], norm_item, &norm_out, &scratch);
            const HeadPhase logits = {
                {head_kind, head_in, head->panels, 0, head_out, rows, head->n, hidden, items_head, head_q},
                head->logits,
                head_best};
            share_run(&shares[num_shares - 1], head_item, &logits, &scratch);
            if (head_best && omp_get_thread_num() == 0) head_argmax(&logits, head->argmax);
        } else {
            const AddPhase out = {bf16_io, last->r, last->z, x, hidden};
            share_run(&shares[num_shares - 2], add_item, &out, &scratch);
        }
        kvray_decode_scratch_free(&scratch);
    }
    free(quantized);
    free(shares);
    free(bufs);
    free(flags);
    free(parts);
    free(arena);
    free(head_in);
    free(head_best);
    if (head && bf16_io) free(head_out);
    for (int32_t j = 0; j < num_plans; j++) kvray_decode_plan_free(&plans[j]);
    free(plans);
    free(plan_of);
}

/* A decode step from its tokens: x's rows the embedding's rows of `tokens` ([vocab, hidden],
 * the model's dtype), each row's RoPE angles the tables' rows at its position ([max_positions,
 * head_dim / 2] fp32), then every layer as below. One call for what were a dozen torch ops
 * and their tensors a step (~0.15 ms of a 1-row step's ~6.5: BENCHMARKS.md, single stream).
 * With a `head` (else NULL), the final norm and the LM head follow in the same parallel
 * region, into head->logits: no second call, no torch ops between. Returns 0, or -1 with
 * nothing done where a token or a position lies outside its table. */
static int decode_step(const DecodeLayer *layers, int32_t num_layers, const DecodeShape *sh, void *x, int64_t rows,
                       const void *embed, int64_t vocab, const int64_t *tokens, const float *cos_table,
                       const float *sin_table, int64_t max_positions, const int64_t *positions, const int64_t *slots,
                       const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                       const int64_t *q_rows, int32_t num_seqs, int32_t num_threads, int bf16_io,
                       const Head *head) {
    const int64_t half = sh->head_dim / 2, row_bytes = sh->hidden * (bf16_io ? 2 : 4);
    for (int64_t r = 0; r < rows; r++)
        if (tokens[r] < 0 || tokens[r] >= vocab || positions[r] < 0 || positions[r] >= max_positions) return -1;
    float *cos = kvray_malloc(sizeof(float) * 2 * rows * half), *sin = cos + rows * half;
    for (int64_t r = 0; r < rows; r++) {
        if (sh->embed_codes)
            kvray_linear_q_rows(embed, vocab, sh->hidden, tokens + r, 1, (char *)x + r * row_bytes, bf16_io);
        else
            memcpy((char *)x + r * row_bytes, (const char *)embed + tokens[r] * row_bytes, row_bytes);
        memcpy(cos + r * half, cos_table + positions[r] * half, sizeof(float) * half);
        memcpy(sin + r * half, sin_table + positions[r] * half, sizeof(float) * half);
    }
    decode_layers(layers, num_layers, sh, x, rows, cos, sin, slots, block_tables, table_stride, seq_lens, q_rows,
                  num_seqs, num_threads, bf16_io, head);
    free(cos);
    return 0;
}

#define DECODE_STEP(SUFFIX, T, BF16)                                                                                 \
    int kvray_decode_step_##SUFFIX(const DecodeLayer *layers, int32_t num_layers, const DecodeShape *shape, T *x,    \
                                   int64_t rows, const T *embed, int64_t vocab, const int64_t *tokens,               \
                                   const float *cos_table, const float *sin_table, int64_t max_positions,            \
                                   const int64_t *positions, const int64_t *slots, const int32_t *block_tables,      \
                                   int64_t table_stride, const int32_t *seq_lens, const int64_t *q_rows,             \
                                   int32_t num_seqs, int32_t num_threads, const Head *head) {                        \
        return decode_step(layers, num_layers, shape, x, rows, embed, vocab, tokens, cos_table, sin_table,           \
                           max_positions, positions, slots, block_tables, table_stride, seq_lens, q_rows, num_seqs,   \
                           num_threads, BF16, head);                                                                 \
    }
DECODE_STEP(f32, float, 0)
DECODE_STEP(bf16, bf16, 1)

/* x [rows, hidden]: the residual stream into the first layer, out of the last; cos, sin
 * [rows, head_dim / 2] fp32; slots [rows]: each row's cache slot; block_tables, seq_lens,
 * q_rows: the step's decode rows as kvray_paged_decode_* takes them */
void kvray_decode_layers_f32(const DecodeLayer *layers, int32_t num_layers, const DecodeShape *shape, float *x,
                             int64_t rows, const float *cos, const float *sin, const int64_t *slots,
                             const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                             const int64_t *q_rows, int32_t num_seqs, int32_t num_threads) {
    decode_layers(layers, num_layers, shape, x, rows, cos, sin, slots, block_tables, table_stride, seq_lens, q_rows,
                  num_seqs, num_threads, 0, 0);
}

void kvray_decode_layers_bf16(const DecodeLayer *layers, int32_t num_layers, const DecodeShape *shape, bf16 *x,
                              int64_t rows, const float *cos, const float *sin, const int64_t *slots,
                              const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                              const int64_t *q_rows, int32_t num_seqs, int32_t num_threads) {
    decode_layers(layers, num_layers, shape, x, rows, cos, sin, slots, block_tables, table_stride, seq_lens, q_rows,
                  num_seqs, num_threads, 1, 0);
}
