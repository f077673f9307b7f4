// logitless: fused linear cross-entropy. The loss of a language model's head, and its gradients, from the
// last hidden states: the logits hidden · weightᵀ (+ bias) exist only a chunk at a time, in scratch.
//
// Shapes (N = number of tokens = product of the leading dimensions of `hidden`, H = hidden size, V = vocabulary):
//   hidden        [*, H]  fp32 / fp16 / bf16; last dimension contiguous (stride 1); leading dimensions may
//                         have any strides (a view such as h[:, :-1, :] needs no copy from the caller: rows
//                         with one common stride >= H go to the GEMMs as they are, other layouts are copied
//                         into the workspace first)
//   weight        [V, H]  hidden's dtype (the lm_head / tied-embedding layout); last dimension contiguous,
//                         row stride >= H
//   bias          [V]     optional, hidden's dtype or float32, any stride
//   target        [*]     int32 or int64, hidden's leading shape, any strides
//   class_weight  [V]     float32, optional per-class weights (torch's cross-entropy `weight`), any stride
//   loss          []      float32 for reduction sum/mean; [*] (N elements, contiguous) for reduction none
//   lse           [*]     float32, N elements, contiguous: per-token log-sum-exp of the (soft-capped) logits;
//                         optional in the forward, required by the backward (it is what the forward saves)
//   grad_hidden   [*, H]  optional: hidden's dtype or float32, hidden's shape, last dimension contiguous,
//                         rows with one common stride >= H (a fresh contiguous tensor always qualifies)
//   grad_weight   [V, H]  optional: weight's dtype or float32, last dimension contiguous, row stride >= H
//   grad_bias     [V]     optional: bias's dtype or float32, any stride
//   entropy       [*]     float32, N elements, contiguous; is_top1 [*] bool or uint8, N elements, contiguous: the
//                         row statistics (LinearCrossEntropyRowStats), given exactly when options.row_stats is set
// An absent (undefined) gradient output is not computed: a frozen lm_head costs no weight-gradient GEMM.
//
// The loss is the cross-entropy family's (include/logitless/cross_entropy.h) over the logits
//   z_i = hidden_i · weightᵀ + bias        (bias 0 when absent)
// with every option meaning what it means there: ignore_index, reductions (mean divides by the summed class
// weights of the tokens not ignored, but the z-loss terms by the count of those tokens; a mean over no tokens is
// 0 with gradient 0), label_smoothing, z_loss,
// softcap (applied to z), class weights, and check_targets. With g = d(loss)/dz (the cross-entropy gradient
// of the logits, times the upstream gradient):
//   grad_hidden = g · weight      grad_weight = gᵀ · hidden      grad_bias = column sums of g
//
// Two exact schedules (they differ in memory and time, not in what they compute):
//  * gradient in the forward (`linear_cross_entropy_forward_backward`, reduction sum/mean): one pass over
//    token chunks computes, per chunk, the logits, their softmax statistics, the gradient of the chunk's
//    logits, and the chunk's contribution to all three gradients: three GEMMs in all. The loss's backward
//    then only multiplies the gradients by the upstream gradient (what a training step's loss.backward()
//    passes is 1.0).
//  * recompute (`linear_cross_entropy_forward`, then `linear_cross_entropy_backward`; needed for reduction
//    none, whose upstream gradient is known only in the backward): the forward keeps the per-token lse; the
//    backward recomputes the logits a vocabulary chunk at a time: four GEMMs in all, and no full-size float32
//    gradient accumulator (each chunk of vocabulary rows of grad_weight is final when written).
//
// Row statistics (options.row_stats; the forward and the gradient-in-forward schedule; not differentiated), per
// token, of the softmax the loss uses, p = softmax(x) with x the (soft-capped) logits:
//   entropy[i] = -Σ_j p_j ln p_j = lse_i - Σ_j p_j x_j   (label smoothing, z-loss and class weights change the loss,
//                                                        not p)
//   is_top1[i] = 1 where target[i] is the first maximum of row i's logits z (torch.argmax's answer: the lowest index
//                among equal maxima), compared before the soft cap, which is monotone: it never reorders them
// An ignored token gets entropy 0 and is_top1 0; an unchecked bad target, NaN and 0. A row whose capped logits have
// no finite lse (a NaN logit; without a soft cap also a +inf logit, or -inf only) has entropy NaN; is_top1 is 0 in a
// row with a NaN logit, and target == 0 in a row of -inf only (torch.argmax: index 0). On CUDA both come from the
// float32 logits the GEMM produced, so two classes within float32 rounding of each other may rank otherwise than on
// the CPU. Not for a vocabulary shard (include/logitless/vocab_parallel.h refuses it): its exchange carries no
// entropy or argmax.
//
// Precision (CUDA): the GEMMs accumulate in float32; each chunk of logits is kept in float32, so the loss is
// as exact as a float32 computation from the same inputs (a bf16 chunk would round every logit by up to
// 2^-9 relative, about 1e-3 of a typical loss); the gradient of the logits is rounded to the inputs' dtype
// (the GEMMs that consume it need it there, as torch's own bf16 backward does); grad_weight sums over token
// chunks in float32 and is rounded once at the end (options.grad_weight_accumulation trades that for memory).
//
// CUDA scratch (*_workspace_bytes; the caller allocates it, e.g. from PyTorch's caching allocator):
// a chunk of float32 logits and the gradient of the chunk's logits in the inputs' dtype, sized from
// options.memory_budget; plus, where grad_weight is 16-bit and the tokens do not fit one chunk, a float32
// grad_weight accumulator (4·V·H bytes; none with GradWeightAccumulation::kWeightDtype); the gradient-in-forward
// schedule holds the logits' gradient of every token at once instead whenever that takes no more than the budget
// plus that accumulator (one weight-gradient GEMM, no accumulation), and its float32 chunk then grows into the rest
// of that allowance (up to 1024 tokens: each chunk's logits GEMM re-reads the weight). Where one call sums in that
// accumulator and grad_weight's rows are contiguous, grad_weight's own storage, which holds nothing until the
// accumulator's sums are written into it, holds the accumulator's last third (so the workspace holds 4·V·H bytes less
// that: about two thirds of it). On the fused Hopper gradient in forward the budget then holds the group's gradient
// alone where grad_weight's storage could hold a token group's other per-token scratch (its statistics, scales,
// scaled hidden rows and float32 grad_hidden rows), and that scratch lies beside the budget in the workspace (the
// last group's products then write grad_weight, with no cast after them); where that storage is larger than the
// budget and holding the group's gradient there too (in place of most of the tail) makes fewer groups, it holds the
// gradient and the scratch, and the workspace holds the accumulator without the gradient (at most one budget more
// than beside the longest tail); the token groups are cut evenly (no short last group). Where grad_weight is float32
// (float32 gradients of 16-bit inputs, as under autocast over float32 weights) it takes the groups' sums itself, and
// each group's product reads and writes all of it: groups shorter than 2048 tokens then grow toward 2048 as far as
// twice the budget holds their gradient (at V = 256000 with the default budget: 2048 tokens, 1000 MiB, where the
// budget alone holds 1024; at V <= 131072 the budget holds 2048 tokens already). chunk_tokens fixes the groups
// instead. The recompute
// backward's float32 grad_hidden accumulator (4·N·H bytes, when grad_hidden is 16-bit and the vocabulary takes more
// than one chunk) comes on top of the budget likewise. The workspace also holds cuBLAS's own (32 MiB on sm_90+, 4 MiB
// before), so the GEMMs allocate nothing and the calls can be captured in a CUDA graph. cuBLAS runs through one handle
// per device and host thread, created by the first call (make that call before any graph capture, as a warm-up does).
#pragma once

