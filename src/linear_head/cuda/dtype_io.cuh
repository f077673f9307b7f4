// Reading and writing one element of a float32 / float16 / bfloat16 buffer by run-time dtype, as float: the
// linear head kernels' bias loads and gradient stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "logitless/tensor.h"

namespace logitless::head {

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

// Four values at column c of a row of T (16-byte aligned for float32, 8-byte for 16-bit: the row lengths are
// multiples of 8 and the chunk buffers 256-byte aligned).
template <typename T>
__device__ __forceinline__ void store4(void* row, int64_t c, const float* v) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(static_cast<float*>(row) + c) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    uint2 u;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]), b = __floats2bfloat162_rn(v[2], v[3]);
      u = make_uint2(*reinterpret_cast<uint32_t*>(&a), *reinterpret_cast<uint32_t*>(&b));
    } else {
      __half2 a = __floats2half2_rn(v[0], v[1]), b = __floats2half2_rn(v[2], v[3]);
      u = make_uint2(*reinterpret_cast<uint32_t*>(&a), *reinterpret_cast<uint32_t*>(&b));
    }
    *reinterpret_cast<uint2*>(static_cast<T*>(row) + c) = u;
  }
}

}  // namespace logitless::head
