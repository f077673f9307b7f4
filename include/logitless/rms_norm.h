// logitless: RMSNorm forward and backward, with the Llama and Gemma casting conventions and an optional
// fused residual add.
//
// Shapes (N = number of rows = product of the leading dimensions of `x`, H = its last dimension):
//   x             [*, H]  fp32 / fp16 / bf16; last dimension contiguous (stride 1); leading dimensions may
//                         have any strides that do not overlap rows (row stride >= H, views need no copy)
//   residual      [*, H]  optional, x's dtype and shape, last dimension contiguous
//   weight        [H]     x's dtype or float32, contiguous
//   y             [*, H]  x's dtype and shape, last dimension contiguous; may be x itself (same pointer and
//                         strides) for an in-place forward
//   residual_out  [*, H]  x + residual, rounded to x's dtype; required exactly when residual is given; may be
//                         x or residual itself
//   rstd          [*]     float32, N elements, contiguous; optional in the forward (needed by the backward)
//
// Per row, with s = x, or s = round(x + residual) when a residual is given (round = to x's dtype, nearest
// even), the statistics are always in float32:
//   r = 1 / sqrt(sum_j s_j^2 / H + eps)
// and the output, by casting mode (g_j = weight_j + offset):
//   kLlama  y_j = round(g_j * round(s_j * r))     g in float32. Hugging Face's LlamaRMSNorm:
//                                                  `weight * hidden.to(input_dtype)` (offset 0).
//   kGemma  y_j = round((s_j * r) * g_j)          all in float32, one rounding. Gemma's RMSNorm:
//                                                  `(x.float() * rstd * (1.0 + weight.float())).type_as(x)`
//                                                  (offset 1).
//   kNone   y_j = round(round(s_j * r') * g'_j)   every intermediate rounded to x's dtype as a module run
//                                                  wholly in that dtype would: r' = round(r),
//                                                  g'_j = round(weight_j + offset); only the sum of squares
//                                                  stays float32 (never accumulated in 16 bits).
// With fp32 tensors the three modes agree. With a float32 weight and a 16-bit x, Hugging Face's Llama module
// would promote y to float32; here y keeps x's dtype (the same values rounded once more).
// rstd receives r (kNone: r', the value the output used), which the backward reads back.
//
// Backward: given dy = dL/dy (and ds = dL/d(residual_out) when the forward added a residual), with
// n_j the normalized value the forward multiplied (kLlama, kNone: round(s_j * r); kGemma: s_j * r) and
// a_j = dy_j * g_j in float32:
//   dL/ds_j      = r * a_j - s_j * r^3 * (sum_k a_k s_k) / H  (+ ds_j)
//   dL/dweight_j = sum over rows of dy_j * n_j                  (float32 accumulation, rounded once)
// dL/dx = dL/dresidual = dL/ds, so one grad_x serves both inputs. The roundings of the forward are treated
// as the identity (their derivative almost everywhere), as autograd does.
//
// Determinism: dL/dweight is reduced in float32 without atomics. Each CTA of the backward sums its rows in
// a fixed order into its own workspace row, and a second kernel adds those rows in a fixed order, so two
// calls with the same inputs on the same GPU model produce the same bits (the CTA count depends on the SM
// count, so a GPU with a different SM count may differ in the last bits).
#pragma once

#include <cstddef>
#include <cstdint>

#include "logitless/tensor.h"

namespace logitless {

enum class RMSNormCasting : int32_t { kLlama = 0, kGemma = 1, kNone = 2 };

// Which kernel runs on CUDA. kAuto picks the fastest that fits; the others exist to test and benchmark
// each path on one GPU (kRegisters where the row does not fit its constraints raises an Error).
enum class RMSNormAlgo : int32_t {
  kAuto = 0,
  kRegisters = 1,  // the row lives in registers, 16-byte accesses: H % (16 / elem bytes) == 0, 16-byte
                   // aligned rows, H up to 32768 (16-bit) / 16384 (fp32) in both directions
  kGeneric = 2,    // any H, any alignment: element accesses, two passes over the row (the second from cache)
};

struct RMSNormOptions {
  double eps = 1e-6;    // > 0, finite
  double offset = 0.0;  // added to the weight: 1.0 for Gemma's zero-centered weights
  RMSNormCasting casting = RMSNormCasting::kLlama;
  RMSNormAlgo algo = RMSNormAlgo::kAuto;
  // kRegisters: 16-byte vectors each thread holds per row, 0 = the launcher's choice; 4 or 8 force it (a
  // knob for benchmarks; a count the row cannot use raises an Error).
  int vectors_per_thread = 0;
};

// Bytes of scratch each entry point needs for these arguments on CUDA (0 on the CPU). The forward needs
// none today; the backward needs one float32 row of H per CTA for the partial sums of grad_weight (per row
// slot of a CTA when H is too long for shared memory, beyond 58K floats on an H100), sized for the kernel
// with the most CTAs that may run, since the tensors' alignment is not known yet. Without grad_weight the
// backward needs none.
size_t rms_norm_forward_workspace_bytes(const TensorView& x, const TensorView& weight, const RMSNormOptions& options);
size_t rms_norm_backward_workspace_bytes(const TensorView& x, const TensorView& weight, const RMSNormOptions& options);

// One read of x (and residual), one write of y (and residual_out), and N floats of rstd.
void rms_norm_forward(const TensorView& x, const TensorView& residual, const TensorView& weight,
                      const RMSNormOptions& options, const TensorView& y, const TensorView& residual_out,
                      const TensorView& rstd, Workspace workspace, StreamHandle stream);

// grad_y            [*, H]  x's dtype and shape, last dimension contiguous
// grad_residual_out [*, H]  optional: the gradient flowing into residual_out (added to grad_x)
// x                 [*, H]  what the forward normalized: x, or residual_out when it added a residual
// weight, rstd              as in the forward (rstd from the forward, same options)
// grad_x            [*, H]  x's dtype, last dimension contiguous; may be grad_y or grad_residual_out itself
//                           (same pointer and strides) to write the gradient in place
// grad_weight       [H]     optional: weight's dtype or float32, contiguous
// One read of x, grad_y (and grad_residual_out), one write of grad_x; grad_weight costs a workspace of
// (CTAs x H) floats, written once and read once, instead of any pass over N x H.
void rms_norm_backward(const TensorView& grad_y, const TensorView& grad_residual_out, const TensorView& x,
                       const TensorView& weight, const TensorView& rstd, const RMSNormOptions& options,
                       const TensorView& grad_x, const TensorView& grad_weight, Workspace workspace,
                       StreamHandle stream);

}  // namespace logitless
