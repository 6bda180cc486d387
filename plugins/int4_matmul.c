/* Int4MatMul: Y = A W^T for int4 weights in blocks along K, as an onnxruntime CPU custom op in the place of
 * com.microsoft::MatMulNBits (bits 4, accuracy_level 4: int8 activations) under the same contract
 * (plugins/quant_linear.py) except for the weights' order in memory (below), and that the scales may be float16 as
 * well as float (engines store them as float16: a weight then streams 4.5 bits from memory, not 5). Inputs: A [..., K]
 * f32; B uint8, the weights in column tiles; scales f32 or f16, in column tiles; optionally minimums of the scales'
 * type in column tiles, for blocks of 32: then w = scale * q + minimum with q the unsigned nibble instead of
 * scale * (q - 8) (llama.cpp's Q4_1 block, its two float16s taken as they are; or a Q4_K sub-block, whose scale and
 * minimum are products d x sc and dmin x m that only float holds exactly). Output [..., N] f32. Attributes: K, N, block_size (a power
 * of 2 of at least 32 that divides K), column_tile (16: the layout below, which the node must say it holds), swiglu
 * (optional, 0 or 1).
 *
 * Factored scales (a Q4_K sub-block's as the file stores them, 4.625 bits a weight instead of 6): with a fifth input,
 * factors, float16 [tiles][K / 256][2][16] (per 256 inputs, the scales' factor d, then the minimums' factor -dmin),
 * the scales and minimums are uint8 multipliers in column tiles (sc and m), and the kernel forms d x sc and
 * -dmin x m in float32 as it reads them: the same floats (a float16 times an integer below 256 is exact there), so
 * the same results bit for bit as those products stored as floats. Blocks of 32, K a multiple of 256.
 *
 * Int8MatMul, the same op for MatMulNBits's 8-bit blocks (q + 128 stored as uint8, w = scale * q), which hold
 * llama.cpp's Q8_0 blocks (blocks of 32, float16 scales) exactly; no minimums.
 *
 * Int6MatMul, for llama.cpp's Q6_K (6.5625 bits a weight, as the file holds it): w = d x sc x (q - 32) with q of 6
 * bits, sc an int8 multiplier per 16 inputs and d a float16 factor per 256. Inputs: A; B, the 6-bit weights in
 * column tiles (below: per chunk the low nibbles as int4's 4 vectors, then 2 vectors of the high two bits); the
 * multipliers, int8 [tiles][K / 16][16]; the factors, float16 [tiles][K / 256][16]. block_size 16, K a multiple of
 * 256. A chunk's integer sum over both its sub-blocks, sc x (q . a - 32 x the sub-block's sum of a), is exact in int32
 * and meets d and the activations' scale in one fma. Its tiles are AVX2 ones on every CPU (none for VNNI yet).
 *
 * Int5MatMul, for llama.cpp's Q5_0 (5.5 bits a weight, as the file holds it): w = scale x (q - 16) with q of 5 bits,
 * under Int8MatMul's contract otherwise (A, B, scales float or float16 per block). B in column tiles of 5 vectors a
 * chunk: the low nibbles as int4's 4, then one whose lane byte b holds the high bit of vector s's even value b in
 * bit 2s and of its odd one in bit 2s + 1. With minimums (blocks of 32), w = scale x q + minimum as Int4MatMul's:
 * llama.cpp's Q5_1 (float16 scale and minimum, 6 bits a weight) and, factored as Int4MatMul's with a fifth input,
 * Q5_K (5.625 bits a weight against the file's 5.5).
 *
 * Column tiles (plugins/int4_matmul.py's `tile_columns` writes them from MatMulNBits's [N, K / block, block * bits /
 * 8]): the columns in tiles of 16, N padded with zero columns to a multiple of 16; per tile, per 32 values of K (a
 * "chunk"), `bits` vectors of 64 bytes, in which lane j (4 bytes) of vector s holds bytes 4s .. 4s + 3 of column j's
 * chunk as MatMulNBits orders them. One 64-byte load then feeds 16 columns at once against 4 activations broadcast
 * to every lane (vpdpbusd), and a chunk's dot products come out one per int32 lane, one lane per column: its scale
 * applies without horizontal sums, and the tile's weights are unpacked once for all the rows of the call. Scales
 * [tiles][K / block][16] and minimums [tiles][K / 32][16] follow the same order.
 *
 * With swiglu = 1 the node is also the MLP's activation: W holds the gate's N / 2 columns, then the up projection's,
 * and the output [..., N / 2] is silu(gate) * up, which the step graph otherwise computes in four more nodes (Split,
 * Sigmoid, Mul, Mul: three kernels a layer after onnxruntime fuses two).
 *
 * Why our own: a row's result here does not depend on the other rows of the call. onnxruntime's kernel takes
 * another path for one row than for several, which rounds differently, so an engine that must give a request the
 * same greedy tokens alone or in a batch padded one-row decode calls to two rows (runner/executor.py's probe). Here
 * every output is the same sequence of operations whatever the rows around it, so one row runs alone; and a call of
 * several rows reads and unpacks each weight once.
 *
 * How: each row of A is quantized per chunk of 32 to int8 (scale max|a| / 127, as onnxruntime's int8 path does);
 * for int4 each 8 values are stored evens first, as the nibbles of a weight byte pair them. Per chunk and column the
 * integer dot product (unsigned weights x signed activations) is exact; less the zero point x the activations' sum
 * (8 for int4, 128 for int8's stored q + 128), converted to float, times the weight scale x the activation scale, it
 * is added to the column's sum with one fma (and minimum x scale x the activations' sum with a second, for Q4_1).
 * Columns are split over the session's threads in groups of tiles, rows in blocks of 64 whose quantized activations
 * stay in cache; within a tile, rows go 4 at a time (8 on the VNNI tiles) against each unpacked chunk.
 * Needs AVX2, FMA and F16C (kernel creation fails without them). Where the CPU has AVX-512 (F, BW) and VNNI the
 * tiles take 512-bit vectors and vpdpbusd; the integer sums are exact and the float operations per column the same
 * on both, so the results are the same bit for bit (LLM_ENGINE_BUILDER_KERNEL_ISA=avx2 keeps the AVX2 tiles;
 * QuantizedMatMulIsa() says which a kernel takes).
 */
#include <immintrin.h>
#include <stdio.h>

#include "ort_abi.h"

#define TILE_COLUMNS 16 /* the column_tile attribute a node must hold */
#define ROW_BLOCK 64    /* rows of A per unit of work */
/* rows that meet each unpacked chunk together: the AVX2 tiles' 16 registers hold 4 rows' sums beside the unpacked
 * chunk, the VNNI tiles' 32 hold 8 (a 5-8 node verify tree or decode batch then unpacks its weights once) */
#define ROW_TILE_AVX2 4
#define ROW_TILE_VNNI 8
/* tiles per unit of work: enough units that the session's threads share a small matrix evenly (N = 576: 36) */
#define TILES_PER_UNIT(tiles) ((tiles) >= 128 ? 4 : 1)
/* v is computed here, in a register: the integer sums' order may not be rearranged across this point, which keeps
 * the compiler from hoisting a chunk's products ahead of their sums (and spilling them, 16 registers being few) */
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
/* How far ahead of use the weights are fetched (a tile's chunks are contiguous; into the L2, ort_abi.h): on a Zen 4
 * VM one-row decode steps 5-9% faster than 2 KiB ahead into the L1, 6-token and 8-row steps 7-13%; 4 KiB into the L1
 * measured no better than 2 (docs/measurements.md) */
