/* Int4MatMul: Y = A W^T for int4 weights in onnxruntime's MatMulNBits layout, as an onnxruntime CPU custom op in the
 * place of com.microsoft::MatMulNBits (bits 4, accuracy_level 4: int8 activations) under the same contract
 * (plugins/quant_linear.py), except that the scales may be float16 as well as float (engines store them as float16:
 * a weight then streams 4.5 bits from memory, not 5). Inputs: A [..., K] f32; B uint8 [N, K / block, block / 2] (two
 * weights per byte, low nibble first, zero point 8); scales f32 or f16 [N * K / block];
 * optionally minimums f16 [N * K / 32] for blocks of 32: then w = scale * q + minimum with q the unsigned nibble
 * (llama.cpp's Q4_1 block, its two float16s taken as they are) instead of scale * (q - 8). Output [..., N] f32.
 * Attributes: K, N, block_size (a power of 2 of at least 32 that divides K), swiglu (optional, 0 or 1).
 *
 * Int8MatMul, the same op for MatMulNBits's 8-bit blocks: B uint8 [N, K / block, block] (q + 128, w = scale * q),
 * which holds llama.cpp's Q8_0 blocks (blocks of 32, float16 scales) exactly; no minimums.
 *
 * With swiglu = 1 the node is also the MLP's activation: W holds the gate's N / 2 columns, then the up projection's,
 * and the output [..., N / 2] is silu(gate) * up, which the step graph otherwise computes in four more nodes (Split,
 * Sigmoid, Mul, Mul: three kernels a layer after onnxruntime fuses two).
 *
 * Why our own: a row's result here does not depend on the other rows of the call. onnxruntime's kernel takes
 * another path for one row than for several, which rounds differently, so an engine that must give a request the
 * same greedy tokens alone or in a batch padded one-row decode calls to two rows (runner/executor.py's probe): the
 * int4 default model decoded 83 against 111 tokens/s at batch 1 that way. Here every output is the same sequence of
 * operations whatever the tile around it, so one row runs alone. Decode speed equals onnxruntime's (both stream the
 * weights from memory as fast as it serves them); prompt chunks run within ~5-10% of it.
 *
 * How: each row of A is quantized per block of 32 to int8 (scale max|a| / 127, as onnxruntime's int8 path does)
 * into the layout the nibbles want: per pair of blocks, the even-indexed values of both, then the odd ones, so a
 * 32-byte load of weights meets its activations without shuffles. unsigned nibble x signed int8 products
 * (vpmaddubsw), summed to int32 per 8 weights, less 8 x the activations' sum (the zero point), times the weight
 * and activation scales, accumulate in float per column. Columns are split over the session's threads in chunks,
 * rows in blocks whose quantized activations stay in cache while the chunk's columns pass; a tile of 4 rows x 2
 * columns unpacks each weight once for 4 rows. The weights are prefetched ahead of use: they come from memory.
 * With minimums the nibble products are kept whole and minimum x the activations' sum is added instead. int8
 * weights take A's rows in their natural order (ACCUMULATE_GROUP_INT8).
 * Needs AVX2, FMA and F16C (kernel creation fails without them). Where the CPU has AVX-512 VNNI (and VL) the tiles
 * take vpdpbusd on the same 256-bit vectors instead: the same integer sums, so the same results bit for bit
 * (LLM_ENGINE_BUILDER_KERNEL_ISA=avx2 keeps the AVX2 tiles; QuantizedMatMulIsa() says which a kernel takes).
 */
#include <immintrin.h>
#include <stdio.h>

#include "ort_abi.h"

#define ROW_BLOCK 64     /* rows of A per unit of work */
/* columns per unit of work: enough units that the session's threads share a small matrix evenly (N = 576: 36) */
#define COLUMN_CHUNK(n) ((n) >= 2048 ? 64 : 16)
/* "avx2" makes the kernels take their AVX2 tiles on a CPU with AVX-512 VNNI (read when a session creates them) */
#define KERNEL_ISA_VARIABLE "LLM_ENGINE_BUILDER_KERNEL_ISA"
#define PREFETCH_BYTES 2048 /* how far ahead of use the weights are fetched (each column's are contiguous) */
#define AVX2 __attribute__((target("avx2,fma,f16c")))
/* the tiles' variant for CPUs with AVX-512 VNNI (vpdpbusd on 256-bit vectors): the same integer sums in one
 * instruction where AVX2 takes two or three, so the same results bit for bit */
