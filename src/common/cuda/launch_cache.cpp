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

// The cached answer for `key`, or `query()`'s (run with the key's device current) cached first.
template <typename Query>
int occupancy_answer(const ShapeKey& key, Query&& query) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_occupancy.find(key);
  if (it == g_occupancy.end()) {
    DeviceGuard on(std::get<0>(key));
    it = g_occupancy.emplace(key, query()).first;
  }
  return it->second;
}

}  // namespace

cudaError_t reserve_dynamic_smem(const void* func, size_t bytes) {
  return reserve_dynamic_smem(current_device(), func, bytes);
}

cudaError_t reserve_dynamic_smem(int device, const void* func, size_t bytes) {
  std::lock_guard<std::mutex> lock(g_mu);
  FuncState& f = g_funcs[FuncKey{device, func}];
  if (bytes <= f.smem) return cudaSuccess;
  DeviceGuard on(device);  // the attribute is the current device's
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
  return allow_non_portable_clusters(current_device(), func);
}

cudaError_t allow_non_portable_clusters(int device, const void* func) {
  std::lock_guard<std::mutex> lock(g_mu);
  FuncState& f = g_funcs[FuncKey{device, func}];
  if (f.non_portable) return cudaSuccess;
  DeviceGuard on(device);
  const cudaError_t err = cudaFuncSetAttribute(func, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return err;
  }
  f.non_portable = true;
  return cudaSuccess;
}

int max_active_clusters(const void* func, const cudaLaunchConfig_t& cfg) {
  return max_active_clusters(current_device(), func, cfg);
}

int max_active_clusters(int device, const void* func, const cudaLaunchConfig_t& cfg) {
  const ShapeKey key{device, func, kOccupancyClusters, cfg.blockDim.x, cluster_size(cfg), cfg.dynamicSmemBytes};
  return occupancy_answer(key, [&] {
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, func, &cfg) != cudaSuccess) {
      cudaGetLastError();  // this cluster size is not supported here: the caller decides
      n = 0;
    }
    return n;
  });
}

int max_active_blocks(const void* func, int threads, size_t smem) {
  return max_active_blocks(current_device(), func, threads, smem);
}

int max_active_blocks(int device, const void* func, int threads, size_t smem) {
  const ShapeKey key{device, func, kOccupancyBlocks, static_cast<unsigned>(threads), 1u, smem};
  return occupancy_answer(key, [&] {
    int n = 0;
    LOGITLESS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, func, threads, smem));
    return n;
  });
}

int binary_version(const void* func) { return binary_version(current_device(), func); }

int binary_version(int device, const void* func) {
  const ShapeKey key{device, func, kBinaryVersion, 0u, 0u, 0};
  return occupancy_answer(key, [&] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, func) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return attr.binaryVersion;
  });
}

}  // namespace logitless::launch_cache