#define PREFETCH_BYTES 4096
#define CHUNKS_PER_SUPER_BLOCK 8 /* chunks of 32 that share factored scales' factors: a K-quant super-block of 256 */
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE_AVX2 __attribute__((always_inline, target("avx2,fma,f16c"))) static inline
#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vnni")))
#define INLINE_VNNI __attribute__((always_inline, target("avx2,fma,f16c,avx512f,avx512bw,avx512vnni"))) static inline

/* A's rows quantized, per row and chunk of 32 */
typedef struct QuantizedRows {
  int32_t *x;    /* [m][chunks][8]: the 32 int8 values, 4 to an int32 (int4: each 8 values evens first) */
  float *scale;  /* [m][chunks] */
  int32_t *zero; /* [m][chunks]: the weights' zero point (8, or 128) x the values' sum; for 6-bit weights the sums
                  * of the chunk's two halves, int16 each (the low one first), which each have their own multiplier */
  float *sum;    /* [m][chunks]: the values' sum x their scale, which the chunk's minimums multiply */
} QuantizedRows;

typedef struct Work {
  const float *a;
  float *out; /* the node's output: y itself, or for swiglu silu(gate) * up of y's halves */
  const uint8_t *w;
  const void *wscale;       /* float, or float16 (scales_f16); int8 multipliers for 6-bit weights */
  const void *minimums;     /* per chunk, of the scales' type (w = scale * q + minimum), or NULL */
  const uint16_t *factors;  /* float16 per 256 inputs, or NULL: then the scales and minimums are uint8 multipliers */
  float *y;
  QuantizedRows q;
  int64_t m, k, n, chunks, tiles, row_blocks, tile_groups;
  int shift; /* chunk c takes the scale of block c >> shift */
  int scales_f16; /* the scales, and minimums where there are, are float16 */
  int bits; /* 4, 5 (Int5MatMul), 6 (Int6MatMul) or 8 (Int8MatMul) */
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

INLINE_AVX2 int32_t lanes_sum(__m256i lanes) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* the lane sums of two vectors (each within int16: 16 values of at most 127) as the int16 pair vpmaddwd takes */
INLINE_AVX2 int32_t halves_of(__m256i low, __m256i high) {
  return (int32_t)((uint32_t)(uint16_t)lanes_sum(low) | (uint32_t)(uint16_t)lanes_sum(high) << 16);
}

/* A's rows [unit * ROW_BLOCK, ...) into w->q: per chunk of 32, scale max|a| / 127, values rounded to nearest even */
AVX2 static void quantize_rows(void *data, size_t unit) {
  const Work *w = data;
  const int64_t first = (int64_t)unit * ROW_BLOCK, last = first + ROW_BLOCK < w->m ? first + ROW_BLOCK : w->m;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* after packing to bytes */
  const __m256i evens_first = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                               0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  /* 6-bit weights' 32 goes with their multipliers */
  const int32_t zero_point = w->bits == 4 ? 8 : w->bits == 5 ? 16 : 128;
  for (int64_t r = first; r < last; r++) {
    for (int64_t c = 0; c < w->chunks; c++) {
      const float *v = w->a + r * w->k + c * 32;
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
      __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), in_order);
      if (w->bits != 8) bytes = _mm256_shuffle_epi8(bytes, evens_first);
      const int64_t at = r * w->chunks + c;
      _mm256_storeu_si256((__m256i *)(w->q.x + at * 8), bytes);
      const int32_t total = lanes_sum(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      w->q.scale[at] = largest / 127.0f;
      w->q.zero[at] = w->bits == 6 ? halves_of(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]))
                                   : zero_point * total;
      w->q.sum[at] = (float)total * (largest / 127.0f);
    }
  }
}

/* columns [first, first + count) of a row's output from a tile's sums; count < lanes stores only those */
INLINE_VNNI void store_columns_512(float *y, __m512 v, int64_t count) {
  if (count >= 16)
    _mm512_storeu_ps(y, v);
  else if (count > 0)
    _mm512_mask_storeu_ps(y, (__mmask16)((1u << count) - 1), v);
}

INLINE_AVX2 void store_columns_256(float *y, __m256 v, int64_t count) {
  if (count >= 8) {
    _mm256_storeu_ps(y, v);
  } else if (count > 0) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), lane), v);
  }
}

/* values [at, at + 16) (or + 8) of a tile's scales or minimums, float16 (F16) or float, as floats */
INLINE_VNNI __m512 floats_512(const void *values, int64_t at, const int F16) {
  return F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)values + at)))
             : _mm512_loadu_ps((const float *)values + at);
}

INLINE_AVX2 __m256 floats_256(const void *values, int64_t at, const int F16) {
  return F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)values + at)))
             : _mm256_loadu_ps((const float *)values + at);
}

/* where tile t's 16 scales of the block holding chunk c start, its 16 minimums (or multipliers) of chunk c, and
 * its 16 factors of the scales (which = 0) or the minimums (which = 1) of the super-block holding chunk c */
static inline int64_t scales_at(const Work *w, int64_t t, int64_t c) {
  return (t * (w->chunks >> w->shift) + (c >> w->shift)) * TILE_COLUMNS;
}
static inline int64_t minimums_at(const Work *w, int64_t t, int64_t c) { return (t * w->chunks + c) * TILE_COLUMNS; }
static inline int64_t factors_at(const Work *w, int64_t t, int64_t c, int which) {
  return ((t * (w->chunks / CHUNKS_PER_SUPER_BLOCK) + c / CHUNKS_PER_SUPER_BLOCK) * 2 + which) * TILE_COLUMNS;
}

/* tile t's 16 factors of its scales (which = 0) or minimums (which = 1) for the super-block of chunk c, and the
 * 8 from lane `lane` */
INLINE_VNNI __m512 factors_512(const Work *w, int64_t t, int64_t c, int which) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->factors + factors_at(w, t, c, which))));
}

INLINE_AVX2 __m256 factors_256(const Work *w, int64_t t, int64_t c, int64_t lane, int which) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->factors + factors_at(w, t, c, which) + lane)));
}

/* 16 (or 8) uint8 multipliers from `at` times their factors, in float32 (the tiles convert a super-block's factors
 * once) */
INLINE_VNNI __m512 multiplied_512(const void *multipliers, int64_t at, __m512 factors) {
  const __m128i sixteen = _mm_loadu_si128((const __m128i *)((const uint8_t *)multipliers + at));
  return _mm512_mul_ps(factors, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sixteen)));
}

INLINE_AVX2 __m256 multiplied_256(const void *multipliers, int64_t at, __m256 factors) {
  const __m128i eight = _mm_loadl_epi64((const __m128i *)((const uint8_t *)multipliers + at));
  return _mm256_mul_ps(factors, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight)));
}

/* the 8 columns' scales (`half` of tile t) for chunk c, and their minimums (zero without MIN), as the 256-bit tiles
 * read them: float or float16 (F16), or FACTORED: uint8 multipliers times the super-block's `factor` */
