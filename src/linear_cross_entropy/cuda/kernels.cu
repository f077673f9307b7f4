// The linear cross-entropy's own kernels: everything between the cuBLAS GEMMs that is not the cross-entropy
// family's row statistics. The per-element gradient is the family's (cross_entropy/math.h, device.cuh), applied
// to a chunk of float32 logits that may be a slice of the vocabulary (the recompute backward's chunks), which
// the family's row kernels, written for whole rows, cannot take.
#include <algorithm>
#include <type_traits>

#include "common/cuda/check.cuh"
#include "cross_entropy/cuda/device.cuh"
#include "linear_cross_entropy/cuda/dtype_io.cuh"
#include "linear_cross_entropy/cuda/kernels.h"
#include "linear_cross_entropy/cuda/plan.h"
#include "linear_head/cuda/grad_columns.h"

namespace logitless::lce {
namespace {

constexpr int kGradThreads = 256;
using head::kGradCols;
using head::kGradRowsPerBlock;

template <typename T>
inline constexpr DType kDTypeOf = std::is_same_v<T, float>    ? DType::kFloat32
                                  : std::is_same_v<T, __half> ? DType::kFloat16
                                                              : DType::kBFloat16;

// One thread: the kGradCols adjacent columns of its group (grad_columns.h) over the kGradRowsPerBlock rows of a
// row block, with those columns' sums in registers (the bias gradient's partials). kGeneral covers soft-capping
// and label smoothing (a tanh and a class-weight load per element); without them the element is one exp2 and a
// compare, as in the cross-entropy kernels' plain loops. Every per-slot access (logits, class weights through
// the element, gradient, partials) goes through grad_columns.h, which touches only the slots inside the chunk;
// the per-row ones (target, lse, upstream, the target's class weight) are of rows r < p.rows and of a valid
// target only.
template <typename T, bool kGeneral>
__global__ void __launch_bounds__(kGradThreads) grad_kernel(const __grid_constant__ GradParams p) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kGradThreads + threadIdx.x) * kGradCols;
  if (c >= p.width) return;
  const uint32_t mask = head::grad_slot_mask(c, p.width);
  const float W = p.scalars->weight_sum, inv_denom = p.scalars->inv_denom, inv_count = p.scalars->inv_count;
  const int64_t row_blocks = (p.rows + kGradRowsPerBlock - 1) / kGradRowsPerBlock;
  for (int64_t rb = blockIdx.y; rb < row_blocks; rb += gridDim.y) {
    float colsum[kGradCols] = {0.f, 0.f, 0.f, 0.f};
    const int64_t r1 = min(p.rows, (rb + 1) * kGradRowsPerBlock);
    for (int64_t r = rb * kGradRowsPerBlock; r < r1; ++r) {
      const int64_t t = p.target[r];
      const ce::RowKind kind = ce::classify(p.ce, t);
      const int64_t tc = ce::target_column(p.ce, t);  // the target's column of a vocabulary shard (== t otherwise)
      float v[kGradCols];
      if (kind == ce::RowKind::kValid) {
        const float* src = p.logits + r * p.ld_logits + c;
        const float lse = p.lse[r];
        const float up = p.upstream ? p.upstream[p.upstream_per_row ? r : 0] : 1.f;
        const ce::GradCoeffs g = ce::row_grad_coeffs(lse, ce::target_weight(p.ce, t), W, p.ce.eps, p.ce.inv_v, p.ce.z,
                                                     inv_denom * up, inv_count * up);
        const float lse_l2 = lse * ce::kLog2e;
        const int64_t j0 = p.col0 + c;
        // 16-byte aligned: ld_logits is a multiple of 8 columns, c of 4, and the chunk buffers 256-byte aligned.
        const auto load_full = [&](float* x) {
          const float4 x4 = *reinterpret_cast<const float4*>(src);
          x[0] = x4.x, x[1] = x4.y, x[2] = x4.z, x[3] = x4.w;
        };
        const auto load_one = [&](int k) { return src[k]; };
        if constexpr (kGeneral) {
          head::grad_group_values(
              mask, load_full, load_one,
              [&](float x, int k) { return ce::grad_elem(p.ce, g, lse_l2, ce::capped(p.ce, x), j0 + k, tc); }, v);
        } else {
          head::grad_group_values(
              mask, load_full, load_one,
              [&](float x, int k) {
                const float d = g.a * ce::fast_exp2(fmaf(x, ce::kLog2e, -lse_l2));
                return j0 + k == tc ? d - g.b : d;
              },
              v);
        }
      } else {
        // Ignored tokens have gradient 0; a bad target (unchecked) makes its row NaN, as in the cross-entropy.
        head::grad_group_fill(mask, kind == ce::RowKind::kBad ? NAN : 0.f, v);
      }
      T* dst = static_cast<T*>(p.dlogits) + r * p.ld_dlogits;
      head::grad_group_store(
          mask, v, [&](const float* w) { head::store4<T>(dst, c, w); },
          [&](int k, float w) { store_as(dst, kDTypeOf<T>, c + k, w); }, colsum);
    }
    if (p.db_partial) head::grad_group_store_sums(mask, colsum, p.db_partial + rb * p.ld_logits + c);
  }
}

