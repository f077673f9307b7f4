// Element access in double for the CPU backends that compute in double and accept float64 tensors (the
// dtype torch.autograd.gradcheck differentiates in): float64 elements keep all their bits, the others
// convert exactly from their float value.
#pragma once

#include <cstdint>

#include "common/host_float.h"

namespace logitless {

inline double load_double(const void* p, DType dt, int64_t i) {
  return dt == DType::kFloat64 ? static_cast<const double*>(p)[i] : static_cast<double>(load_float(p, dt, i));
}

// Rounded to the dtype; a 16-bit dtype goes through float32 first (the two roundings differ from one only for
// values within float32's rounding error of a tie between two 16-bit values).
inline void store_double(void* p, DType dt, int64_t i, double v) {
  if (dt == DType::kFloat64) {
    static_cast<double*>(p)[i] = v;
  } else {
    store_float(p, dt, i, static_cast<float>(v));
  }
}

}  // namespace logitless
