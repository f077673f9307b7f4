// The mainloop of the Hopper logits GEMM: Z[mt, nt] = X[mt] · W[nt]ᵀ over k for one [128, 256] output tile, by a
// producer thread issuing TMA loads and consumer warpgroups issuing WGMMAs (float32 accumulators).
//
// A (tokens) and B (classes, [256, 64] tiles) go through a kStages ring of 128-byte-swizzled shared memory. A stage
// holds kRowsA rows of A: the whole tile's 128 for the cooperative kernel (both consumer warpgroups read every
// stage), or one consumer warpgroup's 64 for the ping-pong kernel (a tile's k loop is streamed once per warpgroup,
// its B with it). CTAs run in clusters of two on adjacent token tiles of one class tile: each loads its own A and
// half of B, multicast to both, so a CTA reads 32 KB per 128-row k step from L2 instead of 48. The ring is a
// PipelineTmaAsync: a stage is refilled only once its consumers in both CTAs have released it (its empty barrier
// counts one arrival per reading warpgroup of the cluster), and a consumer warpgroup releases a stage as soon as its
// WGMMAs on it have retired, so the loads of the next tile overlap the epilogue of this one.
#pragma once

#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cstdint>
#include <type_traits>

#include "linear_cross_entropy/cuda/plan.h"  // kFusedTileCols

