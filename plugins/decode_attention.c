/* DecodeAttention: attention over the runner's KV cache as an onnxruntime CPU custom op, in the place of
 * com.microsoft::GroupQueryAttention under plugins/attention.py's contract (rotary embedding, grouped-query
 * attention, the new K/V written into the cache in place). A call of up to MAX_STEPS tokens a row (every decode
 * step, speculative verify trees, short prompt chunks) runs this file's kernel: each cached K and V row is read once
 * for all the query heads that share it and all the row's new tokens, the positions are split into chunks over the
 * session's threads (flash-decoding), and the rows are prefetched ahead of use (after a step's weights have streamed
 * through the caches, the cache rows come from memory). Longer prompt chunks run onnxruntime's own
 * GroupQueryAttention on the same inputs and outputs (InvokeOp). docs/measurements.md has what it gains over
 * onnxruntime's kernel.
 *
 * Inputs (GroupQueryAttention's that an fp32 cache with rotary embedding uses): qkv [B, T, (H + 2 KVH) D] f32,
 * past_key / past_value [B, KVH, L, D] f32, seqlens_k [B] i32 (P_b + Q_b - 1), total_sequence_length [] i32,
 * cos_cache / sin_cache [positions, D / 2] f32, position_ids [B, T] i64, attention_bias [B, 1, T, W] f32,
 * query_lens [B] i32 (Q_b; 0 for a row that takes no part). Outputs: out [B, T, H D] f32, present_key /
 * present_value [B, KVH, L, D]: the past buffers with the new K/V written (the runner binds present to past, so
 * only those positions are written; otherwise the past is copied first). Attributes: num_heads, kv_num_heads,
 * scale. Real token t of row b (t < Q_b) is written at P_b + t and attends to positions 0 .. P_b + t plus the bias; a
 * padding token (t >= Q_b) or a row that takes no part (Q_b = 0) gets a zero output.
 *
 * DecodeAttentionInt8Cache is the same kernel over an int8 cache (GroupQueryAttention's k_quant_type / v_quant_type
 * PER_CHANNEL, kv_cache_bit_width 8): past / present int8, and two more inputs, k_scale / v_scale [1, KVH, 1, D] f32.
 * A new token's K (rotated) and V are written as round(x / scale), ties to even, saturated to int8; a unit of work
 * turns the rows it reads into floats (code x scale, as the reference reads them) in a buffer of its own, so the
 * loops below are the float cache's and a verify call still computes what decode steps compute. Over an int8 cache
 * it takes prompt chunks of up to MAX_STEPS_INT8_CACHE tokens too: onnxruntime's int8-cache kernel is slower than
 * this one there, while over a float cache onnxruntime's (a matrix product) is the faster one for long chunks
 * (docs/measurements.md).
 *
 * onnxruntime's C ABI is reached as ort_abi.h declares; native_ops.c registers the ops.
 */
#include "ort_abi.h"

/* the node's inputs: GroupQueryAttention's that an fp32 cache with rotary embedding uses, in its order, then an int8
 * cache's scales (DecodeAttentionInt8Cache only) */
enum { IN_QKV, IN_PAST_KEY, IN_PAST_VALUE, IN_SEQLENS_K, IN_TOTAL_LEN, IN_COS, IN_SIN, IN_POSITIONS, IN_BIAS,
       IN_QUERY_LENS, IN_K_SCALE, IN_V_SCALE, INPUTS_INT8_CACHE };
#define INPUTS IN_K_SCALE /* a float cache's */
#define GQA_INPUTS 17 /* where those sit among GroupQueryAttention's inputs: */
static const int gqa_slot[INPUTS_INT8_CACHE] = {0, 3, 4, 5, 6, 7, 8, 9, 10, 16, 12, 13};

typedef struct Kernel {
  OrtApiTable api;
  int64_t num_heads, kv_heads;
  float scale;
  OrtOp *gqa; /* onnxruntime's own kernel, for calls with more than one token per row (prompt chunks, verify) */
  int wide;   /* blocks of WIDE_QUERY_BLOCK queries on 512-bit vectors: the CPU has AVX-512 F, and KERNEL_ISA_VARIABLE
                 does not say avx2 */
  int int8_cache; /* a DecodeAttentionInt8Cache node */
} Kernel;

static size_t node_inputs(const Kernel *kernel) { return kernel->int8_cache ? INPUTS_INT8_CACHE : INPUTS; }

/* The work is split into units of (row, kv head, chunk of CHUNK positions, block of QUERY_BLOCK queries, or of
 * WIDE_QUERY_BLOCK where the CPU has AVX-512 and a row has more than QUERY_BLOCK: the row's new tokens times the query
 * heads that share the kv head); each unit scores its positions for its queries (reading
 * each K and V row once for all of them), and leaves per query the maximum score, the sum of exp(score - maximum) and
 * the exp-weighted sum of V rows; `combine` then merges a row's chunks (flash-decoding's split of the positions, so
 * that one long row still keeps every thread busy). */
#define CHUNK 128
#define MAX_STEPS 16   /* new tokens a row for this kernel; longer chunks run onnxruntime's */
#define MAX_STEPS_INT8_CACHE 128 /* the same over an int8 cache, where onnxruntime's kernel is slower than ours */
#define MOST_STEPS MAX_STEPS_INT8_CACHE /* the most new tokens a row any call of this kernel has */
#define MAX_HEAD_DIM 256
#define QUERY_BLOCK 8       /* queries a unit computes together, a vector lane each */
#define WIDE_QUERY_BLOCK 16 /* the same on 512-bit vectors */
#define WIDE_BLOCK 4        /* from this many queries in a block the lanes hold queries; below, each query alone */
/* a bias at or below this masks a position (the runner's is float's lowest): its weight is exactly zero, as in a
 * decode step of the same token, where the position is not in the cache at all */
#define MASKED_BIAS -1e30f
#define DOT_LANES 16 /* head_dim is a multiple of 16 (plugins/attention.py checks it at build time) */
/* The cache rows come from memory: the weights streamed through the caches since the layer's last step. The
 * hardware prefetcher alone left this loop waiting on them; 32 rows ahead measured best (docs/measurements.md) */
