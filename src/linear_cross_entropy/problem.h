// The validated, framework-free description of one linear cross-entropy call that every backend consumes.
// api.cpp builds it (all argument checking happens there); cpu.cpp and cuda/ only compute.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/layout.h"
#include "logitless/linear_cross_entropy.h"

namespace logitless::lce {

enum class Mode { kForward, kForwardBackward, kBackward };

// A 2-D operand with one row stride (what a GEMM can take): element (i, j) at data[i * ld + j].
struct Matrix {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t ld = 0;
};

struct Problem {
  Mode mode = Mode::kForward;
  int64_t n_tokens = 0;  // N
  int64_t hidden = 0;    // H
  int64_t vocab = 0;     // V
  DType dtype = DType::kFloat32;  // hidden and weight
  Device device;

  // hidden: rows by `hidden_rows` (any collapsed layout); `hidden_uniform` when they also have one stride
  // >= H (then hidden_ld is it), so a GEMM can read them in place.
  const void* hidden_data = nullptr;
  RowLayout hidden_rows;
  bool hidden_uniform = true;
  int64_t hidden_ld = 0;
  Matrix weight;  // [V, H]
  const void* bias = nullptr;  // [V] or nullptr
  DType bias_dtype = DType::kFloat32;
  int64_t bias_stride = 1;

  const void* target = nullptr;
  DType target_dtype = DType::kInt64;
  RowLayout target_rows;
  const float* class_weight = nullptr;  // [V] or nullptr
  int64_t class_weight_stride = 1;

  float* loss = nullptr;      // [] or [N] (none); forward modes
  float* lse = nullptr;       // [N]: output (forward modes, optional) or input (backward)
  Matrix grad_hidden;         // data == nullptr: not wanted
  Matrix grad_weight;
  void* grad_bias = nullptr;  // [V] or nullptr
  DType grad_bias_dtype = DType::kFloat32;
  int64_t grad_bias_stride = 1;
  const float* grad_scale = nullptr;  // kForwardBackward: optional upstream factor; kBackward: grad_loss
  bool grad_scale_per_row = false;

  LinearCrossEntropyOptions options;
};

void run_cpu(const Problem& p);

#if defined(LOGITLESS_WITH_CUDA)
size_t cuda_workspace_bytes(const Problem& p);
void run_cuda(const Problem& p, Workspace ws, StreamHandle stream);
#endif

}  // namespace logitless::lce
