#include "common/cuda/launch_cache.h"

#include <map>
#include <mutex>
#include <tuple>

#include "common/cuda/check.cuh"

namespace logitless::launch_cache {
namespace {

struct FuncState {
  size_t smem = 0;            // dynamic shared memory opted into
  bool non_portable = false;  // clusters above 8 CTAs allowed
};

// The kinds of answers, kept apart in one map.
enum Kind : int { kOccupancyBlocks = 0, kOccupancyClusters = 1, kBinaryVersion = 2 };
using FuncKey = std::tuple<int, const void*>;
using ShapeKey = std::tuple<int, const void*, int, unsigned, unsigned, size_t>;  // device, func, kind, threads,
                                                                                 // cluster, dynamic smem
std::mutex g_mu;
std::map<FuncKey, FuncState> g_funcs;
std::map<ShapeKey, int> g_occupancy;

int current_device() {
  int d = 0;
  LOGITLESS_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

unsigned cluster_size(const cudaLaunchConfig_t& cfg) {
  for (unsigned i = 0; i < cfg.numAttrs; ++i)
    if (cfg.attrs[i].id == cudaLaunchAttributeClusterDimension) return cfg.attrs[i].val.clusterDim.x;
  return 1;
}

}  // namespace

cudaError_t reserve_dynamic_smem(const void* func, size_t bytes) {
  const FuncKey key{current_device(), func};
  std::lock_guard<std::mutex> lock(g_mu);
  FuncState& f = g_funcs[key];
  if (bytes <= f.smem) return cudaSuccess;
  const cudaError_t err =
      cudaFuncSetAttribute(func, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) {
    cudaGetLastError();
    return err;
  }
  f.smem = bytes;
  return cudaSuccess;
}

cudaError_t allow_non_portable_clusters(const void* func) {
  const FuncKey key{current_device(), func};
  std::lock_guard<std::mutex> lock(g_mu);
  FuncState& f = g_funcs[key];
  if (f.non_portable) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(func, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return err;
  }
  f.non_portable = true;
  return cudaSuccess;
}

int max_active_clusters(const void* func, const cudaLaunchConfig_t& cfg) {
  const ShapeKey key{current_device(),    func, kOccupancyClusters, cfg.blockDim.x, cluster_size(cfg),
                     cfg.dynamicSmemBytes};
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_occupancy.find(key);
  if (it == g_occupancy.end()) {
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, func, &cfg) != cudaSuccess) {
      cudaGetLastError();  // this cluster size is not supported here: the caller decides
      n = 0;
    }
    it = g_occupancy.emplace(key, n).first;
  }
  return it->second;
}

int max_active_blocks(const void* func, int threads, size_t smem) {
  const ShapeKey key{current_device(), func, kOccupancyBlocks, static_cast<unsigned>(threads), 1u, smem};
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_occupancy.find(key);
  if (it == g_occupancy.end()) {
    int n = 0;
    LOGITLESS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, func, threads, smem));
    it = g_occupancy.emplace(key, n).first;
  }
  return it->second;
}

int binary_version(const void* func) {
  const ShapeKey key{current_device(), func, kBinaryVersion, 0u, 0u, 0};
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_occupancy.find(key);
  if (it == g_occupancy.end()) {
    cudaFuncAttributes attr{};
    int version = 0;
    if (cudaFuncGetAttributes(&attr, func) != cudaSuccess) {
      cudaGetLastError();
    } else {
      version = attr.binaryVersion;
    }
    it = g_occupancy.emplace(key, version).first;
  }
  return it->second;
}

}  // namespace logitless::launch_cache
