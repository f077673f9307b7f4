// Device building blocks shared by the kernel families that stream rows of logits: fast exp2, the 16-byte chunk
// geometry of an arbitrarily aligned row, NaN-propagating max, and warp / block reductions. (Moved here from the
// cross-entropy kernels unchanged, so the policy-loss kernels run the same code.)
#pragma once

#include <cstdint>

#include "common/cuda/vec.cuh"

namespace logitless {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A span of `len` elements starting at byte address `start`, cut into the 16-byte chunks of the address
// space: chunk q covers bytes [base + 16q, base + 16q + 16) with base = start rounded down to 16. Interior
// chunks are read and written with one 16-byte access; the first and last may be partial (misaligned rows,
// odd V) and are handled element by element. Elements are naturally aligned, so `mis` is a multiple of the
// element size.
template <typename T>
struct ChunkSpan {
  static constexpr int kVec = Vec<T>::kN;
  const char* base;
  int mis;      // start - base, bytes
  int64_t end;  // mis + len * sizeof(T), bytes from base
  int64_t nchunks;

  __device__ ChunkSpan(const void* start, int64_t len) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(start);
    mis = static_cast<int>(a & 15u);
    base = reinterpret_cast<const char*>(a - mis);
    end = mis + len * static_cast<int64_t>(sizeof(T));
    nchunks = len > 0 ? (end + 15) / 16 : 0;
  }
  __device__ bool full(int64_t q) const { return 16 * q >= mis && 16 * q + 16 <= end; }
  // Element index (within the span) of slot k of chunk q; may be outside [0, len) for partial chunks.
  __device__ int64_t elem(int64_t q, int k) const { return (16 * q - mis) / static_cast<int64_t>(sizeof(T)) + k; }
  __device__ bool valid(int64_t q, int k) const {
    const int64_t b = 16 * q + k * static_cast<int64_t>(sizeof(T));
    return b >= mis && b < end;
  }
  __device__ const char* chunk_ptr(int64_t q) const { return base + 16 * q; }
};

// Loads chunk q of `span` as floats and returns the mask of slots inside the span (the others hold 0).
// `full_src` is where a full chunk's 16 bytes live (global memory, or the shared-memory copy of the span);
// partial chunks are read element by element from global memory.
template <typename T>
__device__ __forceinline__ uint32_t load_chunk(const ChunkSpan<T>& span, int64_t q, const char* full_src, float* v) {
  constexpr int kN = Vec<T>::kN;
  if (span.full(q)) {
    Vec<T>::unpack(*reinterpret_cast<const uint4*>(full_src), v);
    return (1u << kN) - 1;
  }
  uint32_t mask = 0;
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const bool ok = span.valid(q, k);
    v[k] = ok ? Vec<T>::load1(span.chunk_ptr(q) + k * sizeof(T)) : 0.f;
    mask |= ok ? (1u << k) : 0u;
  }
  return mask;
}

// The partial (first or last) chunk of `span` that this thread handles outside the whole-chunk loops, or -1:
// thread 0 takes a misaligned first chunk, thread 1 a ragged last chunk (unless it is that same chunk).
template <typename T>
__device__ __forceinline__ int partial_chunk_of_thread(const ChunkSpan<T>& span) {
  const int first = span.mis ? 0 : -1;
  const int last = (span.end & 15) ? static_cast<int>(span.nchunks) - 1 : -1;
  if (threadIdx.x == 0) return first;
  if (threadIdx.x == 1) return last != first ? last : -1;
  return -1;
}

// Stores kN floats as chunk q of the span `dst` (same geometry as the span the values came from when
// `vector_ok`): one 16-byte store for a full chunk, element stores otherwise.
template <typename T>
__device__ __forceinline__ void store_chunk(const ChunkSpan<T>& span, int64_t q, char* dst_elem0, bool vector_ok,
                                            const float* v) {
  constexpr int kN = Vec<T>::kN;
  if (vector_ok && span.full(q)) {
    *reinterpret_cast<uint4*>(dst_elem0 - span.mis + 16 * q) = Vec<T>::pack(v);
    return;
  }
#pragma unroll
  for (int k = 0; k < kN; ++k)
    if (span.valid(q, k)) Vec<T>::store1(dst_elem0 + span.elem(q, k) * static_cast<int64_t>(sizeof(T)), v[k]);
}

// A 16-byte load from shared or global memory (the generic address resolves to LDS / LDG once inlined).
__device__ __forceinline__ uint4 load16(const char* p) { return *reinterpret_cast<const uint4*>(p); }

// max that propagates NaN (fmaxf drops it): a NaN logit must make its row's loss NaN, even when every other
// logit of a slice is -inf.
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Block-wide reductions; `scratch` holds 32 floats. Every thread gets the result. Two barriers: the
// second keeps a following reduction from overwriting scratch before everyone has read it.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < nwarps ? scratch[lane] : -INFINITY;
  r = warp_max(r);
  __syncthreads();
  return r;
}
__device__ __forceinline__ float2 block_sum2(float2 v, float2* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v.x = warp_sum(v.x);
  v.y = warp_sum(v.y);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float2 r = lane < nwarps ? scratch[lane] : make_float2(0.f, 0.f);
  r.x = warp_sum(r.x);
  r.y = warp_sum(r.y);
  __syncthreads();
  return r;
}

}  // namespace logitless
