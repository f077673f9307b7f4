// The Hopper logits GEMM's ping-pong schedule: PingPongGemm<Mainloop<T, kWarpgroupRows>, Epilogue, Scheduler>. The
// work units and tiles are the cooperative kernel's (kernel.cuh), but a tile's two 64-row halves are computed one
// after the other, each by its consumer warpgroup alone: the producer streams the k loop of rows 0..63 (for
// warpgroup 0), then that of rows 64..127 (warpgroup 1), B with each, and the warpgroups take turns at the tensor
// cores, so that one's epilogue runs while the other's WGMMAs do. B goes through L2 twice per tile, and a stage
// holds 64 rows of A instead of 128.
//
// The turns: an ordered sequence barrier in shared memory (mbarriers: no named barrier id, so none shared with the
// epilogue's, TileStore::kBarrier + warpgroup). A warpgroup waits for its turn before its first WGMMA of a tile and
// gives the turn away once it has issued its last, before it waits for them and runs the epilogue. Both warpgroups
// take part in every work unit of the CTA, so they take as many turns, odd counts of units included; the last turn
// warpgroup 1 gives away is never taken, which leaves an mbarrier phase open at exit and nothing waiting on it.
//
// The ring: each stage has one reading warpgroup per CTA; a warpgroup's read and release positions skip the other
// warpgroup's k_tiles stages of every tile (warpgroup 1 starts past warpgroup 0's first ones).
#pragma once

#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "linear_cross_entropy/cuda/hopper/kernel_common.cuh"

namespace logitless::lce::hopper {

template <class MainloopT, class EpilogueT, class SchedulerT>
struct PingPongGemm : GemmParts<MainloopT, EpilogueT, SchedulerT> {
  using Parts = GemmParts<MainloopT, EpilogueT, SchedulerT>;
  using typename Parts::Epilogue;
  using typename Parts::Mainloop;
  using typename Parts::Params;
  using typename Parts::Pipeline;
  using typename Parts::PipelineState;
  using typename Parts::Scheduler;
  static constexpr int kWarpgroups = kConsumerThreads / 128;
  static_assert(Mainloop::kRowsA == kWarpgroupRows && Mainloop::kSplits == kWarpgroups,
                "a stage holds one consumer warpgroup's rows of the tile");
  // One turn per warpgroup in a row: a sequence of depth 1 suffices, since neither can take two turns in a row.
  using OrderBarrier = cutlass::OrderedSequenceBarrier<1, kWarpgroups>;

  struct SharedStorage {
    typename Mainloop::SharedStorage mainloop;
    typename Epilogue::SharedStorage epilogue;
    typename Pipeline::SharedStorage pipeline;
    typename OrderBarrier::SharedStorage order;
  };
  static constexpr size_t kSmemBytes = sizeof(SharedStorage) + Parts::kSmemAlignSlack;
  static_assert(kSmemBytes <= kSmemOptIn, "the ring and the epilogue's buffers exceed the shared memory opt-in");

  __device__ __forceinline__ static void run(const Params& params, char* smem_raw) {
    auto& smem = Parts::template aligned_storage<SharedStorage>(smem_raw);
    const int wg = threadIdx.x / 128;
    const int rank = static_cast<int>(cute::block_rank_in_cluster());
    Pipeline pipeline = Mainloop::make_pipeline(smem.pipeline, wg == 0);
    // Every thread constructs it (warp 0 initializes the barriers); the producer's group is never used.
    const int wgl = wg > 0 ? wg - 1 : 0;
    OrderBarrier order(smem.order, typename OrderBarrier::Params{static_cast<uint32_t>(wgl), 128u});
    cute::cluster_sync();  // the peer's barriers are initialized before anything multicasts into them
    if (wg == 0) {
      Parts::produce(params, pipeline, smem.mainloop, rank);
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
      consume(params, pipeline, order, smem, rank, wgl, static_cast<int>(threadIdx.x) & 127);
    }
    Parts::leave_cluster();
  }

 private:
  // wgl: the consumer warpgroup, tw: the thread in it.
  __device__ __forceinline__ static void consume(const Params& params, Pipeline& pipeline, OrderBarrier& order,
                                                 SharedStorage& smem, int rank, int wgl, int tw) {
    auto acc = Mainloop::make_accumulators();
    const auto k_tiles = static_cast<uint32_t>(params.mainloop.k_tiles);
    PipelineState next;  // the first stage of this warpgroup's next part: read and release meet there
    next.advance(wgl * k_tiles);
    for (int u = Scheduler::first_unit(); u < params.scheduler.pairs; u += Scheduler::unit_stride()) {
      const auto tile = Scheduler::tile(params.scheduler, u, rank);
      PipelineState read = next, release = next;
      order.wait();
      Mainloop::mma(params.mainloop, pipeline, read, release, smem.mainloop, acc, tw);
      order.arrive();  // every WGMMA of this part issued: the other warpgroup's turn
      const auto crd = Mainloop::accumulator_coords(Parts::per_tile(128 * wgl + tw));  // rows 64 wgl .. of the tile
      const TileAt at = Parts::tile_at(tile.mt, tile.nt);
      const auto rows = Epilogue::load_rows(params.epilogue, crd, at.m0);  // while the last WGMMAs run
      Mainloop::mma_tail(pipeline, release, acc);
      next.advance(kWarpgroups * k_tiles);
      Epilogue::apply(params.epilogue, rows, acc, crd, at, smem.epilogue, wgl, tw);
    }
    Epilogue::drain(tw);
  }
};

}  // namespace logitless::lce::hopper
