// Kernel parameters of the GLU kernels: plain pointers, int64 sizes, one RowLayout per tensor.
#pragma once

#include <cstdint>

#include "common/layout.h"

namespace logitless::glu {

struct Params {
  const void* gate = nullptr;
  RowLayout gate_rows;
  const void* up = nullptr;
  RowLayout up_rows;
  const void* grad_y = nullptr;  // backward
  RowLayout grad_y_rows;
  void* y = nullptr;  // forward
  RowLayout y_rows;
  void* grad_gate = nullptr;  // backward
  RowLayout grad_gate_rows;
  void* grad_up = nullptr;  // backward
  RowLayout grad_up_rows;
  int64_t n_rows = 0;
  int64_t units = 0;   // per row: 16-byte vectors (vector kernels) or elements (scalar kernels)
  int64_t chunks = 0;  // per row: column chunks of blockDim.x * kUnitsPerThread units, one CTA each
};

}  // namespace logitless::glu
