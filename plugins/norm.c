/* SkipRmsNorm: com.microsoft::SkipSimplifiedLayerNormalization as every decoder layer runs it twice (the residual
 * sum, then RMSNorm of it with gamma; no bias), over float rows, as an onnxruntime CPU custom op in our domain.
 *
 * Why: onnxruntime's kernel hands a call's rows to the pool's threads from two rows up, which costs more than the
 * rows' work: a graph of 60 such nodes over the default model's 576 values took 6.8 us a node for 6 rows against 1.2
 * for one (ours: 2.0 and 0.9; 2 threads, Zen 4 VM), ~0.3 ms of a 6-token verify step. Up to INLINE_VALUES values a
 * call this runs on the calling thread; longer calls (prompt chunks) split their rows over the session's threads.
 * plugins/norm.py rewrites the nodes; docs/measurements.md has what it gains end to end.
 *
 * Inputs: input [..., H] f32, skip [..., H] f32 (the same shape), gamma [H] f32, 1 to 4 dimensions. Outputs: output
 * [..., H] = sum / sqrt(mean(sum^2) + epsilon) x gamma, sum [..., H] = input + skip. Attribute: epsilon (float).
 * A row's result does not depend on the call around it (its squares summed in 16 lanes, lane h % 16, folded
 * pairwise), and every clone computes the same bits (no fused multiply-adds: `fp-contract=off`).
 */
#include "ort_abi.h"

#define INLINE_VALUES 16384 /* values a call runs on the calling thread (28 rows of 576) */
#define ROWS_PER_UNIT 16    /* rows a unit of a longer call */
#define LANES 16

typedef float floats16 __attribute__((vector_size(64)));

typedef struct Rows {
  const float *input, *skip, *gamma;
  float *out, *sum;
  int64_t rows, width;
  float epsilon;
} Rows;

#ifndef NORM_CLONES /* a test builds the library with the baseline clone alone, to compare the others with it */
#define NORM_CLONES "arch=x86-64-v4", "arch=x86-64-v3", "default"
#endif
/* row r: its sum, then its output (the squares in LANES partial sums; values past the last whole vector in lane 0..) */
__attribute__((target_clones(NORM_CLONES), optimize("fp-contract=off"))) static void norm_row(const Rows *w,
                                                                                            int64_t r) {
  const int64_t width = w->width, whole = width / LANES * LANES;
  const float *x = w->input + r * width, *skip = w->skip + r * width;
  float *sum = w->sum + r * width, *out = w->out + r * width;
  floats16 squares = {0.0f};
  for (int64_t h = 0; h < whole; h += LANES) {
    floats16 a, b;
    memcpy(&a, x + h, sizeof(a));
    memcpy(&b, skip + h, sizeof(b));
    const floats16 total = a + b;
    memcpy(sum + h, &total, sizeof(total));
    squares += total * total;
  }
  float tail[LANES] = {0.0f};
  for (int64_t h = whole; h < width; h++) {
    sum[h] = x[h] + skip[h];
    tail[h - whole] = sum[h] * sum[h];
  }
  float lanes[LANES];
  for (int l = 0; l < LANES; l++) lanes[l] = squares[l] + tail[l];
  for (int half = LANES / 2; half; half /= 2) /* pairwise: lane l + lane l + half */
    for (int l = 0; l < half; l++) lanes[l] += lanes[l + half];
  const float rms = sqrtf(lanes[0] / (float)width + w->epsilon);
  for (int64_t h = 0; h < whole; h += LANES) {
    floats16 total, g;
    memcpy(&total, sum + h, sizeof(total));
    memcpy(&g, w->gamma + h, sizeof(g));
    const floats16 y = total / rms * g;
    memcpy(out + h, &y, sizeof(y));
  }
  for (int64_t h = whole; h < width; h++) out[h] = sum[h] / rms * w->gamma[h];
}

static void norm_unit(void *data, size_t unit) {
  const Rows *w = data;
  const int64_t first = (int64_t)unit * ROWS_PER_UNIT, last = first + ROWS_PER_UNIT < w->rows ? first + ROWS_PER_UNIT : w->rows;
  for (int64_t r = first; r < last; r++) norm_row(w, r);
}

typedef struct Kernel {
  OrtApiTable api;
  float epsilon;
} Kernel;

static OrtStatus *compute(void *kernel_state, OrtKernelContext *context) {
  const Kernel *kernel = kernel_state;
  OrtApiTable api = kernel->api;
  const OrtValue *inputs[3];
  void *data[3];
  int64_t dims[3][4];
  size_t rank[3];
  int type[3];
  for (size_t i = 0; i < 3; i++)
    if (API(api, KernelContext_GetInput, OrtStatus *(*)(const OrtKernelContext *, size_t, const OrtValue **))(
            context, i, &inputs[i]) ||
        !inputs[i] || !tensor_typed(api, inputs[i], &data[i], dims[i], &rank[i], &type[i]) || type[i] != ELEMENT_FLOAT)
      return fail(api, "SkipRmsNorm: cannot read its inputs (float input, skip and gamma, 1 to 4 dimensions)");
  const int64_t width = dims[0][rank[0] - 1];
  int same = rank[0] >= 1 && rank[1] == rank[0] && rank[2] == 1 && dims[2][0] == width && width > 0;
  int64_t rows = 1;
  for (size_t d = 0; same && d < rank[0]; d++) {
    same = dims[1][d] == dims[0][d];
    if (d + 1 < rank[0]) rows *= dims[0][d];
  }
  if (!same) return fail(api, "SkipRmsNorm: input and skip must have one shape [..., H] and gamma [H]");
  void *out[2];
  for (size_t i = 0; i < 2; i++) {
    OrtValue *output = NULL;
    int64_t ignored[4];
    if (API(api, KernelContext_GetOutput,
            OrtStatus *(*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **))(context, i, dims[0], rank[0],
                                                                                               &output) ||
        !tensor(api, output, &out[i], ignored))
      return fail(api, "SkipRmsNorm: cannot allocate its outputs");
  }
  Rows work = {data[0], data[1], data[2], out[0], out[1], rows, width, kernel->epsilon};
  if (rows * width <= INLINE_VALUES) { /* decode steps and verify trees: no hand-over to another thread */
    for (int64_t r = 0; r < rows; r++) norm_row(&work, r);
    return NULL;
  }
  return API(api, KernelContext_ParallelFor,
             OrtStatus *(*)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *))(
      context, norm_unit, (size_t)((rows + ROWS_PER_UNIT - 1) / ROWS_PER_UNIT), 0, &work);
}

static OrtStatus *create_kernel(const OrtCustomOp *op, OrtApiTable api, const OrtKernelInfo *info, void **out) {
  (void)op;
  Kernel *kernel = malloc(sizeof(Kernel));
  if (!kernel) return fail(api, "SkipRmsNorm: out of memory");
  kernel->api = api;
  OrtStatus *status = API(api, KernelInfoGetAttribute_float, OrtStatus *(*)(const OrtKernelInfo *, const char *, float *))(
      info, "epsilon", &kernel->epsilon);
  if (status) {
    free(kernel);
    return status;
  }
  *out = kernel;
  return NULL;
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "SkipRmsNorm"; }
static int input_type(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return ELEMENT_FLOAT; }
static size_t three(const OrtCustomOp *op) { (void)op; return 3; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }

OrtCustomOp skip_rms_norm_op = CPU_CUSTOM_OP(op_name, input_type, three, required, two, create_kernel, compute,
                                             destroy_kernel);
