// Launchers of the linear head's shared kernels (the GEMMs are cuBLAS's; the per-row statistics and the gradient of
// the logits belong to each loss). All take the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/layout.h"
#include "cross_entropy/cuda/params.h"
#include "logitless/tensor.h"

namespace logitless::head {

// logits[r, c] = bias[col0 + c] for r < rows, c < width: the GEMM then adds the product (beta = 1).
void launch_fill_bias(float* logits, int64_t ld, int64_t rows, int64_t width, const void* bias, DType bias_dtype,
                      int64_t bias_stride, int64_t col0, int sm_count, cudaStream_t stream);

// out[c] = (acc ? acc[c] : 0) + sum over r of partial[r, c] for c < width, in a fixed order. With `acc` the
// sum goes back to acc (float32); otherwise to out (dtype, stride).
void launch_column_sums(const float* partial, int64_t partial_rows, int64_t ld, int64_t width, float* acc, void* out,
                        DType out_dtype, int64_t out_stride, cudaStream_t stream);

// dst[r * dst_ld + c * dst_col_stride] = src[r * src_ld + c] (float32 -> dtype); src nullptr: zeros. dst may be
// src itself (float32, same layout).
void launch_cast(const float* src, int64_t src_ld, int64_t rows, int64_t cols, void* dst, DType dst_dtype,
                 int64_t dst_ld, int64_t dst_col_stride, int sm_count, cudaStream_t stream);

// dst [n, h] contiguous = the rows of src (any collapsed layout), elements of `elem_bytes`.
void launch_copy_rows(const void* src, const RowLayout& rows, int64_t n, int64_t h, int elem_bytes, void* dst,
                      int sm_count, cudaStream_t stream);

// loss[0] = sum of row_loss[0, n) (in double, fixed order) * scalars->inv_denom; 0 for n = 0. With row_z (the rows'
// z-loss terms, which row_loss includes): those terms times scalars->inv_count instead.
void launch_reduce_loss(const float* row_loss, const float* row_z, int64_t n, const ce::Scalars* scalars, float* loss,
                        cudaStream_t stream);

}  // namespace logitless::head
