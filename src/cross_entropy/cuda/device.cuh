// Device-side building blocks shared by the cross-entropy kernels: dtype traits for 16-byte chunks, the
// chunk geometry of an arbitrarily aligned row, fast exp2, block reductions, and per-row bookkeeping.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/cuda/vec.cuh"
#include "cross_entropy/cuda/params.h"
#include "cross_entropy/math.h"

namespace logitless::ce {

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
  int mis;           // start - base, bytes
  int64_t end;       // mis + len * sizeof(T), bytes from base
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
  __device__ int64_t elem(int64_t q, int k) const {
    return (16 * q - mis) / static_cast<int64_t>(sizeof(T)) + k;
  }
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

// --- online softmax state (running max m, sum of exp(x - m)) -----------------------------------------------
// Merges n values (already -inf where absent) into (m, s) with one rescale for the whole group. NaN poisons
// both; a group of -inf leaves them unchanged; no -inf - -inf is ever formed.
template <int kN>
__device__ __forceinline__ void online_add(float& m, float& s, const float* x) {
  float cm = x[0];
#pragma unroll
  for (int i = 1; i < kN; ++i) cm = max_nan(cm, x[i]);
  const float mn = max_nan(m, cm);
  const float scale = m == mn ? 1.f : fast_exp2((m - mn) * kLog2e);
  const float mn_l2 = mn == -INFINITY ? 0.f : mn * kLog2e;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kN; ++i) acc += fast_exp2(fmaf(x[i], kLog2e, -mn_l2));
  s = fmaf(s, scale, acc);
  m = mn;
}

// (m1, s1) <- (m1, s1) merged with (m2, s2).
__device__ __forceinline__ void online_merge(float& m1, float& s1, float m2, float s2) {
  const float M = max_nan(m1, m2);
  const float a = m1 == -INFINITY ? 0.f : s1 * fast_exp2((m1 - M) * kLog2e);
  const float b = m2 == -INFINITY ? 0.f : s2 * fast_exp2((m2 - M) * kLog2e);
  m1 = M;
  s1 = a + b;
}

// Block-wide merge of (m, s) and a plain sum `w`; every thread gets the result. `scratch` holds 32 float4.
__device__ __forceinline__ void block_online(float& m, float& s, float& w, float4* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, o), s2 = __shfl_xor_sync(0xFFFFFFFFu, s, o);
    w += __shfl_xor_sync(0xFFFFFFFFu, w, o);
    online_merge(m, s, m2, s2);
  }
  if (lane == 0) scratch[warp] = make_float4(m, s, w, 0.f);
  __syncthreads();
  const float4 v = lane < nwarps ? scratch[lane] : make_float4(-INFINITY, 0.f, 0.f, 0.f);
  m = v.x, s = v.y, w = v.z;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, o), s2 = __shfl_xor_sync(0xFFFFFFFFu, s, o);
    w += __shfl_xor_sync(0xFFFFFFFFu, w, o);
    online_merge(m, s, m2, s2);
  }
  __syncthreads();  // scratch may be reused right after
}

// --- per-row bookkeeping shared by the kernels ------------------------------------------------------------
__device__ __forceinline__ int64_t load_target(const KernelParams& p, int64_t row) {
  const int64_t off = p.target_rows.offset(row);
  return p.target_is64 ? static_cast<const int64_t*>(p.target)[off]
                       : static_cast<int64_t>(static_cast<const int32_t*>(p.target)[off]);
}

enum class RowKind { kValid, kIgnored, kBad };
__device__ __forceinline__ RowKind classify(const KernelParams& p, int64_t t) {
  if (t == p.ignore_index) return RowKind::kIgnored;
  return (t >= 0 && t < p.vocab) ? RowKind::kValid : RowKind::kBad;
}

__device__ __forceinline__ float capped(const KernelParams& p, float y) {
  // Accurate tanh: the cap multiplies its error by softcap (a 1e-3 relative error at x = 30 would move the
  // loss by 3e-2), so the approximate instruction is not good enough here.
  return p.softcap > 0.f ? p.softcap * tanhf(y / p.softcap) : y;
}

__device__ __forceinline__ float class_weight(const KernelParams& p, int64_t j) {
  return p.weight ? p.weight[j * p.weight_stride] : 1.f;
}

// The upstream factor of a row's gradient: 1/denominator for mean, times the incoming gradient if given.
__device__ __forceinline__ float row_grad_scale(const KernelParams& p, int64_t row) {
  float s = p.scalars->inv_denom;
  if (p.grad_scale) s *= p.grad_scale[p.grad_scale_per_row ? row : 0];
  return s;
}

// Writes the forward outputs of a row whose statistics are known (rank 0 / thread 0 only).
__device__ __forceinline__ void write_row_outputs(const KernelParams& p, int64_t row, RowKind kind, const RowStats& st,
                                                  int64_t t) {
  float loss = 0.f, lse = 0.f, zt = 0.f;
  if (kind == RowKind::kBad) {
    loss = lse = zt = NAN;
  } else if (kind == RowKind::kValid) {
    const LossTerms lt = row_loss(st, class_weight(p, t), p.scalars->weight_sum, p.eps, p.inv_v, p.z);
    loss = lt.loss;
    zt = lt.z_term;
    lse = st.lse;
  }
  if (p.row_loss) p.row_loss[row] = loss;
  if (p.lse) p.lse[row] = lse;
  if (p.z_loss) p.z_loss[row] = zt;
}

