// The Hopper logits GEMM with the cross-entropy in its epilogue (see kernels_hopper.h): the kernels this build
// instantiates, and their host launchers. The kernel is FusedGemm<Mainloop, Epilogue, Scheduler> (hopper/kernel.cuh,
// the cooperative schedule) or, for the exponentials and the bare mainloop where a test or benchmark asks
// (use_pingpong), PingPongGemm (hopper/kernel_pingpong.cuh): TMA loads and WGMMAs over k in 2-CTA clusters
// (hopper/mainloop.cuh), a persistent grouped tile order (hopper/scheduler.cuh), and one epilogue per mode
// (hopper/epilogue_*.cuh), each with its own parameters, built here from FusedGemmParams.
#include "linear_cross_entropy/cuda/kernels_hopper.h"

#include "common/cuda/check.cuh"

#if defined(LOGITLESS_WITH_CUTLASS)
#include "linear_cross_entropy/cuda/hopper/epilogue_exp.cuh"
#include "linear_cross_entropy/cuda/hopper/epilogue_exp_row_stats.cuh"
#include "linear_cross_entropy/cuda/hopper/epilogue_grad.cuh"
#include "linear_cross_entropy/cuda/hopper/epilogue_none.cuh"
#include "linear_cross_entropy/cuda/hopper/epilogue_stats.cuh"
#include "linear_cross_entropy/cuda/hopper/kernel.cuh"
#include "linear_cross_entropy/cuda/hopper/kernel_pingpong.cuh"
#include "linear_cross_entropy/cuda/hopper/mainloop.cuh"
#include "linear_cross_entropy/cuda/hopper/scheduler.cuh"
#endif

namespace logitless::lce {

#if defined(LOGITLESS_WITH_CUTLASS)
namespace {

using namespace hopper;
using bf16 = cutlass::bfloat16_t;
using f16 = cutlass::half_t;
using Scheduler = GroupedPairScheduler<kBM, kBN, kCluster>;
template <typename T, class Epilogue>
using Gemm = FusedGemm<Mainloop<T>, Epilogue, Scheduler>;
template <typename T, class Epilogue>
using PingPong = PingPongGemm<Mainloop<T, kWarpgroupRows>, Epilogue, Scheduler>;

// The kernels of this file (fourteen): statistics and gradient for {bfloat16, float16} x {plain, general (soft cap
// or label smoothing)}; exponentials (with and without the row statistics) and the bare mainloop for plain bfloat16
// only, on either schedule.
// The largest shared memory of them: the output-writing epilogues' (TileStore's buffers).
constexpr size_t kMaxSmemBytes = Gemm<bf16, EpilogueGrad<bf16, false>>::kSmemBytes;
static_assert(Gemm<f16, EpilogueGrad<f16, true>>::kSmemBytes <= kMaxSmemBytes);
static_assert(Gemm<bf16, EpilogueExp<bf16>>::kSmemBytes <= kMaxSmemBytes);
static_assert(Gemm<bf16, EpilogueExpRowStats<bf16>>::kSmemBytes <= kMaxSmemBytes);
static_assert(PingPong<bf16, EpilogueExp<bf16>>::kSmemBytes <= kMaxSmemBytes);
static_assert(PingPong<bf16, EpilogueExpRowStats<bf16>>::kSmemBytes <= kMaxSmemBytes);

LogitRows logit_rows(const FusedGemmParams& p) {
  LogitRows r;
  r.m = p.m;
  r.n = p.n;
  r.col0 = p.col0;
  r.bias = p.bias;
  r.bias_dtype = p.bias_dtype;
  r.bias_stride = p.bias_stride;
  r.target = p.target;
  r.ce = p.ce;
  return r;
}

template <class Kernel>
void launch_kernel(const FusedGemmParams& p, const typename Kernel::Epilogue::Arguments& epilogue, int sm_count,
                   cudaStream_t stream) {
  using T = typename Kernel::Mainloop::Element;
  using Epilogue = typename Kernel::Epilogue;
  typename Kernel::Mainloop::Arguments mainloop;
  mainloop.x = static_cast<const T*>(p.x);
  mainloop.ldx = p.ldx;
  mainloop.w = static_cast<const T*>(p.w);
  mainloop.ldw = p.ldw;
  mainloop.m = static_cast<int>(p.m);
  mainloop.n = static_cast<int>(p.n);
  mainloop.k = static_cast<int>(p.k);
  const typename Kernel::Params params{Kernel::Mainloop::to_underlying_arguments(mainloop),
                                       Epilogue::to_underlying_arguments(epilogue),
                                       Scheduler::to_underlying_arguments(p.m, p.n)};
  launch_fused_gemm<Kernel>(params, sm_count, stream);
}

template <typename T, class Epilogue>
void launch_gemm(const FusedGemmParams& p, const typename Epilogue::Arguments& epilogue, int sm_count,
                 cudaStream_t stream) {
  launch_kernel<Gemm<T, Epilogue>>(p, epilogue, sm_count, stream);
}

// The schedule the kLceFusedPingPong hook names, read at the call. Cooperative by default: the ping-pong schedule
// hides the exponential epilogue but fills shared memory with B twice per tile (1.5x the bytes per FLOP), and on
// an H100 that costs more than it hides even at k = 2048 (bench/RESULTS.md).
bool use_pingpong() { return logitless::debug::hook(logitless::debug::Hook::kLceFusedPingPong) != 0; }

template <typename T, class Epilogue>
void launch_either_schedule(const FusedGemmParams& p, const typename Epilogue::Arguments& epilogue, int sm_count,
                            cudaStream_t stream) {
  if (use_pingpong())
    launch_kernel<PingPong<T, Epilogue>>(p, epilogue, sm_count, stream);
  else
    launch_kernel<Gemm<T, Epilogue>>(p, epilogue, sm_count, stream);
}

// The epilogues templated on the input dtype and on the general options (soft cap or label smoothing).
template <template <typename, bool> class Epilogue, class Arguments>
void launch_dtype_options(const FusedGemmParams& p, const Arguments& epilogue, int sm_count, cudaStream_t stream) {
  const bool general = p.ce.softcap > 0.f || p.ce.eps != 0.f;
  if (p.dtype == DType::kBFloat16) {
    general ? launch_gemm<bf16, Epilogue<bf16, true>>(p, epilogue, sm_count, stream)
            : launch_gemm<bf16, Epilogue<bf16, false>>(p, epilogue, sm_count, stream);
  } else {
    general ? launch_gemm<f16, Epilogue<f16, true>>(p, epilogue, sm_count, stream)
            : launch_gemm<f16, Epilogue<f16, false>>(p, epilogue, sm_count, stream);
  }
}

}  // namespace

bool debug::fused_kernels_built() { return true; }

bool fused_gemm_supported(int device, DType dtype, const void* x, int64_t ldx, const void* w, int64_t ldw, int64_t k) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return false;
  const DeviceInfo& info = device_info(device);
  if (info.sm_major != 9 || info.sm_minor != 0) return false;
  if (info.max_smem_per_block_optin < static_cast<int>(kMaxSmemBytes)) return false;
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return k >= 1 && aligned(x) && aligned(w) && ldx % 8 == 0 && ldw % 8 == 0;
}

