// The accumulating grad_weight product (accumulate_gemm.h) as a type over its tiling and its epilogue's staging, so
// that the library's choice (accumulate_gemm.cu) and the micro-benchmark's alternatives (bench/cpp) are one code:
// m = vocabulary rows of dW, n = hidden size, k = tokens. A (dZᵀ) is m-contiguous (column-major [m, k]) and B (x)
// n-contiguous: both reach the tensor cores through transposed shared-memory layouts, as 16-bit operands may.
// Requires LOGITLESS_WITH_CUTLASS and a CUDA translation unit.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "linear_head/cuda/accumulate_gemm.h"

namespace logitless::head::accumulate {

// A TMA reduce-add store issued by one lane. CUTLASS's epilogue calls its D store from every lane of one warp: for a
// plain TMA store ptxas issues one instruction per warp, but a reduce-add it must issue once per lane, and each
// would add the tile into D again (bench/RESULTS.md, twelfth session: D came out 32 times the product).
struct TmaReduceAddOneLane {
  template <class... Coords>
  CUTE_HOST_DEVICE static void copy(void const* desc, void const* smem, Coords const&... coords) {
#if defined(__CUDA_ARCH__)
    if ((threadIdx.x & 31) == 0) cute::SM90_TMA_REDUCE_ADD::copy(desc, smem, coords...);
#endif
  }
};

}  // namespace logitless::head::accumulate

namespace cute {
// What cute's TMA construction needs of a store op: its descriptor and coordinate tensor, and the copy itself.
template <class NumBitsPerTMA, class AuxParams_>
struct Copy_Traits<logitless::head::accumulate::TmaReduceAddOneLane, NumBitsPerTMA, AuxParams_> {
  using ThrID = Layout<_1>;
  using SrcLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using DstLayout = Layout<Shape<_1, NumBitsPerTMA>>;
  using RefLayout = SrcLayout;
  using AuxParams = AuxParams_;
  TmaDescriptor tma_desc_;
  AuxParams aux_params_;

  CUTE_HOST_DEVICE constexpr TmaDescriptor const* get_tma_descriptor() const { return &tma_desc_; }
  template <class GShape>
  CUTE_HOST_DEVICE constexpr auto get_tma_tensor(GShape const& g_shape) const {
    return make_coord_tensor(make_layout(g_shape, aux_params_.g_stride_));
  }
  // src: the shared-memory tile; dst: TMA coordinates.
  template <class TS, class SLayout, class TD, class DLayout>
  CUTE_HOST_DEVICE friend constexpr void copy_unpack(Copy_Traits const& traits, Tensor<TS, SLayout> const& src,
                                                     Tensor<TD, DLayout>& dst) {
    static_assert(is_smem<TS>::value, "a TMA store reads shared memory");
    const void* smem = raw_pointer_cast(src.data());
    cute::apply(dst.data().coord_, [&](auto const&... c) {
      logitless::head::accumulate::TmaReduceAddOneLane::copy(&traits.tma_desc_, smem, static_cast<int32_t>(c)...);
    });
  }
};
}  // namespace cute

