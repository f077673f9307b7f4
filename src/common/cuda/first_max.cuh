// The first maximum of a row of logits (torch.argmax's answer: the lowest index among equal maxima), folded from
// the values each thread reads in a statistics pass and merged across the block, so that "is the target the top-1
// class" costs a few compares and selects per 16-byte chunk instead of another read of the row.
//
// The order: a larger value wins, the lower index among equal values. It is total on the candidates (NaN values are
// never taken: a caller tells a row with a NaN by its NaN-propagating max), so the merge is associative and
// commutative and any tree of merges, across the threads of a block or the slices of a vocabulary, gives the same
// answer. -inf values never become candidates either: a row of -inf only ends with no candidate (kNone), and its
// first maximum is index 0, which the caller knows from the row's max.
#pragma once

#include <cstdint>

namespace logitless {

// Trivially constructible (it also lives in __shared__ scratch): start from none().
struct FirstMax {
  static constexpr int64_t kNone = INT64_MAX;
  float value;
  int64_t index;

  static __host__ __device__ __forceinline__ FirstMax none() { return {-INFINITY, kNone}; }

  __device__ __forceinline__ void merge(float v, int64_t j) {
    if (v > value || (v == value && j < index)) {
      value = v;
      index = j;
    }
  }

  // kN values of the classes j, j + 1, ...: a chunk above every class this thread has taken in so far (threads read
  // their chunks in increasing order), so only a strictly larger value replaces the candidate.
  template <int kN>
  __device__ __forceinline__ void add_later(const float* x, int64_t j) {
    float cm = x[0];
#pragma unroll
    for (int i = 1; i < kN; ++i) cm = fmaxf(cm, x[i]);  // NaN skipped
    int slot = 0;
#pragma unroll
    for (int i = kN - 1; i >= 0; --i) slot = x[i] == cm ? i : slot;  // the lowest slot holding it
    if (cm > value) {
      value = cm;
      index = j + slot;
    }
  }
};

// Block-wide merge: every thread gets the block's first maximum. `scratch` holds 32 entries. Two barriers: the
// second keeps a following reduction from overwriting scratch before everyone has read it.
__device__ __forceinline__ void block_first_max(FirstMax& f, FirstMax* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  auto warp_merge = [&] {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(0xFFFFFFFFu, f.value, o);
      const long long j = __shfl_xor_sync(0xFFFFFFFFu, static_cast<long long>(f.index), o);
      f.merge(v, j);
    }
  };
  warp_merge();
  if (lane == 0) scratch[warp] = f;
  __syncthreads();
  f = lane < nwarps ? scratch[lane] : FirstMax::none();
  warp_merge();
  __syncthreads();
}

// Whether `id` is the row's first maximum, given the row's NaN-propagating max `m` and its merged FirstMax: a row
// with a NaN is no answer (false), a row of -inf only answers index 0 (as torch.argmax does).
__device__ __forceinline__ bool is_first_max(float m, const FirstMax& f, int64_t id) {
  if (m != m) return false;
  return m == -INFINITY ? id == 0 : f.index == id;
}

}  // namespace logitless
