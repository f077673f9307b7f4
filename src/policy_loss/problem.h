// The validated, framework-free description of one policy-loss or selective-log-softmax call that every backend
// consumes. api.cpp builds it (all argument checking happens there); cpu.cpp and cuda/ only compute.
//
// Both ops work on token rows: row r of the logits is token r of a [n_seqs, seq_len] grid (sequence r / seq_len),
// whatever the logits' own layout (the shift of [B, L+1, V] logits is only a RowLayout). Selective log-softmax
// is the grid [1, N] with no mask, no sequence terms and no loss.
#pragma once

#include <cstdint>

#include "common/layout.h"
#include "logitless/policy_loss.h"

namespace logitless::pl {

enum class Op { kPolicy, kSelective };
enum class Mode {
  kForward,          // statistics and outputs
  kForwardBackward,  // policy: outputs and the gradient of the reduced loss
  kBackward,         // selective: the gradient from a saved lse and the incoming gradient of logp
};

struct Problem {
  Op op = Op::kPolicy;
  Mode mode = Mode::kForward;
  int64_t n_seqs = 0;   // B (selective: 1)
  int64_t seq_len = 0;  // L (selective: N)
  int64_t n_rows = 0;   // B * L
  int64_t vocab = 0;
  DType dtype = DType::kFloat32;  // logits and grad
  Device device;

  const void* logits = nullptr;  // token rows
  RowLayout logits_rows;
  const void* ids = nullptr;
  DType ids_dtype = DType::kInt64;
  RowLayout ids_rows;
  const void* mask = nullptr;  // optional: a weight per token (any of bool, uint8, int32, int64, float32)
  DType mask_dtype = DType::kFloat32;
  RowLayout mask_rows;
  const float* old_logp = nullptr;
  RowLayout old_rows;
  const float* ref_logp = nullptr;
  RowLayout ref_rows;
  const float* advantages = nullptr;  // [n_seqs]
  int64_t adv_stride = 1;

  // Outputs: loss [] (policy), the rest [n_rows] contiguous, each optional.
  float* loss = nullptr;
  float* per_token_loss = nullptr;
  float* kl = nullptr;
  uint8_t* is_clipped = nullptr;
  float* logp = nullptr;
  float* entropy = nullptr;
  float* lse = nullptr;
  uint8_t* is_top1 = nullptr;  // selective forward only: the id is the row's first maximum

  void* grad = nullptr;  // token rows of grad_logits
  RowLayout grad_rows;
  char* grad_pad = nullptr;     // rows of grad_logits that belong to no token (the unused last position): zeroed
  int64_t grad_pad_stride = 0;  // elements between them
  int64_t n_pad = 0;
  const float* grad_scale = nullptr;  // [] optional (kForwardBackward)
  const float* grad_logp = nullptr;   // [n_rows] (kBackward)
  const float* lse_in = nullptr;      // [n_rows] (kBackward)

  PolicyLossType loss_type = PolicyLossType::kGrpo;
  ImportanceSamplingLevel level = ImportanceSamplingLevel::kToken;
  double beta = 0, eps_low = 0, eps_high = 0, temperature = 1;
  int64_t max_completion_length = 0;
  double num_items_in_batch = 0;
  bool check_ids = true;
  PolicyLossAlgo algo = PolicyLossAlgo::kAuto;
  int cluster_size = 0;
  int threads = 0;

  bool sequence_level() const { return op == Op::kPolicy && level == ImportanceSamplingLevel::kSequence; }
};

// Token weight as float: the mask's value (bool / integers as 0 or their value), 1 without a mask.
inline double mask_weight(const void* mask, DType dt, int64_t off) {
  switch (dt) {
    case DType::kBool:
    case DType::kUInt8:
      return static_cast<const uint8_t*>(mask)[off];
    case DType::kInt32:
      return static_cast<double>(static_cast<const int32_t*>(mask)[off]);
    case DType::kInt64:
      return static_cast<double>(static_cast<const int64_t*>(mask)[off]);
    case DType::kFloat32:
      return static_cast<const float*>(mask)[off];
    default:
      return 0;
  }
}

// The validated problem of a policy_loss_forward (grad_logits nullptr) or policy_loss_forward_backward call, as
// api.cpp builds it: for callers that run the steps themselves (cuda/steps.h).
Problem make_policy_problem(Mode mode, const PolicyLossInputs& inputs, const PolicyLossOptions& options,
                            const PolicyLossOutputs& outputs, const TensorView* grad_logits);

// The same without logits: the options, the token inputs (inputs.logits unused) and the outputs, validated for a
// vocabulary of `vocab` on `device`; logits, their rows and the gradient are left for the caller to fill (a fused
// linear head computes the logits a chunk at a time). dtype stays float32.
Problem make_token_problem(Mode mode, const PolicyLossInputs& inputs, const PolicyLossOptions& options,
                           const PolicyLossOutputs& outputs, const Device& device, int64_t vocab);

// No output of a policy call (its gradient included, when given) shares memory with an input or another output,
// the gradient over the logits excepted (checked with them). For callers with other inputs too (a fused linear
// head checks its own against these outputs).
void check_policy_apart(const PolicyLossInputs& inputs, const PolicyLossOutputs& outputs, const TensorView* grad_logits,
                        const TensorView& grad_scale);

void run_cpu(const Problem& p);

#if defined(LOGITLESS_WITH_CUDA)
size_t cuda_workspace_bytes(Op op, int64_t n_seqs, int64_t n_rows, ImportanceSamplingLevel level);
void run_cuda(const Problem& p, Workspace ws, StreamHandle stream);
#endif

}  // namespace logitless::pl
