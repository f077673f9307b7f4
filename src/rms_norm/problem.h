// The validated, framework-free description of one RMSNorm call that every backend consumes. api.cpp
// builds it (all argument checking happens there); cpu.cpp and cuda/ only compute.
#pragma once

#include <cstdint>

#include "common/layout.h"
#include "logitless/rms_norm.h"

namespace logitless::rms {

struct ForwardProblem {
  int64_t n_rows = 0;
  int64_t hidden = 0;
  DType dtype = DType::kFloat32;         // x, residual, y, residual_out
  DType weight_dtype = DType::kFloat32;  // dtype or float32
  Device device;

  const void* x = nullptr;
  RowLayout x_rows;
  const void* residual = nullptr;  // optional
  RowLayout residual_rows;
  const void* weight = nullptr;  // [H], contiguous
  void* y = nullptr;
  RowLayout y_rows;
  void* residual_out = nullptr;  // exactly when residual is given
  RowLayout residual_out_rows;
  float* rstd = nullptr;  // [N] contiguous, optional

  float eps = 1e-6f;
  float offset = 0.f;
  RMSNormCasting casting = RMSNormCasting::kLlama;
  RMSNormAlgo algo = RMSNormAlgo::kAuto;
  int vectors_per_thread = 0;
};

struct BackwardProblem {
  int64_t n_rows = 0;
  int64_t hidden = 0;
  DType dtype = DType::kFloat32;  // x, grad_y, grad_residual_out, grad_x
  DType weight_dtype = DType::kFloat32;
  DType grad_weight_dtype = DType::kFloat32;
  Device device;

  const void* grad_y = nullptr;
  RowLayout grad_y_rows;
  const void* grad_residual_out = nullptr;  // optional
  RowLayout grad_residual_out_rows;
  const void* x = nullptr;  // what the forward normalized
  RowLayout x_rows;
  const void* weight = nullptr;
  const float* rstd = nullptr;  // [N]
  void* grad_x = nullptr;
  RowLayout grad_x_rows;
  void* grad_weight = nullptr;  // [H] contiguous, optional

  float offset = 0.f;
  RMSNormCasting casting = RMSNormCasting::kLlama;
  RMSNormAlgo algo = RMSNormAlgo::kAuto;
  int vectors_per_thread = 0;
};

void forward_cpu(const ForwardProblem& p);
void backward_cpu(const BackwardProblem& p);

#if defined(LOGITLESS_WITH_CUDA)
// The most any backward kernel may need for these sizes (the alignment of the tensors is not known yet).
size_t backward_workspace_bytes_cuda(int64_t n_rows, int64_t hidden, DType dtype, const RMSNormOptions& o, int device);
void forward_cuda(const ForwardProblem& p, StreamHandle stream);
void backward_cuda(const BackwardProblem& p, Workspace ws, StreamHandle stream);
#endif

}  // namespace logitless::rms
