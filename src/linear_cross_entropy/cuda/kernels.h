// Launchers of the linear cross-entropy's own kernels (the GEMMs are cuBLAS's, the row statistics the
// cross-entropy family's). All take the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include "linear_cross_entropy/cuda/params.h"

namespace logitless::lce {

// One CTA: copies the targets to contiguous int64, sums the mean's denominator, finds the first bad target.
void launch_prepass(const PrepassParams& p, cudaStream_t stream);

// logits[r, c] = bias[col0 + c] for r < rows, c < width: the GEMM then adds the product (beta = 1).
void launch_fill_bias(float* logits, int64_t ld, int64_t rows, int64_t width, const void* bias, DType bias_dtype,
                      int64_t bias_stride, int64_t col0, int sm_count, cudaStream_t stream);

// d(loss)/d(logits) of a chunk (see GradParams), into p.dlogits in `out_dtype`, and its column sums.
void launch_grad(const GradParams& p, DType out_dtype, cudaStream_t stream);

// out[c] = (acc ? acc[c] : 0) + sum over r of partial[r, c] for c < width, in a fixed order. With `acc` the
// sum goes back to acc (float32); otherwise to out (dtype, stride).
void launch_column_sums(const float* partial, int64_t partial_rows, int64_t ld, int64_t width, float* acc, void* out,
                        DType out_dtype, int64_t out_stride, cudaStream_t stream);

// dst[r * dst_ld + c * dst_col_stride] = src[r * src_ld + c] (float32 -> dtype), times row_scale[r] when given;
// src nullptr: zeros. dst may be src itself (float32, same layout).
void launch_cast(const float* src, int64_t src_ld, int64_t rows, int64_t cols, void* dst, DType dst_dtype,
                 int64_t dst_ld, int64_t dst_col_stride, int sm_count, cudaStream_t stream,
                 const float* row_scale = nullptr);

// dst [n, h] contiguous = the rows of src (any collapsed layout), elements of `elem_bytes`.
void launch_copy_rows(const void* src, const RowLayout& rows, int64_t n, int64_t h, int elem_bytes, void* dst,
                      int sm_count, cudaStream_t stream);

// The rows' loss and lse from the fused forward's tile statistics partials [rows, tiles, 4] (kernels_hopper.h): one
// warp per row combines its tiles as a vocabulary-parallel finalize combines shards
// (include/logitless/vocab_parallel.h) and applies the cross-entropy's row loss. target_logit: the rows' target logits,
// or nullptr to take them from the partials. lse and z_rows (the rows' z-loss terms) may be nullptr. ce: the row kinds,
// class weights and options.
void launch_finish_rows(const float* partials, int64_t rows, int64_t tiles, const int64_t* target,
                        const float* target_logit, const ce::KernelParams& ce, const Scalars* scalars, float* loss,
                        float* lse, float* z_rows, int sm_count, cudaStream_t stream);

// The gradient in forward's fused path (ExpGradParams, kernels_exp_grad.cu). Before the logits GEMM: shift[r] = the
// target's logit (0 for rows without one). After it and launch_finish_rows: every row's scale, the target's
// element of E and the scaled hidden row, or (the rows the scaled form does not suit) a rewrite of the row.
void launch_target_shift(const ExpGradParams& p, int sm_count, cudaStream_t stream);
void launch_exp_rows(const ExpGradParams& p, int sm_count, cudaStream_t stream);

// loss[0] = sum of row_loss[0, n) (in double, fixed order) * scalars->inv_denom; 0 for n = 0. With row_z (the rows'
// z-loss terms, which row_loss includes): those terms times scalars->inv_count instead.
void launch_reduce_loss(const float* row_loss, const float* row_z, int64_t n, const Scalars* scalars, float* loss,
                        cudaStream_t stream);

}  // namespace logitless::lce
