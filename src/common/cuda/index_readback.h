// The eager check of an index argument (a target, a token id) without a stream synchronization: a prepass writes
// the first bad row to device memory; its value is copied to pinned host memory behind the prepass and an event
// marks the copy. The caller keeps queueing work (kernels that must write nothing on a bad index check the device
// value themselves) and waits for the event, not the stream, before it throws. Never while a CUDA graph is being
// captured (the caller checks).
#pragma once

#include <cuda_runtime.h>

#include <optional>

#include "common/layout.h"

namespace logitless {

struct BadIndex {
  int64_t row = 0;
  int64_t value = 0;  // the index found there
};

class IndexReadback {
 public:
  // Starts copying *first_bad (device memory) to the host on `stream`. `device` is current. One slot per host
  // thread and device, kept for the thread's lifetime: a call waits for its own copy before it returns.
  static IndexReadback& start(int device, const long long* first_bad, cudaStream_t stream);
  // Waits for the copy (not for the work queued after it) and returns the value.
  long long wait();
  // Waits for the copy; the first bad row if it is below n_rows, with the index there read from `indices` (int32 or
  // int64, rows laid out by `rows`; one synchronous copy, on the error path only).
  std::optional<BadIndex> first_bad(int64_t n_rows, const void* indices, DType dtype, const RowLayout& rows);

  IndexReadback();
  ~IndexReadback();
  IndexReadback(const IndexReadback&) = delete;
  IndexReadback& operator=(const IndexReadback&) = delete;

 private:
  long long* slot_ = nullptr;
  cudaEvent_t copied_ = nullptr;
  bool in_flight_ = false;  // a copy was started and nobody has waited for it
};

}  // namespace logitless
