// The gradient of a chunk of float32 logits for the linear policy loss and selective log-softmax. One thread owns
// a group of kGradCols adjacent classes over the rows of a row block, with their column sums in registers (the
// bias gradient's partials), as the linear cross-entropy's gradient kernel does: the column logic is the
// linear head's grad_columns.h; the per-row part differs (a token's coefficient instead of the cross-entropy's, the
// temperature, positions that are no token).
#include <algorithm>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda/check.cuh"
#include "common/cuda/chunks.cuh"
#include "linear_head/cuda/dtype_io.cuh"
#include "linear_head/cuda/grad_columns.h"
#include "linear_head/cuda/plan.h"
#include "linear_policy_loss/cuda/kernels.h"
#include "policy_loss/cuda/tokens.cuh"

namespace logitless::lpl {
namespace {

constexpr int kThreads = 256;
using head::kGradCols;
using head::kGradRowsPerBlock;

using pl::token_id;
using pl::token_weight;

template <typename T>
__device__ __forceinline__ void store1(void* row, int64_t c, float v) {
  if constexpr (std::is_same_v<T, float>) {
    static_cast<float*>(row)[c] = v;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    static_cast<__nv_bfloat16*>(row)[c] = __float2bfloat16_rn(v);
  } else {
    static_cast<__half*>(row)[c] = __float2half_rn(v);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) grad_kernel(const __grid_constant__ GradParams p) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kGradCols;
  if (c >= p.vocab) return;
  const uint32_t mask = head::grad_slot_mask(c, p.vocab);
  const int64_t row_blocks = (p.rows + kGradRowsPerBlock - 1) / kGradRowsPerBlock;
  for (int64_t rb = blockIdx.y; rb < row_blocks; rb += gridDim.y) {
    float colsum[kGradCols] = {0.f, 0.f, 0.f, 0.f};
    const int64_t r1 = min(p.rows, (rb + 1) * kGradRowsPerBlock);
    for (int64_t r = rb * kGradRowsPerBlock; r < r1; ++r) {
      const int64_t pos = p.row0 + r, b = pos / p.row_len, l = pos - b * p.row_len;
      float v[kGradCols];
      float fill = 0.f;  // masked tokens and the unused position: 0, never read
      bool read = false;
      int64_t id = 0, t = 0;
      if (l < p.seq_len) {
        t = b * p.seq_len + l;
        if (token_weight(p, t) != 0.f) {
          id = token_id(p, t);
          read = id >= 0 && id < p.vocab;
          fill = NAN;  // a bad id (unchecked): NaN row
        }
      }
      if (read) {
        const float* src = p.logits + r * p.ld_logits + c;
        const float k = -p.coeff[t] * p.inv_temp;  // grad_j = k p_j - [j == id] k
        const float lse_l2 = p.lse[t] * kLog2e;
        // 16-byte aligned: ld_logits is a multiple of 8 columns, c of 4, and the chunk buffers 256-byte aligned.
        head::grad_group_values(
            mask,
            [&](float* x) {
              const float4 x4 = *reinterpret_cast<const float4*>(src);
              x[0] = x4.x, x[1] = x4.y, x[2] = x4.z, x[3] = x4.w;
            },
            [&](int i) { return src[i]; },
            [&](float x, int i) {
              const float d = k * fast_exp2(fmaf(x, p.scale_l2, -lse_l2));
              return c + i == id ? d - k : d;
            },
            v);
      } else {
        head::grad_group_fill(mask, fill, v);
      }
      T* dst = static_cast<T*>(p.dlogits) + r * p.ld_dlogits;
      head::grad_group_store(
          mask, v, [&](const float* w) { head::store4<T>(dst, c, w); },
          [&](int i, float w) { store1<T>(dst, c + i, w); }, colsum);
    }
    if (p.db_partial) head::grad_group_store_sums(mask, colsum, p.db_partial + rb * p.ld_logits + c);
  }
}

template <typename T>
void grad_typed(const GradParams& p, cudaStream_t stream) {
  const int64_t col_blocks = (p.vocab + kThreads * kGradCols - 1) / (kThreads * kGradCols);
  const int64_t row_blocks = (p.rows + kGradRowsPerBlock - 1) / kGradRowsPerBlock;
  const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(std::min<int64_t>(row_blocks, 65535)));
  grad_kernel<T><<<grid, kThreads, 0, stream>>>(p);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear policy-loss gradient kernel");
}

}  // namespace

void launch_grad(const GradParams& p, DType out_dtype, cudaStream_t stream) {
  if (p.rows == 0 || p.vocab == 0) return;
  switch (out_dtype) {
    case DType::kFloat32:
      return grad_typed<float>(p, stream);
    case DType::kFloat16:
      return grad_typed<__half>(p, stream);
    case DType::kBFloat16:
      return grad_typed<__nv_bfloat16>(p, stream);
    default:
      throw_invalid("linear policy-loss gradient: unsupported dtype");
  }
}

}  // namespace logitless::lpl