#define PREFETCH_ROWS 32
#define LINE_FLOATS 16 /* floats per 64-byte cache line */
#define LINE_BYTES 64
/* floats of a query's weighted V a decode step keeps in registers at a time; with 2-3 queries (a decode step's
 * grouped heads) half as many each, so that one pass over the V rows serves them all (a pass per query read the rows
 * once from memory and again from the L2: the attention of a decode step after 650 positions 1.06-1.10x slower on a
 * Zen 4 VM) */
#define V_BLOCK 64

typedef struct Work {
  const float *q_scaled; /* [B, KVH, T, group, D]: rotated, times the softmax scale */
  const float *keys, *values; /* the present cache [B, KVH, L, D], a float one (NULL for an int8 cache) */
  const int8_t *keys8, *values8; /* an int8 one (NULL for a float cache) */
  const float *k_scale, *v_scale; /* the int8 cache's scales [KVH, D] */
  const float *bias; /* [B, T, W] */
  const int32_t *seqlens_k, *query_lens;
  float *partials; /* [B, KVH, chunks, T x group, 2 + D]: maximum, sum, weighted V */
  int64_t kv_heads, group, steps, head_dim, length, bias_width, chunks, query_blocks;
  int64_t query_block; /* QUERY_BLOCK, or WIDE_QUERY_BLOCK where the CPU has AVX-512 */
} Work;

typedef float floats8 __attribute__((vector_size(32)));
typedef int32_t ints8 __attribute__((vector_size(32)));
typedef float floats16 __attribute__((vector_size(64)));
#define SOFTMAX_LANES 8 /* a query's ranks are softmaxed 8 at a time; CHUNK is a multiple of it */

/* where `mask` is set (all ones), a; elsewhere b (a macro: a function that takes and returns vectors would change the
 * ABI of the clone without AVX, and GCC warns of it) */
#define select8(mask, a, b) ((floats8)(((mask) & (ints8)(a)) | (~(mask) & (ints8)(b))))

/* e^x for x <= 0, 8 lanes in place, within ~2 float ulps: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
 * series to r^6, 2^n through the exponent bits (expf would be a call per score) */
__attribute__((always_inline)) static inline void exp_nonpositive(floats8 *value) {
  const floats8 x = select8(*value < -87.0f, (floats8){0} - 87.0f, *value);
  const floats8 n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
  const floats8 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  /* ln2 in two parts, the first exact */
  const floats8 p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  *value = p * (floats8)((__builtin_convertvector(n, ints8) + 127) << 23);
}

/* Every query's arithmetic is the same sequence of operations whatever the call around it, its lane or its block: a
 * decode step of its token on a cache that holds its ancestors at consecutive positions would do exactly these. A
 * query sees the row's cached positions, then the new tokens it may see (itself, and in a verify tree its ancestors:
 * the bias masks the other branches), ranked in that order; chunk c holds its ranks 128c .. 128c + 127, as a decode
 * step's chunk holds those positions. Its scores are DOT_LANES partial sums over the head dimension added up
 * pairwise (`score`'s tree), its softmax runs over its ranks SOFTMAX_LANES at a time (rank j in lane j % 8, the lanes
 * summed pairwise), its weighted V over its ranks in order. So a verify step's token computes bit for bit what a
 * decode step of that token computes, and speculation keeps the plain engine's greedy tokens. */

/* acc[a] += weight x the a-th 8 values of v, for a < vectors */
__attribute__((always_inline)) static inline void add_weighted(floats8 *acc, float weight, const float *v,
                                                               int64_t vectors) {
  for (int64_t a = 0; a < vectors; a++) {
    floats8 x;
    memcpy(&x, v + 8 * a, sizeof(x));
    acc[a] += weight * x;
  }
}

/* query b's score: the dot product of its values and a K row, as DOT_LANES partial sums P_l (d = l mod 16, in order
 * of d) added pairwise, four levels deep rather than a chain of fifteen adds: s_l = P_l + P_l+8, then
 * ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)) (the partial sums in two vectors: lanes 0-7 and 8-15) */
static inline float score(const float *q, const float *k, int64_t d_count) {
  floats8 low = {0.0f}, high = {0.0f}; /* independent partial sums: no serial chain of adds */
  for (int64_t d = 0; d < d_count; d += DOT_LANES) {
    floats8 q_low, q_high, k_low, k_high;
    memcpy(&q_low, q + d, sizeof(q_low));
    memcpy(&q_high, q + d + 8, sizeof(q_high));
    memcpy(&k_low, k + d, sizeof(k_low));
    memcpy(&k_high, k + d + 8, sizeof(k_high));
    low += q_low * k_low;
    high += q_high * k_high;
  }
  const floats8 eight = low + high;
  const float four[4] = {eight[0] + eight[4], eight[1] + eight[5], eight[2] + eight[6], eight[3] + eight[7]};
  return (four[0] + four[2]) + (four[1] + four[3]);
}

/* The scores of a block of queries side by side in the lanes of VEC (t[d]: lane b holds query b's d-th value),
 * `rows` K rows at a time (k: the first, d_count floats apart), each computed as `score` computes it. Each query's
 * partial sums are formed two at a time, P_l and P_l+8, for all the rows, and folded into score's tree as they come:
 * a query vector loaded serves every row, and only a few sums a row are live, so they stay in registers (a row's 16
 * partial sums beside the broadcast K values do not fit there). */
