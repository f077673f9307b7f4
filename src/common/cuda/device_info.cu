#include <memory>
#include <mutex>
#include <vector>

#include "common/cuda/check.cuh"
#include "logitless/version.h"

namespace logitless {

const DeviceInfo& device_info(int device) {
  static std::mutex mu;
  static std::vector<std::unique_ptr<DeviceInfo>> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (device < 0) throw_invalid(str_cat("device: expected a CUDA ordinal >= 0, got ", device));
  if (static_cast<size_t>(device) >= cache.size()) cache.resize(device + 1);
  if (!cache[device]) {
    auto info = std::make_unique<DeviceInfo>();
    LOGITLESS_CUDA_CHECK(cudaDeviceGetAttribute(&info->sm_major, cudaDevAttrComputeCapabilityMajor, device));
    LOGITLESS_CUDA_CHECK(cudaDeviceGetAttribute(&info->sm_minor, cudaDevAttrComputeCapabilityMinor, device));
    LOGITLESS_CUDA_CHECK(cudaDeviceGetAttribute(&info->sm_count, cudaDevAttrMultiProcessorCount, device));
    LOGITLESS_CUDA_CHECK(
        cudaDeviceGetAttribute(&info->max_smem_per_block_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    LOGITLESS_CUDA_CHECK(
        cudaDeviceGetAttribute(&info->max_smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    LOGITLESS_CUDA_CHECK(cudaDeviceGetAttribute(&info->l2_bytes, cudaDevAttrL2CacheSize, device));
    cache[device] = std::move(info);
  }
  return *cache[device];
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  LOGITLESS_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

bool built_with_cuda() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

}  // namespace logitless
