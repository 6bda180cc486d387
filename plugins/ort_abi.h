/* What our onnxruntime custom ops (decode_attention.c, int4_matmul.c, argmax.c, registered by native_ops.c) need of
 * onnxruntime's C ABI, declared here rather than taken from onnxruntime's header (which is not vendored): the
 * positions of the few functions they call in its OrtApi table, which only ever grows at the end (checked against
 * the installed onnxruntime by tests/plugins/test_decode_attention.py), and the OrtCustomOp layout of version 16.
 */
#ifndef ORT_ABI_H
#define ORT_ABI_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* "avx2" makes our kernels take their AVX2 paths on a CPU with AVX-512 (read when a session creates them): the
 * results are the same bit for bit, which tests check by running both on one machine */
#define KERNEL_ISA_VARIABLE "LLM_ENGINE_BUILDER_KERNEL_ISA"
static inline int avx2_paths_asked(void) {
  const char *isa = getenv(KERNEL_ISA_VARIABLE);
  return isa && !strcmp(isa, "avx2");
}

/* The weights and the attention's cache rows stream from memory: their software prefetches go into the L2, not the
 * L1, whose few outstanding misses then bounded the stream (prefetcht1; both kernels together made a Zen 4 VM's
 * decode steps 5-13% faster than into the L1; docs/measurements.md) */
#define prefetch_into_l2(address) __builtin_prefetch((address), 0, 2)

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtOp OrtOp;
typedef struct OrtOpAttr OrtOpAttr;
typedef void *const *OrtApiTable;

typedef struct OrtApiBase {
  OrtApiTable (*GetApi)(uint32_t version);
  const char *(*GetVersionString)(void);
} OrtApiBase;

enum { ORT_FAIL = 1, ELEMENT_ANY = 0, ELEMENT_FLOAT = 1, ELEMENT_UINT8 = 2, ELEMENT_INT8 = 3, ELEMENT_INT32 = 6, ELEMENT_INT64 = 7,
       ELEMENT_FLOAT16 = 10, ATTR_INT = 1, ATTR_FLOAT = 3, ATTR_STRING = 5 };
/* the OrtApi version that has every function below (KernelContext_ParallelFor came with 1.17) */
#define ORT_API_VERSION_NEEDED 17
/* positions in the OrtApi table */
enum {
  API_CreateStatus = 0,
  API_CreateCustomOpDomain = 26,
  API_CustomOpDomain_Add = 27,
  API_AddCustomOpDomain = 28,
  API_GetTensorMutableData = 51,
  API_GetTensorElementType = 60,
  API_GetDimensionsCount = 61,
  API_GetDimensions = 62,
  API_GetTensorTypeAndShape = 65,
  API_KernelInfoGetAttribute_float = 85,
  API_KernelInfoGetAttribute_int64 = 86,
  API_KernelContext_GetInputCount = 88,
  API_KernelContext_GetInput = 90,
  API_KernelContext_GetOutput = 91,
  API_ReleaseStatus = 93,
  API_ReleaseTensorTypeAndShapeInfo = 99,
  API_CreateOpAttr = 211,
  API_ReleaseOpAttr = 212,
  API_CreateOp = 213,
  API_InvokeOp = 214,
  API_ReleaseOp = 215,
  API_KernelContext_ParallelFor = 274,
};
#define API(table, name, type) ((type)(table)[API_##name])

/* onnxruntime's OrtCustomOp as of version 16: the callbacks in their order; the ones later versions added after
 * KernelComputeV2 are not read for a version 16 op */
typedef struct OrtCustomOp {
  uint32_t version;
  void *(*CreateKernel)(const struct OrtCustomOp *op, OrtApiTable api, const OrtKernelInfo *info);
  const char *(*GetName)(const struct OrtCustomOp *op);
  const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op);
  int (*GetInputType)(const struct OrtCustomOp *op, size_t index);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
  int (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
  void (*KernelCompute)(void *kernel, OrtKernelContext *context);
  void (*KernelDestroy)(void *kernel);
  int (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);
  int (*GetInputMemoryType)(const struct OrtCustomOp *op, size_t index);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp *op);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *op);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *op);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *op);
  OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *op, OrtApiTable api, const OrtKernelInfo *info, void **kernel);
  OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *context);
} OrtCustomOp;
#define CUSTOM_OP_VERSION 16 /* the first with CreateKernelV2 / KernelComputeV2, which return a status */