namespace logitless::lce::hopper {

using namespace cute;

constexpr int kBM = 128, kBN = static_cast<int>(kFusedTileCols), kBK = 64;  // the output tile and its k step
constexpr int kCluster = 2;                       // CTAs per cluster: token tiles sharing one class tile
constexpr int kConsumerThreads = 256;             // two consumer warpgroups, 64 rows of the tile each
constexpr int kThreads = 128 + kConsumerThreads;  // and a producer warpgroup
// The rows of the tile one consumer warpgroup owns, and a WGMMA atom's.
constexpr int kWarpgroupRows = kBM * 128 / kConsumerThreads;

template <typename T>
struct MmaOf;
template <>
struct MmaOf<cutlass::bfloat16_t> {
  using Op = SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
};
template <>
struct MmaOf<cutlass::half_t> {
  using Op = SM90_64x256x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>;
};

// kRowsA: the rows of A in a stage, kBM (every consumer warpgroup reads every stage) or kWarpgroupRows (one reads
// it, computing its rows of the tile alone).
template <typename T, int kRowsA_ = kBM>
struct Mainloop {
  static constexpr int kStages = 4;
  static constexpr int kRowsA = kRowsA_;
  static_assert(kRowsA == kBM || kRowsA == kWarpgroupRows, "a stage holds the tile's rows or one warpgroup's");
  static constexpr int kSplits = kBM / kRowsA;                           // stage sequences per tile: one per A part
  static constexpr int kStageConsumers = kRowsA / kWarpgroupRows * 128;  // consumer threads reading a stage
  using Element = T;
  using SmemLayoutA =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, make_shape(Int<kRowsA>{}, Int<kBK>{}, Int<kStages>{})));
  using SmemLayoutB =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{})));
  // The WGMMAs of a stage: one 64 x 256 atom per warpgroup reading it.
  using TiledMma =
      decltype(make_tiled_mma(typename MmaOf<T>::Op{}, Layout<Shape<Int<kRowsA / kWarpgroupRows>, _1, _1>>{}));
  // The whole tile's WGMMAs, one atom per consumer warpgroup: the accumulator layout the epilogues index by.
  using TileMma = decltype(make_tiled_mma(typename MmaOf<T>::Op{}, Layout<Shape<Int<kBM / kWarpgroupRows>, _1, _1>>{}));
  using ClusterShape = Shape<Int<kCluster>, _1, _1>;
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  // Bytes landing in a CTA's stage: A, our half of B and the peer's.
  static constexpr uint32_t kStageBytes = (kRowsA + kBN) * kBK * sizeof(T);

  // A consumer thread's accumulators: TiledMma's fragment of its warpgroup's kRowsA rows. With one warpgroup per
  // stage that is the one WGMMA atom's fragment, which is also what TileMma gives thread 128 * wg + t of the whole
  // tile (atom wg covers rows 64 wg ..): the same values in the same order, TileMma's coordinates offset by 64 wg
  // rows, which that thread's slice of TileMma carries. So the epilogues take TileMma's coordinates in either
  // schedule. The layouts below (fragment shape, and value -> coordinate offset of a thread's slice) say so.
  using TileShape = Shape<Int<kBM>, Int<kBN>>;
  using PartShape = Shape<Int<kRowsA>, Int<kBN>>;
  static_assert(std::is_same_v<decltype(partition_fragment_C(TiledMma{}, PartShape{}).layout()),
                               decltype(partition_fragment_C(TileMma{}, TileShape{}).layout())>,
                "one accumulator fragment for both schedules");
  static_assert(
      std::is_same_v<decltype(TiledMma{}.get_thread_slice(0).partition_C(make_identity_tensor(PartShape{})).layout()),
                     decltype(TileMma{}.get_thread_slice(0).partition_C(make_identity_tensor(TileShape{})).layout())>,
      "the same coordinates of each accumulator, up to the thread's offset");

  struct SharedStorage {
    alignas(1024) cute::array_aligned<T, kRowsA * kBK * kStages, 1024> a;
    alignas(1024) cute::array_aligned<T, kBN * kBK * kStages, 1024> b;
  };

  struct Arguments {
    const T* x = nullptr;  // [m, k], row stride ldx (elements)
    int64_t ldx = 0;
    const T* w = nullptr;  // [n, k], row stride ldw
    int64_t ldw = 0;
    int m = 0, n = 0, k = 0;
  };

  static auto make_tma_a(const T* x, int m, int k, int64_t ldx) {
    Tensor mA = make_tensor(make_gmem_ptr(x), make_shape(m, k), make_stride(ldx, Int<1>{}));  // (m, k)
    return make_tma_copy(SM90_TMA_LOAD{}, mA, SmemLayoutA{}(_, _, 0));
  }
  static auto make_tma_b(const T* w, int n, int k, int64_t ldw) {
    Tensor mB = make_tensor(make_gmem_ptr(w), make_shape(n, k), make_stride(ldw, Int<1>{}));  // (n, k)
    return make_tma_copy(SM90_TMA_LOAD_MULTICAST{}, mB, SmemLayoutB{}(_, _, 0), Int<kCluster>{});
  }
  using TmaA = decltype(make_tma_a(nullptr, 0, 0, 0));
  using TmaB = decltype(make_tma_b(nullptr, 0, 0, 0));

  struct Params {
    TmaA tma_a;
    TmaB tma_b;
    int m, n, k;
    int k_tiles;
  };

  static Params to_underlying_arguments(const Arguments& a) {
    return {make_tma_a(a.x, a.m, a.k, a.ldx), make_tma_b(a.w, a.n, a.k, a.ldw), a.m, a.n, a.k, (a.k + kBK - 1) / kBK};
  }

  // Every thread of the CTA builds the pipeline (warp 0 initializes its barriers); the caller synchronizes the
  // cluster before any barrier is used. For a 2 x 1 cluster PipelineTmaAsync counts (2 + 1 - 1) x (warpgroups per
  // stage) arrivals on an empty barrier, one per reading warpgroup of either CTA (each sends one to both CTAs): what
  // the multicast of B needs, since the peer writes into this CTA's stage too.
  __device__ __forceinline__ static Pipeline make_pipeline(typename Pipeline::SharedStorage& storage, bool producer) {
    typename Pipeline::Params pp;
    pp.transaction_bytes = kStageBytes;
    pp.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pp.is_leader = threadIdx.x == 0;
    pp.num_consumers = kStageConsumers;
    return Pipeline(storage, pp, ClusterShape{});
  }

  // Producer (one thread): tile (mt, nt) into the ring, its k loop once per part of kRowsA rows of A (B each time).
  // mt may be one past the last token tile when their count is odd, and a part may start past m: TMA fills zeros,
  // and the epilogue stores nothing there.
  __device__ __forceinline__ static void load_tile(const Params& p, Pipeline& pipeline, PipelineState& write,
                                                   SharedStorage& smem, int mt, int nt, int rank) {
    for (int part = 0; part < kSplits; ++part) load(p, pipeline, write, smem, mt * kSplits + part, nt, rank);
  }

  // The k loop of A rows [at * kRowsA, + kRowsA) against class tile nt.
  __device__ __forceinline__ static void load(const Params& p, Pipeline& pipeline, PipelineState& write,
                                              SharedStorage& smem, int at, int nt, int rank) {
    Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), SmemLayoutA{});  // (rows A, BK, stage)
    Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), SmemLayoutB{});  // (BN, BK, stage)
    Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.m, p.k));
    Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.n, p.k));
    Tensor gA = local_tile(mA, make_shape(Int<kRowsA>{}, Int<kBK>{}), make_coord(at, _));  // (rows A, BK, k)
    Tensor gB = local_tile(mB, make_shape(Int<kBN>{}, Int<kBK>{}), make_coord(nt, _));     // (BN, BK, k)
    auto [tAgA, tAsA] = tma_partition(p.tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
    auto [tBgB, tBsB] =
        tma_partition(p.tma_b, rank, Layout<Int<kCluster>>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
    for (int kt = 0; kt < p.k_tiles; ++kt) {
      pipeline.producer_acquire(write);  // waits for the stage to be free, then expects kStageBytes on it
      auto* full = pipeline.producer_get_barrier(write);
      copy(p.tma_a.with(*full), tAgA(_, kt), tAsA(_, write.index()));
      copy(p.tma_b.with(*full, static_cast<uint16_t>((1u << kCluster) - 1)), tBgB(_, kt), tBsB(_, write.index()));
      ++write;
    }
  }

  // The accumulators of a consumer thread, and their (row, column) coordinates in the tile (ct: the thread among
  // the consumers' 256, 128 x its warpgroup + its thread in it).
  __device__ __forceinline__ static auto make_accumulators() { return partition_fragment_C(TiledMma{}, PartShape{}); }
  __device__ __forceinline__ static auto accumulator_coords(int ct) {
    return TileMma{}.get_thread_slice(ct).partition_C(make_identity_tensor(TileShape{}));
  }

  // Consumer: the k loop of one tile (or of its warpgroup's part of it) into acc; mma_thread: the thread among the
  // warpgroups reading a stage. Returns with the last k step's WGMMAs still in flight (the epilogue
  // loads its row data meanwhile); mma_tail waits for them. A stage is released once the WGMMAs of the next one
  // have been issued and its own have retired.
  template <class Acc>
  __device__ __forceinline__ static void mma(const Params& p, Pipeline& pipeline, PipelineState& read,
                                             PipelineState& release, SharedStorage& smem, Acc& acc, int mma_thread) {
    Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), SmemLayoutB{});
    TiledMma tiled_mma;
    auto thr = tiled_mma.get_thread_slice(mma_thread);
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, stage): descriptors
    Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    for (int kt = 0; kt < p.k_tiles; ++kt) {
      pipeline.consumer_wait(read);
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, read.index()), tCrB(_, _, kb, read.index()), acc);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // the previous k step's WGMMAs have retired: its stage is free
      warpgroup_fence_operand(acc);
      if (kt > 0) {
        pipeline.consumer_release(release);
        ++release;
      }
      ++read;
    }
  }

  template <class Acc>
  __device__ __forceinline__ static void mma_tail(Pipeline& pipeline, PipelineState& release, Acc& acc) {
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    pipeline.consumer_release(release);  // k >= 1: every tile has a last stage
    ++release;
  }
};

}  // namespace logitless::lce::hopper
