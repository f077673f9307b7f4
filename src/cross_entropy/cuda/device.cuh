// Device-side building blocks of the cross-entropy kernels: per-row bookkeeping (targets, class weights, the
// soft cap, the row's outputs and gradient coefficients) and the hot loops' per-element work. The pieces every
// streaming kernel family shares (chunk geometry, fast exp2, reductions, the online-softmax algebra and the loops
// themselves) live in src/common/cuda/; the using-declarations below keep their ce:: names.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/cuda/chunk_loops.cuh"
#include "common/cuda/chunks.cuh"
#include "common/cuda/online_softmax.cuh"
#include "common/cuda/vec.cuh"
#include "cross_entropy/cuda/params.h"
#include "cross_entropy/math.h"

namespace logitless::ce {

using logitless::block_max;
using logitless::block_online;
using logitless::block_sum2;
using logitless::ChunkSpan;
using logitless::fast_exp2;
using logitless::kLn2;
using logitless::kLog2e;
using logitless::load16;
using logitless::load_chunk;
using logitless::max_nan;
using logitless::online_add;
using logitless::online_merge;
using logitless::partial_chunk_of_thread;
using logitless::store_chunk;
using logitless::warp_max;
using logitless::warp_sum;

// --- per-row bookkeeping shared by the kernels ------------------------------------------------------------
__device__ __forceinline__ int64_t load_target(const KernelParams& p, int64_t row) {
  const int64_t off = p.target_rows.offset(row);
  return p.target_is64 ? static_cast<const int64_t*>(p.target)[off]
                       : static_cast<int64_t>(static_cast<const int32_t*>(p.target)[off]);
}

// True in a kernel that must write nothing (KernelParams::abort_on_bad): the same answer in every thread.
__device__ __forceinline__ bool aborted(const KernelParams& p) {
  return p.abort_on_bad && p.scalars->first_bad < p.n_rows;
}

// Targets are classes of the whole vocabulary (a vocabulary shard sees every row's target, in or out of it).
enum class RowKind { kValid, kIgnored, kBad };
__device__ __forceinline__ RowKind classify(const KernelParams& p, int64_t t) {
  if (t == p.ignore_index) return RowKind::kIgnored;
  return (t >= 0 && t < p.vocab_total) ? RowKind::kValid : RowKind::kBad;
}

// The column of class t in these logits: outside [0, vocab) when another shard holds it, which no element
// index and no chunk position ever equals (so such a row simply has no target term here).
__device__ __forceinline__ int64_t target_column(const KernelParams& p, int64_t t) { return t - p.vocab_offset; }

__device__ __forceinline__ float capped(const KernelParams& p, float y) {
  // Accurate tanh: the cap multiplies its error by softcap (a 1e-3 relative error at x = 30 would move the
  // loss by 3e-2), so the approximate instruction is not good enough here.
  return p.softcap > 0.f ? p.softcap * tanhf(y / p.softcap) : y;
}

// The weight of column j (class vocab_offset + j).
__device__ __forceinline__ float class_weight(const KernelParams& p, int64_t j) {
  return p.weight ? p.weight[(p.vocab_offset + j) * p.weight_stride] : 1.f;
}

// The weight of class t (a row's target, of the whole vocabulary).
__device__ __forceinline__ float target_weight(const KernelParams& p, int64_t t) {
  return p.weight ? p.weight[t * p.weight_stride] : 1.f;
}

// The upstream factor of a row's gradient: `inv` (the mean's 1/denominator of the term, 1 otherwise) times the
// incoming gradient if given. `inv` is p.scalars->inv_denom (the cross-entropy term) or p.scalars->inv_count (the
// z-loss term), which a kernel may load once.
__device__ __forceinline__ float row_grad_scale(const KernelParams& p, int64_t row, float inv) {
  return p.grad_scale ? inv * p.grad_scale[p.grad_scale_per_row ? row : 0] : inv;
}

// A row's gradient coefficients (math.h) with the upstream factors of this call's scalars.
__device__ __forceinline__ GradCoeffs row_coeffs(const KernelParams& p, int64_t row, float lse, float w_t, float W) {
  return row_grad_coeffs(lse, w_t, W, p.eps, p.inv_v, p.z, row_grad_scale(p, row, p.scalars->inv_denom),
                         p.z != 0.f ? row_grad_scale(p, row, p.scalars->inv_count) : 0.f);
}

// Writes the forward outputs of a row whose statistics are known (rank 0 / thread 0 only): its loss (for sum and
// mean, its share of the reduced loss, which the finalize kernel only sums), lse and z-loss term.
__device__ __forceinline__ void write_row_outputs(const KernelParams& p, int64_t row, RowKind kind, const RowStats& st,
                                                  int64_t t) {
  float loss = 0.f, lse = 0.f, zt = 0.f;
  if (kind == RowKind::kBad) {
    loss = lse = zt = NAN;
  } else if (kind == RowKind::kValid) {
    const LossTerms lt = row_loss(st, target_weight(p, t), p.scalars->weight_sum, p.eps, p.inv_v, p.z);
    loss = reduced_row_loss(lt, p.scalars->inv_denom, p.scalars->inv_count);
    zt = lt.z_term;
    lse = st.lse;
  }
  if (p.row_loss) p.row_loss[row] = loss;
  if (p.lse) p.lse[row] = lse;
  if (p.z_loss) p.z_loss[row] = zt;
}

// A vocabulary shard's partial statistics of a row (thread 0 only): max, sum of exp(x - max), the target's logit
// (0 when another shard holds it) and sum of w x.
__device__ __forceinline__ void write_row_partials(const KernelParams& p, int64_t row, float m, float s, float x_t,
                                                   float swx) {
  reinterpret_cast<float4*>(p.partials)[row] = make_float4(m, s, x_t, swx);
}

// d(loss)/d(logit) of one element with capped value x at column j of a row whose target is column t.
__device__ __forceinline__ float grad_elem(const KernelParams& p, const GradCoeffs& g, float lse_l2, float x, int64_t j,
                                           int64_t t) {
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

// The per-element work of the hot loops (see common/cuda/chunk_loops.cuh), in two flavours: kGeneral handles
// soft-capping and label smoothing (a tanh, a division and a class-weight load per element); the plain one,
// which covers class weights and z-loss too (they act per row), is straight-line code.
template <typename T, bool kGeneral>
struct CeElem {
  static constexpr int kVec = Vec<T>::kN;
  const KernelParams& p;
  struct Acc {
    float& m;
    float& s;
    float& swx;  // sum of w_j x_j (label smoothing)
  };

  // Chunk q's values (capped), adding w_j x_j to swx for label smoothing.
  __device__ void load(const char* src, int q, int64_t j0, float* x, Acc& acc) const {
    Vec<T>::unpack(load16(src + 16 * q), x);
    if constexpr (kGeneral) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        x[i] = capped(p, x[i]);
        if (p.eps != 0.f) acc.swx += class_weight(p, j0 + static_cast<int64_t>(q) * kVec + i) * x[i];
      }
    }
  }