// d(loss)/d(logit) of one element with capped value x at class j of a row with target t.
__device__ __forceinline__ float grad_elem(const KernelParams& p, const GradCoeffs& g, float lse_l2, float x,
                                           int64_t j, int64_t t) {
  // p_j = exp(x - lse) = 2^(x log2e - lse log2e)
  float d = g.a * fast_exp2(fmaf(x, kLog2e, -lse_l2));
  if (g.c != 0.f) d -= g.c * class_weight(p, j);
  if (j == t) d -= g.b;
  if (p.softcap > 0.f) {
    const float u = x / p.softcap;
    d *= 1.f - u * u;
  }
  return d;
}

// A 16-byte load from shared or global memory (the generic address resolves to LDS / LDG once inlined).
__device__ __forceinline__ uint4 load16(const char* p) { return *reinterpret_cast<const uint4*>(p); }

// The hot loops come in two flavours: kGeneral handles soft-capping and label smoothing (a tanh, a division
// and a class-weight load per element); the plain one, which covers class weights and z-loss too (they act
// per row), is straight-line code: with only 16 warps per SM to hide latency, per-element branches cost a
// factor of several (measured: 28% of copy bandwidth with them, see bench/RESULTS.md).
//
// `src` is where whole chunks live: a shared-memory stage (row-resident) or the row in global memory
// (streaming); chunk q is src + 16 q either way, and slot i of chunk q is class j0 + q kVec + i.
template <typename T, bool kGeneral>
struct ChunkLoops {
  static constexpr int kVec = Vec<T>::kN;
  static constexpr int kUnroll = 4;  // 16-byte chunks in flight per thread and pass
  const KernelParams& p;

  __device__ float cap(float y) const {
    if constexpr (kGeneral) return capped(p, y);
    return y;
  }

  // Chunk q's values (capped), adding w_j x_j to swx for label smoothing.
  __device__ void load_x(const char* src, int q, int64_t j0, float* x, float& swx) const {
    Vec<T>::unpack(load16(src + 16 * q), x);
    if constexpr (kGeneral) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        x[i] = capped(p, x[i]);
        if (p.eps != 0.f) swx += class_weight(p, j0 + static_cast<int64_t>(q) * kVec + i) * x[i];
      }
    }
  }

  // Statistics of the whole chunks [q_lo, q_hi), merged into (m, s, swx).
  // The main loop issues kUnroll loads with no branch between them; a remainder loop takes the rest.
  __device__ void stats(const char* src, int q_lo, int q_hi, int64_t j0, float& m, float& s, float& swx) const {
    const int nt = blockDim.x;
    int q = q_lo + static_cast<int>(threadIdx.x);
    for (; q + (kUnroll - 1) * nt < q_hi; q += kUnroll * nt) {
      float x[kUnroll * kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) load_x(src, q + u * nt, j0, x + u * kVec, swx);
      online_add<kUnroll * kVec>(m, s, x);
    }
    for (; q < q_hi; q += nt) {
      float x[kVec];
      load_x(src, q, j0, x, swx);
      online_add<kVec>(m, s, x);
    }
  }

  // Gradient of whole chunk q (values v, in place).
  __device__ void grad_chunk(float* v, int q, int64_t j0, const GradCoeffs& g, float lse_l2, int q_t, int slot_t,
                             int64_t t) const {
    if constexpr (kGeneral) {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        v[i] = grad_elem(p, g, lse_l2, capped(p, v[i]), j0 + static_cast<int64_t>(q) * kVec + i, t);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[i] = g.a * fast_exp2(fmaf(v[i], kLog2e, -lse_l2));
      if (q == q_t) {
#pragma unroll
        for (int i = 0; i < kVec; ++i)
          if (i == slot_t) v[i] -= g.b;
      }
    }
  }

  // Gradient of the whole chunks, src -> gdst: 16-byte stores when the gradient's alignment matches
  // the logits' (always, in place), element stores otherwise.
  template <bool kVecStore>
  __device__ void grad(const char* src, int q_lo, int q_hi, int64_t j0, const GradCoeffs& g, float lse_l2,
                       int q_t, int slot_t, int64_t t, const ChunkSpan<T>& span, char* gdst) const {
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
        grad_chunk(v[u], q + u * nt, j0, g, lse_l2, q_t, slot_t, t);
        put(q + u * nt, v[u]);
      }
    }
    for (; q < q_hi; q += nt) {
      float v[kVec];
      Vec<T>::unpack(load16(src + 16 * q), v);
      grad_chunk(v, q, j0, g, lse_l2, q_t, slot_t, t);
      put(q, v);
    }
  }
};

}  // namespace logitless::ce
