// logitless: policy-gradient losses over given logits — the GRPO family (GRPO, BNPO, Dr. GRPO, DAPO) with the
// PPO-clip ratio at the token level or GSPO's at the sequence level, and a k3 KL penalty — and selective
// log-softmax (the log-probability of chosen tokens, for old-policy and reference log-probs).
//
// Shapes (B sequences of L completion tokens, V the vocabulary):
//   logits           [B, L+1, V]  fp32 / fp16 / bf16, the model's output for the completion: position l predicts
//                                 completion token l and the last position is unused (the shift is implicit: no
//                                 copy, no slicing by the caller); or [B, L, V], already aligned. Last dimension
//                                 contiguous (stride 1); the leading two may have any strides that do not overlap
//                                 rows.
//   completion_ids   [B, L]       int32 or int64, any strides (e.g. a view input_ids[:, -L:]).
//   advantages       [B]          float32, any stride.
//   completion_mask  [B, L]       optional; bool, uint8, int32, int64 or float32, any strides. Its value is the
//                                 token's weight w (0 = masked; absent = every token weighs 1), as trainers
//                                 multiply by the mask. Masked tokens are not read (logits or ids), get loss 0
//                                 and gradient 0.
//   old_logp         [B, L]       float32, optional: log-probabilities under the policy that sampled the
//                                 completions. Absent: the ratio is exp(logp - logp.detach()), 1 with gradient.
//   ref_logp         [B, L]       float32, optional: log-probabilities under the reference policy. Required when
//                                 beta > 0.
//   grad_logits      logits' shape and dtype, last dimension contiguous; may be `logits` itself (same pointer
//                                 and strides) for an in-place gradient. Every element is written: masked
//                                 tokens' rows and the unused last position get 0.
// Outputs (float32 [B, L] contiguous unless said otherwise; every one but `loss` optional; masked tokens get 0):
//   loss [] · per_token_loss · kl · is_clipped (bool or uint8) · logp · entropy · lse (of logits / temperature)
//
// Per token (b, l) with weight w, advantage A = advantages[b], x = logits[b, l] / temperature:
//   logp    = log_softmax(x)[id]                                   (from an online log-sum-exp)
//   entropy = -sum_j p_j log p_j,  p = softmax(x)                  (reported, not differentiated)
//   kl      = exp(ref - logp) - (ref - logp) - 1                   (k3 estimator; 0 without ref_logp; with
//                                                                   beta = 0 it is reported but no part of
//                                                                   per_token_loss, the loss or the gradient)
//   ratio r : token level    r = exp(logp - old_logp)
//             sequence level r = exp(S_b) for every token of sequence b (GSPO), with
//                            S_b = sum_l w (logp - old_logp) / D_b,  D_b = max(sum_l w, 1)
//   per_token_loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta kl
//   is_clipped     = (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low): the clip is active, so the
//                    ratio term passes no gradient
// Reductions (sum over tokens of w · per_token_loss, divided as the loss type says; denominators that count
// tokens are clamped at 1 as TRL clamps them, so an all-masked batch or sequence contributes loss 0 and
// gradient 0):
//   kGrpo    (1/B) sum_b [ sum_l w per_token_loss / D_b ]       per-sequence mean, then batch mean
//   kBnpo    sum w per_token_loss / max(sum w, 1)                 token mean over this batch
//   kDrGrpo  sum w per_token_loss / (B * max_completion_length)   constant normalizer (required option)
//   kDapo    sum w per_token_loss / num_items_in_batch            token mean over the *global* batch, as TRL
//            computes it: the caller passes the number of completion tokens of every micro-batch of the
//            optimizer step (across gradient accumulation), divided by the number of processes (TRL's
//            num_items_in_batch / num_processes). With num_items_in_batch == 0 the local count is used, and
//            dapo equals bnpo; they differ exactly when one optimizer step spans several micro-batches or
//            processes, where bnpo weighs each micro-batch's tokens by its own count.
//
// Gradient: d(logp)/d(logits_j) = ([j == id] - p_j) / temperature, so every row's gradient is c · ([j == id] -
// p_j) / temperature with c = d(loss)/d(logp) of that token. At the token level c depends only on the token's
// own statistics, so `policy_loss_forward_backward` writes the gradient in the same pass that reads the logits
// (one read and one write per unmasked row). At the sequence level c needs S_b, the whole sequence's: the call
// runs a statistics pass (one read), the per-sequence terms, and a gradient pass from the saved log-sum-exp
// (one read and one write).
//
// Ids outside [0, V) at unmasked tokens: with check_ids (and a stream that is not capturing a CUDA graph) the
// call throws an Error naming the first such token; otherwise that token's outputs and gradient row are NaN
// (and so is the loss; at the sequence level, every per_token_loss and gradient row of its sequence). A token
// whose logits hold a NaN or +inf gets NaN outputs and gradient likewise. A NaN old_logp or advantage makes its
// token's (its sequence's) per_token_loss and gradient NaN; a NaN ref_logp its kl, and with beta > 0 its
// per_token_loss and gradient (with beta = 0 the KL term is not evaluated: TRL's choice, so a -inf or NaN
// ref_logp leaves loss and gradient finite). Masked tokens and the unused last position are never read.
#pragma once

#include <cstddef>
#include <cstdint>

#include "logitless/tensor.h"

