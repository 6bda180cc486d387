/* ArgMax: onnxruntime's ArgMax as the step graph asks it (the last axis, keepdims 0, select_last_index 0: the first
 * position of a row's largest value) over float rows, as an onnxruntime CPU custom op in our domain.
 *
 * Why: onnxruntime's kernel scans a row one value at a time, ~40 us for the default model's 49,152 logits, and a
 * verify tree or a decode batch pays it per row: 6 rows 0.13 ms, 8 rows 0.18 ms, 16 rows 0.35 ms of a step that
 * takes 4-9 ms on a 2-core Zen 4 VM. This one scans 16 values at a time and spreads the rows over the session's
 * threads (plugins/argmax.py rewrites the node; docs/measurements.md has what it gains).
 *
 * Input: x [..., V] float, 1 to 4 dimensions, 1 <= V < 2^31 (positions are int32 in the lanes). Output: [...]
 * int64, per row the first position holding its largest value. A NaN is never the largest value (onnxruntime's
 * kernel leaves that case unspecified); a row with nothing above -inf gives 0.
 */
#include "ort_abi.h"

typedef float floats16 __attribute__((vector_size(64)));
typedef int32_t ints16 __attribute__((vector_size(64)));

typedef struct Rows {
  const float *x;
  int64_t *out;
  int64_t width; /* V */
} Rows;

#define CHAINS 4 /* independent comparisons in flight: one chain waits on its compare and select every vector */

/* lane by lane: where v is larger than *most, v and its positions replace *most and *at (a later equal value does
 * not: *at stays the first position that held the lane's largest value) */
__attribute__((always_inline)) static inline void keep_larger(const float *x, int32_t first, floats16 *most,
                                                             ints16 *at) {
  const ints16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  floats16 v;
  memcpy(&v, x + first, sizeof(v));
  const ints16 larger = v > *most;
  *most = (floats16)((larger & (ints16)v) | (~larger & (ints16)*most));
  *at = (larger & (lane + first)) | (~larger & *at);
}

/* The first position of the row's largest value: CHAINS x 16 lanes each keep their largest value and the first
 * position that held it, over the whole vectors of the row; then the largest over the lanes, and the first position
 * among the lanes that hold it; then the positions after the last whole vector, each taken only if larger. The
 * clones differ in vector width only: the same comparisons, the same answer. */
#ifndef ARGMAX_CLONES /* a test builds the library with the baseline clone alone, to compare the others with it */
#define ARGMAX_CLONES "arch=x86-64-v4", "arch=x86-64-v3", "default"
#endif
__attribute__((target_clones(ARGMAX_CLONES))) static int64_t row_argmax(const float *x, int64_t width) {
  floats16 most[CHAINS];
  ints16 at[CHAINS];
  for (int c = 0; c < CHAINS; c++) {
    most[c] = (floats16){0.0f} - INFINITY;
    at[c] = (ints16){0};
  }
  int32_t i = 0;
  for (; i + 16 * CHAINS <= width; i += 16 * CHAINS)
    for (int c = 0; c < CHAINS; c++) keep_larger(x, i + 16 * c, &most[c], &at[c]);
  for (; i + 16 <= width; i += 16) keep_larger(x, i, &most[0], &at[0]);
  float best = -INFINITY;
  int64_t best_at = 0;
  for (int c = 0; c < CHAINS; c++)
    for (int l = 0; l < 16; l++) best = most[c][l] > best ? most[c][l] : best;
  if (best > -INFINITY) {
    best_at = width;
    for (int c = 0; c < CHAINS; c++)
      for (int l = 0; l < 16; l++)
        if (most[c][l] == best && at[c][l] < best_at) best_at = at[c][l];
  }
  for (; i < width; i++)
    if (x[i] > best) {
      best = x[i];
      best_at = i;
    }
  return best_at;
}

static void argmax_row(void *data, size_t row) {
  const Rows *rows = data;
  rows->out[row] = row_argmax(rows->x + (int64_t)row * rows->width, rows->width);
}

typedef struct Kernel {
  OrtApiTable api;
} Kernel;

static OrtStatus *compute(void *kernel_state, OrtKernelContext *context) {
  OrtApiTable api = ((const Kernel *)kernel_state)->api;
  const OrtValue *input = NULL;
  void *x = NULL;
  int64_t dims[4];
  size_t rank = 0;
  int type = 0;
  if (API(api, KernelContext_GetInput, OrtStatus *(*)(const OrtKernelContext *, size_t, const OrtValue **))(
          context, 0, &input) ||
      !input || !tensor_typed(api, input, &x, dims, &rank, &type))
    return fail(api, "ArgMax: cannot read its input (float, 1 to 4 dimensions)");
  if (type != ELEMENT_FLOAT || rank < 1 || dims[rank - 1] < 1 || dims[rank - 1] > INT32_MAX)
    return fail(api, "ArgMax: its input must be float with 1 to 2^31 - 1 values on the last axis");
  int64_t count = 1;
  for (size_t d = 0; d + 1 < rank; d++) count *= dims[d];
  OrtValue *output = NULL;
  void *out = NULL;
  int64_t ignored[4];
  if (API(api, KernelContext_GetOutput, OrtStatus *(*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **))(
          context, 0, dims, rank - 1, &output) ||
      !tensor(api, output, &out, ignored))
    return fail(api, "ArgMax: cannot allocate its output");
  Rows rows = {x, out, dims[rank - 1]};
  if (count == 1) { /* a decode step's one row: no hand-over to another thread */
    argmax_row(&rows, 0);
    return NULL;
  }
  return API(api, KernelContext_ParallelFor,
             OrtStatus *(*)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *))(
      context, argmax_row, (size_t)count, 0, &rows);
}

static OrtStatus *create_kernel(const OrtCustomOp *op, OrtApiTable api, const OrtKernelInfo *info, void **out) {
  (void)op;
  (void)info;
  Kernel *kernel = malloc(sizeof(Kernel));
  if (!kernel) return fail(api, "ArgMax: out of memory");
  kernel->api = api;
  *out = kernel;
  return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "ArgMax"; }
static int input_type(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return ELEMENT_FLOAT; }
static int int64_output(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return ELEMENT_INT64; }
static size_t one_value(const OrtCustomOp *op) { (void)op; return 1; }

OrtCustomOp argmax_op = CPU_CUSTOM_OP_TYPED(op_name, input_type, one_value, required, int64_output, one_value,
                                            create_kernel, compute, destroy_kernel);
