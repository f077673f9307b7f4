// The Hopper logits GEMM of the linear cross-entropy (sm_90a: TMA loads, WGMMA, a persistent warp-specialized
// CTA): Z = X · Wᵀ (+ bias) for a block of tokens against a block of classes, with the cross-entropy's per-row
// work done in the epilogue on the float32 accumulators, so that no logit goes through device memory unless asked:
//   * stats:    per (row, 256-column tile) the partial statistics of include/logitless/vocab_parallel.h
//               (max, sum of exp, the target's logit, sum of w x); launch_finish_rows (kernels.h) combines the
//               tiles into lse and the loss.
//   * gradient: d(loss)/dZ from a known lse, in the inputs' dtype, straight into the buffer the grad_hidden and
//               grad_weight GEMMs read.
//   * exp:      the statistics, and E = exp(Z - shift) per element in bfloat16 for the gradient in forward
//               (params.h, ExpGradParams; plain options only); with row_partials also the per-tile partials of
//               the row statistics (LinearCrossEntropyOptions::row_stats; hopper/epilogue_exp_row_stats.cuh).
// Host interface only (no CUTLASS types): the kernel is FusedGemm<Mainloop, Epilogue, Scheduler> (hopper/kernel.cuh),
// one epilogue per mode above (hopper/epilogue_*.cuh), instantiated and launched in kernels_hopper.cu; the
// exponentials and the bare mainloop also have a ping-pong schedule (hopper/kernel_pingpong.cuh), which the
// kLceFusedPingPong hook of common/debug_hooks.h selects.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/debug_hooks.h"
#include "cross_entropy/cuda/params.h"
#include "linear_cross_entropy/cuda/params.h"
#include "linear_cross_entropy/cuda/plan.h"  // kFusedTileCols
#include "logitless/tensor.h"

namespace logitless::lce {

struct FusedGemmParams {
  DType dtype = DType::kBFloat16;  // of x and w: bf16 or fp16
  const void* x = nullptr;         // [m, k], row stride ldx (elements)
  int64_t ldx = 0;
  const void* w = nullptr;  // [n, k], row stride ldw: the weight rows of classes col0 .. col0 + n
  int64_t ldw = 0;
  int64_t m = 0, n = 0, k = 0;
  int64_t col0 = 0;            // the class of column 0, relative to ce.vocab_offset
  const void* bias = nullptr;  // bias[(col0 + c) * bias_stride] or nullptr
  DType bias_dtype = DType::kFloat32;
  int64_t bias_stride = 1;
  const int64_t* target = nullptr;  // [m]
  ce::KernelParams ce;              // ignore_index, vocab_total, vocab_offset, eps, inv_v, z, softcap, weight

  // stats
  float* partials = nullptr;  // [m, ceil(n / kFusedTileCols), kStatsFloats] (exp: kExpStatsFloats; plan.h)

  // exp
  const float* shift = nullptr;   // [m]; E goes to dlogits
  float* row_partials = nullptr;  // [m, ceil(n / kFusedTileCols), 4] or nullptr: the row statistics' partials

  // gradient
  const float* lse = nullptr;       // [m]
  const float* upstream = nullptr;  // nullptr (1), [1] or [m] (upstream_per_row)
  int upstream_per_row = 0;
  const Scalars* scalars = nullptr;
  void* dlogits = nullptr;  // [m, ld_dlogits] in dtype
  int64_t ld_dlogits = 0;

  int64_t debug_spin = 0;  // debug::launch_fused_mainloop only: cycles each tile's (empty) epilogue waits
};

// Whether this build has the fused kernels and the device and operands suit them: compute capability 9.0, 16-bit
// inputs, both operands' base addresses 16-byte aligned and their row strides multiples of 8 elements (what a
// TMA descriptor takes), k >= 1.
bool fused_gemm_supported(int device, DType dtype, const void* x, int64_t ldx, const void* w, int64_t ldw, int64_t k);

// Test and benchmark hooks (not public API; names over common/debug_hooks.h's registry, which benchmark harnesses
// set by name): the fused kernels on or off for every later call in the process (on by default), and which kernel
// the last call planned.
namespace debug {
bool fused_kernels_built();  // this build has them (it found the CUTLASS headers)
void set_fused_kernels(bool enabled);
// The gradient in forward's fused path sends every valid row through its rewrite (params.h, ExpGradParams), the
// path of rows the scaled form does not suit, which real inputs seldom reach.
void set_exp_fixup_all(bool enabled);
// The gradient in forward's exponential form on (the default) or off for later calls (common/debug_hooks.h).
void set_exp_form(bool enabled);
bool fused_kernels_enabled();
inline logitless::debug::Slot<Kernel> last_kernel;
// Whether the last gradient in forward on the fused path kept its per-group regions in grad_weight's storage
// (plan.h, Plan::exp_in_grad_weight).
inline logitless::debug::Slot<bool> last_exp_in_grad_weight;
// The last run's Plan::dw_tail_rows, Plan::dw_written_rows, Plan::dlogits_in_grad_weight and Plan::group_rows.
inline logitless::debug::Slot<int64_t> last_dw_tail_rows;
inline logitless::debug::Slot<int64_t> last_dw_written_rows;
inline logitless::debug::Slot<bool> last_dlogits_in_grad_weight;
inline logitless::debug::Slot<int64_t> last_group_rows;
// Whether the last gradient in forward on the fused path kept each group's shared region in its own rows of a
// float32 grad_hidden (plan.h, Plan::shared_in_grad_hidden).
inline logitless::debug::Slot<bool> last_shared_in_grad_hidden;
// The fused GEMM (bfloat16) without an epilogue: its accumulators are dropped. The mainloop's speed alone, for the
// kernel micro-benchmark (bench/cpp/bench_lce_gemm.cu).
void launch_fused_mainloop(const FusedGemmParams& p, int sm_count, cudaStream_t stream);
}  // namespace debug

void launch_fused_stats(const FusedGemmParams& p, int sm_count, cudaStream_t stream);
void launch_fused_grad(const FusedGemmParams& p, int sm_count, cudaStream_t stream);
void launch_fused_exp(const FusedGemmParams& p, int sm_count, cudaStream_t stream);

}  // namespace logitless::lce