#define VNNI_1 __attribute__((target("avx2,fma,f16c,avx512vnni,avx512vl")))
#define VNNI_0 AVX2
/* u8 x s8 products summed to int32 per 4 bytes: of two pairs of vectors (int4: the low and high nibbles), or one
 * (int8); AVX2 sums through int16 (no saturation: int4 products reach 4 x 15 x 127, int8 pairs 2 x 128 x 127) */
#define DOT_PAIRS_0(lo, even, hi, odd) \
  _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd)), ones)
#define DOT_PAIRS_1(lo, even, hi, odd) _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, even), hi, odd)
#define DOT_0(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones)
#define DOT_1(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
#define INLINE_AVX2 __attribute__((always_inline, target("avx2,fma,f16c"))) static inline

/* A's rows quantized: per row, per pair of 32-blocks ("group"; the last holds one block where K / 32 is odd) */
typedef struct QuantizedRows {
  int8_t *x;     /* [m][groups][64]: the even-indexed values of both blocks, then the odd ones */
  int32_t *corr; /* [m][groups][8]: per int32 lane of the dot product, 8 x the sum of the values it pairs with */
  float *scale;  /* [m][groups][8]: lanes 0-3 the first block's scale, 4-7 the second's */
  float *sum;    /* [m][groups][8]: per lane, the sum of the values it pairs with times their scale (for minimums) */
} QuantizedRows;

typedef struct Work {
  const float *a;
  float *out; /* the node's output: y itself, or for swiglu silu(gate) * up of y's halves */
  const uint8_t *w;
  const void *wscale; /* float, or float16 (scales_f16) */
  const uint16_t *minimums; /* float16 per block (Q4_1: w = scale * q + minimum), or NULL (w = scale * (q - 8)) */
  float *y;
  QuantizedRows q;
  int64_t m, k, n, block_size, groups, row_blocks, column_chunks;
  int scales_f16;
  int bits; /* 4, or 8 (Int8MatMul: A's rows are then quantized in their natural order) */
  int vnni; /* the tiles' AVX-512 VNNI variant */
} Work;

/* e^x for x in [-87, 88] (clamped there), within ~2 float ulps: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts,
 * as Cephes), e^r by its Taylor series to r^6, 2^n through the exponent bits */
INLINE_AVX2 __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  static const float taylor[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  __m256 p = _mm256_set1_ps(taylor[0]);
  for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(taylor[i]));
  const __m256i two_to_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_n));
}

/* rows [unit * ROW_BLOCK, ...) of a swiglu node: out[r, j] = silu(y[r, j]) * y[r, n / 2 + j], silu(g) = g / (1 + e^-g) */
AVX2 static void silu_times_up(void *data, size_t unit) {
  const Work *w = data;
  const int64_t first = (int64_t)unit * ROW_BLOCK, last = first + ROW_BLOCK < w->m ? first + ROW_BLOCK : w->m;
  const int64_t half = w->n / 2;
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = first; r < last; r++) {
    const float *gate = w->y + r * w->n, *up = gate + half;
    float *out = w->out + r * half;
    int64_t j = 0;
    for (; j + 8 <= half; j += 8) {
      const __m256 g = _mm256_loadu_ps(gate + j);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp_ps(_mm256_xor_ps(g, sign))));
      _mm256_storeu_ps(out + j, _mm256_mul_ps(silu, _mm256_loadu_ps(up + j)));
    }
    for (; j < half; j++) out[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
  }
}

