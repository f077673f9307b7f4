// CUDA error checks: every runtime call and every launch is checked and turned into logitless::Error.
#pragma once

#include <cuda_runtime.h>

#include "common/check.h"

namespace logitless {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what, const char* file, int line) {
  throw_runtime(str_cat("CUDA error in ", what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") at ",
                        file, ":", line));
}

// A failed call also leaves its error as the runtime's "last error": it is read back here (a sticky error stays
// anyway), so that the next launch check does not blame an unrelated launch.
#define LOGITLESS_CUDA_CHECK(expr)                              \
  do {                                                          \
    const cudaError_t err_ = (expr);                            \
    if (err_ != cudaSuccess) {                                  \
      cudaGetLastError();                                       \
      ::logitless::throw_cuda(err_, #expr, __FILE__, __LINE__); \
    }                                                           \
  } while (0)

// After a launch: catches bad configurations at once (asynchronous faults surface at the next sync).
#define LOGITLESS_CUDA_CHECK_LAUNCH(name)                                                          \
  do {                                                                                             \
    const cudaError_t err_ = cudaGetLastError();                                                   \
    if (err_ != cudaSuccess) ::logitless::throw_cuda(err_, "launch of " name, __FILE__, __LINE__); \
  } while (0)

// Launches `kernel` and checks the launch in one runtime call, where <<<...>>> followed by LOGITLESS_CUDA_CHECK_LAUNCH
// takes several (the configuration push and pop, the launch, the read-back of the error). `what` names the launch in
// the error ("launch of ...").
template <typename... Params, typename... Args>
void launch_kernel(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw_cuda(err, what, __FILE__, __LINE__);
  }
}

// Makes `device` current for the scope of a call and restores the caller's device afterwards. One runtime call where
// the device is current already (the usual case: torch makes the tensors' device current); the scope never leaves
// another device current (nested guards restore theirs), so the destructor knows without asking.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    LOGITLESS_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) LOGITLESS_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (prev_ != device_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_ = 0;
  int prev_ = 0;
};

// Properties of a device the launchers need, read once per device and cached.
struct DeviceInfo {
  int sm_major = 0, sm_minor = 0;
  int sm_count = 0;
  int max_smem_per_block_optin = 0;  // bytes a block may use after opting in
  int max_smem_per_sm = 0;
  int l2_bytes = 0;
};
const DeviceInfo& device_info(int device);

// True when `stream` is capturing a CUDA graph (no synchronization or host read-back allowed then).
bool stream_is_capturing(cudaStream_t stream);

}  // namespace logitless