// A tile's statistics as (maximum, sum of exp, the target's logit, sum of w x): the forward's record, or the
// exponential form's (base, sum of E), which has no target or smoothing term.
__device__ __forceinline__ float4 stats_of(const float4& q) { return q; }
__device__ __forceinline__ float4 stats_of(const float2& q) { return make_float4(q.x, q.y, 0.f, 0.f); }

template <typename Record>
__global__ void finish_rows_kernel(const Record* partials, int64_t rows, int64_t tiles, const int64_t* target,
                                   const float* target_logit, const ce::KernelParams p, const Scalars* scalars,
                                   float* loss, float* lse, float* z_rows) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const int64_t t = target[r];
    const ce::RowKind kind = ce::classify(p, t);
    if (kind != ce::RowKind::kValid) {  // uniform over the warp
      if (lane == 0) {
        const float v = kind == ce::RowKind::kBad ? NAN : 0.f;
        loss[r] = v;
        if (lse) lse[r] = v;
        if (z_rows) z_rows[r] = v;
      }
      continue;
    }
    const Record* row = partials + r * tiles;
    float m = -INFINITY, s = 0.f, xt = 0.f, swx = 0.f;
    for (int64_t j = lane; j < tiles; j += 32) m = ce::max_nan(m, row[j].x);
    m = ce::warp_max(m);
    for (int64_t j = lane; j < tiles; j += 32) {
      const float4 q = stats_of(row[j]);
      if (q.x != -INFINITY) s += q.y * expf(q.x - m);  // accurate exp: a few terms per row, not a hot loop
      xt += q.z;
      swx += q.w;
    }
    s = ce::warp_sum(s);
    xt = target_logit ? target_logit[r] : ce::warp_sum(xt);
    swx = ce::warp_sum(swx);
    if (lane == 0) {
      // NaN, +inf (an infinite logit) or -inf (every logit -inf) as the maximum: NaN, as the row kernels give.
      const ce::RowStats st{isfinite(m) ? m + logf(s) : NAN, xt, swx};
      const ce::LossTerms lt = ce::row_loss(st, ce::target_weight(p, t), scalars->weight_sum, p.eps, p.inv_v, p.z);
      loss[r] = lt.loss;
      if (lse) lse[r] = st.lse;
      if (z_rows) z_rows[r] = lt.z_term;
    }
  }
}

template <typename T>
void grad_typed(const GradParams& p, cudaStream_t stream) {
  const int64_t col_blocks = (p.width + kGradThreads * kGradCols - 1) / (kGradThreads * kGradCols);
  const int64_t row_blocks = (p.rows + kGradRowsPerBlock - 1) / kGradRowsPerBlock;
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(std::min<int64_t>(row_blocks, 65535)));
  const bool general = p.ce.softcap > 0.f || p.ce.eps != 0.f;
  (general ? grad_kernel<T, true> : grad_kernel<T, false>)<<<grid, kGradThreads, 0, stream>>>(p);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy gradient kernel");
}

}  // namespace

void launch_grad(const GradParams& p, DType out_dtype, cudaStream_t stream) {
  if (p.rows == 0 || p.width == 0) return;
  switch (out_dtype) {
    case DType::kFloat32:
      return grad_typed<float>(p, stream);
    case DType::kFloat16:
      return grad_typed<__half>(p, stream);
    case DType::kBFloat16:
      return grad_typed<__nv_bfloat16>(p, stream);
    default:
      throw_invalid("linear cross-entropy gradient: unsupported dtype");
  }
}

void launch_finish_rows(const float* partials, int stats_floats, int64_t rows, int64_t tiles, const int64_t* target,
                        const float* target_logit, const ce::KernelParams& ce, const Scalars* scalars, float* loss,
                        float* lse, float* z_rows, int sm_count, cudaStream_t stream) {
  if (rows <= 0) return;
  if (stats_floats != kStatsFloats && !(stats_floats == kExpStatsFloats && target_logit))
    throw_invalid("linear cross-entropy fused row statistics: records of 4 floats, or of 2 with the target logits");
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((rows + kThreads / 32 - 1) / (kThreads / 32), int64_t{sm_count} * 8);
  const auto grid = static_cast<unsigned>(blocks);
  if (stats_floats == kExpStatsFloats)
    finish_rows_kernel<<<grid, kThreads, 0, stream>>>(reinterpret_cast<const float2*>(partials), rows, tiles, target,
                                                      target_logit, ce, scalars, loss, lse, z_rows);
  else
    finish_rows_kernel<<<grid, kThreads, 0, stream>>>(reinterpret_cast<const float4*>(partials), rows, tiles, target,
                                                      target_logit, ce, scalars, loss, lse, z_rows);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy fused row statistics");
}

}  // namespace logitless::lce
