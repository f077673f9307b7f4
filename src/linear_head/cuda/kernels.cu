// The linear head's shared kernels: everything between the GEMMs that does not depend on the loss.
#include "linear_head/cuda/kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "common/cuda/check.cuh"
#include "linear_head/cuda/dtype_io.cuh"

namespace logitless::head {
namespace {

constexpr int kReduceThreads = 1024;
constexpr int kEltThreads = 256;

__global__ void fill_bias_kernel(float* logits, int64_t ld, int64_t rows, int64_t width, const void* bias, DType bdt,
                                 int64_t bstride, int64_t col0) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < width;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x)
      logits[r * ld + c] = load_as_float(bias, bdt, (col0 + c) * bstride);
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
                            int64_t dst_ld, int64_t dst_cs) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x)
      store_as(dst, ddt, r * dst_ld + c * dst_cs, src ? src[r * src_ld + c] : 0.f);
  }
}

// The cast's common case: float32 rows into contiguous rows of T (16-bit or float32), four elements per thread
// (a 16-byte load, an 8- or 16-byte store), which the element-wise kernel above reaches only at half the
// bandwidth. Rows of cols % 4 == 0 elements, src_ld and dst_ld multiples of 4, both pointers aligned to 16 bytes.
template <typename T>
__global__ void cast4_kernel(const float* src, int64_t src_ld, int64_t rows, int64_t cols, T* dst, int64_t dst_ld) {
  const int64_t quads = cols / 4;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float4* in = reinterpret_cast<const float4*>(src + r * src_ld);
    T* out = dst + r * dst_ld;
    for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < quads;
         q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const float4 v = in[q];
      if constexpr (std::is_same_v<T, float>) {
        reinterpret_cast<float4*>(out)[q] = v;
      } else {
        uint2 w;
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
          const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
          w = make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
        } else {
          const __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
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

__global__ void __launch_bounds__(kReduceThreads)
    reduce_loss_kernel(const float* row_loss, const float* row_z, int64_t n, const ce::Scalars* scalars, float* loss) {
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

}  // namespace

void launch_fill_bias(float* logits, int64_t ld, int64_t rows, int64_t width, const void* bias, DType bias_dtype,
                      int64_t bias_stride, int64_t col0, int sm_count, cudaStream_t stream) {
  if (rows == 0 || width == 0) return;
  const dim3 grid = grid_2d(rows, width, sm_count);
  fill_bias_kernel<<<grid, kEltThreads, 0, stream>>>(logits, ld, rows, width, bias, bias_dtype, bias_stride, col0);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear head bias fill");
}

void launch_column_sums(const float* partial, int64_t partial_rows, int64_t ld, int64_t width, float* acc, void* out,
                        DType out_dtype, int64_t out_stride, cudaStream_t stream) {
  if (width == 0) return;
  const int64_t blocks = std::min<int64_t>((width + kEltThreads - 1) / kEltThreads, 4096);
  column_sums_kernel<<<static_cast<unsigned>(blocks), kEltThreads, 0, stream>>>(partial, partial_rows, ld, width, acc,
                                                                                out, out_dtype, out_stride);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear head column sums");
}

void launch_cast(const float* src, int64_t src_ld, int64_t rows, int64_t cols, void* dst, DType dst_dtype,
                 int64_t dst_ld, int64_t dst_col_stride, int sm_count, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (src && dst_col_stride == 1 && cols % 4 == 0 && src_ld % 4 == 0 && dst_ld % 4 == 0 && aligned16(src) &&
      aligned16(dst)) {
    const dim3 grid = grid_2d(rows, cols / 4, sm_count);
    switch (dst_dtype) {
      case DType::kBFloat16:
        cast4_kernel<<<grid, kEltThreads, 0, stream>>>(src, src_ld, rows, cols, static_cast<__nv_bfloat16*>(dst),
                                                       dst_ld);
        break;
      case DType::kFloat16:
        cast4_kernel<<<grid, kEltThreads, 0, stream>>>(src, src_ld, rows, cols, static_cast<__half*>(dst), dst_ld);
        break;
      default:
        cast4_kernel<<<grid, kEltThreads, 0, stream>>>(src, src_ld, rows, cols, static_cast<float*>(dst), dst_ld);
        break;
    }
  } else {
    cast_kernel<<<grid_2d(rows, cols, sm_count), kEltThreads, 0, stream>>>(src, src_ld, rows, cols, dst, dst_dtype,
                                                                           dst_ld, dst_col_stride);
  }
  LOGITLESS_CUDA_CHECK_LAUNCH("linear head cast");
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
  LOGITLESS_CUDA_CHECK_LAUNCH("linear head row copy");
}

void launch_reduce_loss(const float* row_loss, const float* row_z, int64_t n, const ce::Scalars* scalars, float* loss,
                        cudaStream_t stream) {
  reduce_loss_kernel<<<1, kReduceThreads, 0, stream>>>(row_loss, row_z, n, scalars, loss);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear head loss reduction");
}

}  // namespace logitless::head
