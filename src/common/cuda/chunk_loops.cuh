// The hot loops over the whole 16-byte chunks of a row, shared by the kernel families: a statistics pass and a
// gradient pass, each issuing kUnroll 16-byte loads per thread with no branch between them, then a remainder
// loop. What a family does per element is its `Elem`:
//
//   struct Elem {
//     // chunk q's kVec values as the statistics see them (unpacked, and transformed or side-summed if need be)
//     __device__ void load(const char* src, int q, int64_t j0, float* x, Acc& acc) const;
//     template <int kN> __device__ void add(Acc& acc, const float* x) const;   // kN values into the state
//     template <typename G>                                                     // chunk q's gradient, in place
//     __device__ void grad(float* v, int q, int64_t j0, const G& g, float lse_l2, int q_t, int slot_t,
//                          int64_t t) const;
//   };
//
// Straight-line code matters here: with only 16 warps per SM to hide latency, per-element branches cost a
// factor of several (the cross-entropy kernels with them: bench/RESULTS.md), so an Elem decides what it does per
// row or at compile time, never per element.
//
// `src` is where whole chunks live: a shared-memory stage or the row in global memory; chunk q is src + 16 q
// either way, and slot i of chunk q is class j0 + q kVec + i.
#pragma once

#include <cstdint>

#include "common/cuda/chunks.cuh"

namespace logitless {

template <typename T, typename Elem>
struct RowChunkLoops {
  static constexpr int kVec = Vec<T>::kN;
  static constexpr int kUnroll = 4;  // 16-byte chunks in flight per thread and pass
  Elem elem;

  // Statistics of the whole chunks [q_lo, q_hi), merged into acc.
  template <typename Acc>
  __device__ void stats(const char* src, int q_lo, int q_hi, int64_t j0, Acc& acc) const {
    const int nt = blockDim.x;
    int q = q_lo + static_cast<int>(threadIdx.x);
    for (; q + (kUnroll - 1) * nt < q_hi; q += kUnroll * nt) {
      float x[kUnroll * kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) elem.load(src, q + u * nt, j0, x + u * kVec, acc);
      elem.template add<kUnroll * kVec>(acc, x);
    }
    for (; q < q_hi; q += nt) {
      float x[kVec];
      elem.load(src, q, j0, x, acc);
      elem.template add<kVec>(acc, x);
    }
  }

  // Gradient of the whole chunks, src -> gdst: 16-byte stores when the gradient's alignment matches the
  // logits' (always, in place), element stores otherwise.
  template <bool kVecStore, typename G>
  __device__ void grad(const char* src, int q_lo, int q_hi, int64_t j0, const G& g, float lse_l2, int q_t, int slot_t,
                       int64_t t, const ChunkSpan<T>& span, char* gdst) const {
    const int nt = blockDim.x;
    char* gbase = gdst - span.mis;
    auto put = [&](int q, const float* v) {
      if constexpr (kVecStore) {
        *reinterpret_cast<uint4*>(gbase + 16 * q) = Vec<T>::pack(v);
      } else {
        store_chunk(span, q, gdst, false, v);
      }
    };
    int q = q_lo + static_cast<int>(threadIdx.x);
    for (; q + (kUnroll - 1) * nt < q_hi; q += kUnroll * nt) {
      float v[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) Vec<T>::unpack(load16(src + 16 * (q + u * nt)), v[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        elem.grad(v[u], q + u * nt, j0, g, lse_l2, q_t, slot_t, t);
        put(q + u * nt, v[u]);
      }
    }
    for (; q < q_hi; q += nt) {
      float v[kVec];
      Vec<T>::unpack(load16(src + 16 * q), v);
      elem.grad(v, q, j0, g, lse_l2, q_t, slot_t, t);
      put(q, v);
    }
  }
};

// The softmax gradient of one chunk, dx_j = a p_j - [j == t] b with p_j = 2^(x_j c - lse_l2): what every family's
// plain flavour computes, with the per-row coefficients (a, b) it chose and c = log2(e) / temperature
// (log2 e for plain logits). `at_target`: this chunk holds the chosen class, in slot slot_t.
template <int kVec>
__device__ __forceinline__ void softmax_grad_chunk(float* v, float a, float b, float c, float lse_l2, bool at_target,
                                                   int slot_t) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) v[i] = a * fast_exp2(fmaf(v[i], c, -lse_l2));
  if (at_target) {
#pragma unroll
    for (int i = 0; i < kVec; ++i)
      if (i == slot_t) v[i] -= b;
  }
}

}  // namespace logitless