namespace logitless {

enum class PolicyLossType : int32_t { kGrpo = 0, kBnpo = 1, kDrGrpo = 2, kDapo = 3 };

enum class ImportanceSamplingLevel : int32_t { kToken = 0, kSequence = 1 };

// Which kernel runs on CUDA. kAuto picks; the others exist to test and benchmark each path on one GPU.
enum class PolicyLossAlgo : int32_t {
  kAuto = 0,
  kStreaming = 1,    // any GPU: one CTA per row; the fused gradient pass re-reads the row (mostly from HBM)
  kCluster = 2,      // Hopper: a thread-block cluster shares each row, so each CTA's slice is small enough for
                     // the gradient pass to re-read it from L2 (raises where clusters are unavailable)
  kRowResident = 3,  // Hopper: a cluster shares each row and every CTA keeps its slice in shared memory, so the
                     // fused pass reads the row once (passes that read each row once stream; at most 256
                     // threads; raises where clusters are unavailable or the row does not fit 16 CTAs)
};

struct PolicyLossOptions {
  PolicyLossType loss_type = PolicyLossType::kGrpo;
  ImportanceSamplingLevel importance_sampling_level = ImportanceSamplingLevel::kToken;
  double beta = 0.04;                 // >= 0, weight of the KL penalty; > 0 needs ref_logp; 0: no KL term
  double eps_low = 0.2;               // >= 0: the ratio is clipped below at 1 - eps_low
  double eps_high = 0.2;              // >= 0: ... and above at 1 + eps_high (DAPO's clip-higher: eps_high > eps_low)
  double temperature = 1.0;           // > 0: the logits are divided by it
  int64_t max_completion_length = 0;  // kDrGrpo: the normalizer's length (> 0, required); ignored otherwise
  double num_items_in_batch = 0.0;    // kDapo: the divisor (> 0), or 0 for this batch's token count
  bool check_ids = true;              // throw on an id outside [0, V) at an unmasked token
  PolicyLossAlgo algo = PolicyLossAlgo::kAuto;
  // Tiles for tests and benchmarks (0: chosen by the planner): CTAs sharing a row in kCluster and kRowResident,
  // threads per CTA.
  int cluster_size = 0;
  int threads = 0;
};

struct PolicyLossInputs {
  TensorView logits;           // [B, L+1, V] or [B, L, V]
  TensorView completion_ids;   // [B, L]
  TensorView advantages;       // [B]
  TensorView completion_mask;  // [B, L], optional
  TensorView old_logp;         // [B, L], optional
  TensorView ref_logp;         // [B, L], optional (required when beta > 0)
};

struct PolicyLossOutputs {
  TensorView loss;            // [] float32, required
  TensorView per_token_loss;  // [B, L] float32, optional (the unweighted per-token loss)
  TensorView kl;              // [B, L] float32, optional
  TensorView is_clipped;      // [B, L] bool or uint8, optional
  TensorView logp;            // [B, L] float32, optional
  TensorView entropy;         // [B, L] float32, optional (computed only when asked: a few more operations per logit)
  TensorView lse;             // [B, L] float32, optional: log-sum-exp of logits / temperature
};

// Bytes of scratch the CUDA entry points need for these arguments (0 on the CPU).
size_t policy_loss_workspace_bytes(const PolicyLossInputs& inputs, const PolicyLossOptions& options);

// The loss and the requested per-token outputs: one read of the unmasked rows.
void policy_loss_forward(const PolicyLossInputs& inputs, const PolicyLossOptions& options,
                         const PolicyLossOutputs& outputs, Workspace workspace, StreamHandle stream);

// The loss, the requested outputs and grad_logits = d(loss)/d(logits), times `grad_scale` when given (float32
// [] on the device, read there: no synchronization), times 1 otherwise. Token level: one read and one write;
// sequence level: two reads and one write (see above).
void policy_loss_forward_backward(const PolicyLossInputs& inputs, const PolicyLossOptions& options,
                                  const PolicyLossOutputs& outputs, const TensorView& grad_logits,
                                  const TensorView& grad_scale, Workspace workspace, StreamHandle stream);

// ---- selective log-softmax ----------------------------------------------------------------------------------
// Shapes (N = product of the leading dimensions):
//   logits  [*, V]  fp32 / fp16 / bf16, last dimension contiguous, leading dimensions any strides (no shift)
//   ids     [*]     int32 or int64, logits' leading shape, any strides; every id must be in [0, V)
//   logp    [*]     float32, contiguous: log_softmax(logits / temperature)[id]
//   entropy [*]     float32, contiguous, optional: entropy of softmax(logits / temperature) (not differentiated)
//   lse     [*]     float32, contiguous, optional in the forward (the backward needs it)
// Backward: grad_logits = grad_logp · ([j == id] - p_j) / temperature, from the forward's lse: one read of the
// logits and one write (grad_logits as in policy_loss_forward_backward; it may be `logits` itself).
struct SelectiveLogSoftmaxOptions {
  double temperature = 1.0;  // > 0
  bool check_ids = true;     // throw on an id outside [0, V); otherwise that row is NaN
};

size_t selective_log_softmax_workspace_bytes(const TensorView& logits, const TensorView& ids,
                                             const SelectiveLogSoftmaxOptions& options);

void selective_log_softmax_forward(const TensorView& logits, const TensorView& ids,
                                   const SelectiveLogSoftmaxOptions& options, const TensorView& logp,
                                   const TensorView& entropy, const TensorView& lse, Workspace workspace,
                                   StreamHandle stream);

// grad_logp: float32 [*] (the leading shape, contiguous).
void selective_log_softmax_backward(const TensorView& logits, const TensorView& ids, const TensorView& lse,
                                    const TensorView& grad_logp, const SelectiveLogSoftmaxOptions& options,
                                    const TensorView& grad_logits, Workspace workspace, StreamHandle stream);

}  // namespace logitless
