// The linear cross-entropy's own kernels: everything between the cuBLAS GEMMs that is not the cross-entropy
// family's row statistics. The per-element gradient is the family's (cross_entropy/math.h, device.cuh), applied
// to a chunk of float32 logits that may be a slice of the vocabulary (the recompute backward's chunks), which
// the family's row kernels, written for whole rows, cannot take.
#include <algorithm>
#include <type_traits>

#include "common/cuda/check.cuh"
#include "cross_entropy/cuda/device.cuh"
#include "linear_cross_entropy/cuda/dtype_io.cuh"
#include "linear_cross_entropy/cuda/grad_columns.h"
#include "linear_cross_entropy/cuda/kernels.h"
#include "linear_cross_entropy/cuda/plan.h"

namespace logitless::lce {
namespace {

constexpr int kReduceThreads = 1024;
constexpr int kGradThreads = 256;
constexpr int kEltThreads = 256;

// Fixed thread count and per-thread order: the sums come out bit-identical on every run.
__global__ void __launch_bounds__(kReduceThreads) prepass_kernel(const PrepassParams p) {
  __shared__ double sh_d[kReduceThreads / 32], sh_w[kReduceThreads / 32];
  __shared__ long long sh_b[kReduceThreads / 32], sh_c[kReduceThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  double denom = 0, wsum = 0;
  long long bad = p.n, count = 0;
  for (int64_t i = tid; i < p.n; i += blockDim.x) {
    const int64_t off = p.target_rows.offset(i);
    const int64_t t = p.target_is64 ? static_cast<const int64_t*>(p.target)[off]
                                    : static_cast<int64_t>(static_cast<const int32_t*>(p.target)[off]);
    p.targets_out[i] = t;
    if (t == p.ignore_index) continue;
    if (t < 0 || t >= p.vocab) {
      bad = min(bad, static_cast<long long>(i));  // i grows per thread: the first is the smallest
      continue;
    }
    denom += p.class_weight ? static_cast<double>(p.class_weight[t * p.class_weight_stride]) : 1.0;
    ++count;
  }
  if (p.need_weight_sum)
    for (int64_t j = tid; j < p.vocab; j += blockDim.x) wsum += p.class_weight[j * p.class_weight_stride];
  for (int o = 16; o > 0; o >>= 1) {
    denom += __shfl_xor_sync(0xFFFFFFFFu, denom, o);
    wsum += __shfl_xor_sync(0xFFFFFFFFu, wsum, o);
    bad = min(bad, __shfl_xor_sync(0xFFFFFFFFu, bad, o));
    count += __shfl_xor_sync(0xFFFFFFFFu, count, o);
  }
  if (lane == 0) sh_d[warp] = denom, sh_w[warp] = wsum, sh_b[warp] = bad, sh_c[warp] = count;
  __syncthreads();
  if (tid == 0) {
    double d = 0, w = 0;
    long long b = p.n, c = 0;
    for (int i = 0; i < kReduceThreads / 32; ++i) d += sh_d[i], w += sh_w[i], b = min(b, sh_b[i]), c += sh_c[i];
    p.scalars->inv_denom = p.mean ? (d != 0 ? static_cast<float>(1.0 / d) : 0.f) : 1.f;
    p.scalars->inv_count = p.mean ? (c != 0 ? static_cast<float>(1.0 / static_cast<double>(c)) : 0.f) : 1.f;
    p.scalars->weight_sum = p.need_weight_sum ? static_cast<float>(w) : static_cast<float>(p.vocab);
    p.scalars->first_bad = b;
  }
}

__global__ void fill_bias_kernel(float* logits, int64_t ld, int64_t rows, int64_t width, const void* bias, DType bdt,
                                 int64_t bstride, int64_t col0) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < width;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x)
      logits[r * ld + c] = load_as_float(bias, bdt, (col0 + c) * bstride);
}

template <typename T>
inline constexpr DType kDTypeOf = std::is_same_v<T, float>    ? DType::kFloat32
                                  : std::is_same_v<T, __half> ? DType::kFloat16
                                                              : DType::kBFloat16;

// Four gradient values to dlogits (16-byte aligned for float32, 8-byte for 16-bit: the row lengths are
// multiples of 8 and the chunk buffers 256-byte aligned).
template <typename T>
__device__ __forceinline__ void store4(void* row, int64_t c, const float* v) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float4*>(static_cast<float*>(row) + c) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    uint2 u;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]), b = __floats2bfloat162_rn(v[2], v[3]);
      u = make_uint2(*reinterpret_cast<uint32_t*>(&a), *reinterpret_cast<uint32_t*>(&b));
    } else {
      __half2 a = __floats2half2_rn(v[0], v[1]), b = __floats2half2_rn(v[2], v[3]);
      u = make_uint2(*reinterpret_cast<uint32_t*>(&a), *reinterpret_cast<uint32_t*>(&b));
    }
    *reinterpret_cast<uint2*>(static_cast<T*>(row) + c) = u;
  }
}

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
  const uint32_t mask = grad_slot_mask(c, p.width);
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
          grad_group_values(
              mask, load_full, load_one,
              [&](float x, int k) { return ce::grad_elem(p.ce, g, lse_l2, ce::capped(p.ce, x), j0 + k, tc); }, v);
        } else {
          grad_group_values(
              mask, load_full, load_one,
              [&](float x, int k) {
                const float d = g.a * ce::fast_exp2(fmaf(x, ce::kLog2e, -lse_l2));
                return j0 + k == tc ? d - g.b : d;
              },
              v);
        }
      } else {
        // Ignored tokens have gradient 0; a bad target (unchecked) makes its row NaN, as in the cross-entropy.
        grad_group_fill(mask, kind == ce::RowKind::kBad ? NAN : 0.f, v);
      }
      T* dst = static_cast<T*>(p.dlogits) + r * p.ld_dlogits;
      grad_group_store(
          mask, v, [&](const float* w) { store4<T>(dst, c, w); },
          [&](int k, float w) { store_as(dst, kDTypeOf<T>, c + k, w); }, colsum);
    }
    if (p.db_partial) grad_group_store_sums(mask, colsum, p.db_partial + rb * p.ld_logits + c);
  }
}

