#include "common/cuda/index_readback.h"

#include <memory>
#include <vector>

#include "common/cuda/check.cuh"

namespace logitless {

IndexReadback::IndexReadback() {
  LOGITLESS_CUDA_CHECK(cudaHostAlloc(&slot_, sizeof(long long), cudaHostAllocPortable));
  LOGITLESS_CUDA_CHECK(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
}

IndexReadback::~IndexReadback() {  // errors ignored: the runtime may already be shutting down
  if (copied_) cudaEventDestroy(copied_);
  if (slot_) cudaFreeHost(slot_);
}

IndexReadback& IndexReadback::start(int device, const long long* first_bad, cudaStream_t stream) {
  // Per device: an event belongs to the device current at its creation.
  thread_local std::vector<std::unique_ptr<IndexReadback>> per_device;
  if (per_device.size() <= static_cast<size_t>(device)) per_device.resize(device + 1);
  if (!per_device[device]) per_device[device] = std::make_unique<IndexReadback>();
  IndexReadback& rb = *per_device[device];
  // A call that threw before its wait may have left a copy in flight (on another stream, perhaps): let it land.
  // Only then: a call that waited has nothing in flight, and the usual call pays no runtime call for this.
  if (rb.in_flight_) {
    LOGITLESS_CUDA_CHECK(cudaEventSynchronize(rb.copied_));
    rb.in_flight_ = false;
  }
  LOGITLESS_CUDA_CHECK(cudaMemcpyAsync(rb.slot_, first_bad, sizeof(long long), cudaMemcpyDeviceToHost, stream));
  LOGITLESS_CUDA_CHECK(cudaEventRecord(rb.copied_, stream));
  rb.in_flight_ = true;
  return rb;
}

long long IndexReadback::wait() {
  LOGITLESS_CUDA_CHECK(cudaEventSynchronize(copied_));
  in_flight_ = false;
  return *slot_;
}

std::optional<BadIndex> IndexReadback::first_bad(int64_t n_rows, const void* indices, DType dtype,
                                                 const RowLayout& rows) {
  const long long row = wait();
  if (row >= n_rows) return std::nullopt;
  const int64_t es = dtype_size(dtype);
  int64_t value = 0;
  const char* addr = static_cast<const char*>(indices) + rows.offset(row) * es;
  LOGITLESS_CUDA_CHECK(cudaMemcpy(&value, addr, es, cudaMemcpyDeviceToHost));
  if (es == 4) value = static_cast<int32_t>(value & 0xFFFFFFFF);
  return BadIndex{row, value};
}

}  // namespace logitless
