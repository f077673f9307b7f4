// logitless: the policy losses of include/logitless/policy_loss.h (GRPO, BNPO, Dr. GRPO, DAPO; token-level PPO-clip
// or sequence-level GSPO ratios; k3 KL) and selective log-softmax, from the model's last hidden states and its
// output layer: the logits hidden · weightᵀ (+ bias) exist only a chunk of tokens at a time, in scratch, as in the
// fused linear cross-entropy (include/logitless/linear_cross_entropy.h).
//
// Shapes (B sequences of L completion tokens, H the hidden size, V the vocabulary):
//   hidden           [B, L+1, H]  fp32 / fp16 / bf16: the last hidden states over the completion and the position
//                                 after it, exactly as policy_loss takes logits [B, L+1, V] (position l predicts
//                                 completion token l, the last position is unused: the shift is implicit); or
//                                 [B, L, H], already aligned. Last dimension contiguous; rows with one common
//                                 stride >= H over all B * (L+1) (or B * L) positions (a contiguous tensor) go to
//                                 the GEMMs as they are, other layouts (e.g. a view h[:, -(L+1):, :] of a longer
//                                 sequence) are copied into the workspace first.
//   weight           [V, H]       hidden's dtype (the lm_head / tied-embedding layout); last dimension contiguous,
//                                 row stride >= H.
//   bias             [V]          optional, hidden's dtype or float32, any stride.
//   completion_ids, advantages, completion_mask, old_logp, ref_logp: as in policy_loss.h.
//   grad_hidden      hidden's shape, hidden's dtype or float32, last dimension contiguous, rows with one common
//                    stride >= H over all positions (a fresh contiguous tensor qualifies). Every element is
//                    written: masked tokens' rows and the unused last position get 0.
//   grad_weight      [V, H], weight's dtype or float32, last dimension contiguous, row stride >= H.
//   grad_bias        [V], bias's dtype or float32, any stride.
// An absent gradient output is not computed (a frozen lm_head costs no weight-gradient GEMM).
// Outputs: policy_loss.h's PolicyLossOutputs (loss, and optionally per_token_loss, kl, is_clipped, logp, entropy,
// lse), with x = (hidden · weightᵀ + bias) / temperature in the place of logits / temperature.
//
// With c = d(loss)/d(logp) of each token (policy_loss.h) and p = softmax(x) of its row, the gradient of the
// logits is g = c ([j == id] - p_j) / temperature per unmasked token (0 elsewhere), and
//   grad_hidden = g · weight      grad_weight = gᵀ · hidden      grad_bias = column sums of g.
//
// Schedules (exact alike; they differ in memory and time):
//  * gradient in the forward (linear_policy_loss_forward_backward). Token level: one pass over token chunks, per
//    chunk the logits GEMM, the statistics and outputs (the policy row kernel), every token's c, the gradient of
//    the chunk's logits, and the dX / dW GEMMs: three GEMMs in all. Sequence level: c needs the whole sequence's
//    log-ratio, so a first pass computes the statistics chunk by chunk (logp and lse per token: O(B L) state),
//    then the per-sequence terms and every c, then a second pass recomputes each chunk's logits for the
//    gradient: four GEMMs.
//  * recompute (linear_policy_loss_forward keeps logp and lse; linear_policy_loss_backward takes them with the
//    incoming gradient of the loss): the backward recomputes every chunk's logits: four GEMMs, and no gradient is
//    held between the two calls (a loss scaler's factor reaches the float16 gradient before it is rounded).
// Chunks follow the linear cross-entropy's planner (the float32 logits of a chunk of tokens and the gradient of
// a group of chunks in the inputs' dtype within options.memory_budget, plus a float32 grad_weight accumulator
// where one is needed, and cuBLAS's workspace; with a float32 grad_weight, groups shorter than 2048 positions grow
// toward that within twice the budget); the GEMMs accumulate in float32, and so do grad_weight across groups and
// grad_bias.
//
// Masked tokens and the unused last position: their logits come out of the GEMMs (the rows go to cuBLAS as one
// matrix) but are never read by the statistics or gradient kernels, and their rows of the logits' gradient are
// zeros, so they contribute exactly 0 to every gradient. Their hidden rows must be finite therefore (a NaN there
// reaches grad_weight as 0 · NaN).
//
// Ids outside [0, V) at unmasked tokens: as in policy_loss.h (an Error naming the first with check_ids; NaN
// outputs and gradient otherwise, which then reach grad_hidden's row and all of grad_weight and grad_bias).
#pragma once

#include <cstddef>
#include <cstdint>

#include "logitless/policy_loss.h"
#include "logitless/tensor.h"

