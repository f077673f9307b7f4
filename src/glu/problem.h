// The validated, framework-free description of one GLU call that every backend consumes. api.cpp builds it
// (all argument checking happens there); cpu.cpp and cuda/ only compute.
#pragma once

#include <cstdint>

#include "common/layout.h"
#include "logitless/glu.h"

namespace logitless::glu {

// Rows of `width` elements; every tensor addresses its rows through its own RowLayout (the leading dimensions
// collapsed jointly). Where every tensor is dense, api.cpp folds the rows into one row of N * I elements.
struct Problem {
  bool backward = false;
  int64_t n_rows = 0;
  int64_t width = 0;
  DType dtype = DType::kFloat32;
  Device device;
  GLUActivation activation = GLUActivation::kSiLU;
  GLUAlgo algo = GLUAlgo::kAuto;

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
};

void run_cpu(const Problem& p);

#if defined(LOGITLESS_WITH_CUDA)
void run_cuda(const Problem& p, StreamHandle stream);
#endif

}  // namespace logitless::glu
