// What the schedules of the Hopper logits GEMM share (kernel.cuh: cooperative, kernel_pingpong.cuh: ping-pong). A
// kernel is a type with Mainloop, Epilogue, Scheduler, Params (GemmParts') and kSmemBytes, and a static
// run(params, shared memory) that the one kernel entry below calls: one persistent CTA per SM in clusters of
// kCluster, three warpgroups, the first's first thread running the mainloop's loads over the scheduler's tiles, the
// other two its WGMMAs and the epilogue.
//
// An epilogue is a type with
//   Arguments, Params, to_underlying_arguments (host: Arguments -> Params),
//   SharedStorage (its part of the CTA's shared memory),
//   Rows and load_rows(params, coords, m0): per-thread row data, loaded before the tile's k loop (cooperative) or
//     while its last WGMMAs run (ping-pong), so that the loads land before the epilogue needs them,
//   apply(params, rows, acc, coords, TileAt, storage, consumer warpgroup, thread in it): the work on one consumer
//     warpgroup's 64 rows of the tile (coords: Mainloop::accumulator_coords, rows of the whole tile),
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

constexpr size_t kSmemOptIn = 227 * 1024;  // the most dynamic shared memory a CTA of an sm_90 device may opt in to
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;  // per thread, after the warpgroups' reallocation

template <class MainloopT, class EpilogueT, class SchedulerT>
struct GemmParts {
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

  // A kernel's SharedStorage at the dynamic base rounded up to 1024 bytes (what the 128-byte swizzle needs): the
  // kernel asks for sizeof + kSmemAlignSlack.
  static constexpr size_t kSmemAlignSlack = 1024;
  template <class Storage>
  __device__ __forceinline__ static Storage& aligned_storage(char* smem_raw) {
    return *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  }

  // The producer warpgroup: it gives its registers to the consumers, and its first thread streams every tile of
  // this CTA into the ring, in the order the consumers read it.
  __device__ __forceinline__ static void produce(const Params& params, Pipeline& pipeline,
                                                 typename Mainloop::SharedStorage& smem, int rank) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    PipelineState write = cutlass::make_producer_start_state<Pipeline>();
    for (int u = Scheduler::first_unit(); u < params.scheduler.pairs; u += Scheduler::unit_stride()) {
      const auto tile = Scheduler::tile(params.scheduler, u, rank);
      Mainloop::load_tile(params.mainloop, pipeline, write, smem, tile.mt, tile.nt, rank);
    }
  }

  __device__ __forceinline__ static TileAt tile_at(int mt, int nt) {
    return {mt, nt, static_cast<int64_t>(mt) * kBM, static_cast<int64_t>(nt) * kBN};
  }

  // v, which the compiler may not treat as the same value from one tile to the next: what a consumer derives from
  // it in the tile loop (the coordinates of its accumulators, a few additions away) it then recomputes per tile,
  // instead of hoisting some 64 column indices out of the loop and holding them, or their spills, across it.
  __device__ __forceinline__ static int per_tile(int v) {
    asm volatile("" : "+r"(v));
    return v;
  }

  // Neither CTA leaves while its peer may still multicast into its shared memory or arrive on its barriers.
  __device__ __forceinline__ static void leave_cluster() {
    __syncwarp();
    cute::cluster_sync();
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
  static_assert(Kernel::kSmemBytes <= kSmemOptIn, "the kernel's shared memory exceeds the opt-in");
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
