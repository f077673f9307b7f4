// Shared-memory residency of a row slice (Hopper): the whole 16-byte chunks of a span are bulk-copied (TMA) into a
// shared-memory stage, completing on an mbarrier, so that a kernel can reduce the slice and then write its gradient
// without reading global memory a second time. Chunk q of the span lands at stage + 16 q (the chunk geometry of
// chunks.cuh), so the chunk loops read the stage exactly as they would read the row; the partial first and last
// chunks are not copied (a bulk copy moves whole 16-byte units from 16-byte-aligned addresses) and stay in global
// memory. A stage therefore needs the slice's bytes plus 16 of lead-in for a misaligned row.
#pragma once

#include <cuda/ptx>

#include <cstdint>

#include "common/cuda/chunks.cuh"

namespace logitless {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// One thread: arms `bar` for the bytes of the span's whole chunks and starts their copy into `stage`. An empty span
// (or one without a whole chunk) still arrives, so the waiter's phase completes.
template <typename T>
__device__ __forceinline__ void copy_whole_chunks(const ChunkSpan<T>& span, unsigned char* stage, uint64_t* bar) {
  const int64_t q0 = span.mis ? 1 : 0, q1 = span.end / 16;
  const uint32_t bytes = q1 > q0 ? static_cast<uint32_t>((q1 - q0) * 16) : 0u;
  cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, bar,
                                       bytes);
  if (bytes > 0)
    cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global, stage + 16 * q0, span.base + 16 * q0,
                             bytes, bar);
}

// Spins until `bar` completes the phase of parity `parity`.
__device__ __forceinline__ void wait_stage(uint64_t* bar, uint32_t parity) {
  while (!cuda::ptx::mbarrier_try_wait_parity(bar, parity)) {
  }
}
#endif

}  // namespace logitless