/* A's rows [unit * ROW_BLOCK, ...) into w->q: per block of 32, scale max|a| / 127, values rounded to nearest even */
AVX2 static void quantize_rows(void *data, size_t unit) {
  const Work *w = data;
  const int64_t first = (int64_t)unit * ROW_BLOCK, last = first + ROW_BLOCK < w->m ? first + ROW_BLOCK : w->m;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  /* after packing to bytes: the 32 values back in order, then each 128-bit lane's even bytes before its odd ones */
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i evens_first = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                               0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t r = first; r < last; r++) {
    for (int64_t b = 0; b < w->k / 32; b++) {
      const float *v = w->a + r * w->k + b * 32;
      __m256 x[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[i]));
      }
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      const float largest = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
      const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
      __m256i q[4];
      for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inverse));
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), in_order);
      /* [evens of values 0-15, odds of 0-15 | evens of 16-31, odds of 16-31] -> [all 16 evens | all 16 odds] */
      const __m256i split = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, evens_first), 0xD8);
      const int64_t g = r * w->groups + b / 2, half = b % 2;
      if (w->bits == 8) {
        _mm256_storeu_si256((__m256i *)(w->q.x + g * 64 + half * 32), bytes);
      } else {
        _mm_storeu_si128((__m128i *)(w->q.x + g * 64 + half * 16), _mm256_castsi256_si128(split));
        _mm_storeu_si128((__m128i *)(w->q.x + g * 64 + 32 + half * 16), _mm256_extracti128_si256(split, 1));
      }
      /* lane l of the dot product pairs with values 8l .. 8l + 7: the sums of q[0..3] */
      const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
      const __m128i lanes = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
      _mm_storeu_si128((__m128i *)(w->q.corr + g * 8 + half * 4), _mm_slli_epi32(lanes, 3));
      _mm_storeu_ps(w->q.scale + g * 8 + half * 4, _mm_set1_ps(largest / 127.0f));
      _mm_storeu_ps(w->q.sum + g * 8 + half * 4, _mm_mul_ps(_mm_cvtepi32_ps(lanes), _mm_set1_ps(largest / 127.0f)));
    }
    if ((w->k / 32) % 2) { /* the last group's second block does not exist: it adds zero */
      const int64_t g = r * w->groups + w->groups - 1;
      if (w->bits == 8) {
        memset(w->q.x + g * 64 + 32, 0, 32);
      } else {
        memset(w->q.x + g * 64 + 16, 0, 16);
        memset(w->q.x + g * 64 + 48, 0, 16);
      }
      memset(w->q.corr + g * 8 + 4, 0, 4 * sizeof(int32_t));
      memset(w->q.scale + g * 8 + 4, 0, 4 * sizeof(float));
      memset(w->q.sum + g * 8 + 4, 0, 4 * sizeof(float));
    }
  }
}

INLINE_AVX2 float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The weight scales (float, or float16 where F16) of group g of a column for its two blocks, lanes 0-3 and 4-7: for
 * blocks of 32 one each, for larger blocks (a power of 2) the one they share */
INLINE_AVX2 __m256 group_scales(const void *column_scales, int64_t g, int blocks_of_32, int shift, int f16) {
  const __m256i first_four_second_four = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  if (f16) {
    const uint16_t *s = column_scales;
    if (!blocks_of_32) return _mm256_set1_ps(_cvtsh_ss(s[g >> shift]));
    int32_t pair;
    memcpy(&pair, s + 2 * g, sizeof(pair));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(pair))), first_four_second_four);
  }
  const float *s = column_scales;
  if (blocks_of_32)
    return _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_broadcast_sd((const double *)(s + 2 * g))),
                                    first_four_second_four);
  return _mm256_broadcast_ss(s + (g >> shift));
}

/* the scale of the lone block of a column's last group (blocks of 32, an odd number of them), in lanes 0-3 */
INLINE_AVX2 __m256 tail_scale(const void *column_scales, int64_t g, int f16) {
  const __m128 scale = f16 ? _mm_set1_ps(_cvtsh_ss(((const uint16_t *)column_scales)[2 * g]))
                           : _mm_broadcast_ss((const float *)column_scales + 2 * g);
  return _mm256_insertf128_ps(_mm256_setzero_ps(), scale, 0);
}

/* Group g of ROWS rows against COLS columns into acc. TAIL: the last group of a K with an odd number of 32-blocks,
 * which holds one block (16 bytes of weights, one scale; its second half of the activations is zero). MIN: the
 * blocks carry a minimum (blocks of 32, float16): scale * q + minimum, so the dot product of the unsigned nibbles
 * is taken as it is and minimum x the activations' sum added, instead of subtracting 8 x that sum. */