#define DEFINE_LANE_SCORES(VEC, MOST_ROWS)                                                                           \
  __attribute__((always_inline)) static inline void pair_sums_##VEC(const VEC *t, const float *k, int64_t d_count,  \
                                                                    int l, const int rows, VEC *s) {                \
    VEC low[MOST_ROWS] = {{0.0f}}, high[MOST_ROWS] = {{0.0f}};                                                       \
    for (int64_t d = 0; d < d_count; d += DOT_LANES)                                                                 \
      for (int r = 0; r < rows; r++) {                                                                               \
        low[r] += t[d + l] * k[r * d_count + d + l];                                                                 \
        high[r] += t[d + l + 8] * k[r * d_count + d + l + 8];                                                        \
      }                                                                                                              \
    for (int r = 0; r < rows; r++) s[r] = low[r] + high[r];                                                          \
  }                                                                                                                  \
  __attribute__((always_inline)) static inline void lane_scores_##VEC(const VEC *t, const float *k, int64_t d_count, \
                                                                      const int rows, VEC *total) {                 \
    VEC x[MOST_ROWS], y[MOST_ROWS], pair[MOST_ROWS], left[MOST_ROWS];                                                \
    pair_sums_##VEC(t, k, d_count, 0, rows, x);                                                                      \
    pair_sums_##VEC(t, k, d_count, 4, rows, y);                                                                      \
    for (int r = 0; r < rows; r++) pair[r] = x[r] + y[r];                                                            \
    pair_sums_##VEC(t, k, d_count, 2, rows, x);                                                                      \
    pair_sums_##VEC(t, k, d_count, 6, rows, y);                                                                      \
    for (int r = 0; r < rows; r++) left[r] = pair[r] + (x[r] + y[r]);                                                \
    pair_sums_##VEC(t, k, d_count, 1, rows, x);                                                                      \
    pair_sums_##VEC(t, k, d_count, 5, rows, y);                                                                      \
    for (int r = 0; r < rows; r++) pair[r] = x[r] + y[r];                                                            \
    pair_sums_##VEC(t, k, d_count, 3, rows, x);                                                                      \
    pair_sums_##VEC(t, k, d_count, 7, rows, y);                                                                      \
    for (int r = 0; r < rows; r++) total[r] = left[r] + (pair[r] + (x[r] + y[r]));                                  \
  }                                                                                                                  \
  /* scores[b][j] for the block's queries b < block and K rows j < count */                                          \
  __attribute__((always_inline)) static inline void block_scores_##VEC(const VEC *t, const float *keys,             \
                                                                       int64_t d_count, int64_t block,              \
                                                                       int64_t count, float scores[][CHUNK]) {      \
    for (int64_t j = 0; j < count;) {                                                                                \
      const int rows = count - j >= MOST_ROWS ? MOST_ROWS : 1;                                                       \
      const float *k = keys + j * d_count;                                                                           \
      for (int64_t e = PREFETCH_ROWS * d_count; e < (PREFETCH_ROWS + rows) * d_count; e += LINE_FLOATS)              \
        prefetch_into_l2(k + e);                                                                                     \
      VEC total[MOST_ROWS];                                                                                          \
      if (rows == MOST_ROWS)                                                                                         \
        lane_scores_##VEC(t, k, d_count, MOST_ROWS, total);                                                          \
      else                                                                                                           \
        lane_scores_##VEC(t, k, d_count, 1, total);                                                                  \
      for (int r = 0; r < rows; r++, j++)                                                                            \
        for (int64_t b = 0; b < block; b++) scores[b][j] = total[r][b];                                              \
    }                                                                                                                \
  }
/* 4 K rows at a time: 8 chains of fmas in flight, which keep both fma pipes busy; on 256-bit vectors (16 registers)
 * a few of the tree's sums spill, which measured no slower than 2 rows without spills */
DEFINE_LANE_SCORES(floats16, 4)
DEFINE_LANE_SCORES(floats8, 4)

/* `count` rows of an int8 cache as the values attention reads: int8 x its channel's scale, the float product the
 * reference computes (a loop GCC turns into vpmovsxbw / vpmovsxwd / vcvtdq2ps: building a vector lane by lane from
 * int8 codes, it would convert them one at a time) */
__attribute__((always_inline)) static inline void dequantize_rows(const int8_t *rows, const float *scale, int64_t count,
                                                                  int64_t d_count, float *out) {
  for (int64_t r = 0; r < count; r++)
    for (int64_t d = 0; d < d_count; d++) out[r * d_count + d] = (float)rows[r * d_count + d] * scale[d];
}

/* The wide path's two loops on 512-bit vectors, for blocks of up to WIDE_QUERY_BLOCK queries: the same operations
 * per query as on 256-bit ones (lanes are queries in the scores, head dimensions in the weighted V), so the results
 * are the same bit for bit; half the instructions. */

/* scores[b][j] for the block's queries b and its chunk's cached K rows j (keys: the chunk's first row) */
__attribute__((target("avx2,fma,avx512f"))) static void wide_scores_512(const float *q, const float *keys,
                                                                       int64_t d_count, int64_t block, int64_t cached,
                                                                       float scores[][CHUNK]) {
  floats16 transposed[MAX_HEAD_DIM]; /* lane b of element d: query b's d-th value */
  for (int64_t d = 0; d < d_count; d++)
    for (int64_t b = 0; b < WIDE_QUERY_BLOCK; b++) transposed[d][b] = b < block ? q[b * d_count + d] : 0.0f;
  block_scores_floats16(transposed, keys, d_count, block, cached, scores);
}

/* every query's weighted V (the rows the block shares, then its own new tokens': `shared` is the unit's cached rows,
 * or all its rows where the block is contiguous and no query has rows of its own), 16 head dimensions at a time in
 * registers, into its partial */
__attribute__((target("avx2,fma,avx512f"))) static void wide_values_512(
    const float *values, int64_t shared, const int64_t fresh[][MOST_STEPS], const int64_t *count,
    int64_t d_count, int64_t block, const float scores[][CHUNK], float *partial, int64_t stride) {
  for (int64_t d = 0; d < d_count; d += 16) {
    floats16 acc[WIDE_QUERY_BLOCK] = {{0.0f}};
    for (int64_t j = 0; j < shared; j++) {
      floats16 v;
      memcpy(&v, values + j * d_count + d, sizeof(v));
      if (d == 0)
        for (int64_t e = 0; e < d_count; e += LINE_FLOATS)
          prefetch_into_l2(values + (j + PREFETCH_ROWS) * d_count + e);
      for (int64_t b = 0; b < WIDE_QUERY_BLOCK; b++) acc[b] += scores[b][j] * v;
    }
    for (int64_t b = 0; b < block; b++) {
      for (int64_t j = shared; j < count[b]; j++) {
        floats16 v;
        memcpy(&v, values + fresh[b][j - shared] * d_count + d, sizeof(v));
        acc[b] += scores[b][j] * v;
      }
      memcpy(partial + b * stride + 2 + d, &acc[b], sizeof(floats16));
    }
  }
}

