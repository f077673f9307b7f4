// The Hopper accumulating grad_weight product (accumulate_gemm.h): the checks every configuration shares, then the
// variant the configuration names (accumulate_gemm_kernel.cuh builds them, one translation unit each).
#include "linear_head/cuda/accumulate_gemm.h"

#include "common/cuda/check.cuh"
#include "linear_head/cuda/accumulate_gemm_variants.h"

namespace logitless::head {

#if defined(LOGITLESS_WITH_CUTLASS)
namespace {

using accumulate::kAlign16;
using accumulate::kAlign32;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// What the TMA descriptors take: 16-byte aligned bases, row strides and contiguous extents (the library checks them
// itself rather than leaving a bad one to the descriptor's encoding).
bool tma_ready(const AccumulateGemm& g) {
  return aligned16(g.a) && aligned16(g.b) && aligned16(g.d) && g.lda % kAlign16 == 0 && g.ldb % kAlign16 == 0 &&
         g.ldd % kAlign32 == 0 && g.m % kAlign16 == 0 && g.n % kAlign16 == 0 && g.lda >= g.m && g.ldb >= g.n &&
         g.ldd >= g.n;
}

// The variants by number, less one.
using Run = bool (*)(const AccumulateGemm&, const AccumulateGemmConfig&, int, int, cudaStream_t);
constexpr Run kVariants[] = {accumulate::run<1>, accumulate::run<2>, accumulate::run<3>, accumulate::run<4>,
                             accumulate::run<5>};
static_assert(sizeof(kVariants) / sizeof(kVariants[0]) == kAccumulateGemmVariants, "one entry per variant");

}  // namespace
#endif

bool launch_accumulate_gemm(const AccumulateGemm& g, const AccumulateGemmConfig& config, int device, int sm_count,
                            cudaStream_t stream) {
#if defined(LOGITLESS_WITH_CUTLASS)
  if (config.variant < 1 || config.variant > kAccumulateGemmVariants) return false;
  const DeviceInfo& info = device_info(device);
  if (info.sm_major != 9 || info.sm_minor != 0 || g.dtype != DType::kBFloat16) return false;
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.m > INT32_MAX || g.n > INT32_MAX || g.k > INT32_MAX) return false;
  if (!tma_ready(g)) return false;
  return kVariants[config.variant - 1](g, config, device, sm_count, stream);
#else
  (void)g, (void)config, (void)device, (void)sm_count, (void)stream;
  return false;
#endif
}

}  // namespace logitless::head
