/* The entry point of our kernel library (plugins/native_ops.py builds it into an engine): registers its ops in our
 * domain on the session options that SessionOptions.register_custom_ops_library passes. */
#include "ort_abi.h"

__attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  OrtApiTable api = base->GetApi(ORT_API_VERSION_NEEDED);
  if (!api) return NULL; /* an onnxruntime older than 1.17: nothing registered, the graph then fails to load */
  OrtCustomOpDomain *domain = NULL;
  OrtStatus *status = API(api, CreateCustomOpDomain, OrtStatus *(*)(const char *, OrtCustomOpDomain **))(DOMAIN, &domain);
  const OrtCustomOp *ops[] = {&decode_attention_op, &decode_attention_int8_cache_op, &int4_matmul_op, &int8_matmul_op, &int6_matmul_op, &int5_matmul_op, &quantized_rows_op, &argmax_op, &skip_rms_norm_op, &all_reduce_op, &all_gather_op};
  for (size_t i = 0; !status && i < sizeof(ops) / sizeof(ops[0]); i++)
    status = API(api, CustomOpDomain_Add, OrtStatus *(*)(OrtCustomOpDomain *, const OrtCustomOp *))(domain, ops[i]);
  if (status) return status;
  return API(api, AddCustomOpDomain, OrtStatus *(*)(OrtSessionOptions *, OrtCustomOpDomain *))(options, domain);
}
