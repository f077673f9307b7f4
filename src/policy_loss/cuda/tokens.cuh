// A completion token's mask weight and id as the policy-loss kernels of both families read them (policy_loss: the
// row kernels and run.cu's passes; linear_policy_loss: its gradient rows), whatever the tensors' dtypes. P is any
// parameter struct with the fields mask, mask_dtype, mask_rows, ids, ids_is64 and ids_rows: policy_loss/cuda/
// params.h's KernelParams, linear_policy_loss/cuda/kernels.h's GradParams.
#pragma once

#include <cstdint>

#include "logitless/tensor.h"  // DType

namespace logitless::pl {

// Token r's mask as a weight (0: masked); 1 without a mask.
template <class P>
__device__ __forceinline__ float token_weight(const P& p, int64_t r) {
  if (!p.mask) return 1.f;
  const int64_t off = p.mask_rows.offset(r);
  switch (static_cast<DType>(p.mask_dtype)) {
    case DType::kBool:
    case DType::kUInt8:
      return static_cast<float>(static_cast<const uint8_t*>(p.mask)[off]);
    case DType::kInt32:
      return static_cast<float>(static_cast<const int32_t*>(p.mask)[off]);
    case DType::kInt64:
      return static_cast<float>(static_cast<const int64_t*>(p.mask)[off]);
    default:
      return static_cast<const float*>(p.mask)[off];
  }
}

// Token r's completion id, from int32 or int64 ids.
template <class P>
__device__ __forceinline__ int64_t token_id(const P& p, int64_t r) {
  const int64_t off = p.ids_rows.offset(r);
  return p.ids_is64 ? static_cast<const int64_t*>(p.ids)[off]
                    : static_cast<int64_t>(static_cast<const int32_t*>(p.ids)[off]);
}

}  // namespace logitless::pl
