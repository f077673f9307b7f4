// What every loss computed from hidden states takes from its caller, checked and described for the GEMMs: hidden,
// weight, bias and the gradient outputs. The families' api.cpp files call these before anything runs.
#pragma once

#include <cstdint>

#include "common/layout.h"
#include "logitless/tensor.h"

namespace logitless::head {

// A 2-D operand with one row stride (what a GEMM can take): element (i, j) at data[i * ld + j]. data nullptr: absent.
struct Matrix {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t ld = 0;
  Matrix rows_from(int64_t r0) const {
    return Matrix{static_cast<char*>(data) + r0 * ld * static_cast<int64_t>(dtype_size(dtype)), dtype, ld};
  }
};

// cuBLAS takes 32-bit sizes and leading dimensions: `value` (of argument `name`, `what` it is) below 2^31.
void check_gemm_extent(int64_t value, const char* name, const char* what);

// hidden [*, H] and weight [V, H] checked (dtypes, devices, shapes, layouts; errors name the argument) and
// described for the GEMMs: what every fused linear head (cross-entropy, policy loss) takes. V = 0 passes only
// with `empty_vocab_ok` (a vocabulary shard without rows).
struct HiddenWeight {
  int64_t hidden = 0, vocab = 0;
  DType dtype = DType::kFloat32;
  Device device;
  const void* hidden_data = nullptr;
  RowLayout hidden_rows;
  bool hidden_uniform = true;  // one row stride >= H (hidden_ld): a GEMM reads the rows in place
  int64_t hidden_ld = 0;
  Matrix weight;
};
HiddenWeight check_hidden_weight(const TensorView& hidden, const TensorView& weight, bool empty_vocab_ok);

// A fused linear head's optional bias [V] (data nullptr: none), of the inputs' dtype or float32.
struct BiasInput {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t stride = 1;
};
BiasInput check_bias(const TensorView& bias, DType dtype, int64_t V, const Device& device);

// The gradient outputs of a fused linear head (any may be absent: data nullptr), checked against the inputs
// they belong to: grad_hidden shaped like hidden and grad_weight like weight (each of its input's dtype or
// float32, with rows a GEMM can write in place), grad_bias [V] of bias's dtype or float32 (`bias` null: only
// sizing a workspace, where any float dtype passes). H and V: the hidden size and the weight's rows.
struct GradOutputs {
  Matrix grad_hidden, grad_weight;
  void* grad_bias = nullptr;
  DType grad_bias_dtype = DType::kFloat32;
  int64_t grad_bias_stride = 1;
};
GradOutputs check_grad_outputs(const TensorView& hidden, const TensorView& weight, const TensorView* bias, int64_t H,
                               int64_t V, const Device& device, const TensorView& grad_hidden,
                               const TensorView& grad_weight, const TensorView& grad_bias);

}  // namespace logitless::head
