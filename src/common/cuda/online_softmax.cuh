// The online-softmax state algebra shared by the kernel families: a running max m and sum s of 2^((x - m) c)
// over the values seen so far, where c = log2(e) / temperature (log2(e) for plain logits), so that
//   lse(x / temperature) = m / temperature + ln(s).
// Optionally the state also carries u = sum of 2^t t with t = (x - m) c, which gives the entropy of
// softmax(x / temperature) without a second pass:
//   H = -sum_j p_j ln p_j = ln(s) - ln(2) u / s        (p_j = 2^t_j / s, ln p_j = ln(2) t_j - ln(s)).
// Keeping t relative to the running max (not sum of p_j x_j) avoids cancelling two large numbers.
//
// Rescaling to a new max M multiplies every 2^t by a = 2^d with d = (m - M) c and shifts every t by d:
//   s <- a s,   u <- a (u + d s).
// NaN poisons every component; values of -inf contribute nothing; no -inf - -inf is ever formed.
#pragma once

#include <cfloat>

#include "common/cuda/chunks.cuh"

namespace logitless {

// Merges kN values (already -inf where absent) into (m, s) with one rescale for the whole group.
template <int kN>
__device__ __forceinline__ void online_add_scaled(float& m, float& s, const float* x, float c) {
  float cm = x[0];
#pragma unroll
  for (int i = 1; i < kN; ++i) cm = max_nan(cm, x[i]);
  const float mn = max_nan(m, cm);
  const float scale = m == mn ? 1.f : fast_exp2((m - mn) * c);
  const float mn_l2 = mn == -INFINITY ? 0.f : mn * c;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kN; ++i) acc += fast_exp2(fmaf(x[i], c, -mn_l2));
  s = fmaf(s, scale, acc);
  m = mn;
}

// The plain logits' case (c = log2 e), which the cross-entropy kernels use.
template <int kN>
__device__ __forceinline__ void online_add(float& m, float& s, const float* x) {
  online_add_scaled<kN>(m, s, x, kLog2e);
}

// (m1, s1) <- (m1, s1) merged with (m2, s2).
__device__ __forceinline__ void online_merge_scaled(float& m1, float& s1, float m2, float s2, float c) {
  const float M = max_nan(m1, m2);
  const float a = m1 == -INFINITY ? 0.f : s1 * fast_exp2((m1 - M) * c);
  const float b = m2 == -INFINITY ? 0.f : s2 * fast_exp2((m2 - M) * c);
  m1 = M;
  s1 = a + b;
}

__device__ __forceinline__ void online_merge(float& m1, float& s1, float m2, float s2) {
  online_merge_scaled(m1, s1, m2, s2, kLog2e);
}

// With the entropy accumulator u. Per value: t = x c - m c (clamped at -FLT_MAX so that a -inf value adds
// 0 * finite, not 0 * -inf), s += 2^t, u += 2^t t: two more operations than online_add_scaled.
template <int kN>
__device__ __forceinline__ void online_add_entropy(float& m, float& s, float& u, const float* x, float c) {
  float cm = x[0];
#pragma unroll
  for (int i = 1; i < kN; ++i) cm = max_nan(cm, x[i]);
  const float mn = max_nan(m, cm);
  // d = 0 when the max is unchanged (a = 1 exactly) or nothing was accumulated yet (s = u = 0).
  const float d = m == -INFINITY ? 0.f : (m - mn) * c;
  const float a = fast_exp2(d);
  u = a * fmaf(d, s, u);
  s *= a;
  const float mn_l2 = mn == -INFINITY ? 0.f : mn * c;
  float acc_s = 0.f, acc_u = 0.f;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    const float t = fmaxf(fmaf(x[i], c, -mn_l2), -FLT_MAX);
    const float e = fast_exp2(t);
    acc_s += e;
    acc_u = fmaf(e, t, acc_u);
  }
  s += acc_s;
  u += acc_u;
  m = mn;
}

// (m1, s1, u1) <- merged with (m2, s2, u2).
__device__ __forceinline__ void online_merge_entropy(float& m1, float& s1, float& u1, float m2, float s2, float u2,
                                                     float c) {
  const float M = max_nan(m1, m2);
  const float d1 = m1 == -INFINITY ? 0.f : (m1 - M) * c, d2 = m2 == -INFINITY ? 0.f : (m2 - M) * c;
  const float a1 = m1 == -INFINITY ? 0.f : fast_exp2(d1), a2 = m2 == -INFINITY ? 0.f : fast_exp2(d2);
  u1 = a1 * fmaf(d1, s1, u1) + a2 * fmaf(d2, s2, u2);
  s1 = a1 * s1 + a2 * s2;
  m1 = M;
}

// Entropy of softmax(x / temperature) from the state.
__device__ __forceinline__ float online_entropy(float s, float u) { return logf(s) - kLn2 * u / s; }

// Block-wide merge of the state (m, s[, u]) and a plain sum `w`; every thread gets the result. `scratch` holds
// 32 float4. Two barriers: the second keeps a following reduction from overwriting scratch before everyone has
// read it.
template <bool kEntropy>
__device__ __forceinline__ void block_online_scaled(float& m, float& s, float& u, float& w, float c, float4* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, o), s2 = __shfl_xor_sync(0xFFFFFFFFu, s, o);
    w += __shfl_xor_sync(0xFFFFFFFFu, w, o);
    if constexpr (kEntropy) {
      const float u2 = __shfl_xor_sync(0xFFFFFFFFu, u, o);
      online_merge_entropy(m, s, u, m2, s2, u2, c);
    } else {
      online_merge_scaled(m, s, m2, s2, c);
    }
  }
  if (lane == 0) scratch[warp] = make_float4(m, s, w, kEntropy ? u : 0.f);
  __syncthreads();
  const float4 v = lane < nwarps ? scratch[lane] : make_float4(-INFINITY, 0.f, 0.f, 0.f);
  m = v.x, s = v.y, w = v.z;
  if constexpr (kEntropy) u = v.w;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, o), s2 = __shfl_xor_sync(0xFFFFFFFFu, s, o);
    w += __shfl_xor_sync(0xFFFFFFFFu, w, o);
    if constexpr (kEntropy) {
      const float u2 = __shfl_xor_sync(0xFFFFFFFFu, u, o);
      online_merge_entropy(m, s, u, m2, s2, u2, c);
    } else {
      online_merge_scaled(m, s, m2, s2, c);
    }
  }
  __syncthreads();  // scratch may be reused right after
}

// The cross-entropy kernels' form: plain logits, no entropy.
__device__ __forceinline__ void block_online(float& m, float& s, float& w, float4* scratch) {
  float u = 0.f;
  block_online_scaled<false>(m, s, u, w, kLog2e, scratch);
}

}  // namespace logitless