INLINE_AVX2 __m256 scales_256(const Work *w, int64_t t, int64_t c, int half, __m256 factor, const int F16,
                              const int FACTORED) {
  return FACTORED ? multiplied_256(w->wscale, minimums_at(w, t, c) + 8 * half, factor)
                  : floats_256(w->wscale, scales_at(w, t, c) + 8 * half, F16);
}

INLINE_AVX2 __m256 minimums_256(const Work *w, int64_t t, int64_t c, int half, __m256 factor, const int MIN,
                                const int F16, const int FACTORED) {
  return FACTORED ? multiplied_256(w->minimums, minimums_at(w, t, c) + 8 * half, factor)
         : MIN    ? floats_256(w->minimums, minimums_at(w, t, c) + 8 * half, F16)
                  : _mm256_setzero_ps();
}

/* Rows [r, r + ROWS) against tile t, 512-bit: vector s of a chunk meets int32 s of the activations (int4: its low
 * nibbles int32 2s, its high ones 2s + 1), two chains of vpdpbusd to keep the adder busy. BITS 4 or 8; MIN: the
 * chunks carry minimums; F16: the scales (and minimums) are float16; FACTORED: they are factored (MIN too). */
INLINE_VNNI void tile_512(const Work *w, int64_t r, int64_t t, const int ROWS, const int BITS, const int MIN,
                          const int F16, const int FACTORED) {
  const int64_t chunks = w->chunks;
  const uint8_t *p = w->w + t * chunks * 64 * BITS;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[ROW_TILE_VNNI], factors[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; c++, p += 64 * BITS) {
    __m512i u[8];
    for (int s = 0; s < BITS; s++) prefetch_into_l2(p + PREFETCH_BYTES + 64 * s);
    if (FACTORED && !(c % CHUNKS_PER_SUPER_BLOCK))
      for (int which = 0; which < 2; which++) factors[which] = factors_512(w, t, c, which);
    if (BITS == 4) {
      for (int s = 0; s < 4; s++) {
        const __m512i v = _mm512_loadu_si512(p + 64 * s);
        u[2 * s] = _mm512_and_si512(v, low);
        u[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int s = 0; s < 8; s++) u[s] = _mm512_loadu_si512(p + 64 * s);
    }
    const __m512 ws = FACTORED ? multiplied_512(w->wscale, minimums_at(w, t, c), factors[0])
                               : floats_512(w->wscale, scales_at(w, t, c), F16);
    const __m512 wmin = FACTORED ? multiplied_512(w->minimums, minimums_at(w, t, c), factors[1])
                        : MIN    ? floats_512(w->minimums, minimums_at(w, t, c), F16)
                                 : _mm512_setzero_ps();
    for (int i = 0; i < ROWS; i++) {
      const int64_t at = (r + i) * chunks + c;
      const int32_t *x = w->q.x + at * 8;
      __m512i even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_set1_epi32(x[0]));
      __m512i odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], _mm512_set1_epi32(x[1]));
      for (int s = 2; s < 8; s += 2) {
        even = _mm512_dpbusd_epi32(even, u[s], _mm512_set1_epi32(x[s]));
        odd = _mm512_dpbusd_epi32(odd, u[s + 1], _mm512_set1_epi32(x[s + 1]));
      }
      __m512i dots = _mm512_add_epi32(even, odd);
      if (!MIN) dots = _mm512_sub_epi32(dots, _mm512_set1_epi32(w->q.zero[at]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(ws, _mm512_set1_ps(w->q.scale[at])), acc[i]);
      if (MIN) acc[i] = _mm512_fmadd_ps(wmin, _mm512_set1_ps(w->q.sum[at]), acc[i]);
    }
  }
  for (int i = 0; i < ROWS; i++) store_columns_512(w->y + (r + i) * w->n + t * 16, acc[i], w->n - t * 16);
}

/* The same on 256-bit vectors, half of tile t (8 columns) at a time: int4 through vpmaddubsw, its int16 pairs
 * summed over the chunk (at most 16 x 15 x 127, no saturation) before vpmaddwd; int8 through |w| x (x with w's
 * sign), since its unsigned products would saturate int16 (that sum is q's own: no zero point to subtract). Each
 * 32-byte vector of the chunk meets every row as soon as it is loaded and unpacked, so only it and the rows' sums
 * are live: with AVX2's 16 registers, unpacking a whole chunk first would spill the rows' sums to the stack. */
INLINE_AVX2 void tile_256(const Work *w, int64_t r, int64_t t, const int ROWS, const int BITS, const int MIN,
                          const int F16, const int FACTORED) {
  const int64_t chunks = w->chunks;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
  for (int half = 0; half < 2; half++) {
    const uint8_t *p = w->w + t * chunks * 64 * BITS + 32 * half;
    __m256 acc[ROW_TILE_AVX2], factors[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; c++, p += 64 * BITS) {
      if (!half)
        for (int s = 0; s < BITS; s++) prefetch_into_l2(p + PREFETCH_BYTES + 64 * s);
      if (FACTORED && !(c % CHUNKS_PER_SUPER_BLOCK))
        for (int which = 0; which < 2; which++) factors[which] = factors_256(w, t, c, 8 * half, which);
      const int32_t *x[ROW_TILE_AVX2];
      for (int i = 0; i < ROWS; i++) x[i] = w->q.x + ((r + i) * chunks + c) * 8;
      __m256i dots[ROW_TILE_AVX2]; /* int4: the int16 pairs until the chunk's end; int8: int32 sums */
      if (BITS == 4) {
        for (int s = 0; s < 4; s++) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * s));
          const __m256i evens = _mm256_and_si256(v, low), odds = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int i = 0; i < ROWS; i++) {
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(evens, _mm256_set1_epi32(x[i][2 * s])),
                                                   _mm256_maddubs_epi16(odds, _mm256_set1_epi32(x[i][2 * s + 1])));
            dots[i] = s ? _mm256_add_epi16(dots[i], pairs) : pairs;
            KEEP_IN_REGISTER(dots[i]);
          }
        }
        for (int i = 0; i < ROWS; i++) {
          dots[i] = _mm256_madd_epi16(dots[i], ones);
          if (!MIN) dots[i] = _mm256_sub_epi32(dots[i], _mm256_set1_epi32(w->q.zero[(r + i) * chunks + c]));
        }
      } else {
        for (int s = 0; s < 8; s++) {
          const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 64 * s)), flip); /* signed */
          const __m256i magnitude = _mm256_abs_epi8(q);
          for (int i = 0; i < ROWS; i++) {
            const __m256i products = _mm256_madd_epi16(
                _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(_mm256_set1_epi32(x[i][s]), q)), ones);
            dots[i] = s ? _mm256_add_epi32(dots[i], products) : products;
            KEEP_IN_REGISTER(dots[i]);
          }
        }
      }
      const __m256 ws = scales_256(w, t, c, half, factors[0], F16, FACTORED);
      const __m256 wmin = minimums_256(w, t, c, half, factors[1], MIN, F16, FACTORED);
      for (int i = 0; i < ROWS; i++) {
        const int64_t at = (r + i) * chunks + c;
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i]), _mm256_mul_ps(ws, _mm256_set1_ps(w->q.scale[at])), acc[i]);
        if (MIN) acc[i] = _mm256_fmadd_ps(wmin, _mm256_set1_ps(w->q.sum[at]), acc[i]);
      }
    }
    for (int i = 0; i < ROWS; i++)
      store_columns_256(w->y + (r + i) * w->n + t * 16 + 8 * half, acc[i], w->n - t * 16 - 8 * half);
  }
}