namespace logitless {

struct LinearPolicyLossOptions {
  PolicyLossOptions policy;  // the loss (policy_loss.h); algo, cluster_size and threads tile its row kernel
  // CUDA chunking. 0: chosen from memory_budget. chunk_tokens: hidden positions whose logits' gradient is held
  // at once.
  int64_t chunk_tokens = 0;
  size_t memory_budget = size_t{512} << 20;  // bytes of chunk scratch; >= 1
};

struct LinearPolicyLossInputs {
  TensorView hidden;           // [B, L+1, H] or [B, L, H]
  TensorView weight;           // [V, H]
  TensorView bias;             // [V], optional
  TensorView completion_ids;   // [B, L]
  TensorView advantages;       // [B]
  TensorView completion_mask;  // [B, L], optional
  TensorView old_logp;         // [B, L], optional
  TensorView ref_logp;         // [B, L], optional (required when beta > 0)
};

struct LinearPolicyLossGrads {
  TensorView grad_hidden;  // optional
  TensorView grad_weight;  // optional
  TensorView grad_bias;    // optional (needs a bias)
};

// Bytes of CUDA scratch each entry point needs for these arguments (0 on the CPU). Pass the gradients the call
// will get (absent: not computed).
size_t linear_policy_loss_forward_workspace_bytes(const LinearPolicyLossInputs& inputs,
                                                  const LinearPolicyLossOptions& options);
size_t linear_policy_loss_forward_backward_workspace_bytes(const LinearPolicyLossInputs& inputs,
                                                           const LinearPolicyLossOptions& options,
                                                           const LinearPolicyLossGrads& grads);
size_t linear_policy_loss_backward_workspace_bytes(const LinearPolicyLossInputs& inputs,
                                                   const LinearPolicyLossOptions& options,
                                                   const LinearPolicyLossGrads& grads);

// The loss and the requested outputs: one GEMM over token chunks.
void linear_policy_loss_forward(const LinearPolicyLossInputs& inputs, const LinearPolicyLossOptions& options,
                                const PolicyLossOutputs& outputs, Workspace workspace, StreamHandle stream);

// The gradient-in-forward schedule: the loss, the outputs and the gradients of the loss, times `grad_scale` when
// given (float32 [] on the device, read there: no synchronization), times 1 otherwise.
void linear_policy_loss_forward_backward(const LinearPolicyLossInputs& inputs, const LinearPolicyLossOptions& options,
                                         const PolicyLossOutputs& outputs, const LinearPolicyLossGrads& grads,
                                         const TensorView& grad_scale, Workspace workspace, StreamHandle stream);

// The recompute schedule's backward: the gradients times grad_loss (float32 []), from the logp and lse [B, L]
// (float32, contiguous) that linear_policy_loss_forward returned for the same inputs. Ids are not checked again.
void linear_policy_loss_backward(const LinearPolicyLossInputs& inputs, const LinearPolicyLossOptions& options,
                                 const TensorView& logp, const TensorView& lse, const TensorView& grad_loss,
                                 const LinearPolicyLossGrads& grads, Workspace workspace, StreamHandle stream);

// ---- selective log-softmax from hidden states ------------------------------------------------------------------
// Shapes (N = product of the leading dimensions of hidden):
//   hidden  [*, H]  as linear_cross_entropy's hidden (no shift: row i's logits give logp of ids[i])
//   weight  [V, H], bias [V] optional: as above
//   ids     [*]     int32 or int64, hidden's leading shape, any strides; every id in [0, V)
//   logp    [*]     float32, contiguous: log_softmax((hidden · weightᵀ + bias) / temperature)[id]
//   entropy [*]     float32, contiguous, optional (not differentiated)
//   lse     [*]     float32, contiguous; optional in the forward, required by the backward
//   is_top1 [*]     bool or uint8, contiguous, optional (not differentiated): 1 where ids[i] is the first maximum of
//                   row i's logits hidden · weightᵀ + bias (torch.argmax's answer, the lowest index among equal
//                   maxima; a positive temperature does not reorder them), tracked in the same pass over the row as
//                   lse. A row with a NaN logit gives 0; a row of -inf only, ids[i] == 0 (torch.argmax: index 0);
//                   an unchecked bad id, 0. On CUDA the comparison is between the float32 logits the GEMM produced,
//                   so two classes within float32 rounding of each other may rank otherwise than in exact arithmetic.
// Backward (recompute): the gradients of sum_i grad_logp[i] logp[i] (grad_logp float32 [*], contiguous), one
// GEMM to recompute each chunk's logits and the two gradient GEMMs.
struct LinearSelectiveLogSoftmaxOptions {
  double temperature = 1.0;  // > 0
  bool check_ids = true;     // throw on an id outside [0, V); otherwise that row is NaN
  int64_t chunk_tokens = 0;  // as in LinearPolicyLossOptions
  size_t memory_budget = size_t{512} << 20;
};

size_t linear_selective_log_softmax_forward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                            const TensorView& ids,
                                                            const LinearSelectiveLogSoftmaxOptions& options);
size_t linear_selective_log_softmax_backward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                             const TensorView& ids,
                                                             const LinearSelectiveLogSoftmaxOptions& options,
                                                             const LinearPolicyLossGrads& grads);

void linear_selective_log_softmax_forward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                          const TensorView& ids, const LinearSelectiveLogSoftmaxOptions& options,
                                          const TensorView& logp, const TensorView& entropy, const TensorView& lse,
                                          const TensorView& is_top1, Workspace workspace, StreamHandle stream);

void linear_selective_log_softmax_backward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                           const TensorView& ids, const TensorView& lse, const TensorView& grad_logp,
                                           const LinearSelectiveLogSoftmaxOptions& options,
                                           const LinearPolicyLossGrads& grads, Workspace workspace,
                                           StreamHandle stream);

}  // namespace logitless
