// Kernel parameters of the RMSNorm kernels: plain pointers, int64 sizes, one RowLayout per tensor.
#pragma once

#include <cstdint>

#include "common/layout.h"
#include "logitless/rms_norm.h"

namespace logitless::rms {

struct ForwardParams {
  const void* x = nullptr;
  RowLayout x_rows;
  const void* residual = nullptr;  // optional
  RowLayout residual_rows;
  const void* weight = nullptr;  // [H] contiguous
  bool weight_f32 = false;       // float32 weight beside a 16-bit x
  void* y = nullptr;
  RowLayout y_rows;
  void* residual_out = nullptr;  // set exactly when residual is
  RowLayout residual_out_rows;
  float* rstd = nullptr;  // [N], optional
  int64_t n_rows = 0;
  int64_t hidden = 0;
  float eps = 1e-6f;
  float offset = 0.f;
  RMSNormCasting casting = RMSNormCasting::kLlama;
};

struct BackwardParams {
  const void* grad_y = nullptr;
  RowLayout grad_y_rows;
  const void* grad_residual_out = nullptr;  // optional
  RowLayout grad_residual_out_rows;
  const void* x = nullptr;
  RowLayout x_rows;
  const void* weight = nullptr;
  bool weight_f32 = false;
  const float* rstd = nullptr;
  void* grad_x = nullptr;
  RowLayout grad_x_rows;
  float* partials = nullptr;  // workspace: [partial rows, workspace_row_stride(H)]; nullptr: no dW wanted
  int64_t partial_stride = 0;
  bool dw_in_smem = false;  // generic path: each row slot's dW sums in shared memory (else its workspace row)
  int64_t n_rows = 0;
  int64_t hidden = 0;
  float offset = 0.f;
  RMSNormCasting casting = RMSNormCasting::kLlama;
};

}  // namespace logitless::rms