#define DOMAIN "llm_engine_builder"

static inline OrtStatus *fail(OrtApiTable api, const char *message) {
  return API(api, CreateStatus, OrtStatus *(*)(int, const char *))(ORT_FAIL, message);
}

/* the tensor's data, up to 4 dimensions (0 where it has fewer), its rank (where `rank` is not NULL) and its element
 * type (where `element_type` is not NULL) */
static inline int tensor_typed(OrtApiTable api, const OrtValue *value, void **data, int64_t dims[4], size_t *rank,
                               int *element_type) {
  OrtTensorTypeAndShapeInfo *info = NULL;
  size_t count = 0;
  memset(dims, 0, sizeof(int64_t) * 4);
  if (API(api, GetTensorTypeAndShape, OrtStatus *(*)(const OrtValue *, OrtTensorTypeAndShapeInfo **))(value, &info))
    return 0;
  int ok = !API(api, GetDimensionsCount, OrtStatus *(*)(const OrtTensorTypeAndShapeInfo *, size_t *))(info, &count) &&
           count <= 4 &&
           !API(api, GetDimensions, OrtStatus *(*)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t))(info, dims, count) &&
           !API(api, GetTensorMutableData, OrtStatus *(*)(const OrtValue *, void **))(value, data) &&
           !(element_type && API(api, GetTensorElementType, OrtStatus *(*)(const OrtTensorTypeAndShapeInfo *, int *))(
                                 info, element_type));
  API(api, ReleaseTensorTypeAndShapeInfo, void (*)(OrtTensorTypeAndShapeInfo *))(info);
  if (rank) *rank = count;
  return ok;
}

static inline int tensor(OrtApiTable api, const OrtValue *value, void **data, int64_t dims[4]) {
  return tensor_typed(api, value, data, dims, NULL, NULL);
}

/* the callbacks every op here answers alike */
static inline const char *op_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
enum { INPUT_REQUIRED = 0, INPUT_OPTIONAL = 1 };
static inline int required(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return INPUT_REQUIRED; }
static inline int default_memory(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return 0; /* the CPU's */ }
static inline int one(const OrtCustomOp *op) { (void)op; return 1; /* no variadic inputs or outputs */ }
static inline int float_output(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return ELEMENT_FLOAT; }

/* an OrtCustomOp (version 16) for the CPU execution provider with float outputs, its outputs required and its inputs
 * as INPUT_CHARACTERISTIC says (`required` for all): the op's own callbacks, the rest answered alike */
#define CPU_CUSTOM_OP(GET_NAME, INPUT_TYPE, INPUT_COUNT, INPUT_CHARACTERISTIC, OUTPUT_COUNT, CREATE, COMPUTE, DESTROY)  \
  CPU_CUSTOM_OP_TYPED(GET_NAME, INPUT_TYPE, INPUT_COUNT, INPUT_CHARACTERISTIC, float_output, OUTPUT_COUNT, CREATE,    \
                      COMPUTE, DESTROY)
/* the same with the output types OUTPUT_TYPE answers */
#define CPU_CUSTOM_OP_TYPED(GET_NAME, INPUT_TYPE, INPUT_COUNT, INPUT_CHARACTERISTIC, OUTPUT_TYPE, OUTPUT_COUNT, CREATE,  \
                            COMPUTE, DESTROY)                                                                       \
  {.version = CUSTOM_OP_VERSION, .GetName = GET_NAME, .GetExecutionProviderType = op_provider,                      \
   .GetInputType = INPUT_TYPE, .GetInputTypeCount = INPUT_COUNT, .GetOutputType = OUTPUT_TYPE,                      \
   .GetOutputTypeCount = OUTPUT_COUNT, .KernelDestroy = DESTROY, .GetInputCharacteristic = INPUT_CHARACTERISTIC,    \
   .GetOutputCharacteristic = required, .GetInputMemoryType = default_memory, .GetVariadicInputMinArity = one,      \
   .GetVariadicInputHomogeneity = one, .GetVariadicOutputMinArity = one, .GetVariadicOutputHomogeneity = one,       \
   .CreateKernelV2 = CREATE, .KernelComputeV2 = COMPUTE}

extern OrtCustomOp decode_attention_op, decode_attention_int8_cache_op, int4_matmul_op, int8_matmul_op, int6_matmul_op, int5_matmul_op, quantized_rows_op, argmax_op, skip_rms_norm_op, all_reduce_op, all_gather_op;
#endif