  template <int kN>
  __device__ void add(Acc& acc, const float* x) const {
    online_add<kN>(acc.m, acc.s, x);
  }

  // Gradient of whole chunk q (values v, in place).
  template <typename G>
  __device__ void grad(float* v, int q, int64_t j0, const G& g, float lse_l2, int q_t, int slot_t, int64_t t) const {
    if constexpr (kGeneral) {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        v[i] = grad_elem(p, g, lse_l2, capped(p, v[i]), j0 + static_cast<int64_t>(q) * kVec + i, t);
    } else {
      softmax_grad_chunk<kVec>(v, g.a, g.b, kLog2e, lse_l2, q == q_t, slot_t);
    }
  }
};

// The cross-entropy kernels' view of the shared loops: statistics into (m, s, swx), the gradient with GradCoeffs.
template <typename T, bool kGeneral>
struct ChunkLoops {
  RowChunkLoops<T, CeElem<T, kGeneral>> loops;

  __device__ explicit ChunkLoops(const KernelParams& p) : loops{CeElem<T, kGeneral>{p}} {}

  // Statistics of the whole chunks [q_lo, q_hi), merged into (m, s, swx).
  __device__ void stats(const char* src, int q_lo, int q_hi, int64_t j0, float& m, float& s, float& swx) const {
    typename CeElem<T, kGeneral>::Acc acc{m, s, swx};
    loops.stats(src, q_lo, q_hi, j0, acc);
  }

  template <bool kVecStore>
  __device__ void grad(const char* src, int q_lo, int q_hi, int64_t j0, const GradCoeffs& g, float lse_l2, int q_t,
                       int slot_t, int64_t t, const ChunkSpan<T>& span, char* gdst) const {
    loops.template grad<kVecStore>(src, q_lo, q_hi, j0, g, lse_l2, q_t, slot_t, t, span, gdst);
  }
};

}  // namespace logitless::ce
