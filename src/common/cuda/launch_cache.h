// One process-wide cache of kernel launch set-up, per device: the dynamic shared memory a kernel was opted into,
// whether it may form non-portable clusters, and the occupancy calculator's answers. Each of those runtime calls
// costs microseconds of host time, as much as a kernel takes at small shapes, so no launch should repeat one.
// Kernels are named by their address (a __global__ function cast to const void*). Thread-safe.
//
// Each function comes twice: on the current device, or on `device` given by the caller. The second asks the runtime
// nothing once the answer is cached (not even which device is current), so a launcher that knows its device pays no
// runtime call for its set-up after the first; on a miss it makes `device` current for the query and restores the
// caller's device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace logitless::launch_cache {

// Opts `func` into at least `bytes` of dynamic shared memory on the current device (a request no larger than one
// granted before costs nothing). The runtime's error where it refuses, cleared from its last-error state and not
// remembered, so a later smaller request still tries.
cudaError_t reserve_dynamic_smem(const void* func, size_t bytes);
cudaError_t reserve_dynamic_smem(int device, const void* func, size_t bytes);

// Lets `func` form clusters above 8 CTAs on the current device; the runtime's error (cleared) where it may not.
cudaError_t allow_non_portable_clusters(const void* func);
cudaError_t allow_non_portable_clusters(int device, const void* func);

// Clusters of cfg's shape (block, cluster dimension, dynamic shared memory) that fit the current device at once;
// 0 where that cluster size is not supported (the runtime's error cleared). cfg.gridDim: one cluster.
int max_active_clusters(const void* func, const cudaLaunchConfig_t& cfg);
int max_active_clusters(int device, const void* func, const cudaLaunchConfig_t& cfg);

// CTAs of `threads` threads with `smem` bytes of dynamic shared memory that fit one SM of the current device.
// Throws where the runtime fails.
int max_active_blocks(const void* func, int threads, size_t smem);
int max_active_blocks(int device, const void* func, int threads, size_t smem);

// The architecture (major * 10 + minor) of the binary of `func` the current device runs; 0 where the runtime has
// none for it (the error cleared).
int binary_version(const void* func);
int binary_version(int device, const void* func);

}  // namespace logitless::launch_cache