__global__ void column_sums_kernel(const float* partial, int64_t partial_rows, int64_t ld, int64_t width, float* acc,
                                   void* out, DType odt, int64_t ostride) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < width;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = acc ? acc[c] : 0.f;
    for (int64_t r = 0; r < partial_rows; ++r) s += partial[r * ld + c];
    if (acc) {
      acc[c] = s;
    } else {
      store_as(out, odt, c * ostride, s);
    }
  }
}

__global__ void cast_kernel(const float* src, int64_t src_ld, int64_t rows, int64_t cols, void* dst, DType ddt,
                            int64_t dst_ld, int64_t dst_cs, const float* row_scale) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float s = row_scale ? row_scale[r] : 1.f;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x)
      store_as(dst, ddt, r * dst_ld + c * dst_cs, src ? s * src[r * src_ld + c] : 0.f);
  }
}

// The cast's common case: float32 rows into contiguous rows of T (16-bit or float32), four elements per thread
// (a 16-byte load, an 8- or 16-byte store), which the element-wise kernel above reaches only at half the
// bandwidth. Rows of cols % 4 == 0 elements, src_ld and dst_ld multiples of 4, both pointers aligned to 16 bytes.
template <typename T>
__global__ void cast4_kernel(const float* src, int64_t src_ld, int64_t rows, int64_t cols, T* dst, int64_t dst_ld,
                             const float* row_scale) {
  const int64_t quads = cols / 4;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float s = row_scale ? row_scale[r] : 1.f;
    const float4* in = reinterpret_cast<const float4*>(src + r * src_ld);
    T* out = dst + r * dst_ld;
    for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < quads;
         q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const float4 v = in[q];
      if constexpr (std::is_same_v<T, float>) {
        reinterpret_cast<float4*>(out)[q] = make_float4(s * v.x, s * v.y, s * v.z, s * v.w);
      } else {
        uint2 w;
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
          const __nv_bfloat162 a = __floats2bfloat162_rn(s * v.x, s * v.y), b = __floats2bfloat162_rn(s * v.z, s * v.w);
          w = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
        } else {
          const __half2 a = __floats2half2_rn(s * v.x, s * v.y), b = __floats2half2_rn(s * v.z, s * v.w);
          w = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
        }
        reinterpret_cast<uint2*>(out)[q] = w;
      }
    }
  }
}

