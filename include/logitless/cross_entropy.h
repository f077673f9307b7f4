// logitless: cross-entropy over given logits.
//
// Shapes (N = number of rows = product of the leading dimensions of `logits`):
//   logits       [*, V]   fp32 / fp16 / bf16; last dimension contiguous (stride 1); leading dimensions may
//                         have any strides >= 0 that do not overlap rows, e.g. the shifted view
//                         logits[:, :-1, :] of a [B, T+1, V] tensor (no copy needed)
//   target       [*]      int32 or int64, the same leading shape as logits, any strides
//   weight       [V]      float32, optional per-class weights (torch's `weight`)
//   loss         []       float32 for reduction sum/mean; [*] (N elements, contiguous) for reduction none
//   lse          [*]      float32, optional: per-row log-sum-exp of the (soft-capped) logits
//   z_loss       [*]      float32, optional: per-row z-loss term z_loss * lse^2
//   grad_logits  [*, V]   same dtype and shape as logits, last dimension contiguous; may be `logits`
//                         itself (same pointer and strides) for an in-place gradient
//
// Per row i with target t (x = softcap * tanh(logits / softcap) when softcap > 0, else logits;
// w = weight, or all ones; eps = label_smoothing; W = sum_j w_j):
//   loss_i = (1 - eps) * w_t * (lse_i - x_t) + (eps / V) * sum_j w_j * (lse_i - x_j) + z_loss * lse_i^2
// Rows whose target equals ignore_index have loss 0, lse 0, z_loss 0 and gradient 0 and are not read.
// Reduction mean divides the sum of the cross-entropy terms (all but z_loss * lse_i^2) by sum_i w_{t_i} over
// the rows not ignored, as torch does, and the sum of the z-loss terms by the count of those rows (as Liger
// does), so the loss does not depend on the scale of the class weights; without weights both divisors are the
// count. When every row is ignored the loss is 0 and the gradient is 0 (torch: NaN).
//
// A term whose coefficient is 0 is not evaluated: without label smoothing the class weights of classes no row
// targets (and their sum W) are not used, so a NaN or inf among them changes nothing (as in torch); with it,
// they enter every row. A NaN class weight of a row's target makes that row's loss and gradient NaN.
//
// Targets outside [0, V) other than ignore_index: with check_targets (and a stream that is not capturing
// a CUDA graph) the call throws an Error naming the first such row; otherwise that row's loss, lse and
// gradient are NaN (and so is a sum or mean). A row with a NaN or +inf logit gets NaN loss and gradient;
// other rows are unaffected.
#pragma once

#include <cstddef>
#include <cstdint>

#include "logitless/tensor.h"

namespace logitless {

enum class Reduction : int32_t { kNone = 0, kSum = 1, kMean = 2 };

// Which kernel runs on CUDA. kAuto picks the fastest that fits; the others exist to test and benchmark
// each path on one GPU (a choice the device cannot run raises an Error).
enum class CrossEntropyAlgo : int32_t {
  kAuto = 0,
  kRowResident = 1,  // Hopper: a thread-block cluster keeps each row in shared memory (1 read + 1 write)
  kStreaming = 2,    // any GPU: the gradient pass re-reads the row (2 reads + 1 write)
};

struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  double label_smoothing = 0.0;  // in [0, 1]
  double z_loss = 0.0;           // >= 0; adds z_loss * lse^2 per row (PaLM's z-loss, "lse_square_scale");
                                 // reduction mean averages it over the rows not ignored, unweighted
  double softcap = 0.0;          // > 0 caps the logits as softcap * tanh(logits / softcap); 0 = off
  bool check_targets = true;     // throw on a target outside [0, V) (skipped while a CUDA graph is captured)
  CrossEntropyAlgo algo = CrossEntropyAlgo::kAuto;
};

// Bytes of scratch the CUDA entry points need for these arguments (0 on the CPU).
size_t cross_entropy_workspace_bytes(const TensorView& logits, const TensorView& target, const TensorView& weight,
                                     const CrossEntropyOptions& options);

// Loss (and optional lse / z_loss) only: one read of the logits.
void cross_entropy_forward(const TensorView& logits, const TensorView& target, const TensorView& weight,
                           const CrossEntropyOptions& options, const TensorView& loss, const TensorView& lse,
                           const TensorView& z_loss, Workspace workspace, StreamHandle stream);

// Loss and d(loss)/d(logits) in one pass: one read of the logits and one write of the gradient.
// The gradient is that of the reduced loss times `grad_scale` when given (float32, [] for sum/mean or
// [*] per row for none; read on the device, so no synchronization), times 1 otherwise.
void cross_entropy_forward_backward(const TensorView& logits, const TensorView& target, const TensorView& weight,
                                    const CrossEntropyOptions& options, const TensorView& loss, const TensorView& lse,
                                    const TensorView& z_loss, const TensorView& grad_logits,
                                    const TensorView& grad_scale, Workspace workspace, StreamHandle stream);

// The gradient from a saved lse (the forward's): grad_logits = d(loss)/d(logits) * grad_loss, where
// grad_loss is float32 [] for sum/mean or [*] for none. One read of the logits, one write.
void cross_entropy_backward(const TensorView& logits, const TensorView& target, const TensorView& weight,
                            const TensorView& lse, const TensorView& grad_loss, const CrossEntropyOptions& options,
                            const TensorView& grad_logits, Workspace workspace, StreamHandle stream);

// grad *= scale in place, rows of `grad` [*, V] by a device-resident float32 `scale` ([] or [*]); rows
// whose scale is exactly 1 are not touched, so the common case (upstream gradient 1.0) costs one launch.
void scale_rows(const TensorView& grad, const TensorView& scale, StreamHandle stream);

}  // namespace logitless
