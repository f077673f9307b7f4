// The linear policy loss's own kernel: the gradient of a chunk of float32 logits from per-token coefficients
// (the GEMMs are cuBLAS's, the statistics the policy row kernel's, the rest the linear head's).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/layout.h"
#include "logitless/tensor.h"

namespace logitless::lpl {

// Rows [0, rows) of the chunk are positions row0 + i (linear_policy_loss/problem.h: position r is token
// (r / row_len) * seq_len + r % row_len when r % row_len < seq_len, the unused position otherwise).
struct GradParams {
  const float* logits = nullptr;  // [rows, ld_logits] float32, z = hidden · weightᵀ + bias
  int64_t ld_logits = 0;
  void* dlogits = nullptr;  // [rows, ld_dlogits] in the GEMMs' dtype; may be `logits` itself (float32)
  int64_t ld_dlogits = 0;
  float* db_partial = nullptr;  // [ceil(rows / head::kGradRowsPerBlock), ld_logits] column sums, or nullptr
  int64_t rows = 0, row0 = 0, vocab = 0, row_len = 1, seq_len = 1;
  // Per token: c = d(loss)/d(logp) with every upstream factor, and the lse of z / temperature.
  const float* coeff = nullptr;
  const float* lse = nullptr;
  const void* ids = nullptr;
  int ids_is64 = 1;
  RowLayout ids_rows;
  const void* mask = nullptr;  // optional token weights (any policy mask dtype): 0 = masked
  int32_t mask_dtype = 0;
  RowLayout mask_rows;
  float inv_temp = 1.f;
  float scale_l2 = 0.f;  // log2(e) / temperature
};

// dlogits = c ([j == id] - p_j) / temperature per token row, p = softmax(z / temperature); 0 for masked tokens
// and unused positions (their logits are not read), NaN for a bad id; and the chunk's column sums.
void launch_grad(const GradParams& p, DType out_dtype, cudaStream_t stream);

}  // namespace logitless::lpl
