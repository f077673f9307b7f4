// The Hopper accumulating grad_weight product (accumulate_gemm.h): which of accumulate_gemm_kernel.cuh's
// configurations the library runs, and the checks before it.
#include "linear_head/cuda/accumulate_gemm.h"

#include "common/cuda/check.cuh"
#include "common/debug_hooks.h"

#if defined(LOGITLESS_WITH_CUTLASS)
#include "linear_head/cuda/accumulate_gemm_kernel.cuh"
#endif

namespace logitless::head {

#if defined(LOGITLESS_WITH_CUTLASS)
namespace {

using Chosen =
    accumulate::Config<cute::Shape<cute::_128, cute::_128, cute::_64>, cute::Shape<cute::_2, cute::_1, cute::_1>,
                       /*cooperative=*/false, accumulate::Staging::kAuto>;
// The accumulator tail's rows (a third of the vocabulary at most): the same tiles on a 1 x 2 cluster, which shares
// A (dZ, read from DRAM) between the two CTAs instead of B: faster for these rows than the head's 2 x 1
// (bench/RESULTS.md, fourteenth session).
using ForTail =
    accumulate::Config<cute::Shape<cute::_128, cute::_128, cute::_64>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                       /*cooperative=*/false, accumulate::Staging::kAuto>;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// What the TMA descriptors take: 16-byte aligned bases, row strides and contiguous extents (the library checks them
// itself rather than leaving a bad one to the descriptor's encoding).
bool tma_ready(const AccumulateGemm& g) {
  constexpr int kAlign16 = 8, kAlign32 = 4;  // elements of 16 bytes: bfloat16, float
  return g.a && g.b && g.d && aligned16(g.a) && aligned16(g.b) && aligned16(g.d) && g.lda % kAlign16 == 0 &&
         g.ldb % kAlign16 == 0 && g.ldd % kAlign32 == 0 && g.m % kAlign16 == 0 && g.n % kAlign16 == 0 && g.lda >= g.m &&
         g.ldb >= g.n && g.ldd >= g.n && (!g.out || (aligned16(g.out) && g.ldo % kAlign16 == 0 && g.ldo >= g.n));
}

}  // namespace
#endif

bool launch_accumulate_gemm(const AccumulateGemm& g, int device, int sm_count, cudaStream_t stream) {
#if defined(LOGITLESS_WITH_CUTLASS)
  const DeviceInfo& info = device_info(device);
  if (info.sm_major != 9 || info.sm_minor != 0 || g.dtype != DType::kBFloat16) return false;
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.m > INT32_MAX || g.n > INT32_MAX || g.k > INT32_MAX) return false;
  if (g.k >= kCublasAccumulatesFrom && !g.any_k && !(g.out && g.k <= kWritesOutUpTo)) return false;
  if (!tma_ready(g)) return false;
  if (g.tail && debug::hook(debug::Hook::kHeadAccumulateGemm) != 3)
    return accumulate::run<ForTail>(g, /*beta=*/1.f, device, sm_count, stream);
  return accumulate::run<Chosen>(g, /*beta=*/1.f, device, sm_count, stream);
#else
  (void)g, (void)device, (void)sm_count, (void)stream;
  return false;
#endif
}

}  // namespace logitless::head