#include <cstddef>
#include <cstdint>

#include "logitless/cross_entropy.h"
#include "logitless/tensor.h"

namespace logitless {

// Where the gradient-in-forward schedule sums a 16-bit grad_weight over token groups (it has several when the
// tokens' gradient of the logits does not fit the budget at once):
//  * kFloat32 (default): in a float32 accumulator of 4·V·H bytes (about a third of it in a contiguous grad_weight's
//    own storage, the rest in the workspace), rounded to grad_weight's dtype once at the end; the accumulator
//    counts in the planner's trade, so the plan may hold every token's gradient instead (one group) where that
//    costs no more.
//  * kWeightDtype: in grad_weight itself, each group's GEMM adding its float32 product to the 16-bit running sum
//    (beta = 1) and rounding the result: no accumulator, so the workspace stays within the budget (groups from the
//    budget alone), at the price of one rounding of the running sum per token group (its error grows with the
//    number of groups). The CPU backend rounds its running sum after each token group of the CUDA generic plan
//    for the same options (chunk_tokens, memory_budget), so it shows the same loss of precision.
// A no-op where nothing sums over token groups in float32: a float32 grad_weight (the inputs' dtype float32, or
// float32 gradients of 16-bit inputs: already their own accumulator), no grad_weight, and the recompute schedule
// (each vocabulary chunk of grad_weight rows is final when written). Loss, lse, grad_hidden and grad_bias are the
// same either way.
enum class GradWeightAccumulation : int32_t { kFloat32 = 0, kWeightDtype = 1 };

struct LinearCrossEntropyOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  double label_smoothing = 0.0;  // in [0, 1]
  double z_loss = 0.0;           // >= 0: adds z_loss * lse^2 per token (reduction mean: averaged over the
                                 // tokens not ignored, unweighted)
  double softcap = 0.0;          // > 0 caps the logits as softcap * tanh(z / softcap); 0 = off
  bool check_targets = true;     // throw on a target outside [0, V) (skipped while a CUDA graph is captured)
  // CUDA chunking. 0: chosen from memory_budget. chunk_tokens: tokens whose logits' gradient is held at once
  // (the forward's and the gradient-in-forward schedule's chunk); chunk_vocab: vocabulary rows per chunk of
  // the recompute backward.
  int64_t chunk_tokens = 0;
  int64_t chunk_vocab = 0;
  size_t memory_budget = size_t{512} << 20;  // bytes of chunk scratch (see above); >= 1
  GradWeightAccumulation grad_weight_accumulation = GradWeightAccumulation::kFloat32;  // see the enum
  // The forward (and the gradient-in-forward schedule) also writes the row statistics (see above) into the call's
  // LinearCrossEntropyRowStats; a flag here, not only the outputs, because the workspace queries size for it (the
  // fused Hopper path keeps per-tile partials of them). Ignored by the recompute backward.
  bool row_stats = false;
};

