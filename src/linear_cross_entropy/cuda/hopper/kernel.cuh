// The Hopper logits GEMM as a composition: FusedGemm<Mainloop, Epilogue, Scheduler>. One persistent CTA per SM,
// three warpgroups: the first's first thread runs the mainloop's loads over the scheduler's tiles; the other two run
// its WGMMAs on the same tiles, then hand each tile's float32 accumulators to the epilogue.
//
// An epilogue is a type with
//   Arguments, Params, to_underlying_arguments (host: Arguments -> Params),
//   SharedStorage (its part of the CTA's shared memory),
//   Rows and load_rows(params, coords, m0): per-thread row data, loaded while the tile's last WGMMAs run,
//   apply(params, rows, acc, coords, TileAt, storage, consumer warpgroup, thread in it): the tile's work,
//   drain(thread in warpgroup): what must finish before the CTA leaves (its pending stores).
// A new fused loss is a new epilogue file and an instantiation in kernels_hopper.cu.
#pragma once

#include <cutlass/arch/reg_reconfig.h>
#include <cute/tensor.hpp>
#include <cutlass/cluster_launch.hpp>

#include <algorithm>
#include <cstdint>

#include "common/cuda/check.cuh"
#include "common/cuda/launch_cache.h"
#include "linear_cross_entropy/cuda/hopper/epilogue_rows.cuh"  // TileAt
#include "linear_cross_entropy/cuda/hopper/mainloop.cuh"

namespace logitless::lce::hopper {

template <class MainloopT, class EpilogueT, class SchedulerT>
struct FusedGemm {
  using Mainloop = MainloopT;
  using Epilogue = EpilogueT;
  using Scheduler = SchedulerT;
  using Pipeline = typename Mainloop::Pipeline;
  using PipelineState = typename Mainloop::PipelineState;

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename Scheduler::Params scheduler;
  };

  struct SharedStorage {
    typename Mainloop::SharedStorage mainloop;
    typename Epilogue::SharedStorage epilogue;
    typename Pipeline::SharedStorage pipeline;
  };
  static constexpr size_t kSmemBytes = sizeof(SharedStorage) + 1024;  // + room to align the dynamic base to 1024

  __device__ __forceinline__ static void run(const Params& params, char* smem_raw) {
    auto& smem = *reinterpret_cast<SharedStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
    const int wg = threadIdx.x / 128;
    const int rank = static_cast<int>(cute::block_rank_in_cluster());
    Pipeline pipeline = Mainloop::make_pipeline(smem.pipeline, wg == 0);
    cute::cluster_sync();  // the peer's barriers are initialized before anything multicasts into them
    if (wg == 0) {
      cutlass::arch::warpgroup_reg_dealloc<40>();
      if (threadIdx.x == 0) produce(params, pipeline, smem, rank);
    } else {
      cutlass::arch::warpgroup_reg_alloc<232>();
      consume(params, pipeline, smem, rank, static_cast<int>(threadIdx.x) - 128);
    }
    // Neither CTA leaves while its peer may still multicast into its shared memory or arrive on its barriers.
    __syncwarp();
    cute::cluster_sync();
  }

 private:
  __device__ __forceinline__ static void produce(const Params& params, Pipeline& pipeline, SharedStorage& smem,
                                                 int rank) {
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    for (int u = Scheduler::first_unit(); u < params.scheduler.pairs; u += Scheduler::unit_stride()) {
      const auto tile = Scheduler::tile(params.scheduler, u, rank);
      Mainloop::load(params.mainloop, pipeline, write, smem.mainloop, tile.mt, tile.nt, rank);
    }
  }

  // ct: the thread among the consumers' 256.
  __device__ __forceinline__ static void consume(const Params& params, Pipeline& pipeline, SharedStorage& smem,
                                                 int rank, int ct) {
    auto acc = Mainloop::make_accumulators();
    const auto crd = Mainloop::accumulator_coords(ct);
    const int wgl = ct / 128, tw = ct & 127;
    PipelineState read, release;
    for (int u = Scheduler::first_unit(); u < params.scheduler.pairs; u += Scheduler::unit_stride()) {
      const auto tile = Scheduler::tile(params.scheduler, u, rank);
      Mainloop::mma(params.mainloop, pipeline, read, release, smem.mainloop, acc, ct);
      const TileAt at{tile.mt, tile.nt, static_cast<int64_t>(tile.mt) * kBM, static_cast<int64_t>(tile.nt) * kBN};
      const auto rows = Epilogue::load_rows(params.epilogue, crd, at.m0);  // while the last WGMMAs run
      Mainloop::mma_tail(pipeline, release, acc);
      Epilogue::apply(params.epilogue, rows, acc, crd, at, smem.epilogue, wgl, tw);
    }
    Epilogue::drain(tw);
  }
};

template <class Kernel>
__global__ void __launch_bounds__(kThreads, 1) fused_kernel(const __grid_constant__ typename Kernel::Params params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  Kernel::run(params, smem_raw);
#endif
}

// How many clusters of the kernel fit at once (the GPCs may not pair every SM). The shared-memory opt-in and that
// count come from the process-wide launch cache: asked of the runtime once per kernel and device.
template <class Kernel>
int resident_clusters(cudaLaunchConfig_t query, int sm_count) {
  const void* kernel = reinterpret_cast<const void*>(&fused_kernel<Kernel>);
  LOGITLESS_CUDA_CHECK(launch_cache::reserve_dynamic_smem(kernel, Kernel::kSmemBytes));
  query.gridDim = dim3(static_cast<unsigned>(kCluster * std::max(1, sm_count / kCluster)));
  const int resident = launch_cache::max_active_clusters(kernel, query);
  return resident >= 1 ? resident : std::max(1, sm_count / kCluster);
}

// As many clusters as fit at once, at most one per work unit.
template <class Kernel>
void launch_fused_gemm(const typename Kernel::Params& params, int sm_count, cudaStream_t stream) {
  // ClusterLauncher::launch would also set the non-portable cluster size attribute on every call (a host API call
  // per launch, and a cluster of two is portable): its configuration is used, the launch done here.
  auto config = cutlass::ClusterLauncher::make_cluster_launch_config(dim3(kCluster), dim3(kCluster, 1, 1),
                                                                     dim3(kThreads), Kernel::kSmemBytes, stream);
  cudaLaunchConfig_t& launch = config.launch_config;
  launch.attrs = config.launch_attribute;  // points into the returned struct: aimed at this copy's
  const int64_t units = Kernel::Scheduler::work_units(params.scheduler);
  launch.gridDim =
      dim3(static_cast<unsigned>(kCluster * std::min<int64_t>(units, resident_clusters<Kernel>(launch, sm_count))));
  LOGITLESS_CUDA_CHECK(cudaLaunchKernelEx(&launch, &fused_kernel<Kernel>, params));
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy fused logits GEMM");
}

}  // namespace logitless::lce::hopper