/* Int6MatMul's tiles, half of tile t (8 columns) at a time. A chunk is 6 vectors of 64 bytes: its low nibbles as
 * int4's 4 (vector s: values 8s .. 8s + 7, evens in the low nibbles), then for values 0-15 and 16-31 one vector each
 * whose lane byte b holds the high two bits of vector 2h's even value b in bits 0-1, its odd one in bits 2-3, and
 * vector 2h + 1's in bits 4-5 and 6-7. Each vector's vpmaddubsw pairs, evens plus odds (at most 2 x 2 x 63 x 127 =
 * 32004: no saturation), meet the multiplier of their sub-block of 16 in vpmaddwd, and 32 x the multipliers times
 * the sub-blocks' activation sums come off once per chunk: an exact int32 per column. */
INLINE_AVX2 void tile6_256(const Work *w, int64_t r, int64_t t, const int ROWS) {
  const int64_t chunks = w->chunks;
  const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
  const int8_t *multipliers = (const int8_t *)w->wscale + t * chunks * 2 * TILE_COLUMNS;
  for (int half = 0; half < 2; half++) {
    const uint8_t *p = w->w + t * chunks * 64 * 6 + 32 * half;
    __m256 acc[ROW_TILE_AVX2], factors = _mm256_setzero_ps();
    for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; c++, p += 64 * 6) {
      if (!half)
        for (int s = 0; s < 6; s++) prefetch_into_l2(p + PREFETCH_BYTES + 64 * s);
      if (!(c % CHUNKS_PER_SUPER_BLOCK)) {
        const int64_t super_block = t * (chunks / CHUNKS_PER_SUPER_BLOCK) + c / CHUNKS_PER_SUPER_BLOCK;
        factors = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->factors + super_block * TILE_COLUMNS + 8 * half)));
      }
      /* the chunk's multipliers: the tile's 16 columns' for values 0-15, then theirs for values 16-31 */
      const int8_t *sc = multipliers + 2 * c * TILE_COLUMNS + 8 * half;
      const int32_t *x[ROW_TILE_AVX2];
      for (int i = 0; i < ROWS; i++) x[i] = w->q.x + ((r + i) * chunks + c) * 8;
      __m256i dots[ROW_TILE_AVX2];
      for (int s = 0; s < 4; s++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * s));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 64 * (4 + s / 2)));
        const __m128i own = _mm_loadl_epi64((const __m128i *)(sc + (s / 2) * TILE_COLUMNS));
        const __m256i multiplier = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(own, own)); /* (sc, sc) per column */
        const __m256i evens = _mm256_or_si256(_mm256_and_si256(v, low),
                                              _mm256_and_si256(s % 2 ? h : _mm256_slli_epi16(h, 4), high));
        const __m256i odds = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                             _mm256_and_si256(s % 2 ? _mm256_srli_epi16(h, 2) : _mm256_slli_epi16(h, 2), high));
        for (int i = 0; i < ROWS; i++) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(evens, _mm256_set1_epi32(x[i][2 * s])),
                                                 _mm256_maddubs_epi16(odds, _mm256_set1_epi32(x[i][2 * s + 1])));
          const __m256i products = _mm256_madd_epi16(pairs, multiplier);
          dots[i] = s ? _mm256_add_epi32(dots[i], products) : products;
          KEEP_IN_REGISTER(dots[i]);
        }
      }
      const __m256i both = _mm256_cvtepi8_epi16( /* (sc of values 0-15, sc of 16-31) per column */
          _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)sc), _mm_loadl_epi64((const __m128i *)(sc + TILE_COLUMNS))));
      for (int i = 0; i < ROWS; i++) {
        const int64_t at = (r + i) * chunks + c;
        const __m256i zero = _mm256_slli_epi32(_mm256_madd_epi16(both, _mm256_set1_epi32(w->q.zero[at])), 5);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dots[i], zero)),
                                 _mm256_mul_ps(factors, _mm256_set1_ps(w->q.scale[at])), acc[i]);
      }
    }
    for (int i = 0; i < ROWS; i++)
      store_columns_256(w->y + (r + i) * w->n + t * 16 + 8 * half, acc[i], w->n - t * 16 - 8 * half);
  }
}

/* Int5MatMul's tiles, half of tile t (8 columns) at a time: a chunk is int4's 4 vectors of low nibbles and one of
 * high bits (vector s's even value b in lane byte b's bit 2s, its odd one in bit 2s + 1), each shifted to bit 4 of
 * its value's byte (a 16-bit shift of at most 4 moves no bit across a byte to bit 4). A vector's vpmaddubsw pairs,
 * evens plus odds, reach 2 x 2 x 31 x 127 = 15748: each vector goes through vpmaddwd on its own (summing two in
 * int16 first would hold a second sum per row, more than AVX2's 16 registers keep beside the chunk); 16 x the
 * activations' sum comes off as int4's 8 does, or with minimums (MIN; FACTORED: factored as Int4MatMul's) the
 * minimum meets the activations' sum in a second fma, as in tile_256. */
INLINE_AVX2 void tile5_256(const Work *w, int64_t r, int64_t t, const int ROWS, const int MIN, const int F16,
                           const int FACTORED) {
  const int64_t chunks = w->chunks;
  const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; half++) {
    const uint8_t *p = w->w + t * chunks * 64 * 5 + 32 * half;
    __m256 acc[ROW_TILE_AVX2], factors[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < ROWS; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; c++, p += 64 * 5) {
      if (!half)
        for (int s = 0; s < 5; s++) prefetch_into_l2(p + PREFETCH_BYTES + 64 * s);
      if (FACTORED && !(c % CHUNKS_PER_SUPER_BLOCK))
        for (int which = 0; which < 2; which++) factors[which] = factors_256(w, t, c, 8 * half, which);
      const int32_t *x[ROW_TILE_AVX2];
      for (int i = 0; i < ROWS; i++) x[i] = w->q.x + ((r + i) * chunks + c) * 8;
      const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 64 * 4));
      __m256i dots[ROW_TILE_AVX2];
      for (int s = 0; s < 4; s++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * s));
        /* bit 2s (evens) and 2s + 1 (odds) of h to bit 4 */
        const __m256i even_high = s == 0 ? _mm256_slli_epi16(h, 4) : s == 1 ? _mm256_slli_epi16(h, 2)
                                : s == 2 ? h : _mm256_srli_epi16(h, 2);
        const __m256i odd_high = s == 0 ? _mm256_slli_epi16(h, 3) : s == 1 ? _mm256_slli_epi16(h, 1)
                               : s == 2 ? _mm256_srli_epi16(h, 1) : _mm256_srli_epi16(h, 3);
        const __m256i evens = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(even_high, bit4));
        const __m256i odds = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_and_si256(odd_high, bit4));
        for (int i = 0; i < ROWS; i++) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(evens, _mm256_set1_epi32(x[i][2 * s])),
                                                 _mm256_maddubs_epi16(odds, _mm256_set1_epi32(x[i][2 * s + 1])));
          const __m256i products = _mm256_madd_epi16(pairs, ones);
          dots[i] = s ? _mm256_add_epi32(dots[i], products) : products;
          KEEP_IN_REGISTER(dots[i]);
        }
      }
      const __m256 ws = scales_256(w, t, c, half, factors[0], F16, FACTORED);
      const __m256 wmin = minimums_256(w, t, c, half, factors[1], MIN, F16, FACTORED);
      for (int i = 0; i < ROWS; i++) {
        const int64_t at = (r + i) * chunks + c;
        const __m256i centred = MIN ? dots[i] : _mm256_sub_epi32(dots[i], _mm256_set1_epi32(w->q.zero[at]));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), _mm256_mul_ps(ws, _mm256_set1_ps(w->q.scale[at])), acc[i]);
        if (MIN) acc[i] = _mm256_fmadd_ps(wmin, _mm256_set1_ps(w->q.sum[at]), acc[i]);
      }
    }
    for (int i = 0; i < ROWS; i++)
      store_columns_256(w->y + (r + i) * w->n + t * 16 + 8 * half, acc[i], w->n - t * 16 - 8 * half);
  }
}