/* attend_chunk's clones, the best one the CPU runs chosen at load time. On AVX-512 CPUs (x86-64-v4) its 256-bit loops
 * get 32 vector registers and the int8 cache's rows become floats 16 at a time: a decode step over an int8 cache
 * 1.07-1.10x faster after 650 positions on a Zen 4 VM, a float one unchanged (docs/measurements.md). The same
 * operations in every clone, so the same results bit for bit (tested: a library built with the clones this macro
 * names instead). */
#ifndef ATTEND_CLONES
#define ATTEND_CLONES "arch=x86-64-v4", "arch=x86-64-v3", "default"
#endif
__attribute__((target_clones(ATTEND_CLONES)))
static void attend_chunk(void *data, size_t unit) {
  const Work *w = data;
  const int64_t d_count = w->head_dim, group = w->group, queries = w->steps * group, stride = 2 + d_count;
  const int64_t query_block = (int64_t)unit % w->query_blocks, rest = (int64_t)unit / w->query_blocks;
  const int64_t chunk = rest % w->chunks, kv = rest / w->chunks, row = kv / w->kv_heads;
  const int64_t i0 = query_block * w->query_block, real = w->query_lens[row];
  float *partial = w->partials + ((kv * w->chunks + chunk) * queries + i0) * stride;
  const int64_t block = real * group - i0 < w->query_block ? real * group - i0 : w->query_block; /* real queries here */
  for (int64_t b = 0; b < w->query_block && i0 + b < queries; b++) partial[b * stride + 1] = 0.0f; /* empty: a zero sum */
  if (block <= 0) return;
  const int64_t first = chunk * CHUNK, past = (int64_t)w->seqlens_k[row] + 1 - real;
  const int64_t cached = past - first <= 0 ? 0 : past - first < CHUNK ? past - first : CHUNK; /* shared by all */
  /* per query, the new tokens it sees whose ranks fall in this chunk (their slots after `past`, in order, counted
   * from the chunk's first position as every row below is) */
  int64_t fresh[WIDE_QUERY_BLOCK][MOST_STEPS], fresh_count[WIDE_QUERY_BLOCK], count[WIDE_QUERY_BLOCK];
  int64_t most = cached;
  for (int64_t b = 0; b < block; b++) {
    const int64_t token = (i0 + b) / group;
    const float *bias = w->bias + (row * w->steps + token) * w->bias_width;
    int64_t rank = past;
    fresh_count[b] = 0;
    for (int64_t s = 0; s <= token; s++) {
      if (bias[past + s] <= MASKED_BIAS) continue; /* another branch of the tree */
      if (rank >= first && rank < first + CHUNK) fresh[b][fresh_count[b]++] = past + s - first;
      rank++;
    }
    count[b] = cached + fresh_count[b];
    most = count[b] > most ? count[b] : most;
  }
  if (most == 0) return;
  const float *q = w->q_scaled + (kv * queries + i0) * d_count;
  int64_t rows = cached; /* the cache rows the unit reads: its cached positions, then the new tokens' slots */
  for (int64_t b = 0; b < block; b++)
    if (fresh_count[b] && fresh[b][fresh_count[b] - 1] + 1 > rows) rows = fresh[b][fresh_count[b] - 1] + 1;
  const int64_t base = (kv * w->length + first) * d_count; /* the chunk's first position in the cache */
  const float *keys, *values;
  float dequantized[w->keys8 ? rows * d_count : 1]; /* an int8 cache's rows as floats: K, then V in the same place */
  if (w->keys8) { /* K's rows as floats now, V's after the softmax: every query then computes as over a float cache
                     of those values, while the rows come from memory at a quarter of the bytes */
    for (int64_t j = 0; j < rows * d_count; j += LINE_BYTES) {
      prefetch_into_l2(w->keys8 + base + j);
      prefetch_into_l2(w->values8 + base + j);
    }
    dequantize_rows(w->keys8 + base, w->k_scale + kv % w->kv_heads * d_count, rows, d_count, dequantized);
    keys = values = dequantized;
  } else {
    keys = w->keys + base;
    values = w->values + base;
    for (int64_t j = 0; j < (cached < PREFETCH_ROWS ? cached : PREFETCH_ROWS) * d_count; j += LINE_FLOATS) {
      prefetch_into_l2(keys + j); /* the rows the loops' own prefetches do not reach */
      prefetch_into_l2(values + j);
    }
  }
  /* A block of several queries whose new tokens each see all those before them (a prompt chunk; in a verify tree, a
   * chain) scores the new tokens' rows with the cached ones, in the lanes, each query's rows past its own masked:
   * the same sums as scoring them one by one, and those rows weigh exactly nothing. */
  int contiguous = block >= WIDE_BLOCK;
  for (int64_t b = 0; b < block && contiguous; b++)
    for (int64_t f = 0; f < fresh_count[b] && contiguous; f++) contiguous = fresh[b][f] == cached + f;
  const int64_t shared = contiguous ? rows : cached; /* the rows every query of the block is scored against */
  float scores[WIDE_QUERY_BLOCK][CHUNK];
  if (w->query_block == WIDE_QUERY_BLOCK && block >= WIDE_BLOCK) {
    wide_scores_512(q, keys, d_count, block, shared, scores);
  } else if (block < WIDE_BLOCK) { /* a few queries (a decode step): each score on its own */
    for (int64_t j = 0; j < cached; j++) {
      const float *k = keys + j * d_count;
      for (int64_t d = 0; d < d_count; d += LINE_FLOATS) prefetch_into_l2(k + PREFETCH_ROWS * d_count + d);
      for (int64_t b = 0; b < block; b++) scores[b][j] = score(q + b * d_count, k, d_count);
    }
  } else { /* several: the block's queries side by side in the lanes, each K row read once for all of them */
    floats8 transposed[MAX_HEAD_DIM]; /* lane b of element d: query i0 + b's d-th value */
    for (int64_t d = 0; d < d_count; d++)
      for (int64_t b = 0; b < QUERY_BLOCK; b++) transposed[d][b] = b < block ? q[b * d_count + d] : 0.0f;
    block_scores_floats8(transposed, keys, d_count, block, shared, scores);
  }
  for (int64_t b = 0; b < block; b++) { /* the bias, the new tokens' scores, then the softmax over the ranks */
    const float *bias = w->bias + (row * w->steps + (i0 + b) / group) * w->bias_width;
    float *s = scores[b];
    const int64_t scored = contiguous ? count[b] : cached; /* its rows scored above */
    int64_t j = 0;
    for (; j + SOFTMAX_LANES <= scored; j += SOFTMAX_LANES) {
      floats8 x, added;
      memcpy(&x, s + j, sizeof(x));
      memcpy(&added, bias + first + j, sizeof(added));
      x = select8(added <= MASKED_BIAS, (floats8){0} - INFINITY, x + added);
      memcpy(s + j, &x, sizeof(x));
    }
    for (; j < scored; j++) s[j] = bias[first + j] <= MASKED_BIAS ? -INFINITY : s[j] + bias[first + j];
    for (int64_t f = scored - cached; f < fresh_count[b]; f++)
      s[cached + f] = score(q + b * d_count, keys + fresh[b][f] * d_count, d_count) + bias[first + fresh[b][f]];
    const int64_t padded = (count[b] + SOFTMAX_LANES - 1) / SOFTMAX_LANES * SOFTMAX_LANES; /* <= CHUNK */
    for (j = count[b]; j < padded; j++) s[j] = -INFINITY; /* no weight */
    floats8 most = (floats8){0} - INFINITY, sums = {0.0f};
    for (j = 0; j < padded; j += SOFTMAX_LANES) {
      floats8 x;
      memcpy(&x, s + j, sizeof(x));
      most = select8(x > most, x, most);
    }
    float maximum = most[0];
    for (int l = 1; l < SOFTMAX_LANES; l++) maximum = most[l] > maximum ? most[l] : maximum;
    if (maximum == -INFINITY) { /* it sees nothing here: no weight anywhere, it stays empty */
      for (j = 0; j < shared; j++) s[j] = 0.0f;
      count[b] = shared;
      continue;
    }
    for (j = 0; j < padded; j += SOFTMAX_LANES) {
      floats8 x;
      memcpy(&x, s + j, sizeof(x));
      const ints8 masked = x == -INFINITY;
      x -= maximum;
      exp_nonpositive(&x);
      x = select8(masked, (floats8){0.0f}, x);
      memcpy(s + j, &x, sizeof(x));
      sums += x;
    }
    for (j = padded; j < shared; j++) s[j] = 0.0f; /* rows past its own (a contiguous block's) */
    partial[b * stride] = maximum;
    partial[b * stride + 1] = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]));
  }
  if (w->values8)
    dequantize_rows(w->values8 + base, w->v_scale + kv % w->kv_heads * d_count, rows, d_count, dequantized);
  if (block < WIDE_BLOCK) { /* every query's weighted V, the cached rows read once for all of them */
    const int64_t pass = block == 1 ? V_BLOCK : V_BLOCK / 2; /* values a pass: all the queries' sums in registers */
    for (int64_t d0 = 0; d0 < d_count; d0 += pass) {
      const int64_t vectors = (d_count - d0 < pass ? d_count - d0 : pass) / 8;
      floats8 acc[WIDE_BLOCK - 1][V_BLOCK / 8] = {{{0.0f}}};
      for (int64_t j = 0; j < cached; j++) {
        const float *v = values + j * d_count;
        if (d0 == 0)
          for (int64_t d = 0; d < d_count; d += LINE_FLOATS) prefetch_into_l2(v + PREFETCH_ROWS * d_count + d);
        if (block == 1 && vectors == V_BLOCK / 8) /* whole passes: a fixed count, unrolled */
          add_weighted(acc[0], scores[0][j], v + d0, V_BLOCK / 8);
        else if (vectors == V_BLOCK / 16)
          for (int64_t b = 0; b < block; b++) add_weighted(acc[b], scores[b][j], v + d0, V_BLOCK / 16);
        else
          for (int64_t b = 0; b < block; b++) add_weighted(acc[b], scores[b][j], v + d0, vectors);
      }
      for (int64_t b = 0; b < block; b++) {
        for (int64_t j = cached; j < count[b]; j++) /* then its own new tokens' rows */
          add_weighted(acc[b], scores[b][j], values + fresh[b][j - cached] * d_count + d0, vectors);
        memcpy(partial + b * stride + 2 + d0, acc[b], sizeof(floats8) * vectors);
      }
    }
    return;
  }
  for (int64_t b = block; b < w->query_block; b++)
    for (int64_t j = 0; j < shared; j++) scores[b][j] = 0.0f;
  if (w->query_block == WIDE_QUERY_BLOCK) { /* (its own rows a query weighs after the shared ones: none if contiguous) */
    wide_values_512(values, shared, fresh, count, d_count, block, scores, partial, stride);
    return;
  }
  for (int64_t d = 0; d < d_count; d += 8) { /* 8 values of every query's weighted V at a time, in registers */
    floats8 acc[QUERY_BLOCK] = {{0.0f}};
    for (int64_t j = 0; j < shared; j++) {
      floats8 v;
      memcpy(&v, values + j * d_count + d, sizeof(v));
      if (d == 0)
        for (int64_t e = 0; e < d_count; e += LINE_FLOATS)
          prefetch_into_l2(values + (j + PREFETCH_ROWS) * d_count + e);
      for (int b = 0; b < QUERY_BLOCK; b++) acc[b] += scores[b][j] * v;
    }
    for (int64_t b = 0; b < block; b++) {
      for (int64_t j = shared; j < count[b]; j++) { /* its own new tokens' rows (none if contiguous) */
        floats8 v;
        memcpy(&v, values + fresh[b][j - cached] * d_count + d, sizeof(v));
        acc[b] += scores[b][j] * v;
      }
      memcpy(partial + b * stride + 2 + d, &acc[b], sizeof(floats8));
    }
  }
}