namespace logitless::head::accumulate {

// How D = αAᵀB + βC is staged through shared memory (C float32, D the same buffer, or bfloat16 apart from it:
// AccumulateGemm::out).
//   kAuto:     CUTLASS's builder: 64 × 32 subtiles for a ping-pong 128 × 128 tile, 4 C buffers that D's stores
//              reuse (a subtile's load then waits for the store that last used its buffer).
//   kSeparate: StagesC buffers for C and StagesD for D, apart (more of C in flight per SM, less for the mainloop).
//   kNoSmem:   C read and D written straight from the accumulator registers.
//   kReduce:   no C at all: the builder's D staging, stored by TMA reduce-add, so that the L2 adds the tile into D
//              and the kernel never waits for D's read. One add per element and product: β = 1's sums, bit for bit.
//              Slower than kAuto where the pass is bound by memory (bench/RESULTS.md, twelfth session).
enum class Staging { kAuto, kSeparate, kNoSmem, kReduce };

template <class TileShape_, class ClusterShape_, bool kCooperative_, Staging kStaging_, class EpiTile_ = void,
          int kStagesC_ = 0, int kStagesD_ = 0>
struct Config {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using EpiTile = EpiTile_;  // void: the builder's
  static constexpr bool kCooperative = kCooperative_;
  static constexpr Staging kStaging = kStaging_;
  static constexpr int kStagesC = kStagesC_, kStagesD = kStagesD_;
  static constexpr bool kPrefetchC = false;
};

// Cfg with its epilogue asking the L2 for each tile's C ahead of its loads (PrefetchingC below).
template <class Cfg>
struct WithPrefetchC : Cfg {
  static constexpr bool kPrefetchC = true;
};

namespace detail {
using RowMajor = cutlass::layout::RowMajor;
constexpr int kAlign16 = 8;  // 16 bytes of bfloat16
constexpr int kAlign32 = 4;  // 16 bytes of float
template <class ElementD>
constexpr int kAlignOf = 16 / static_cast<int>(sizeof(ElementD));
template <class ElementD>
using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, float, float, float>;

template <class Cfg, class ElementD, Staging = Cfg::kStaging>
struct EpilogueOf {  // kAuto, kNoSmem: CUTLASS's builder
  using Schedule =
      cute::conditional_t<Cfg::kStaging == Staging::kNoSmem, cutlass::epilogue::NoSmemWarpSpecialized,
                          cute::conditional_t<Cfg::kCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                              cutlass::epilogue::TmaWarpSpecialized>>;
  using Tile = cute::conditional_t<cute::is_void_v<typename Cfg::EpiTile>,
                                   cutlass::epilogue::collective::EpilogueTileAuto, typename Cfg::EpiTile>;
  using type = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::TileShape, typename Cfg::ClusterShape, Tile,
      float, float, float, RowMajor, kAlign32, ElementD, RowMajor, kAlignOf<ElementD>, Schedule,
      Fusion<ElementD>>::CollectiveOp;
};

// A CollectiveEpilogue with its global store replaced (kReduce: a reduce-add for the builder's TMA store).
template <class Epilogue, class StoreOp>
struct WithStoreOp;
template <class P, class T, class ET, class EC, class SC, class ED, class SD, class F, class G2S, class LC, class S2R,
          class S2G, class LD, class R2S, class AC, class R2R, class StoreOp>
struct WithStoreOp<
    cutlass::epilogue::collective::CollectiveEpilogue<P, T, ET, EC, SC, ED, SD, F, G2S, LC, S2R, S2G, LD, R2S, AC, R2R>,
    StoreOp> {
  using type = cutlass::epilogue::collective::CollectiveEpilogue<P, T, ET, EC, SC, ED, SD, F, G2S, LC, S2R, StoreOp, LD,
                                                                 R2S, AC, R2R>;
};

template <class Cfg, class ElementD>
struct EpilogueOf<Cfg, ElementD, Staging::kReduce> {  // kAuto's schedule and subtiles, no source, reduce-add stores
  static_assert(cute::is_same_v<ElementD, float>, "a reduce-add D is the float32 sums themselves");
  using Auto = EpilogueOf<Cfg, ElementD, Staging::kAuto>;
  using Built = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::TileShape, typename Cfg::ClusterShape,
      typename Auto::Tile, float, float, void, RowMajor, kAlign32, float, RowMajor, kAlign32, typename Auto::Schedule,
      Fusion<float>>::CollectiveOp;
  using type = typename WithStoreOp<Built, TmaReduceAddOneLane>::type;
};

template <class Cfg, class ElementD>
struct EpilogueOf<Cfg, ElementD,
                  Staging::kSeparate> {  // the builder's own assembly with the staging named, not derived
  using Tile = typename Cfg::EpiTile;
  static constexpr int kFragment = int(cute::size(Tile{})) / (Cfg::kCooperative ? 256 : 128);
  using Policy = cutlass::epilogue::Sm90TmaWarpSpecialized<Cfg::kStagesC, Cfg::kStagesD, kFragment,
                                                           /*ReuseSmemC=*/false, /*DelayTmaStore=*/false>;
  using type = typename cutlass::epilogue::collective::detail::Sm90TmaBuilderImpl<
      typename Cfg::TileShape, Tile, float, float, float, RowMajor, kAlign32, ElementD, RowMajor, kAlignOf<ElementD>,
      Fusion<ElementD>, Policy>::CollectiveOp;
};
}  // namespace detail

// An epilogue whose C loads for a tile are preceded by L2 prefetches of the whole tile, issued by the epilogue's load
// warp when it reaches the tile: it loads C one subtile at a time as buffers free up, the later ones during the
// tile's epilogue itself, where each load's DRAM latency would hold the stores behind it. Slower than kAuto at most
// pass shapes, the early reads competing with the pass's own (bench/RESULTS.md, thirteenth session): the
// micro-benchmark's configurations only.
template <class Base>
struct PrefetchingC : Base {
  CUTLASS_HOST_DEVICE PrefetchingC(typename Base::Params const& params, typename Base::TensorStorage& shared)
      : Base(params, shared), params_(params) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class TiledMma>
  CUTLASS_DEVICE auto load(typename Base::LoadPipeline pipeline, typename Base::LoadPipelineState state,
                           ProblemShapeMNKL problem, TileShapeMNK tile_shape, TileCoordMNKL tile, TiledMma tiled_mma,
                           int thread_idx, typename Base::TensorStorage& shared, int subtile = -1) {
    if (subtile == -1 && cute::elect_one_sync()) prefetch_tile(problem, tile);
    return Base::load(pipeline, state, problem, tile_shape, tile, tiled_mma, thread_idx, shared, subtile);
  }