#define ACCUMULATE_GROUP(ROWS, COLS, BLOCKS_OF_32, F16, TAIL, MIN, VNNI)                                             \
  for (int j = 0; j < COLS; j++) {                                                                                  \
    const uint8_t *p = weights[j] + g * 32;                                                                         \
    _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);                                                    \
    const __m256i bytes = TAIL ? _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128((const __m128i *)p), 0) \
                               : _mm256_loadu_si256((const __m256i *)p);                                            \
    const __m256 ws = TAIL ? tail_scale(scales[j], g, F16) : group_scales(scales[j], g, BLOCKS_OF_32, shift, F16);   \
    const __m256 wmin = !MIN ? _mm256_setzero_ps()                                                                 \
                        : TAIL ? tail_scale(minimums[j], g, 1) : group_scales(minimums[j], g, 1, 0, 1);             \
    const __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);       \
    for (int i = 0; i < ROWS; i++) {                                                                                \
      const int64_t at = i * groups + g;                                                                            \
      const __m256i even = _mm256_loadu_si256((const __m256i *)(x + at * 64));                                      \
      const __m256i odd = _mm256_loadu_si256((const __m256i *)(x + at * 64 + 32));                                  \
      __m256i dots = DOT_PAIRS_##VNNI(lo, even, hi, odd);                                                           \
      if (!MIN) dots = _mm256_sub_epi32(dots, _mm256_loadu_si256((const __m256i *)(corr + at * 8)));                \
      const __m256 scale = _mm256_mul_ps(ws, _mm256_loadu_ps(xscale + at * 8));                                     \
      acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc[i][j]);                                      \
      if (MIN) acc[i][j] = _mm256_fmadd_ps(wmin, _mm256_loadu_ps(xsum + at * 8), acc[i][j]);                        \
    }                                                                                                               \
  }

/* The int8 form of ACCUMULATE_GROUP (MatMulNBits's 8-bit blocks: q + 128 stored as uint8, w = scale * q; GGUF
 * Q8_0): a group is two blocks of 32 bytes in their natural order, as A's rows are quantized for it. The signed
 * weights meet the activations through |w| x (x with w's sign) (vpmaddubsw takes one unsigned operand); each block's
 * products are summed to int32 on their own (two blocks' pairs would overflow int16), then arranged so that lanes
 * 0-3 hold the first block and 4-7 the second, as the scales are. */
#define ACCUMULATE_GROUP_INT8(ROWS, COLS, BLOCKS_OF_32, F16, TAIL, VNNI)                                            \
  for (int j = 0; j < COLS; j++) {                                                                                  \
    const uint8_t *p = weights[j] + g * 64;                                                                         \
    _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);                                                    \
    _mm_prefetch((const char *)p + PREFETCH_BYTES + 64, _MM_HINT_T0);                                               \
    const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), flip);                              \
    const __m256i w1 = TAIL ? _mm256_setzero_si256()                                                                \
                            : _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 32)), flip);               \
    const __m256i abs0 = _mm256_abs_epi8(w0), abs1 = _mm256_abs_epi8(w1);                                          \
    const __m256 ws = TAIL ? tail_scale(scales[j], g, F16) : group_scales(scales[j], g, BLOCKS_OF_32, shift, F16);   \
    for (int i = 0; i < ROWS; i++) {                                                                                \
      const int64_t at = i * groups + g;                                                                            \
      const __m256i x0 = _mm256_loadu_si256((const __m256i *)(x + at * 64));                                        \
      const __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + at * 64 + 32));                                   \
      const __m256i d0 = DOT_##VNNI(abs0, _mm256_sign_epi8(x0, w0));                                                \
      const __m256i d1 = DOT_##VNNI(abs1, _mm256_sign_epi8(x1, w1));                                                \
      const __m256i dots = _mm256_permute4x64_epi64(_mm256_hadd_epi32(d0, d1), 0xD8);                              \
      const __m256 scale = _mm256_mul_ps(ws, _mm256_loadu_ps(xscale + at * 8));                                     \
      acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc[i][j]);                                      \
    }                                                                                                               \
  }

/* Y[r .. r + ROWS, c .. c + COLS] for weights in blocks of 32 (BLOCKS_OF_32) or of 64 << shift, with float16 scales
 * (F16) or float, with minimums (MIN) or not: each output is the same operations in the same order whatever ROWS and
 * COLS are */