/* a row's chunks into its attention output [T, H, D] (zeros for padding tokens and a row that takes no part) */
static void combine(const Work *w, int64_t row, float *out) {
  const int64_t d_count = w->head_dim, group = w->group, queries = w->steps * group, stride = 2 + d_count;
  for (int64_t g = 0; g < w->kv_heads; g++)
    for (int64_t i = 0; i < queries; i++) {
      const float *first = w->partials + ((row * w->kv_heads + g) * w->chunks * queries + i) * stride;
      float *o = out + ((i / group) * w->kv_heads * group + g * group + i % group) * d_count;
      float maximum = -INFINITY, total = 0.0f;
      for (int64_t c = 0; c < w->chunks; c++)
        if (first[c * queries * stride + 1] > 0.0f && first[c * queries * stride] > maximum)
          maximum = first[c * queries * stride];
      memset(o, 0, sizeof(float) * d_count);
      for (int64_t c = 0; c < w->chunks; c++) {
        const float *p = first + c * queries * stride;
        if (p[1] == 0.0f) continue;
        const float weight = expf(p[0] - maximum);
        total += weight * p[1];
        for (int64_t d = 0; d < d_count; d++) o[d] += weight * p[2 + d];
      }
      const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t d = 0; d < d_count; d++) o[d] *= inverse;
    }
}

