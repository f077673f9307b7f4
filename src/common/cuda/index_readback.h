// The eager check of an index argument (a target, a token id) without a stream synchronization: a prepass writes
// the first bad row to device memory; its value is copied to pinned host memory behind the prepass and an event
// marks the copy. The caller keeps queueing work (kernels that must write nothing on a bad index check the device
// value themselves) and waits for the event, not the stream, before it throws. Never while a CUDA graph is being
// captured (the caller checks).
#pragma once

#include <cuda_runtime.h>

namespace logitless {

class IndexReadback {
 public:
  // Starts copying *first_bad (device memory) to the host on `stream`. `device` is current. One slot per host
  // thread and device, kept for the thread's lifetime: a call waits for its own copy before it returns.
  static IndexReadback& start(int device, const long long* first_bad, cudaStream_t stream);
  // Waits for the copy (not for the work queued after it) and returns the value.
  long long wait();

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
