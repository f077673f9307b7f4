// The Hopper logits GEMM's cooperative schedule: FusedGemm<Mainloop, Epilogue, Scheduler>. Both consumer warpgroups
// run their WGMMAs on every stage of a tile (64 rows each of one Mainloop<T> stage of 128), then both run the
// epilogue on their rows while the producer loads the next tile's first stages; the tensor cores wait for the
// epilogue. kernel_common.cuh has what the schedules share (the producer, the kernel entry, the launch) and what an
// epilogue provides.
#pragma once

#include "linear_cross_entropy/cuda/hopper/kernel_common.cuh"

namespace logitless::lce::hopper {

template <class MainloopT, class EpilogueT, class SchedulerT>
struct FusedGemm : GemmParts<MainloopT, EpilogueT, SchedulerT> {
  using Parts = GemmParts<MainloopT, EpilogueT, SchedulerT>;
  using typename Parts::Epilogue;
  using typename Parts::Mainloop;
  using typename Parts::Params;
  using typename Parts::Pipeline;
  using typename Parts::PipelineState;
  using typename Parts::Scheduler;
  static_assert(Mainloop::kRowsA == kBM, "both consumer warpgroups read every stage");

  struct SharedStorage {
    typename Mainloop::SharedStorage mainloop;
    typename Epilogue::SharedStorage epilogue;
    typename Pipeline::SharedStorage pipeline;
  };
  static constexpr size_t kSmemBytes = sizeof(SharedStorage) + Parts::kSmemAlignSlack;

  __device__ __forceinline__ static void run(const Params& params, char* smem_raw) {
    auto& smem = Parts::template aligned_storage<SharedStorage>(smem_raw);
    const int wg = threadIdx.x / 128;
    const int rank = static_cast<int>(cute::block_rank_in_cluster());
    Pipeline pipeline = Mainloop::make_pipeline(smem.pipeline, wg == 0);
    cute::cluster_sync();  // the peer's barriers are initialized before anything multicasts into them
    if (wg == 0) {
      Parts::produce(params, pipeline, smem.mainloop, rank);
    } else {
      cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
      consume(params, pipeline, smem, rank, static_cast<int>(threadIdx.x) - 128);
    }
    Parts::leave_cluster();
  }

 private:
  // ct: the thread among the consumers' 256.
  __device__ __forceinline__ static void consume(const Params& params, Pipeline& pipeline, SharedStorage& smem,
                                                 int rank, int ct) {
    auto acc = Mainloop::make_accumulators();
    const auto crd = Mainloop::accumulator_coords(ct);
    const int wgl = ct / 128, tw = ct & 127;
    PipelineState read, release;
    for (int u = Scheduler::first_unit(); u < params.scheduler.pairs; u += Scheduler::unit_stride()) {
      const auto tile = Scheduler::tile(params.scheduler, u, rank);
      const TileAt at = Parts::tile_at(tile.mt, tile.nt);
      // The row data first: its loads land during the tile's k loop, not in the epilogue's path.
      const auto rows = Epilogue::load_rows(params.epilogue, crd, at.m0);
      Mainloop::mma(params.mainloop, pipeline, read, release, smem.mainloop, acc, ct);
      Mainloop::mma_tail(pipeline, release, acc);
      Epilogue::apply(params.epilogue, rows, acc, crd, at, smem.epilogue, wgl, tw);
    }
    Epilogue::drain(tw);
  }
};

}  // namespace logitless::lce::hopper
