// Host-side conversions between float and the 16-bit formats, bit-exact with the GPU's round-to-nearest-
// even (used by the CPU backend and the tests; CUDA code uses the cuda_bf16/cuda_fp16 intrinsics).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "logitless/tensor.h"

namespace logitless {

inline float bf16_bits_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);  // keep it a quiet NaN
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3FF;
      u = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1F) {
    u = sign | 0x7F800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_half_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t absu = u & 0x7FFFFFFFu;
  if (absu >= 0x7F800000u) return sign | (absu > 0x7F800000u ? 0x7E00 : 0x7C00);  // NaN / inf
  if (absu >= 0x477FF000u) return sign | 0x7C00;                                  // rounds to >= 65520: overflow to inf
  if (absu < 0x38800000u) {  // result is subnormal (or zero) in half
    // value = absu as float; half subnormal unit is 2^-24
    float af;
    std::memcpy(&af, &absu, 4);
    const float scaled = af * 16777216.0f;   // / 2^-24, exact (power of two)
    const float r = std::nearbyint(scaled);  // round half to even under the default rounding mode
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t exp = (absu >> 23) - 127 + 15;
  uint32_t mant = absu & 0x7FFFFFu;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carries into the exponent correctly
  return sign | static_cast<uint16_t>(h);
}

// Element `i` of a float tensor's storage as float / double.
inline float load_float(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DType::kBFloat16:
      return bf16_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat16:
      return half_bits_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kFloat64:
      return static_cast<float>(static_cast<const double*>(p)[i]);
    default:
      return NAN;
  }
}

inline void store_float(void* p, DType dt, int64_t i, float v) {
  switch (dt) {
    case DType::kFloat32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = float_to_bf16_bits(v);
      break;
    case DType::kFloat16:
      static_cast<uint16_t*>(p)[i] = float_to_half_bits(v);
      break;
    case DType::kFloat64:
      static_cast<double*>(p)[i] = v;
      break;
    default:
      break;
  }
}

inline int64_t load_index(const void* p, DType dt, int64_t i) {
  return dt == DType::kInt32 ? static_cast<int64_t>(static_cast<const int32_t*>(p)[i])
                             : static_cast<const int64_t*>(p)[i];
}

}  // namespace logitless
