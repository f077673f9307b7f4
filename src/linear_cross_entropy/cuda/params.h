// What the linear cross-entropy kernels take: plain pointers, int64 sizes, and the cross-entropy family's
// KernelParams for the per-element math they share with it.
#pragma once

#include <cstdint>

#include "cross_entropy/cuda/params.h"
#include "logitless/tensor.h"

namespace logitless::lce {

// Per-call scalars, computed on the device by the prepass (the cross-entropy family's, cross_entropy/cuda/steps.h;
// workspace region Plan::off_scalars): the mean's divisors over the whole call, W, the first bad target.
using Scalars = ce::Scalars;

// The gradient of a chunk of float32 logits: rows [0, rows) of the chunk are tokens row0 + r, its columns
// [0, width) are classes col0 + c.
struct GradParams {
  const float* logits = nullptr;  // [rows, ld_logits]
  int64_t ld_logits = 0;
  void* dlogits = nullptr;  // [rows, ld_dlogits] in the GEMMs' dtype; may be `logits` itself (float32)
  int64_t ld_dlogits = 0;
  float* db_partial = nullptr;      // [ceil(rows / kGradRowsPerBlock), ld_logits] column sums, or nullptr
  const int64_t* target = nullptr;  // [rows]: the chunk's targets
  const float* lse = nullptr;       // [rows]
  const float* upstream = nullptr;  // nullptr (1), [] or [rows] (per_row)
  int upstream_per_row = 0;
  const Scalars* scalars = nullptr;
  int64_t rows = 0, width = 0, col0 = 0;
  ce::KernelParams ce;  // vocab, ignore_index, eps, inv_v, z, softcap, class weights: the family's definitions
};

// The gradient in forward on the fused Hopper path, one token group at a time. The logits GEMM (kernels_hopper.h, exp
// epilogue) writes E[r, j] = exp(z[r, j] - shift[r]) in bfloat16 next to the tile statistics, with shift[r] the
// target's logit (a dot product before the GEMM), so that d(loss)/dZ[r, j] = scale[r] * E[r, j] for every j but the
// target. The target's element, a p_t - b, stays out of the 16-bit products: exp_rows zeroes it in E and keeps it in
// float32 as target_coef[r], so that
//   grad_hidden = scale ⊙ (E W) + target_coef ⊙ W[t]            (both terms in float32, one kernel after the GEMM)
//   grad_weight = Eᵀ (scale ⊙ X), then W[t] rows += target_coef ⊙ X  (float32 sums per class, rows sorted by target)
// The target terms dominate both gradients' norms; in 16-bit they would be rounded twice (once in E, once in
// scale ⊙ X), where torch's bfloat16 product rounds them once. Rows where the scaled form loses range or precision
// (lse more than kExpRange above shift, or a row scale near 0 beside its target term) go to exp_fixup, which
// recomputes their logits and writes their gradient over a scale of its own.
struct ExpGradParams {
  int64_t rows = 0, h = 0, v = 0;
  const void* x = nullptr;  // bfloat16 hidden rows [rows, h], row stride ldx
  int64_t ldx = 0;
  const void* w = nullptr;  // bfloat16 weight [v, h], row stride ldw
  int64_t ldw = 0;
  const void* bias = nullptr;  // bias[j * bias_stride] or nullptr
  DType bias_dtype = DType::kFloat32;
  int64_t bias_stride = 1;
  const int64_t* target = nullptr;  // [rows]
  ce::KernelParams ce;              // ignore_index, vocab_total, z, class weights (no label smoothing, no soft cap)
  const Scalars* scalars = nullptr;
  const float* upstream = nullptr;  // nullptr (1), [1] or [rows] (upstream_per_row)
  int upstream_per_row = 0;
  const float* lse = nullptr;  // [rows]
  float* shift = nullptr;      // [rows]
  float* scale = nullptr;      // [rows]: 0 for ignored rows, NaN for bad ones
  void* e = nullptr;           // bfloat16 [rows, ld_e]
  int64_t ld_e = 0;
  float* target_coef = nullptr;  // [rows]: a p_t - b (0 for ignored rows, NaN for bad ones)
  int* class_keys = nullptr;     // [rows]: the target's column, v for rows without a target term; nullptr when no
  int* class_rows = nullptr;     // grad_weight is asked for. With class_rows (0 .. rows - 1): what the sort takes.
  void* xs = nullptr;            // bfloat16 [rows, h]: scale[r] * x[r]; nullptr when no grad_weight is asked for
  int* fixups = nullptr;         // [1 + rows]: the count, then the rows exp_fixup rewrites
  int force_fixups = 0;          // tests: every valid row goes through exp_fixup
};

// Rows whose lse exceeds shift by more than this many nats are rewritten by exp_fixup: below it E stays under e^40
// (the maximum logit is at most lse) and scale above e^-40 times its row factor, far from bfloat16's range limits
// (e^±88).
inline constexpr float kExpRange = 40.f;

}  // namespace logitless::lce
