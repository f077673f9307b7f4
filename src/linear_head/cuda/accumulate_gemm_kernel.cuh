// The Hopper accumulating grad_weight product (accumulate_gemm.h), built from CUTLASS's collective builders, as a
// template over its configuration: m = vocabulary rows of dW, n = hidden size, k = tokens. A (dZᵀ) is m-contiguous
// (column-major [m, k]) and B (x) n-contiguous: both reach the tensor cores through transposed shared-memory
// layouts, as 16-bit operands may. Each variant of plan.h's AccumulateGemmConfig is instantiated in a translation
// unit of its own (accumulate_gemm_v<N>.cu: they compile slowly, and apart they compile in parallel); the table of
// variants below is the one place that says what each number builds.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "linear_head/cuda/accumulate_gemm_variants.h"

namespace logitless::head::accumulate {

using cute::_1, cute::_2, cute::_64, cute::_128, cute::_256, cute::Shape;

template <class Tile, class Cluster, class KernelSchedule, class EpilogueSchedule>
struct Variant {
  using TileShape = Tile;
  using ClusterShape = Cluster;
  using Kernel = KernelSchedule;
  using Epilogue = EpilogueSchedule;
};
using PingPong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingPongEpilogue = cutlass::epilogue::TmaWarpSpecialized;
using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CooperativeEpilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;

// The variants, by number (plan.h documents them for the hook's users).
template <int N>
struct VariantOf;
template <>
struct VariantOf<1> : Variant<Shape<_128, _128, _64>, Shape<_2, _1, _1>, PingPong, PingPongEpilogue> {};
template <>
struct VariantOf<2> : Variant<Shape<_256, _128, _64>, Shape<_2, _1, _1>, Cooperative, CooperativeEpilogue> {};
template <>
struct VariantOf<3> : Variant<Shape<_128, _256, _64>, Shape<_1, _2, _1>, Cooperative, CooperativeEpilogue> {};
template <>
struct VariantOf<4> : Variant<Shape<_128, _128, _64>, Shape<_1, _1, _1>, PingPong, PingPongEpilogue> {};
// Variant 1's cluster, so that the two differ in the tile alone.
template <>
struct VariantOf<5> : Variant<Shape<_64, _256, _64>, Shape<_2, _1, _1>, PingPong, PingPongEpilogue> {};

using Element = cutlass::bfloat16_t;

// The kernel of a variant: D (float32, row-major) = A B + C with C = D, A column-major and B row-major bfloat16.
template <class V>
struct GemmOf {
  using EpilogueOp = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename V::TileShape, typename V::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, cutlass::layout::RowMajor, kAlign32, float,
      cutlass::layout::RowMajor, kAlign32, typename V::Epilogue>::CollectiveOp;
  // The mainloop's pipeline gets the shared memory the epilogue leaves.
  using StageCount =
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename EpilogueOp::SharedStorage))>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::ColumnMajor, kAlign16, Element,
      cutlass::layout::RowMajor, kAlign16, float, typename V::TileShape, typename V::ClusterShape, StageCount,
      typename V::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, EpilogueOp>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Gemm>
typename Gemm::Arguments arguments(const AccumulateGemm& g, const AccumulateGemmConfig& config, int device,
                                   int sm_count) {
  using Kernel = typename Gemm::GemmKernel;
  const auto M = static_cast<int>(g.m), N = static_cast<int>(g.n), K = static_cast<int>(g.k);
  typename Kernel::StrideA sa{};
  typename Kernel::StrideB sb{};
  typename Kernel::StrideC sc{};
  // A (m, k): m-contiguous, k steps lda. B (n, k): n-contiguous, k steps ldb. C and D (m, n): row-major.
  cute::get<1>(sa) = g.lda;
  cute::get<1>(sb) = g.ldb;
  cute::get<0>(sc) = g.ldd;
  cutlass::KernelHardwareInfo hw{device, sm_count};
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {M, N, K, 1},
                                {static_cast<const Element*>(g.a), sa, static_cast<const Element*>(g.b), sb},
                                {{1.f, 1.f}, g.d, sc, g.d, sc},
                                hw};
  args.scheduler.raster_order = static_cast<decltype(args.scheduler.raster_order)>(config.raster);
  args.scheduler.max_swizzle_size = 1 << config.log2_swizzle;
  return args;
}

// Variant N's product; false, having done nothing, where CUTLASS cannot implement it (the caller runs cuBLAS). The
// caller has checked the device, the dtype and what the TMA descriptors take (accumulate_gemm.cu).
template <int N>
bool run(const AccumulateGemm& g, const AccumulateGemmConfig& config, int device, int sm_count, cudaStream_t stream) {
  using Gemm = typename GemmOf<VariantOf<N>>::Adapter;
  const typename Gemm::Arguments args = arguments<Gemm>(g, config, device, sm_count);
  // The persistent scheduler needs no workspace; none is passed.
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess || Gemm::get_workspace_size(args) != 0) return false;
  Gemm gemm;
  if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return false;
  return gemm.run(stream) == cutlass::Status::kSuccess;
}

}  // namespace logitless::head::accumulate