#define DEFINE_TILE(NAME, ROWS, COLS, BLOCKS_OF_32, F16, MIN, BITS, VNNI)                                           \
  VNNI_##VNNI static void NAME(const Work *w, int64_t r, int64_t c) {                                               \
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);   \
    (void)ones;                                                                                                     \
    (void)low;                                                                                                      \
    (void)flip;                                                                                                     \
    const int64_t groups = w->groups, full = w->k / 64, n = w->n;                                                   \
    const int shift = BLOCKS_OF_32 ? 0 : __builtin_ctzll((unsigned long long)(w->block_size / 64));                 \
    const uint8_t *weights[COLS];                                                                                   \
    const void *scales[COLS], *minimums[COLS];                                                                      \
    for (int j = 0; j < COLS; j++) {                                                                                \
      weights[j] = w->w + (c + j) * (w->k * BITS / 8);                                                              \
      scales[j] = (const char *)w->wscale + (c + j) * (w->k / w->block_size) * (F16 ? 2 : 4);                       \
      minimums[j] = MIN ? w->minimums + (c + j) * (w->k / 32) : NULL;                                               \
    }                                                                                                               \
    const int8_t *x = w->q.x + r * groups * 64;                                                                     \
    const int32_t *corr = w->q.corr + r * groups * 8;                                                               \
    const float *xscale = w->q.scale + r * groups * 8;                                                              \
    const float *xsum = w->q.sum + r * groups * 8;                                                                  \
    __m256 acc[ROWS][COLS];                                                                                         \
    for (int i = 0; i < ROWS; i++)                                                                                  \
      for (int j = 0; j < COLS; j++) acc[i][j] = _mm256_setzero_ps();                                               \
    int64_t g = 0;                                                                                                  \
    if (BITS == 8) {                                                                                                \
      for (; g < full; g++) ACCUMULATE_GROUP_INT8(ROWS, COLS, BLOCKS_OF_32, F16, 0, VNNI)                           \
      if (BLOCKS_OF_32 && g < groups) ACCUMULATE_GROUP_INT8(ROWS, COLS, BLOCKS_OF_32, F16, 1, VNNI)                 \
    } else {                                                                                                        \
      for (; g < full; g++) ACCUMULATE_GROUP(ROWS, COLS, BLOCKS_OF_32, F16, 0, MIN, VNNI)                           \
      if (BLOCKS_OF_32 && g < groups) ACCUMULATE_GROUP(ROWS, COLS, BLOCKS_OF_32, F16, 1, MIN, VNNI)                 \
    }                                                                                                               \
    for (int i = 0; i < ROWS; i++)                                                                                  \
      for (int j = 0; j < COLS; j++) w->y[(r + i) * n + c + j] = horizontal_sum(acc[i][j]);                         \
  }

