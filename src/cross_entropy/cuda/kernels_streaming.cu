// The portable cross-entropy kernels (any GPU from sm_80): one CTA per row, reading the row from global
// memory with 16-byte loads. The fused forward+backward reads each row twice (the second read mostly hits
// L2), which is why Hopper uses the row-resident kernel instead; this path serves other GPUs, rows too long
// for a cluster's shared memory, and the backward from a saved lse (one read, one write: all it needs).
#include "common/cuda/check.cuh"
#include "cross_entropy/cuda/device.cuh"
#include "cross_entropy/cuda/kernels.h"

namespace logitless::ce {
namespace {

template <typename T, bool kGeneral, bool kWithLse>
__global__ void __launch_bounds__(kStreamingThreads) streaming_kernel(const __grid_constant__ KernelParams p) {
  constexpr int kVec = Vec<T>::kN;
  constexpr int64_t kEs = sizeof(T);
  __shared__ float4 red[32];
  if (aborted(p)) return;
  const int tid = threadIdx.x;
  const float W = p.scalars->weight_sum;
  const ChunkLoops<T, kGeneral> loops{p};

  for (int64_t row = blockIdx.x; row < p.n_rows; row += gridDim.x) {
    const int64_t t = load_target(p, row);
    const RowKind kind = classify(p, t);
    const int64_t tc = target_column(p, t);  // == t unless the logits are a vocabulary shard
    char* gdst = p.grad ? p.grad + p.grad_rows.offset(row) * kEs : nullptr;
    if (kind != RowKind::kValid) {
      if (!kWithLse && tid == 0) {
        if (p.partials) {
          write_row_partials(p, row, -INFINITY, 0.f, 0.f, 0.f);
        } else {
          write_row_outputs(p, row, kind, RowStats{0.f, 0.f, 0.f}, t);
        }
      }
      if (gdst) {
        const ChunkSpan<T> gspan(gdst, p.vocab);
        float v[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[i] = kind == RowKind::kBad ? NAN : 0.f;
        for (int64_t q = tid; q < gspan.nchunks; q += blockDim.x) store_chunk(gspan, q, gdst, true, v);
      }
      continue;
    }
    const char* src = p.logits + p.logits_rows.offset(row) * kEs;
    const ChunkSpan<T> span(src, p.vocab);
    // Rows up to 2^35 bytes: chunk indices fit in int.
    const int q_lo = span.mis ? 1 : 0, q_hi = static_cast<int>(span.end / 16);
    const int64_t j0 = -static_cast<int64_t>(span.mis) / kEs;
    const int part = partial_chunk_of_thread(span);
    float lse;
    if constexpr (kWithLse) {
      lse = p.lse_in[row];
    } else {
      float m = -INFINITY, se = 0.f, swx = 0.f;
      loops.stats(span.base, q_lo, q_hi, j0, m, se, swx);
      if (part >= 0) {
        float v[kVec];
        const uint32_t mask = load_chunk(span, part, nullptr, v);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const bool ok = (mask >> i) & 1u;
          v[i] = ok ? capped(p, v[i]) : -INFINITY;
          if (p.eps != 0.f && ok) swx += class_weight(p, span.elem(part, i)) * v[i];
        }
        online_add<kVec>(m, se, v);
      }
      // The target logit is read before the block reduction's barriers, hence before any thread of this
      // CTA can overwrite the row (in place). A vocabulary shard reads it only when it holds the target.
      float x_t = 0.f;
      if (tid == 0 && tc >= 0 && tc < p.vocab) x_t = capped(p, Vec<T>::load1(src + tc * kEs));
      block_online(m, se, swx, red);
      if (p.partials) {  // a shard's statistics: the exchange and finalize combine them (no gradient here)
        if (tid == 0) write_row_partials(p, row, m, se, x_t, swx);
        continue;
      }
      lse = m == -INFINITY ? NAN : m + logf(se);
      if (tid == 0) write_row_outputs(p, row, kind, RowStats{lse, x_t, swx}, t);
    }
    if (gdst) {
      const GradCoeffs g = row_coeffs(p, row, lse, target_weight(p, t), W);
      const float lse_l2 = lse * kLog2e;
      // A target column outside the shard gives a chunk index no whole chunk has (negative, or >= q_hi).
      const int64_t b = span.mis + tc * kEs;
      const int q_t = static_cast<int>(b >> 4), slot_t = static_cast<int>((b & 15) / kEs);
      if ((reinterpret_cast<uintptr_t>(gdst) & 15u) == static_cast<uintptr_t>(span.mis)) {
        loops.template grad<true>(span.base, q_lo, q_hi, j0, g, lse_l2, q_t, slot_t, tc, span, gdst);
      } else {
        loops.template grad<false>(span.base, q_lo, q_hi, j0, g, lse_l2, q_t, slot_t, tc, span, gdst);
      }
      if (part >= 0) {
        float v[kVec];
        const uint32_t mask = load_chunk(span, part, nullptr, v);
#pragma unroll
        for (int i = 0; i < kVec; ++i)
          v[i] = (mask >> i) & 1u ? grad_elem(p, g, lse_l2, capped(p, v[i]), span.elem(part, i), tc) : 0.f;
        store_chunk(span, part, gdst, false, v);
      }
    }
    // The next row's reduction reuses `red`; block_online's trailing barrier already orders that.
  }
}

template <typename T>
__global__ void __launch_bounds__(kStreamingThreads) scale_rows_kernel(char* grad, const RowLayout rows, int64_t n_rows,
                                                                       int64_t vocab, const float* scale, int per_row) {
  constexpr int kVec = Vec<T>::kN;
  // The common case, one upstream gradient of 1.0, costs one read per CTA.
  if (!per_row && scale[0] == 1.f) return;
  for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x) {
    const float f = scale[per_row ? row : 0];
    if (f == 1.f) continue;  // rows of upstream gradient 1.0 cost nothing but this read
    char* dst = grad + rows.offset(row) * static_cast<int64_t>(sizeof(T));
    const ChunkSpan<T> span(dst, vocab);
    for (int64_t q = threadIdx.x; q < span.nchunks; q += blockDim.x) {
      float v[kVec];
      load_chunk(span, q, span.chunk_ptr(q), v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[i] *= f;
      store_chunk(span, q, dst, true, v);
    }
  }
}

int grid_for(int64_t n_rows, int sm_count) {
  // Enough CTAs for 8 per SM (2048 threads), each looping over rows.
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n_rows, static_cast<int64_t>(sm_count) * 8)));
}

