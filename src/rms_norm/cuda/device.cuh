// Device-side building blocks of the RMSNorm kernels: 16-byte vectors of each dtype as floats, rounding to
// a dtype, the per-mode element math, and the reduction of one row's partial sums across its threads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/cuda/vec.cuh"
#include "rms_norm/cuda/params.h"

namespace logitless::rms {

// Plain (coherent) 16-byte accesses for the tensors the kernels may write in place: an output may alias an
// input, so the read-only (non-coherent) path is reserved for the weight.
// 16-byte global accesses as explicit vector instructions: written as uint4 copies, the compiler split the
// stores of a row's third and fourth vectors into four 4-byte stores each. The loads are volatile and the
// stores clobber memory, so their program order survives: an output may alias an input (in-place use),
// which is also why these are coherent loads, not the read-only path the weight takes.
__device__ __forceinline__ uint4 load16(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void store16(void* p, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// A read-only (non-coherent path) 16-byte load the compiler keeps where it is written: as an intrinsic, the
// weight loads of a row loop were hoisted out of it, and a float32 weight held that way (16 registers a
// vector) spilled.
__device__ __forceinline__ uint4 load16_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The tensors of one call share their collapsed leading sizes (api.cpp collapses them jointly), so a row's
// coordinates are computed once (64-bit divisions only when the rows are not a single strided dimension)
// and each tensor's offset is a dot product with its strides.
struct RowCoords {
  int64_t i[kMaxRowDims];
};
__device__ __forceinline__ RowCoords row_coords(const RowLayout& shared_sizes, int64_t row) {
  RowCoords c{};
  // Constant indices only (unrolled, guarded): a loop over the runtime nd would put c in local memory.
#pragma unroll
  for (int d = kMaxRowDims - 1; d > 0; --d) {
    if (d < shared_sizes.nd) {
      const int64_t q = row / shared_sizes.sizes[d];
      c.i[d] = row - q * shared_sizes.sizes[d];
      row = q;
    }
  }
  c.i[0] = row;
  return c;
}
__device__ __forceinline__ int64_t row_offset(const RowLayout& rows, const RowCoords& c) {
  int64_t off = c.i[0] * rows.strides[0];
#pragma unroll
  for (int d = 1; d < kMaxRowDims; ++d)
    if (d < rows.nd) off += c.i[d] * rows.strides[d];
  return off;
}

// kN weights of vector v (elements v*kN ..), as float32 plus the offset; kNone rounds the sum to T like a
// module run in T would. A float32 weight beside a 16-bit T is two 16-byte loads.
template <typename T>
__device__ __forceinline__ void load_weight_vec(const void* weight, bool weight_f32, int64_t v, float offset,
                                                RMSNormCasting casting, float* g) {
  constexpr int kN = Vec<T>::kN;
  if constexpr (kN == 8) {
    if (weight_f32) {
      const float* w = static_cast<const float*>(weight) + 8 * v;
      Vec<float>::unpack(load16_nc(w), g);
      Vec<float>::unpack(load16_nc(w + 4), g + 4);
    } else {
      Vec<T>::unpack(load16_nc(static_cast<const uint4*>(weight) + v), g);
    }
  } else {  // T is float: the weight is float32 too
    Vec<T>::unpack(load16_nc(static_cast<const uint4*>(weight) + v), g);
  }
#pragma unroll
  for (int e = 0; e < kN; ++e) {
    g[e] += offset;
    if (casting == RMSNormCasting::kNone) g[e] = Vec<T>::round(g[e]);
  }
}

// The weight vectors of a thread's columns (vectors t, t + tpr, ... of the row) in registers, when the
// weight has x's dtype (one 16-byte vector per vector of x): loaded all at once, before the stores of a row
// (each store orders the loads after it, so loads between stores would cost one L1 round trip per vector).
// The backward loads them once and holds them across its rows; the forward loads them per row, after the
// residual is added (it needs their registers for the residual before). A float32 weight beside 16-bit x
// (two vectors per vector of x) is read where it is used instead.
template <typename T, int VPT>
struct RowWeight {
  uint4 w[VPT];
  __device__ __forceinline__ void load(const void* weight, bool weight_f32, int t, int tpr, int64_t nvec) {
    if (weight_f32) return;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t v = t + static_cast<int64_t>(k) * tpr;
      if (v < nvec) w[k] = load16_nc(static_cast<const uint4*>(weight) + v);
    }
  }
  // g = the weights of vector v (the thread's k-th) plus the offset, as load_weight_vec returns them.
  __device__ __forceinline__ void get(int k, int64_t v, const void* weight, bool weight_f32, float offset,
                                      RMSNormCasting casting, float* g) const {
    constexpr int kN = Vec<T>::kN;
    if (weight_f32) {
      load_weight_vec<T>(weight, weight_f32, v, offset, casting, g);
      return;
    }
    // Opaque to the optimizer: otherwise the unpacked floats (twice the registers) are what it hoists out
    // of the row loop and keeps (and spills).
    uint4 u = w[k];
    asm volatile("" : "+r"(u.x), "+r"(u.y), "+r"(u.z), "+r"(u.w));
    Vec<T>::unpack(u, g);
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      g[e] += offset;
      if (casting == RMSNormCasting::kNone) g[e] = Vec<T>::round(g[e]);
    }
  }
};

template <typename T>
__device__ __forceinline__ float load_weight1(const void* weight, bool weight_f32, int64_t j, float offset,
                                              RMSNormCasting casting) {
  float g =
      weight_f32 ? __ldg(static_cast<const float*>(weight) + j) : Vec<T>::load1(static_cast<const T*>(weight) + j);
  g += offset;
  return casting == RMSNormCasting::kNone ? Vec<T>::round(g) : g;
}

// The normalized value the weight multiplies: rounded to T except in Gemma's all-float32 mode.
template <typename T>
__device__ __forceinline__ float normalized(float s, float r, RMSNormCasting casting) {
  const float n = s * r;
  return casting == RMSNormCasting::kGemma ? n : Vec<T>::round(n);
}

// y before its final rounding (the store rounds): kLlama g * round(s r); kGemma (s r) * g; kNone
// round(s r') * round(g). The operand order of each product follows the module it reproduces.
template <typename T>
__device__ __forceinline__ float output(float s, float r, float g, RMSNormCasting casting) {
  return casting == RMSNormCasting::kGemma ? (s * r) * g : g * normalized<T>(s, r, casting);
}

__device__ __forceinline__ float warp_sum(float v, int width) {
  // Butterfly: at each step lane i adds v[i ^ o] to v[i] and lane i ^ o adds the same two values in the
  // other order, which IEEE addition makes bit-identical, so every lane of a group ends with the same sum.
  for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Sum of v over the blockDim.x threads of this thread's row (the CTA is blockDim.x threads per row times
// blockDim.y rows). Rows of up to 32 threads reduce inside their warp (blockDim.x is then a power of two);
// longer rows are whole warps that meet in `scratch` (32 floats) behind a barrier of their own row's warps
// only (named barrier 1 + row, at most kMaxNamedBarrierRows rows a CTA): the rows of a CTA then drift apart,
// so while one row waits for its loads another computes, where a CTA-wide barrier would keep every row in
// the same phase and leave the SM without loads in flight during the math. Every thread of the row must call
// it, and a caller that reduces again must use another scratch or synchronize the row first. The warps'
// partials are added in warp order, so all threads of a row get the same bits.
__device__ __forceinline__ void row_barrier() {
  if (blockDim.y == 1) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + static_cast<int>(threadIdx.y)), "r"(static_cast<int>(blockDim.x))
                 : "memory");
  }
}

__device__ __forceinline__ float row_sum(float v, float* scratch) {
  const int tpr = blockDim.x;
  if (tpr <= 32) return warp_sum(v, tpr);
  v = warp_sum(v, 32);
  const int tid = threadIdx.y * tpr + threadIdx.x;
  const int warps_per_row = tpr >> 5;
  if ((tid & 31) == 0) scratch[tid >> 5] = v;
  row_barrier();
  const float* mine = scratch + threadIdx.y * warps_per_row;
  float s = 0.f;
  for (int w = 0; w < warps_per_row; ++w) s += mine[w];
  return s;
}

__device__ __forceinline__ float rstd_of(float sum_sq, int64_t hidden, float eps) {
  // IEEE division and square root (not rsqrtf's 2-ulp approximation): the CPU backend computes the same
  // expression, and one per row costs nothing.
  return 1.f / sqrtf(sum_sq / static_cast<float>(hidden) + eps);
}

}  // namespace logitless::rms
