// The row statistics of the linear cross-entropy (LinearCrossEntropyOptions::row_stats): per token the entropy of the
// softmax the loss uses and whether the target is the row's first maximum (torch.argmax's answer), from a chunk of
// float32 logits (the generic path) or from the fused exponential form's tile partials.
#include <algorithm>
#include <climits>

#include "common/cuda/check.cuh"
#include "common/cuda/first_max.cuh"
#include "common/cuda/online_softmax.cuh"
#include "cross_entropy/cuda/device.cuh"
#include "linear_cross_entropy/cuda/kernels.h"

namespace logitless::lce {
namespace {

constexpr int kChunkThreads = 256;   // a block per row: a vocabulary-wide row is long
constexpr int kGroup = 4;            // values merged into the online state at once (one rescale per group)
constexpr int kFinishThreads = 256;  // a warp per row: a row has a few hundred tiles at most

// Writes what a row that is not valid gets; true if the row is valid.
__device__ __forceinline__ bool write_if_not_valid(ce::RowKind kind, int64_t r, float* entropy, uint8_t* is_top1) {
  if (kind == ce::RowKind::kValid) return true;
  entropy[r] = kind == ce::RowKind::kBad ? NAN : 0.f;
  is_top1[r] = 0;
  return false;
}

// One block per row (grid-stride over rows). The online state (m, s, u) of the capped logits gives the entropy
// (common/cuda/online_softmax.cuh); the first maximum is folded from the raw logits. A NaN logit makes m NaN
// (max_nan); the raw maximum is the merged candidate's value otherwise (NaN is never a candidate).
__global__ void __launch_bounds__(kChunkThreads)
    chunk_row_stats_kernel(const float* z, int64_t ld, int64_t rows, int64_t width, const int64_t* target,
                           const ce::KernelParams p, float* entropy, uint8_t* is_top1) {
  __shared__ float4 scratch[32];
  __shared__ FirstMax first_scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t t = target[r];
    const ce::RowKind kind = ce::classify(p, t);
    if (kind != ce::RowKind::kValid) {  // uniform over the block
      if (threadIdx.x == 0) write_if_not_valid(kind, r, entropy, is_top1);
      continue;
    }
    const float* row = z + r * ld;
    float m = -INFINITY, s = 0.f, u = 0.f, unused = 0.f;
    FirstMax first = FirstMax::none();
    for (int64_t j0 = threadIdx.x; j0 < width; j0 += int64_t{kChunkThreads} * kGroup) {
      float x[kGroup];
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        const int64_t j = j0 + int64_t{k} * kChunkThreads;
        x[k] = -INFINITY;
        if (j < width) {
          const float y = row[j];
          first.merge(y, j);
          x[k] = ce::capped(p, y);
        }
      }
      online_add_entropy<kGroup>(m, s, u, x, ce::kLog2e);
    }
    block_online_scaled<true>(m, s, u, unused, ce::kLog2e, scratch);
    block_first_max(first, first_scratch);
    if (threadIdx.x == 0) {
      // NaN, +inf or (uncapped) every logit -inf: no finite lse, NaN as the loss's.
      entropy[r] = isfinite(m) ? online_entropy(s, u) : NAN;
      const float raw_max = isnan(m) ? NAN : first.value;
      is_top1[r] = is_first_max(raw_max, first, ce::target_column(p, t)) ? 1 : 0;
    }
  }
}

// A warp per row over its tiles (hopper/epilogue_exp_row_stats.cuh has the formula): partials (base, s),
// row_partials (A, tile maximum, its first column, NaN flag).
__global__ void __launch_bounds__(kFinishThreads)
    finish_row_stats_kernel(const float2* partials, const float4* row_partials, int64_t rows, int64_t tiles,
                            const int64_t* target, const float* lse, const ce::KernelParams p, float* entropy,
                            uint8_t* is_top1) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kFinishThreads / 32);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kFinishThreads / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const int64_t t = target[r];
    const ce::RowKind kind = ce::classify(p, t);
    if (kind != ce::RowKind::kValid) {  // uniform over the warp
      if (lane == 0) write_if_not_valid(kind, r, entropy, is_top1);
      continue;
    }
    const float2* st = partials + r * tiles;
    const float4* rs = row_partials + r * tiles;
    const float l = lse[r];
    float mx = -INFINITY, h = 0.f;
    int nan = 0;
    for (int64_t k = lane; k < tiles; k += 32) {
      const float2 a = st[k];
      const float4 b = rs[k];
      mx = fmaxf(mx, b.y);
      nan |= b.w != 0.f;
      if (a.x != -INFINITY) h += expf(a.x - l) * fmaf(l - a.x, a.y, -b.x);  // accurate exp: a few terms per row
    }
    mx = ce::warp_max(mx);
    h = ce::warp_sum(h);
    nan = __any_sync(0xFFFFFFFFu, nan);
    int first = INT_MAX;
    for (int64_t k = lane; k < tiles; k += 32)
      if (rs[k].y == mx) first = min(first, __float_as_int(rs[k].z));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(0xFFFFFFFFu, first, o));
    if (lane == 0) {
      entropy[r] = nan || !isfinite(l) ? NAN : h;
      const int64_t tc = ce::target_column(p, t);
      is_top1[r] = !nan && (mx == -INFINITY ? tc == 0 : first == tc) ? 1 : 0;
    }
  }
}

}  // namespace

void launch_chunk_row_stats(const float* z, int64_t ld, int64_t rows, int64_t width, const int64_t* target,
                            const ce::KernelParams& ce, float* entropy, uint8_t* is_top1, int sm_count,
                            cudaStream_t stream) {
  if (rows <= 0) return;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, int64_t{sm_count} * 8));
  chunk_row_stats_kernel<<<blocks, kChunkThreads, 0, stream>>>(z, ld, rows, width, target, ce, entropy, is_top1);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy row statistics");
}

void launch_finish_row_stats(const float* partials, const float* row_partials, int64_t rows, int64_t tiles,
                             const int64_t* target, const float* lse, const ce::KernelParams& ce, float* entropy,
                             uint8_t* is_top1, int sm_count, cudaStream_t stream) {
  if (rows <= 0) return;
  const int64_t per_block = kFinishThreads / 32;
  const auto blocks =
      static_cast<unsigned>(std::min<int64_t>((rows + per_block - 1) / per_block, int64_t{sm_count} * 8));
  finish_row_stats_kernel<<<blocks, kFinishThreads, 0, stream>>>(reinterpret_cast<const float2*>(partials),
                                                                 reinterpret_cast<const float4*>(row_partials), rows,
                                                                 tiles, target, lse, ce, entropy, is_top1);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy fused row statistics");
}

}  // namespace logitless::lce
