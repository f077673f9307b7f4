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

void check_cuda_target(const char* name, const Device& device, StreamHandle stream) {
  // Read once: the visible devices do not change while a process runs, and no query runs inside a graph capture.
  static const int n = cuda_device_count();
  LOGITLESS_CHECK_ARG(device.index >= 0 && device.index < n, name,
                      str_cat("a tensor on a visible CUDA device (", n, " visible)"), device_str(device));
  // The default streams are per device already: the call makes its device current before it launches.
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread) return;
  // A capturing stream is left alone: a query beside the capture could invalidate it (global capture mode), and the
  // capture records on the stream's own device.
  if (stream_is_capturing(s)) return;
  int stream_device = -1;
  const cudaError_t err = cudaStreamGetDevice(s, &stream_device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw_invalid(
        str_cat("stream: expected a CUDA stream, got a handle the runtime rejects (", cudaGetErrorName(err), ")"));
  }
  // A kernel launched on another device's stream fails (or runs on the wrong device) after the checks have passed.
  LOGITLESS_CHECK_ARG(stream_device == device.index, "stream",
                      str_cat("a stream of ", device_str(device), " (the tensors' device)"),
                      str_cat("a stream of cuda:", stream_device));
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