 private:
  template <class ProblemShapeMNKL, class TileCoordMNKL>
  CUTLASS_DEVICE void prefetch_tile(ProblemShapeMNKL problem, TileCoordMNKL tile) const {
    using namespace cute;
    using CtaTile = decltype(take<0, 2>(typename Base::CtaTileMNK{}));
    auto [M, N, K, L] = problem;
    auto [m, n, k, l] = tile;
    Tensor mC = coalesce(params_.tma_load_c.get_tma_tensor(make_shape(M, N, L)), CtaTile{});
    Tensor gC = flat_divide(local_tile(mC, CtaTile{}, make_coord(m, n, l)), typename Base::EpilogueTile{});
    Tensor src = params_.tma_load_c.get_slice(Int<0>{}).partition_S(gC);  // (box, 1, 1, subtiles m, subtiles n)
    CUTE_UNROLL
    for (int sn = 0; sn < size<4>(src); ++sn) {
      CUTE_UNROLL
      for (int sm = 0; sm < size<3>(src); ++sm) prefetch(params_.tma_load_c, src(_, _, _, sm, sn));
    }
  }
  typename Base::Params const& params_;
};

// ElementD float: D is C, the sums in place. bfloat16: D is AccumulateGemm::out, C only read.
template <class Cfg, class ElementD_ = float>
struct Kernel {
  using Element = cutlass::bfloat16_t;
  using ElementD = ElementD_;
  using TileShape = typename Cfg::TileShape;
  using ClusterShape = typename Cfg::ClusterShape;
  using MainSchedule = cute::conditional_t<Cfg::kCooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                           cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using Built = typename detail::EpilogueOf<Cfg, ElementD>::type;
  using Epilogue = cute::conditional_t<Cfg::kPrefetchC, PrefetchingC<Built>, Built>;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::ColumnMajor, detail::kAlign16,
      Element, detail::RowMajor, detail::kAlign16, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  static typename Gemm::Arguments arguments(const AccumulateGemm& g, float beta, int device, int sm_count) {
    typename GemmKernel::StrideA sa{};
    typename GemmKernel::StrideB sb{};
    typename GemmKernel::StrideC sc{};
    typename GemmKernel::StrideD sd{};
    // A (m, k): m-contiguous, k steps lda. B (n, k): n-contiguous, k steps ldb. C and D (m, n): row-major.
    cute::get<1>(sa) = g.lda;
    cute::get<1>(sb) = g.ldb;
    cute::get<0>(sc) = g.ldd;
    constexpr bool kInPlace = cute::is_same_v<ElementD, float>;
    cute::get<0>(sd) = kInPlace ? g.ldd : g.ldo;
    cutlass::KernelHardwareInfo hw{device, sm_count};
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k), 1},
                                  {static_cast<const Element*>(g.a), sa, static_cast<const Element*>(g.b), sb},
                                  {},
                                  hw};
    args.epilogue.ptr_D = static_cast<ElementD*>(kInPlace ? static_cast<void*>(g.d) : g.out);
    args.epilogue.dD = sd;
    args.epilogue.dC = sc;
    if constexpr (Cfg::kStaging == Staging::kReduce) {
      args.epilogue.thread = {1.f, 0.f};  // no C: D's own adds do what β = 1 does
    } else {
      args.epilogue.thread = {1.f, beta};
      args.epilogue.ptr_C = g.d;
    }
    return args;
  }

  // d = aᵀb + beta·d, or out = aᵀb + beta·d (beta 1 in the library; 0 lets a benchmark time the product without
  // reading C, and zeroes d first for kReduce). False, having done nothing, where CUTLASS cannot run it.
  static bool run(const AccumulateGemm& g, float beta, int device, int sm_count, cudaStream_t stream) {
    const typename Gemm::Arguments args = arguments(g, beta, device, sm_count);
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess || Gemm::get_workspace_size(args) != 0) return false;
    if (Cfg::kStaging == Staging::kReduce && beta == 0.f &&
        cudaMemset2DAsync(g.d, g.ldd * sizeof(float), 0, g.n * sizeof(float), g.m, stream) != cudaSuccess)
      return false;
    Gemm gemm;
    if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return false;
    return gemm.run(stream) == cutlass::Status::kSuccess;
  }
};

// Cfg's kernel for g: the sums in place, or into g.out (bfloat16) where it is set. False as Kernel::run.
template <class Cfg>
bool run(const AccumulateGemm& g, float beta, int device, int sm_count, cudaStream_t stream) {
  if (!g.out) return Kernel<Cfg>::run(g, beta, device, sm_count, stream);
  if constexpr (Cfg::kStaging == Staging::kReduce) {
    return false;  // its D is the float32 sums
  } else {
    return Kernel<Cfg, cutlass::bfloat16_t>::run(g, beta, device, sm_count, stream);
  }
}

}  // namespace logitless::head::accumulate