template <typename E>
__global__ void copy_rows_kernel(const E* src, const RowLayout rows, int64_t n, int64_t h, E* dst) {
  for (int64_t r = blockIdx.y; r < n; r += gridDim.y) {
    const int64_t off = rows.offset(r);
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < h;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x)
      dst[r * h + c] = src[off + c];
  }
}

__global__ void finish_rows_kernel(const float4* partials, int64_t rows, int64_t tiles, const int64_t* target,
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
    const float4* row = partials + r * tiles;
    float m = -INFINITY, s = 0.f, xt = 0.f, swx = 0.f;
    for (int64_t j = lane; j < tiles; j += 32) m = ce::max_nan(m, row[j].x);
    m = ce::warp_max(m);
    for (int64_t j = lane; j < tiles; j += 32) {
      const float4 q = row[j];
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

__global__ void __launch_bounds__(kReduceThreads)
    reduce_loss_kernel(const float* row_loss, const float* row_z, int64_t n, const Scalars* scalars, float* loss) {
  __shared__ double sh[kReduceThreads / 32], sh_z[kReduceThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  double s = 0, sz = 0;
  for (int64_t i = tid; i < n; i += blockDim.x) {
    s += row_loss[i];
    if (row_z) sz += row_z[i];
  }
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    sz += __shfl_xor_sync(0xFFFFFFFFu, sz, o);
  }
  if (lane == 0) sh[warp] = s, sh_z[warp] = sz;
  __syncthreads();
  if (tid == 0) {
    double total = 0, total_z = 0;
    for (int i = 0; i < kReduceThreads / 32; ++i) total += sh[i], total_z += sh_z[i];
    // The z-loss terms (held apart only where their divisor differs) over the count, the rest over the weights.
    const double out =
        row_z ? (total - total_z) * scalars->inv_denom + total_z * scalars->inv_count : total * scalars->inv_denom;
    loss[0] = n > 0 ? static_cast<float>(out) : 0.f;
  }
}

// A 2-D grid for (rows x cols) elementwise kernels: columns across threads and x-blocks, rows across y-blocks.
dim3 grid_2d(int64_t rows, int64_t cols, int sm_count) {
  const int64_t bx = std::max<int64_t>(1, std::min<int64_t>((cols + kEltThreads - 1) / kEltThreads, 64));
  const int64_t by =
      std::max<int64_t>(1, std::min<int64_t>({rows, 65535, (static_cast<int64_t>(sm_count) * 32 + bx - 1) / bx}));
  return dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by));
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

void launch_prepass(const PrepassParams& p, cudaStream_t stream) {
  prepass_kernel<<<1, kReduceThreads, 0, stream>>>(p);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy prepass");
}

void launch_fill_bias(float* logits, int64_t ld, int64_t rows, int64_t width, const void* bias, DType bias_dtype,
                      int64_t bias_stride, int64_t col0, int sm_count, cudaStream_t stream) {
  if (rows == 0 || width == 0) return;
  const dim3 grid = grid_2d(rows, width, sm_count);
  fill_bias_kernel<<<grid, kEltThreads, 0, stream>>>(logits, ld, rows, width, bias, bias_dtype, bias_stride, col0);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy bias fill");
}

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

void launch_column_sums(const float* partial, int64_t partial_rows, int64_t ld, int64_t width, float* acc, void* out,
                        DType out_dtype, int64_t out_stride, cudaStream_t stream) {
  if (width == 0) return;
  const int64_t blocks = std::min<int64_t>((width + kEltThreads - 1) / kEltThreads, 4096);
  column_sums_kernel<<<static_cast<unsigned>(blocks), kEltThreads, 0, stream>>>(partial, partial_rows, ld, width, acc,
                                                                                out, out_dtype, out_stride);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy column sums");
}

void launch_cast(const float* src, int64_t src_ld, int64_t rows, int64_t cols, void* dst, DType dst_dtype,
                 int64_t dst_ld, int64_t dst_col_stride, int sm_count, cudaStream_t stream, const float* row_scale) {
  if (rows == 0 || cols == 0) return;
  const auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (src && dst_col_stride == 1 && cols % 4 == 0 && src_ld % 4 == 0 && dst_ld % 4 == 0 && aligned16(src) &&
      aligned16(dst)) {
    const dim3 grid = grid_2d(rows, cols / 4, sm_count);
    switch (dst_dtype) {
      case DType::kBFloat16:
        cast4_kernel<<<grid, kEltThreads, 0, stream>>>(src, src_ld, rows, cols, static_cast<__nv_bfloat16*>(dst),
                                                       dst_ld, row_scale);
        break;
      case DType::kFloat16:
        cast4_kernel<<<grid, kEltThreads, 0, stream>>>(src, src_ld, rows, cols, static_cast<__half*>(dst), dst_ld,
                                                       row_scale);
        break;
      default:
        cast4_kernel<<<grid, kEltThreads, 0, stream>>>(src, src_ld, rows, cols, static_cast<float*>(dst), dst_ld,
                                                       row_scale);
        break;
    }
  } else {
    cast_kernel<<<grid_2d(rows, cols, sm_count), kEltThreads, 0, stream>>>(src, src_ld, rows, cols, dst, dst_dtype,
                                                                           dst_ld, dst_col_stride, row_scale);
  }
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy cast");
}

void launch_copy_rows(const void* src, const RowLayout& rows, int64_t n, int64_t h, int elem_bytes, void* dst,
                      int sm_count, cudaStream_t stream) {
  if (n == 0 || h == 0) return;
  const dim3 grid = grid_2d(n, h, sm_count);
  if (elem_bytes == 4) {
    copy_rows_kernel<uint32_t>
        <<<grid, kEltThreads, 0, stream>>>(static_cast<const uint32_t*>(src), rows, n, h, static_cast<uint32_t*>(dst));
  } else {
    copy_rows_kernel<uint16_t>
        <<<grid, kEltThreads, 0, stream>>>(static_cast<const uint16_t*>(src), rows, n, h, static_cast<uint16_t*>(dst));
  }
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy row copy");
}

void launch_finish_rows(const float* partials, int64_t rows, int64_t tiles, const int64_t* target,
                        const float* target_logit, const ce::KernelParams& ce, const Scalars* scalars, float* loss,
                        float* lse, float* z_rows, int sm_count, cudaStream_t stream) {
  if (rows <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((rows + kThreads / 32 - 1) / (kThreads / 32), int64_t{sm_count} * 8);
  finish_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(partials), rows, tiles, target, target_logit, ce, scalars, loss, lse, z_rows);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy fused row statistics");
}

void launch_reduce_loss(const float* row_loss, const float* row_z, int64_t n, const Scalars* scalars, float* loss,
                        cudaStream_t stream) {
  reduce_loss_kernel<<<1, kReduceThreads, 0, stream>>>(row_loss, row_z, n, scalars, loss);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy loss reduction");
}

}  // namespace logitless::lce
