// The validated, framework-free description of one linear policy-loss or linear selective-log-softmax call that
// every backend consumes. api.cpp builds it (all argument checking happens there); cpu.cpp and cuda/ only compute.
//
// Rows and tokens. The GEMMs see `n_rows` hidden positions, row_len per sequence: row r is position r % row_len of
// sequence r / row_len. A position l < seq_len is token t = (r / row_len) * seq_len + l of the [n_seqs, seq_len]
// token grid that `tokens` describes; the position l == seq_len (hidden [B, L+1, H]: row_len = L + 1) is the
// unused one. Selective log-softmax is one sequence of N tokens and N rows.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/layout.h"
#include "linear_head/problem.h"
#include "logitless/linear_policy_loss.h"
#include "policy_loss/problem.h"

namespace logitless::lpl {

enum class Mode {
  kForward,          // statistics and outputs
  kForwardBackward,  // policy: outputs and the gradients of the reduced loss, in the forward
  kBackward,         // the gradients from saved statistics and an incoming gradient
};

struct Problem {
  pl::Op op = pl::Op::kPolicy;
  Mode mode = Mode::kForward;
  int64_t n_rows = 0;             // hidden positions: n_seqs * row_len
  int64_t row_len = 1;            // positions per sequence: seq_len or seq_len + 1
  int64_t hidden = 0;             // H
  int64_t vocab = 0;              // V
  DType dtype = DType::kFloat32;  // hidden and weight
  Device device;

  // hidden: rows by `hidden_rows` (any collapsed layout); `hidden_uniform` when they also have one stride
  // >= H (then hidden_ld is it), so a GEMM can read them in place.
  const void* hidden_data = nullptr;
  RowLayout hidden_rows;
  bool hidden_uniform = true;
  int64_t hidden_ld = 0;
  head::Matrix weight;  // [V, H]
  const void* bias = nullptr;
  DType bias_dtype = DType::kFloat32;
  int64_t bias_stride = 1;

  // The token side: ids, mask, advantages, log-probs, options and outputs (policy_loss/problem.h), with n_seqs,
  // seq_len and n_rows (the token count) of the grid. Its logits are the float32 chunks a backend computes.
  pl::Problem tokens;

  // Gradient outputs (data nullptr: not wanted). grad_hidden has n_rows rows of one stride.
  head::Matrix grad_hidden;
  head::Matrix grad_weight;
  void* grad_bias = nullptr;
  DType grad_bias_dtype = DType::kFloat32;
  int64_t grad_bias_stride = 1;

  // kBackward inputs, [tokens] float32 contiguous: the forward's logp (policy) and lse; grad_logp (selective);
  // the policy's incoming gradient is tokens.grad_scale.
  const float* logp_in = nullptr;
  const float* lse_in = nullptr;
  const float* grad_logp = nullptr;

  int64_t chunk_tokens = 0;
  size_t memory_budget = size_t{512} << 20;

  int64_t n_tokens() const { return tokens.n_rows; }
  int64_t seq_len() const { return tokens.seq_len; }
  bool wants_grads() const { return grad_hidden.data || grad_weight.data || grad_bias; }
};

void run_cpu(const Problem& p);

#if defined(LOGITLESS_WITH_CUDA)
size_t cuda_workspace_bytes(const Problem& p);
void run_cuda(const Problem& p, Workspace ws, StreamHandle stream);
#endif

}  // namespace logitless::lpl