/* the four tile shapes of each kind of weights: [blocks of 32][float16 scales][minimums], int4 or int8, AVX2 or VNNI */
#define DEFINE_SHAPES(SUFFIX, BLOCKS_OF_32, F16, MIN, BITS, VNNI)                                                   \
  DEFINE_TILE(tile_4x2_##SUFFIX, 4, 2, BLOCKS_OF_32, F16, MIN, BITS, VNNI)                                          \
  DEFINE_TILE(tile_4x1_##SUFFIX, 4, 1, BLOCKS_OF_32, F16, MIN, BITS, VNNI)                                          \
  DEFINE_TILE(tile_1x4_##SUFFIX, 1, 4, BLOCKS_OF_32, F16, MIN, BITS, VNNI)                                          \
  DEFINE_TILE(tile_1x1_##SUFFIX, 1, 1, BLOCKS_OF_32, F16, MIN, BITS, VNNI)
#define DEFINE_TILES(SUFFIX, BLOCKS_OF_32, F16, MIN, BITS)                                                          \
  DEFINE_SHAPES(SUFFIX, BLOCKS_OF_32, F16, MIN, BITS, 0)                                                            \
  DEFINE_SHAPES(SUFFIX##_vnni, BLOCKS_OF_32, F16, MIN, BITS, 1)
DEFINE_TILES(shared, 0, 0, 0, 4)
DEFINE_TILES(shared_f16, 0, 1, 0, 4)
DEFINE_TILES(32, 1, 0, 0, 4)
DEFINE_TILES(32_f16, 1, 1, 0, 4)
DEFINE_TILES(32_min, 1, 0, 1, 4)
DEFINE_TILES(32_f16_min, 1, 1, 1, 4)
DEFINE_TILES(int8_shared, 0, 0, 0, 8)
DEFINE_TILES(int8_shared_f16, 0, 1, 0, 8)
DEFINE_TILES(int8_32, 1, 0, 0, 8)
DEFINE_TILES(int8_32_f16, 1, 1, 0, 8)

typedef void (*Tile)(const Work *w, int64_t r, int64_t c);
enum { TILE_4x2, TILE_4x1, TILE_1x4, TILE_1x1 };
#define TILE_SHAPES(SUFFIX) {tile_4x2_##SUFFIX, tile_4x1_##SUFFIX, tile_1x4_##SUFFIX, tile_1x1_##SUFFIX}
/* [VNNI][blocks of 32][float16 scales][minimums]: minimums come in blocks of 32 only */
static const Tile tiles[2][2][2][2][4] = {
    {{{TILE_SHAPES(shared), {NULL}}, {TILE_SHAPES(shared_f16), {NULL}}},
     {{TILE_SHAPES(32), TILE_SHAPES(32_min)}, {TILE_SHAPES(32_f16), TILE_SHAPES(32_f16_min)}}},
    {{{TILE_SHAPES(shared_vnni), {NULL}}, {TILE_SHAPES(shared_f16_vnni), {NULL}}},
     {{TILE_SHAPES(32_vnni), TILE_SHAPES(32_min_vnni)}, {TILE_SHAPES(32_f16_vnni), TILE_SHAPES(32_f16_min_vnni)}}},
};
static const Tile int8_tiles[2][2][2][4] = {
    {{TILE_SHAPES(int8_shared), TILE_SHAPES(int8_shared_f16)}, {TILE_SHAPES(int8_32), TILE_SHAPES(int8_32_f16)}},
    {{TILE_SHAPES(int8_shared_vnni), TILE_SHAPES(int8_shared_f16_vnni)},
     {TILE_SHAPES(int8_32_vnni), TILE_SHAPES(int8_32_f16_vnni)}},
};

/* one unit: a block of rows against a chunk of columns */
static void multiply_unit(void *data, size_t unit) {
  const Work *w = data;
  const int64_t row_block = (int64_t)unit / w->column_chunks, chunk = (int64_t)unit % w->column_chunks;
  const int64_t r0 = row_block * ROW_BLOCK, r1 = r0 + ROW_BLOCK < w->m ? r0 + ROW_BLOCK : w->m;
  const int64_t c0 = chunk * COLUMN_CHUNK(w->n), c1 = c0 + COLUMN_CHUNK(w->n) < w->n ? c0 + COLUMN_CHUNK(w->n) : w->n;
  const Tile *tile = w->bits == 8 ? int8_tiles[w->vnni][w->block_size == 32][w->scales_f16]
                                   : tiles[w->vnni][w->block_size == 32][w->scales_f16][w->minimums != NULL];
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    int64_t c = c0;
    for (; c + 2 <= c1; c += 2) tile[TILE_4x2](w, r, c);
    for (; c < c1; c++) tile[TILE_4x1](w, r, c);
  }
  for (; r < r1; r++) {
    int64_t c = c0;
    for (; c + 4 <= c1; c += 4) tile[TILE_1x4](w, r, c);
    for (; c < c1; c++) tile[TILE_1x1](w, r, c);
  }
}

typedef struct Kernel {
  OrtApiTable api;
  int64_t k, n, block_size, swiglu;
  int bits; /* 4: Int4MatMul, 8: Int8MatMul */
  int vnni; /* this CPU has AVX-512 VNNI (+ VL) and KERNEL_ISA_VARIABLE does not say avx2 */
} Kernel;

/* a failed status whose message names the op */
static OrtStatus *refuse(OrtApiTable api, int bits, const char *message) {
  char named[256];
  snprintf(named, sizeof(named), "Int%dMatMul: %s", bits, message);
  return fail(api, named);
}

static OrtStatus *compute(void *kernel_state, OrtKernelContext *context) {
  const Kernel *kernel = kernel_state;
  OrtApiTable api = kernel->api;
  const OrtValue *inputs[4] = {NULL};
  void *data[4] = {NULL};
  int64_t dims[4][4];
  size_t rank[4], count = 0;
  int element_type[4];
  if (API(api, KernelContext_GetInputCount, OrtStatus *(*)(const OrtKernelContext *, size_t *))(context, &count) ||
      count < 3 || count > 4)
    return refuse(api, kernel->bits, "takes 3 inputs (A, B, scales) or 4 (and minimums, int4 only)");
  for (size_t i = 0; i < count; i++)
    if (API(api, KernelContext_GetInput, OrtStatus *(*)(const OrtKernelContext *, size_t, const OrtValue **))(
            context, i, &inputs[i]) || !inputs[i] || !tensor_typed(api, inputs[i], &data[i], dims[i], &rank[i], &element_type[i]))
      return refuse(api, kernel->bits, "cannot read its inputs");
  int64_t m = 1, scale_count = 1, minimum_count = 1;
  for (size_t i = 0; i + 1 < rank[0]; i++) m *= dims[0][i];
  for (size_t i = 0; i < rank[2]; i++) scale_count *= dims[2][i];
  for (size_t i = 0; count == 4 && i < rank[3]; i++) minimum_count *= dims[3][i];
  if (count == 4 && (kernel->bits != 4 || kernel->block_size != 32 || element_type[3] != ELEMENT_FLOAT16 ||
                     minimum_count != kernel->n * (kernel->k / 32)))
    return refuse(api, kernel->bits, "minimums must be N * K / 32 float16s, for blocks of 32");
  if (rank[0] < 1 || dims[0][rank[0] - 1] != kernel->k || dims[1][0] != kernel->n || dims[1][1] * dims[1][2] * 8 / kernel->bits != kernel->k)
    return refuse(api, kernel->bits, "the input's last axis or the weight's shape does not match K and N");
  if ((element_type[2] != ELEMENT_FLOAT && element_type[2] != ELEMENT_FLOAT16) ||
      scale_count != kernel->n * (kernel->k / kernel->block_size))
    return refuse(api, kernel->bits, "the scales must be N * K / block_size floats or float16s");
  int64_t out_dims[4];
  memcpy(out_dims, dims[0], sizeof(out_dims));
  out_dims[rank[0] - 1] = kernel->swiglu ? kernel->n / 2 : kernel->n;
  OrtValue *output = NULL;
  void *y = NULL;
  int64_t ignored[4];
  if (API(api, KernelContext_GetOutput, OrtStatus *(*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **))(
          context, 0, out_dims, rank[0], &output) || !tensor(api, output, &y, ignored))
    return refuse(api, kernel->bits, "cannot allocate its output");
  if (m == 0) return NULL;
  const int64_t groups = (kernel->k / 32 + 1) / 2;
  const size_t quantized_bytes = (size_t)(m * groups * (64 + 8 * sizeof(int32_t) + 2 * 8 * sizeof(float)));
  /* a swiglu node's product goes to scratch after the quantized rows (an offset that keeps floats aligned) */
  char *buffer = malloc(quantized_bytes + (kernel->swiglu ? (size_t)(m * kernel->n) * sizeof(float) : 0));
  if (!buffer) return refuse(api, kernel->bits, "out of memory");
  Work work = {data[0], y, data[1], data[2], data[3], kernel->swiglu ? (float *)(buffer + quantized_bytes) : y,
               {(int8_t *)buffer, (int32_t *)(buffer + m * groups * 64), (float *)(buffer + m * groups * 96),
                (float *)(buffer + m * groups * 128)},
               m, kernel->k, kernel->n, kernel->block_size, groups, (m + ROW_BLOCK - 1) / ROW_BLOCK,
               (kernel->n + COLUMN_CHUNK(kernel->n) - 1) / COLUMN_CHUNK(kernel->n), element_type[2] == ELEMENT_FLOAT16,
               kernel->bits, kernel->vnni};
  OrtStatus *(*parallel_for)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *) =
      API(api, KernelContext_ParallelFor, OrtStatus *(*)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *));
  OrtStatus *status = parallel_for(context, quantize_rows, (size_t)work.row_blocks, 0, &work);
  if (!status) status = parallel_for(context, multiply_unit, (size_t)(work.row_blocks * work.column_chunks), 0, &work);
  if (!status && kernel->swiglu) status = parallel_for(context, silu_times_up, (size_t)work.row_blocks, 0, &work);
  free(buffer);
  return status;
}

/* whether the kernels take their VNNI tiles: the CPU has AVX-512 VNNI and VL, and KERNEL_ISA_VARIABLE is not "avx2" */
static int use_vnni(void) {
  const char *isa = getenv(KERNEL_ISA_VARIABLE);
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && !(isa && !strcmp(isa, "avx2"));
}

/* the tiles a kernel created now takes, for tools and tests: "avx512vnni" or "avx2" */
__attribute__((visibility("default"))) const char *QuantizedMatMulIsa(void) { return use_vnni() ? "avx512vnni" : "avx2"; }

static OrtStatus *create_kernel(const OrtCustomOp *op, OrtApiTable api, const OrtKernelInfo *info, void **out) {
  const int bits = op == &int8_matmul_op ? 8 : 4;
  Kernel *kernel = calloc(1, sizeof(Kernel));
  if (!kernel) return refuse(api, bits, "out of memory");
  kernel->api = api;
  kernel->bits = bits;
  kernel->vnni = use_vnni();
  OrtStatus *(*get_int)(const OrtKernelInfo *, const char *, int64_t *) =
      API(api, KernelInfoGetAttribute_int64, OrtStatus *(*)(const OrtKernelInfo *, const char *, int64_t *));
  OrtStatus *status = get_int(info, "K", &kernel->k);
  if (!status) status = get_int(info, "N", &kernel->n);
  if (!status) status = get_int(info, "block_size", &kernel->block_size);
  OrtStatus *absent = status ? NULL : get_int(info, "swiglu", &kernel->swiglu);
  if (absent) { /* an optional attribute: a plain matmul */
    API(api, ReleaseStatus, void (*)(OrtStatus *))(absent);
    kernel->swiglu = 0;
  }
  if (!status && (kernel->swiglu < 0 || kernel->swiglu > 1 || (kernel->swiglu && kernel->n % 2)))
    status = refuse(api, kernel->bits, "swiglu must be 0 or 1, and 1 needs an even N (gate columns, then up columns)");
  if (!status && (kernel->n <= 0 || kernel->k <= 0 || kernel->block_size < 32 ||
                  (kernel->block_size & (kernel->block_size - 1)) || kernel->k % kernel->block_size))
    status = refuse(api, kernel->bits, "block_size must be a power of 2 of at least 32 that divides K");
  if (!status && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
    status = refuse(api, kernel->bits, "this CPU lacks AVX2, FMA or F16C, which the kernel needs (build the engine with "
                       "--onnxruntime-quantized-matmul to run onnxruntime's MatMulNBits instead)");
  if (status) {
    free(kernel);
    return status;
  }
  *out = kernel;
  return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { return op == &int8_matmul_op ? "Int8MatMul" : "Int4MatMul"; }
/* scales: float or float16; minimums: float16 */
static const int input_types[4] = {ELEMENT_FLOAT, ELEMENT_UINT8, ELEMENT_ANY, ELEMENT_FLOAT16};
static int input_type(const OrtCustomOp *op, size_t index) { (void)op; return input_types[index]; }
static size_t input_count(const OrtCustomOp *op) { (void)op; return 4; }
static int minimums_optional(const OrtCustomOp *op, size_t index) {
  (void)op;
  return index == 3 ? INPUT_OPTIONAL : INPUT_REQUIRED;
}
static size_t output_count(const OrtCustomOp *op) { (void)op; return 1; }

OrtCustomOp int4_matmul_op =
    CPU_CUSTOM_OP(op_name, input_type, input_count, minimums_optional, output_count, create_kernel, compute, destroy_kernel);
OrtCustomOp int8_matmul_op =
    CPU_CUSTOM_OP(op_name, input_type, input_count, minimums_optional, output_count, create_kernel, compute, destroy_kernel);