/* a new K or V row into an int8 cache: round(x / scale) to the nearest (ties to even, as torch.round), saturated */
static void quantize_row(const float *x, const float *scale, int64_t d_count, int8_t *out) {
  for (int64_t d = 0; d < d_count; d++) {
    const float q = nearbyintf(x[d] / scale[d]);
    out[d] = (int8_t)(q >= 127.0f ? 127.0f : q > -128.0f ? q : -128.0f); /* NaN: -128 */
  }
}

static void rotate(const float *x, const float *cos, const float *sin, int64_t half, float *out) {
  for (int64_t d = 0; d < half; d++) {
    out[d] = x[d] * cos[d] - x[d + half] * sin[d];
    out[d + half] = x[d + half] * cos[d] + x[d] * sin[d];
  }
}

/* a call with more than one token per row: onnxruntime's GroupQueryAttention, on the same inputs and outputs */
static OrtStatus *invoke_onnxruntime(Kernel *kernel, OrtKernelContext *context, const OrtValue *const *inputs,
                                     int64_t batch, int64_t steps, const int64_t *cache_dims) {
  OrtApiTable api = kernel->api;
  const OrtValue *gqa_inputs[GQA_INPUTS] = {NULL};
  for (size_t i = 0; i < node_inputs(kernel); i++) gqa_inputs[gqa_slot[i]] = inputs[i];
  const int64_t out_dims[3] = {batch, steps, kernel->num_heads * cache_dims[3]};
  OrtValue *outputs[3] = {NULL, NULL, NULL};
  OrtStatus *(*get_output)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **) =
      API(api, KernelContext_GetOutput, OrtStatus *(*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **));
  for (size_t i = 0; i < 3; i++) {
    OrtStatus *status = get_output(context, i, i ? cache_dims : out_dims, i ? 4 : 3, &outputs[i]);
    if (status) return status;
  }
  return API(api, InvokeOp, OrtStatus *(*)(const OrtKernelContext *, const OrtOp *, const OrtValue *const *, int,
                                            OrtValue *const *, int))(context, kernel->gqa, gqa_inputs, GQA_INPUTS, outputs, 3);
}