void launch_fused_stats(const FusedGemmParams& p, int sm_count, cudaStream_t stream) {
  if (p.m <= 0 || p.n <= 0) return;
  StatsArguments a;
  a.rows = logit_rows(p);
  a.partials = p.partials;
  launch_dtype_options<EpilogueStats>(p, a, sm_count, stream);
}

void launch_fused_grad(const FusedGemmParams& p, int sm_count, cudaStream_t stream) {
  if (p.m <= 0 || p.n <= 0) return;
  GradArguments a;
  a.rows = logit_rows(p);
  a.lse = p.lse;
  a.upstream = p.upstream;
  a.upstream_per_row = p.upstream_per_row;
  a.scalars = p.scalars;
  a.dlogits = p.dlogits;
  a.ld_dlogits = p.ld_dlogits;
  launch_dtype_options<EpilogueGrad>(p, a, sm_count, stream);
}

void debug::launch_fused_mainloop(const FusedGemmParams& p, int sm_count, cudaStream_t stream) {
  if (p.m <= 0 || p.n <= 0) return;
  EpilogueNone::Arguments a;
  a.sink = p.partials;
  a.debug_spin = p.debug_spin;
  launch_either_schedule<bf16, EpilogueNone>(p, a, sm_count, stream);
}

void launch_fused_exp(const FusedGemmParams& p, int sm_count, cudaStream_t stream) {
  if (p.m <= 0 || p.n <= 0) return;
  if (p.dtype != DType::kBFloat16 || p.ce.softcap > 0.f || p.ce.eps != 0.f)
    throw_invalid("linear cross-entropy fused exponentials: bfloat16 inputs without soft cap or label smoothing only");
  ExpRowStatsArguments a;
  a.rows = logit_rows(p);
  a.partials = p.partials;
  a.shift = p.shift;
  a.e = p.dlogits;
  a.ld_e = p.ld_dlogits;
  a.row_partials = p.row_partials;
  a.on_shift = logitless::debug::hook(logitless::debug::Hook::kLceExpOnShift) != 0;
  if (p.row_partials)
    launch_either_schedule<bf16, EpilogueExpRowStats<bf16>>(p, a, sm_count, stream);
  else
    launch_either_schedule<bf16, EpilogueExp<bf16>>(p, a, sm_count, stream);
}

#else  // built without CUTLASS: the generic path serves every device

bool debug::fused_kernels_built() { return false; }
bool fused_gemm_supported(int, DType, const void*, int64_t, const void*, int64_t, int64_t) { return false; }
void launch_fused_stats(const FusedGemmParams&, int, cudaStream_t) {
  throw_runtime("linear cross-entropy: the fused Hopper kernels were not built (no CUTLASS headers)");
}
void launch_fused_grad(const FusedGemmParams&, int, cudaStream_t) {
  throw_runtime("linear cross-entropy: the fused Hopper kernels were not built (no CUTLASS headers)");
}
void launch_fused_exp(const FusedGemmParams&, int, cudaStream_t) {
  throw_runtime("linear cross-entropy: the fused Hopper kernels were not built (no CUTLASS headers)");
}
void debug::launch_fused_mainloop(const FusedGemmParams&, int, cudaStream_t) {
  throw_runtime("linear cross-entropy: the fused Hopper kernels were not built (no CUTLASS headers)");
}

#endif

}  // namespace logitless::lce