template <typename T>
void streaming_typed(const KernelParams& p, bool with_lse, int sm_count, cudaStream_t stream) {
  const int grid = grid_for(p.n_rows, sm_count);
  const bool general = p.softcap > 0.f || p.eps != 0.f;
  const auto kernel = with_lse ? (general ? streaming_kernel<T, true, true> : streaming_kernel<T, false, true>)
                               : (general ? streaming_kernel<T, true, false> : streaming_kernel<T, false, false>);
  launch_kernel("launch of cross-entropy streaming kernel", kernel, dim3(grid), dim3(kStreamingThreads), 0, stream, p);
}

}  // namespace

void launch_streaming(DType dtype, const KernelParams& p, bool with_lse, int sm_count, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return streaming_typed<float>(p, with_lse, sm_count, stream);
    case DType::kFloat16:
      return streaming_typed<__half>(p, with_lse, sm_count, stream);
    case DType::kBFloat16:
      return streaming_typed<__nv_bfloat16>(p, with_lse, sm_count, stream);
    default:
      throw_invalid("logits: unsupported dtype");
  }
}

void launch_scale_rows(DType dtype, char* grad, const RowLayout& rows, int64_t n_rows, int64_t vocab,
                       const float* scale, bool per_row, int sm_count, cudaStream_t stream) {
  void (*kernel)(char*, RowLayout, int64_t, int64_t, const float*, int) = nullptr;
  switch (dtype) {
    case DType::kFloat32:
      kernel = scale_rows_kernel<float>;
      break;
    case DType::kFloat16:
      kernel = scale_rows_kernel<__half>;
      break;
    case DType::kBFloat16:
      kernel = scale_rows_kernel<__nv_bfloat16>;
      break;
    default:
      throw_invalid("grad: unsupported dtype");
  }
  launch_kernel("launch of scale_rows kernel", kernel, dim3(grid_for(n_rows, sm_count)), dim3(kStreamingThreads), 0,
                stream, grad, rows, n_rows, vocab, scale, per_row ? 1 : 0);
}

}  // namespace logitless::ce