static OrtStatus *compute(Kernel *kernel, OrtKernelContext *context) {
  OrtApiTable api = kernel->api;
  OrtStatus *(*get_input)(const OrtKernelContext *, size_t, const OrtValue **) =
      API(api, KernelContext_GetInput, OrtStatus *(*)(const OrtKernelContext *, size_t, const OrtValue **));
  OrtStatus *(*get_output)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **) =
      API(api, KernelContext_GetOutput, OrtStatus *(*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **));
  const OrtValue *inputs[INPUTS_INT8_CACHE];
  void *data[INPUTS_INT8_CACHE];
  int64_t dims[INPUTS_INT8_CACHE][4];
  const size_t input_count = node_inputs(kernel);
  for (size_t i = 0; i < input_count; i++)
    if (get_input(context, i, &inputs[i]) || !inputs[i] || !tensor(api, inputs[i], &data[i], dims[i]))
      return fail(api, "DecodeAttention: cannot read its inputs");
  const int64_t batch = dims[IN_QKV][0], steps = dims[IN_QKV][1], heads = kernel->num_heads, kv_heads = kernel->kv_heads;
  const int64_t head_dim = dims[IN_PAST_KEY][3], length = dims[IN_PAST_KEY][2], half = head_dim / 2;
  const int64_t bias_width = dims[IN_BIAS][3];
  const int64_t group = heads / kv_heads;
  if (steps > (kernel->int8_cache ? MAX_STEPS_INT8_CACHE : MAX_STEPS) || head_dim > MAX_HEAD_DIM)
    return invoke_onnxruntime(kernel, context, inputs, batch, steps, dims[IN_PAST_KEY]);
  if (dims[IN_QKV][2] != (heads + 2 * kv_heads) * head_dim || dims[IN_PAST_KEY][1] != kv_heads ||
      dims[IN_COS][1] != half || head_dim % DOT_LANES || dims[IN_BIAS][2] != steps)
    return fail(api, "DecodeAttention: input shapes do not match num_heads / kv_num_heads / the cache");
  for (int i = IN_K_SCALE; i < (int)input_count; i++)
    if (dims[i][0] != 1 || dims[i][1] != kv_heads || dims[i][2] != 1 || dims[i][3] != head_dim)
      return fail(api, "DecodeAttention: an int8 cache's scales are not [1, kv_num_heads, 1, head_dim]");
  const float *qkv = data[IN_QKV], *cos_cache = data[IN_COS], *sin_cache = data[IN_SIN];
  const int32_t *seqlens_k = data[IN_SEQLENS_K], *query_lens = data[IN_QUERY_LENS];
  const int64_t *position_ids = data[IN_POSITIONS];
  for (int64_t b = 0; b < batch; b++) {
    if (query_lens[b] < 0 || query_lens[b] > steps)
      return fail(api, "DecodeAttention: a row's query length is outside 0 .. its tokens");
    if (!query_lens[b]) continue;
    if (seqlens_k[b] + 1 < query_lens[b] || seqlens_k[b] >= length || seqlens_k[b] >= bias_width)
      return fail(api, "DecodeAttention: a row's position is outside the cache or the bias");
    for (int64_t s = 0; s < query_lens[b]; s++)
      if (position_ids[b * steps + s] < 0 || position_ids[b * steps + s] >= dims[IN_COS][0])
        return fail(api, "DecodeAttention: a token's position is outside the rotary tables");
  }

  int64_t out_dims[3] = {batch, steps, heads * head_dim};
  const size_t element_size = kernel->int8_cache ? sizeof(int8_t) : sizeof(float); /* the cache's */
  OrtValue *out_value = NULL, *present[2] = {NULL, NULL};
  void *out_data = NULL, *present_data[2];
  int64_t ignored[4];
  if (get_output(context, 0, out_dims, 3, &out_value) || !tensor(api, out_value, &out_data, ignored))
    return fail(api, "DecodeAttention: cannot allocate its output");
  for (int i = 0; i < 2; i++) {
    if (get_output(context, 1 + i, dims[IN_PAST_KEY], 4, &present[i]) || !tensor(api, present[i], &present_data[i], ignored))
      return fail(api, "DecodeAttention: cannot allocate the present cache");
    if (present_data[i] != data[IN_PAST_KEY + i]) /* not bound in place: the present cache starts as a copy of the past */
      memcpy(present_data[i], data[IN_PAST_KEY + i], element_size * batch * kv_heads * length * head_dim);
  }
  const float *k_scale = kernel->int8_cache ? data[IN_K_SCALE] : NULL;
  const float *v_scale = kernel->int8_cache ? data[IN_V_SCALE] : NULL;

  int64_t longest = 1;
  for (int64_t b = 0; b < batch; b++)
    if (query_lens[b] && seqlens_k[b] + 1 > longest) longest = seqlens_k[b] + 1;
  const int64_t chunks = (longest + CHUNK - 1) / CHUNK;
  float *q_scaled = malloc(sizeof(float) * batch * steps * heads * head_dim);
  float *partials = malloc(sizeof(float) * batch * kv_heads * chunks * steps * group * (2 + head_dim));
  if (!q_scaled || !partials) {
    free(q_scaled);
    free(partials);
    return fail(api, "DecodeAttention: out of memory");
  }
  for (int64_t b = 0; b < batch; b++) {
    const int64_t past = (int64_t)seqlens_k[b] + 1 - query_lens[b];
    for (int64_t s = 0; s < query_lens[b]; s++) { /* real tokens only: padding stays out of the cache */
      const float *x = qkv + (b * steps + s) * (heads + 2 * kv_heads) * head_dim;
      const int64_t position = position_ids[b * steps + s];
      const float *cos = cos_cache + position * half, *sin = sin_cache + position * half;
      for (int64_t h = 0; h < heads; h++) {
        float *q = q_scaled + (((b * kv_heads + h / group) * steps + s) * group + h % group) * head_dim;
        rotate(x + h * head_dim, cos, sin, half, q);
        for (int64_t d = 0; d < head_dim; d++) q[d] *= kernel->scale; /* once here, not on every score */
      }
      for (int64_t g = 0; g < kv_heads; g++) {
        const int64_t slot = ((b * kv_heads + g) * length + past + s) * head_dim;
        const float *value = x + (heads + kv_heads + g) * head_dim;
        if (!kernel->int8_cache) {
          rotate(x + (heads + g) * head_dim, cos, sin, half, (float *)present_data[0] + slot);
          memcpy((float *)present_data[1] + slot, value, sizeof(float) * head_dim);
          continue;
        }
        float key[MAX_HEAD_DIM];
        rotate(x + (heads + g) * head_dim, cos, sin, half, key);
        quantize_row(key, k_scale + g * head_dim, head_dim, (int8_t *)present_data[0] + slot);
        quantize_row(value, v_scale + g * head_dim, head_dim, (int8_t *)present_data[1] + slot);
      }
    }
  }
  /* 16 lanes only where they save a block: up to 8 queries a row take the same 8-lane block as ever */
  const int64_t query_block = kernel->wide && steps * group > QUERY_BLOCK ? WIDE_QUERY_BLOCK : QUERY_BLOCK;
  const int64_t query_blocks = (steps * group + query_block - 1) / query_block;
  const int float_cache = !kernel->int8_cache;
  Work work = {q_scaled,
               float_cache ? present_data[0] : NULL,
               float_cache ? present_data[1] : NULL,
               float_cache ? NULL : present_data[0],
               float_cache ? NULL : present_data[1],
               k_scale,
               v_scale,
               data[IN_BIAS],
               seqlens_k,
               query_lens,
               partials,
               kv_heads,
               group,
               steps,
               head_dim,
               length,
               bias_width,
               chunks,
               query_blocks,
               query_block};
  OrtStatus *status = API(api, KernelContext_ParallelFor,
                          OrtStatus *(*)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *))(
      context, attend_chunk, (size_t)(batch * kv_heads * chunks * query_blocks), 0, &work);
  if (!status)
    for (int64_t b = 0; b < batch; b++) combine(&work, b, (float *)out_data + b * steps * heads * head_dim);
  free(q_scaled);
  free(partials);
  return status;
}

/* onnxruntime's GroupQueryAttention with this node's attributes (its type constraints have grown over releases:
 * the combinations are tried in turn) */
