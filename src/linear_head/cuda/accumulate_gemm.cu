// The Hopper accumulating grad_weight product (accumulate_gemm.h), built from CUTLASS's collective builders:
// m = vocabulary rows of dW, n = hidden size, k = tokens. A (dZᵀ) is m-contiguous (column-major [m, k]) and B
// (x) n-contiguous: both reach the tensor cores through transposed shared-memory layouts, as 16-bit operands may.
#include "linear_head/cuda/accumulate_gemm.h"

#include "common/cuda/check.cuh"

#if defined(LOGITLESS_WITH_CUTLASS)
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#endif

namespace logitless::head {

#if defined(LOGITLESS_WITH_CUTLASS)
namespace {

using namespace cute;

using Element = cutlass::bfloat16_t;
using TileShape = Shape<_128, _128, _64>;
using ClusterShape = Shape<_2, _1, _1>;
constexpr int kAlign16 = 8;  // 16 bytes of bfloat16
constexpr int kAlign32 = 4;  // 16 bytes of float

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, cutlass::layout::RowMajor, kAlign32, float,
    cutlass::layout::RowMajor, kAlign32, cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::ColumnMajor, kAlign16, Element,
    cutlass::layout::RowMajor, kAlign16, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// What the TMA descriptors take: 16-byte aligned bases, row strides and contiguous extents (the library checks them
// itself rather than leaving a bad one to the descriptor's encoding).
bool tma_ready(const AccumulateGemm& g) {
  return g.a && g.b && g.d && aligned16(g.a) && aligned16(g.b) && aligned16(g.d) && g.lda % kAlign16 == 0 &&
         g.ldb % kAlign16 == 0 && g.ldd % kAlign32 == 0 && g.m % kAlign16 == 0 && g.n % kAlign16 == 0 && g.lda >= g.m &&
         g.ldb >= g.n && g.ldd >= g.n;
}

typename Gemm::Arguments arguments(const AccumulateGemm& g, int device, int sm_count) {
  const auto M = static_cast<int>(g.m), N = static_cast<int>(g.n), K = static_cast<int>(g.k);
  typename Kernel::StrideA sa{};
  typename Kernel::StrideB sb{};
  typename Kernel::StrideC sc{};
  // A (m, k): m-contiguous, k steps lda. B (n, k): n-contiguous, k steps ldb. C and D (m, n): row-major.
  get<1>(sa) = g.lda;
  get<1>(sb) = g.ldb;
  get<0>(sc) = g.ldd;
  cutlass::KernelHardwareInfo hw{device, sm_count};
  return typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {M, N, K, 1},
                                  {static_cast<const Element*>(g.a), sa, static_cast<const Element*>(g.b), sb},
                                  {{1.f, 1.f}, g.d, sc, g.d, sc},
                                  hw};
}

}  // namespace
#endif

bool launch_accumulate_gemm(const AccumulateGemm& g, int device, int sm_count, cudaStream_t stream) {
#if defined(LOGITLESS_WITH_CUTLASS)
  const DeviceInfo& info = device_info(device);
  if (info.sm_major != 9 || info.sm_minor != 0 || g.dtype != DType::kBFloat16) return false;
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.m > INT32_MAX || g.n > INT32_MAX || g.k > INT32_MAX) return false;
  if (!tma_ready(g)) return false;
  const typename Gemm::Arguments args = arguments(g, device, sm_count);
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess || Gemm::get_workspace_size(args) != 0) return false;
  Gemm gemm;
  if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return false;
  return gemm.run(stream) == cutlass::Status::kSuccess;
#else
  (void)g, (void)device, (void)sm_count, (void)stream;
  return false;
#endif
}

}  // namespace logitless::head