// The row statistics' outputs (see above): both defined when options.row_stats is set, both undefined otherwise.
struct LinearCrossEntropyRowStats {
  TensorView entropy;  // [*] float32
  TensorView is_top1;  // [*] bool or uint8
};

// Bytes of scratch each CUDA entry point needs for these arguments (0 on the CPU). Pass the tensors the call
// will get (undefined gradient outputs: not computed).
size_t linear_cross_entropy_forward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                    const TensorView& target, const LinearCrossEntropyOptions& options);
size_t linear_cross_entropy_forward_backward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                             const TensorView& target, const TensorView& grad_hidden,
                                                             const TensorView& grad_weight, const TensorView& grad_bias,
                                                             const LinearCrossEntropyOptions& options);
size_t linear_cross_entropy_backward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                     const TensorView& target, const TensorView& grad_hidden,
                                                     const TensorView& grad_weight, const TensorView& grad_bias,
                                                     const LinearCrossEntropyOptions& options);

// Whether the recompute schedule is expected to finish a reduced (sum/mean) loss with these gradients sooner
// than the gradient-in-forward schedule, for N tokens of hidden size H over V classes on `device`, with the
// gradient outputs in the inputs' dtype, grad_weight's rows contiguous and hidden rows a GEMM can read in place. A
// cost model of the two CUDA plans (src/linear_cross_entropy/cuda/plan.cpp): the recompute schedule's fourth GEMM
// against the gradient-in-forward schedule's grad_weight accumulation over token groups (float32, or 16-bit at half
// the bytes with GradWeightAccumulation::kWeightDtype), which the budget forces at large V·H (bench/RESULTS.md has
// the shapes measured). False on the CPU and for float32 inputs. The Python package's schedule="auto" asks it for
// bfloat16.
bool linear_cross_entropy_recompute_is_faster(int64_t n_tokens, int64_t hidden, int64_t vocab, DType dtype,
                                              Device device, bool need_grad_hidden, bool need_grad_weight,
                                              bool need_grad_bias, const LinearCrossEntropyOptions& options);

// The loss (and optional lse) only: one GEMM over token chunks.
void linear_cross_entropy_forward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                  const TensorView& target, const TensorView& class_weight,
                                  const LinearCrossEntropyOptions& options, const TensorView& loss,
                                  const TensorView& lse, Workspace workspace, StreamHandle stream,
                                  const LinearCrossEntropyRowStats& row_stats = {});

// The gradient-in-forward schedule: the loss and the gradients of the reduced loss, times `grad_scale` when
// given (float32 on the device: [] for sum/mean, [*] per token for none; read on the device, so no
// synchronization), times 1 otherwise.
void linear_cross_entropy_forward_backward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                           const TensorView& target, const TensorView& class_weight,
                                           const LinearCrossEntropyOptions& options, const TensorView& loss,
                                           const TensorView& lse, const TensorView& grad_hidden,
                                           const TensorView& grad_weight, const TensorView& grad_bias,
                                           const TensorView& grad_scale, Workspace workspace, StreamHandle stream,
                                           const LinearCrossEntropyRowStats& row_stats = {});

// The recompute schedule's backward: the gradients times grad_loss (float32: [] for sum/mean, [*] for none),
// from the lse the forward returned. Targets are not checked again (the forward did).
void linear_cross_entropy_backward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                   const TensorView& target, const TensorView& class_weight, const TensorView& lse,
                                   const TensorView& grad_loss, const LinearCrossEntropyOptions& options,
                                   const TensorView& grad_hidden, const TensorView& grad_weight,
                                   const TensorView& grad_bias, Workspace workspace, StreamHandle stream);

}  // namespace logitless
