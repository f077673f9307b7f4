// Reading and writing one element of a float32 / float16 / bfloat16 buffer by run-time dtype, as float: the
// linear cross-entropy kernels' bias loads and gradient stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "logitless/tensor.h"

namespace logitless::lce {

__device__ __forceinline__ float load_as_float(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

__device__ __forceinline__ void store_as(void* p, DType dt, int64_t i, float v) {
  switch (dt) {
    case DType::kFloat16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
      break;
  }
}

}  // namespace logitless::lce