static OrtStatus *create_gqa(Kernel *kernel, const OrtKernelInfo *info) {
  OrtApiTable api = kernel->api;
  OrtStatus *(*create_attr)(const char *, const void *, int, int, OrtOpAttr **) =
      API(api, CreateOpAttr, OrtStatus *(*)(const char *, const void *, int, int, OrtOpAttr **));
  const int64_t rotary = 1, interleaved = 0, cache_bits = 8;
  static const char per_channel[] = "PER_CHANNEL";
  OrtOpAttr *attrs[8] = {NULL};
  const int attr_count = kernel->int8_cache ? 8 : 5;
  OrtStatus *status = create_attr("num_heads", &kernel->num_heads, 1, ATTR_INT, &attrs[0]);
  if (!status) status = create_attr("kv_num_heads", &kernel->kv_heads, 1, ATTR_INT, &attrs[1]);
  if (!status) status = create_attr("scale", &kernel->scale, 1, ATTR_FLOAT, &attrs[2]);
  if (!status) status = create_attr("do_rotary", &rotary, 1, ATTR_INT, &attrs[3]);
  if (!status) status = create_attr("rotary_interleaved", &interleaved, 1, ATTR_INT, &attrs[4]);
  if (!status && kernel->int8_cache) /* the cache as plugins/attention.py lowers it: static per-channel int8 */
    status = create_attr("k_quant_type", per_channel, sizeof(per_channel) - 1, ATTR_STRING, &attrs[5]);
  if (!status && kernel->int8_cache)
    status = create_attr("v_quant_type", per_channel, sizeof(per_channel) - 1, ATTR_STRING, &attrs[6]);
  if (!status && kernel->int8_cache) status = create_attr("kv_cache_bit_width", &cache_bits, 1, ATTR_INT, &attrs[7]);
  const int cache_type = kernel->int8_cache ? ELEMENT_INT8 : ELEMENT_FLOAT;
  static const char *names[][4] = {{"T", "T_CACHE", "M"}, {"T", "M"}, {"T", "T_CACHE", "T_KV_SCALE", "M"}};
  const int types[][4] = {{ELEMENT_FLOAT, cache_type, ELEMENT_INT32}, {ELEMENT_FLOAT, ELEMENT_INT32},
                          {ELEMENT_FLOAT, cache_type, ELEMENT_FLOAT, ELEMENT_INT32}};
  static const int counts[] = {3, 2, 4};
  OrtStatus *(*create_op)(const OrtKernelInfo *, const char *, const char *, int, const char *const *, const int *, int,
                          OrtOpAttr *const *, int, int, int, OrtOp **) =
      API(api, CreateOp, OrtStatus *(*)(const OrtKernelInfo *, const char *, const char *, int, const char *const *,
                                        const int *, int, OrtOpAttr *const *, int, int, int, OrtOp **));
  for (int i = 0; !status && i < 3; i++) {
    status = create_op(info, "GroupQueryAttention", "com.microsoft", 1, names[i], types[i], counts[i], attrs,
                       attr_count, GQA_INPUTS, 3, &kernel->gqa);
    if (status && i < 2) {
      API(api, ReleaseStatus, void (*)(OrtStatus *))(status);
      status = NULL;
    } else if (!status) {
      break;
    }
  }
  for (int i = 0; i < 8; i++)
    if (attrs[i]) API(api, ReleaseOpAttr, void (*)(OrtOpAttr *))(attrs[i]);
  return status;
}

static void kernel_destroy(void *kernel) {
  Kernel *k = kernel;
  if (k->gqa) API(k->api, ReleaseOp, void (*)(OrtOp *))(k->gqa);
  free(k);
}

static OrtStatus *create_kernel(const OrtCustomOp *op, OrtApiTable api, const OrtKernelInfo *info, void **out) {
  Kernel *kernel = calloc(1, sizeof(Kernel));
  if (!kernel) return fail(api, "DecodeAttention: out of memory");
  kernel->api = api;
  kernel->int8_cache = op == &decode_attention_int8_cache_op;
  kernel->wide = __builtin_cpu_supports("avx512f") && !avx2_paths_asked();
  OrtStatus *(*get_int)(const OrtKernelInfo *, const char *, int64_t *) =
      API(api, KernelInfoGetAttribute_int64, OrtStatus *(*)(const OrtKernelInfo *, const char *, int64_t *));
  OrtStatus *status = get_int(info, "num_heads", &kernel->num_heads);
  if (!status) status = get_int(info, "kv_num_heads", &kernel->kv_heads);
  if (!status)
    status = API(api, KernelInfoGetAttribute_float, OrtStatus *(*)(const OrtKernelInfo *, const char *, float *))(
        info, "scale", &kernel->scale);
  if (!status && (kernel->num_heads <= 0 || kernel->kv_heads <= 0 || kernel->num_heads % kernel->kv_heads))
    status = fail(api, "DecodeAttention: num_heads must be a positive multiple of kv_num_heads");
  if (!status) status = create_gqa(kernel, info);
  if (status) {
    kernel_destroy(kernel);
    return status;
  }
  *out = kernel;
  return NULL;
}

static OrtStatus *kernel_compute(void *kernel, OrtKernelContext *context) { return compute(kernel, context); }
static const char *op_name(const OrtCustomOp *op) {
  return op == &decode_attention_int8_cache_op ? "DecodeAttentionInt8Cache" : "DecodeAttention";
}
static const int input_types[INPUTS_INT8_CACHE] = {ELEMENT_FLOAT, ELEMENT_FLOAT, ELEMENT_FLOAT, ELEMENT_INT32,
                                                   ELEMENT_INT32, ELEMENT_FLOAT, ELEMENT_FLOAT, ELEMENT_INT64,
                                                   ELEMENT_FLOAT, ELEMENT_INT32, ELEMENT_FLOAT, ELEMENT_FLOAT};
/* an int8 cache's op: the past and present buffers int8, its scales after the float cache's inputs */
static int is_cache(size_t index) { return index == IN_PAST_KEY || index == IN_PAST_VALUE; }
static int input_type(const OrtCustomOp *op, size_t index) {
  return op == &decode_attention_int8_cache_op && is_cache(index) ? ELEMENT_INT8 : input_types[index];
}
static size_t input_count(const OrtCustomOp *op) { return op == &decode_attention_int8_cache_op ? INPUTS_INT8_CACHE : INPUTS; }
static int output_type(const OrtCustomOp *op, size_t index) {
  return op == &decode_attention_int8_cache_op && index ? ELEMENT_INT8 : ELEMENT_FLOAT;
}
static size_t output_count(const OrtCustomOp *op) { (void)op; return 3; }

OrtCustomOp decode_attention_op = CPU_CUSTOM_OP(op_name, input_type, input_count, required, output_count, create_kernel,
                                                kernel_compute, kernel_destroy);
OrtCustomOp decode_attention_int8_cache_op = CPU_CUSTOM_OP_TYPED(op_name, input_type, input_count, required, output_type,
                                                                 output_count, create_kernel, kernel_compute,
                                                                 kernel_destroy);