typedef void (*Tile)(const Work *w, int64_t r, int64_t t);
/* one function per tile kind and number of rows (1 .. its ROW_TILE), each with its loops unrolled for them */
#define DEFINE_ROW(NAME, ISA, WIDTH, ROWS, BITS, MIN, F16, FACTORED) \
  ISA static void NAME##_##ROWS(const Work *w, int64_t r, int64_t t) { tile_##WIDTH(w, r, t, ROWS, BITS, MIN, F16, FACTORED); }
#define DEFINE_KIND(NAME, BITS, MIN, F16, FACTORED)                \
  DEFINE_ROW(NAME, AVX2, 256, 1, BITS, MIN, F16, FACTORED)         \
  DEFINE_ROW(NAME, AVX2, 256, 2, BITS, MIN, F16, FACTORED)         \
  DEFINE_ROW(NAME, AVX2, 256, 3, BITS, MIN, F16, FACTORED)         \
  DEFINE_ROW(NAME, AVX2, 256, 4, BITS, MIN, F16, FACTORED)         \
  DEFINE_ROW(NAME##_vnni, VNNI, 512, 1, BITS, MIN, F16, FACTORED)  \
  DEFINE_ROW(NAME##_vnni, VNNI, 512, 2, BITS, MIN, F16, FACTORED)  \
  DEFINE_ROW(NAME##_vnni, VNNI, 512, 3, BITS, MIN, F16, FACTORED)  \
  DEFINE_ROW(NAME##_vnni, VNNI, 512, 4, BITS, MIN, F16, FACTORED)  \
  DEFINE_ROW(NAME##_vnni, VNNI, 512, 5, BITS, MIN, F16, FACTORED)  \
  DEFINE_ROW(NAME##_vnni, VNNI, 512, 6, BITS, MIN, F16, FACTORED)  \
  DEFINE_ROW(NAME##_vnni, VNNI, 512, 7, BITS, MIN, F16, FACTORED)  \
  DEFINE_ROW(NAME##_vnni, VNNI, 512, 8, BITS, MIN, F16, FACTORED)
DEFINE_KIND(int4, 4, 0, 0, 0)
DEFINE_KIND(int4_f16, 4, 0, 1, 0)
DEFINE_KIND(int4_min, 4, 1, 0, 0)
DEFINE_KIND(int4_min_f16, 4, 1, 1, 0)
DEFINE_KIND(int4_factored, 4, 1, 0, 1)
DEFINE_KIND(int8, 8, 0, 0, 0)
DEFINE_KIND(int8_f16, 8, 0, 1, 0)
#define KIND_OF(NAME)                                          \
  {{NAME##_1, NAME##_2, NAME##_3, NAME##_4},                   \
   {NAME##_vnni_1, NAME##_vnni_2, NAME##_vnni_3, NAME##_vnni_4, \
    NAME##_vnni_5, NAME##_vnni_6, NAME##_vnni_7, NAME##_vnni_8}}
#define DEFINE_INT6_ROW(ROWS) \
  AVX2 static void int6_##ROWS(const Work *w, int64_t r, int64_t t) { tile6_256(w, r, t, ROWS); }
DEFINE_INT6_ROW(1)
DEFINE_INT6_ROW(2)
DEFINE_INT6_ROW(3)
DEFINE_INT6_ROW(4)
static const Tile int6_tiles[ROW_TILE_AVX2] = {int6_1, int6_2, int6_3, int6_4};
#define DEFINE_INT5_ROW(NAME, ROWS, MIN, F16, FACTORED) \
  AVX2 static void NAME##_##ROWS(const Work *w, int64_t r, int64_t t) { tile5_256(w, r, t, ROWS, MIN, F16, FACTORED); }
#define DEFINE_INT5_KIND(NAME, MIN, F16, FACTORED) \
  DEFINE_INT5_ROW(NAME, 1, MIN, F16, FACTORED)     \
  DEFINE_INT5_ROW(NAME, 2, MIN, F16, FACTORED)     \
  DEFINE_INT5_ROW(NAME, 3, MIN, F16, FACTORED)     \
  DEFINE_INT5_ROW(NAME, 4, MIN, F16, FACTORED)
DEFINE_INT5_KIND(int5, 0, 0, 0)
DEFINE_INT5_KIND(int5_f16, 0, 1, 0)
DEFINE_INT5_KIND(int5_min, 1, 0, 0)
DEFINE_INT5_KIND(int5_min_f16, 1, 1, 0)
DEFINE_INT5_KIND(int5_factored, 1, 0, 1)
#define INT5_KIND_OF(NAME) {NAME##_1, NAME##_2, NAME##_3, NAME##_4}
enum { INT4, INT4_MIN, INT4_FACTORED, INT8 };
/* [kind (INT4: none, INT4_MIN: minimums, INT4_FACTORED: factored)][float16 scales][rows - 1] */
static const Tile int5_tiles[3][2][ROW_TILE_AVX2] = {
    {INT5_KIND_OF(int5), INT5_KIND_OF(int5_f16)},
    {INT5_KIND_OF(int5_min), INT5_KIND_OF(int5_min_f16)},
    {INT5_KIND_OF(int5_factored), INT5_KIND_OF(int5_factored)},
};
/* [kind][float16 scales][VNNI][rows - 1] (factored scales are uint8: never float16) */
static const Tile tiles[4][2][2][ROW_TILE_VNNI] = {
    {KIND_OF(int4), KIND_OF(int4_f16)},
    {KIND_OF(int4_min), KIND_OF(int4_min_f16)},
    {KIND_OF(int4_factored), KIND_OF(int4_factored)},
    {KIND_OF(int8), KIND_OF(int8_f16)},
};

/* one unit: a block of rows against a group of tiles */
static void multiply_unit(void *data, size_t unit) {
  const Work *w = data;
  const int64_t row_block = (int64_t)unit / w->tile_groups, group = (int64_t)unit % w->tile_groups;
  const int64_t r0 = row_block * ROW_BLOCK, r1 = r0 + ROW_BLOCK < w->m ? r0 + ROW_BLOCK : w->m;
  const int64_t per_group = TILES_PER_UNIT(w->tiles), t0 = group * per_group;
  const int64_t t1 = t0 + per_group < w->tiles ? t0 + per_group : w->tiles;
  const int kind = w->bits == 8 ? INT8 : w->factors ? INT4_FACTORED : w->minimums ? INT4_MIN : INT4;
  /* Int6MatMul and Int5MatMul have AVX2 tiles only */
  const Tile *tile = w->bits == 6   ? int6_tiles
                     : w->bits == 5 ? int5_tiles[kind][w->scales_f16]
                                    : tiles[kind][w->scales_f16][w->vnni];
  const int64_t rows = w->vnni && w->bits != 6 && w->bits != 5 ? ROW_TILE_VNNI : ROW_TILE_AVX2;
  for (int64_t t = t0; t < t1; t++)
    for (int64_t r = r0; r < r1; r += rows) tile[(r1 - r < rows ? r1 - r : rows) - 1](w, r, t);
}

typedef struct Kernel {
  OrtApiTable api;
  int64_t k, n, block_size, swiglu;
  int bits; /* 4: Int4MatMul, 5: Int5MatMul, 6: Int6MatMul, 8: Int8MatMul */
  int vnni; /* this CPU has AVX-512 (F, BW) and VNNI and KERNEL_ISA_VARIABLE does not say avx2 */
} Kernel;

/* a failed status whose message names the op */
static OrtStatus *refuse(OrtApiTable api, int bits, const char *message) {
  char named[256];
  snprintf(named, sizeof(named), "Int%dMatMul: %s", bits, message);
  return fail(api, named);
}

/* a node's inputs (at most 5, each of at most 4 dimensions), read for compute */
typedef struct Inputs {
  size_t count;
  void *data[5];
  int64_t dims[5][4], counts[5]; /* counts: each input's number of values */
  size_t rank[5];
  int type[5];
} Inputs;

enum { INPUTS_READ, INPUTS_NOT_3_TO_5, INPUTS_UNREADABLE };

static int read_inputs(OrtApiTable api, OrtKernelContext *context, Inputs *in) {
  if (API(api, KernelContext_GetInputCount, OrtStatus *(*)(const OrtKernelContext *, size_t *))(context, &in->count) ||
      in->count < 3 || in->count > 5)
    return INPUTS_NOT_3_TO_5;
  for (size_t i = 0; i < in->count; i++) {
    const OrtValue *value = NULL;
    if (API(api, KernelContext_GetInput, OrtStatus *(*)(const OrtKernelContext *, size_t, const OrtValue **))(
            context, i, &value) || !value ||
        !tensor_typed(api, value, &in->data[i], in->dims[i], &in->rank[i], &in->type[i]))
      return INPUTS_UNREADABLE;
    in->counts[i] = 1;
    for (size_t d = 0; d < in->rank[i]; d++) in->counts[i] *= in->dims[i][d];
  }
  return INPUTS_READ;
}

static OrtStatus *compute(void *kernel_state, OrtKernelContext *context) {
  const Kernel *kernel = kernel_state;
  OrtApiTable api = kernel->api;
  Inputs in = {0};
  const int read = read_inputs(api, context, &in);
  if (read == INPUTS_NOT_3_TO_5)
    return refuse(api, kernel->bits, "takes 3 inputs (A, B, scales), 4 (and minimums, Int4MatMul and Int5MatMul "
                                     "only) or 5 (and factors)");
  if (read == INPUTS_UNREADABLE) return refuse(api, kernel->bits, "cannot read its inputs");
  void **data = in.data;
  int64_t(*dims)[4] = in.dims, *counts = in.counts, m = 1;
  const size_t *rank = in.rank, count = in.count;
  const int *element_type = in.type;
  const int64_t weight_bytes = counts[1];
  for (size_t i = 0; i + 1 < rank[0]; i++) m *= dims[0][i];
  const int64_t tiles = (kernel->n + TILE_COLUMNS - 1) / TILE_COLUMNS, padded = tiles * TILE_COLUMNS;
  const int64_t super_blocks = kernel->k / (32 * CHUNKS_PER_SUPER_BLOCK);
  if (kernel->bits == 6 &&
      (count != 4 || element_type[2] != ELEMENT_INT8 || counts[2] != padded * (kernel->k / 16) ||
       element_type[3] != ELEMENT_FLOAT16 || counts[3] != padded * super_blocks))
    return refuse(api, kernel->bits, "takes A, the weights, N * K / 16 int8 multipliers and N * K / 256 float16 "
                                     "factors (N padded to whole tiles)");
  const int factored = count == 5;
  if (kernel->bits == 8 && count != 3)
    return refuse(api, kernel->bits, "takes 3 inputs (A, the weights, the scales): its minimums are Int5MatMul's");
  if (kernel->bits != 6 && count >= 4 && (kernel->block_size != 32 || element_type[3] != element_type[2] ||
                     counts[3] != padded * (kernel->k / 32)))
    return refuse(api, kernel->bits, "minimums must be N * K / 32 values of the scales' type (N padded to whole tiles), "
                                     "for blocks of 32");
  if (rank[0] < 1 || dims[0][rank[0] - 1] != kernel->k || weight_bytes != padded * kernel->k * kernel->bits / 8)
    return refuse(api, kernel->bits, "the input's last axis or the weights' size does not match K and N (N padded to whole tiles)");
  if (count == 5 && (element_type[2] != ELEMENT_UINT8 || element_type[4] != ELEMENT_FLOAT16 ||
                     kernel->k % (32 * CHUNKS_PER_SUPER_BLOCK) || counts[4] != padded * 2 * super_blocks))
    return refuse(api, kernel->bits, "factored scales are uint8 multipliers beside N * 2 * K / 256 float16 factors "
                                     "(N padded to whole tiles), K a multiple of 256");
  if (kernel->bits != 6 && ((factored ? element_type[2] != ELEMENT_UINT8
                                       : element_type[2] != ELEMENT_FLOAT && element_type[2] != ELEMENT_FLOAT16) ||
                             counts[2] != padded * (kernel->k / kernel->block_size)))
    return refuse(api, kernel->bits, "the scales must be N * K / block_size floats or float16s (N padded to whole tiles)");
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
  const int64_t chunks = kernel->k / 32;
  const size_t quantized_bytes = (size_t)(m * chunks * (32 + sizeof(float) + sizeof(int32_t) + sizeof(float)));
  /* a swiglu node's product goes to scratch after the quantized rows (an offset that keeps floats aligned) */
  char *buffer = malloc(quantized_bytes + (kernel->swiglu ? (size_t)(m * kernel->n) * sizeof(float) : 0));
  if (!buffer) return refuse(api, kernel->bits, "out of memory");
  const int six = kernel->bits == 6; /* no minimums: the fourth input is the factors */
  Work work = {data[0], y, data[1], data[2], six ? NULL : data[3], six ? data[3] : data[4],
               kernel->swiglu ? (float *)(buffer + quantized_bytes) : y,
               {(int32_t *)buffer, (float *)(buffer + m * chunks * 32), (int32_t *)(buffer + m * chunks * 36),
                (float *)(buffer + m * chunks * 40)},
               m, kernel->k, kernel->n, chunks, tiles, (m + ROW_BLOCK - 1) / ROW_BLOCK,
               (tiles + TILES_PER_UNIT(tiles) - 1) / TILES_PER_UNIT(tiles),
               six ? 0 : __builtin_ctzll((unsigned long long)(kernel->block_size / 32)), element_type[2] == ELEMENT_FLOAT16,
               kernel->bits, kernel->vnni};
  OrtStatus *(*parallel_for)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *) =
      API(api, KernelContext_ParallelFor, OrtStatus *(*)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *));
  OrtStatus *status = parallel_for(context, quantize_rows, (size_t)work.row_blocks, 0, &work);
  if (!status) status = parallel_for(context, multiply_unit, (size_t)(work.row_blocks * work.tile_groups), 0, &work);
  if (!status && kernel->swiglu) status = parallel_for(context, silu_times_up, (size_t)work.row_blocks, 0, &work);
  free(buffer);
  return status;
}

/* whether the kernels take their VNNI tiles: the CPU has AVX-512 F, BW and VNNI, and KERNEL_ISA_VARIABLE is not "avx2" */
static int use_vnni(void) {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni") &&
         !avx2_paths_asked();
}

/* the tiles a kernel created now takes, for tools and tests: "avx512vnni" or "avx2" */
__attribute__((visibility("default"))) const char *QuantizedMatMulIsa(void) { return use_vnni() ? "avx512vnni" : "avx2"; }

static OrtStatus *create_kernel(const OrtCustomOp *op, OrtApiTable api, const OrtKernelInfo *info, void **out) {
  const int bits = op == &int8_matmul_op ? 8 : op == &int6_matmul_op ? 6 : op == &int5_matmul_op ? 5 : 4;
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
  int64_t column_tile = 0;
  OrtStatus *untiled = status ? NULL : get_int(info, "column_tile", &column_tile);
  if (untiled) API(api, ReleaseStatus, void (*)(OrtStatus *))(untiled);
  if (!status && column_tile != TILE_COLUMNS)
    status = refuse(api, kernel->bits, "its weights must be in column tiles of 16 (column_tile = 16): the engine was built "
                       "by an earlier builder; rebuild it");
  OrtStatus *absent = status ? NULL : get_int(info, "swiglu", &kernel->swiglu);
  if (absent) { /* an optional attribute: a plain matmul */
    API(api, ReleaseStatus, void (*)(OrtStatus *))(absent);
    kernel->swiglu = 0;
  }
  if (!status && (kernel->swiglu < 0 || kernel->swiglu > 1 || (kernel->swiglu && kernel->n % 2)))
    status = refuse(api, kernel->bits, "swiglu must be 0 or 1, and 1 needs an even N (gate columns, then up columns)");
  if (!status && bits == 6 && (kernel->n <= 0 || kernel->k <= 0 || kernel->block_size != 16 ||
                               kernel->k % (32 * CHUNKS_PER_SUPER_BLOCK)))
    status = refuse(api, kernel->bits, "block_size must be 16 and K a multiple of 256 (Q6_K's super-blocks)");
  if (!status && bits != 6 && (kernel->n <= 0 || kernel->k <= 0 || kernel->block_size < 32 ||
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
static const char *op_name(const OrtCustomOp *op) {
  return op == &int8_matmul_op   ? "Int8MatMul"
         : op == &int6_matmul_op ? "Int6MatMul"
         : op == &int5_matmul_op ? "Int5MatMul"
                                 : "Int4MatMul";
}
/* scales: float or float16 (uint8 multipliers where factored, int8 for Int6MatMul); minimums: the scales' type
 * (Int6MatMul: its factors); factors: float16 */
static const int input_types[5] = {ELEMENT_FLOAT, ELEMENT_UINT8, ELEMENT_ANY, ELEMENT_ANY, ELEMENT_FLOAT16};
static int input_type(const OrtCustomOp *op, size_t index) { (void)op; return input_types[index]; }
static size_t input_count(const OrtCustomOp *op) { (void)op; return 5; }
static int minimums_optional(const OrtCustomOp *op, size_t index) {
  (void)op;
  return index >= 3 ? INPUT_OPTIONAL : INPUT_REQUIRED;
}
static size_t output_count(const OrtCustomOp *op) { (void)op; return 1; }

OrtCustomOp int4_matmul_op =
    CPU_CUSTOM_OP(op_name, input_type, input_count, minimums_optional, output_count, create_kernel, compute, destroy_kernel);
OrtCustomOp int8_matmul_op =
    CPU_CUSTOM_OP(op_name, input_type, input_count, minimums_optional, output_count, create_kernel, compute, destroy_kernel);
OrtCustomOp int5_matmul_op =
    CPU_CUSTOM_OP(op_name, input_type, input_count, minimums_optional, output_count, create_kernel, compute, destroy_kernel);
/* QuantizedRows: rows of a quantized matmul's weight, dequantized. A tied LM head's blocks are the embedding table
 * too, and the lookup reads them where the head's node does, as llama.cpp reads a GGUF's quantized token_embd: no
 * float table, and no copy of the blocks in another layout. Inputs: ids [...] int64; then the inputs of the head's
 * Int4MatMul / Int5MatMul / Int6MatMul / Int8MatMul node as it reads them (weights in column tiles, scales, minimums,
 * factors). Attributes: K, N (rows of the table), bits (4, 5, 6, 8), block_size, column_tile (16). Output [..., K] float32: each
 * weight as plugins/quant_linear.py's reference computes it, scale x (q - zero point) or scale x q + minimum with
 * one rounding per operation (no fma), scales and minimums that are factored formed as the matmul kernels form
 * them. An id outside [0, N) is an error. Scalar code: a call reads one table row per token. */
typedef struct RowsKernel {
  OrtApiTable api;
  int64_t k, n, block_size, bits;
} RowsKernel;

/* the unsigned value v (0 .. 31) of column j's chunk in a tile whose vectors (64 bytes each) start at `chunk` */
static inline int chunk_value(const uint8_t *chunk, int64_t j, int64_t bits, int v) {
  if (bits == 8) return chunk[64 * (v / 4) + 4 * j + v % 4];
  const int s = v / 8, b = v % 8 / 2, odd = v % 2;
  const int low = chunk[64 * s + 4 * j + b] >> (4 * odd) & 15;
  if (bits == 4) return low;
  if (bits == 5) return low | (chunk[64 * 4 + 4 * j + b] >> (2 * s + odd) & 1) << 4;
  return low | (chunk[64 * (4 + s / 2) + 4 * j + b] >> (2 * (2 * (s % 2) + odd)) & 3) << 4;
}

AVX2 static float stored_float(const void *values, int64_t at, int f16) {
  return f16 ? _cvtsh_ss(((const uint16_t *)values)[at]) : ((const float *)values)[at];
}

static OrtStatus *refuse_rows(OrtApiTable api, const char *message) {
  char named[256];
  snprintf(named, sizeof(named), "QuantizedRows: %s", message);
  return fail(api, named);
}

__attribute__((optimize("fp-contract=off"))) AVX2 static OrtStatus *rows_compute(void *kernel_state,
                                                                                   OrtKernelContext *context) {
  const RowsKernel *kernel = kernel_state;
  OrtApiTable api = kernel->api;
  Inputs in = {0};
  const int read = read_inputs(api, context, &in);
  if (read == INPUTS_NOT_3_TO_5) return refuse_rows(api, "takes the ids, then 2 to 4 inputs of a quantized matmul");
  if (read == INPUTS_UNREADABLE) return refuse_rows(api, "cannot read its inputs");
  void **data = in.data;
  int64_t(*dims)[4] = in.dims, *counts = in.counts;
  const size_t *rank = in.rank, count = in.count;
  const int *type = in.type;
  const int64_t k = kernel->k, bits = kernel->bits, padded = (kernel->n + TILE_COLUMNS - 1) / TILE_COLUMNS * TILE_COLUMNS;
  const int64_t chunks = k / 32, supers = k / (32 * CHUNKS_PER_SUPER_BLOCK), blocks = k / kernel->block_size;
  /* the layouts the matmul kernels take: 6-bit with int8 multipliers and factors; int4 or 5-bit with uint8
   * multipliers of scales and minimums and factors; else float or float16 scales (and minimums of their type, int4
   * or 5-bit only) */
  const int six = bits == 6, factored = count == 5, minimums = count >= 4 && !six;
  const int f16 = !six && !factored && type[2] == ELEMENT_FLOAT16;
  int ok = type[0] == ELEMENT_INT64 && type[1] == ELEMENT_UINT8 && counts[1] == padded * k * bits / 8;
  if (six)
    ok = ok && count == 4 && type[2] == ELEMENT_INT8 && counts[2] == padded * (k / 16) && type[3] == ELEMENT_FLOAT16 &&
         counts[3] == padded * supers;
  else if (factored)
    ok = ok && (bits == 4 || bits == 5) && type[2] == ELEMENT_UINT8 && type[3] == ELEMENT_UINT8 && type[4] == ELEMENT_FLOAT16 &&
         counts[2] == padded * chunks && counts[3] == padded * chunks && counts[4] == padded * 2 * supers;
  else
    ok = ok && (type[2] == ELEMENT_FLOAT || type[2] == ELEMENT_FLOAT16) && counts[2] == padded * blocks &&
         (!minimums || ((bits == 4 || bits == 5) && type[3] == type[2] && counts[3] == padded * chunks));
  if (!ok)
    return refuse_rows(api, "its inputs are not a quantized matmul's of its K, N, bits and block_size");
  int64_t out_dims[5];
  memcpy(out_dims, dims[0], sizeof(int64_t) * rank[0]);
  out_dims[rank[0]] = k;
  OrtValue *output = NULL;
  void *out = NULL;
  int64_t ignored[4];
  if (rank[0] > 3 ||
      API(api, KernelContext_GetOutput, OrtStatus *(*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **))(
          context, 0, out_dims, rank[0] + 1, &output) || !tensor(api, output, &out, ignored))
    return refuse_rows(api, "cannot allocate its output (ids of at most 3 dimensions)");
  const int64_t *ids = data[0];
  const int zero_point = bits == 4 ? 8 : bits == 5 ? 16 : bits == 6 ? 32 : 128;
  for (int64_t r = 0; r < counts[0]; r++) {
    const int64_t id = ids[r];
    if (id < 0 || id >= kernel->n) return refuse_rows(api, "an id is outside the table");
    const int64_t t = id / TILE_COLUMNS, j = id % TILE_COLUMNS;
    float *row = (float *)out + r * k;
    for (int64_t c = 0; c < chunks; c++) {
      const uint8_t *chunk = (const uint8_t *)data[1] + (t * chunks + c) * 64 * bits;
      const int64_t super_block = t * supers + c / CHUNKS_PER_SUPER_BLOCK;
      for (int v = 0; v < 32; v++) {
        const int q = chunk_value(chunk, j, bits, v);
        float scale, minimum = 0.0f;
        if (six) {
          const int8_t multiplier = ((const int8_t *)data[2])[(t * (k / 16) + 2 * c + v / 16) * TILE_COLUMNS + j];
          scale = _cvtsh_ss(((const uint16_t *)data[3])[super_block * TILE_COLUMNS + j]) * (float)multiplier;
        } else if (factored) {
          const int64_t at = (t * chunks + c) * TILE_COLUMNS + j;
          const uint16_t *factor = (const uint16_t *)data[4] + super_block * 2 * TILE_COLUMNS + j;
          scale = _cvtsh_ss(factor[0]) * (float)((const uint8_t *)data[2])[at];
          minimum = _cvtsh_ss(factor[TILE_COLUMNS]) * (float)((const uint8_t *)data[3])[at];
        } else {
          scale = stored_float(data[2], (t * blocks + c * 32 / kernel->block_size) * TILE_COLUMNS + j, f16);
          if (minimums) minimum = stored_float(data[3], (t * chunks + c) * TILE_COLUMNS + j, f16);
        }
        row[c * 32 + v] = minimums || factored ? (float)q * scale + minimum : (float)(q - zero_point) * scale;
      }
    }
  }
  return NULL;
}

static OrtStatus *create_rows_kernel(const OrtCustomOp *op, OrtApiTable api, const OrtKernelInfo *info, void **out) {
  (void)op;
  RowsKernel *kernel = calloc(1, sizeof(RowsKernel));
  if (!kernel) return refuse_rows(api, "out of memory");
  kernel->api = api;
  OrtStatus *(*get_int)(const OrtKernelInfo *, const char *, int64_t *) =
      API(api, KernelInfoGetAttribute_int64, OrtStatus *(*)(const OrtKernelInfo *, const char *, int64_t *));
  int64_t column_tile = 0;
  OrtStatus *status = get_int(info, "K", &kernel->k);
  if (!status) status = get_int(info, "N", &kernel->n);
  if (!status) status = get_int(info, "bits", &kernel->bits);
  if (!status) status = get_int(info, "block_size", &kernel->block_size);
  if (!status) status = get_int(info, "column_tile", &column_tile);
  const int64_t k = kernel->k, block = kernel->block_size;
  if (!status && (column_tile != TILE_COLUMNS || kernel->n <= 0 || k <= 0 || k % 32 ||
                  (kernel->bits == 6 ? block != 16 || k % (32 * CHUNKS_PER_SUPER_BLOCK)
                                     : (kernel->bits != 4 && kernel->bits != 5 && kernel->bits != 8) || block < 32 || (block & (block - 1)) ||
                                           k % block)))
    status = refuse_rows(api, "K, N, bits and block_size must be a quantized matmul's, in column tiles of 16");
  if (!status && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")))
    status = refuse_rows(api, "this CPU lacks AVX2 or F16C, which our kernels need");
  if (status) {
    free(kernel);
    return status;
  }
  *out = kernel;
  return NULL;
}

static const char *rows_name(const OrtCustomOp *op) { (void)op; return "QuantizedRows"; }
static const int rows_input_types[5] = {ELEMENT_INT64, ELEMENT_UINT8, ELEMENT_ANY, ELEMENT_ANY, ELEMENT_FLOAT16};
static int rows_input_type(const OrtCustomOp *op, size_t index) { (void)op; return rows_input_types[index]; }

OrtCustomOp quantized_rows_op = CPU_CUSTOM_OP(rows_name, rows_input_type, input_count, minimums_optional, output_count,
                                              create_rows_kernel, rows_compute, destroy_kernel);
OrtCustomOp int6_matmul_op =
    CPU_CUSTOM_OP(op_name, input_type, input_count, minimums_optional, output_count, create_kernel, compute, destroy_kernel);
